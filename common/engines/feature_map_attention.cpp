#include "common/engines/feature_map_attention.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <optional>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel.h"
#include "common/core/random.h"
#include "common/core/threads.h"
#include "common/kernels/simd.h"
#include "common/kernels/softmax.h"

namespace attnbench::feature_map {

namespace {

[[maybe_unused]] constexpr float kLog2e = 1.44269504088896341f;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

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

/// A 64-byte aligned float block.
class Aligned {
 public:
  explicit Aligned(int64_t floats)
      : p_(static_cast<float*>(std::aligned_alloc(
            64, size_t(round_up(std::max<int64_t>(floats, 1) * int64_t(sizeof(float)), 64))))) {
    if (!p_) throw std::bad_alloc();
  }
  ~Aligned() { std::free(p_); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  float* get() const { return p_; }

 private:
  float* p_;
};

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

// Workspace layout of the backward (every part starts on a 16-float boundary): phi(Q) and
// dphi(Q) of a row block, phi(K) and dphi(K) of a key block, G and dden of a row block, the
// masked C x C products A and B, the state (S, z in pass 1; U, u in pass 2).
struct BackwardLayout {
  int64_t phq, dphq, phk, dphk, g, dd, a, bm, s, z, total;
  BackwardLayout(const Schedule& sc, int64_t f, int64_t d) {
    const int64_t rf = round_up(sc.block * f, 16), cc = round_up(sc.chunk * sc.chunk, 16);
    phq = 0;
    dphq = phq + rf;
    phk = dphq + rf;
    dphk = phk + rf;
    g = dphk + rf;
    dd = g + round_up(sc.block * d, 16);
    a = dd + round_up(sc.block, 16);
    bm = a + cc;
    s = bm + cc;
    z = s + round_up(f * d, 16);
    total = z + round_up(f, 16);
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

namespace {

/// The prefix key state of a walk over the rows: S = sum phi(k_j) v_j^T (F x d) and
/// z = sum phi(k_j) over keys [0, kdone), kept at the current key scale exp(-shift). The
/// forward, the backward's first pass and the decode state build it the same way.
struct KeyState {
  const FeatureMap& fm;
  const float *k, *v;  // the rows map_keys and fold index (row j at k + j ldk, v + j ldv)
  int64_t ldk, ldv, f, d;
  float *s, *z;
  float shift = -INFINITY;
  int64_t kdone = 0;  // keys [0, kdone) are in S and z

  /// A walk from no key: S and z zeroed.
  KeyState(const FeatureMap& fm_, const float* k_, int64_t ldk_, const float* v_, int64_t ldv_,
           int64_t d_, float* s_, float* z_)
      : fm(fm_), k(k_), v(v_), ldk(ldk_), ldv(ldv_), f(fm_.features()), d(d_), s(s_), z(z_) {
    std::fill(s, s + f * d, 0.0f);
    std::fill(z, z + f, 0.0f);
  }
  /// A walk resumed on S and z that hold `kdone_` keys at key shift `shift_` (a decode step:
  /// k and v then point at the rows of the keys to come, whatever their positions).
  KeyState(const FeatureMap& fm_, const float* k_, int64_t ldk_, const float* v_, int64_t ldv_,
           int64_t d_, float* s_, float* z_, float shift_, int64_t kdone_)
      : fm(fm_),
        k(k_),
        v(v_),
        ldk(ldk_),
        ldv(ldv_),
        f(fm_.features()),
        d(d_),
        s(s_),
        z(z_),
        shift(shift_),
        kdone(kdone_) {}
  /// Maps keys [j0, j0 + cnt) into phk (rows of f floats), bringing S and z to the new key
  /// scale when the map raises it.
  void map_keys(int64_t j0, int64_t cnt, float* phk) {
    const float old = shift;
    fm.keys(k + j0 * ldk, ldk, cnt, phk, f, shift);
    if (shift > old && old > -INFINITY && kdone > 0) {
      const float c = std::exp(old - shift);
      for (int64_t i = 0; i < f * d; ++i) s[i] *= c;
      for (int64_t i = 0; i < f; ++i) z[i] *= c;
    }
  }
  /// S += phi(K)^T V and z += column sums of phi(K) for keys [j0, j0 + cnt), rows of pk.
  void fold(const float* pk, int64_t j0, int64_t cnt) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(f), int(d), int(cnt), 1.0f, pk, int(f),
                v + j0 * ldv, int(ldv), 1.0f, s, int(d));
    for (int64_t r = 0; r < cnt; ++r) {
      const float* row = pk + r * f;
      for (int64_t i = 0; i < f; ++i) z[i] += row[i];
    }
  }
};

}  // namespace

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
  int64_t clamped = 0;
  OmpGuard guard;
#pragma omp parallel if (per_head)
  {
    std::optional<Aligned> work;
    guard.run([&] { work.emplace(floats); });
#pragma omp for schedule(dynamic, 1) reduction(+ : clamped)
    for (int64_t bh = 0; bh < heads; ++bh)
      guard.run([&] {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        clamped += attend_head(map_for_head(h), p, b, sc, q.head(b, h), q.stride_row, k.head(b, h),
                               k.stride_row, v.head(b, h), v.stride_row, out.head(b, h),
                               out.stride_row, eps, work->get(), den ? den + bh * p.n : nullptr);
      });
  }
  guard.rethrow();
  return clamped;
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

// ----- decode -----

namespace {

/// Threads a loop over `heads` (batch, head) pairs of `flops` work in all runs on, as
/// attend(): every thread of the team when there are at least as many pairs and the work is
/// worth a parallel region (common/core/threads.h), else 1.
int head_threads(int64_t heads, double flops) {
  return heads >= team_threads() && parallel_worth(flops, heads) ? team_threads() : 1;
}

/// body(bh, work) for every (batch, head) index bh < heads, OpenMP over them on
/// head_threads(heads, flops) threads (BLAS single-threaded inside a region); work: the
/// running thread's `stride` floats of `pool` (head_threads(heads, flops) stride floats).
template <class Body>
void for_each_head(int64_t heads, double flops, float* pool, int64_t stride, const Body& body) {
  const bool per_head = head_threads(heads, flops) > 1;
  OmpGuard guard;
#pragma omp parallel for if (per_head) schedule(dynamic, 1)
  for (int64_t bh = 0; bh < heads; ++bh)
    guard.run([&] { body(bh, pool + int64_t(omp_get_thread_num()) * stride); });
  guard.rethrow();
}

class KernelDecodeState final : public DecodeState {
 public:
  KernelDecodeState(const Problem& p, float eps,
                    std::vector<std::shared_ptr<const FeatureMap>> maps, double map_bytes)
      : batch_(p.batch),
        heads_(p.heads),
        capacity_(p.n),
        d_(p.dim),
        eps_(eps),
        map_bytes_(map_bytes),
        maps_(std::move(maps)) {
    if (maps_.empty() || (maps_.size() != 1 && int64_t(maps_.size()) != heads_))
      throw UsageError(fmt::format(
          "kernel attention decode: {} feature maps for {} heads (one for all, or one per head)",
          maps_.size(), heads_));
    f_ = maps_[0]->features();
    for (const auto& m : maps_)
      if (!m || m->features() != f_)
        throw UsageError("kernel attention decode: the feature maps differ in their features");
    zoff_ = round_up(f_ * d_, 16);
    stride_ = zoff_ + round_up(f_, 16);
    state_ = std::make_unique<Aligned>(batch_ * heads_ * stride_);
    shift_.assign(size_t(batch_ * heads_), -INFINITY);
  }

  /// Folds keys and values 0 .. t0 - 1 in the engine's blocks.
  void prefill(ConstTensorView k, ConstTensorView v, int64_t t0) {
    const int64_t block = Schedule::for_features(f_).block, stride = round_up(block * f_, 16);
    const int64_t heads = batch_ * heads_;
    double flops = 0;
    for (int64_t h = 0; h < heads_; ++h)
      flops += double(batch_) * double(t0) * (map(h).key_flops() + 2.0 * double(f_ * d_));
    // phi(K) of one key block per thread, freed when the prefill ends
    Aligned work(stride * head_threads(heads, flops));
    for_each_head(heads, flops, work.get(), stride, [&](int64_t bh, float* phk) {
      const int64_t b = bh / heads_, h = bh % heads_;
      KeyState st(map(h), k.head(b, h), k.stride_row, v.head(b, h), v.stride_row, d_, s(bh), z(bh));
      while (st.kdone < t0) {
        const int64_t cnt = std::min(block, t0 - st.kdone);
        st.map_keys(st.kdone, cnt, phk);
        st.fold(phk, st.kdone, cnt);
        st.kdone += cnt;
      }
      shift_[size_t(bh)] = st.shift;
    });
    length_ = t0;
  }

  int64_t length() const override { return length_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(length_, capacity_, Shape4{batch_, heads_, 1, d_}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const SerialIfSmall small(step_flops());
    const int64_t f = f_, d = d_, fpad = round_up(f, 16), heads = batch_ * heads_;
    // a step is one key and one query per head: most often too little for a parallel region
    const double flops = step_flops();
    // phi(k) and phi(q) per thread, kept between steps so that a step allocates nothing
    const int64_t need = 2 * fpad * head_threads(heads, flops);
    if (work_floats_ < need) {
      work_.reset();
      work_ = std::make_unique<Aligned>(need);
      work_floats_ = need;
    }
    // the key count of the step's row: every key so far and its own
    const float weight = float(length_ + 1);
    for_each_head(heads, flops, work_->get(), 2 * fpad, [&](int64_t bh, float* w) {
      const int64_t b = bh / heads_, h = bh % heads_;
      const FeatureMap& fm = map(h);
      float *phk = w, *phq = w + fpad, *o = out.head(b, h);
      // 1. the key, at the shift it raises (S and z rescaled first), into S and z
      KeyState st(fm, k.head(b, h), k.stride_row, v.head(b, h), v.stride_row, d, s(bh), z(bh),
                  shift_[size_t(bh)], length_);
      st.map_keys(0, 1, phk);
      st.fold(phk, 0, 1);
      shift_[size_t(bh)] = st.shift;
      // 2. the query: out = phi(q)^T S / (phi(q)^T z + eps) by the engine's row rule
      fm.queries(q.head(b, h), q.stride_row, 1, phq, f);
      cblas_sgemv(CblasRowMajor, CblasTrans, int(f), int(d), 1.0f, s(bh), int(d), phq, 1, 0.0f, o,
                  1);
      finish_row(o, d, dot(phq, z(bh), f) + eps_, fm.denominator_floor(), weight);
    });
    ++length_;
  }

  double state_bytes() const override { return double(heads_ * (f_ * d_ + f_ + 2)) * 4.0; }

  double step_bytes_read() const override {
    const double bh = double(batch_ * heads_);
    return bh * double(f_ * d_ + f_) * 4.0 + double(maps_.size()) * map_bytes_ +
           bh * 3.0 * double(d_) * 4.0;
  }

  double step_flops() const override {
    double total = 0;
    for (int64_t h = 0; h < heads_; ++h) {
      const FeatureMap& fm = map(h);
      total += fm.query_flops() + fm.key_flops();
    }
    const double f = double(f_), d = double(d_);
    return double(batch_) * (total + double(heads_) * (4.0 * f * d + 3.0 * f + d));
  }

 private:
  const FeatureMap& map(int64_t h) const { return *maps_[maps_.size() == 1 ? 0 : size_t(h)]; }
  float* s(int64_t bh) const { return state_->get() + bh * stride_; }
  float* z(int64_t bh) const { return s(bh) + zoff_; }
  // a view [B, H, >= rows, d] of this state's problem

  int64_t batch_, heads_, capacity_, d_, f_ = 0, zoff_ = 0, stride_ = 0, length_ = 0;
  float eps_;
  double map_bytes_;
  std::vector<std::shared_ptr<const FeatureMap>> maps_;
  std::unique_ptr<Aligned> state_;  // per (batch, head): S (F x d), then z (F)
  std::vector<float> shift_;        // the key shift of each (batch, head)
  std::unique_ptr<Aligned> work_;   // a step's per-thread phi(k), phi(q)
  int64_t work_floats_ = 0;
};

}  // namespace

std::unique_ptr<DecodeState> prefill_state(const Problem& p, ConstTensorView k, ConstTensorView v,
                                           int64_t t0, float eps,
                                           std::vector<std::shared_ptr<const FeatureMap>> maps,
                                           double map_bytes) {
  check_prefill(p, k, v, t0);
  auto state = std::make_unique<KernelDecodeState>(p, eps, std::move(maps), map_bytes);
  state->prefill(k, v, t0);
  return state;
}

double prefill_flops(const Problem& p, int64_t t0, int64_t features, double key_map_flops) {
  const double f = double(features), d = double(p.dim);
  return double(p.batch * p.heads) * double(t0) * (key_map_flops + 2.0 * f * d + f);
}

// ----- the backward -----

const RowDenominators& RowDenominators::of(const SavedState& saved, const Problem& p) {
  const auto* s = dynamic_cast<const RowDenominators*>(&saved);
  if (!s || s->den.size() != size_t(p.batch * p.heads * p.n))
    throw UsageError(
        "kernel attention backward: the saved state is not from forward_train on this problem");
  return *s;
}

double RowDenominators::bytes(const Problem& p) {
  return 4.0 * double(p.batch * p.heads * p.n) + double(sizeof(RowDenominators));
}

int64_t backward_workspace_floats(const Schedule& s, int64_t features, int64_t d) {
  return BackwardLayout(s, features, d).total;
}

void attend_backward_head(const FeatureMap& fm, const Problem& p, int64_t b, const Schedule& sc,
                          const HeadGrads& io, float* work) {
  const int64_t f = fm.features(), d = p.dim, n = p.n, m = p.keys(), R = sc.block, C = sc.chunk;
  const BackwardLayout L(sc, f, d);
  float *phq = work + L.phq, *dphq = work + L.dphq, *phk = work + L.phk, *dphk = work + L.dphk,
        *g = work + L.g, *dd = work + L.dd, *a = work + L.a, *bm = work + L.bm, *s = work + L.s,
        *z = work + L.z;
  const float *q = io.q, *k = io.k, *v = io.v, *den = io.den;
  const int64_t ldq = io.ldq, ldk = io.ldk, ldv = io.ldv;
  const int64_t blocks = (n + R - 1) / R;
  std::vector<float> shifts(size_t(blocks), -INFINITY);  // the key shift of each row block

  // g = dO / |den| and dden = -(dO . out) / den of rows [i0, i0 + rows) into g and dd; rows that
  // are 0 get 0, rows raised to the floor (den < 0) get dden = 0
  auto grads = [&](int64_t i0, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      const float dn = den[i0 + r];
      float* gr = g + r * d;
      if (dn == 0.0f) {
        std::fill(gr, gr + d, 0.0f);
        dd[r] = 0.0f;
        continue;
      }
      const float inv = 1.0f / std::fabs(dn);
      const float *dor = io.dout + (i0 + r) * io.lddo, *orow = io.out + (i0 + r) * io.ldo;
      float dot = 0.0f;
      for (int64_t x = 0; x < d; ++x) {
        gr[x] = dor[x] * inv;
        dot += dor[x] * orow[x];
      }
      dd[r] = dn > 0 ? -dot * inv : 0.0f;
    }
  };
  // writes 0 into `cnt` rows of a gradient
  auto zero_rows = [&](float* x, int64_t ld, int64_t cnt) {
    for (int64_t r = 0; r < cnt; ++r) std::fill(x + r * ld, x + r * ld + d, 0.0f);
  };
  // B = G_c V_w^T + dden (c x w) and, if `with_a`, A = phi(Q_c) phi(K_w)^T, both with the
  // keys row i0 + r does not see set to 0
  auto diagonal = [&](int64_t i, int64_t c, const float* pq, const float* gc, const float* ddc,
                      int64_t j0, int64_t w, const float* pk, bool with_a) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(w), int(d), 1.0f, gc, int(d),
                v + j0 * ldv, int(ldv), 0.0f, bm, int(w));
    if (with_a)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(w), int(f), 1.0f, pq, int(f),
                  pk, int(f), 0.0f, a, int(w));
    for (int64_t r = 0; r < c; ++r) {
      const int64_t vis = std::clamp<int64_t>(p.visible(b, i + r) - j0, 0, w);
      float* br = bm + r * w;
      for (int64_t t = 0; t < vis; ++t) br[t] += ddc[r];
      std::fill(br + vis, br + w, 0.0f);
      if (with_a) std::fill(a + r * w + vis, a + r * w + w, 0.0f);
    }
  };

  // ---- pass 1: rows forwards with the prefix state S, z (as attend_head), dphi(Q), dq ----
  {
    KeyState st(fm, k, ldk, v, ldv, d, s, z);
    const float& shift = st.shift;
    int64_t& kdone = st.kdone;
    auto map_keys = [&](int64_t j0, int64_t cnt) { st.map_keys(j0, cnt, phk); };
    auto fold = [&](const float* pk, int64_t j0, int64_t cnt) { st.fold(pk, j0, cnt); };
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const int64_t i0 = bi * R, rows = std::min(R, n - i0);
      const int64_t kv = p.visible(b, i0), ke = p.visible(b, i0 + rows - 1);
      while (kdone < kv) {
        const int64_t cnt = std::min(R, kv - kdone);
        map_keys(kdone, cnt);
        fold(phk, kdone, cnt);
        kdone += cnt;
      }
      if (ke == 0) {
        zero_rows(io.dq + i0 * io.lddq, io.lddq, rows);
        continue;
      }
      fm.queries(q + i0 * ldq, ldq, rows, phq, f);
      const int64_t kb = kdone;
      if (ke > kdone) map_keys(kdone, ke - kdone);
      shifts[size_t(bi)] = shift;
      grads(i0, rows);
      const int64_t step = ke > kdone ? C : rows;
      for (int64_t a0 = 0; a0 < rows; a0 += step) {
        const int64_t c = std::min(step, rows - a0), i = i0 + a0;
        float* dpq = dphq + a0 * f;
        const float *gc = g + a0 * d, *ddc = dd + a0;
        // dphi(q) = G S^T + dden z^T
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(f), int(d), 1.0f, gc,
                    int(d), s, int(d), 0.0f, dpq, int(f));
        for (int64_t r = 0; r < c; ++r)
          for (int64_t e = 0; e < f; ++e) dpq[r * f + e] += ddc[r] * z[e];
        const int64_t je = p.visible(b, i + c - 1);
        if (je > kdone) {  // + B phi(K_w) over the chunk's diagonal keys, then fold them
          const int64_t w = je - kdone;
          const float* pk = phk + (kdone - kb) * f;
          diagonal(i, c, nullptr, gc, ddc, kdone, w, pk, false);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(c), int(f), int(w), 1.0f, bm,
                      int(w), pk, int(f), 1.0f, dpq, int(f));
          fold(pk, kdone, w);
          kdone = je;
        }
      }
      fm.queries_backward(q + i0 * ldq, ldq, rows, phq, f, dphq, f, io.dq + i0 * io.lddq, io.lddq);
    }
  }

  // ---- pass 2: rows backwards with the suffix state U, u (in s, z), dphi(K), dk, dv ----
  float* u_mat = s;
  float* u_vec = z;
  std::fill(u_mat, u_mat + f * d, 0.0f);
  std::fill(u_vec, u_vec + f, 0.0f);
  float tau = -INFINITY;                            // the key shift U and u are at
  int64_t kdone = n > 0 ? p.visible(b, n - 1) : 0;  // keys [kdone, m) are final
  zero_rows(io.dk + kdone * io.lddk, io.lddk, m - kdone);
  zero_rows(io.dv + kdone * io.lddv, io.lddv, m - kdone);
  // dphi(K) = V U^T + 1 u^T and dV = phi(K) U of keys [j0, j0 + cnt) (features pk), added to
  // what dpk and the dv rows hold (beta = 1) or overwriting them (beta = 0); then dk
  auto finish_keys = [&](const float* pk, float* dpk, int64_t j0, int64_t cnt, float beta) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(cnt), int(f), int(d), 1.0f,
                v + j0 * ldv, int(ldv), u_mat, int(d), beta, dpk, int(f));
    for (int64_t r = 0; r < cnt; ++r)
      for (int64_t e = 0; e < f; ++e) dpk[r * f + e] += u_vec[e];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(cnt), int(d), int(f), 1.0f, pk,
                int(f), u_mat, int(d), beta, io.dv + j0 * io.lddv, int(io.lddv));
    fm.keys_backward(k + j0 * ldk, ldk, cnt, pk, f, dpk, f, io.dk + j0 * io.lddk, io.lddk);
  };
  // keys [x, kdone), seen only by rows already in U: final now, in blocks of R
  auto finish_upto = [&](int64_t x) {
    while (kdone > x) {
      const int64_t cnt = std::min(R, kdone - x), j0 = kdone - cnt;
      float sh = tau;  // at U's scale (every key here was mapped by then, so none raises it)
      fm.keys(k + j0 * ldk, ldk, cnt, phk, f, sh);
      finish_keys(phk, dphk, j0, cnt, 0.0f);
      kdone = j0;
    }
  };
  for (int64_t bi = blocks - 1; bi >= 0; --bi) {
    const int64_t i0 = bi * R, rows = std::min(R, n - i0);
    const int64_t kv = p.visible(b, i0), ke = p.visible(b, i0 + rows - 1);
    finish_upto(ke);
    if (ke == 0) continue;
    // U and u to this block's key scale (shifts only grow along the rows)
    const float tb = shifts[size_t(bi)];
    if (tau > -INFINITY && tb < tau) {
      const float c = std::exp(tb - tau);
      for (int64_t i = 0; i < f * d; ++i) u_mat[i] *= c;
      for (int64_t i = 0; i < f; ++i) u_vec[i] *= c;
    }
    tau = tb;
    fm.queries(q + i0 * ldq, ldq, rows, phq, f);
    grads(i0, rows);
    if (ke > kv) {  // the block's diagonal keys, at its scale
      float sh = tau;
      fm.keys(k + kv * ldk, ldk, ke - kv, phk, f, sh);
    }
    // sub-chunks backwards; chunk [i, i + c) owns the keys [jlo, je) the rows before it do
    // not see (its diagonal), and every key past je is final already
    const int64_t step = ke > kv ? C : rows;
    for (int64_t a0 = (rows - 1) / step * step; a0 >= 0; a0 -= step) {
      const int64_t c = std::min(step, rows - a0), i = i0 + a0;
      const float *pq = phq + a0 * f, *gc = g + a0 * d, *ddc = dd + a0;
      const int64_t je = p.visible(b, i + c - 1), jlo = a0 == 0 ? kv : p.visible(b, i - 1);
      if (je > jlo) {
        const int64_t w = je - jlo;
        const float* pk = phk + (jlo - kv) * f;
        float* dpk = dphk + (jlo - kv) * f;
        diagonal(i, c, pq, gc, ddc, jlo, w, pk, true);
        // the chunk's rows: dphi(K_w) = B^T phi(Q_c), dV_w = A^T G_c; then the later rows
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(w), int(f), int(c), 1.0f, bm,
                    int(w), pq, int(f), 0.0f, dpk, int(f));
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(w), int(d), int(c), 1.0f, a,
                    int(w), gc, int(d), 0.0f, io.dv + jlo * io.lddv, int(io.lddv));
        finish_keys(pk, dpk, jlo, w, 1.0f);
        kdone = jlo;
      }
      // the chunk's rows join U and u
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(f), int(d), int(c), 1.0f, pq, int(f),
                  gc, int(d), 1.0f, u_mat, int(d));
      cblas_sgemv(CblasRowMajor, CblasTrans, int(c), int(f), 1.0f, pq, int(f), ddc, 1, 1.0f, u_vec,
                  1);
    }
  }
  finish_upto(0);
}

void attend_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     ConstTensorView out, ConstTensorView dout, const float* den, TensorView dq,
                     TensorView dk, TensorView dv, int64_t features,
                     const std::function<const FeatureMap&(int64_t head)>& map_for_head) {
  const Schedule sc = Schedule::for_features(features);
  const int64_t heads = p.batch * p.heads, floats = backward_workspace_floats(sc, features, p.dim);
  const bool per_head = heads >= team_threads();
  OmpGuard guard;
#pragma omp parallel if (per_head)
  {
    std::optional<Aligned> work;
    guard.run([&] { work.emplace(floats); });
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < heads; ++bh)
      guard.run([&] {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        const HeadGrads io{q.head(b, h),    k.head(b, h),   v.head(b, h),    out.head(b, h),
                           dout.head(b, h), den + bh * p.n, q.stride_row,    k.stride_row,
                           v.stride_row,    out.stride_row, dout.stride_row, dq.head(b, h),
                           dk.head(b, h),   dv.head(b, h),  dq.stride_row,   dk.stride_row,
                           dv.stride_row};
        attend_backward_head(map_for_head(h), p, b, sc, io, work->get());
      });
  }
  guard.rethrow();
}

double attend_backward_flops(const Problem& p, int64_t features, double query_map_flops,
                             double key_map_flops, double query_back_flops, double key_back_flops) {
  const Schedule sc = Schedule::for_features(features);
  const double f = double(features), d = double(p.dim);
  const int64_t n = p.n, R = sc.block, C = sc.chunk;
  double total = 0;
  int64_t kdone = 0;
  // per key: pass 1 maps and folds it (S and z), pass 2 maps it again, forms dphi(k) (V U^T,
  // + u) and dv (phi(K) U), and goes back through the map
  auto key = [&](int64_t cnt) {
    total +=
        double(cnt) * (2.0 * key_map_flops + 2.0 * f * d + f + 4.0 * f * d + f + key_back_flops);
  };
  for (int64_t i0 = 0; i0 < n; i0 += R) {
    const int64_t rows = std::min(R, n - i0);
    const int64_t kv = p.visible(i0), ke = p.visible(i0 + rows - 1);
    if (kv > kdone) key(kv - kdone), kdone = kv;
    if (ke == 0) continue;
    // per row: phi(q) twice, g and dden (3 d), G S^T and dden z (2 F d + 2 F), U and u
    // (2 F d + 2 F), the map's backward
    total +=
        double(rows) * (2.0 * query_map_flops + 3.0 * d + 4.0 * f * d + 4.0 * f + query_back_flops);
    const int64_t step = ke > kdone ? C : rows;
    for (int64_t a0 = 0; a0 < rows; a0 += step) {
      const int64_t c = std::min(step, rows - a0);
      const int64_t je = p.visible(i0 + a0 + c - 1);
      if (je > kdone) {
        // B twice (2 d + 1), B phi(K) (2 F), A (2 F), B^T phi(Q) (2 F), A^T G (2 d)
        total += double(c) * double(je - kdone) * (6.0 * d + 2.0 + 6.0 * f);
        key(je - kdone);
        kdone = je;
      }
    }
  }
  return total * double(p.batch * p.heads);
}

double attend_backward_bytes(const Problem& p, int64_t features) {
  const Schedule sc = Schedule::for_features(features);
  const double per_thread =
      double(
          round_up(backward_workspace_floats(sc, features, p.dim) * int64_t(sizeof(float)), 64)) +
      double((p.n + sc.block - 1) / sc.block) * sizeof(float);
  const int threads = team_threads();
  double bytes = per_thread * attend_threads(p);
  if (p.batch * p.heads < threads && threads > 1) bytes += 524296.0;  // as attend_bytes
  return bytes;
}

}  // namespace attnbench::feature_map
