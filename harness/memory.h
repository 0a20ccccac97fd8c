// Heap accounting. The process-wide allocation hook (harness/memory_hook.cpp, linked into
// the executables) replaces malloc and its relatives, so operator new (which libstdc++ routes
// through malloc), Eigen temporaries and the OpenMP runtime are all seen.
#pragma once

#include <cstdint>

namespace attnbench {

/// Whether the allocation hook counts (false under AddressSanitizer, whose allocator it leaves
/// alone): when it does not, every heap figure below stays 0 and must not be reported.
bool heap_counting();
/// Bytes currently allocated on the heap (usable sizes).
int64_t heap_current_bytes();
/// Resets the peak to the current figure and returns it.
int64_t heap_reset_peak();
/// Peak of heap_current_bytes() since the last reset.
int64_t heap_peak_bytes();
/// Number of allocations since the process started.
int64_t heap_allocations();

/// Peak heap bytes above the level at construction (which resets the process-wide peak).
/// The harness measures each timed run with one of these instead of Google Benchmark's
/// MemoryManager: Debian's Google Benchmark 1.7.1 hands reporters pointers to memory results
/// that go stale after the first repetition (google/benchmark#1939), so neither attnbench nor
/// its JSONReporter may see them.
class PeakScope {
 public:
  PeakScope() : base_(heap_reset_peak()), allocs_(heap_allocations()) {}
  int64_t peak_bytes() const { return heap_peak_bytes() - base_; }
  int64_t allocations() const { return heap_allocations() - allocs_; }

 private:
  int64_t base_, allocs_;
};

}  // namespace attnbench
