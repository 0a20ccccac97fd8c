#include "common/engines/feature_map_attention.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"
#include "common/core/random.h"
#include "common/core/threads.h"
#include "common/engines/feature_map_internal.h"
#include "common/kernels/simd.h"
#include "common/kernels/softmax.h"

namespace attnbench::feature_map {

using detail::Aligned;
using detail::KeyState;
using detail::round_up;

namespace {

[[maybe_unused]] constexpr float kLog2e = 1.44269504088896341f;

/// y[i] = exp(y[i] - s) for i < count.
inline void exp_shifted(float* y, int64_t count, float s) {
#ifdef __AVX512F__
  const __m512 l2e = _mm512_set1_ps(kLog2e), vs = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + simd::kLanes <= count; i += simd::kLanes) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(y + i), vs);
    _mm512_storeu_ps(y + i, simd::exp2_ps(_mm512_mul_ps(x, l2e)));
  }
  if (i < count) {
    const __mmask16 mk = simd::first_lanes(count - i);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, y + i), vs);
    _mm512_mask_storeu_ps(y + i, mk, simd::exp2_ps(_mm512_mul_ps(x, l2e)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  namespace v8 = simd::avx2;
  const __m256 l2e = _mm256_set1_ps(kLog2e), vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + v8::kLanes <= count; i += v8::kLanes) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(y + i), vs);
    _mm256_storeu_ps(y + i, v8::exp2_ps(_mm256_mul_ps(x, l2e)));
  }
  for (; i < count; ++i) y[i] = fast_exp(y[i] - s);
#else
  for (int64_t i = 0; i < count; ++i) y[i] = fast_exp(y[i] - s);
#endif
}

/// out[i] = elu(x[i]) + 1 = x > 0 ? x + 1 : exp(x).
inline void elu_plus_one(const float* x, int64_t count, float* out) {
#ifdef __AVX512F__
  const __m512 l2e = _mm512_set1_ps(kLog2e), one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; i += simd::kLanes) {
    const __mmask16 mk = simd::first_lanes(count - i);
    const __m512 v = _mm512_maskz_loadu_ps(mk, x + i);
    const __mmask16 pos = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
    // exp of min(v, 0): no overflow in the lanes that take v + 1
    const __m512 e = simd::exp2_ps(_mm512_mul_ps(_mm512_min_ps(v, zero), l2e));
    _mm512_mask_storeu_ps(out + i, mk, _mm512_mask_blend_ps(pos, e, _mm512_add_ps(v, one)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  namespace v8 = simd::avx2;
  const __m256 l2e = _mm256_set1_ps(kLog2e), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + v8::kLanes <= count; i += v8::kLanes) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 pos = _mm256_cmp_ps(v, zero, _CMP_GT_OQ);
    // exp of min(v, 0): no overflow in the lanes that take v + 1
    const __m256 e = v8::exp2_ps(_mm256_mul_ps(_mm256_min_ps(v, zero), l2e));
    _mm256_storeu_ps(out + i, _mm256_blendv_ps(e, _mm256_add_ps(v, one), pos));
  }
  for (; i < count; ++i) out[i] = x[i] > 0 ? x[i] + 1.0f : fast_exp(x[i]);
#else
  for (int64_t i = 0; i < count; ++i) out[i] = x[i] > 0 ? x[i] + 1.0f : fast_exp(x[i]);
#endif
}

/// y = features^-1/2 relu(y) + kReluFeatureEps over `rows` rows of f features.
inline void relu_features(float* y, int64_t ldy, int64_t rows, int64_t f) {
  const float ratio = float(1.0 / std::sqrt(double(f)));
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y + r * ldy;
    for (int64_t i = 0; i < f; ++i) row[i] = std::max(row[i], 0.0f) * ratio + kReluFeatureEps;
  }
}

inline float row_max(const float* y, int64_t count) {
#ifdef __AVX512F__
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  __m512 mx = lowest;
  int64_t i = 0;
  for (; i + simd::kLanes <= count; i += simd::kLanes)
    mx = _mm512_max_ps(mx, _mm512_loadu_ps(y + i));
  if (i < count)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(lowest, simd::first_lanes(count - i), y + i));
  return _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__) && defined(__FMA__)
  namespace v8 = simd::avx2;
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + v8::kLanes <= count; i += v8::kLanes) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(y + i));
  float mx = v8::reduce_max(mx8);
  for (; i < count; ++i) mx = std::max(mx, y[i]);
  return mx;
#else
  float mx = -INFINITY;
  for (int64_t i = 0; i < count; ++i) mx = std::max(mx, y[i]);
  return mx;
#endif
}

// Workspace layout (every part starts on a 16-float boundary).
struct Layout {
  int64_t phq, phk, a, s, z, den, total;
  Layout(const Schedule& sc, int64_t f, int64_t d) {
    phq = 0;
    phk = phq + round_up(sc.block * f, 16);
    a = phk + round_up(sc.block * f, 16);
    s = a + round_up(sc.chunk * sc.chunk, 16);
    z = s + round_up(f * d, 16);
    den = z + round_up(f, 16);
    total = den + round_up(sc.block, 16);
  }
};

// Stream ids of the Performer's projection: "performr" mixed with the head index.
constexpr uint64_t kPerformerStream = 0x706572666f726d72ULL;

}  // namespace

// ----- feature maps -----

void EluFeatureMap::queries(const float* x, int64_t ldx, int64_t rows, float* out,
                            int64_t ldo) const {
  for (int64_t r = 0; r < rows; ++r) elu_plus_one(x + r * ldx, d_, out + r * ldo);
}

void EluFeatureMap::keys(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo,
                         float&) const {
  queries(x, ldx, rows, out, ldo);
}

PerformerFeatureMap::PerformerFeatureMap(std::vector<float> w, int64_t features, int64_t d,
                                         PerformerKernel kernel)
    : ws_(std::move(w)), features_(features), d_(d), kernel_(kernel) {
  const float s = float(std::pow(double(d), -0.25));
  for (float& x : ws_) x *= s;
}

void PerformerFeatureMap::project(const float* x, int64_t ldx, int64_t rows, float* out,
                                  int64_t ldo) const {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(features_), int(d_), 1.0f, x,
              int(ldx), ws_.data(), int(d_), 0.0f, out, int(ldo));
}

void PerformerFeatureMap::queries(const float* x, int64_t ldx, int64_t rows, float* out,
                                  int64_t ldo) const {
  project(x, ldx, rows, out, ldo);
  const int64_t f = features_;
  if (kernel_ == PerformerKernel::Relu) return relu_features(out, ldo, rows, f);
  // exp(W x~ - |x~|^2/2 - shift) with shift = max_f (W x~)_f - |x~|^2/2: the norm term
  // cancels, so it is never computed. features^-1/2 goes into the shift.
  const float half_log_f = float(0.5 * std::log(double(f)));
  for (int64_t r = 0; r < rows; ++r) {
    float* y = out + r * ldo;
    exp_shifted(y, f, row_max(y, f) + half_log_f);
  }
}

void PerformerFeatureMap::keys(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo,
                               float& shift) const {
  project(x, ldx, rows, out, ldo);
  const int64_t f = features_, d = d_;
  if (kernel_ == PerformerKernel::Relu) return relu_features(out, ldo, rows, f);
  // |k~|^2 / 2 = |k|^2 / (2 sqrt(d)) per row; the block max of W k~ - |k~|^2/2 raises the shift
  const float half_inv_sqrt_d = float(0.5 / std::sqrt(double(d)));
  float block_max = -INFINITY;
  for (int64_t r = 0; r < rows; ++r)
    block_max = std::max(
        block_max, row_max(out + r * ldo, f) - dot(x + r * ldx, x + r * ldx, d) * half_inv_sqrt_d);
  shift = std::max(shift, block_max);
  const float half_log_f = float(0.5 * std::log(double(f)));
  for (int64_t r = 0; r < rows; ++r)
    exp_shifted(out + r * ldo, f,
                shift + dot(x + r * ldx, x + r * ldx, d) * half_inv_sqrt_d + half_log_f);
}

double PerformerFeatureMap::query_flops() const {
  const double f = double(features_), d = double(d_);
  // projection GEMM; then max + subtract + exp (softmax) or max + multiply-add (relu)
  return 2.0 * f * d + (kernel_ == PerformerKernel::Softmax ? 3.0 * f : 2.0 * f);
}

double PerformerFeatureMap::key_flops() const {
  const double f = double(features_), d = double(d_);
  // projection GEMM; softmax: |k|^2 (twice, 2d each), max, subtract, exp
  return 2.0 * f * d + (kernel_ == PerformerKernel::Softmax ? 3.0 * f + 4.0 * d : 2.0 * f);
}

void EluFeatureMap::queries_backward(const float* x, int64_t ldx, int64_t rows, const float* phi,
                                     int64_t ldp, float* dphi, int64_t ldd, float* dx,
                                     int64_t lddx) const {
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * ldx, *pr = phi + r * ldp, *gr = dphi + r * ldd;
    float* o = dx + r * lddx;
    // d/dx (x + 1) = 1; d/dx exp(x) = exp(x) = phi
    for (int64_t c = 0; c < d_; ++c) o[c] = xr[c] > 0 ? gr[c] : gr[c] * pr[c];
  }
}

void PerformerFeatureMap::project_back(const float* y, int64_t ldy, int64_t rows, float* dx,
                                       int64_t lddx) const {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d_), int(features_), 1.0f,
              y, int(ldy), ws_.data(), int(d_), 0.0f, dx, int(lddx));
}

void PerformerFeatureMap::queries_backward(const float*, int64_t, int64_t rows, const float* phi,
                                           int64_t ldp, float* dphi, int64_t ldd, float* dx,
                                           int64_t lddx) const {
  const int64_t f = features_;
  const float ratio = float(1.0 / std::sqrt(double(f)));
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = phi + r * ldp;
    float* gr = dphi + r * ldd;
    if (kernel_ == PerformerKernel::Relu)
      // phi = ratio relu(y) + eps: dy = ratio dphi where y > 0, i.e. where phi > eps
      for (int64_t e = 0; e < f; ++e) gr[e] = pr[e] > kReluFeatureEps ? gr[e] * ratio : 0.0f;
    else
      for (int64_t e = 0; e < f; ++e) gr[e] *= pr[e];  // d exp(y) = exp(y) dy
  }
  project_back(dphi, ldd, rows, dx, lddx);
}

void PerformerFeatureMap::keys_backward(const float* x, int64_t ldx, int64_t rows, const float* phi,
                                        int64_t ldp, float* dphi, int64_t ldd, float* dx,
                                        int64_t lddx) const {
  queries_backward(x, ldx, rows, phi, ldp, dphi, ldd, dx, lddx);
  if (kernel_ == PerformerKernel::Relu) return;
  // the exponent's -|x~|^2/2 = -|x|^2 / (2 sqrt(d)): dx -= x / sqrt(d) sum_e dy_e, with
  // dy = dphi o phi (what queries_backward left in dphi)
  const int64_t f = features_, d = d_;
  const float inv_sqrt_d = float(1.0 / std::sqrt(double(d)));
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = dphi + r * ldd;
    float sum = 0.0f;
    for (int64_t e = 0; e < f; ++e) sum += gr[e];
    const float c = sum * inv_sqrt_d;
    const float* xr = x + r * ldx;
    float* o = dx + r * lddx;
    for (int64_t i = 0; i < d; ++i) o[i] -= c * xr[i];
  }
}

double PerformerFeatureMap::query_backward_flops() const {
  const double f = double(features_), d = double(d_);
  return 2.0 * f * d + f;  // dphi o phi (or the relu mask), then the GEMM back through W~
}

double PerformerFeatureMap::key_backward_flops() const {
  const double f = double(features_), d = double(d_);
  return query_backward_flops() + (kernel_ == PerformerKernel::Softmax ? f + 2.0 * d : 0.0);
}

std::vector<float> performer_projection(uint64_t seed, int64_t head, int64_t features, int64_t d,
                                        bool orthogonal) {
  const RandomStream gauss(seed, mix64(kPerformerStream + 2 * uint64_t(head))),
      norms(seed, mix64(kPerformerStream + 2 * uint64_t(head) + 1));
  std::vector<float> w(size_t(features * d));
  if (!orthogonal) {
    for (int64_t i = 0; i < features * d; ++i) w[size_t(i)] = float(gauss.normal(uint64_t(i)));
    return w;
  }
  using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Mat g(d, d);
  for (int64_t b = 0; b * d < features; ++b) {
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < d; ++j) g(i, j) = gauss.normal(uint64_t((b * d + i) * d + j));
    Eigen::HouseholderQR<Mat> qr(g);
    Mat q = qr.householderQ();
    // G = Q R is unique with diag(R) > 0, and that Q is Haar distributed
    for (int64_t j = 0; j < d; ++j)
      if (qr.matrixQR()(j, j) < 0) q.col(j) *= -1.0;
    const int64_t rows = std::min(d, features - b * d);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t f = b * d + r;
      double chi2 = 0;
      for (int64_t i = 0; i < d; ++i) {
        const double x = norms.normal(uint64_t(f * d + i));
        chi2 += x * x;
      }
      const double chi = std::sqrt(chi2);
      // row f of W = column r of Q (a row of Q^T), a unit vector, times chi_d
      for (int64_t i = 0; i < d; ++i) w[size_t(f * d + i)] = float(q(i, r) * chi);
    }
  }
  return w;
}

// ----- the engine -----

Schedule Schedule::for_features(int64_t features) {
  // a block of features (R x F floats) of at most 256 KiB: R = 1024 for F <= 64, 256 for
  // F = 256 (two of them, phi(Q) and phi(K), stay in a 1 MiB L2)
  int64_t block = 1024;
  while (block > 16 && block * features > 65536) block /= 2;
  // causal sub-chunks of 16 rows: the masked diagonal products cost 2 n C (F + d), 12% of the
  // rest at F = 256, d = 64. Chunks of 8 to 32 rows time alike (GEMMs that small still run
  // near the machine's rate) and longer ones grow that cost; 16 sits in the flat part.
  return Schedule{block, std::min<int64_t>(16, block)};
}

int64_t workspace_floats(const Schedule& s, int64_t features, int64_t d) {
  return Layout(s, features, d).total;
}

float finish_row(float* o, int64_t d, float den, float floor, float weight) {
  bool raised = false;
  if (floor > 0 && weight > 0 && !(den >= floor * weight)) den = floor * weight, raised = true;
  if (weight > 0 && den > 0) {
    for (int64_t x = 0; x < d; ++x) o[x] /= den;
    return raised ? -den : den;
  }
  std::fill(o, o + d, 0.0f);
  return 0.0f;
}

int64_t attend_head(const FeatureMap& fm, const Problem& p, int64_t b, const Schedule& sc,
                    const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                    int64_t ldv, float* out, int64_t ldo, float eps, float* work, float* den_out) {
  const int64_t f = fm.features(), d = p.dim, n = p.n, R = sc.block, C = sc.chunk;
  const Layout L(sc, f, d);
  float *phq = work + L.phq, *phk = work + L.phk, *a = work + L.a, *s = work + L.s, *z = work + L.z,
        *den = work + L.den;
  KeyState st(fm, k, ldk, v, ldv, d, s, z);
  int64_t& kdone = st.kdone;  // keys [0, kdone) are in S and z
  const float floor = fm.denominator_floor();
  int64_t clamped = 0;
  auto map_keys = [&](int64_t j0, int64_t cnt) { st.map_keys(j0, cnt, phk); };
  auto fold = [&](const float* pk, int64_t j0, int64_t cnt) { st.fold(pk, j0, cnt); };

  for (int64_t i0 = 0; i0 < n; i0 += R) {
    const int64_t rows = std::min(R, n - i0);
    const int64_t kv = p.visible(b, i0), ke = p.visible(b, i0 + rows - 1);
    // 1. keys every row of the block sees go straight into the state
    while (kdone < kv) {
      const int64_t cnt = std::min(R, kv - kdone);
      map_keys(kdone, cnt);
      fold(phk, kdone, cnt);
      kdone += cnt;
    }
    if (ke == 0) {  // no row of the block sees a key
      for (int64_t r = 0; r < rows; ++r)
        std::fill(out + (i0 + r) * ldo, out + (i0 + r) * ldo + d, 0.0f);
      if (den_out) std::fill(den_out + i0, den_out + i0 + rows, 0.0f);
      continue;
    }
    // 2. the block's queries, and the keys only some of its rows see (causal: < R of them)
    fm.queries(q + i0 * ldq, ldq, rows, phq, f);
    const int64_t kb = kdone;
    if (ke > kdone) map_keys(kdone, ke - kdone);
    // 3. sub-chunks: state part, masked diagonal part, fold the diagonal keys
    const int64_t step = ke > kdone ? C : rows;
    for (int64_t a0 = 0; a0 < rows; a0 += step) {
      const int64_t c = std::min(step, rows - a0), i = i0 + a0;
      const float* pq = phq + a0 * f;
      float* o = out + i * ldo;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(c), int(d), int(f), 1.0f, pq,
                  int(f), s, int(d), 0.0f, o, int(ldo));
      cblas_sgemv(CblasRowMajor, CblasNoTrans, int(c), int(f), 1.0f, pq, int(f), z, 1, 0.0f, den,
                  1);
      const int64_t je = p.visible(b, i + c - 1);
      if (je > kdone) {
        const int64_t w = je - kdone;  // <= c keys
        const float* pk = phk + (kdone - kb) * f;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(w), int(f), 1.0f, pq,
                    int(f), pk, int(f), 0.0f, a, int(w));
        for (int64_t r = 0; r < c; ++r) {
          float* ar = a + r * w;
          const int64_t vis = std::clamp<int64_t>(p.visible(b, i + r) - kdone, 0, w);
          float sum = 0.0f;
          for (int64_t t = 0; t < vis; ++t) sum += ar[t];
          std::fill(ar + vis, ar + w, 0.0f);
          den[r] += sum;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(c), int(d), int(w), 1.0f, a,
                    int(w), v + kdone * ldv, int(ldv), 1.0f, o, int(ldo));
        fold(pk, kdone, w);
        kdone = je;
      }
      for (int64_t r = 0; r < c; ++r) {
        const float dn =
            finish_row(o + r * ldo, d, den[r] + eps, floor, float(p.visible(b, i + r)));
        if (dn < 0) ++clamped;
        if (den_out) den_out[i + r] = dn;
      }
    }
  }
  return clamped;
}

int attend_threads(const Problem& p) {
  const int threads = team_threads();
  const int64_t heads = p.batch * p.heads;
  return heads >= threads ? threads : 1;
}

int64_t attend(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out, float eps, int64_t features,
               const std::function<const FeatureMap&(int64_t head)>& map_for_head, float* den) {
  const Schedule sc = Schedule::for_features(features);
  const int64_t heads = p.batch * p.heads, floats = workspace_floats(sc, features, p.dim);
  // With fewer heads than threads, let BLAS use the threads; otherwise one head per thread.
  const bool per_head = heads >= team_threads();
  std::atomic<int64_t> clamped{0};
  parallel_for(
      heads, [&] { return Aligned(floats); },
      [&](int64_t bh, Aligned& work) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        clamped += attend_head(map_for_head(h), p, b, sc, q.head(b, h), q.stride_row, k.head(b, h),
                               k.stride_row, v.head(b, h), v.stride_row, out.head(b, h),
                               out.stride_row, eps, work.get(), den ? den + bh * p.n : nullptr);
      },
      {.parallel = per_head});
  return clamped.load();
}

double attend_flops(const Problem& p, int64_t features, double query_map_flops,
                    double key_map_flops) {
  const Schedule sc = Schedule::for_features(features);
  const double f = double(features), d = double(p.dim);
  const int64_t n = p.n, R = sc.block, C = sc.chunk;
  double total = 0;
  int64_t kdone = 0;
  auto fold = [&](int64_t cnt) { total += cnt * (key_map_flops + 2.0 * f * d + f); };
  for (int64_t i0 = 0; i0 < n; i0 += R) {
    const int64_t rows = std::min(R, n - i0);
    const int64_t kv = p.visible(i0), ke = p.visible(i0 + rows - 1);
    if (kv > kdone) fold(kv - kdone), kdone = kv;
    if (ke == 0) continue;
    total += rows * query_map_flops;
    const int64_t step = ke > kdone ? C : rows;
    for (int64_t a0 = 0; a0 < rows; a0 += step) {
      const int64_t c = std::min(step, rows - a0);
      total += c * (2.0 * f * d + 2.0 * f + d);  // phi(Q) S, phi(Q) z, division
      const int64_t je = p.visible(i0 + a0 + c - 1);
      if (je > kdone) {
        const double w = double(je - kdone);
        total += c * w * (2.0 * f + 2.0 * d + 1.0);  // A, A V, row sums of A
        fold(je - kdone);
        kdone = je;
      }
    }
  }
  return total * double(p.batch * p.heads);
}

double attend_bytes(const Problem& p, int64_t features) {
  const Schedule sc = Schedule::for_features(features);
  const double per_thread =
      double(round_up(workspace_floats(sc, features, p.dim) * int64_t(sizeof(float)), 64));
  const int threads = team_threads();
  double bytes = per_thread * attend_threads(p);
  // With fewer heads than threads the GEMMs run multi-threaded inside OpenBLAS, and its
  // OpenMP build mallocs a job array for every level-3 call it splits over threads: 524296
  // bytes per call, measured with the heap hook (calls it keeps on one thread allocate none).
  if (p.batch * p.heads < threads && threads > 1) bytes += 524296.0;
  return bytes;
}

}  // namespace attnbench::feature_map
