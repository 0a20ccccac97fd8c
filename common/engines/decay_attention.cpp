// The decayed linear attention engine (common/engines/decay_attention.h).
#include "common/engines/decay_attention.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"
#include "common/core/random.h"
#include "common/core/threads.h"
#include "common/kernels/simd.h"
#include "common/reference/oracle.h"

namespace attnbench::decay_attention {
namespace {

// Random streams of the gate's projections (common/core/random.h).
constexpr uint64_t kStreamW1 = 0x67'6c'61'31;  // "gla1"
constexpr uint64_t kStreamW2 = 0x67'6c'61'32;  // "gla2"
// Rows per sub-chunk of the gated intra-chunk products.
constexpr int64_t kSub = 16;
// Largest decay exponent a sub-chunk's keys may be scaled up by (e^60 < 2^87 of float range).
constexpr float kMaxExponent = 60.0f;

// x = exp(x), elementwise.
void exp_inplace(float* x, int64_t count) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
  for (; i + simd::kLanes <= count; i += simd::kLanes)
    _mm512_storeu_ps(x + i, simd::exp2_ps(_mm512_mul_ps(log2e, _mm512_loadu_ps(x + i))));
#endif
  for (; i < count; ++i) x[i] = std::exp(x[i]);
}

// log(sigmoid(z)) without overflow.
template <class T>
T log_sigmoid(T z) {
  return std::min(z, T(0)) - std::log1p(std::exp(-std::abs(z)));
}

// One state's sequence: its keys and values, the query heads reading it and their outputs.
struct Seq {
  int64_t n = 0, d = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t ks = 0, vs = 0, qs = 0, os = 0;  // row strides
  std::vector<const float*> q;             // one per query head of the state
  std::vector<float*> o;                   // outputs (empty: fold the state only)
  float gamma = 1;                         // retention's decay
  const Gate* gate = nullptr;              // gla's stand-in (then gamma is unused)
  const float* g = nullptr;                // gla's given log decays, n x d (no gate then)
  bool gated() const { return gate != nullptr || g != nullptr; }
};

// log a of rows t .. t + rows - 1 of x, rows x d: the given g's rows, else the gate's.
void log_decay_rows(const Seq& x, int64_t t, int64_t rows, float* out) {
  if (x.g)
    std::copy(x.g + t * x.d, x.g + (t + rows) * x.d, out);
  else
    x.gate->log_decay(x.k + t * x.ks, x.ks, rows, out);
}

// The states of p under `decay`: (batch, query head) for retention, (batch, kv head) for gla.
int64_t state_heads(const Problem& p, const Decay& decay) {
  return decay.shared() ? p.kv_head_count() : p.heads;
}

Seq make_seq(const Problem& p, const Decay& decay, int64_t b, int64_t s, ConstTensorView q,
             ConstTensorView k, ConstTensorView v, TensorView* out) {
  Seq x;
  x.n = p.n;
  x.d = p.dim;
  const int64_t first = decay.shared() ? s * p.kv_group() : s;
  const int64_t nq = decay.shared() ? p.kv_group() : 1;
  x.k = k.head(b, first);
  x.v = v.head(b, first);
  x.ks = k.stride_row;
  x.vs = v.stride_row;
  if (q.data) {
    x.qs = q.stride_row;
    for (int64_t h = first; h < first + nq; ++h) x.q.push_back(q.head(b, h));
  }
  if (out) {
    x.os = out->stride_row;
    for (int64_t h = first; h < first + nq; ++h) x.o.push_back(out->head(b, h));
  }
  if (decay.shared()) {
    x.gate = decay.gate.get();
    if (decay.given)
      x.g = decay.given +
            (b * p.kv_head_count() + s) * (decay.given_rows ? decay.given_rows : p.n) * p.dim;
  } else {
    x.gamma = decay.gamma[size_t(s)];
  }
  return x;
}

// body(b, s) for every state, OpenMP over them when there are at least as many as threads and
// `parallel` (BLAS single-threaded inside the region), else serially (BLAS multi-threaded).
template <class Body>
void for_each_state(int64_t batch, int64_t states, const Body& body, bool parallel = true) {
  const int64_t count = batch * states;
  parallel_for(count, [&](int64_t i) { body(i / states, i % states); },
               {.parallel = parallel && count >= team_threads()});
}

// Value columns per register block of the fused step.
constexpr int64_t kBlock = 16;

// One token: S = diag(a) S + k v^T and o_h = scale S^T q_h for each of the nq query heads, the
// row of S read once (a null: gamma on every dimension; o null: the update only). With one
// query head the columns go by blocks of 16: the block's outputs stay in a register while the
// d rows pass, so S is loaded and stored once and the output once per block.
void step(int64_t d, float scale, float* __restrict S, const float* a, float gamma,
          const float* __restrict k, const float* __restrict v, int64_t nq, const float* const* q,
          float* const* o) {
  int64_t e0 = 0;
  if (o && nq == 1) {
    const float* __restrict qv = q[0];
    float* __restrict out = o[0];
    for (; e0 + kBlock <= d; e0 += kBlock) {
      float acc[kBlock] = {}, vb[kBlock];
      for (int64_t e = 0; e < kBlock; ++e) vb[e] = v[e0 + e];
      for (int64_t c = 0; c < d; ++c) {
        const float ac = a ? a[c] : gamma, kc = k[c], qc = scale * qv[c];
        float* __restrict row = S + c * d + e0;
#pragma omp simd
        for (int64_t e = 0; e < kBlock; ++e) {
          const float x = ac * row[e] + kc * vb[e];
          row[e] = x;
          acc[e] += qc * x;
        }
      }
      for (int64_t e = 0; e < kBlock; ++e) out[e0 + e] = acc[e];
    }
  }
  // the remaining columns (all of them with several query heads or none)
  if (e0 == d) return;
  if (o)
    for (int64_t h = 0; h < nq; ++h) std::fill(o[h] + e0, o[h] + d, 0.0f);
  for (int64_t c = 0; c < d; ++c) {
    const float ac = a ? a[c] : gamma, kc = k[c];
    float* __restrict row = S + c * d;
#pragma omp simd
    for (int64_t e = e0; e < d; ++e) row[e] = ac * row[e] + kc * v[e];
    if (!o) continue;
    for (int64_t h = 0; h < nq; ++h) {
      const float qc = scale * q[h][c];
      float* __restrict out = o[h];
#pragma omp simd
      for (int64_t e = e0; e < d; ++e) out[e] += qc * row[e];
    }
  }
}

// Gate rows at a time of the recurrent form.
constexpr int64_t kGateRows = 64;

// The recurrent form over rows 0 .. n - 1 of x, state S (in and out).
void recurrent(const Seq& x, float scale, float* S) {
  const int64_t d = x.d, nq = int64_t(x.q.size());
  std::vector<float> a(size_t(x.gated() ? kGateRows * d : 0));
  std::vector<const float*> q(static_cast<size_t>(nq));
  std::vector<float*> o(static_cast<size_t>(nq));
  for (int64_t t = 0; t < x.n; ++t) {
    const float* at = nullptr;
    if (x.gated()) {
      const int64_t r = t % kGateRows;
      if (r == 0) {
        const int64_t rows = std::min(kGateRows, x.n - t);
        log_decay_rows(x, t, rows, a.data());
        exp_inplace(a.data(), rows * d);
      }
      at = a.data() + r * d;
    }
    for (int64_t h = 0; h < nq; ++h) {
      q[size_t(h)] = x.q[size_t(h)] + t * x.qs;
      if (!x.o.empty()) o[size_t(h)] = x.o[size_t(h)] + t * x.os;
    }
    step(d, scale, S, at, x.gamma, x.k + t * x.ks, x.v + t * x.vs, nq, q.data(),
         x.o.empty() ? nullptr : o.data());
  }
}

// Working buffers of the chunkwise form (one state at a time).
struct ChunkWork {
  int64_t C, d;
  std::vector<float> a, mask, qt, kt, cum, e;
  int64_t mask_len = -1;  // rows the retention mask was built for
  ChunkWork(int64_t chunk, int64_t dim)
      : C(chunk),
        d(dim),
        a(size_t(chunk * chunk)),
        mask(size_t(chunk * chunk)),
        qt(size_t(chunk * dim)),
        kt(size_t(chunk * dim)),
        cum(size_t(chunk * dim)),
        e(size_t(dim)) {}
};

// Retention's chunk of L rows at t0: the masked product, the state's contribution, the state.
void retention_chunk(const Seq& x, float scale, int64_t t0, int64_t L, float* S, ChunkWork& w) {
  const int64_t d = x.d, C = w.C;
  const double gamma = x.gamma;
  const float* K = x.k + t0 * x.ks;
  const float* V = x.v + t0 * x.vs;
  if (!x.o.empty()) {
    if (w.mask_len != L) {  // scale gamma^(i - j) below the diagonal, 0 above
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < L; ++j)
          w.mask[size_t(i * C + j)] = j <= i ? float(scale * std::pow(gamma, double(i - j))) : 0.0f;
      w.mask_len = L;
    }
    for (size_t h = 0; h < x.q.size(); ++h) {
      const float* Q = x.q[h] + t0 * x.qs;
      float* O = x.o[h] + t0 * x.os;
      // 1. A = (Q K^T) o mask, O = A V
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(L), int(L), int(d), 1.0f, Q,
                  int(x.qs), K, int(x.ks), 0.0f, w.a.data(), int(C));
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < L; ++j) w.a[size_t(i * C + j)] *= w.mask[size_t(i * C + j)];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(L), int(d), int(L), 1.0f,
                  w.a.data(), int(C), V, int(x.vs), 0.0f, O, int(x.os));
      // 2. O += diag(scale gamma^(i + 1)) Q S
      for (int64_t i = 0; i < L; ++i) {
        const float f = float(scale * std::pow(gamma, double(i + 1)));
        for (int64_t c = 0; c < d; ++c) w.qt[size_t(i * d + c)] = f * Q[i * x.qs + c];
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(L), int(d), int(d), 1.0f,
                  w.qt.data(), int(d), S, int(d), 1.0f, O, int(x.os));
    }
  }
  // 3. S = gamma^L S + (diag(gamma^(L - 1 - j)) K)^T V
  for (int64_t j = 0; j < L; ++j) {
    const float f = float(std::pow(gamma, double(L - 1 - j)));
    for (int64_t c = 0; c < d; ++c) w.kt[size_t(j * d + c)] = f * K[j * x.ks + c];
  }
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(d), int(d), int(L), 1.0f, w.kt.data(),
              int(d), V, int(x.vs), float(std::pow(gamma, double(L))), S, int(d));
}

// Gated linear attention's chunk of L rows at t0 (the header's steps 1 to 3).
void gated_chunk(const Seq& x, float scale, int64_t t0, int64_t L, float* S, ChunkWork& w) {
  const int64_t d = x.d, C = w.C;
  const float* K = x.k + t0 * x.ks;
  const float* V = x.v + t0 * x.vs;
  // cum_i = sum of log a over rows 0 .. i of the chunk
  float* cum = w.cum.data();
  log_decay_rows(x, t0, L, cum);
  for (int64_t i = 1; i < L; ++i)
    for (int64_t c = 0; c < d; ++c) cum[i * d + c] += cum[(i - 1) * d + c];
  if (!x.o.empty()) {
    for (size_t h = 0; h < x.q.size(); ++h) {
      const float* Q = x.q[h] + t0 * x.qs;
      float* O = x.o[h] + t0 * x.os;
      // 1. O = scale (Q o exp(cum)) S
      std::copy(cum, cum + L * d, w.qt.data());
      exp_inplace(w.qt.data(), L * d);
      for (int64_t i = 0; i < L; ++i)
        for (int64_t c = 0; c < d; ++c) w.qt[size_t(i * d + c)] *= Q[i * x.qs + c];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(L), int(d), int(d), scale,
                  w.qt.data(), int(d), S, int(d), 0.0f, O, int(x.os));
    }
    // 2. intra-chunk, by sub-chunks [i0, i1) with the reference row r = i0 - 1
    for (int64_t i0 = 0; i0 < L; i0 += kSub) {
      const int64_t i1 = std::min(L, i0 + kSub), rows = i1 - i0;
      const float* ref = i0 > 0 ? cum + (i0 - 1) * d : nullptr;
      auto at_ref = [&](int64_t c) { return ref ? ref[c] : 0.0f; };
      float own = 0;  // the sub-chunk's largest decay exponent
      for (int64_t c = 0; c < d; ++c) own = std::max(own, at_ref(c) - cum[(i1 - 1) * d + c]);
      const bool direct = !(own <= kMaxExponent);  // element by element on the diagonal
      const int64_t keys = direct ? i0 : i1;       // keys through the factorised product
      // kt_j = K_j o exp(cum_r - cum_j)
      for (int64_t j = 0; j < keys; ++j)
        for (int64_t c = 0; c < d; ++c) w.kt[size_t(j * d + c)] = at_ref(c) - cum[j * d + c];
      exp_inplace(w.kt.data(), keys * d);
      for (int64_t j = 0; j < keys; ++j)
        for (int64_t c = 0; c < d; ++c) w.kt[size_t(j * d + c)] *= K[j * x.ks + c];
      for (size_t h = 0; h < x.q.size(); ++h) {
        const float* Q = x.q[h] + t0 * x.qs;
        float* O = x.o[h] + t0 * x.os;
        // qt_i = Q_i o exp(cum_i - cum_r)
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t c = 0; c < d; ++c)
            w.qt[size_t((i - i0) * d + c)] = cum[i * d + c] - at_ref(c);
        exp_inplace(w.qt.data(), rows * d);
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t c = 0; c < d; ++c) w.qt[size_t((i - i0) * d + c)] *= Q[i * x.qs + c];
        std::fill(w.a.begin(), w.a.begin() + rows * C, 0.0f);
        if (keys > 0)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(keys), int(d), scale,
                      w.qt.data(), int(d), w.kt.data(), int(d), 0.0f, w.a.data(), int(C));
        for (int64_t i = i0; i < i1; ++i) {
          float* arow = w.a.data() + (i - i0) * C;
          if (!direct) {
            std::fill(arow + i + 1, arow + i1, 0.0f);
            continue;
          }
          for (int64_t j = i0; j <= i; ++j) {
            for (int64_t c = 0; c < d; ++c) w.e[size_t(c)] = cum[i * d + c] - cum[j * d + c];
            exp_inplace(w.e.data(), d);
            float acc = 0;
            for (int64_t c = 0; c < d; ++c)
              acc += Q[i * x.qs + c] * K[j * x.ks + c] * w.e[size_t(c)];
            arow[j] = scale * acc;
          }
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(i1), 1.0f,
                    w.a.data(), int(C), V, int(x.vs), 1.0f, O + i0 * x.os, int(x.os));
      }
    }
  }
  // 3. S = diag(exp(cum_{L-1})) S + (K o exp(cum_{L-1} - cum_j))^T V
  const float* last = cum + (L - 1) * d;
  std::copy(last, last + d, w.e.data());
  exp_inplace(w.e.data(), d);
  for (int64_t c = 0; c < d; ++c)
    for (int64_t e = 0; e < d; ++e) S[c * d + e] *= w.e[size_t(c)];
  for (int64_t j = 0; j < L; ++j)
    for (int64_t c = 0; c < d; ++c) w.kt[size_t(j * d + c)] = last[c] - cum[j * d + c];
  exp_inplace(w.kt.data(), L * d);
  for (int64_t j = 0; j < L; ++j)
    for (int64_t c = 0; c < d; ++c) w.kt[size_t(j * d + c)] *= K[j * x.ks + c];
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(d), int(d), int(L), 1.0f, w.kt.data(),
              int(d), V, int(x.vs), 1.0f, S, int(d));
}

// The chunkwise form over rows 0 .. n - 1 of x, state S (in and out).
void chunkwise(const Seq& x, float scale, int64_t chunk, float* S) {
  const int64_t C = std::max<int64_t>(1, std::min(chunk, x.n));
  ChunkWork w(C, x.d);
  for (int64_t t0 = 0; t0 < x.n; t0 += C) {
    const int64_t L = std::min(C, x.n - t0);
    if (x.gated())
      gated_chunk(x, scale, t0, L, S, w);
    else
      retention_chunk(x, scale, t0, L, S, w);
  }
}

float scale_of(int64_t d) { return float(1.0 / std::sqrt(double(d))); }

}  // namespace

Gate::Gate(const Problem& p, int64_t r, double t, double b) : d(p.dim), rank(r), tau(t), bias(b) {
  w1.resize(size_t(d * rank));
  w2.resize(size_t(rank * d));
  const RandomStream s1(p.seed, kStreamW1), s2(p.seed, kStreamW2);
  const double f1 = 1.0 / std::sqrt(double(d)), f2 = 1.0 / std::sqrt(double(rank));
  for (size_t i = 0; i < w1.size(); ++i) w1[i] = float(f1 * s1.normal(i));
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = float(f2 * s2.normal(i));
}

void Gate::log_decay(const float* k, int64_t stride, int64_t rows, float* out) const {
  if (rows <= 0) return;
  // z = bias + (K W1) W2, two GEMMs
  std::vector<float> u(static_cast<size_t>(rows * rank)), t(static_cast<size_t>(d));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(rank), int(d), 1.0f, k,
              int(stride), w1.data(), int(rank), 0.0f, u.data(), int(rank));
  std::fill(out, out + rows * d, float(bias));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(rank), 1.0f,
              u.data(), int(rank), w2.data(), int(d), 1.0f, out, int(d));
  const float inv_tau = float(1.0 / tau);
  for (int64_t i = 0; i < rows; ++i) {
    float* z = out + i * d;
    // log sigmoid(z) = min(z, 0) - log1p(x), x = exp(-|z|) in (0, 1], with
    // log1p(x) = 2 atanh(s), s = x / (2 + x) <= 1/3: the odd series to s^15 (next term < 2e-9)
    for (int64_t e = 0; e < d; ++e) t[size_t(e)] = -std::abs(z[e]);
    exp_inplace(t.data(), d);
    for (int64_t e = 0; e < d; ++e) {
      const float x = t[size_t(e)], sv = x / (2.0f + x), s2 = sv * sv;
      float poly = 1.0f / 15;
      for (int m = 13; m >= 1; m -= 2) poly = poly * s2 + 1.0f / float(m);
      z[e] = inv_tau * (std::min(z[e], 0.0f) - 2.0f * sv * poly);
    }
  }
}

std::vector<double> Gate::log_decay(const float* k) const {
  const float* a1 = w1.data();
  const float* a2 = w2.data();
  std::vector<double> u(static_cast<size_t>(rank), 0.0), z(static_cast<size_t>(d), bias);
  for (int64_t c = 0; c < d; ++c)
    for (int64_t j = 0; j < rank; ++j) u[size_t(j)] += double(k[c]) * double(a1[c * rank + j]);
  for (int64_t j = 0; j < rank; ++j)
    for (int64_t e = 0; e < d; ++e) z[size_t(e)] += u[size_t(j)] * double(a2[j * d + e]);
  for (double& e : z) e = log_sigmoid(e) / tau;
  return z;
}

void Gate::backward(const float* k, const float* dlog, float* dk) const {
  const float* a1 = w1.data();
  const float* a2 = w2.data();
  std::vector<float> u(static_cast<size_t>(rank), 0.0f), z(static_cast<size_t>(d), float(bias)),
      du(static_cast<size_t>(rank), 0.0f);
  for (int64_t c = 0; c < d; ++c)
    for (int64_t j = 0; j < rank; ++j) u[size_t(j)] += k[c] * a1[c * rank + j];
  for (int64_t j = 0; j < rank; ++j)
    for (int64_t e = 0; e < d; ++e) z[size_t(e)] += u[size_t(j)] * a2[j * d + e];
  // d log(sigmoid(z)) / tau / dz = (1 - sigmoid(z)) / tau = sigmoid(-z) / tau
  const float inv_tau = float(1.0 / tau);
  for (int64_t e = 0; e < d; ++e) {
    const float dz = dlog[e] * inv_tau / (1.0f + std::exp(z[size_t(e)]));
    for (int64_t j = 0; j < rank; ++j) du[size_t(j)] += a2[j * d + e] * dz;
  }
  for (int64_t c = 0; c < d; ++c) {
    float acc = 0;
    for (int64_t j = 0; j < rank; ++j) acc += a1[c * rank + j] * du[size_t(j)];
    dk[c] += acc;
  }
}

void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
             TensorView out, const Decay& decay, Form form, int64_t chunk) {
  const float scale = scale_of(p.dim);
  for_each_state(p.batch, state_heads(p, decay), [&](int64_t b, int64_t s) {
    const Seq x = make_seq(p, decay, b, s, q, k, v, &out);
    std::vector<float> S(size_t(p.dim * p.dim), 0.0f);
    if (form == Form::recurrent)
      recurrent(x, scale, S.data());
    else
      chunkwise(x, scale, chunk, S.data());
  });
}

double forward_flops(const Problem& p, const Decay& decay, Form form, int64_t chunk) {
  const double n = double(p.n), d = double(p.dim), C = double(std::min(chunk, p.n));
  const double states = double(p.batch * state_heads(p, decay)), heads = double(p.batch * p.heads);
  const double gate = decay.gate ? states * n * decay.gate->flops() : 0.0;
  if (form == Form::recurrent) return gate + states * n * 2 * d * d + heads * n * 2 * d * d;
  // per query head: Q K^T and A V (2 C d each per row), Q S (2 d^2); per state: K^T V
  return gate + states * n * 2 * d * d + heads * n * (4 * C * d + 2 * d * d);
}

double forward_bytes(const Problem& p, const Decay& decay, Form form, int64_t chunk) {
  const double d = double(p.dim), C = double(std::min(chunk, p.n));
  const double per =
      4.0 * (d * d + (form == Form::recurrent ? (decay.shared() ? kGateRows * d : 0.0)
                                              : 2 * C * C + 3 * C * d + d));
  return per * double(std::min<int64_t>(team_threads(), p.batch * state_heads(p, decay)));
}

void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
              ConstTensorView dout, TensorView dq, TensorView dk, TensorView dv, const Decay& decay,
              int64_t chunk, float* dlog) {
  const int64_t n = p.n, d = p.dim, dd = d * d;
  const int64_t C = std::max<int64_t>(1, std::min(chunk, n)), chunks = (n + C - 1) / C;
  const float scale = scale_of(d);
  // one query head at a time (gla recomputes its key/value head's state per query head; the
  // caller sums a group's dk and dv)
  for_each_state(p.batch, p.heads, [&](int64_t b, int64_t h) {
    const float* K = k.head(b, h);
    const float* V = v.head(b, h);
    const float* Q = q.head(b, h);
    const float* dO = dout.head(b, h);
    // per-row decays a (n x d; one column of gamma for retention)
    std::vector<float> a;
    if (decay.gate) {
      a.resize(size_t(n * d));
      decay.gate->log_decay(K, k.stride_row, n, a.data());
      exp_inplace(a.data(), n * d);
    } else if (decay.given) {
      const float* g = decay.given + (b * p.kv_head_count() + p.kv_head(h)) * n * d;
      a.assign(g, g + n * d);
      exp_inplace(a.data(), n * d);
    }
    const float gamma = decay.shared() ? 1.0f : decay.gamma[size_t(h)];
    auto decay_row = [&](int64_t t) { return decay.shared() ? a.data() + t * d : nullptr; };
    // 1. the states before each chunk
    std::vector<float> bound(static_cast<size_t>(chunks * dd)), S(static_cast<size_t>(dd), 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      if (t % C == 0) std::copy(S.begin(), S.end(), bound.begin() + (t / C) * dd);
      step(d, scale, S.data(), decay_row(t), gamma, K + t * k.stride_row, V + t * v.stride_row, 1,
           nullptr, nullptr);
    }
    // 2. chunks in reverse: the chunk's states again, then its rows in reverse
    std::vector<float> states(static_cast<size_t>(C * dd)), dS(static_cast<size_t>(dd), 0.0f),
        dl(static_cast<size_t>(d));
    for (int64_t c = chunks - 1; c >= 0; --c) {
      const int64_t t0 = c * C, L = std::min(C, n - t0);
      const float* start = bound.data() + c * dd;
      for (int64_t i = 0; i < L; ++i) {
        float* st = states.data() + i * dd;
        std::copy(i == 0 ? start : st - dd, (i == 0 ? start : st - dd) + dd, st);
        step(d, scale, st, decay_row(t0 + i), gamma, K + (t0 + i) * k.stride_row,
             V + (t0 + i) * v.stride_row, 1, nullptr, nullptr);
      }
      for (int64_t i = L - 1; i >= 0; --i) {
        const int64_t t = t0 + i;
        const float* st = states.data() + i * dd;
        const float* prev = i == 0 ? start : st - dd;
        const float *qt = Q + t * q.stride_row, *gt = dO + t * dout.stride_row;
        const float *kt = K + t * k.stride_row, *vt = V + t * v.stride_row;
        float *dqt = dq.row(b, h, t), *dkt = dk.row(b, h, t), *dvt = dv.row(b, h, t);
        const float* at = decay_row(t);
        std::fill(dvt, dvt + d, 0.0f);
        for (int64_t r = 0; r < d; ++r) {
          float* __restrict ds = dS.data() + r * d;
          const float* __restrict sr = st + r * d;
          const float qr = scale * qt[r];
          float accq = 0, acck = 0, accl = 0;
          for (int64_t e = 0; e < d; ++e) {
            ds[e] += qr * gt[e];  // dS_t = scale q_t dO_t^T + diag(a_{t+1}) dS_{t+1}
            accq += sr[e] * gt[e];
            acck += ds[e] * vt[e];
            dvt[e] += ds[e] * kt[r];
          }
          dqt[r] = scale * accq;
          dkt[r] = acck;
          const float ar = at ? at[r] : gamma;
          if (at) {
            const float* __restrict pr = prev + r * d;
            for (int64_t e = 0; e < d; ++e) accl += ds[e] * pr[e];
            dl[size_t(r)] = ar * accl;  // dL/d log a = a dL/da
          }
          for (int64_t e = 0; e < d; ++e) ds[e] *= ar;
        }
        if (decay.gate) decay.gate->backward(kt, dl.data(), dkt);
        if (dlog && decay.given)  // the given g's gradient, this query head's share
          std::copy(dl.begin(), dl.end(), dlog + ((b * p.heads + h) * n + t) * d);
      }
    }
  });
}

double backward_flops(const Problem& p, const Decay& decay) {
  const double n = double(p.n), d = double(p.dim), heads = double(p.batch * p.heads);
  const double gate = decay.gate ? heads * n * 3 * decay.gate->flops() : 0.0;
  // two forward recurrences (4 d^2 each) and the reverse step (about 12 d^2)
  return gate + heads * n * 20 * d * d;
}

double backward_bytes(const Problem& p, const Decay& decay, int64_t chunk) {
  const double d = double(p.dim), n = double(p.n), C = double(std::min(chunk, p.n));
  // the states at chunk boundaries, one chunk's states, S and dS; gla: the decays (n x d)
  const double per = 4.0 * ((std::ceil(n / C) + C + 2) * d * d + (decay.shared() ? n * d : 0.0));
  return per * double(std::min<int64_t>(team_threads(), p.batch * p.heads));
}

namespace {

class DecayState final : public DecodeState {
 public:
  DecayState(const Problem& p, const Decay& decay)
      : p_(p), decay_(decay), given_(decay.given != nullptr), states_(state_heads(p, decay)) {
    S_.assign(size_t(p.batch * states_ * p.dim * p.dim), 0.0f);
    p_.extra_inputs.reset();  // the steps' own come with each step
  }

  float* state(int64_t b, int64_t s) { return S_.data() + (b * states_ + s) * p_.dim * p_.dim; }

  void prefill(ConstTensorView k, ConstTensorView v, int64_t t0, int64_t chunk) {
    Problem head = p_;
    head.n = head.m = t0;
    for_each_state(p_.batch, states_, [&](int64_t b, int64_t s) {
      Seq x = make_seq(head, decay_, b, s, ConstTensorView{}, k, v, nullptr);
      chunkwise(x, scale_of(p_.dim), chunk, state(b, s));
    });
    len_ = t0;
    decay_.given = nullptr;  // the prefill's; each step brings its own (step_given)
  }

  int64_t length() const override { return len_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step_inputs(given_ ? "g" : "", nullptr);
    advance(q, k, v, nullptr, out);
  }

  void step_given(ConstTensorView q, ConstTensorView k, ConstTensorView v, const ExtraInputs& in,
                  TensorView out) override {
    check_step_inputs(given_ ? "g" : "", &in);
    advance(q, k, v, in.at("g").data.data(), out);
  }

  double state_bytes() const override { return 4.0 * double(states_ * p_.dim * p_.dim); }
  double step_bytes_read() const override {
    return double(p_.batch) * (state_bytes() + 4.0 * double(p_.dim * (2 * p_.heads + 2 * states_)));
  }
  double step_flops() const override {
    const double d = double(p_.dim), b = double(p_.batch);
    return b * (double(states_) * (2 * d * d + (decay_.gate ? decay_.gate->flops() : 0.0)) +
                double(p_.heads) * 2 * d * d);
  }

 private:
  // One token: the step of every state, with its log decays g [B, G, 1, d] when given.
  void advance(ConstTensorView q, ConstTensorView k, ConstTensorView v, const float* g,
               TensorView out) {
    check_step(len_, p_.n, Shape4{p_.batch, p_.heads, 1, p_.dim}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const SerialIfSmall small(step_flops());
    const int64_t d = p_.dim;
    // a parallel region only when the step's work outweighs opening one (common/core/threads.h)
    const bool parallel = parallel_worth(step_flops(), p_.batch * states_);
    Decay given;  // the token's log decays, one row per state
    if (g) given.given = g, given.given_rows = 1;
    for_each_state(
        p_.batch, states_,
        [&](int64_t b, int64_t s) {
          Seq x = make_seq(p_, g ? given : decay_, b, s, q, k, v, &out);
          std::vector<float> a;
          if (x.g) {
            a.assign(x.g, x.g + d);
            exp_inplace(a.data(), d);
          } else if (x.gate) {
            a.resize(size_t(d));
            x.gate->log_decay(x.k, x.ks, 1, a.data());
            exp_inplace(a.data(), d);
          }
          decay_attention::step(d, scale_of(d), state(b, s), a.empty() ? nullptr : a.data(),
                                x.gamma, x.k, x.v, int64_t(x.q.size()), x.q.data(), x.o.data());
        },
        parallel);
    ++len_;
  }

  Problem p_;
  Decay decay_;
  bool given_;  // prefilled with given log decays: each step takes the token's (step_given)
  int64_t states_;
  int64_t len_ = 0;
  std::vector<float> S_;
};

}  // namespace

std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                     int64_t t0, const Decay& decay, int64_t chunk) {
  check_prefill(p, k, v, t0);
  auto st = std::make_unique<DecayState>(p, decay);
  st->prefill(k, v, t0, chunk);
  return st;
}

double prefill_flops(const Problem& p, int64_t t0, const Decay& decay, int64_t /*chunk*/) {
  const double d = double(p.dim), states = double(p.batch * state_heads(p, decay));
  return states * double(t0) * (2 * d * d + (decay.gate ? decay.gate->flops() : 0.0));
}

std::vector<double> recurrence_oracle(const Problem& p, ConstTensorView q, ConstTensorView k,
                                      ConstTensorView v, const Decay& decay) {
  const int64_t d = p.dim;
  const double scale = 1.0 / std::sqrt(double(d));
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    oracle::Matrix S(d, d), o(p.n, d);
    for (int64_t t = 0; t < p.n; ++t) {
      const float* kt = k.row(b, h, t);
      const float* vt = v.row(b, h, t);
      const float* qt = q.row(b, h, t);
      std::vector<double> a(static_cast<size_t>(d),
                            double(decay.shared() ? 1.0f : decay.gamma[size_t(h)]));
      if (decay.gate) {
        a = decay.gate->log_decay(kt);
        for (double& x : a) x = std::exp(x);
      } else if (decay.given) {
        const float* g = decay.given + ((b * p.kv_head_count() + p.kv_head(h)) * p.n + t) * d;
        for (int64_t c = 0; c < d; ++c) a[size_t(c)] = std::exp(double(g[c]));
      }
      for (int64_t c = 0; c < d; ++c)
        for (int64_t e = 0; e < d; ++e) S(c, e) = a[size_t(c)] * S(c, e) + double(kt[c]) * vt[e];
      for (int64_t c = 0; c < d; ++c)
        for (int64_t e = 0; e < d; ++e) o(t, e) += scale * double(qt[c]) * S(c, e);
    }
    return o;
  });
}

}  // namespace attnbench::decay_attention

namespace attnbench::decay_attention {

DecayVariant::DecayVariant(const ParamValues& pv)
    : form_(pv.get_choice("form") == "recurrent" ? Form::recurrent : Form::chunkwise),
      chunk_(pv.get_int("chunk")) {}

void DecayVariant::forward(const Problem& p, ConstTensorView q, ConstTensorView k,
                           ConstTensorView v, TensorView out) {
  decay_attention::forward(p, q, k, v, out, decay(p), form_, chunk_);
}

double DecayVariant::flops(const Problem& p) const {
  return forward_flops(p, decay(p), form_, chunk_);
}

double DecayVariant::memory_estimate(const Problem& p) const {
  return forward_bytes(p, decay(p), form_, chunk_);
}

// Saved: nothing; the backward recomputes the states from k and v.
std::unique_ptr<SavedState> DecayVariant::forward_train(const Problem& p, ConstTensorView q,
                                                        ConstTensorView k, ConstTensorView v,
                                                        TensorView out) {
  forward(p, q, k, v, out);
  return std::make_unique<NothingSaved>();
}

void DecayVariant::backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, ConstTensorView /*out*/, ConstTensorView dout,
                            const SavedState& saved, TensorView dq, TensorView dk, TensorView dv) {
  NothingSaved::expect(saved, info().name.c_str());
  decay_attention::backward(p, q, k, v, dout, dq, dk, dv, decay(p), chunk_);
}

void DecayVariant::backward_inputs(const Problem& p, ConstTensorView q, ConstTensorView k,
                                   ConstTensorView v, ConstTensorView /*out*/, ConstTensorView dout,
                                   const SavedState& saved, TensorView dq, TensorView dk,
                                   TensorView dv, InputGrads& dinputs) {
  NothingSaved::expect(saved, info().name.c_str());
  const Decay dc = decay(p);
  if (!dc.given) throw UsageError(fmt::format("{}: backward_inputs without a given g", spec()));
  // dL/dg per query head, then summed over the query heads that share a key/value head's g
  const int64_t n = p.n, d = p.dim, G = p.kv_head_count(), grp = p.kv_group();
  std::vector<float> per_head(size_t(p.batch * p.heads * n * d));
  decay_attention::backward(p, q, k, v, dout, dq, dk, dv, dc, chunk_, per_head.data());
  std::vector<float>& dg = dinputs["g"];
  dg.assign(size_t(p.batch * G * n * d), 0.0f);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* src = per_head.data() + (b * p.heads + h) * n * d;
      float* dst = dg.data() + (b * G + h / grp) * n * d;
      for (int64_t i = 0; i < n * d; ++i) dst[i] += src[i];
    }
}

double DecayVariant::backward_flops(const Problem& p) const {
  return decay_attention::backward_flops(p, decay(p));
}

double DecayVariant::backward_memory_estimate(const Problem& p) const {
  const Decay dc = decay(p);
  // with g given, backward_inputs also holds dL/dg per query head before the group sum
  const double per_head = dc.given ? 4.0 * double(p.batch * p.heads * p.n * p.dim) : 0.0;
  return backward_bytes(p, dc, chunk_) + per_head;
}

std::unique_ptr<DecodeState> DecayVariant::prefill(const Problem& p, ConstTensorView k,
                                                   ConstTensorView v, int64_t t0) {
  if (p.extra_inputs && !p.extra_inputs->empty())  // the problem's own inputs, n rows
    return prefill_given(p, k, v, t0, *p.extra_inputs);
  return decay_attention::prefill(p, k, v, t0, decay(p), chunk_);
}

std::unique_ptr<DecodeState> DecayVariant::prefill_given(const Problem& p, ConstTensorView k,
                                                         ConstTensorView v, int64_t t0,
                                                         const ExtraInputs& in) {
  const auto g = in.find("g");
  if (!decodes_inputs() || in.size() != 1 || g == in.end() || g->second.shape.size() != 4)
    throw UnsupportedError(fmt::format("{}: a decode prefill takes the input g alone (given: {})",
                                       spec(), input_names(in)));
  Problem plain = p;
  plain.extra_inputs.reset();
  Decay dc;
  dc.given = g->second.data.data();
  dc.given_rows = g->second.shape[2];
  return decay_attention::prefill(plain, k, v, t0, dc, chunk_);
}

double DecayVariant::prefill_flops(const Problem& p, int64_t t0) const {
  return decay_attention::prefill_flops(p, t0, decay(p), chunk_);
}

std::vector<ParamSpec> decay_params() {
  return {ParamSpec::Choice("form", "chunkwise", {"chunkwise", "recurrent"},
                            "chunkwise (masked products per chunk, state across chunks) or "
                            "recurrent (one token at a time, as the decode step)"),
          ParamSpec::Int("chunk", 64, 1, 4096, "rows per chunk of the chunkwise form")};
}

std::vector<double> decay_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                 ConstTensorView k, ConstTensorView v) {
  return recurrence_oracle(p, q, k, v, dynamic_cast<const DecayVariant&>(var).decay(p));
}

// The float32 chain of one output row: the products q.k (a reduction over d, in the masked
// product or through the state), the sums over the keys (the state accumulates up to n decayed
// terms, and the chunkwise form adds the state's and the chunk's parts: 2 n in quadrature), and
// the decays (exp of summed logs, powers of gamma, the gate's sigmoid: a dozen roundings). The
// gate's logits grow with the inputs' scale, as logits do.
double decay_tolerance(const Variant& /*var*/, const Problem& p, const Workload& w) {
  return kErrorMargin * float32_error(double(p.dim), logit_size(w), 2.0 * double(p.n), 16.0);
}

}  // namespace attnbench::decay_attention
