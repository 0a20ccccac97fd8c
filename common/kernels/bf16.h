// bfloat16 rounding: a float32 with its low 16 mantissa bits rounded away, to nearest with ties
// to even (as torch.Tensor.to(torch.bfloat16) and the hardware's conversions round). The
// values stay in float32 arrays; a bf16 value converts to and from float32 exactly.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "common/core/tensor.h"

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

/// The bf16 kernels of the tiled attention engine (common/engines/block_sparse.h).
///   amx  AMX tiles (common/kernels/amx_kernels.h): Q K^T and P V as TDPBF16PS products of bfloat16
///        operands with float32 accumulation, the softmax in float32. Built when the compiler
///        targets AMX-BF16 (ATTNBENCH_NATIVE on such a CPU); used when the CPU has it and the
///        kernel grants the process the tile state.
///   f32  the float32 passes (AVX-512 or portable) on the bfloat16 values of q, k, v and P:
///        a product of two bfloat16 values is exact in float32, so this computes the same
///        function (bf16 products, float32 accumulation) on every CPU, at float32 speed.
enum class Bf16Kernel { amx, f32 };

/// Whether the amx kernel can run in this process: built in, the CPU reports AMX-TILE,
/// AMX-BF16 and AVX512-BF16 (CPUID), and arch_prctl(ARCH_REQ_XCOMP_PERM) granted the tile
/// state. Asked once per process.
bool amx_usable();
/// Why amx_usable() is false, a phrase ("this CPU has no AMX-BF16", ...); empty when true.
std::string amx_unusable_reason();
/// Whether the CPU reports AVX512-BF16 (CPUID), whether or not a kernel uses it.
bool cpu_has_avx512_bf16();

/// Peak rates of this machine's bf16 product instructions, GFLOP/s over `threads` threads,
/// each timed for about `seconds`: 0 where the build or the CPU has no such instruction.
///   amx          TDPBF16PS on L1-resident tiles, blocked as the engine's amx kernel (4 C tiles,
///                2 A and 2 B tiles loaded per step), 16384 flops per instruction
///   avx512_bf16  VDPBF16PS into 12 register accumulators, 64 flops per instruction
double amx_bf16_peak_gflops(int threads, double seconds);
double avx512_bf16_peak_gflops(int threads, double seconds);

/// The environment variable that picks the bf16 kernel: "auto" (the default: amx where
/// usable, else f32), "amx" (an error where it is not usable) or "f32".
inline constexpr const char* kBf16KernelEnv = "ATTNBENCH_BF16_KERNEL";
/// Its value ("auto" when unset); throws Error naming the accepted values for any other.
std::string bf16_kernel_request();

/// Rounds n floats to bfloat16 values in place.
void round_to_bf16(float* x, int64_t n);

/// A copy of t (same storage shape and grouping) with every value rounded to bfloat16.
Tensor rounded_bf16(const Tensor& t);

}  // namespace attnbench
