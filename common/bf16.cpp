#include "common/bf16.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "common/amx_kernels.h"
#include "common/error.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attnbench {

void round_to_bf16(float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_round(x[i]);
}

Tensor rounded_bf16(const Tensor& t) {
  Tensor r(t.shape(), t.group());
  if (t.numel() > 0) {
    std::copy(t.data(), t.data() + t.numel(), r.data());
    round_to_bf16(r.data(), r.numel());
  }
  return r;
}

namespace {

struct CpuBf16 {
  bool avx512_bf16 = false, amx_tile = false, amx_bf16 = false;
};

CpuBf16 cpu_bf16() {
  CpuBf16 c;
#if defined(__x86_64__)
  unsigned a, b, cx, d;
  if (__get_cpuid_count(7, 0, &a, &b, &cx, &d)) {
    c.amx_bf16 = (d >> 22) & 1u;
    c.amx_tile = (d >> 24) & 1u;
  }
  if (__get_cpuid_count(7, 1, &a, &b, &cx, &d)) c.avx512_bf16 = (a >> 5) & 1u;
#endif
  return c;
}

// The reason the amx kernel cannot run, or "" when it can (asks the kernel for the tile state
// on the way: once per process, from amx_status()).
std::string amx_check() {
#ifndef ATTNBENCH_AMX_KERNELS
  return "not built: the compiler did not target AMX-BF16 (build with ATTNBENCH_NATIVE=ON on a "
         "CPU that has it)";
#else
  const CpuBf16 c = cpu_bf16();
  if (!c.amx_tile || !c.amx_bf16) return "this CPU has no AMX-BF16";
  if (!c.avx512_bf16) return "this CPU has no AVX512-BF16";
#if defined(__linux__)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0)
    return "the operating system did not grant the AMX tile state (arch_prctl)";
  return "";
#else
  return "AMX is enabled on Linux only";
#endif
#endif
}

const std::string& amx_status() {
  static const std::string reason = amx_check();
  return reason;
}

}  // namespace

bool amx_usable() { return amx_status().empty(); }
std::string amx_unusable_reason() { return amx_status(); }
bool cpu_has_avx512_bf16() { return cpu_bf16().avx512_bf16; }

std::string bf16_kernel_request() {
  const char* env = std::getenv(kBf16KernelEnv);
  const std::string_view v = env && *env ? env : "auto";
  if (v != "auto" && v != "amx" && v != "f32")
    throw UsageError(std::string(kBf16KernelEnv) + "='" + std::string(v) +
                     "' is not a bf16 kernel; accepted: auto, amx, f32");
  return std::string(v);
}

}  // namespace attnbench
