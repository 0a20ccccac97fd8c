// Small AVX-512 helpers for hand-vectorised kernels. Everything here exists only when the
// compiler targets AVX-512F (__AVX512F__); callers keep a portable path for other targets.
#pragma once

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
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

/// 2^x for 16 floats, within about 2 ulp: exp2_nonpos_ps with x also clamped to 128 from
/// above, so that 128 or more gives +inf. NaN stays NaN.
inline __m512 exp2_ps(__m512 x) { return exp2_nonpos_ps(_mm512_min_ps(_mm512_set1_ps(128.0f), x)); }

/// Mask of the first `count` lanes (count clamped to [0, 16]).
inline __mmask16 first_lanes(int64_t count) {
  if (count <= 0) return 0;
  if (count >= kLanes) return 0xFFFF;
  return static_cast<__mmask16>((1u << count) - 1u);
}

}  // namespace attnbench::simd

#endif  // __AVX512F__
