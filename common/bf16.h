// bfloat16 rounding: a float32 with its low 16 mantissa bits rounded away, to nearest with ties
// to even (as torch.Tensor.to(torch.bfloat16) and the hardware's conversions round). The
// values stay in float32 arrays; a bf16 value converts to and from float32 exactly.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/tensor.h"

namespace attnbench {

/// The bfloat16 bits of x: rounded to nearest even; a NaN stays a (quiet) NaN of the same sign.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

/// The float32 of bfloat16 bits (exact).
inline float bf16_float(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

/// x rounded to the nearest bfloat16 value (ties to even), as a float.
inline float bf16_round(float x) { return bf16_float(bf16_bits(x)); }

/// The bf16 path of the tiled attention engine (common/block_sparse.h), as a row's notes say
/// it: its products take the bfloat16 values of q, k, v and P in float32 arithmetic (a product
/// of two bfloat16 values is exact in float32, so this is bf16 products with float32
/// accumulation), on every CPU; it uses no bf16 instruction (AVX512-BF16, AMX), so it is not
/// faster than float32.
inline constexpr const char* kBf16EnginePath =
    "bf16 path: portable (bfloat16 operands, float32 arithmetic; no AVX512-BF16/AMX kernel)";

/// Rounds n floats to bfloat16 values in place.
void round_to_bf16(float* x, int64_t n);

/// A copy of t (same storage shape and grouping) with every value rounded to bfloat16.
Tensor rounded_bf16(const Tensor& t);

}  // namespace attnbench
