// Small SIMD helpers for hand-vectorised kernels: 16-lane AVX-512 ones when the compiler
// targets AVX-512F (__AVX512F__), 8-lane AVX2 ones (namespace simd::avx2) when it targets
// AVX2 with FMA. Callers keep a portable path for other targets.
#pragma once

namespace attnbench::simd {

/// 2^f on [-1/2, 1/2] as a Horner polynomial, highest power first: the degree-5 minimax of
/// Cephes' exp2f in 1 + f P(f) form (relative error 1.7e-7). Both widths below use it.
inline constexpr int kExp2Terms = 7;
inline constexpr float kExp2Poly[kExp2Terms] = {1.535336188319500e-4f,
                                                1.339887440266574e-3f,
                                                9.618437357674640e-3f,
                                                5.550332471162809e-2f,
                                                2.402264791363012e-1f,
                                                6.931472028550421e-1f,
                                                1.0f};

/// sin and cos reduction and polynomials shared by both widths' sincos_ps: x = j pi/2 + r
/// with j = round(2 x / pi) and r = x - j (pi/2) in three parts (Cody-Waite; the first part has
/// 8 significant bits, so j times it is exact for |j| <= 2^13), then Cephes' sinf / cosf
/// minimax polynomials in r^2 on [-pi/4, pi/4], highest power first.
inline constexpr float kTwoOverPi = 0.636619772367581343f;
inline constexpr float kPiOver2Parts[3] = {1.5703125f, 4.837512969970703125e-4f,
                                           7.54978995489188216e-8f};
/// Largest |x| sincos_ps reduces exactly: j (pi/2)_hi with |j| <= 2^13 is exact in float.
inline constexpr float kSincosLimit = 8192.0f;
inline constexpr float kSinPoly[3] = {-1.9515295891e-4f, 8.3321608736e-3f, -1.6666654611e-1f};
inline constexpr float kCosPoly[3] = {2.443315711809948e-5f, -1.388731625493765e-3f,
                                      4.166664568298827e-2f};

}  // namespace attnbench::simd

#ifdef __AVX512F__
#include <immintrin.h>

#include <cstdint>

namespace attnbench::simd {

/// Floats per 512-bit register.
inline constexpr int kLanes = 16;

/// 2^x for 16 floats, within about 2 ulp, for x <= 0 (or NaN) only: anything below -150
/// (including -inf) gives exactly 0, and NaN stays NaN.
///
/// x = k + f with k = round(x) and f in [-1/2, 1/2] (exact); 2^f = 1 + f P(f) with the
/// degree-5 minimax P of Cephes' exp2f (relative error 1.7e-7 on that interval); scalef
/// multiplies by 2^k, going gradually to 0 through the subnormals.
inline __m512 exp2_nonpos_ps(__m512 x) {
  // x second: max returns its second operand when either is NaN, so NaN is kept
  x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, k);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, k);
}

/// 2^x for 16 floats, within about 2 ulp: exp2_nonpos_ps with x also clamped to 128 from
/// above, so that 128 or more gives +inf. NaN stays NaN.
inline __m512 exp2_ps(__m512 x) { return exp2_nonpos_ps(_mm512_min_ps(_mm512_set1_ps(128.0f), x)); }

/// sin and cos of 16 floats with |x| <= kSincosLimit (callers check; outside it, and for NaN,
/// the results are meaningless), within about 2 ulp of the float result: the reduction and
/// polynomials above, and the quadrant j mod 4 picks and signs them.
inline void sincos_ps(__m512 x, __m512& sin_out, __m512& cos_out) {
  const __m512 j = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kTwoOverPi)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = x;
  for (float part : kPiOver2Parts) r = _mm512_fnmadd_ps(j, _mm512_set1_ps(part), r);
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 ps = _mm512_set1_ps(kSinPoly[0]), pc = _mm512_set1_ps(kCosPoly[0]);
  for (int i = 1; i < 3; ++i) {
    ps = _mm512_fmadd_ps(ps, r2, _mm512_set1_ps(kSinPoly[i]));
    pc = _mm512_fmadd_ps(pc, r2, _mm512_set1_ps(kCosPoly[i]));
  }
  const __m512 s = _mm512_fmadd_ps(_mm512_mul_ps(ps, r2), r, r);
  const __m512 c = _mm512_add_ps(
      _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), r2, _mm512_mul_ps(_mm512_mul_ps(pc, r2), r2)),
      _mm512_set1_ps(1.0f));
  // quadrant q = j mod 4: sin x = (s, c, -s, -c)[q], cos x = (c, -s, -c, s)[q]
  const __m512i q = _mm512_cvtps_epi32(j);
  const __mmask16 swap = _mm512_test_epi32_mask(q, _mm512_set1_epi32(1));
  const __m512i sign_s = _mm512_slli_epi32(_mm512_and_si512(q, _mm512_set1_epi32(2)), 30);
  const __m512i sign_c = _mm512_slli_epi32(
      _mm512_and_si512(_mm512_add_epi32(q, _mm512_set1_epi32(1)), _mm512_set1_epi32(2)), 30);
  sin_out = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(_mm512_mask_blend_ps(swap, s, c)), sign_s));
  cos_out = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(_mm512_mask_blend_ps(swap, c, s)), sign_c));
}

/// Mask of the first `count` lanes (count clamped to [0, 16]).
inline __mmask16 first_lanes(int64_t count) {
  if (count <= 0) return 0;
  if (count >= kLanes) return 0xFFFF;
  return static_cast<__mmask16>((1u << count) - 1u);
}

}  // namespace attnbench::simd

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cmath>

namespace attnbench::simd::avx2 {

/// Floats per 256-bit register.
inline constexpr int kLanes = 8;

/// 2^x for 8 floats, within about 2 ulp: the same reduction and polynomial as the AVX-512
/// exp2_ps. x is clamped to [-150, 128] (NaN stays NaN); 2^k is applied as two powers of two
/// 2^(k/2) of normal range each, so results below 2^-126 go gradually through the subnormals
/// to 0, and 128 or more gives +inf.
inline __m256 exp2_ps(__m256 x) {
  // x second: min and max return their second operand when either is NaN
  x = _mm256_min_ps(_mm256_set1_ps(128.0f), x);
  x = _mm256_max_ps(_mm256_set1_ps(-150.0f), x);
  const __m256 k = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, k);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  // k = k1 + k2 with k1 = floor(k / 2): both in [-75, 64], so 2^k1 and 2^k2 are normal
  const __m256i ki = _mm256_cvtps_epi32(k);
  const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/// exp(x) for 8 floats: fast_exp (common/kernels/softmax.h) lane by lane, the same Cody-Waite
/// reduction and polynomial. Below -87.33 it gives exactly 0 (so exp(-inf) = 0), above 88.7
/// +inf, and NaN stays NaN.
inline __m256 exp_ps(__m256 x) {
  const __m256 round = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23: adding it rounds
  // x second: min and max return their second operand when either is NaN
  const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-87.33f), x));
  const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), round);
  const __m256 n = _mm256_sub_ps(t, round);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.3888889e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333338e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666668e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n as two powers of two of normal range each (n reaches 128 near the top of the range)
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(round));
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  y = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.33f), _CMP_LT_OQ), y);
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY),
                          _mm256_cmp_ps(x, _mm256_set1_ps(88.7f), _CMP_GT_OQ));
}

/// Largest of the 8 lanes.
inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

/// Sum of the 8 lanes.
inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// sin and cos of 8 floats with |x| <= kSincosLimit (callers check; outside it, and for NaN,
/// the results are meaningless), within about 2 ulp of the float result: the reduction and
/// polynomials of simd:: (kPiOver2Parts, kSinPoly, kCosPoly), and the quadrant j mod 4 picks
/// and signs them.
inline void sincos_ps(__m256 x, __m256& sin_out, __m256& cos_out) {
  const __m256 j = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kTwoOverPi)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = x;
  for (float part : kPiOver2Parts) r = _mm256_fnmadd_ps(j, _mm256_set1_ps(part), r);
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 ps = _mm256_set1_ps(kSinPoly[0]), pc = _mm256_set1_ps(kCosPoly[0]);
  for (int i = 1; i < 3; ++i) {
    ps = _mm256_fmadd_ps(ps, r2, _mm256_set1_ps(kSinPoly[i]));
    pc = _mm256_fmadd_ps(pc, r2, _mm256_set1_ps(kCosPoly[i]));
  }
  const __m256 s = _mm256_fmadd_ps(_mm256_mul_ps(ps, r2), r, r);
  const __m256 c = _mm256_add_ps(
      _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), r2, _mm256_mul_ps(_mm256_mul_ps(pc, r2), r2)),
      _mm256_set1_ps(1.0f));
  // quadrant q = j mod 4: sin x = (s, c, -s, -c)[q], cos x = (c, -s, -c, s)[q]
  const __m256i q = _mm256_cvtps_epi32(j);
  const __m256 swap = _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(q, _mm256_set1_epi32(1)), _mm256_set1_epi32(1)));
  const __m256 sign_s =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(2)), 30));
  const __m256 sign_c = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_and_si256(_mm256_add_epi32(q, _mm256_set1_epi32(1)), _mm256_set1_epi32(2)), 30));
  sin_out = _mm256_xor_ps(_mm256_blendv_ps(s, c, swap), sign_s);
  cos_out = _mm256_xor_ps(_mm256_blendv_ps(c, s, swap), sign_c);
}

}  // namespace attnbench::simd::avx2

#endif  // __AVX2__ && __FMA__
