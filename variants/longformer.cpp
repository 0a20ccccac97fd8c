// longformer: a (optionally dilated) sliding window plus symmetric global tokens. With the
// aligned position a(i) = i + (m - n) (bottom-right aligned, like the causal mask), head h
// with dilation D_h attends
//
//   P_h(i) = all keys                                        if 0 <= a(i) < g  (global query)
//          = { j < g }  U  { a(i) + t D_h : |t| <= window }   otherwise
//
// i.e. the window holds the keys j with |a(i) - j| <= window D_h and (a(i) - j) mod D_h == 0:
// `window` keys on EACH side (one side; Longformer's attention_window = 512 is window = 256
// here). The global tokens are the first g key positions; a key that is both global and in
// the window counts once (the pattern is a set). D_h = `dilation` for every head if
// dilated_heads = 0, else for heads h < dilated_heads only, the others using D_h = 1 (the
// paper dilates 2 heads of the upper layers). Causal masking is applied by the engine.
// Time O(n (2 window + 1 + g) d + g m d); memory O(threads block (block + d)); the pattern
// holds nothing.
// Decode (generation): the pattern cache of common/decode/pattern_decode.h, the global keys and the
// window's blocks around the query (older blocks are freed).
// Paper: Beltagy, Peters, Cohan, "Longformer: The Long-Document Transformer" (2020).
#include <algorithm>
#include <cstdlib>
#include <memory>

#include "common/decode/pattern_decode.h"
#include "common/engines/block_sparse.h"

namespace attnbench {
namespace {

class LongformerPattern final : public SparsePattern {
 public:
  LongformerPattern(int64_t n, int64_t m, int64_t window, int64_t dilation, int64_t dilated_heads,
                    int64_t global, int64_t block)
      : n_(n),
        m_(m),
        off_(m - n),
        w_(window),
        dil_(dilation),
        dheads_(dilated_heads),
        g_(std::min(global, m)),
        bs_(block) {}

  int64_t block() const override { return bs_; }

  void key_blocks(int64_t, int64_t h, int64_t qb, std::vector<KeyBlock>& out) const override {
    out.clear();
    const int64_t i0 = qb * bs_, i1 = std::min(n_, i0 + bs_);
    if (i0 < 0 || i0 >= i1) return;
    const int64_t a0 = i0 + off_, a1 = i1 - 1 + off_, d = dilation(h);
    // Every pair of the tile allowed? Global rows are, and every row allows the global keys;
    // what is left, the plain rows (a < 0 or a >= g) x the keys >= g, must be in the window.
    auto full = [&](int64_t j0, int64_t j1) {
      const int64_t k0 = std::max(j0, g_);
      return window_full(a0, std::min(a1, int64_t(-1)), k0, j1, d) &&
             window_full(std::max(a0, g_), a1, k0, j1, d);
    };
    if (std::max<int64_t>(a0, 0) <= std::min(a1, g_ - 1)) {
      // a global row attends every key block
      for (int64_t kb = 0; kb * bs_ < m_; ++kb)
        out.push_back({kb, !full(kb * bs_, std::min(m_, kb * bs_ + bs_) - 1)});
      return;
    }
    // the global key blocks first, then the window's blocks past them
    for (int64_t kb = 0; kb * bs_ < g_; ++kb)
      out.push_back({kb, !full(kb * bs_, std::min(m_, kb * bs_ + bs_) - 1)});
    // row a attends j = a - t d for |t| <= w; the t whose keys [a0 - t d, a1 - t d] meet [0, m)
    const int64_t tlo = std::max(-w_, ceil_div(a0 - (m_ - 1), d)),
                  thi = std::min(w_, floor_div(a1, d));
    auto add_range = [&](int64_t lo, int64_t hi) {
      lo = std::max<int64_t>(lo, 0), hi = std::min(hi, m_ - 1);
      if (lo > hi) return;
      int64_t kb = lo / bs_;
      if (!out.empty()) kb = std::max(kb, out.back().index + 1);
      for (; kb <= hi / bs_; ++kb)
        out.push_back({kb, !full(kb * bs_, std::min(m_, kb * bs_ + bs_) - 1)});
    };
    if (tlo > thi) return;
    if (a1 - a0 + 1 >= d) {
      add_range(a0 - thi * d, a1 - tlo * d);  // every residue: one contiguous range
    } else {
      for (int64_t t = thi; t >= tlo; --t) add_range(a0 - t * d, a1 - t * d);
    }
  }

  void block_mask(int64_t, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    const int64_t d = dilation(h), span = w_ * d;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = i0 + r + off_;
      const bool global_row = a >= 0 && a < g_;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t j = j0 + c, x = a - j;
        mask[r * cols + c] = global_row || j < g_ || (std::llabs(x) <= span && pmod(x, d) == 0);
      }
    }
  }

 private:
  int64_t dilation(int64_t h) const { return dheads_ == 0 || h < dheads_ ? dil_ : 1; }

  // Every pair of rows [alo, ahi] x keys [jlo, jhi] in the (dilated) window? True if empty.
  bool window_full(int64_t alo, int64_t ahi, int64_t jlo, int64_t jhi, int64_t d) const {
    if (alo > ahi || jlo > jhi) return true;
    const int64_t xlo = alo - jhi, xhi = ahi - jlo;  // the tile's differences fill [xlo, xhi]
    return (d == 1 || (xlo == xhi && pmod(xlo, d) == 0)) && xlo >= -w_ * d && xhi <= w_ * d;
  }

  int64_t n_, m_, off_, w_, dil_, dheads_, g_, bs_;
};

class Longformer final : public FixedPatternVariant {
 public:
  Longformer(int64_t window, int64_t dilation, int64_t dilated_heads, int64_t global, int64_t block)
      : window_(window),
        dilation_(dilation),
        dilated_heads_(dilated_heads),
        global_(global),
        block_(block) {}

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView,
                                              ConstTensorView) const override {
    return std::make_unique<LongformerPattern>(p.n, p.keys(), window_, dilation_, dilated_heads_,
                                               global_, block_);
  }

 private:
  int64_t window_, dilation_, dilated_heads_, global_, block_;
};

ATTNBENCH_REGISTER_VARIANT(
    longformer,
    VariantInfo{
        .name = "longformer",
        .summary = "sliding window (dilated per head) + the first g tokens global both ways",
        .complexity = "time O(n (2 window + 1 + g) d + g m d), memory O(threads block (block + d))",
        .family = "pattern",
        .display = "Longformer",
        .paper = "Beltagy et al. 2020 (arXiv:2004.05150)",
        .look = {.color = "#2ca02c", .marker = "P"},
        .params =
            {ParamSpec::Int("window", 256, 0, int64_t(1) << 30,
                            "keys on EACH side of the query (one side; both sides = 2 window + 1)"),
             ParamSpec::Int("dilation", 1, 1, int64_t(1) << 20,
                            "window keys are a(i) + t dilation, |t| <= window"),
             ParamSpec::Int("dilated_heads", 0, 0, int64_t(1) << 20,
                            "0 = every head dilated; k > 0 = heads h < k only, others dilation 1"),
             ParamSpec::Int("global", 16, 0, int64_t(1) << 30,
                            "number of global tokens: the first g positions"),
             block_param()},
        .caps = {.causal = true,
                 .cross = true,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true,
                 .bf16 = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<Longformer>(v.get_int("window"), v.get_int("dilation"),
                                              v.get_int("dilated_heads"), v.get_int("global"),
                                              v.get_int("block"));
        }});

}  // namespace
}  // namespace attnbench
