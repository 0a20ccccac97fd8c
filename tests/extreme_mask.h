// An attention mask holding the finite extremes masks are written with in the ecosystem
// (-FLT_MAX = torch.finfo(torch.float32).min, what Hugging Face models put in their masks,
// and -1e30), beside ordinary values and -inf: the rows the engines must not turn into NaN
// when they scale the mask by sqrt(d).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "common/core/problem.h"
#include "tests/test_util.h"

namespace attnbench::test {

/// random_mask(p, mb, mh, false) (finite values in [-5, 3], a quarter -inf) with these rows
/// (when p.n is large enough):
///   1  -FLT_MAX on every key: the uniform average of the visible values
///   2  -1e30 on every key: the same
///   3  -FLT_MAX and -inf alternating: the average of the even keys
///   4  -FLT_MAX except keys 0 and 1 (0.5 and -1): those two keys only
///   5  +1e30 on key 0 and -FLT_MAX on key 1, the rest as drawn: key 0 only
///   6  -FLT_MAX on every key but -3 on the last: that key only
inline std::shared_ptr<const AttnMask> extreme_mask(const Problem& p, int64_t mb, int64_t mh) {
  auto base = random_mask(p, mb, mh, false);
  auto a = std::make_shared<AttnMask>(*base);
  const float lowest = std::numeric_limits<float>::lowest();
  const int64_t m = p.keys();
  for (int64_t bh = 0; bh < mb * mh; ++bh) {
    auto row = [&](int64_t i) { return a->bias.data() + (bh * p.n + i) * m; };
    if (p.n > 1) std::fill(row(1), row(1) + m, lowest);
    if (p.n > 2) std::fill(row(2), row(2) + m, -1e30f);
    if (p.n > 3)
      for (int64_t j = 0; j < m; ++j) row(3)[j] = j % 2 ? -INFINITY : lowest;
    if (p.n > 4) {
      std::fill(row(4), row(4) + m, lowest);
      row(4)[0] = 0.5f;
      if (m > 1) row(4)[1] = -1.0f;
    }
    if (p.n > 5) {
      row(5)[0] = 1e30f;
      if (m > 1) row(5)[1] = lowest;
    }
    if (p.n > 6) {
      std::fill(row(6), row(6) + m, lowest);
      row(6)[m - 1] = -3.0f;
    }
  }
  return a;
}

}  // namespace attnbench::test
