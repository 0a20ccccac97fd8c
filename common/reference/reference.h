// The exact reference: softmax(QK^T / sqrt(d) + mask) V in double precision, written plainly
// so it can be trusted. Every variant is checked against it. The logits follow the problem's
// scoring function (scaled_dot, dot, bilinear or additive; reference_probabilities is the one
// place they are formed).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/core/problem.h"
#include "common/core/tensor.h"
#include "common/patterns/pattern.h"

namespace attnbench {

/// Exact output rows of head (b, h) for the given query rows: out is rows.size() x d.
/// A row with no visible key is all zeros. O(rows * m * d). With a pattern, the softmax runs
/// over the keys the pattern allows only (the dense reference masked by the pattern). With
/// `lse` (rows.size() values), each row's log-sum-exp of its logits (-inf with no key).
void reference_rows(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    int64_t b, int64_t h, std::span<const int64_t> rows, double* out,
                    const SparsePattern* pattern = nullptr, double* lse = nullptr);

/// The output rows of head (b, h) when every logit is 0: each query's average of v over the
/// keys it may see (the masks' additive bias still weighs them), zeros for a row with no key.
/// The baseline an approximation must beat to say more than "average everything".
void uniform_rows(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t b, int64_t h,
                  std::span<const int64_t> rows, double* out);

/// Exact output [B, H, n, d] in double, optionally masked by a pattern. O(B H n m d).
std::vector<double> reference_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                                        ConstTensorView v, const SparsePattern* pattern = nullptr);

/// Exact softmax probabilities of one query row over its visible keys (length m, zeros for
/// hidden keys), optionally restricted to a pattern.
std::vector<double> reference_probabilities(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            int64_t b, int64_t h, int64_t i,
                                            const SparsePattern* pattern = nullptr);

/// Share of the exact (unmasked) softmax probability of each given row that falls inside the
/// pattern: mass[r] = sum over keys j the pattern allows of softmax(q_i K^T)_j.
std::vector<double> pattern_mass(const Problem& p, ConstTensorView q, ConstTensorView k,
                                 const SparsePattern& pattern, int64_t b, int64_t h,
                                 std::span<const int64_t> rows);
/// The same from the rows' log-sum-exp (reference_rows without a pattern): O(pairs the
/// pattern allows * d) instead of O(rows * m * d).
std::vector<double> pattern_mass(const Problem& p, ConstTensorView q, ConstTensorView k,
                                 const SparsePattern& pattern, int64_t b, int64_t h,
                                 std::span<const int64_t> rows, std::span<const double> lse);

/// Exact gradients of L = sum(dout ∘ O) for one head (b, h), in float64 (docs/passes.md,
/// "Training: the backward pass"): with P the reference probabilities (optionally restricted to a
/// pattern),
///   dV = Pᵀ dO,  dS = P ∘ (dO Vᵀ − D), D_i = Σ_j P_ij (dO_i · v_j),
///   dQ_i = Σ_j dS_ij ∂a(q_i, k_j)/∂q_i,  dK_j = Σ_i dS_ij ∂a(q_i, k_j)/∂k_j
/// for the scaled_dot, dot and bilinear scores (a = s q·k or qᵀ W k). Rows with no visible key
/// contribute nothing. dq is n x d, dk and dv m x d, row-major. O(n m d). Throws
/// UnsupportedError for the additive score.
struct HeadGradients {
  std::vector<double> dq, dk, dv;
};
HeadGradients reference_head_gradients(const Problem& p, ConstTensorView q, ConstTensorView k,
                                       ConstTensorView v, ConstTensorView dout, int64_t b,
                                       int64_t h, const SparsePattern* pattern = nullptr);

}  // namespace attnbench
