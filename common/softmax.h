// Softmax helpers shared by the kernels: a vectorisable exp and row softmax.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

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
  int32_t bits = (std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kRound) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

inline float fast_exp(float x) {
  float y = fast_exp_in_range(x < -87.33f ? -87.33f : (x > 88.7f ? 88.7f : x));
  y = x < -87.33f ? 0.0f : y;
  return x > 88.7f ? INFINITY : y;
}

/// max of x[0, len) (-inf for an empty row). The max is kept in 16 lanes with a plain
/// comparison, so GCC vectorises it (std::fmax becomes a libm call per element).
inline float row_max(const float* x, int64_t len) {
  constexpr int kLanes = 16;
  float m[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = -INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes)
    for (int l = 0; l < kLanes; ++l) m[l] = x[j + l] > m[l] ? x[j + l] : m[l];
  float mx = -INFINITY;
  for (; j < len; ++j) mx = x[j] > mx ? x[j] : mx;
  for (int l = 0; l < kLanes; ++l) mx = m[l] > mx ? m[l] : mx;
  return mx;
}

/// x <- exp((x - max) scale) in place; returns the sum, accumulated in 16 lanes. `max` is the
/// row max in the units of x (raw logits): x - max <= 0, so no exponential can overflow
/// whatever the size of the logits (subtracting max * scale from x * scale instead rounds
/// max * scale, and at |logit| ~ 1e9 that rounding alone is past exp's range). A NaN, or
/// max = +-inf (an overflowed logit), gives NaN, never a finite wrong value.
inline float exp_sum(float* x, int64_t len, float scale, float max) {
  constexpr int kLanes = 16;
  float s[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float e = fast_exp((x[j + l] - max) * scale);
      x[j + l] = e;
      s[l] += e;
    }
  float sum = 0.0f;
  for (; j < len; ++j) sum += x[j] = fast_exp((x[j] - max) * scale);
  for (int l = 0; l < kLanes; ++l) sum += s[l];
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

}  // namespace attnbench
