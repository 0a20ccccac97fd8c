// Seeded input generators for q, k, v.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/core/problem.h"
#include "common/core/tensor.h"
#include "common/core/workload.h"

namespace attnbench {

/// q [B, H, n, d], k and v [B, H, m, d].
struct Inputs {
  Tensor q, k, v;
  /// The upstream gradient dO [B, H, n, d] of the training passes when an inputs file gives
  /// one ('do'); empty otherwise (the harness then draws it: generate_dout).
  Tensor dout = {};
};

/// dO for the training passes: iid N(0, 1) entries [B, H, n, d], each head from a random
/// stream of its own under p.seed, independent of the inputs' streams and the thread count.
Tensor generate_dout(const Problem& p);

/// Names of the generated distributions: gaussian, local, clustered, lowrank.
const std::vector<std::string>& input_distributions();
/// The input names accepted wherever an input distribution is: the generated distributions and
/// trained inputs (common/io/trained.h), as a message lists them.
std::string accepted_inputs();
/// The canonical name of an input: a generated distribution as it is, trained inputs as
/// "trained:layer=L" ("trained" is layer 0). Throws UsageError for an unknown name or a bad
/// trained option, naming what is accepted.
std::string canonical_input(const std::string& name);
/// One line describing a distribution (or trained inputs).
std::string describe_distribution(const std::string& name);

/// Generates the inputs of p drawn from w.input with p.seed; q is multiplied by w.scale (the
/// default workload: gaussian, scale 1). The result depends only on the problem and the
/// workload's input and scale, not on the thread count. Trained inputs (w.input "trained:...")
/// are read instead (load_trained_inputs, seed unused), q multiplied by w.scale the same way.
/// Throws UsageError for an unknown name or trained inputs that do not fit p, and InputError if
/// the scale overflows an entry of q in float.
Inputs generate_inputs(const Problem& p, const Workload& w = Workload{});
/// Head (b, h) of generate_inputs(p, w) alone, as [1, 1, len, d] tensors: the same numbers
/// without generating (or holding) the other heads. Trained inputs: head h of the model (p's
/// batch and heads are not checked).
Inputs generate_head_inputs(const Problem& p, int64_t b, int64_t h, const Workload& w = Workload{});

/// E[tanh(u)^2] for u ~ N(0, 2), by quadrature (about 0.52): the variance factor of one
/// hidden unit of the additive score on gaussian inputs.
double additive_tanh_variance();

/// The score weights of p drawn from p.seed, for the bilinear and additive scores (null for
/// the others), each head from a random stream of its own, independent of the inputs' streams.
/// Scaled so that on inputs with iid N(0, 1) entries the logits have unit variance, like
/// q.k / sqrt(d):
///   bilinear  W entries N(0, 1/d^2): Var(q^T W k) = d^2 Var(W_rc) = 1;
///   additive  W_q, W_k entries N(0, 1/d), so W_q q + W_k k has entries of variance 2, and w
///             entries N(0, 1 / (h E[tanh^2(N(0, 2))])) = N(0, 1 / (0.52 h)): the logit
///             sum_c w_c tanh(.) then has variance h Var(w_c) E[tanh^2] = 1.
std::shared_ptr<const ScoreWeights> make_score_weights(const Problem& p);

}  // namespace attnbench
