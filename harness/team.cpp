#include "harness/team.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>

#include "common/error.h"

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

int apply_threads(int threads) {
  threads = resolve_threads(threads);
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  return threads;
}

ThreadTeam::ThreadTeam(int threads)
    : omp_before_(omp_get_max_threads()), blas_before_(openblas_get_num_threads()) {
  openblas_set_num_threads(threads);
  omp_set_num_threads(threads);
}

ThreadTeam::~ThreadTeam() {
  openblas_set_num_threads(blas_before_);
  omp_set_num_threads(omp_before_);
}

}  // namespace attnbench
