// retention: the retention of RetNet (Sun et al. 2023, "Retentive Network: A Successor to
// Transformer for Large Language Models"), linear attention with a fixed decay per head.
//
//   S_t = gamma_h S_{t-1} + k_t v_t^T,   o_t = s S_t^T q_t,   s = 1 / sqrt(d)
// equivalently the parallel form O = (s Q K^T o D) V with D_ij = gamma_h^(i-j) for j <= i, else
// 0. RetNet scales k by d^-1/2; here the same factor s multiplies the scores. Defined causally
// only (caps.causal_only); no softmax, no normalisation (RetNet's group norm belongs to the
// layer, not to this operator).
// Multi-scale decay: gamma_h = 1 - 2^(-5-h) for query heads h = 0 .. H-1, the paper's schedule
// for its 8 heads (gamma from 0.96875 to 0.99976); with H != 8 the same formula continues
// (H = 4: 0.96875 .. 0.99609; H = 16 reaches 1 - 2^-20). Grouped-query heads: k and v of the
// head's key/value head, the state per query head (gamma is per query head).
// Parameters: form (chunkwise | recurrent), chunk (64 rows).
// Chunkwise (common/engines/decay_attention.h): per chunk of C rows the masked C x C product, the
// state's part Q S and the state update K^T V, all GEMMs: O(n (C d + d^2)) time per head,
// O(C^2 + C d + d^2) memory per thread. Recurrent: 4 d^2 flops per token per head, the d x d
// state in L1. Not softmax attention: its oracle is the recurrence in float64.
// Backward: a reverse recurrence per head over the states at chunk boundaries (recomputed).
// Decode: S per (batch, head), d^2 floats whatever the length; a step is O(d^2).
#include <cmath>
#include <memory>

#include "common/core/registry.h"
#include "common/engines/decay_attention.h"

namespace attnbench {
namespace {

namespace da = decay_attention;

class Retention final : public da::DecayVariant {
 public:
  using DecayVariant::DecayVariant;

  da::Decay decay(const Problem& p) const override {
    da::Decay dc;
    for (int64_t h = 0; h < p.heads; ++h)
      dc.gamma.push_back(float(1.0 - std::ldexp(1.0, int(-5 - h))));
    return dc;
  }
};

ATTNBENCH_REGISTER_VARIANT(
    retention,
    VariantInfo{.name = "retention",
                .summary = "retention (RetNet, Sun et al. 2023): (s Q K^T o gamma^(i-j)) V, "
                           "gamma_h = 1 - 2^(-5-h); not softmax",
                .complexity = "time O(n d (C + d)), memory O(threads (C^2 + C d + d^2)), C = chunk",
                .family = "decay",
                .display = "Retention (RetNet)",
                .paper = "Sun et al. 2023 (arXiv:2307.08621)",
                .look = {.color = "#756bb1", .marker = "o"},
                .long_context = true,
                .sweep_specs = {"retention:form=recurrent"},
                .params = da::decay_params(),
                .caps = {.causal = true, .cross = false, .exact = false, .causal_only = true},
                .make = [](const ParamValues& pv) { return std::make_unique<Retention>(pv); },
                .oracle = da::decay_oracle,
                .tolerance = da::decay_tolerance});

}  // namespace
}  // namespace attnbench
