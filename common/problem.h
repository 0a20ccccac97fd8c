// One attention problem: what a variant computes (shapes, masking, seed).
#pragma once

#include <cstdint>
#include <string>

#include "common/tensor.h"

namespace attnbench {

/// One attention problem. q is [B, H, n, d]; k and v are [B, H, m, d]; out is [B, H, n, d].
struct Problem {
  /// Largest batch and head count: seeded inputs draw an independent random stream per
  /// (batch item, head), for up to 2^24 of each.
  static constexpr int64_t kMaxBatchOrHeads = int64_t(1) << 24;

  int64_t batch = 1;
  int64_t heads = 8;
  int64_t n = 1024;  ///< query length
  int64_t m = 0;     ///< key length; 0 means m = n
  int64_t dim = 64;  ///< head dimension d
  /// Bottom-right aligned causal mask: key j is visible to query i iff j <= i + (m - n).
  bool causal = false;
  // What attention computes grows here, beside `causal`: an attention mask (key padding, an
  // additive [n, m] mask), the scoring function, grouped kv-heads and the pass (forward,
  // backward, decode). Each comes with a flag in Capabilities, so check_supported refuses a
  // variant that cannot honour it, and with its column among the results' key columns.

  /// Seed of the variant's random choices (features, projections, hashes) and of generated
  /// inputs. How the inputs are drawn and how many threads run is the workload's
  /// (common/workload.h), which variants never see.
  uint64_t seed = 0;

  int64_t keys() const { return m > 0 ? m : n; }
  Shape4 q_shape() const { return {batch, heads, n, dim}; }
  Shape4 kv_shape() const { return {batch, heads, keys(), dim}; }
  /// Number of keys visible to query i (keys 0 .. count-1 are the visible ones).
  int64_t visible(int64_t i) const {
    if (!causal) return keys();
    int64_t last = i + (keys() - n);
    return last < 0 ? 0 : (last + 1 < keys() ? last + 1 : keys());
  }
  /// Number of (query, key) pairs visible, summed over one head.
  double visible_pairs() const;
  /// Softmax scale 1/sqrt(d).
  float softmax_scale() const;
  /// Checks sizes are positive and sane; throws UsageError naming the bad field.
  void validate() const;
  /// Canonical "B=1,H=8,n=1024,m=1024,d=64,causal=0,seed=0" (describe() in
  /// common/workload.h adds the workload).
  std::string str() const;
};

}  // namespace attnbench
