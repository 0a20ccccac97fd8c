// deltanet: linear attention with the delta rule (Yang, Wang, Zhang, Shen & Kim 2024,
// "Parallelizing Linear Transformers with the Delta Rule over Sequence Length"), and with
// `gated` the decay of Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks:
// Improving Mamba2 with Delta Rule"). Not softmax: a causal recurrence over a d x d state.
//
// Per key/value head, token t (k_t, v_t its key and value rows):
//   k^_t   = k_t / |k_t|                          (L2-normalised key; a zero key stays 0)
//   beta_t = sigmoid(k_t . w_b + b_b)             (write strength in (0, 1))
//   alpha_t = exp(-softplus(k_t . w_a + b_a))     (gated: decay in (0, 1); else alpha_t = 1)
//   S_t = alpha_t S_{t-1} (I - beta_t k^_t k^_t^T) + beta_t v_t k^_t^T       (S_0 = 0, d x d)
//   o_t = S_t q'_t,  q'_t = q_t / (|q_t| sqrt(d))  (L2-normalised query scaled by d^-1/2, as
//                                                    the reference code does; a zero q gives 0)
// The papers project the layer input x for beta and alpha (alpha's decay also carries a learned
// per-head rate A); here k stands in for x and the projections are seeded draws shared by every
// head (deltanet_weights): w_b, w_a with N(0, 1/d) entries, b_b = 0 and b_a = -2.5 (so a
// typical alpha is exp(-softplus(-2.5)) = 0.92, the decay range Gated DeltaNet's dt init
// aims at). beta, alpha and S depend on k and v only: under grouped-query heads the state is
// per key/value head and its group's query heads all read it.
//
// form=recurrent: the recurrence above in float32, token by token (the decode step's code):
// with the state stored transposed (S^T, rows over the key dimension), u = S k^ and y = S q'
// are one pass of row axpys, S <- alpha S + e k^^T with e = beta (v - alpha u) a second, and
// o = alpha y + e (k^ . q'). About 6 d^2 flops per token over a state that stays in L1.
// form=chunkwise (default): the WY / UT form of the delta rule over chunks of C = `chunk`
// tokens. With g_t the cumulative log-decay inside the chunk (gamma_t = exp(g_t); all 1
// ungated), A_ti = beta_t exp(g_t - g_i) k^_t . k^_i (i < t), and S the state at the chunk start:
//   [U | W] = (I + A)^-1 [diag(beta) V | diag(beta gamma) K^]   (unit lower solve, C x C)
//   N = U - W S^T                                               (the chunk's new values)
//   O = diag(gamma) Q' S^T + ((Q' K^^T) o D) N,   D_ti = exp(g_t - g_i) for i <= t, else 0
//   S <- gamma_C S + N^T diag(exp(g_C - g_i)) K^
// all Eigen products (the causal ones on lower halves only). Per token about 6 d^2 + 5 C d
// flops: more than the recurrence, but in matrix products instead of matrix-vector passes.
// On a CPU at d = 64 the recurrence is no slower than the chunks: its 16 KiB state stays in L1
// and its two passes run near the rate of the chunks' small products, which do more flops
// (measured at n = 8192, H = 8, one thread: recurrent 38 ms, chunk 16 48 ms, chunk 64 65 ms).
// The chunkwise form is the parallel-over-time form the papers use on GPUs, kept for that.
// Time O(n d (d + C)) per head, memory O(threads C (C + d)) beyond inputs and output.
//
// Backward (exact gradients of the function above, through beta, alpha and both
// normalisations): the recurrence is run forward to keep the state at every chunk start, then
// chunks are taken in reverse: the chunk's states are recomputed from its start and the
// reverse recurrence (dS_{t-1} = alpha (dS_t - beta g k^^T), g = dS_t k^) gives dq, dk, dv.
// Each row's dbeta = (v - alpha S_{t-1} k^) . g and dalpha = <dS_t, S_{t-1}> - beta g . S_{t-1} k^
// go on into dk through the stand-ins; a given beta or g takes them instead (dL/dbeta_t and
// dL/dg_t = alpha_t dalpha per key/value head, backward_inputs). Nothing is saved between
// forward_train and backward. Decode: the state S^T per (batch, key/value head), a step is the
// recurrent step (O(d^2) per head, whatever t); prefill runs the chunkwise form over the
// prompt. Given beta and g reach the prefill for its tokens and each step for its own
// (prefill_given, step_given).
#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/core/backward.h"
#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/reference/oracle.h"

namespace attnbench {
namespace {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::OuterStride<>;
using ConstMap = Eigen::Map<const Mat, 0, Strided>;
using MutMap = Eigen::Map<Mat, 0, Strided>;

/// Columns of the stored state: d rounded up to a multiple of 16 (the padding stays 0).
constexpr int64_t kLanes = 16;
int64_t padded(int64_t d) { return (d + kLanes - 1) / kLanes * kLanes; }

/// Bias of the write strength and of the decay's softplus argument (see the header).
constexpr float kBetaBias = 0.0f;
constexpr float kDecayBias = -2.5f;
/// Random stream of the projections w_b, w_a.
constexpr uint64_t kWeightStream = 0xde17a;

/// The seeded projections of k for beta and alpha, shared by every head: w_b, w_a with
/// N(0, 1/d) entries (floats; the oracle reads the same floats).
struct Weights {
  std::vector<float> wb, wa;
};

Weights deltanet_weights(const Problem& p) {
  const RandomStream rs(p.seed, kWeightStream);
  const int64_t d = p.dim;
  const double sd = 1.0 / std::sqrt(double(d));
  Weights w;
  w.wb.resize(size_t(d)), w.wa.resize(size_t(d));
  for (int64_t i = 0; i < d; ++i) {
    w.wb[size_t(i)] = float(sd * rs.normal(uint64_t(i)));
    w.wa[size_t(i)] = float(sd * rs.normal(uint64_t(d + i)));
  }
  return w;
}

float softplus(float x) { return std::max(x, 0.0f) + std::log1p(std::exp(-std::abs(x))); }
float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

/// One key row's quantities: k^ into kn, beta, the log-decay (0 ungated) and |k|.
struct KeyFeatures {
  float beta, log_alpha, norm;
};

KeyFeatures key_features(const float* k, int64_t d, const Weights& w, bool gated, float* kn) {
  float ss = 0, zb = kBetaBias, za = kDecayBias;
  for (int64_t j = 0; j < d; ++j) ss += k[j] * k[j], zb += k[j] * w.wb[size_t(j)];
  if (gated)
    for (int64_t j = 0; j < d; ++j) za += k[j] * w.wa[size_t(j)];
  const float norm = std::sqrt(ss), inv = norm > 0 ? 1.0f / norm : 0.0f;
  for (int64_t j = 0; j < d; ++j) kn[j] = k[j] * inv;
  return {sigmoid(zb), gated ? -softplus(za) : 0.0f, norm};
}

/// q' = q / (|q| sqrt(d)) into out (0 for a zero q); returns |q|.
float query_features(const float* q, int64_t d, float* out) {
  float ss = 0;
  for (int64_t j = 0; j < d; ++j) ss += q[j] * q[j];
  const float norm = std::sqrt(ss);
  const float f = norm > 0 ? 1.0f / (norm * std::sqrt(float(d))) : 0.0f;
  for (int64_t j = 0; j < d; ++j) out[j] = q[j] * f;
  return norm;
}

/// Columns of one block of the state passes: up to four vectors of 16, so that four
/// independent accumulation chains hide the latency of the fused multiply-adds.
constexpr int64_t kBlock = 64;

/// acc[c0 .. c0 + W) = columns c0 .. c0 + W of ST^T x, and of ST^T y when y is given.
template <int64_t W>
void state_block(const float* st, int64_t d, int64_t dp, int64_t c0, const float* x, const float* y,
                 float* accx, float* accy) {
  float a[W] = {}, b[W] = {};
  if (y) {
    for (int64_t j = 0; j < d; ++j) {
      const float xj = x[j], yj = y[j];
      const float* r = st + j * dp + c0;
#pragma omp simd
      for (int64_t l = 0; l < W; ++l) a[l] += xj * r[l], b[l] += yj * r[l];
    }
    std::copy(b, b + W, accy + c0);
  } else {
    for (int64_t j = 0; j < d; ++j) {
      const float xj = x[j];
      const float* r = st + j * dp + c0;
#pragma omp simd
      for (int64_t l = 0; l < W; ++l) a[l] += xj * r[l];
    }
  }
  std::copy(a, a + W, accx + c0);
}

/// accx[0 .. dp) = ST^T x (x of d entries), and accy = ST^T y in the same pass when y is
/// given; ST has d rows of dp floats. Row axpys over column blocks held in registers.
void state_times(const float* st, int64_t d, int64_t dp, const float* x, float* accx,
                 const float* y = nullptr, float* accy = nullptr) {
  int64_t c0 = 0;
  for (; c0 + kBlock <= dp; c0 += kBlock) state_block<kBlock>(st, d, dp, c0, x, y, accx, accy);
  for (; c0 < dp; c0 += kLanes) state_block<kLanes>(st, d, dp, c0, x, y, accx, accy);
}

float dot(const float* a, const float* b, int64_t d) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < d; ++j) s += a[j] * b[j];
  return s;
}

/// One token of the recurrence on ST = S^T (d rows of dp floats, columns >= d zero):
/// S <- alpha S + e k^^T, e = beta (v - alpha S k^), then out[h] = S q'[h] for the nq query
/// heads (nq may be 0). work: (2 + nq) dp floats.
void delta_step(float* st, int64_t d, int64_t dp, const float* kn, const float* v, float beta,
                float alpha, int64_t nq, const float* const* qs, float* const* outs, float* work) {
  float* u = work;
  float* e = work + dp;
  float* y = work + 2 * dp;
  // pass 1: u = S k^ and y_h = S q'_h on the old state
  if (nq > 0) {
    state_times(st, d, dp, kn, u, qs[0], y);
    for (int64_t h = 1; h < nq; ++h) state_times(st, d, dp, qs[h], y + h * dp);
  } else {
    state_times(st, d, dp, kn, u);
  }
  for (int64_t l = 0; l < d; ++l) e[l] = beta * (v[l] - alpha * u[l]);
  for (int64_t l = d; l < dp; ++l) e[l] = 0;
  // the outputs: S_t q' = alpha S_{t-1} q' + e (k^ . q')
  for (int64_t h = 0; h < nq; ++h) {
    const float kq = dot(kn, qs[h], d);
    const float* yh = y + h * dp;
    for (int64_t l = 0; l < d; ++l) outs[h][l] = alpha * yh[l] + e[l] * kq;
  }
  // pass 2: S^T <- alpha S^T + k^ e^T
  for (int64_t j = 0; j < d; ++j) {
    float* r = st + j * dp;
    const float kj = kn[j];
#pragma omp simd
    for (int64_t l = 0; l < dp; ++l) r[l] = alpha * r[l] + kj * e[l];
  }
}

/// The inputs of one (batch, key/value head): its key and value rows, and the rows of its
/// group's query heads and their outputs (none for a prefill).
struct HeadIo {
  const float *k = nullptr, *v = nullptr;
  int64_t ldk = 0, ldv = 0;
  /// The head's given beta and log decay rows (the inputs beta and g, n entries each), or
  /// null: computed from k by the seeded stand-ins.
  const float *beta = nullptr, *g = nullptr;
  int64_t nq = 0;
  std::vector<const float*> q;
  std::vector<float*> out;
  int64_t ldq = 0, ldo = 0;
};

/// key_features of row t of a head, with its given beta and log decay in place of the
/// stand-ins'.
KeyFeatures row_features(const HeadIo& io, int64_t t, int64_t d, const Weights& w, bool gated,
                         float* kn) {
  KeyFeatures f = key_features(io.k + t * io.ldk, d, w, gated, kn);
  if (io.beta) f.beta = io.beta[t];
  if (io.g) f.log_alpha = io.g[t];
  return f;
}

HeadIo head_io(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t b, int64_t g,
               const ConstTensorView* q, const TensorView* out) {
  const int64_t grp = p.kv_group();
  HeadIo io;
  io.k = k.head(b, g * grp), io.v = v.head(b, g * grp);
  io.ldk = k.stride_row, io.ldv = v.stride_row;
  if (q) {
    io.nq = grp, io.ldq = q->stride_row, io.ldo = out ? out->stride_row : 0;
    for (int64_t r = 0; r < grp; ++r) {
      io.q.push_back(q->head(b, g * grp + r));
      io.out.push_back(out ? out->head(b, g * grp + r) : nullptr);
    }
  }
  return io;
}

/// The recurrent form over tokens [t0, t1) of one head, from and into the state st.
void recurrent_head(const HeadIo& io, int64_t t0, int64_t t1, int64_t d, const Weights& w,
                    bool gated, float* st) {
  const int64_t dp = padded(d);
  std::vector<float> buf(size_t((3 + 2 * io.nq) * dp));
  float* kn = buf.data();
  float* qf = kn + dp;
  float* work = qf + io.nq * dp;
  std::vector<const float*> qs(size_t(io.nq));
  std::vector<float*> outs(size_t(io.nq));
  for (int64_t h = 0; h < io.nq; ++h) qs[size_t(h)] = qf + h * dp;
  for (int64_t t = t0; t < t1; ++t) {
    const KeyFeatures f = row_features(io, t, d, w, gated, kn);
    for (int64_t h = 0; h < io.nq; ++h) {
      query_features(io.q[size_t(h)] + t * io.ldq, d, qf + h * dp);
      outs[size_t(h)] = io.out[size_t(h)] + t * io.ldo;
    }
    delta_step(st, d, dp, kn, io.v + t * io.ldv, f.beta, std::exp(f.log_alpha), io.nq, qs.data(),
               outs.data(), work);
  }
}

/// Workspace of the chunkwise form for chunks of up to C tokens.
struct ChunkWork {
  Mat kn, qf, a, x, nv, p, kr;
  std::vector<float> beta, lg;
  ChunkWork(int64_t C, int64_t d)
      : kn(C, d), qf(C, d), a(C, C), x(C, 2 * d), nv(C, d), p(C, C), kr(C, d) {
    beta.resize(size_t(C)), lg.resize(size_t(C));
  }
  static double floats(int64_t C, int64_t d) { return double(C) * double(2 * C + 6 * d + 2); }
};

/// The chunkwise form over the n tokens of one head (see the header), from and into st.
void chunkwise_head(const HeadIo& io, int64_t n, int64_t d, int64_t C, const Weights& w, bool gated,
                    float* st, ChunkWork& cw) {
  const int64_t dp = padded(d);
  MutMap S(st, d, d, Strided(dp));  // S^T: rows over the key dimension
  for (int64_t c0 = 0; c0 < n; c0 += C) {
    const int64_t c = std::min(C, n - c0);
    // pass 1: normalised keys, beta, cumulative log-decays within the chunk
    double g = 0;
    for (int64_t t = 0; t < c; ++t) {
      const KeyFeatures f = row_features(io, c0 + t, d, w, gated, cw.kn.row(t).data());
      cw.beta[size_t(t)] = f.beta;
      g += double(f.log_alpha);
      cw.lg[size_t(t)] = float(g);
    }
    auto K = cw.kn.topRows(c);
    const ConstMap V(io.v + c0 * io.ldv, c, d, Strided(io.ldv));
    // pass 2: A = strictly lower beta_t exp(g_t - g_i) k^_t . k^_i, right-hand sides, solve
    auto A = cw.a.topLeftCorner(c, c);
    A.triangularView<Eigen::Lower>() = K * K.transpose();  // the lower half only
    auto X = cw.x.topRows(c);
    for (int64_t t = 0; t < c; ++t) {
      const float bt = cw.beta[size_t(t)], gt = cw.lg[size_t(t)];
      if (gated)
        for (int64_t i = 0; i < t; ++i) A(t, i) *= bt * std::exp(gt - cw.lg[size_t(i)]);
      else
        for (int64_t i = 0; i < t; ++i) A(t, i) *= bt;
      X.row(t).head(d) = bt * V.row(t);
      X.row(t).tail(d) = (gated ? bt * std::exp(gt) : bt) * K.row(t);
    }
    A.triangularView<Eigen::UnitLower>().solveInPlace(X);
    // pass 3: new values N = U - W S^T (S^T stored: W S^T = W * S)
    auto N = cw.nv.topRows(c);
    N.noalias() = X.leftCols(d);
    N.noalias() -= X.rightCols(d) * S;
    // pass 4: outputs of the group's query heads
    auto P = cw.p.topLeftCorner(c, c);
    for (int64_t h = 0; h < io.nq; ++h) {
      for (int64_t t = 0; t < c; ++t)
        query_features(io.q[size_t(h)] + (c0 + t) * io.ldq, d, cw.qf.row(t).data());
      auto Q = cw.qf.topRows(c);
      MutMap O(io.out[size_t(h)] + c0 * io.ldo, c, d, Strided(io.ldo));
      O.noalias() = Q * S;
      P.triangularView<Eigen::Lower>() = Q * K.transpose();  // causal: the lower half only
      if (gated)
        for (int64_t t = 0; t < c; ++t) {
          const float gt = cw.lg[size_t(t)];
          O.row(t) *= std::exp(gt);
          for (int64_t i = 0; i <= t; ++i) P(t, i) *= std::exp(gt - cw.lg[size_t(i)]);
        }
      O.noalias() += P.triangularView<Eigen::Lower>() * N;
    }
    // pass 5: the state at the next chunk's start
    if (gated) {
      const float gc = cw.lg[size_t(c - 1)];
      for (int64_t t = 0; t < c; ++t) cw.kr.row(t) = std::exp(gc - cw.lg[size_t(t)]) * K.row(t);
      S *= std::exp(gc);
      S.noalias() += cw.kr.topRows(c).transpose() * N;
    } else {
      S.noalias() += K.transpose() * N;
    }
  }
}

bool is_gated(const Variant& v) { return v.params().get_bool("gated"); }

// ---- the backward pass ----

/// Where one (batch, key/value head)'s gradients of its given beta and log decay rows go (n
/// entries each, backward_inputs), or null: for a stood-in row they go into dk instead.
struct RowGrads {
  float *beta = nullptr, *g = nullptr;
};

/// Row t of the group's query heads: dq'_h = S_t^T do_h, taken back through the query's
/// normalisation into dq, and dS += do_h q'_h^T (dS^T += q'_h do_h^T). sn: S_t^T; qf, dqf:
/// d floats of scratch each.
void outputs_backward(const HeadIo& io, int64_t t, int64_t d, const float* sn, float* ds,
                      const std::vector<const float*>& dout, int64_t lddo,
                      const std::vector<float*>& dq, int64_t lddq, float* qf, float* dqf) {
  const int64_t dp = padded(d);
  for (int64_t h = 0; h < io.nq; ++h) {
    const float* q = io.q[size_t(h)] + t * io.ldq;
    const float* gout = dout[size_t(h)] + t * lddo;
    const float qnorm = query_features(q, d, qf);
    for (int64_t j = 0; j < d; ++j) {
      dqf[j] = dot(sn + j * dp, gout, d);
      float* r = ds + j * dp;
      const float qj = qf[j];
#pragma omp simd
      for (int64_t l = 0; l < d; ++l) r[l] += qj * gout[l];
    }
    // through q' = q / (|q| sqrt(d)): dq = (dq'' - q^ (q^ . dq'')) / |q|, dq'' = dq' / sqrt(d)
    float* out = dq[size_t(h)] + t * lddq;
    if (qnorm > 0) {
      const float rs = 1.0f / std::sqrt(float(d));
      const float proj = dot(qf, dqf, d);
      // q^ = sqrt(d) q', dq'' = rs dq'
      for (int64_t j = 0; j < d; ++j) out[j] = rs * (dqf[j] - float(d) * qf[j] * proj) / qnorm;
    } else {
      std::fill(out, out + d, 0.0f);
    }
  }
}

/// dk of row t (into dkr) from dk^ = dkn, dbeta and dalpha: through k^ = k / |k|, and through
/// the stand-ins beta = sigmoid(k.w_b + b_b), alpha = exp(-softplus(k.w_a + b_a)) of the rows
/// not given; a given row's dbeta and dlog alpha = dalpha alpha go to rg instead.
void key_backward(const HeadIo& io, const RowGrads& rg, int64_t t, int64_t d, const Weights& w,
                  bool gated, const KeyFeatures& f, const float* kn, const float* dkn, float dbeta,
                  float dalpha, float* dkr) {
  const float* k = io.k + t * io.ldk;
  const float beta = f.beta, alpha = std::exp(f.log_alpha);
  const float proj = dot(kn, dkn, d);
  const float inv = f.norm > 0 ? 1.0f / f.norm : 0.0f;
  float cb = 0, ca = 0;
  if (io.beta)
    rg.beta[t] = dbeta;
  else
    cb = dbeta * beta * (1.0f - beta);
  if (gated && io.g) {
    rg.g[t] = dalpha * alpha;
  } else if (gated) {
    float za = kDecayBias;
    for (int64_t j = 0; j < d; ++j) za += k[j] * w.wa[size_t(j)];
    ca = -dalpha * alpha * sigmoid(za);
  }
  for (int64_t j = 0; j < d; ++j)
    dkr[j] = (dkn[j] - kn[j] * proj) * inv + cb * w.wb[size_t(j)] + ca * w.wa[size_t(j)];
}

/// One (batch, key/value head) of the backward: dq for its group's query heads (rows of dout
/// and dq per head), dk and dv for its key/value rows, and the gradients of its given beta and
/// log decay rows into rg (backward_inputs).
void backward_head(const Problem& p, const HeadIo& io, const std::vector<const float*>& dout,
                   int64_t lddo, const std::vector<float*>& dq, int64_t lddq, float* dk,
                   int64_t lddk, float* dv, int64_t lddv, int64_t C, const Weights& w, bool gated,
                   const RowGrads& rg) {
  const int64_t n = p.n, d = p.dim, dp = padded(d), sz = d * dp;
  const int64_t chunks = (n + C - 1) / C;
  auto floats = [](int64_t count) { return std::vector<float>(static_cast<size_t>(count), 0.0f); };
  std::vector<float> ck = floats(chunks * sz), states = floats((C + 1) * sz), ds = floats(sz);
  std::vector<float> kn = floats(dp), work = floats(3 * dp), qf = floats(dp), g = floats(dp),
                     u = floats(dp), e = floats(dp), dkn = floats(dp), dqf = floats(dp);
  // pass 1: the recurrence forward, keeping the state at every chunk start
  {
    std::vector<float> st(size_t(sz), 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      std::copy(st.begin(), st.end(), ck.begin() + c * sz);
      for (int64_t t = c * C; t < std::min(n, (c + 1) * C); ++t) {
        const KeyFeatures f = row_features(io, t, d, w, gated, kn.data());
        delta_step(st.data(), d, dp, kn.data(), io.v + t * io.ldv, f.beta, std::exp(f.log_alpha), 0,
                   nullptr, nullptr, work.data());
      }
    }
  }
  // pass 2: chunks in reverse; each chunk's states again, then the reverse recurrence
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t t0 = c * C, t1 = std::min(n, t0 + C);
    std::copy(ck.begin() + c * sz, ck.begin() + (c + 1) * sz, states.begin());
    for (int64_t t = t0; t < t1; ++t) {
      float* next = states.data() + (t - t0 + 1) * sz;
      std::copy(next - sz, next, next);
      const KeyFeatures f = row_features(io, t, d, w, gated, kn.data());
      delta_step(next, d, dp, kn.data(), io.v + t * io.ldv, f.beta, std::exp(f.log_alpha), 0,
                 nullptr, nullptr, work.data());
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const float* sn = states.data() + (t - t0 + 1) * sz;  // S_t^T
      const float* so = sn - sz;                            // S_{t-1}^T
      const float* v = io.v + t * io.ldv;
      const KeyFeatures f = row_features(io, t, d, w, gated, kn.data());
      const float beta = f.beta, alpha = std::exp(f.log_alpha);
      outputs_backward(io, t, d, sn, ds.data(), dout, lddo, dq, lddq, qf.data(), dqf.data());
      // g = dS k^ and u = S_{t-1} k^ in one pass; e = v - alpha u
      state_times(ds.data(), d, dp, kn.data(), g.data());
      state_times(so, d, dp, kn.data(), u.data());
      for (int64_t l = 0; l < d; ++l) e[size_t(l)] = v[l] - alpha * u[size_t(l)];
      const float dbeta = dot(e.data(), g.data(), d);
      float* dvr = dv + t * lddv;
      for (int64_t l = 0; l < d; ++l) dvr[l] = beta * g[size_t(l)];
      // dk^_j = beta (dS^T e)_j - beta alpha (S_{t-1}^T g)_j; dalpha = <dS, S_{t-1}> - beta g.u;
      // dS_{t-1} = alpha (dS - beta g k^^T)
      float dalpha = -beta * dot(g.data(), u.data(), d);
      for (int64_t j = 0; j < d; ++j) {
        float* r = ds.data() + j * dp;
        const float* s = so + j * dp;
        dkn[size_t(j)] = beta * (dot(r, e.data(), d) - alpha * dot(s, g.data(), d));
        dalpha += dot(r, s, d);
        const float bk = beta * kn[size_t(j)];
#pragma omp simd
        for (int64_t l = 0; l < d; ++l) r[l] = alpha * (r[l] - bk * g[size_t(l)]);
      }
      key_backward(io, rg, t, d, w, gated, f, kn.data(), dkn.data(), dbeta, dalpha, dk + t * lddk);
    }
  }
}

// ---- decode ----

class DeltaState final : public DecodeState {
 public:
  DeltaState(const Problem& p, Weights w, bool gated)
      : p_(p),
        w_(std::move(w)),
        gated_(gated),
        dp_(padded(p.dim)),
        st_(size_t(p.batch * p.kv_head_count() * p.dim * dp_), 0.0f) {}

  float* state(int64_t b, int64_t g) {
    return st_.data() + (b * p_.kv_head_count() + g) * p_.dim * dp_;
  }
  int64_t& len() { return len_; }

  int64_t length() const override { return len_; }

  /// The inputs the prefill was given (input_names), which every step takes too.
  std::string& given() { return given_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step_inputs(given_, nullptr);
    advance(q, k, v, nullptr, out);
  }

  void step_given(ConstTensorView q, ConstTensorView k, ConstTensorView v, const ExtraInputs& in,
                  TensorView out) override {
    check_step_inputs(given_, &in);
    advance(q, k, v, &in, out);
  }

  double state_bytes() const override { return 4.0 * double(p_.kv_head_count() * p_.dim * dp_); }
  double step_bytes_read() const override {
    return 4.0 * double(p_.batch) *
           (double(p_.kv_head_count()) * double(p_.dim * dp_ + 2 * p_.dim) +
            double(p_.heads * p_.dim));
  }
  double step_flops() const override {
    const double d = double(p_.dim);
    return double(p_.batch) * (double(p_.kv_head_count()) * (4.0 * d * d + 12.0 * d) +
                               double(p_.heads) * (2.0 * d * d + 6.0 * d));
  }

 private:
  // One token: the recurrent step of every (batch, key/value head), with the token's given
  // beta and g ([B, G, 1] each) when `in` holds them.
  void advance(ConstTensorView q, ConstTensorView k, ConstTensorView v, const ExtraInputs* in,
               TensorView out) {
    check_step(len_, p_.n, Shape4{p_.batch, p_.heads, 1, p_.dim}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const SerialIfSmall small(step_flops());
    const int64_t G = p_.kv_head_count();
    const float* beta = in ? given_data(*in, "beta") : nullptr;
    const float* g = in && gated_ ? given_data(*in, "g") : nullptr;
#pragma omp parallel for schedule(static) if (p_.batch * G >= 2 * team_threads())
    for (int64_t bg = 0; bg < p_.batch * G; ++bg) {
      HeadIo io = head_io(p_, k, v, bg / G, bg % G, &q, &out);
      if (beta) io.beta = beta + bg;
      if (g) io.g = g + bg;
      recurrent_head(io, 0, 1, p_.dim, w_, gated_, state(bg / G, bg % G));
    }
    ++len_;
  }

  Problem p_;
  Weights w_;
  bool gated_;
  int64_t dp_;
  std::vector<float> st_;
  int64_t len_ = 0;
  std::string given_;
};

// ---- the variant ----

class DeltaNet final : public Variant, public RecomputeBackward<DeltaNet>, public Decoder {
 public:
  explicit DeltaNet(const ParamValues& pv)
      : gated_(pv.get_bool("gated")),
        chunkwise_(pv.get_choice("form") == "chunkwise"),
        chunk_(pv.get_int("chunk")) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const Weights w = deltanet_weights(p);
    const int64_t G = p.kv_head_count(), d = p.dim, C = std::min(chunk_, p.n);
    struct Scratch {
      std::vector<float> st;          // the state S^T of one head
      std::unique_ptr<ChunkWork> cw;  // the chunkwise form's buffers
    };
    parallel_for(
        p.batch * G,
        [&] {
          return Scratch{std::vector<float>(size_t(d * padded(d))),
                         chunkwise_ ? std::make_unique<ChunkWork>(C, d) : nullptr};
        },
        [&](int64_t bg, Scratch& s) {
          HeadIo io = head_io(p, k, v, bg / G, bg % G, &q, &out);
          given_rows(p, bg, io);
          std::fill(s.st.begin(), s.st.end(), 0.0f);
          if (chunkwise_)
            chunkwise_head(io, p.n, d, C, w, gated_, s.st.data(), *s.cw);
          else
            recurrent_head(io, 0, p.n, d, w, gated_, s.st.data());
        });
  }

  /// The given beta and g of (batch, key/value head) bg ([B, G, n] each) into io.
  void given_rows(const Problem& p, int64_t bg, HeadIo& io) const {
    if (const float* beta = input(p, "beta")) io.beta = beta + bg * p.n;
    if (const float* g = gated_ ? input(p, "g") : nullptr) io.g = g + bg * p.n;
  }

  double flops(const Problem& p) const override {
    const double d = double(p.dim), n = double(p.n), G = double(p.batch * p.kv_head_count()),
                 H = double(p.batch * p.heads);
    if (!chunkwise_) return G * n * (4.0 * d * d + 12.0 * d) + H * n * (2.0 * d * d + 6.0 * d);
    const double C = double(std::min<int64_t>(chunk_, p.n));
    // per key: the lower half of K K^T (C d), the solve (2 C d), N (2 d^2 + d), the state
    // (2 d^2); per query head and row: Q S (2 d^2), the lower halves of Q K^T and P N (2 C d)
    return G * n * (3.0 * C * d + 4.0 * d * d + 8.0 * d) + H * n * (2.0 * d * d + 2.0 * C * d);
  }

  double memory_estimate(const Problem& p) const override {
    const int64_t d = p.dim;
    const double per_thread = chunkwise_ ? ChunkWork::floats(chunk_, d) : double(5 * padded(d));
    return 4.0 * double(team_threads()) * (per_thread + double(d * padded(d)));
  }

  // ---- Backward ----

  // Nothing saved (RecomputeBackward): the backward runs the recurrence again.
  void recompute_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          ConstTensorView /*out*/, ConstTensorView dout, TensorView dq,
                          TensorView dk, TensorView dv) {
    backward_pass(p, q, k, v, dout, dq, dk, dv, nullptr, nullptr);
  }

  // The given beta and g: dL/dbeta_t and dL/dlog alpha_t = alpha_t dL/dalpha_t per key/value
  // head, which the backward forms for every row anyway (for a stood-in row it takes them on
  // into dk). Each key/value head's rows serve its whole group of query heads, whose
  // contributions the backward of that head already sums.
  bool gives_input_grads() const override { return true; }
  void backward_inputs(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       ConstTensorView /*out*/, ConstTensorView dout, const SavedState& saved,
                       TensorView dq, TensorView dk, TensorView dv, InputGrads& dinputs) override {
    NothingSaved::expect(saved, info().name.c_str());
    const size_t rows = size_t(p.batch * p.kv_head_count() * p.n);
    auto grad_of = [&](const char* name) -> float* {
      if (!input(p, name)) return nullptr;
      std::vector<float>& x = dinputs[name];
      x.assign(rows, 0.0f);
      return x.data();
    };
    float* dbeta = grad_of("beta");
    float* dg = gated_ ? grad_of("g") : nullptr;
    backward_pass(p, q, k, v, dout, dq, dk, dv, dbeta, dg);
  }

  /// The backward of every (batch, key/value head); dbeta and dg ([B, G, n]) receive the
  /// gradients of the given beta and g (null: not given).
  void backward_pass(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     ConstTensorView dout, TensorView dq, TensorView dk, TensorView dv,
                     float* dbeta, float* dg) const {
    const Weights w = deltanet_weights(p);
    const int64_t G = p.kv_head_count(), grp = p.kv_group(), C = std::min(chunk_, p.n);
    parallel_for(p.batch * G, [&](int64_t bg) {
      const int64_t b = bg / G, g = bg % G;
      HeadIo io = head_io(p, k, v, b, g, &q, nullptr);
      given_rows(p, bg, io);
      const RowGrads rg{io.beta ? dbeta + bg * p.n : nullptr, io.g ? dg + bg * p.n : nullptr};
      std::vector<const float*> douts;
      std::vector<float*> dqs;
      for (int64_t r = 0; r < grp; ++r) {
        douts.push_back(dout.head(b, g * grp + r));
        dqs.push_back(dq.head(b, g * grp + r));
      }
      backward_head(p, io, douts, dout.stride_row, dqs, dq.stride_row, dk.head(b, g * grp),
                    dk.stride_row, dv.head(b, g * grp), dv.stride_row, C, w, gated_, rg);
      // the group's other query heads: their share is in the first one's rows
      for (int64_t r = 1; r < grp; ++r)
        for (int64_t t = 0; t < p.n; ++t) {
          std::fill(dk.row(b, g * grp + r, t), dk.row(b, g * grp + r, t) + p.dim, 0.0f);
          std::fill(dv.row(b, g * grp + r, t), dv.row(b, g * grp + r, t) + p.dim, 0.0f);
        }
    });
  }

  double backward_flops(const Problem& p) const override {
    const double d = double(p.dim), n = double(p.n), G = double(p.batch * p.kv_head_count()),
                 H = double(p.batch * p.heads);
    // per key: the forward recurrence twice (4 d^2 each), g, u (4 d^2), the row pass (8 d^2);
    // per query head and row: dq' and dS (4 d^2)
    return G * n * 20.0 * d * d + H * n * 4.0 * d * d;
  }
  double backward_memory_estimate(const Problem& p) const override {
    const int64_t d = p.dim, dp = padded(d), C = std::min(chunk_, p.n);
    const double per_head = double((p.n + C - 1) / C + C + 2) * double(d * dp) + 12.0 * double(dp);
    return 4.0 * double(std::min<int64_t>(team_threads(), p.batch * p.kv_head_count())) * per_head;
  }

  // ---- Decoder ----

  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override {
    if (p.extra_inputs && !p.extra_inputs->empty())  // the problem's own inputs, n rows
      return prefill_given(p, k, v, t0, *p.extra_inputs);
    return prefill_with(p, k, v, t0, ExtraInputs{});
  }

  bool decodes_inputs() const override { return true; }
  std::unique_ptr<DecodeState> prefill_given(const Problem& p, ConstTensorView k, ConstTensorView v,
                                             int64_t t0, const ExtraInputs& in) override {
    if (in.empty() || (!gated_ && in.count("g")))
      throw UnsupportedError(fmt::format("{}: a decode prefill takes beta{} (given: {})", spec(),
                                         gated_ ? " and g" : "", input_names(in)));
    return prefill_with(p, k, v, t0, in);
  }

  // The state after rows 0 .. t0 - 1, with the given beta and g of `in` ([B, G, >= t0] each).
  std::unique_ptr<DecodeState> prefill_with(const Problem& p, ConstTensorView k, ConstTensorView v,
                                            int64_t t0, const ExtraInputs& in) {
    check_prefill(p, k, v, t0);
    const Weights w = deltanet_weights(p);
    Problem plain = p;
    plain.extra_inputs.reset();
    auto state = std::make_unique<DeltaState>(plain, w, gated_);
    const int64_t G = p.kv_head_count(), C = std::min<int64_t>(chunk_, std::max<int64_t>(t0, 1));
    const float* beta = given_data(in, "beta");
    const float* g = gated_ ? given_data(in, "g") : nullptr;
    const int64_t rows = in.empty() ? 0 : in.begin()->second.shape[2];
    parallel_for(
        p.batch * G, [&] { return ChunkWork(C, p.dim); },
        [&](int64_t bg, ChunkWork& cw) {
          HeadIo io = head_io(p, k, v, bg / G, bg % G, nullptr, nullptr);
          if (beta) io.beta = beta + bg * rows;
          if (g) io.g = g + bg * rows;
          chunkwise_head(io, t0, p.dim, C, w, gated_, state->state(bg / G, bg % G), cw);
        });
    state->len() = t0;
    state->given() = input_names(in);
    return state;
  }

  double prefill_flops(const Problem& p, int64_t t0) const override {
    const double d = double(p.dim), C = double(std::min<int64_t>(chunk_, std::max<int64_t>(t0, 1)));
    return double(p.batch * p.kv_head_count()) * double(t0) * (3.0 * C * d + 4.0 * d * d + 8.0 * d);
  }

 private:
  bool gated_, chunkwise_;
  int64_t chunk_;
};

// The recurrence in double, step by step, for each query head over its key/value head's rows
// (the same float weights as the variant).
std::vector<double> deltanet_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                    ConstTensorView k, ConstTensorView v) {
  const bool gated = is_gated(var);
  const Weights w = deltanet_weights(p);
  const int64_t d = p.dim;
  const float* given_beta = var.input(p, "beta");
  const float* given_g = gated ? var.input(p, "g") : nullptr;
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    const int64_t row0 = (b * p.kv_head_count() + p.kv_head(h)) * p.n;
    const oracle::Matrix Q = oracle::head(q, b, h), K = oracle::head(k, b, h),
                         V = oracle::head(v, b, h);
    oracle::Matrix S(d, d), O(p.n, d);  // S: rows over the value dimension
    std::vector<double> kn(static_cast<size_t>(d)), qn(kn), u(kn);
    for (int64_t t = 0; t < p.n; ++t) {
      double ss = 0, zb = kBetaBias, za = kDecayBias, qs = 0;
      for (int64_t j = 0; j < d; ++j) {
        ss += K(t, j) * K(t, j), qs += Q(t, j) * Q(t, j);
        zb += K(t, j) * double(w.wb[size_t(j)]), za += K(t, j) * double(w.wa[size_t(j)]);
      }
      const double inv = ss > 0 ? 1.0 / std::sqrt(ss) : 0.0;
      const double qinv = qs > 0 ? 1.0 / (std::sqrt(qs) * std::sqrt(double(d))) : 0.0;
      for (int64_t j = 0; j < d; ++j) kn[size_t(j)] = K(t, j) * inv, qn[size_t(j)] = Q(t, j) * qinv;
      const double beta = given_beta ? double(given_beta[row0 + t]) : 1.0 / (1.0 + std::exp(-zb));
      const double alpha =
          !gated    ? 1.0
          : given_g ? std::exp(double(given_g[row0 + t]))
                    : std::exp(-(std::max(za, 0.0) + std::log1p(std::exp(-std::abs(za)))));
      for (int64_t l = 0; l < d; ++l) {
        double s = 0;
        for (int64_t j = 0; j < d; ++j) s += S(l, j) * kn[size_t(j)];
        u[size_t(l)] = s;
      }
      for (int64_t l = 0; l < d; ++l) {
        const double e = beta * (V(t, l) - alpha * u[size_t(l)]);
        double o = 0;
        for (int64_t j = 0; j < d; ++j) {
          S(l, j) = alpha * S(l, j) + e * kn[size_t(j)];
          o += S(l, j) * qn[size_t(j)];
        }
        O(t, l) = o;
      }
    }
    return O;
  });
}

ATTNBENCH_REGISTER_VARIANT(
    deltanet,
    VariantInfo{
        .name = "deltanet",
        .summary =
            "delta rule linear attention, S_t = a_t S (I - b_t k k^T) + b_t v k^T, L2-normed "
            "q, k (Yang et al. 2024; gated: Gated DeltaNet); beta, alpha: seeded "
            "projections of k standing in for x; causal only; not softmax",
        .complexity = "time O(n d (d + C)), memory O(threads C (C + d) + d^2)",
        .family = "decay",
        .display = "DeltaNet",
        .paper = "Schlag et al. 2021 (arXiv:2102.11174); "
                 "chunkwise: Yang et al. 2024 (arXiv:2406.06484); "
                 "gated: Yang et al. 2024 (arXiv:2412.06464)",
        .look = {.color = "#d6616b", .marker = "^"},
        .long_context = true,
        .sweep_specs = {"deltanet:gated=true", "deltanet:form=recurrent"},
        .params = {ParamSpec::Bool("gated", false,
                                   "Gated DeltaNet: decay alpha_t = exp(-softplus(k.w_a - 2.5))"),
                   ParamSpec::Choice("form", "chunkwise", {"chunkwise", "recurrent"},
                                     "chunkwise: WY/UT form with GEMMs; recurrent: token by "
                                     "token in float32"),
                   ParamSpec::Int("chunk", 64, 1, 4096,
                                  "tokens per chunk (chunkwise form; the backward's checkpoint "
                                  "spacing)")},
        .inputs = {{.name = "beta",
                    .dims = {"B", "G", "n"},
                    .help = "write strength beta_t per token and key/value head, in (0, 1)",
                    .stand_in = "sigmoid(k_t . w_b), w_b seeded",
                    .min = 0,
                    .max = 1},
                   {.name = "g",
                    .dims = {"B", "G", "n"},
                    .help = "log decay log alpha_t per token and key/value head (<= 0)",
                    .stand_in = "-softplus(k_t . w_a - 2.5), w_a seeded",
                    .max = 0,
                    .when = "gated=true"}},
        .caps = {.causal = true, .cross = false, .exact = false, .causal_only = true},
        .make = [](const ParamValues& pv) { return std::make_unique<DeltaNet>(pv); },
        .oracle = deltanet_oracle});

}  // namespace
}  // namespace attnbench
