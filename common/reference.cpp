#include "common/reference.h"

#include <algorithm>
#include <cmath>

#include "common/omp_guard.h"

namespace attnbench {

std::vector<double> reference_probabilities(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            int64_t b, int64_t h, int64_t i,
                                            const SparsePattern* pattern) {
  const int64_t d = p.dim, visible = p.visible(b, i);
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> prob(size_t(p.keys()), 0.0);
  if (visible == 0) return prob;
  std::vector<uint8_t> allowed(size_t(p.keys()), 1);
  if (pattern) pattern_row(p, *pattern, b, h, i, allowed.data());
  // the attention mask adds its bias to the logit; -inf hides the key like the pattern does
  const AttnMask* mask = p.attn_mask.get();
  if (mask)
    for (int64_t j = 0; j < visible; ++j)
      if (mask->at(b, h, i, j) == -INFINITY) allowed[size_t(j)] = 0;
  const float* qi = q.row(b, h, i);
  // pass 1: scaled logits and their max
  double mx = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    if (!allowed[size_t(j)]) continue;
    const float* kj = k.row(b, h, j);
    double s = 0;
    for (int64_t c = 0; c < d; ++c) s += double(qi[c]) * double(kj[c]);
    prob[size_t(j)] = s * scale + (mask ? double(mask->at(b, h, i, j)) : 0.0);
    mx = std::max(mx, prob[size_t(j)]);
  }
  if (mx == -INFINITY) return prob;  // the pattern or the mask leaves this row no key
  // pass 2: exponentials and their sum
  double sum = 0;
  for (int64_t j = 0; j < visible; ++j)
    if (allowed[size_t(j)]) sum += (prob[size_t(j)] = std::exp(prob[size_t(j)] - mx));
  // pass 3: normalise
  for (int64_t j = 0; j < visible; ++j) prob[size_t(j)] /= sum;
  return prob;
}

std::vector<double> pattern_mass(const Problem& p, ConstTensorView q, ConstTensorView k,
                                 const SparsePattern& pattern, int64_t b, int64_t h,
                                 std::span<const int64_t> rows) {
  std::vector<double> mass(rows.size());
  OmpGuard guard;
#pragma omp parallel for schedule(dynamic, 4)
  for (size_t r = 0; r < rows.size(); ++r)
    guard.run([&] {
      const int64_t i = rows[r];
      std::vector<double> prob = reference_probabilities(p, q, k, b, h, i);
      std::vector<uint8_t> allowed(size_t(p.keys()));
      pattern_row(p, pattern, b, h, i, allowed.data());
      double in = 0;
      for (int64_t j = 0; j < p.keys(); ++j) in += allowed[size_t(j)] ? prob[size_t(j)] : 0.0;
      // a row with no visible key (causal, padding or the mask) has nothing to lose: mass 1
      const bool empty = std::all_of(prob.begin(), prob.end(), [](double x) { return x == 0; });
      mass[r] = empty ? 1.0 : in;
    });
  guard.rethrow();
  return mass;
}

void reference_rows(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    int64_t b, int64_t h, std::span<const int64_t> rows, double* out,
                    const SparsePattern* pattern) {
  const int64_t d = p.dim;
  OmpGuard guard;
#pragma omp parallel for schedule(dynamic, 4)
  for (size_t r = 0; r < rows.size(); ++r)
    guard.run([&] {
      const int64_t i = rows[r];
      std::vector<double> prob = reference_probabilities(p, q, k, b, h, i, pattern);
      double* o = out + int64_t(r) * d;
      std::fill(o, o + d, 0.0);
      for (int64_t j = 0; j < p.visible(b, i); ++j) {
        const float* vj = v.row(b, h, j);
        for (int64_t c = 0; c < d; ++c) o[c] += prob[size_t(j)] * double(vj[c]);
      }
    });
  guard.rethrow();
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
