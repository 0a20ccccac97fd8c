#include "harness/team.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "common/core/error.h"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace attnbench {

int max_threads() { return kMaxThreadsPerCore * std::max(1, omp_get_num_procs()); }

int resolve_threads(int threads) {
  if (threads < 0 || threads > max_threads())
    throw UsageError(
        fmt::format("threads: {} is out of range; accepted: 0 (every core) to {} "
                    "({} per core on {} cores)",
                    threads, max_threads(), kMaxThreadsPerCore, omp_get_num_procs()));
  return threads == 0 ? omp_get_num_procs() : threads;
}

namespace {

// OpenBLAS's thread count is one setting of the whole process, where OpenMP's team size is
// per thread. Teams of concurrent calls (Python threads with the GIL released) share it: the
// count outside any team (`baseline`) is saved when the first team starts and put back when
// the last one ends, and while several teams are open the count is the largest they asked
// for. Saving and restoring per team instead races (a team ending after another started
// restores the count the other had set) and could leave the process at 1 thread for good.
struct BlasThreads {
  std::mutex mu;
  std::multiset<int> open;  // the counts of the teams open now
  int baseline = 0;
};

BlasThreads& blas_threads() {
  static BlasThreads b;
  return b;
}

}  // namespace

int apply_threads(int threads) {
  threads = resolve_threads(threads);
  omp_set_num_threads(threads);
  BlasThreads& b = blas_threads();
  const std::lock_guard<std::mutex> lock(b.mu);
  if (b.open.empty())
    openblas_set_num_threads(threads);
  else
    b.baseline = threads;  // what the last open team puts back
  return threads;
}

ThreadTeam::ThreadTeam(int threads) : omp_before_(omp_get_max_threads()) {
  {
    BlasThreads& b = blas_threads();
    const std::lock_guard<std::mutex> lock(b.mu);
    if (b.open.empty()) b.baseline = openblas_get_num_threads();
    b.open.insert(threads);
    openblas_set_num_threads(*b.open.rbegin());
  }
  threads_ = threads;
  omp_set_num_threads(threads);
}

ThreadTeam::~ThreadTeam() {
  {
    BlasThreads& b = blas_threads();
    const std::lock_guard<std::mutex> lock(b.mu);
    b.open.erase(b.open.find(threads_));
    openblas_set_num_threads(b.open.empty() ? b.baseline : *b.open.rbegin());
  }
  omp_set_num_threads(omp_before_);
}

}  // namespace attnbench
