// Parallel loops that carry exceptions out: the shape every multi-threaded loop of attnbench
// takes.
//
//   parallel_for(tasks, [&](int64_t t) { work(t); });
//   parallel_for(tasks, [&] { return Scratch(size); },              // once per thread
//                [&](int64_t t, Scratch& s) { work(t, s); }, {.chunk = 4});
//
// Tasks go to the OpenMP team with schedule(dynamic, chunk), or all to the calling thread
// when `parallel` is false. The first exception any task (or a thread's scratch) throws is
// rethrown on the calling thread once the loop has ended; after it the tasks not yet started
// are skipped (OmpGuard). A task's body must not open a worksharing construct of its own.
#pragma once

#include <omp.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include "common/core/omp_guard.h"

namespace attnbench {

namespace detail {
/// Converts to make()'s result: optional::emplace constructs the scratch in place from it, so
/// a scratch type need not be movable.
template <class Make>
struct FromMake {
  Make& make;
  operator std::invoke_result_t<Make>() const { return make(); }
};
}  // namespace detail

/// How a parallel_for spreads its tasks.
struct ParallelFor {
  /// false: every task on the calling thread (a region too small for the team, or one a caller
  /// runs inside another parallel loop).
  bool parallel = true;
  /// Tasks a thread takes at a time (schedule(dynamic, chunk)).
  int chunk = 1;
  /// The team size; 0 = OpenMP's (omp_get_max_threads()).
  int threads = 0;
};

/// body(t) for every t in [0, tasks).
template <class Body>
void parallel_for(int64_t tasks, Body&& body, ParallelFor how = {}) {
  OmpGuard guard;
  const int team = how.threads > 0 ? how.threads : omp_get_max_threads();
#pragma omp parallel for if (how.parallel) num_threads(team) schedule(dynamic, how.chunk)
  for (int64_t t = 0; t < tasks; ++t) guard.run([&] { body(t); });
  guard.rethrow();
}

/// body(t, scratch) for every t in [0, tasks), where scratch is the value make() returned on
/// the thread that runs t (make runs once per thread, before its first task).
template <class Make, class Body>
requires std::is_invocable_v<Make>
void parallel_for(int64_t tasks, Make&& make, Body&& body, ParallelFor how = {}) {
  OmpGuard guard;
  const int team = how.threads > 0 ? how.threads : omp_get_max_threads();
#pragma omp parallel if (how.parallel) num_threads(team)
  {
    std::optional<std::invoke_result_t<Make>> scratch;
    guard.run([&] { scratch.emplace(detail::FromMake<Make>{make}); });
#pragma omp for schedule(dynamic, how.chunk)
    for (int64_t t = 0; t < tasks; ++t) guard.run([&] { body(t, *scratch); });
  }
  guard.rethrow();
}

}  // namespace attnbench
