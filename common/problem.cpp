#include "common/problem.h"

#include <fmt/format.h>

#include <cmath>

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
  if (!std::isfinite(scale) || scale <= 0)
    throw UsageError(fmt::format("scale must be a positive finite number, got {}", scale));
  if (threads < 0) throw UsageError(fmt::format("threads must be >= 0 (0 = all), got {}", threads));
}

std::string Problem::str() const {
  return fmt::format("B={},H={},n={},m={},d={},causal={},input={},scale={},seed={}", batch, heads,
                     n, keys(), dim, int(causal), input, scale, seed);
}

}  // namespace attnbench
