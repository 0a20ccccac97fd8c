#include "common/core/phase.h"

namespace attnbench {

namespace {
std::atomic<PhaseSink*> g_sink{nullptr};
}  // namespace

PhaseSink* phase_sink() { return g_sink.load(std::memory_order_acquire); }

PhaseSink* set_phase_sink(PhaseSink* sink) {
  return g_sink.exchange(sink, std::memory_order_acq_rel);
}

}  // namespace attnbench
