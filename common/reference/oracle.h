// Oracles and tolerances: what the tests hold every variant to (VariantInfo::oracle and
// VariantInfo::tolerance, common/core/registry.h).
//
// An oracle states a variant's own function in float64, independently of its float32 kernels:
// plain loops over doubles, the same random draws as the variant (which it exposes as a
// function both call). The helpers below are the pieces most oracles share: one head of a
// tensor as a double matrix, products, a row softmax, softmax attention over a prefix of
// the keys, and the assembly of per-head results into the [B, H, n, d] output.
//
// Error model of float32 attention (the default tolerance). With u = 2^-24 (float32 unit
// roundoff), rounding errors are modelled as independent and of random sign, so a float32
// reduction of L terms carries a relative error of about u sqrt(L) (its rms size; a blocked or
// pairwise sum does better, a worst-case bound would be u L). One softmax attention row:
//   1. logits s_j = q.k_j / sqrt(d): a reduction over d products, each as large as the
//      logit's own scale, so an absolute error of about u sqrt(d) S, S the typical size of a
//      logit (1 for the generated inputs, whose entries have unit variance; the workload's
//      `scale` multiplies q and so S). exp turns an absolute logit error into a relative weight
//      error of the same size, and for near-uniform weights (the worst case: one-hot weights are
//      insensitive to it) the output row moves by that much relative to its norm;
//   2. exp, the division and the scalings: a few roundings each, u each;
//   3. the weighted sum over m keys and the normaliser sum: reductions of length m,
//      u sqrt(m) relative.
// Hence  err(p) = u (sqrt(d) S + sqrt(m) + 4),   S = max(1, scale),
// and the default tolerance is kErrorMargin err(p): the model gives the rms size, the margin
// covers the tail of the largest rows and constants left out of the model. At d = 64, m = 1000
// and S = 1 that is 1.0e-5, the bound these tests used before the model; full and flash land
// near 1e-7 there. An approximation whose arithmetic has a longer chain (an iterative
// pseudo-inverse, random features, a projection that grows the logits) derives its own
// tolerance from float32_error() with the terms of its chain, and says how in a comment.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "common/core/problem.h"
#include "common/core/tensor.h"
#include "common/core/workload.h"

namespace attnbench {

/// Unit roundoff of float32, u = 2^-24.
inline constexpr double kFloat32Roundoff = 0x1.0p-24;
/// How far beyond the modelled (rms) error a tolerance reaches.
inline constexpr double kErrorMargin = 4.0;

/// The modelled relative error of a float32 computation whose chain is `steps` roundings in
/// series, reductions whose lengths sum (in quadrature) to `reduction`, and a logit-like
/// quantity of typical size `logit` entering exp after a reduction over `dim` terms:
///   u (sqrt(dim) logit + sqrt(reduction) + steps).
double float32_error(double dim, double logit, double reduction, double steps);

/// Typical logit size S of a workload's inputs: max(1, scale) (generated inputs have unit
/// variance entries, so q.k / sqrt(d) is of order 1 before the scale).
double logit_size(const Workload& w);

/// The default tolerance: kErrorMargin float32_error(d, S, m, 4) (see the header comment) for
/// scaled_dot; the other scores lengthen the chain of the logits (their terms in oracle.cpp):
/// dot makes them sqrt(d) times larger, bilinear adds the map of q (a reduction over d), and
/// additive the projections, the tanh and a reduction over h.
double attention_tolerance(const Problem& p, const Workload& w);

namespace oracle {

/// A dense row-major matrix of doubles.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> a;

  Matrix() = default;
  Matrix(int64_t r, int64_t c) : rows(r), cols(c), a(size_t(r * c), 0.0) {}
  double& operator()(int64_t i, int64_t j) { return a[size_t(i * cols + j)]; }
  double operator()(int64_t i, int64_t j) const { return a[size_t(i * cols + j)]; }
  double* row(int64_t i) { return a.data() + i * cols; }
  const double* row(int64_t i) const { return a.data() + i * cols; }
};

/// Head (b, h) of t as a len x d matrix.
Matrix head(ConstTensorView t, int64_t b, int64_t h);
/// The first `rows` rows of head (b, h) of t (the valid keys under key padding).
Matrix head(ConstTensorView t, int64_t b, int64_t h, int64_t rows);
/// x y (x: r x k, y: k x c).
Matrix product(const Matrix& x, const Matrix& y);
/// x y^T (x: r x k, y: c x k).
Matrix product_t(const Matrix& x, const Matrix& y);
/// x^T.
Matrix transpose(const Matrix& x);
/// Softmax of scale x over each row's first cols(i) entries (every entry without cols); the
/// others, and every entry of a row with cols(i) == 0, become 0.
void softmax_rows(Matrix& x, double scale,
                  const std::function<int64_t(int64_t row)>& cols = nullptr);
/// Softmax attention softmax(scale q k^T) v with row i seeing keys 0 .. visible(i) - 1 (every
/// key without `visible`); a row that sees no key is 0.
Matrix softmax_attention(const Matrix& q, const Matrix& k, const Matrix& v, double scale,
                         const std::function<int64_t(int64_t row)>& visible = nullptr);

/// Kernelised attention with features fq (n x F) and fk (m x F): row i is
/// sum_j a_ij v_j / (sum_j a_ij + eps), a_ij = fq_i . fk_j, over keys j < visible(i) (every key
/// without `visible`); a row that sees no key is 0.
Matrix feature_map_attention(const Matrix& fq, const Matrix& fk, const Matrix& v, double eps,
                             const std::function<int64_t(int64_t row)>& visible = nullptr);

/// The [B, H, n, d] output whose head (b, h) is f(b, h) (an n x d matrix). Heads are
/// evaluated in parallel.
std::vector<double> per_head(const Problem& p,
                             const std::function<Matrix(int64_t b, int64_t h)>& f);

}  // namespace oracle
}  // namespace attnbench
