// Error of a variant's output against exact softmax attention on the same inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/core/problem.h"
#include "common/core/tensor.h"
#include "common/patterns/pattern.h"

namespace attnbench {

/// Up to this many (query, key) pairs in the problem (B H n m), the reference is computed for
/// every row; above it, for a seeded sample of about kExactPairsLimit / m query rows.
inline constexpr double kExactPairsLimit = double(1 << 26);

struct ErrorStats {
  double rel_fro = 0;  ///< ||O - O*||_F / ||O*||_F over the rows used
  double max_abs = 0;  ///< max |O - O*|
  /// mean over the rows used of cos(O_i, O*_i), every row counted: a row where both are zero
  /// counts 1 (the exact answer), a row where only one of them is zero counts 0
  double mean_cos = 0;
  int64_t rows_used = 0;   ///< query rows compared
  int64_t rows_total = 0;  ///< B H n
  /// For pattern variants: share of each row's exact softmax probability inside the pattern
  /// (mean and minimum over the rows used); NaN for other variants.
  double mass_mean = NAN, mass_min = NAN;
  /// ||U - O*||_F / ||O*||_F of the uniform-average output U (uniform_rows) on the same rows:
  /// the error of ignoring the scores. An output of zeros has error 1.
  double uniform_rel_fro = NAN;
};

/// The query rows of each head (b, h) the error is measured on, indexed b * H + h, sorted:
/// every row up to `exact_limit` pairs, else a seeded sample of about exact_limit / m rows.
std::vector<std::vector<int64_t>> pick_rows(const Problem& p, double exact_limit);

/// Compares `out` with the double-precision reference. Rows are sampled with p.seed when the
/// problem exceeds `exact_limit` pairs.
/// With a pattern, the mass it keeps is measured on the same rows. Throws Error if the output
/// or the reference holds a non-finite value on those rows, or an error figure is not finite:
/// a non-finite error is never returned as a result (the runner turns it into an error row).
ErrorStats measure_error(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         ConstTensorView out, double exact_limit = kExactPairsLimit,
                         const SparsePattern* pattern = nullptr);

/// measure_error on the given rows of each head (indexed b * H + h, sorted) instead of those
/// pick_rows would choose: the decode pass compares the rows it generated.
ErrorStats measure_error_on_rows(const Problem& p, ConstTensorView q, ConstTensorView k,
                                 ConstTensorView v, ConstTensorView out,
                                 const std::vector<std::vector<int64_t>>& rows,
                                 double exact_limit = kExactPairsLimit,
                                 const SparsePattern* pattern = nullptr);

/// Bytes the error measurement will allocate.
double error_memory_estimate(const Problem& p, double exact_limit = kExactPairsLimit);

/// Gradient error of a backward pass against exact softmax attention's (reference_head_gradients)
/// on the same inputs and dO: relative Frobenius errors of dQ, dK and dV over whole heads
/// (NaN when no head was compared).
struct GradErrorStats {
  double q = NAN, k = NAN, v = NAN;
  int64_t heads = 0;  ///< heads compared (0: not measured, the problem's heads are too large)
};

/// The heads (b * H + h, sorted) whose gradients are compared: every head while B H n m is at
/// most `exact_limit` pairs, else a seeded sample of floor(exact_limit / (n m)) heads; none
/// when a single head holds more than exact_limit pairs (the gradient of one head needs all of
/// its rows, so it cannot be sampled by rows as the forward error is).
std::vector<int64_t> pick_gradient_heads(const Problem& p, double exact_limit);

/// Compares dq, dk, dv with the float64 gradients of exact softmax attention on the heads of
/// pick_gradient_heads. Throws Error if a gradient compared holds a non-finite value or an
/// error figure is not finite.
GradErrorStats measure_grad_error(const Problem& p, ConstTensorView q, ConstTensorView k,
                                  ConstTensorView v, ConstTensorView dout, ConstTensorView dq,
                                  ConstTensorView dk, ConstTensorView dv,
                                  double exact_limit = kExactPairsLimit);

/// Bytes measure_grad_error allocates (one head's gradients in double, and its row blocks).
double grad_error_memory_estimate(const Problem& p);

}  // namespace attnbench
