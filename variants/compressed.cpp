// compressed: memory-compressed attention (Liu et al. 2018). Keys and values are pooled by a
// factor r = `ratio` along the positions, then every query attends the m' = ceil(m / r) pooled
// keys with exact softmax (scale 1/sqrt(d)):
//
//   group t = keys [t r, min(m, (t + 1) r))                      (the last group may be ragged)
//   mean:  K'_t = mean of K over group t                          (likewise V')
//   conv:  K'_t = sum_{s < r} Wk_s K_{t r + s}                    (V'_t with Wv_s)
//          a strided convolution, kernel = stride = r, full d x d channel mixing per tap; the
//          missing taps of a ragged last group count as zeros
//   out_i = sum_{t visible to i} softmax_t(q_i . K'_t / sqrt(d)) V'_t
//
// Conv weights: untrained, as a freshly initialised layer computes: Wk_s[c][c'] and
// Wv_s[c][c'] ~ N(0, 1/(r d)), separate weights for keys and values (two conv layers, as in
// tensor2tensor's memory-compressed attention), the same for every batch item of a head, drawn
// from the problem's seed: entry (s, c, c') of head h is
// RandomStream(seed, conv_stream(h, kv)).normal((s d + c) d + c') / sqrt(r d), kv = 0 for
// keys and 1 for values.
//
// Causal: pooled key t is visible to query i only when ALL its keys are, i.e. its last key
// min(m, (t + 1) r) - 1 < p.visible(i) (a staircase). Rows that see no complete group (the
// first r - 1 rows when m = n) attend nothing and output 0. m != n is supported.
//
// Key padding (Problem::key_lengths): padded keys are absent. Batch element b pools only its
// L_b valid keys, as if m were L_b: groups t < ceil(L_b / r) of r keys from key 0, the group
// straddling L_b holding its valid keys only (mean: their mean; conv: the taps past L_b count
// as zeros, like a ragged last group); no padded key or value enters a pooled row. Pooled key
// t is visible to query i when all its valid keys are, i.e. min(L_b, (t + 1) r) - 1 <
// p.visible(b, i) (causal and padding intersected, the causal diagonal that of the full m).
// A row that sees no pooled key (L_b = 0, or causal with no complete group) outputs 0.
//
// Implementation: pool K and V into per-call buffers, then run the block-sparse engine on the
// derived problem (n queries, m' keys, no causal mask) with the staircase as its pattern
// (non-causal: every pooled key). The pooled keys mix keys, so there is no pattern over the
// original keys: make_pattern returns nullptr (no `attnbench pattern`, no mass).
// Backward: forward_train keeps the pooled K' and V' and the rows' log-sum-exps; the engine's
// block-sparse backward over the staircase gives dQ, dK' and dV', and the pooling's transpose
// gives dK and dV (mean: dK_j = dK'_t / |group t|; conv: dK_{t r + s} = dK'_t Wk_s). The conv
// weights are constants of the backward; padded keys get 0.
// Oracle: pooling and softmax over the complete groups in double, with the same conv weights
// (conv_weights, which forward() calls too).
// Tolerance (the float32 error model of common/oracle.h): softmax attention over the pooled
// keys, whose logits also carry the pooling's rounding (a sum of r rows for mean, r d products
// for conv), on top of the dot product's d.
// Time O(B H n (m / r) d) plus pooling O(B H m d) (mean) or O(B H m d^2) (conv);
// memory O(B H (m / r) d + threads 64 (64 + d)) plus the conv weights (2 H r d^2 floats).
// Paper: Liu, Saleh, Pot, Goodrich, Sepassi, Kaiser, Shazeer, "Generating Wikipedia by
// Summarizing Long Sequences" (ICLR 2018), memory-compressed attention (r = 3 there).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common/block_sparse.h"
#include "common/error.h"
#include "common/oracle.h"
#include "common/random.h"

namespace attnbench {
namespace {

constexpr int64_t kTile = 64;  // engine tile (query rows and pooled keys)

/// RandomStream id of the conv weights of head h: keys (kv = 0) or values (kv = 1).
uint64_t conv_stream(int64_t head, int kv) {
  // "CMPK" / "CMPV" in the high bits keeps these apart from the other generators' streams
  return (uint64_t(kv ? 0x434d5056 : 0x434d504b) << 32) + uint64_t(head);
}

/// The conv weights of head h (keys: kv = 0, values: kv = 1), r taps of d x d ([s][c][c']),
/// as documented at the top of the file.
void conv_weights(uint64_t seed, int64_t head, int kv, int64_t r, int64_t d, float* w) {
  const RandomStream rs(seed, conv_stream(head, kv));
  const double sd = 1.0 / std::sqrt(double(r * d));
  for (int64_t e = 0; e < r * d * d; ++e) w[e] = float(rs.normal(uint64_t(e)) * sd);
}

/// Valid keys of batch element b: its key length under key padding, else every key.
inline int64_t valid_keys(const Problem& p, int64_t b) {
  return p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)];
}

/// Pooled keys of batch element b: the groups of its valid keys, ceil(L_b / r).
inline int64_t valid_groups(const Problem& p, int64_t ratio, int64_t b) {
  return (valid_keys(p, b) + ratio - 1) / ratio;
}

/// Pooled keys visible to query i of batch element b: the groups whose last valid key is
/// visible.
inline int64_t complete_groups(const Problem& p, int64_t ratio, int64_t b, int64_t i) {
  const int64_t vis = p.visible(b, i);
  return vis >= valid_keys(p, b) ? valid_groups(p, ratio, b) : vis / ratio;
}

/// The causal staircase over the pooled keys: query i attends pooled keys t < cnt(i), cnt as
/// complete_groups on the original problem. Consumed with the derived problem (m' keys).
class StaircasePattern final : public SparsePattern {
 public:
  StaircasePattern(const Problem& original, int64_t ratio, int64_t pooled)
      : p_(original), r_(ratio), mp_(pooled) {}

  int64_t block() const override { return kTile; }

  void key_blocks(int64_t b, int64_t, int64_t qb, std::vector<KeyBlock>& out) const override {
    out.clear();
    const int64_t i0 = qb * kTile, i1 = std::min(p_.n, i0 + kTile) - 1;
    if (i0 < 0 || i0 > i1) return;
    // cnt grows with i: the first row sees the fewest pooled keys, the last the most
    const int64_t lo = cnt(b, i0), hi = cnt(b, i1);
    for (int64_t kb = 0; kb * kTile < hi; ++kb)
      out.push_back({kb, std::min(mp_, (kb + 1) * kTile) > lo});
  }

  void block_mask(int64_t b, int64_t, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c_end = cnt(b, i0 + r);
      for (int64_t c = 0; c < cols; ++c) mask[r * cols + c] = j0 + c < c_end;
    }
  }

 private:
  int64_t cnt(int64_t b, int64_t i) const { return complete_groups(p_, r_, b, i); }

  Problem p_;
  int64_t r_, mp_;
};

/// mean pooling of one head: x (len rows, stride ld) -> y (ceil(len / r) rows of d).
void mean_pool(const float* x, int64_t ld, int64_t len, int64_t d, int64_t r, float* y) {
  for (int64_t t = 0; t * r < len; ++t) {
    float* yt = y + t * d;
    const int64_t j0 = t * r, j1 = std::min(len, j0 + r);
    std::copy(x + j0 * ld, x + j0 * ld + d, yt);
    for (int64_t j = j0 + 1; j < j1; ++j) {
      const float* xj = x + j * ld;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) yt[c] += xj[c];
    }
    const float count = float(j1 - j0);
    for (int64_t c = 0; c < d; ++c) yt[c] /= count;
  }
}

/// conv pooling of one head: y_t = sum_s W_s x_{t r + s}, W = r taps of d x d ([s][c][c']).
/// Tap s is one GEMM over the rows s, s + r, s + 2r, ... (row stride r ld).
void conv_pool(const float* x, int64_t ld, int64_t len, int64_t d, int64_t r, const float* w,
               float* y) {
  for (int64_t s = 0; s < std::min(r, len); ++s) {
    const int64_t rows = (len - s + r - 1) / r;  // groups that have tap s
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(d), int(d), 1.0f,
                x + s * ld, int(r * ld), w + s * d * d, int(d), s == 0 ? 0.0f : 1.0f, y, int(d));
  }
}

/// What forward_train keeps: the pooled keys and values [B, H, m', d] and the rows'
/// log-sum-exps over them [B, H, n].
class CompressedSaved final : public SavedState {
 public:
  Tensor pk, pv;
  std::vector<float> lse;
};

/// The transpose of mean_pool: dx_j = dy_t / |group t| for the len valid rows (stride ld).
void mean_unpool(const float* dy, int64_t len, int64_t d, int64_t r, float* dx, int64_t ld) {
  for (int64_t t = 0; t * r < len; ++t) {
    const int64_t j0 = t * r, j1 = std::min(len, j0 + r);
    const float count = float(j1 - j0);
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t c = 0; c < d; ++c) dx[j * ld + c] = dy[t * d + c] / count;
  }
}

/// The transpose of conv_pool: dx_{t r + s} = dy_t W_s for the len valid rows (stride ld),
/// one GEMM per tap over the rows s, s + r, s + 2r, ...
void conv_unpool(const float* dy, int64_t len, int64_t d, int64_t r, const float* w, float* dx,
                 int64_t ld) {
  for (int64_t s = 0; s < std::min(r, len); ++s) {
    const int64_t rows = (len - s + r - 1) / r;  // groups that have tap s
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(d), 1.0f, dy,
                int(d), w + s * d * d, int(d), 0.0f, dx + s * ld, int(r * ld));
  }
}

class Compressed final : public Variant, public Backward {
 public:
  Compressed(int64_t ratio, bool conv) : r_(ratio), conv_(conv) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const int64_t mp = pooled(p);
    Tensor pk(Shape4{p.batch, p.heads, mp, p.dim}), pv(Shape4{p.batch, p.heads, mp, p.dim});
    pool(p, k, v, pk, pv);
    // pass 3: exact attention over the pooled keys, the staircase as the pattern
    const StaircasePattern pat(p, r_, mp);
    block_sparse_attention(derived(p), q, pk.view(), pv.view(), out, pat);
  }

  // The backward: the engine's block-sparse backward over the pooled keys (their gradients
  // dK', dV'), then back through the pooling: mean, dK_j = dK'_t / |group t|; conv,
  // dK_{t r + s} = dK'_t Wk_s (dV alike with Wv). The conv weights are constants.
  Backward* backward() override { return this; }

  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    const int64_t mp = pooled(p);
    auto st = std::make_unique<CompressedSaved>();
    st->pk = Tensor(Shape4{p.batch, p.heads, mp, p.dim});
    st->pv = Tensor(Shape4{p.batch, p.heads, mp, p.dim});
    st->lse.resize(size_t(p.batch * p.heads * p.n));
    pool(p, k, v, st->pk, st->pv);
    const StaircasePattern pat(p, r_, mp);
    const LseView lse{st->lse.data(), p.heads * p.n, p.n, 1};
    block_sparse_attention(derived(p), q, st->pk.view(), st->pv.view(), out, pat, &lse);
    return st;
  }

  void backward(const Problem& p, ConstTensorView q, ConstTensorView, ConstTensorView,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    const int64_t B = p.batch, H = p.heads, d = p.dim, mp = pooled(p);
    const auto* st = dynamic_cast<const CompressedSaved*>(&saved);
    if (!st || st->lse.size() != size_t(B * H * p.n) || st->pk.shape() != Shape4{B, H, mp, d})
      throw UsageError("compressed: the saved state is not from its forward_train on this problem");
    Tensor dpk(Shape4{B, H, mp, d}), dpv(Shape4{B, H, mp, d});
    const StaircasePattern pat(p, r_, mp);
    const LseView lse{const_cast<float*>(st->lse.data()), H * p.n, p.n, 1};
    block_sparse_attention_backward(derived(p), q, st->pk.view(), st->pv.view(), out, dout, lse,
                                    pat, dq, dpk.view(), dpv.view());
    const std::vector<float> weights = conv_ ? all_conv_weights(p) : std::vector<float>();
    const ConstTensorView gk = dpk.view(), gv = dpv.view();
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < B * H; ++t) {
      const int64_t b = t / H, h = t % H, len = valid_keys(p, b);
      for (int64_t j = len; j < p.keys(); ++j) {  // padded keys: no gradient
        std::fill_n(dk.row(b, h, j), d, 0.0f);
        std::fill_n(dv.row(b, h, j), d, 0.0f);
      }
      if (conv_) {
        const float* wk = weights.data() + (2 * h) * r_ * d * d;
        conv_unpool(gk.row(b, h, 0), len, d, r_, wk, dk.row(b, h, 0), dk.stride_row);
        conv_unpool(gv.row(b, h, 0), len, d, r_, wk + r_ * d * d, dv.row(b, h, 0), dv.stride_row);
      } else {
        mean_unpool(gk.row(b, h, 0), len, d, r_, dk.row(b, h, 0), dk.stride_row);
        mean_unpool(gv.row(b, h, 0), len, d, r_, dv.row(b, h, 0), dv.stride_row);
      }
    }
  }

  double backward_flops(const Problem& p) const override {
    double m = 0;
    for (int64_t b = 0; b < p.batch; ++b) m += double(valid_keys(p, b));
    const double d = double(p.dim);
    // the engine's backward (2.5 times its forward's scores), then the pooling's transpose
    const double unpool = 2.0 * (conv_ ? 2.0 * m * d * d : m * d);
    return 2.5 * (flops(p) - double(p.heads) * pool_flops(p)) + double(p.heads) * unpool;
  }
  double saved_estimate(const Problem& p) const override {
    return double(p.batch * p.heads) * double(2 * pooled(p) * p.dim + p.n) * sizeof(float) +
           double(sizeof(CompressedSaved));
  }
  double backward_memory_estimate(const Problem& p) const override {
    const double f = sizeof(float);
    const double grads = 2.0 * double(p.batch * p.heads * pooled(p) * p.dim) * f;
    const double weights = conv_ ? 2.0 * double(p.heads * r_ * p.dim * p.dim) * f : 0.0;
    const StaircasePattern pat(p, r_, pooled(p));
    const Problem e = derived(p);
    return grads + weights + block_sparse_backward_memory(e, kTile, listed_blocks(e, pat));
  }

  /// Pooled keys and values [B, H, m', d] (pk, pv); under key padding the first
  /// ceil(L_b / r) pooled rows of batch element b, from its valid keys (the rest are never
  /// read: the derived problem pads them and the staircase stops before them).
  void pool(const Problem& p, ConstTensorView k, ConstTensorView v, Tensor& pk, Tensor& pv) const {
    const int64_t B = p.batch, H = p.heads, d = p.dim;
    // pass 1: the conv weights of every head, keys then values
    const std::vector<float> weights = conv_ ? all_conv_weights(p) : std::vector<float>();
    // pass 2: the pooled rows
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < B * H; ++t) {
      const int64_t b = t / H, h = t % H, len = valid_keys(p, b);
      if (conv_) {
        const float* wk = weights.data() + (2 * h) * r_ * d * d;
        conv_pool(k.row(b, h, 0), k.stride_row, len, d, r_, wk, pk.view().row(b, h, 0));
        conv_pool(v.row(b, h, 0), v.stride_row, len, d, r_, wk + r_ * d * d,
                  pv.view().row(b, h, 0));
      } else {
        mean_pool(k.row(b, h, 0), k.stride_row, len, d, r_, pk.view().row(b, h, 0));
        mean_pool(v.row(b, h, 0), v.stride_row, len, d, r_, pv.view().row(b, h, 0));
      }
    }
  }

  /// The conv weights of every head, keys then values: [H][2][r][d][d].
  std::vector<float> all_conv_weights(const Problem& p) const {
    const int64_t per = r_ * p.dim * p.dim;
    std::vector<float> weights(size_t(2 * p.heads * per));
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < 2 * p.heads; ++t)
      conv_weights(p.seed, t / 2, int(t % 2), r_, p.dim, weights.data() + t * per);
    return weights;
  }

  /// FLOPs of pooling K and V of one head over every batch element: about m d adds (mean) or
  /// 2 m d^2 (conv) each.
  double pool_flops(const Problem& p) const {
    double m = 0;
    for (int64_t b = 0; b < p.batch; ++b) m += double(valid_keys(p, b));
    const double d = double(p.dim);
    return 2.0 * (conv_ ? 2.0 * m * d * d : m * d);
  }

  double flops(const Problem& p) const override {
    const int64_t mp = pooled(p);
    const StaircasePattern pat(p, r_, mp);
    const Problem e = derived(p);
    // per head: the scores of every batch element, and the pooling
    double scores = 0;
    for (int64_t b = 0; b < p.batch; ++b) scores += pattern_scores(e, pat, b, 0);
    return double(p.heads) * (4.0 * double(p.dim) * scores + pool_flops(p));
  }

  double memory_estimate(const Problem& p) const override {
    const double f = sizeof(float);
    const double pooled_kv = 2.0 * double(p.batch * p.heads * pooled(p) * p.dim) * f;
    const double weights = conv_ ? 2.0 * double(p.heads * r_ * p.dim * p.dim) * f : 0.0;
    return pooled_kv + weights + block_sparse_memory(derived(p), kTile);
  }

 private:
  int64_t pooled(const Problem& p) const { return (p.keys() + r_ - 1) / r_; }
  /// The problem the engine runs: n queries over m' pooled keys, key padding (if any) by
  /// pooled lengths ceil(L_b / r); the causal rule is in the staircase pattern.
  Problem derived(const Problem& p) const {
    Problem e = p;
    e.m = pooled(p);
    e.causal = false;
    for (size_t b = 0; b < e.key_lengths.size(); ++b)
      e.key_lengths[b] = valid_groups(p, r_, int64_t(b));
    return e;
  }

  int64_t r_;
  bool conv_;
};

std::vector<double> compressed_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                      ConstTensorView k, ConstTensorView v) {
  const int64_t r = var.params().get_int("ratio"), m = p.keys(), d = p.dim;
  const bool conv = var.params().get_choice("pool") == "conv";
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    // the valid keys: len of them (m without key padding), in mp groups
    const int64_t len = p.key_lengths.empty() ? m : p.key_lengths[size_t(b)];
    const int64_t mp = (len + r - 1) / r;
    // group t of x pooled: the mean of its valid rows, or sum_s W_s x_{t r + s} over them
    auto pool = [&](ConstTensorView x, int kv) {
      const oracle::Matrix xh = oracle::head(x, b, h);
      std::vector<float> w(size_t(conv ? r * d * d : 0));
      if (conv) conv_weights(p.seed, h, kv, r, d, w.data());
      oracle::Matrix y(mp, d);
      for (int64_t t = 0; t < mp; ++t) {
        const int64_t j0 = t * r, j1 = std::min(len, j0 + r);
        for (int64_t j = j0; j < j1; ++j)
          for (int64_t c = 0; c < d; ++c) {
            if (!conv) {
              y(t, c) += xh(j, c) / double(j1 - j0);
              continue;
            }
            for (int64_t c2 = 0; c2 < d; ++c2)
              y(t, c) += double(w[size_t(((j - j0) * d + c) * d + c2)]) * xh(j, c2);
          }
      }
      return y;
    };
    return oracle::softmax_attention(oracle::head(q, b, h), pool(k, 0), pool(v, 1),
                                     1.0 / std::sqrt(double(d)), [&](int64_t i) {
                                       const int64_t vis = p.visible(b, i);
                                       return vis >= len ? mp : vis / r;
                                     });
  });
}

double compressed_tolerance(const Variant& var, const Problem& p, const Workload& wl) {
  const double r = double(var.params().get_int("ratio")), d = double(p.dim);
  const double pooling = var.params().get_choice("pool") == "conv" ? r * d : r;
  return kErrorMargin * float32_error(d + pooling, logit_size(wl), double(p.keys()), 4.0);
}

ATTNBENCH_REGISTER_VARIANT(
    compressed,
    VariantInfo{
        .name = "compressed",
        .summary = "memory-compressed attention: keys and values pooled by `ratio` (mean or "
                   "strided conv), then exact softmax; causal rows without a complete group are 0",
        .complexity = "time O(n (m / ratio) d + m d (conv: m d^2)), "
                      "memory O((m / ratio) d + threads 64 (64 + d))",
        .params = {ParamSpec::Int("ratio", 3, 1, int64_t(1) << 20,
                                  "pooling factor r: groups of r consecutive keys become one"),
                   ParamSpec::Choice("pool", "mean", {"mean", "conv"},
                                     "mean of each group, or a strided conv with seeded weights")},
        .caps = {.causal = true, .cross = true, .exact = false, .key_padding = true},
        .make =
            [](const ParamValues& v) {
              return std::make_unique<Compressed>(v.get_int("ratio"),
                                                  v.get_choice("pool") == "conv");
            },
        .oracle = compressed_oracle,
        .tolerance = compressed_tolerance});

}  // namespace
}  // namespace attnbench
