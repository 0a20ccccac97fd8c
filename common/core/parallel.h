// Parallel regions too small for the team run on one thread.
//
// One rule trims the team, the same everywhere: a region whose work is too small to pay for
// opening it runs on the calling thread alone (region_threads, parallel_worth, SerialIfSmall).
// Below the threshold a fork/join costs a sizeable share of the work, and on a loaded machine
// (another process busy on a core the team uses) a region of two threads waits for whichever
// of them the scheduler preempted: a step of a few microseconds of work would take a scheduler
// slice. Decode steps, small tiles and small GEMMs stay on one thread; large problems keep the
// team (common/core/threads.h).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/core/threads.h"

namespace attnbench {

/// The least work, in flops (a multiply-add counts 2; a region that streams memory counts its
/// kernel's flops, e.g. 4 d per cached key and query head for a decode step), for which a
/// parallel region opens on more than one thread.
///
/// How it is set: against the cost of the synchronisation a region brings, measured on the
/// machine the suite is developed on (2 vCPUs). With the passive wait policy
/// (harness/wait_policy.cpp) each synchronisation point of a team of two (the fork, a barrier,
/// the join) costs a futex wake-up, and a decode step's region has three (the fork, the
/// barrier between its two loops, the join). A region runs on the team only when its work
/// takes one thread at least 20 times those three wake-ups, with the decode kernels' rate on
/// one thread (full's step at n = 1024, 2 M flops, timed undisturbed), rounded up to a power
/// of two: 2^22 flops. Two threads already break even at a tenth of it on a quiet machine,
/// but a region that small loses most of its gain to one late wake-up when another process
/// competes for the cores; above it a region loses at most a few percent to synchronising.
/// Re-measure (fork/join of an empty region, a decode step on one thread) on another machine.
inline constexpr double kParallelMinFlops = double(int64_t(1) << 22);

/// Threads a region of `flops` work split into `tasks` independent pieces should run on: 1
/// when flops < kParallelMinFlops, there is a single task or the team is one thread (or the
/// caller is already inside a parallel region), else min(team, tasks).
inline int region_threads(double flops, int64_t tasks = std::numeric_limits<int64_t>::max()) {
  const int team = team_threads();
  if (team <= 1 || tasks <= 1 || !(flops >= kParallelMinFlops) || omp_in_parallel()) return 1;
  return int(std::min<int64_t>(team, tasks));
}

/// Whether a region of `flops` work over `tasks` pieces is worth more than one thread; for
/// `#pragma omp parallel if (parallel_worth(...))`.
inline bool parallel_worth(double flops, int64_t tasks = std::numeric_limits<int64_t>::max()) {
  return region_threads(flops, tasks) > 1;
}

/// For its scope, the team of a piece of work below kParallelMinFlops is the calling thread
/// alone: the parallel regions opened inside run on one thread, and so do OpenBLAS's calls
/// (its OpenMP build takes the OpenMP team size, omp_get_max_threads(), as its own). A decode
/// step opens one at its top with the step's flops. Above the threshold it changes nothing.
class SerialIfSmall {
 public:
  /// `threshold`: kParallelMinFlops, or an engine's own (lowered by tests to exercise the
  /// parallel path on small problems).
  explicit SerialIfSmall(double flops, double threshold = kParallelMinFlops)
      : before_(!(flops >= threshold) ? omp_get_max_threads() : 1) {
    if (before_ > 1) omp_set_num_threads(1);
  }
  ~SerialIfSmall() {
    if (before_ > 1) omp_set_num_threads(before_);
  }
  SerialIfSmall(const SerialIfSmall&) = delete;
  SerialIfSmall& operator=(const SerialIfSmall&) = delete;

 private:
  int before_;
};

}  // namespace attnbench
