// The thread count of the calls into a variant: the harness's --threads and the Python
// module's threads= keyword.
#pragma once

namespace attnbench {

/// Threads per core a run may ask for: more only measures the scheduler, and far more makes
/// the OpenMP runtime fail to start its threads.
constexpr int kMaxThreadsPerCore = 8;
/// The largest thread count accepted: kMaxThreadsPerCore x the cores this process may use.
int max_threads();

/// Resolves threads = 0 to every core. Throws UsageError for a count outside
/// [0, max_threads()].
int resolve_threads(int threads);

/// Resolves threads = 0 to every core and applies the count to OpenMP and BLAS for the rest
/// of the process. Throws UsageError for a count outside [0, max_threads()].
int apply_threads(int threads);

/// The team every call into a variant runs with: sets the OpenMP team size and OpenBLAS's
/// thread count for a scope and restores both when it ends. OpenBLAS's count is process-wide:
/// with teams open at once in several threads it is the largest of theirs, and the count from
/// before the first is put back when the last ends (whatever order they end in). Variants, engines
/// and kernels take the team they are given (common/core/threads.h); run_one is where the count is
/// decided.
class ThreadTeam {
 public:
  /// `threads` >= 1 (resolve_threads gives one).
  explicit ThreadTeam(int threads);
  ~ThreadTeam();
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

 private:
  int omp_before_;
  int threads_;  // the count this team asked for
};

}  // namespace attnbench
