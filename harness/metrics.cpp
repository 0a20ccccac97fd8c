#include "harness/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>
#include <vector>

#include "common/error.h"
#include "common/random.h"
#include "common/reference.h"

namespace attnbench {

std::vector<std::vector<int64_t>> pick_rows(const Problem& p, double exact_limit) {
  const int64_t heads = p.batch * p.heads;
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(heads));
  const double pairs = double(heads) * double(p.n) * double(p.keys());
  if (pairs <= exact_limit) {
    for (auto& r : rows) {
      r.resize(size_t(p.n));
      for (int64_t i = 0; i < p.n; ++i) r[size_t(i)] = i;
    }
    return rows;
  }
  const int64_t wanted = std::max<int64_t>(256, int64_t(exact_limit / double(p.keys())));
  const int64_t per_head =
      std::min<int64_t>(p.n, std::max<int64_t>(1, (wanted + heads - 1) / heads));
  RandomStream rs(p.seed, 0xe7707ULL);
  uint64_t draw = 0;
  for (int64_t bh = 0; bh < heads; ++bh) {
    std::unordered_set<int64_t> chosen;
    while (int64_t(chosen.size()) < per_head)
      chosen.insert(int64_t(rs.below(draw++, uint64_t(p.n))));
    rows[size_t(bh)].assign(chosen.begin(), chosen.end());
    std::sort(rows[size_t(bh)].begin(), rows[size_t(bh)].end());
  }
  return rows;
}

double error_memory_estimate(const Problem& p, double exact_limit) {
  // one head's reference rows in double, plus the row lists
  double rows = std::min(double(p.n), std::max(256.0, exact_limit / double(p.keys())));
  return rows * double(p.dim) * 8.0 + double(p.batch * p.heads) * rows * 8.0 +
         double(p.keys()) * 8.0 * 2;
}

ErrorStats measure_error(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         ConstTensorView out, double exact_limit, const SparsePattern* pattern) {
  const int64_t d = p.dim;
  auto rows = pick_rows(p, exact_limit);
  ErrorStats e;
  e.rows_total = p.batch * p.heads * p.n;
  double diff2 = 0, ref2 = 0, cos_sum = 0, mass_sum = 0, mass_min = INFINITY;
  std::vector<double> ref;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const auto& r = rows[size_t(b * p.heads + h)];
      ref.resize(r.size() * size_t(d));
      reference_rows(p, q, k, v, b, h, r, ref.data());
      for (size_t t = 0; t < r.size(); ++t) {
        const float* o = out.row(b, h, r[t]);
        const double* o_ref = ref.data() + t * size_t(d);
        double dot = 0, nn = 0, nr = 0;
        for (int64_t c = 0; c < d; ++c) {
          const double a = o[c], x = o_ref[c];
          if (!std::isfinite(a) || !std::isfinite(x))
            throw Error(fmt::format(
                "the error cannot be measured: {} holds a non-finite value ({}) at batch {}, "
                "head {}, row {}, feature {}",
                std::isfinite(x) ? "the output" : "the float64 reference", std::isfinite(x) ? a : x,
                b, h, r[t], c));
          diff2 += (a - x) * (a - x);
          ref2 += x * x;
          dot += a * x;
          nn += a * a;
          nr += x * x;
          e.max_abs = std::max(e.max_abs, std::abs(a - x));
        }
        if (nn == 0 && nr == 0)
          cos_sum += 1;
        else if (nn > 0 && nr > 0)
          cos_sum += dot / (std::sqrt(nn) * std::sqrt(nr));
      }
      e.rows_used += int64_t(r.size());
      if (pattern)
        for (double x : pattern_mass(p, q, k, *pattern, b, h, r)) {
          mass_sum += x;
          mass_min = std::min(mass_min, x);
        }
    }
  if (pattern && e.rows_used) {
    e.mass_mean = mass_sum / double(e.rows_used);
    e.mass_min = mass_min;
  }
  e.rel_fro = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  e.mean_cos = e.rows_used ? cos_sum / double(e.rows_used) : 0;
  // finite values can still overflow the sums of squares (|values| ~ 1e154 and more are
  // impossible in float, but a NaN error must never be reported as a result)
  if (!std::isfinite(e.rel_fro) || !std::isfinite(e.max_abs) || !std::isfinite(e.mean_cos))
    throw Error(
        fmt::format("the error against the reference is not finite (rel_fro {}, "
                    "max_abs {}, mean_cos {})",
                    e.rel_fro, e.max_abs, e.mean_cos));
  return e;
}

}  // namespace attnbench
