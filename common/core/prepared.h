// Per-head state a variant draws from the problem's seed and shapes alone (random projections
// and the feature maps built on them), for Variant::prepare.
//
// forward() calls get(): it returns the heads kept by prepare() when they were drawn for the
// same seed, head count and head dimension, and otherwise builds them into the caller's
// vector for this call only (so a forward() without prepare() pays for its draws every time). The
// variant's own parameters are fixed for its lifetime and are not part of the key. used() tells
// whether the last get() reused prepared heads, for the variant's notes().
//
//   bool prepare(const Problem& p) override { heads_.prepare(p, make); return true; }
//   void forward(...) { Heads fresh; const auto& maps = heads_.get(p, make, fresh); ... }
//   std::string notes() const override { return heads_.note(); }
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/core/omp_guard.h"
#include "common/core/problem.h"

namespace attnbench {

/// The notes text of a pass that reused prepared draws.
inline constexpr const char* kPreparedNote =
    "random draws prepared once per problem outside the timed passes (their time: prepare_s)";

template <class T>
class PreparedHeads {
 public:
  /// Shared: a decode state (common/core/decode.h) keeps the heads it was prefilled with alive
  /// after the variant drops or replaces them.
  using Heads = std::vector<std::shared_ptr<T>>;

  /// make(h) (a std::unique_ptr<T> or std::shared_ptr<T>) for every head of p, in parallel
  /// over the heads.
  template <class Make>
  static Heads build(const Problem& p, const Make& make) {
    Heads heads(size_t(p.heads));
    OmpGuard guard;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t h = 0; h < p.heads; ++h) guard.run([&] { heads[size_t(h)] = make(h); });
    guard.rethrow();
    return heads;
  }

  /// Builds and keeps the heads of p (replacing any kept for another problem).
  template <class Make>
  void prepare(const Problem& p, const Make& make) {
    kept_.clear();
    kept_ = build(p, make);
    seed_ = p.seed, dim_ = p.dim;
  }

  /// The heads of p: the kept ones if they were prepared for p's seed, head count and head
  /// dimension, else `fresh`, built now (the caller's, so they are freed with the pass).
  template <class Make>
  const Heads& get(const Problem& p, const Make& make, Heads& fresh) {
    used_ = ready(p);
    if (used_) return kept_;
    fresh = build(p, make);
    return fresh;
  }

  /// Whether heads are kept for p's seed, head count and head dimension.
  bool ready(const Problem& p) const {
    return !kept_.empty() && int64_t(kept_.size()) == p.heads && seed_ == p.seed && dim_ == p.dim;
  }
  /// Whether the last get() reused prepared heads.
  bool used() const { return used_; }
  /// kPreparedNote if the last get() reused prepared heads, else "".
  std::string note() const { return used_ ? kPreparedNote : ""; }

 private:
  Heads kept_;
  uint64_t seed_ = 0;
  int64_t dim_ = 0;
  bool used_ = false;
};

}  // namespace attnbench
