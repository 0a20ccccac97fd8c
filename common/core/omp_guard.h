// Exceptions out of OpenMP parallel regions.
//
// An exception must not leave the structured block of an OpenMP construct: one that does
// ends the process (std::terminate), so a std::bad_alloc in a worker thread would abort a
// whole sweep instead of failing one row. OmpGuard carries the first exception thrown inside
// a region out of it:
//
//   OmpGuard guard;
//   #pragma omp parallel
//   {
//     std::vector<float> buf;
//     guard.run([&] { buf.resize(size); });   // per-thread set-up
//   #pragma omp for
//     for (int64_t t = 0; t < tasks; ++t)
//       guard.run([&] { work(t, buf); });     // skipped once any thread has failed
//   }
//   guard.rethrow();                          // after the region, on the calling thread
//
// Every thread still reaches every worksharing construct and barrier of the region (a thread
// that skipped one would hang the others); only the work inside run() is skipped once a
// thread has failed. Keep the `#pragma omp for` outside the lambdas.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>
#include <utility>

namespace attnbench {

class OmpGuard {
 public:
  OmpGuard() = default;
  OmpGuard(const OmpGuard&) = delete;
  OmpGuard& operator=(const OmpGuard&) = delete;

  /// Runs f() unless a thread has already failed; keeps the first exception any thread throws.
  template <class F>
  void run(F&& f) noexcept {
    if (failed()) return;
    try {
      std::forward<F>(f)();
    } catch (...) {
      capture();
    }
  }

  /// Keeps the exception being handled (call inside a catch (...) block in the region), for
  /// hot loops whose body is better left out of a lambda.
  void capture() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::current_exception();
    failed_.store(true, std::memory_order_release);
  }

  /// Whether some run() threw.
  bool failed() const { return failed_.load(std::memory_order_acquire); }

  /// Throws the first captured exception, if any. Call after the region has ended.
  void rethrow() {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace attnbench
