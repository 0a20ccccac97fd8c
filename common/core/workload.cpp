#include "common/core/workload.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/core/error.h"

namespace attnbench {

void Workload::validate(const Problem& p) const {
  // The kernels see scale as a float (q is multiplied by float(scale)), and the logits as
  // float(scale) q . k / sqrt(d): both factors must be finite and nonzero in float.
  const float fs = float(scale), fl = fs * p.softmax_scale();
  if (!(scale > 0) || !std::isfinite(fs) || !std::isfinite(fl) || fs == 0 || fl == 0) {
    // the accepted range: float(scale) in [smallest positive float, FLT_MAX], and
    // float(scale) / sqrt(d) not below the smallest positive float either
    const double lo =
        std::max(double(std::numeric_limits<float>::denorm_min()),
                 double(std::numeric_limits<float>::denorm_min()) / double(p.softmax_scale()));
    throw UsageError(fmt::format(
        "scale must be a positive number that stays finite and nonzero in float32, also "
        "divided by sqrt(d): accepted range about [{:.3g}, {:.7g}] (d = {}), got {}",
        lo, double(std::numeric_limits<float>::max()), p.dim, scale));
  }
  if (threads < 0) throw UsageError(fmt::format("threads must be >= 0 (0 = all), got {}", threads));
  const auto& passes = pass_names();
  if (std::find(passes.begin(), passes.end(), pass) == passes.end())
    throw UsageError(fmt::format("unknown pass '{}'; accepted: {}", pass, fmt::join(passes, ", ")));
}

const std::vector<std::string>& pass_names() {
  static const std::vector<std::string> names = {"fwd", "bwd", "fwdbwd", "decode"};
  return names;
}

std::string describe(const Problem& p, const Workload& w) {
  return fmt::format("B={},H={}{},n={},m={},d={},causal={}{},input={},scale={},seed={}", p.batch,
                     p.heads, p.kv_str(), p.n, p.keys(), p.dim, int(p.causal), p.score_str(),
                     w.input, w.scale, p.seed) +
         mask_suffix(p) + p.dtype_str() +
         (w.pass == "fwd" || w.pass.empty() ? "" : ",pass=" + w.pass);
}

}  // namespace attnbench
