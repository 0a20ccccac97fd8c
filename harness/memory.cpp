#include "harness/memory.h"

#include <atomic>

namespace attnbench {
namespace hook {
// Defined in memory_hook.cpp, which every attnbench binary links.
extern std::atomic<int64_t> g_current, g_peak, g_allocs;
}  // namespace hook
}  // namespace attnbench

namespace attnbench {

int64_t heap_current_bytes() { return hook::g_current.load(); }
int64_t heap_peak_bytes() { return hook::g_peak.load(); }
int64_t heap_allocations() { return hook::g_allocs.load(); }
int64_t heap_reset_peak() {
  int64_t cur = hook::g_current.load();
  hook::g_peak.store(cur);
  return cur;
}

void PeakMemoryManager::Start() {
  base_ = heap_reset_peak();
  allocs_ = heap_allocations();
}

void PeakMemoryManager::Stop(Result& result) {
  result.max_bytes_used = heap_peak_bytes() - base_;
  result.num_allocs = heap_allocations() - allocs_;
  result.net_heap_growth = heap_current_bytes() - base_;
}

}  // namespace attnbench
