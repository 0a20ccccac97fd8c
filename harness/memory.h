// Heap accounting. The process-wide allocation hook (harness/memory_hook.cpp, linked into
// the executables) replaces malloc and its relatives, so operator new (which libstdc++ routes
// through malloc), Eigen temporaries and the OpenMP runtime are all seen.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdint>

namespace attnbench {

/// Bytes currently allocated on the heap (usable sizes).
int64_t heap_current_bytes();
/// Resets the peak to the current figure and returns it.
int64_t heap_reset_peak();
/// Peak of heap_current_bytes() since the last reset.
int64_t heap_peak_bytes();
/// Number of allocations since the process started.
int64_t heap_allocations();

/// Google Benchmark MemoryManager reporting the peak bytes above the level at Start().
class PeakMemoryManager : public benchmark::MemoryManager {
 public:
  void Start() override;
  void Stop(Result& result) override;
  void Stop(Result* result) override { Stop(*result); }

 private:
  int64_t base_ = 0, allocs_ = 0;
};

}  // namespace attnbench
