#include "common/reference/oracle.h"

#include <algorithm>
#include <cmath>

#include "common/core/parallel.h"
#include "common/core/parallel_for.h"

namespace attnbench {

double float32_error(double dim, double logit, double reduction, double steps) {
  return kFloat32Roundoff * (std::sqrt(dim) * logit + std::sqrt(reduction) + steps);
}

double logit_size(const Workload& w) { return std::max(1.0, std::abs(w.scale)); }

double attention_tolerance(const Problem& p, const Workload& w) {
  const double d = double(p.dim), S = logit_size(w), m = double(p.keys());
  switch (p.score) {
    case Score::scaled_dot:
      break;
    case Score::dot:  // scaled_dot on sqrt(d) q: logits sqrt(d) times larger
      return kErrorMargin * float32_error(d, S * std::sqrt(d), m, 5.0);
    case Score::bilinear:  // q' = sqrt(d) W^T q, a reduction over d, before the logit's own
      return kErrorMargin * float32_error(2.0 * d, S, m, 5.0);
    case Score::additive: {
      // q'_c, k'_c: reductions over d each, of unit-variance terms (error u sqrt(2d) on their
      // sum); tanh: fast_tanh's 4e-7 = 7u; w_c of size 1/sqrt(0.52 h) over h terms turns
      // both into u (sqrt(2d) + 7) / sqrt(0.52) on the logit, plus the reduction over h,
      // u sqrt(h). In float32_error's form: dim 2d/0.52 + h, 7/sqrt(0.52) = 10 steps more.
      const double h = double(p.hidden());
      return kErrorMargin * float32_error(2.0 * d / 0.52 + h, S, m, 14.0);
    }
  }
  return kErrorMargin * float32_error(d, S, m, 4.0);
}

namespace oracle {

Matrix head(ConstTensorView t, int64_t b, int64_t h) { return head(t, b, h, t.shape.len); }

Matrix head(ConstTensorView t, int64_t b, int64_t h, int64_t rows) {
  Matrix x(rows, t.shape.dim);
  for (int64_t i = 0; i < x.rows; ++i) {
    const float* r = t.row(b, h, i);
    for (int64_t c = 0; c < x.cols; ++c) x(i, c) = double(r[c]);
  }
  return x;
}

Matrix product(const Matrix& x, const Matrix& y) {
  Matrix z(x.rows, y.cols);
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t t = 0; t < x.cols; ++t) {
      const double a = x(i, t);
      const double* yr = y.row(t);
      double* zr = z.row(i);
      for (int64_t j = 0; j < y.cols; ++j) zr[j] += a * yr[j];
    }
  return z;
}

Matrix product_t(const Matrix& x, const Matrix& y) {
  Matrix z(x.rows, y.rows);
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = 0; j < y.rows; ++j) {
      double s = 0;
      for (int64_t t = 0; t < x.cols; ++t) s += x(i, t) * y(j, t);
      z(i, j) = s;
    }
  return z;
}

Matrix transpose(const Matrix& x) {
  Matrix y(x.cols, x.rows);
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = 0; j < x.cols; ++j) y(j, i) = x(i, j);
  return y;
}

void softmax_rows(Matrix& x, double scale, const std::function<int64_t(int64_t)>& cols) {
  for (int64_t i = 0; i < x.rows; ++i) {
    double* r = x.row(i);
    const int64_t len = cols ? std::clamp<int64_t>(cols(i), 0, x.cols) : x.cols;
    std::fill(r + len, r + x.cols, 0.0);
    if (len == 0) continue;
    const double mx = *std::max_element(r, r + len);
    double sum = 0;
    for (int64_t j = 0; j < len; ++j) sum += r[j] = std::exp(scale * (r[j] - mx));
    for (int64_t j = 0; j < len; ++j) r[j] /= sum;
  }
}

Matrix softmax_attention(const Matrix& q, const Matrix& k, const Matrix& v, double scale,
                         const std::function<int64_t(int64_t)>& visible) {
  Matrix s = product_t(q, k);
  softmax_rows(s, scale, visible);
  return product(s, v);
}

Matrix feature_map_attention(const Matrix& fq, const Matrix& fk, const Matrix& v, double eps,
                             const std::function<int64_t(int64_t)>& visible) {
  const Matrix a = product_t(fq, fk);
  Matrix out(fq.rows, v.cols);
  for (int64_t i = 0; i < fq.rows; ++i) {
    const int64_t len = visible ? std::clamp<int64_t>(visible(i), 0, fk.rows) : fk.rows;
    if (len == 0) continue;
    double den = eps;
    double* o = out.row(i);
    for (int64_t j = 0; j < len; ++j) {
      den += a(i, j);
      for (int64_t c = 0; c < v.cols; ++c) o[c] += a(i, j) * v(j, c);
    }
    for (int64_t c = 0; c < v.cols; ++c) o[c] /= den;
  }
  return out;
}

std::vector<double> per_head(const Problem& p, const std::function<Matrix(int64_t, int64_t)>& f) {
  const int64_t bh = p.batch * p.heads, per = p.n * p.dim;
  std::vector<double> out(size_t(bh * per));
  // a head's oracle forms its n x m weights: about 4 n m d flops in double
  const double flops = 4.0 * double(bh) * double(p.n) * double(p.keys()) * double(p.dim);
  parallel_for(bh,
               [&](int64_t t) {
                 const Matrix o = f(t / p.heads, t % p.heads);
                 std::copy(o.a.begin(), o.a.end(), out.begin() + t * per);
               },
               {.parallel = parallel_worth(flops, bh)});
  return out;
}

}  // namespace oracle
}  // namespace attnbench
