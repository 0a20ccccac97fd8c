#include "common/problem.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"

namespace attnbench {

std::string Shape4::str() const { return fmt::format("[{}, {}, {}, {}]", batch, heads, len, dim); }

double Problem::visible_pairs() const {
  if (!causal) return double(n) * double(keys());
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += double(visible(i));
  return total;
}

float Problem::softmax_scale() const { return float(1.0 / std::sqrt(double(dim))); }

void Problem::validate() const {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) throw UsageError(fmt::format("{} must be a positive integer, got {}", name, v));
  };
  positive("batch", batch);
  positive("heads", heads);
  positive("seq (n)", n);
  positive("dim (d)", dim);
  if (m < 0) throw UsageError(fmt::format("seq-k (m) must be positive (or 0 for m = n), got {}", m));
  // The kernels see scale as a float (q is multiplied by float(scale)), and the logits as
  // float(scale) q . k / sqrt(d): both factors must be finite and nonzero in float.
  const float fs = float(scale), fl = fs * softmax_scale();
  if (!(scale > 0) || !std::isfinite(fs) || !std::isfinite(fl) || fs == 0 || fl == 0) {
    // the accepted range: float(scale) in [smallest positive float, FLT_MAX], and
    // float(scale) / sqrt(d) not below the smallest positive float either
    const double lo = std::max(double(std::numeric_limits<float>::denorm_min()),
                               double(std::numeric_limits<float>::denorm_min()) /
                                   double(softmax_scale()));
    throw UsageError(fmt::format(
        "scale must be a positive number that stays finite and nonzero in float32, also "
        "divided by sqrt(d): accepted range about [{:.3g}, {:.7g}] (d = {}), got {}",
        lo, double(std::numeric_limits<float>::max()), dim, scale));
  }
  if (threads < 0) throw UsageError(fmt::format("threads must be >= 0 (0 = all), got {}", threads));
}

std::string Problem::str() const {
  return fmt::format("B={},H={},n={},m={},d={},causal={},input={},scale={},seed={}", batch, heads,
                     n, keys(), dim, int(causal), input, scale, seed);
}

}  // namespace attnbench
