#include "common/kernels/bf16.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string_view>

#include "common/core/error.h"
#include "common/kernels/amx_kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
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

namespace {

// The best rate, GFLOP/s, of `step` (flops_per_step flops on one thread's registers or tiles)
// run by `threads` threads together: the step count doubles until a round takes `seconds`.
// enter / leave run on each thread around its steps (the AMX tile configuration).
template <class Step, class Enter, class Leave>
double peak_rate(int threads, double seconds, double flops_per_step, Step step, Enter enter,
                 Leave leave) {
  double best = 0;
  for (int64_t steps = 1024;; steps *= 2) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      enter();
      step(steps);
      leave();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, flops_per_step * double(steps) * threads / s / 1e9);
    if (s >= seconds || steps > (int64_t(1) << 40)) return best;
  }
}

}  // namespace

double amx_bf16_peak_gflops(int threads, double seconds) {
#ifdef ATTNBENCH_AMX_KERNELS
  if (!amx_usable()) return 0.0;
  namespace amx = kernels::amx;
  constexpr double kFlops = 4.0 * 2 * amx::kTileRows * amx::kTileRows * amx::kDepth;
  return peak_rate(
      threads, seconds, kFlops,
      [](int64_t steps) {
        // A, B (bf16) and C (float) of one 2 x 2 block, in L1
        alignas(64) uint16_t a[2 * amx::kTileRows * amx::kDepth] = {};
        alignas(64) uint16_t b[2 * amx::kTileRows * amx::kDepth] = {};
        alignas(64) float c[4 * amx::kTileRows * amx::kTileRows] = {};
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t i = 0; i < steps; ++i) {
          _tile_loadd(4, a, 64);
          _tile_loadd(5, a + amx::kTileRows * amx::kDepth, 64);
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + amx::kTileRows * amx::kDepth, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
        asm volatile("" : : "r"(c) : "memory");
      },
      [] { kernels::amx::configure(); }, [] { kernels::amx::release(); });
#else
  (void)threads, (void)seconds;
  return 0.0;
#endif
}

double avx512_bf16_peak_gflops(int threads, double seconds) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (!cpu_has_avx512_bf16()) return 0.0;
  constexpr int kAcc = 12;
  return peak_rate(
      threads, seconds, kAcc * 64.0,
      [](int64_t steps) {
        __m512 acc[kAcc];
        for (__m512& x : acc) x = _mm512_setzero_ps();
        __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = a;
        for (int64_t i = 0; i < steps; ++i) {
          for (__m512& x : acc) x = _mm512_dpbf16_ps(x, a, b);
          asm volatile("" : "+v"(a), "+v"(b));
        }
        __m512 sum = acc[0];
        for (int i = 1; i < kAcc; ++i) sum = _mm512_add_ps(sum, acc[i]);
        asm volatile("" : : "v"(sum));
      },
      [] {}, [] {});
#else
  (void)threads, (void)seconds;
  return 0.0;
#endif
}

std::string bf16_kernel_request() {
  const char* env = std::getenv(kBf16KernelEnv);
  const std::string_view v = env && *env ? env : "auto";
  if (v != "auto" && v != "amx" && v != "f32")
    throw UsageError(std::string(kBf16KernelEnv) + "='" + std::string(v) +
                     "' is not a bf16 kernel; accepted: auto, amx, f32");
  return std::string(v);
}

}  // namespace attnbench
