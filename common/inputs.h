// Seeded input generators for q, k, v.
#pragma once

#include <string>
#include <vector>

#include "common/problem.h"
#include "common/tensor.h"
#include "common/workload.h"

namespace attnbench {

/// q [B, H, n, d], k and v [B, H, m, d].
struct Inputs {
  Tensor q, k, v;
};

/// Names of the generated distributions: gaussian, local, clustered, lowrank.
const std::vector<std::string>& input_distributions();
/// One line describing a distribution.
std::string describe_distribution(const std::string& name);

/// Generates the inputs of p drawn from w.input with p.seed; q is multiplied by w.scale (the
/// default workload: gaussian, scale 1). The result depends only on the problem and the
/// workload's input and scale, not on the thread count. Throws UsageError for an unknown
/// name, and InputError if the scale overflows an entry of q in float.
Inputs generate_inputs(const Problem& p, const Workload& w = Workload{});
/// Head (b, h) of generate_inputs(p, w) alone, as [1, 1, len, d] tensors: the same numbers
/// without generating (or holding) the other heads.
Inputs generate_head_inputs(const Problem& p, int64_t b, int64_t h, const Workload& w = Workload{});

}  // namespace attnbench
