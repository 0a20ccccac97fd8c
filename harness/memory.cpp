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

}  // namespace attnbench
