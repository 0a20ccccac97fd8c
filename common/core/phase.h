// Phases of a forward pass, timed by whoever is listening.
//
// A variant may mark the phases of its forward pass (hashing, routing, ...) so their share of
// the time can be reported; it never reads a clock itself. The harness installs a PhaseSink
// around the timed passes, which keeps the clock and the sums; with none installed (tests,
// the checked pass, a plugin host that does not care) a Phase is one atomic load and a branch.
//
//   for (int64_t bh = ...) {              // inside a parallel region is fine
//     { Phase ph("hash"); hash(...); }
//     { Phase ph("attend"); attend(...); }
//   }
//
// Phase names are string literals (the sink may keep the pointer). The time of a phase is
// summed over the threads that run it, so with one head per thread it is thread-seconds; the
// share of a phase in a pass is its time over the sum of the pass's phases. Mark phases that
// do not overlap and together cover the work whose split is of interest.
#pragma once

#include <atomic>

namespace attnbench {

/// Receives the phases of forward passes. Both functions may be called concurrently from
/// any thread of a parallel region.
class PhaseSink {
 public:
  virtual ~PhaseSink() = default;
  /// A phase named `name` starts on the calling thread; returns a mark given back to end().
  virtual double begin(const char* name) = 0;
  /// The phase begun with `mark` ends on the calling thread.
  virtual void end(const char* name, double mark) = 0;
};

/// The sink phases go to, or nullptr (the default): phases are then not timed at all.
PhaseSink* phase_sink();
/// Installs `sink` (nullptr removes it) and returns the previous one. Not to be called while
/// a forward pass runs.
PhaseSink* set_phase_sink(PhaseSink* sink);

/// One phase, from construction to destruction, reported to the installed sink if any.
class Phase {
 public:
  explicit Phase(const char* name) : name_(name), sink_(phase_sink()) {
    if (sink_) mark_ = sink_->begin(name_);
  }
  ~Phase() {
    if (sink_) sink_->end(name_, mark_);
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  const char* name_;
  PhaseSink* sink_;
  double mark_ = 0;
};

}  // namespace attnbench
