// rfa: the random draws of a head (W, the gate) and the feature map's forward (the projection
// GEMM and sin / cos of the normalised rows) and backward; the plain and gated attention, their
// backward passes, decoding, the oracle and the registration are in rfa.cpp.
#include "variants/rfa_features.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "common/core/random.h"
#include "common/kernels/simd.h"
#include "common/kernels/softmax.h"

namespace attnbench {
namespace rfa {

// Stream ids of the projection and the gate: "rfa_feat" mixed with the head index.
constexpr uint64_t kRfaStream = 0x7266615f66656174ULL;

std::vector<float> rfa_projection(uint64_t seed, int64_t head, int64_t features, int64_t d,
                                  double sigma) {
  const RandomStream rs(seed, mix64(kRfaStream + 2 * uint64_t(head)));
  std::vector<float> w(size_t(features * d));
  for (int64_t i = 0; i < features * d; ++i) w[size_t(i)] = float(rs.normal(uint64_t(i)) / sigma);
  return w;
}

std::vector<float> rfa_gate(uint64_t seed, int64_t head, int64_t d) {
  const RandomStream rs(seed, mix64(kRfaStream + 2 * uint64_t(head) + 1));
  std::vector<float> g(size_t(d + 1));
  const double s = 1.0 / std::sqrt(double(d));
  for (int64_t c = 0; c < d; ++c) g[size_t(c)] = float(rs.normal(uint64_t(c)) * s);
  g[size_t(d)] = float(rs.normal(uint64_t(d)));
  return g;
}

void RfaFeatureMap::queries_backward(const float* x, int64_t ldx, int64_t rows, const float* phi,
                                     int64_t ldp, float* dphi, int64_t ldd, float* dx,
                                     int64_t lddx) const {
  const int64_t D = freqs_, d = d_;
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = phi + r * ldp;
    float* gr = dphi + r * ldd;
    for (int64_t f = 0; f < D; ++f) gr[f] = gr[f] * pr[D + f] - gr[D + f] * pr[f];
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(D), 1.0f, dphi,
              int(ldd), w_.data(), int(d), 0.0f, dx, int(lddx));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* o = dx + r * lddx;
    const float ss = dot(xr, xr, d);
    if (!(ss > 0.0f)) {
      std::fill(o, o + d, 0.0f);
      continue;
    }
    const float inv = 1.0f / std::sqrt(ss);
    const float proj = dot(xr, o, d) * inv * inv;  // x^ . dx^ / |x|
    for (int64_t c = 0; c < d; ++c) o[c] = (o[c] - xr[c] * proj) * inv;
  }
}

void RfaFeatureMap::map(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo) const {
  const int64_t D = freqs_, d = d_;
  // 1. W x into the first D entries of each output row
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(D), int(d), 1.0f, x, int(ldx),
              w_.data(), int(d), 0.0f, out, int(ldo));
  const float ratio = float(1.0 / std::sqrt(double(D)));
  for (int64_t r = 0; r < rows; ++r) {
    // 2. W x^ = W x / |x| (0 for x = 0), then sin into entry f and cos into entry D + f
    const float* xr = x + r * ldx;
    const float ss = dot(xr, xr, d);
    const float inv = ss > 0.0f ? 1.0f / std::sqrt(ss) : 0.0f;
    float* y = out + r * ldo;
    int64_t f = 0;
    // 16 (AVX-512), then 8 (AVX2) frequencies at a time through the polynomial sincos of
    // common/kernels/simd.h (within a few ulp of libm's; both widths give the same bits); a group
    // with an angle past its exact range goes the libm way
#ifdef __AVX512F__
    const __m512 winv = _mm512_set1_ps(inv), wratio = _mm512_set1_ps(ratio),
                 wlimit = _mm512_set1_ps(simd::kSincosLimit);
    for (; f + simd::kLanes <= D; f += simd::kLanes) {
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(y + f), winv);
      // |a| <= limit in every lane (false for NaN): else these lanes go the narrower ways
      if (_mm512_cmp_ps_mask(_mm512_abs_ps(a), wlimit, _CMP_LE_OQ) != 0xFFFF) break;
      __m512 sn, cs;
      simd::sincos_ps(a, sn, cs);
      _mm512_storeu_ps(y + D + f, _mm512_mul_ps(cs, wratio));
      _mm512_storeu_ps(y + f, _mm512_mul_ps(sn, wratio));
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    namespace v8 = simd::avx2;
    const __m256 vinv = _mm256_set1_ps(inv), vratio = _mm256_set1_ps(ratio),
                 limit = _mm256_set1_ps(simd::kSincosLimit);
    for (; f + v8::kLanes <= D; f += v8::kLanes) {
      const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(y + f), vinv);
      // |a| <= limit in every lane (false for NaN): else these lanes go the scalar way
      const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
      if (_mm256_movemask_ps(_mm256_cmp_ps(abs, limit, _CMP_LE_OQ)) != 0xFF) break;
      __m256 sn, cs;
      v8::sincos_ps(a, sn, cs);
      _mm256_storeu_ps(y + D + f, _mm256_mul_ps(cs, vratio));
      _mm256_storeu_ps(y + f, _mm256_mul_ps(sn, vratio));
    }
#endif
    for (; f < D; ++f) {
      const float a = y[f] * inv;
      y[D + f] = std::cos(a) * ratio;
      y[f] = std::sin(a) * ratio;
    }
  }
}

}  // namespace rfa
}  // namespace attnbench
