// The additive (Bahdanau) score (docs/cli.md, "Scoring functions") as the float kernels
// compute it:
//
//   a(q_i, k_j) = sum_c w_c tanh(q'_ic + k'_jc),   q' = W_q q_i, k' = W_k k_j  (c = 1 .. h)
//
// per head, with W_q, W_k [h, d] and w [h] (ScoreWeights). The projections q' and k' are formed
// once per call (O((n + m) h d) per head, AdditiveProjections); a score tile then costs
// h tanh evaluations per (query, key) pair and never needs more than the tile: the engine's
// score-tile hook (common/engines/block_sparse.cpp) and `full` call additive_tile on their own
// tiles.
//
// The tanh is fast_tanh, vectorised over the keys of a tile: an AVX-512 path (16 lanes) when
// the compiler targets it, otherwise a branch-free scalar form the compiler vectorises. Both
// compute tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|) (the sign restored after), and for
// |x| < 1/4, where 1 - e would cancel, the odd Taylor polynomial to x^9 (truncation below
// 1e-8 relative). Error: within about 3e-7 relative and 1.5e-7 absolute of tanh on all of R
// (tests/common/score_test.cpp measures it); |x| > 9 gives exactly +-1.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "common/core/problem.h"
#include "common/core/tensor.h"
#include "common/kernels/softmax.h"

namespace attnbench {

/// tanh(x) in float within about 3e-7 relative (see the note at the top); NaN stays NaN.
inline float fast_tanh(float x) {
  const float a = std::fabs(x);
  const float a2 = a * a;
  // |x| < 1/4: x (1 - x^2/3 + 2 x^4/15 - 17 x^6/315 + 62 x^8/2835)
  const float small =
      a * (1.0f +
           a2 * (-0.333333333f + a2 * (0.133333333f + a2 * (-0.053968254f + a2 * 0.021869489f))));
  // tanh 9 rounds to 1; a NaN x stays NaN through the min and e
  const float e = fast_exp_in_range(-2.0f * std::min(a, 9.0f));
  const float large = (1.0f - e) / (1.0f + e);
  // a blend, not a select: a select of a division keeps a branch (the division may trap), and
  // a loop with a branch does not vectorise
  const float use_small = float(a < 0.25f);
  return std::copysign(large + use_small * (small - large), x);
}

/// s[j] += w tanh(qc + k[j]) for j < cols: one hidden unit's share of a row of additive scores
/// (fast_tanh, vectorised: see additive_score.cpp).
void add_tanh_row(float* s, const float* k, float qc, float w, int64_t cols);

/// The additive score's projections of one problem: q' = W_q q as [B, H, n, h] and k' = W_k k
/// stored transposed, [B, H, h, m] (so that one hidden unit's values over the keys are
/// contiguous). Formed in float with float accumulation over d.
struct AdditiveProjections {
  Tensor qp;       ///< [B, H, n, h]
  Tensor kt;       ///< [B, H, h, m]
  const float* w;  ///< ScoreWeights::w_score, [H, h]
  int64_t hidden;

  /// Projects q and k of p (p.score == Score::additive, with its weights). OpenMP over heads.
  AdditiveProjections(const Problem& p, ConstTensorView q, ConstTensorView k);
  /// Bytes the projections hold.
  static double bytes(const Problem& p);
};

/// The additive scores of query rows i0 .. i0 + rows - 1 and keys j0 .. j0 + cols - 1 of head
/// (b, h): row r, key c at s[r rs + c cs] (cs = 1: row-major; rs = 1: transposed).
void additive_tile(const AdditiveProjections& a, int64_t b, int64_t h, int64_t i0, int64_t rows,
                   int64_t j0, int64_t cols, float* s, int64_t rs, int64_t cs);

/// Flops of one logit: 2 d for the dot-product scores, 3 h for the additive one (per hidden
/// unit an add, a tanh counted as one, a multiply-add; the projections, O((n + m) h d), aside).
inline double logit_flops(const Problem& p) {
  return p.score == Score::additive ? 3.0 * double(p.hidden()) : 2.0 * double(p.dim);
}

}  // namespace attnbench
