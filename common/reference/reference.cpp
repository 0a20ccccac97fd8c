#include "common/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"

namespace attnbench {

namespace {

/// The logits a(q_i, k) of one query row under the problem's scoring function, in float64
/// (docs/cli.md, "Scoring functions"): q.k / sqrt(d), q.k, q^T W k, or w^T tanh(W_q q + W_k k).
/// The query side (W_q q, or W^T q) is formed once per row.
class Logits {
 public:
  Logits(const Problem& p, const float* qi, int64_t h) : p_(p), d_(p.dim) {
    const ScoreWeights* sw = p.score_weights.get();
    switch (p.score) {
      case Score::scaled_dot:
      case Score::dot: {
        const double f = p.score == Score::dot ? 1.0 : 1.0 / std::sqrt(double(d_));
        for (int64_t c = 0; c < d_; ++c) qs_.push_back(f * double(qi[c]));
        break;
      }
      case Score::bilinear: {  // q^T W k = (W^T q) . k
        const float* w = sw->w_bilinear.data() + h * d_ * d_;
        qs_.assign(size_t(d_), 0.0);
        for (int64_t r = 0; r < d_; ++r)
          for (int64_t c = 0; c < d_; ++c) qs_[size_t(c)] += double(qi[r]) * double(w[r * d_ + c]);
        break;
      }
      case Score::additive: {
        hidden_ = p.hidden();
        wk_ = sw->w_k.data() + h * hidden_ * d_;
        ws_ = sw->w_score.data() + h * hidden_;
        const float* wq = sw->w_q.data() + h * hidden_ * d_;
        qs_.assign(size_t(hidden_), 0.0);
        for (int64_t c = 0; c < hidden_; ++c)
          for (int64_t x = 0; x < d_; ++x) qs_[size_t(c)] += double(wq[c * d_ + x]) * double(qi[x]);
        break;
      }
    }
  }

  double operator()(const float* kj) const {
    double s = 0;
    if (p_.score != Score::additive) {
      for (int64_t c = 0; c < d_; ++c) s += qs_[size_t(c)] * double(kj[c]);
      return s;
    }
    for (int64_t c = 0; c < hidden_; ++c) {
      double u = qs_[size_t(c)];
      for (int64_t x = 0; x < d_; ++x) u += double(wk_[c * d_ + x]) * double(kj[x]);
      s += double(ws_[c]) * std::tanh(u);
    }
    return s;
  }

 private:
  const Problem& p_;
  int64_t d_, hidden_ = 0;
  std::vector<double> qs_;
  const float *wk_ = nullptr, *ws_ = nullptr;
};

}  // namespace

namespace {

// Softmax probabilities of row i over its visible keys; with `uniform`, every logit is taken
// as 0, so only the masks (and their additive bias) shape the weights.
// With `lse`, *lse receives the log of the softmax's normaliser (-inf for a row with no key).
std::vector<double> probabilities(const Problem& p, ConstTensorView q, ConstTensorView k, int64_t b,
                                  int64_t h, int64_t i, const SparsePattern* pattern, bool uniform,
                                  double* lse = nullptr) {
  const int64_t visible = p.visible(b, i);
  std::vector<double> prob(size_t(p.keys()), 0.0);
  if (lse) *lse = -INFINITY;
  if (visible == 0) return prob;
  std::vector<uint8_t> allowed(size_t(p.keys()), 1);
  if (pattern) pattern_row(p, *pattern, b, h, i, allowed.data());
  // the attention mask adds its bias to the logit; -inf hides the key like the pattern does
  const AttnMask* mask = p.attn_mask.get();
  if (mask)
    for (int64_t j = 0; j < visible; ++j)
      if (mask->at(b, h, i, j) == -INFINITY) allowed[size_t(j)] = 0;
  std::optional<Logits> logit;
  if (!uniform) logit.emplace(p, q.row(b, h, i), h);
  // pass 1: logits and their max
  double mx = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    if (!allowed[size_t(j)]) continue;
    prob[size_t(j)] =
        (logit ? (*logit)(k.row(b, h, j)) : 0.0) + (mask ? double(mask->at(b, h, i, j)) : 0.0);
    mx = std::max(mx, prob[size_t(j)]);
  }
  if (mx == -INFINITY) return prob;  // the pattern or the mask leaves this row no key
  // pass 2: exponentials and their sum
  double sum = 0;
  for (int64_t j = 0; j < visible; ++j)
    if (allowed[size_t(j)]) sum += (prob[size_t(j)] = std::exp(prob[size_t(j)] - mx));
  if (lse) *lse = mx + std::log(sum);
  // pass 3: normalise
  for (int64_t j = 0; j < visible; ++j) prob[size_t(j)] /= sum;
  return prob;
}

// The team for `rows` float64 rows of p, a task each (chunks of 4): about 4 m d flops per
// row (its logits, then its weighted sum or its mass), on one thread when that is small.
ParallelFor rows_team(const Problem& p, size_t rows) {
  const double flops = 4.0 * double(rows) * double(p.keys()) * double(p.dim);
  return {.parallel = parallel_worth(flops, int64_t(rows)), .chunk = 4};
}

// out (rows.size() x d) = the rows' probabilities times V.
void weighted_rows(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                   int64_t b, int64_t h, std::span<const int64_t> rows, double* out,
                   const SparsePattern* pattern, bool uniform, double* lse) {
  const int64_t d = p.dim;
  parallel_for(
      int64_t(rows.size()),
      [&](int64_t r) {
        const int64_t i = rows[r];
        std::vector<double> prob =
            probabilities(p, q, k, b, h, i, pattern, uniform, lse ? lse + r : nullptr);
        double* o = out + int64_t(r) * d;
        std::fill(o, o + d, 0.0);
        for (int64_t j = 0; j < p.visible(b, i); ++j) {
          const float* vj = v.row(b, h, j);
          for (int64_t c = 0; c < d; ++c) o[c] += prob[size_t(j)] * double(vj[c]);
        }
      },
      rows_team(p, rows.size()));
}

}  // namespace

HeadGradients reference_head_gradients(const Problem& p, ConstTensorView q, ConstTensorView k,
                                       ConstTensorView v, ConstTensorView dout, int64_t b,
                                       int64_t h, const SparsePattern* pattern) {
  if (p.score == Score::additive)
    throw UnsupportedError("the reference gradient does not cover the additive score");
  const int64_t n = p.n, m = p.keys(), d = p.dim;
  HeadGradients g{std::vector<double>(size_t(n * d), 0.0), std::vector<double>(size_t(m * d), 0.0),
                  std::vector<double>(size_t(m * d), 0.0)};
  const double f = p.score == Score::scaled_dot ? 1.0 / std::sqrt(double(d)) : 1.0;
  const float* wb =
      p.score == Score::bilinear ? p.score_weights->w_bilinear.data() + h * d * d : nullptr;
  // Blocks of R query rows: P and dS of the block (R x m each), dQ of its rows (parallel over
  // rows), then the block's share of dK and dV (parallel over keys, rows summed in order: the
  // same numbers on any thread count). Memory O(R m).
  constexpr int64_t R = 128;
  std::vector<double> prob(size_t(R * m)), ds(size_t(R * m)), qs(size_t(R * d));
  OmpGuard guard;
  for (int64_t i0 = 0; i0 < n; i0 += R) {
    const int64_t rows = std::min(R, n - i0);
    // per row: its logits, probabilities, dS and dQ, about 8 m d flops in double
    const bool parallel = parallel_worth(8.0 * double(rows * m * d), rows);
#pragma omp parallel for schedule(dynamic, 4) if (parallel)
    for (int64_t r = 0; r < rows; ++r)
      guard.run([&] {
        const int64_t i = i0 + r;
        double* pr = prob.data() + r * m;
        double* dsr = ds.data() + r * m;
        const std::vector<double> pv = probabilities(p, q, k, b, h, i, pattern, false);
        std::copy(pv.begin(), pv.end(), pr);
        const float* doi = dout.row(b, h, i);
        double dsum = 0;
        for (int64_t j = 0; j < m; ++j) {
          dsr[j] = 0;
          if (pr[j] == 0) continue;
          const float* vj = v.row(b, h, j);
          double s = 0;
          for (int64_t c = 0; c < d; ++c) s += double(doi[c]) * double(vj[c]);
          dsr[j] = s;
          dsum += pr[j] * s;
        }
        // dS = P (dP - D); the gradient of the logits wrt q_i gathered as sum_j dS_ij k_j
        std::vector<double> gq(size_t(d), 0.0);
        for (int64_t j = 0; j < m; ++j) {
          if (pr[j] == 0) continue;
          dsr[j] = pr[j] * (dsr[j] - dsum);
          const float* kj = k.row(b, h, j);
          for (int64_t c = 0; c < d; ++c) gq[size_t(c)] += dsr[j] * double(kj[c]);
        }
        // the query side of a(q_i, k) = qs_i . k: f q_i (dot products) or W^T q_i (bilinear);
        // dq_i = f gq or W gq
        const float* qi = q.row(b, h, i);
        double* qsr = qs.data() + r * d;
        double* dqi = g.dq.data() + i * d;
        if (wb) {
          std::fill(qsr, qsr + d, 0.0);
          for (int64_t x = 0; x < d; ++x)
            for (int64_t c = 0; c < d; ++c) qsr[c] += double(qi[x]) * double(wb[x * d + c]);
          for (int64_t x = 0; x < d; ++x) {
            double s = 0;
            for (int64_t c = 0; c < d; ++c) s += double(wb[x * d + c]) * gq[size_t(c)];
            dqi[x] = s;
          }
        } else {
          for (int64_t c = 0; c < d; ++c) qsr[c] = f * double(qi[c]), dqi[c] = f * gq[size_t(c)];
        }
      });
    guard.rethrow();
    // dK_j += sum_i dS_ij qs_i, dV_j += sum_i P_ij dO_i over the block's rows
#pragma omp parallel for schedule(static) if (parallel_worth(4.0 * double(rows * m * d), m))
    for (int64_t j = 0; j < m; ++j) {
      double* dkj = g.dk.data() + j * d;
      double* dvj = g.dv.data() + j * d;
      for (int64_t r = 0; r < rows; ++r) {
        const double pj = prob[size_t(r * m + j)];
        if (pj == 0) continue;
        const double dsj = ds[size_t(r * m + j)];
        const double* qsr = qs.data() + r * d;
        const float* doi = dout.row(b, h, i0 + r);
        for (int64_t c = 0; c < d; ++c) dkj[c] += dsj * qsr[c], dvj[c] += pj * double(doi[c]);
      }
    }
  }
  return g;
}

std::vector<double> reference_probabilities(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            int64_t b, int64_t h, int64_t i,
                                            const SparsePattern* pattern) {
  return probabilities(p, q, k, b, h, i, pattern, false);
}

std::vector<double> pattern_mass(const Problem& p, ConstTensorView q, ConstTensorView k,
                                 const SparsePattern& pattern, int64_t b, int64_t h,
                                 std::span<const int64_t> rows) {
  std::vector<double> mass(rows.size());
  parallel_for(
      int64_t(rows.size()),
      [&](int64_t r) {
        const int64_t i = rows[r];
        std::vector<double> prob = reference_probabilities(p, q, k, b, h, i);
        std::vector<uint8_t> allowed(size_t(p.keys()));
        pattern_row(p, pattern, b, h, i, allowed.data());
        double in = 0;
        for (int64_t j = 0; j < p.keys(); ++j) in += allowed[size_t(j)] ? prob[size_t(j)] : 0.0;
        // a row with no visible key (causal, padding or the mask) has nothing to lose:
        // mass 1
        const bool empty = std::all_of(prob.begin(), prob.end(), [](double x) { return x == 0; });
        mass[r] = empty ? 1.0 : in;
      },
      rows_team(p, rows.size()));
  return mass;
}

std::vector<double> pattern_mass(const Problem& p, ConstTensorView q, ConstTensorView k,
                                 const SparsePattern& pattern, int64_t b, int64_t h,
                                 std::span<const int64_t> rows, std::span<const double> lse) {
  std::vector<double> mass(rows.size());
  const AttnMask* mask = p.attn_mask.get();
  parallel_for(
      int64_t(rows.size()),
      [&](int64_t r) {
        const int64_t i = rows[r];
        // a row with no visible key (causal, padding or the mask) has nothing to lose:
        // mass 1
        if (lse[r] == -INFINITY) {
          mass[r] = 1.0;
          return;
        }
        std::vector<uint8_t> allowed(size_t(p.keys()));
        pattern_row(p, pattern, b, h, i, allowed.data());
        const Logits logit(p, q.row(b, h, i), h);
        double in = 0;
        for (int64_t j = 0; j < p.visible(b, i); ++j) {
          if (!allowed[size_t(j)]) continue;
          const double bias = mask ? double(mask->at(b, h, i, j)) : 0.0;
          if (bias != -INFINITY) in += std::exp(logit(k.row(b, h, j)) + bias - lse[r]);
        }
        mass[r] = in;
      },
      rows_team(p, rows.size()));
  return mass;
}

void reference_rows(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    int64_t b, int64_t h, std::span<const int64_t> rows, double* out,
                    const SparsePattern* pattern, double* lse) {
  weighted_rows(p, q, k, v, b, h, rows, out, pattern, false, lse);
}

void uniform_rows(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t b, int64_t h,
                  std::span<const int64_t> rows, double* out) {
  weighted_rows(p, k, k, v, b, h, rows, out, nullptr, true, nullptr);
}

std::vector<double> reference_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                                        ConstTensorView v, const SparsePattern* pattern) {
  std::vector<double> out(size_t(p.q_shape().numel()));
  std::vector<int64_t> rows(size_t(p.n));
  for (int64_t i = 0; i < p.n; ++i) rows[size_t(i)] = i;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      reference_rows(p, q, k, v, b, h, rows, out.data() + (b * p.heads + h) * p.n * p.dim, pattern);
  return out;
}

}  // namespace attnbench
