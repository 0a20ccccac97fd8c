// sparse_transformer: the factorised patterns of the Sparse Transformer, with block length
// l = `stride` and c = `summary`, on the aligned position a(i) = i + (m - n) (bottom-right
// aligned, like the causal mask). The paper splits each pattern over two heads (or
// interleaves them); here BOTH HEADS ARE COMBINED INTO ONE PATTERN, their union, so every
// head attends
//
//   strided: P(i) = { j : |a(i) - j| < l }  U  { j : (a(i) - j) mod l == 0 }
//   fixed:   P(i) = { j : floor(j / l) == floor(a(i) / l) }  U  { j : j mod l >= l - c }
//
// (mathematical floor and mod, so queries with a(i) < 0 when n > m see only the summary
// columns). Causal masking is applied by the engine: the local part becomes (a(i) - l, a(i)]
// and the stride part the earlier multiples, as in the paper; without it both sides count.
// Keys per row: about 2 l + m / l (strided), l + c m / l (fixed).
// Strided mode runs its two parts apart and merges them into one softmax: the band without
// the query's own key (|a(i) - j| < l, j != a(i)) on the block-sparse engine, and the stride
// part with it (every multiple of l) as the reshape of common/engines/strided_attention.h (a dense
// problem per residue class mod l); the parts are disjoint, so each row is their two results
// weighted by exp of their log-sum-exps (merge_attention); below n = 4 l (fewer than 4 queries
// per residue class) the union runs on the engine as one pattern instead. Work about
// O(n (2 l + 2 block + m / l) d), with O(B H n d) more memory for the second part's output.
// Fixed mode runs its pattern on the block-sparse engine, which scores whole tiles: the work is
// O(n m d), as for full attention, when l <= block and c > 0 (every tile holds a summary
// column), otherwise about O(n (l + m (c + block) / l) d).
// Memory O(threads block (block + d)); the pattern holds nothing. Training in strided mode runs
// the two parts' backward passes from the union's log-sum-exps (see backward below).
// Decode (generation): the pattern cache of common/decode/pattern_decode.h over the union, in both
// modes (fixed mode frees an l-block's plain keys once its queries have passed).
// Paper: Child, Gray, Radford, Sutskever, "Generating Long Sequences with Sparse
// Transformers" (2019); defaults l = 128, c = 32 as in OpenAI's blocksparse code.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/decode/pattern_decode.h"
#include "common/engines/block_sparse.h"
#include "common/engines/strided_attention.h"
#include "common/kernels/additive_score.h"
#include "common/patterns/strided_pattern.h"

namespace attnbench {
namespace {

class SparseTransformerPattern final : public AlignedBlockPattern {
 public:
  SparseTransformerPattern(int64_t n, int64_t m, bool fixed, int64_t l, int64_t c, int64_t block)
      : AlignedBlockPattern(n, m, block), fixed_(fixed), l_(l), c_(std::min(c, l)) {}

  void aligned_key_blocks(int64_t a0, int64_t a1, std::vector<KeyBlock>& out) const override {
    // Key ranges are added in increasing order of their first key; a block already listed
    // is not listed again. Nothing is allocated: the engine calls this in its inner loop.
    auto add_range = [&](int64_t lo, int64_t hi) {
      lo = std::max<int64_t>(lo, 0), hi = std::min(hi, m_ - 1);
      if (lo > hi) return;
      int64_t kb = lo / bs_;
      if (!out.empty()) kb = std::max(kb, out.back().index + 1);
      for (; kb <= hi / bs_; ++kb) {
        const int64_t j0 = kb * bs_, j1 = std::min(m_, j0 + bs_) - 1;
        out.push_back({kb, !full(a0, a1, j0, j1)});
      }
    };
    if (!fixed_) {
      // strided: the band [a0 - l + 1, a1 + l - 1] and the stride ranges [a0 - t l, a1 - t l]
      const int64_t band_lo = a0 - l_ + 1, band_hi = a1 + l_ - 1;
      if (a1 - a0 + 1 >= l_) {
        add_range(0, m_ - 1);  // every residue: the stride part alone covers every key
        return;
      }
      bool band = false;
      for (int64_t t = floor_div(a1, l_), tlo = ceil_div(a0 - (m_ - 1), l_); t >= tlo; --t) {
        if (!band && a0 - t * l_ >= band_lo) add_range(band_lo, band_hi), band = true;
        add_range(a0 - t * l_, a1 - t * l_);
      }
      if (!band) add_range(band_lo, band_hi);
      return;
    }
    // fixed: the rows' own l-blocks, and every key block holding a summary column (found by
    // jumping from one listed block to the first summary column past it: O(listed blocks))
    const int64_t own_lo = floor_div(a0, l_) * l_, own_hi = (floor_div(a1, l_) + 1) * l_ - 1;
    bool own = false;
    for (int64_t cur = 0; c_ > 0;) {
      const int64_t r = cur % l_;
      const int64_t j = r >= l_ - c_ ? cur : cur - r + (l_ - c_);
      if (j >= m_) break;
      if (!own && own_lo <= j) {
        add_range(own_lo, own_hi), own = true;
        if (!out.empty() && (out.back().index + 1) * bs_ > j) {  // j's block is listed now
          cur = (out.back().index + 1) * bs_;
          continue;
        }
      }
      add_range(j, j);
      cur = (j / bs_ + 1) * bs_;
    }
    if (!own) add_range(own_lo, own_hi);
  }

  void block_mask(int64_t, int64_t, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = i0 + r + off_, ab = floor_div(a, l_);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t j = j0 + c, x = a - j;
        mask[r * cols + c] =
            fixed_ ? (j / l_ == ab || j % l_ >= l_ - c_) : (std::llabs(x) < l_ || pmod(x, l_) == 0);
      }
    }
  }

 private:
  // True if some key of [lo, hi] is not a summary column (j mod l < l - c).
  bool has_plain_column(int64_t lo, int64_t hi) const {
    if (lo > hi) return false;
    if (c_ >= l_) return false;
    if (hi - lo + 1 > c_) return true;  // summary columns come in runs of c
    if (lo % l_ < l_ - c_) return true;
    return hi > lo - lo % l_ + l_ - 1;  // the run of lo ends with its l-block
  }

  // True if some difference of [lo, hi] is outside the local band and not a multiple of l.
  bool has_bad_difference(int64_t lo, int64_t hi) const {
    auto non_multiple = [&](int64_t u, int64_t v) {
      return u <= v && l_ > 1 && (v > u || pmod(u, l_) != 0);
    };
    return non_multiple(std::max(lo, l_), hi) || non_multiple(lo, std::min(hi, -l_));
  }

  // Every pair of rows [a0, a1] x keys [j0, j1] in the pattern?
  bool full(int64_t a0, int64_t a1, int64_t j0, int64_t j1) const {
    if (!fixed_) return !has_bad_difference(a0 - j1, a1 - j0);
    if (!has_plain_column(j0, j1)) return true;
    // plain columns need every row in their l-block: the rows must share one l-block U
    // and every plain column of the tile must lie in it
    const int64_t u = floor_div(a0, l_);
    if (floor_div(a1, l_) != u) return false;
    return !has_plain_column(j0, std::min(j1, u * l_ - 1)) &&
           !has_plain_column(std::max(j0, (u + 1) * l_), j1);
  }

  bool fixed_;
  int64_t l_, c_;
};

class SparseTransformer final : public FixedPatternVariant {
 public:
  SparseTransformer(bool fixed, int64_t l, int64_t c, int64_t block)
      : fixed_(fixed), l_(l), c_(c), block_(block) {}

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView,
                                              ConstTensorView) const override {
    return std::make_unique<SparseTransformerPattern>(p.n, p.keys(), fixed_, l_, c_, block_);
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    if (on_engine(p)) return PatternVariant::forward(p, q, k, v, out);
    bf16_note_ = bf16_engine_note(p, block_);  // both parts run on the engine
    std::vector<float> lse(size_t(p.batch * p.heads * p.n));
    run_parts(p, q, k, v, out, LseView{lse.data(), p.heads * p.n, p.n, 1});
  }

  // Strided mode's backward: with the merged rows' log-sum-exps L and the merged output, each
  // part's backward (the engine's over the band, the reshape's over the stride part) gives the
  // gradient of its own keys' probabilities exp(s - L), and D = dO . O is the union's; the two
  // parts' gradients add up.
  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    if (on_engine(p)) return PatternVariant::forward_train(p, q, k, v, out);
    auto saved = std::make_unique<LseSaved>(p);
    run_parts(p, q, k, v, out, saved->view(p));
    return saved;
  }
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    if (on_engine(p)) return PatternVariant::backward(p, q, k, v, out, dout, saved, dq, dk, dv);
    const LseView lse = LseSaved::of(saved, p, "sparse_transformer").view(p);
    block_sparse_attention_backward(p, q, k, v, out, dout, lse, band(p), dq, dk, dv);
    Tensor gq(p.q_shape()), gk(p.kv_shape()), gv(p.kv_shape());
    strided_attention_backward(p, q, k, v, out, dout, lse, gq.view(), gk.view(), gv.view(), l_, -1,
                               block_);
    add(p, gq.view(), dq, p.n);
    add(p, gk.view(), dk, p.keys());
    add(p, gv.view(), dv, p.keys());
  }
  double backward_flops(const Problem& p) const override {
    return on_engine(p) ? PatternVariant::backward_flops(p) : 2.5 * flops(p);
  }
  double saved_estimate(const Problem& p) const override {
    return on_engine(p) ? PatternVariant::saved_estimate(p) : LseSaved::bytes(p);
  }
  double backward_memory_estimate(const Problem& p) const override {
    if (on_engine(p)) return PatternVariant::backward_memory_estimate(p);
    // the larger part's backward, and the stride part's three gradients
    const double heads = double(p.batch * p.heads);
    return std::max(block_sparse_backward_memory(p, block_, listed_blocks(p, band(p))),
                    strided_attention_backward_memory(p, l_, -1, block_)) +
           heads * double(p.n + 2 * p.keys()) * double(p.dim) * sizeof(float);
  }

  double flops(const Problem& p) const override {
    if (on_engine(p)) return PatternVariant::flops(p);
    // the band's scores are the same in every head (and key padding is not counted, as for
    // the other patterns)
    const double band_scores = pattern_scores(p, band(p), 0, 0) * double(p.batch * p.heads);
    return (logit_flops(p) + 2.0 * double(p.dim)) *
           (band_scores + strided_attention_scores(p, l_, -1, block_));
  }

  double memory_estimate(const Problem& p) const override {
    if (on_engine(p)) return PatternVariant::memory_estimate(p);
    const double rows = double(p.batch * p.heads * p.n);
    return std::max(block_sparse_memory(p, block_), strided_attention_memory(p, l_, block_)) +
           rows * (double(p.dim) + 2.0) * sizeof(float);
  }

 private:
  // Whether the whole pattern runs on the engine as one: fixed mode always; strided mode when
  // a residue class mod l holds fewer than 4 queries (n < 4 l), where the classes' dense
  // problems are too small to pay for their dispatch and the union's tiles are nearly all
  // visited anyway (B = 1, H = 8, d = 64, l = 128 on 2 cores: at n = 256 the union took 2.5 ms
  // and the two parts 3.1; at n = 512 the union 9.5 ms and the parts 6.9). And with an
  // attention mask: merging the parts' float log-sum-exps loses log of each part's sum beside
  // a huge row max (a row masked wholly by -FLT_MAX), where the engine keeps the max apart.
  bool on_engine(const Problem& p) const { return fixed_ || p.n < 4 * l_ || p.attn_mask; }

  // Strided mode's two parts: the band without the own key into out, with its rows'
  // log-sum-exps in lse, the stride part (own key included) into a buffer with its own, then
  // merged into one softmax over the union (lse then holds the union's).
  void run_parts(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                 TensorView out, const LseView& lse) const {
    std::vector<float> other(size_t(p.batch * p.heads * p.n));
    const LseView stride_lse{other.data(), p.heads * p.n, p.n, 1};
    block_sparse_attention(p, q, k, v, out, band(p), &lse);
    // every row is written (rows that see no key as 0), so the buffer needs no clearing
    const auto buf = std::make_unique_for_overwrite<float[]>(size_t(p.q_shape().numel()));
    const TensorView strided(buf.get(), p.q_shape());
    strided_attention(p, q, k, v, strided, l_, -1, block_, &stride_lse);
    merge_attention(p, out, lse, strided, stride_lse);
  }

  // dst += src over rows rows of every head
  static void add(const Problem& p, ConstTensorView src, TensorView dst, int64_t rows) {
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < p.batch * p.heads; ++bh)
      for (int64_t i = 0; i < rows; ++i) {
        const float* x = src.row(bh / p.heads, bh % p.heads, i);
        float* y = dst.row(bh / p.heads, bh % p.heads, i);
        for (int64_t c = 0; c < p.dim; ++c) y[c] += x[c];
      }
  }

  // strided mode's band part: |a(i) - j| <= l - 1, j != a(i)
  StridedPattern band(const Problem& p) const {
    return StridedPattern(p.n, p.keys(), 1, l_ - 1, 1, block_);
  }

  bool fixed_;
  int64_t l_, c_, block_;
};

ATTNBENCH_REGISTER_VARIANT(
    sparse_transformer,
    VariantInfo{
        .name = "sparse_transformer",
        .summary = "Sparse Transformer, both heads of a pattern in one: strided (band + stride) "
                   "or fixed (own block + summary columns)",
        .complexity = "time O(n (2 l + 2 block + m / l) d) strided (band on the engine, stride as "
                      "a dense problem per residue class), O(n (l + m (c + block) / l) d) fixed "
                      "(O(n m d) when l <= block and c > 0); memory O(threads block (block + d)), "
                      "strided O(B H n d) more",
        .family = "pattern",
        .display = "Sparse Transformer",
        .paper = "Child et al. 2019 (arXiv:1904.10509)",
        .look = {.color = "#9467bd", .marker = "<"},
        .params = {ParamSpec::Choice("mode", "strided", {"strided", "fixed"},
                                     "strided: |a(i)-j| < l or (a(i)-j) mod l == 0; fixed: same "
                                     "l-block or j mod l >= l - c"),
                   ParamSpec::Int("stride", 128, 1, int64_t(1) << 30,
                                  "the paper's block length l (band width and stride)"),
                   ParamSpec::Int("summary", 32, 0, int64_t(1) << 30,
                                  "fixed mode: summary columns c at the end of each l-block"),
                   block_param()},
        .caps = {.causal = true,
                 .cross = true,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true,
                 .bf16 = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<SparseTransformer>(v.get_choice("mode") == "fixed",
                                                     v.get_int("stride"), v.get_int("summary"),
                                                     v.get_int("block"));
        }});

}  // namespace
}  // namespace attnbench
