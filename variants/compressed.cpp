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
// Decode (generation): a pooled cache of the complete groups so far plus the group being
// filled (mean: its running sums; conv: its raw rows); a step pools the group it completes,
// as the forward pools, and attends the pooled rows its query sees (CompressedDecodeState).
// Mean's pooled cache is one per key/value head (shrinking by H / G under grouped-query
// attention); conv's is per query head, as its weights are.
// Oracle: pooling and softmax over the complete groups in double, with the same conv weights
// (conv_weights, which forward() calls too).
// Tolerance (the float32 error model of common/reference/oracle.h): softmax attention over the
// pooled keys, whose logits also carry the pooling's rounding (a sum of r rows for mean, r d
// products for conv), on top of the dot product's d. Time O(B H n (m / r) d) plus pooling O(B H m
// d) (mean) or O(B H m d^2) (conv); memory O(B H (m / r) d + threads 64 (64 + d)) plus the conv
// weights (2 H r d^2 floats). Paper: Liu, Saleh, Pot, Goodrich, Sepassi, Kaiser, Shazeer,
// "Generating Wikipedia by Summarizing Long Sequences" (ICLR 2018), memory-compressed attention (r
// = 3 there).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "common/core/checked.h"
#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/random.h"
#include "common/core/threads.h"
#include "common/decode/decode_kernels.h"
#include "common/engines/block_sparse.h"
#include "common/kernels/attention_kernels.h"
#include "common/reference/oracle.h"

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

/// The decode state (common/core/decode.h) of compressed: a pooled cache plus the group being
/// filled.
///
/// Pooled cache: the rows K'_t, V'_t of the groups pooled so far, room for ceil(n / r) of
/// them. Mean pooling depends on k and v alone, so one cache per (batch, key/value head)
/// serves the H / G query heads of its group (grouped-query attention shrinks it H / G-fold);
/// conv pooling mixes the channels with weights drawn per QUERY head (conv_weights), so its
/// pooled rows differ per query head and are kept per (batch, query head): the same size
/// whatever G.
///
/// Pending group: per (batch, key/value head), for mean the running sums of its keys and of
/// its values (the first row copied, the next ones added in order, then divided by the count:
/// mean_pool's arithmetic), for conv its raw rows (up to r), pooled by conv_pool, both as the
/// forward pools.
///
/// Step at position t: k_t, v_t join the pending group, which is pooled into a new row once
/// complete: when t + 1 is a multiple of r, or at t = n - 1, where the forward's last row sees
/// every group, a ragged last one included (complete_groups). Query t then attends the pooled
/// rows (its complete groups) with exact softmax (decode::attend_rows); none gives 0, as the
/// forward.
class CompressedDecodeState final : public DecodeState {
 public:
  CompressedDecodeState(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t t0,
                        int64_t ratio, bool conv, std::vector<float> weights)
      : batch_(p.batch),
        heads_(p.heads),
        kv_heads_(p.kv_head_count()),
        group_(p.kv_group()),
        d_(p.dim),
        r_(ratio),
        cap_(p.n),
        cache_heads_(conv ? p.heads : p.kv_head_count()),
        cap_rows_((p.n + ratio - 1) / ratio),
        conv_(conv),
        scale_(p.softmax_scale()),
        len_(t0),
        weights_(std::move(weights)),
        pk_(cache_bytes(p)),
        pv_(cache_bytes(p)),
        pend_k_(size_t(batch_ * kv_heads_ * pending_rows() * d_)),
        pend_v_(pend_k_.size()) {
    // the complete groups of rows 0 .. t0 - 1 pooled as the forward pools (all of them, a
    // ragged last one included, when t0 = n), the rest into the pending group
    const int64_t pooled_keys = t0 == cap_ ? t0 : t0 / r_ * r_;
    done_ = (pooled_keys + r_ - 1) / r_;
    pending_ = t0 - pooled_keys;
    const int64_t tasks = batch_ * cache_heads_;
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1 && t0 * d_ * tasks >= (1 << 16))
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / cache_heads_, c = task % cache_heads_;
      const int64_t h = conv_ ? c : c * group_;  // a query head reading this cache's keys
      if (conv_) {
        conv_pool(k.row(b, h, 0), k.stride_row, pooled_keys, d_, r_, key_weights(h),
                  pooled_row(pk_, b, c, 0));
        conv_pool(v.row(b, h, 0), v.stride_row, pooled_keys, d_, r_, value_weights(h),
                  pooled_row(pv_, b, c, 0));
      } else {
        mean_pool(k.row(b, h, 0), k.stride_row, pooled_keys, d_, r_, pooled_row(pk_, b, c, 0));
        mean_pool(v.row(b, h, 0), v.stride_row, pooled_keys, d_, r_, pooled_row(pv_, b, c, 0));
      }
    }
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t g = 0; g < kv_heads_; ++g)
        for (int64_t j = pooled_keys; j < t0; ++j)
          append(b, g, j - pooled_keys, k.row(b, g * group_, j), v.row(b, g * group_, j));
  }

  int64_t length() const override { return len_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(len_, cap_, Shape4{batch_, heads_, 1, d_}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const double flops = step_flops();
    const SerialIfSmall small(flops);
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t g = 0; g < kv_heads_; ++g)
        append(b, g, pending_, k.row(b, g * group_, 0), v.row(b, g * group_, 0));
    ++pending_;
    const bool completes = completes_group();
    ++len_;
    const int threads = team_threads();
    const int64_t bh_count = batch_ * heads_;
    if (int64_t(scores_.size()) < threads * cap_rows_) scores_.resize(size_t(threads * cap_rows_));
    // the step's flops (step_flops() before the row was appended) against the shared
    // threshold of common/core/threads.h
    const bool parallel = parallel_worth(flops, bh_count);
#pragma omp parallel if (parallel)
    {
      if (completes) {
        // the pending group becomes pooled row done_: per query head (conv) or per key/value
        // head (mean)
#pragma omp for schedule(static)
        for (int64_t task = 0; task < batch_ * cache_heads_; ++task)
          pool_pending(task / cache_heads_, task % cache_heads_);
      }
      const int64_t rows = done_ + (completes ? 1 : 0);
      float* sc = scores_.data() + omp_get_thread_num() * cap_rows_;
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < bh_count; ++bh) {
        const int64_t b = bh / heads_, h = bh % heads_, c = conv_ ? h : h / group_;
        decode::attend_rows(q.row(b, h, 0), pooled_row(pk_, b, c, 0), pooled_row(pv_, b, c, 0),
                            rows, d_, scale_, sc, out.row(b, h, 0));
      }
    }
    if (completes) ++done_, pending_ = 0;
  }

  double state_bytes() const override {
    // the pooled rows so far and the pending group's buffers (the conv weights, shared by
    // every sequence and fixed by the seed, are the model's, not a sequence's)
    const double floats =
        double(cache_heads_ * done_ * 2 * d_) + double(kv_heads_ * pending_rows() * 2 * d_);
    return floats * sizeof(float);
  }

  double step_bytes_read() const override {
    // the visible pooled rows once per cache (b, c) (the new one included); per (b, h) the q
    // row read and the out row written; per (b, g) the k and v rows and the pending group
    // (mean: its sums; conv: its raw rows, read when it completes, with the weights)
    if (len_ >= cap_) return 0.0;
    const bool completes = pending_ + 1 == r_ || len_ + 1 == cap_;
    const int64_t rows = done_ + (completes ? 1 : 0);
    double floats = double(batch_ * cache_heads_ * rows * 2 * d_) +
                    double(batch_ * heads_ * 2 * d_) + double(batch_ * kv_heads_ * 2 * d_);
    if (!conv_)
      floats += double(batch_ * kv_heads_ * 2 * d_);
    else if (completes)
      floats += double(batch_ * kv_heads_ * 2 * (pending_ + 1) * d_) +
                double(heads_ * 2 * (pending_ + 1) * d_ * d_);
    return floats * sizeof(float);
  }

  double step_flops() const override {
    // 4 d per (query, visible pooled row) as the forward counts a pair, and the pooling as
    // pool_flops counts it: mean d per key and value row (its add to the sums), conv 2 d^2
    // per tap of the group it completes, for every query head
    if (len_ >= cap_) return 0.0;
    const bool completes = pending_ + 1 == r_ || len_ + 1 == cap_;
    const int64_t rows = done_ + (completes ? 1 : 0);
    double f = double(batch_ * heads_) * double(rows) * 4.0 * double(d_);
    if (!conv_)
      f += double(batch_ * kv_heads_) * 2.0 * double(d_);
    else if (completes)
      f += double(batch_ * heads_) * 2.0 * 2.0 * double((pending_ + 1) * d_ * d_);
    return f;
  }

 private:
  /// Rows of one pending group's buffer: the running sum (mean) or up to r raw rows (conv).
  int64_t pending_rows() const { return conv_ ? r_ : 1; }
  int64_t cache_bytes(const Problem& p) const {
    const int64_t heads = conv_ ? p.heads : p.kv_head_count();
    const int64_t rows = checked_mul<UsageError>(p.batch * heads, cap_rows_, "pooled cache rows");
    return checked_mul<UsageError>(checked_mul<UsageError>(rows, p.dim, "pooled cache floats"),
                                   int64_t(sizeof(float)), "pooled cache bytes");
  }
  float* pooled_row(const kernels::AlignedBuffer& buf, int64_t b, int64_t c, int64_t t) const {
    return buf.floats() + ((b * cache_heads_ + c) * cap_rows_ + t) * d_;
  }
  const float* key_weights(int64_t h) const { return weights_.data() + 2 * h * r_ * d_ * d_; }
  const float* value_weights(int64_t h) const { return key_weights(h) + r_ * d_ * d_; }
  /// Whether the pending group (pending_ rows, the step's own included) is complete at
  /// position len_.
  bool completes_group() const { return pending_ == r_ || len_ + 1 == cap_; }

  /// Key and value rows kr, vr of (b, g) as row `at` of the pending group.
  void append(int64_t b, int64_t g, int64_t at, const float* kr, const float* vr) {
    const int64_t base = (b * kv_heads_ + g) * pending_rows() * d_;
    float* pk = pend_k_.data() + base + (conv_ ? at * d_ : 0);
    float* pv = pend_v_.data() + base + (conv_ ? at * d_ : 0);
    if (conv_ || at == 0) {
      std::copy(kr, kr + d_, pk);
      std::copy(vr, vr + d_, pv);
      return;
    }
    for (int64_t c = 0; c < d_; ++c) pk[c] += kr[c];
    for (int64_t c = 0; c < d_; ++c) pv[c] += vr[c];
  }

  /// The pending group of cache (b, c) as pooled row done_.
  void pool_pending(int64_t b, int64_t c) const {
    const int64_t g = conv_ ? c / group_ : c;
    const float* sk = pend_k_.data() + (b * kv_heads_ + g) * pending_rows() * d_;
    const float* sv = pend_v_.data() + (b * kv_heads_ + g) * pending_rows() * d_;
    float* yk = pooled_row(pk_, b, c, done_);
    float* yv = pooled_row(pv_, b, c, done_);
    if (conv_) {
      conv_pool(sk, d_, pending_, d_, r_, key_weights(c), yk);
      conv_pool(sv, d_, pending_, d_, r_, value_weights(c), yv);
      return;
    }
    const float count = float(pending_);
    for (int64_t i = 0; i < d_; ++i) yk[i] = sk[i] / count;
    for (int64_t i = 0; i < d_; ++i) yv[i] = sv[i] / count;
  }

  int64_t batch_, heads_, kv_heads_, group_, d_, r_, cap_;
  int64_t cache_heads_;  // heads of the pooled cache: H (conv) or G (mean)
  int64_t cap_rows_;     // pooled rows it has room for: ceil(n / r)
  bool conv_;
  float scale_;
  int64_t len_, done_ = 0, pending_ = 0;  // tokens, pooled rows, rows of the pending group
  std::vector<float> weights_;            // conv: [H][2][r][d][d] (conv_weights); mean: empty
  // pooled keys and values [B, cache heads, ceil(n / r), d], uninitialised: only the rows
  // pooled are ever read
  kernels::AlignedBuffer pk_, pv_;
  // the pending group of each (b, g): [B, G, 1 or r, d] for keys and for values
  std::vector<float> pend_k_, pend_v_;
  std::vector<float> scores_;  // per-thread scores of a step, kept between steps
};

class Compressed final : public Variant, public Backward, public Decoder {
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

  // Decode: a pooled cache and the pending group (CompressedDecodeState). The prefill pools
  // the complete groups of its t0 tokens with the forward's pooling code.
  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override {
    check_prefill(p, k, v, t0);
    return std::make_unique<CompressedDecodeState>(
        p, k, v, t0, r_, conv_, conv_ ? all_conv_weights(p) : std::vector<float>());
  }
  double prefill_flops(const Problem& p, int64_t t0) const override {
    // the pooling of the t0 keys and values, as pool_flops counts it: mean d per row (every
    // row is added to a pooled row or to the pending sums), conv 2 d^2 per row of a pooled
    // group (the pending rows are only copied), for every query head
    const double d = double(p.dim);
    if (!conv_) return double(p.batch * p.kv_head_count()) * 2.0 * double(t0) * d;
    const int64_t pooled_keys = t0 == p.n ? t0 : t0 / r_ * r_;
    return double(p.batch * p.heads) * 2.0 * 2.0 * double(pooled_keys) * d * d;
  }

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

  using Variant::backward;  // the accessor stays visible beside the pass
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
        .family = "lowrank",
        .display = "Memory-compressed attention",
        .paper = "Liu et al. 2018 (arXiv:1801.10198)",
        .look = {.color = "#8c6d31", .marker = "X"},
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
