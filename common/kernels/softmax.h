// Softmax helpers shared by the kernels: a vectorisable exp and row softmax.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "common/kernels/simd.h"

namespace attnbench {

/// exp(x) to about 2 ulp for x in [-87.3, 88.7]; exactly 0 below that (so exp(-inf) = 0)
/// and +inf above. Written with plain arithmetic so GCC vectorises loops that call it.
/// fast_exp without its clamps: for xc in [-87.33, 88.7] only, and branch-free (so a loop of
/// it vectorises).
inline float fast_exp_in_range(float xc) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = xc * kLog2e + kRound;
  float n = t - kRound;
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  // exp(r) on [-ln2/2, ln2/2] by a degree-6 polynomial (Taylor-like, Horner form).
  float p = 1.3888889e-3f;
  p = p * r + 8.3333338e-3f;
  p = p * r + 4.1666668e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n as two powers of two of normal range each (n reaches 128 near the top of the range)
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kRound);
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  return p * std::bit_cast<float>((n1 + 127) << 23) * std::bit_cast<float>((n2 + 127) << 23);
}

inline float fast_exp(float x) {
  float y = fast_exp_in_range(x < -87.33f ? -87.33f : (x > 88.7f ? 88.7f : x));
  y = x < -87.33f ? 0.0f : y;
  return x > 88.7f ? INFINITY : y;
}

/// max of x[0, len) (-inf for an empty row). The max is kept in 16 lanes with a plain
/// comparison, so GCC vectorises it (std::fmax becomes a libm call per element).
inline float row_max(const float* x, int64_t len) {
  int64_t j = 0;
  float mx = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  // x first: a NaN score is passed over, as the comparison below does
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  for (; j + 16 <= len; j += 16) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + j), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + j + 8), m1);
  }
  mx = simd::avx2::reduce_max(_mm256_max_ps(m0, m1));
#else
  constexpr int kLanes = 16;
  float m[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = -INFINITY;
  for (; j + kLanes <= len; j += kLanes)
    for (int l = 0; l < kLanes; ++l) m[l] = x[j + l] > m[l] ? x[j + l] : m[l];
  for (int l = 0; l < kLanes; ++l) mx = m[l] > mx ? m[l] : mx;
#endif
  for (; j < len; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

/// x <- exp((x - max) scale) in place; returns the sum, accumulated in 16 lanes. `max` is the
/// row max in the units of x (raw logits): x - max <= 0, so no exponential can overflow
/// whatever the size of the logits (subtracting max * scale from x * scale instead rounds
/// max * scale, and at |logit| ~ 1e9 that rounding alone is past exp's range). A NaN, or
/// max = +-inf (an overflowed logit), gives NaN, never a finite wrong value.
inline float exp_sum(float* x, int64_t len, float scale, float max) {
  int64_t j = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(max), sv = _mm256_set1_ps(scale);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  for (; j + 16 <= len; j += 16) {
    const __m256 e0 =
        simd::avx2::exp_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv), sv));
    const __m256 e1 =
        simd::avx2::exp_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), mv), sv));
    _mm256_storeu_ps(x + j, e0);
    _mm256_storeu_ps(x + j + 8, e1);
    s0 = _mm256_add_ps(s0, e0);
    s1 = _mm256_add_ps(s1, e1);
  }
  sum = simd::avx2::reduce_add(_mm256_add_ps(s0, s1));
#else
  constexpr int kLanes = 16;
  float s[kLanes] = {};
  for (; j + kLanes <= len; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float e = fast_exp((x[j + l] - max) * scale);
      x[j + l] = e;
      s[l] += e;
    }
  for (int l = 0; l < kLanes; ++l) sum += s[l];
#endif
  for (; j < len; ++j) sum += x[j] = fast_exp((x[j] - max) * scale);
  return sum;
}

/// In-place softmax of x[0, len) scaled by `scale`: x <- exp(scale (x - max)) / sum.
/// An empty row is left alone. Returns the sum of exponentials (0 for an empty row).
inline float softmax_row(float* x, int64_t len, float scale) {
  if (len <= 0) return 0.0f;
  const float sum = exp_sum(x, len, scale, row_max(x, len));
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < len; ++j) x[j] *= inv;
  return sum;
}

/// Sum of a[c] b[c] over [0, len): in 16 (AVX-512, the last group masked) or 8 (AVX2, then
/// the rest in order) interleaved partial sums, added up at the end.
inline float dot(const float* a, const float* b, int64_t len) {
  int64_t c = 0;
  float sum = 0.0f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; c < len; c += simd::kLanes) {
    const __mmask16 lanes = simd::first_lanes(len - c);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, a + c), _mm512_maskz_loadu_ps(lanes, b + c),
                          acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  if (len >= simd::avx2::kLanes) {
    __m256 acc = _mm256_setzero_ps();
    for (; c + simd::avx2::kLanes <= len; c += simd::avx2::kLanes)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    sum = simd::avx2::reduce_add(acc);
  }
#endif
  for (; c < len; ++c) sum += a[c] * b[c];
  return sum;
}

/// The backward of one softmax row (softmax_row's output p, `len` entries): the gradient g of
/// the loss in p becomes the gradient in the row's unscaled logits, g <- p o (g - D) scale.
/// D = rowsum(p o g); for an attention row O = P V with upstream dO it equals dO . O, which
/// callers holding both pass instead.
inline void softmax_backward_row(const float* p, float* g, int64_t len, float D, float scale) {
  for (int64_t c = 0; c < len; ++c) g[c] = p[c] * (g[c] - D) * scale;
}

/// softmax_backward_row over `rows` rows of `cols` (row-major, no gaps), D from p and g.
inline void softmax_backward_rows(const float* p, float* g, int64_t rows, int64_t cols,
                                  float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + r * cols;
    float* gr = g + r * cols;
    softmax_backward_row(pr, gr, cols, dot(pr, gr, cols), scale);
  }
}

}  // namespace attnbench
