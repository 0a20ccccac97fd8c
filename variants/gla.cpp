// gla: gated linear attention (Yang, Wang, Shen, Panda & Kim 2024, "Gated Linear Attention
// Transformers with Hardware-Efficient Training"), linear attention with a data-dependent
// decay per key dimension.
//
//   a_t = sigmoid(k_t W1 W2 + b)^(1/tau)               (in (0, 1)^d)
//   S_t = diag(a_t) S_{t-1} + k_t v_t^T,   o_t = s S_t^T q_t,   s = 1 / sqrt(d)
// (the paper's reference code scales q by d^-1/2 the same way). Defined causally only.
// The gate: W1 (d x rank) and W2 (rank x d), the paper's low rank 16, seeded (entries
// N(0, 1/d) and N(0, 1/rank), streams "gla1" and "gla2" of the problem's seed) and shared by
// every head (the paper's W2 gives each head its own slice; one pair keeps a key/value head's
// decay a function of its keys alone, so grouped heads equal their copies);
// tau = 16, the paper's temperature, which keeps a_t near 1 (slow forgetting): with b = 0 (the
// reference code's zero-initialised bias) and z = k W1 W2 of unit size, a_t is about
// 0.5^(1/16) = 0.958 and lies mostly within 0.92 .. 0.99. The paper projects the layer input
// x; without a layer, k stands in for x (documented stand-in).
// Grouped-query heads: the decay comes from k, so the state is per key/value head and serves
// the group's query heads.
// Parameters: form (chunkwise | recurrent), chunk (64 rows), rank (16), tau (16).
// Chunkwise (common/engines/decay_attention.h): cumulative log-decays relative to the chunk start,
// sub-chunks of 16 rows so that no exp overflows, GEMMs for the products: O(n (C d + d^2 +
// d rank)) time, O(C^2 + C d + d^2) memory per thread. Recurrent: about 4 d^2 flops per token
// per head, the state in L1. Not softmax attention: its oracle is the recurrence in float64.
// Backward: a reverse recurrence per query head over the states at chunk boundaries; the
// gradient flows through the decay (d log a / dz = (1 - sigmoid(z)) / tau) into k via W1, W2.
// Decode: S per (batch, key/value head); a step is O(d^2 + d rank).
#include <memory>

#include "common/core/registry.h"
#include "common/engines/decay_attention.h"

namespace attnbench {
namespace {

namespace da = decay_attention;

class Gla final : public da::DecayVariant {
 public:
  explicit Gla(const ParamValues& pv)
      : DecayVariant(pv), rank_(pv.get_int("rank")), tau_(pv.get_float("tau")) {}

  da::Decay decay(const Problem& p) const override {
    da::Decay dc;
    dc.given = input(p, "g");  // the model's log decays, else the seeded gate stands in
    if (!dc.given) dc.gate = std::make_shared<da::Gate>(p, rank_, tau_, 0.0);
    return dc;
  }

 private:
  int64_t rank_;
  double tau_;
};

std::vector<ParamSpec> gla_params() {
  std::vector<ParamSpec> ps = da::decay_params();
  ps.push_back(ParamSpec::Int("rank", 16, 1, 1024, "rank of the gate's projection W1 W2"));
  ps.push_back(ParamSpec::Float("tau", 16.0, 1.0, 1024.0,
                                "temperature: the decay is sigmoid(k W1 W2)^(1/tau)"));
  return ps;
}

ATTNBENCH_REGISTER_VARIANT(
    gla,
    VariantInfo{.name = "gla",
                .summary = "gated linear attention (Yang et al. 2024): S_t = diag(a_t) S_{t-1} + "
                           "k_t v_t^T, a_t = sigmoid(k_t W1 W2)^(1/16); not softmax",
                .complexity = "time O(n d (C + d + rank)), memory O(threads (C^2 + C d + d^2)), "
                              "C = chunk",
                .family = "decay",
                .display = "Gated linear attention",
                .paper = "Yang et al. 2023 (arXiv:2312.06635)",
                .look = {.color = "#636363", .marker = "s"},
                .long_context = true,
                .sweep_specs = {"gla:form=recurrent"},
                .params = gla_params(),
                .inputs = {{.name = "g",
                            .dims = {"B", "G", "n", "d"},
                            .help = "log decay log a_t per token, key/value head and key "
                                    "feature (<= 0; S_t = diag(exp g_t) S_(t-1) + k_t v_t^T)",
                            .stand_in = "log sigmoid(k_t W1 W2) / tau, W1 and W2 seeded",
                            .max = 0}},
                .caps = {.causal = true, .cross = false, .exact = false, .causal_only = true},
                .make = [](const ParamValues& pv) { return std::make_unique<Gla>(pv); },
                .oracle = da::decay_oracle,
                .tolerance = da::decay_tolerance});

}  // namespace
}  // namespace attnbench
