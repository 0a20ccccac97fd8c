#include "common/additive_score.h"

#include <algorithm>
#include <vector>

namespace attnbench {

AdditiveProjections::AdditiveProjections(const Problem& p, ConstTensorView q, ConstTensorView k)
    : qp(Shape4{p.batch, p.heads, p.n, p.hidden()}),
      kt(Shape4{p.batch, p.heads, p.hidden(), p.keys()}),
      w(p.score_weights->w_score.data()),
      hidden(p.hidden()) {
  const ScoreWeights& sw = *p.score_weights;
  const int64_t d = p.dim, hd = hidden, m = p.keys();
  TensorView qv = qp.view(), kv = kt.view();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* wq = sw.w_q.data() + h * hd * d;
      const float* wk = sw.w_k.data() + h * hd * d;
      for (int64_t i = 0; i < p.n; ++i) {
        const float* qi = q.row(b, h, i);
        float* o = qv.row(b, h, i);
        for (int64_t c = 0; c < hd; ++c) {
          float s = 0;
          for (int64_t x = 0; x < d; ++x) s += wq[c * d + x] * qi[x];
          o[c] = s;
        }
      }
      float* kh = kv.head(b, h);
      std::fill(kh, kh + hd * m, 0.0f);
      for (int64_t j = 0; j < m; ++j) {
        const float* kj = k.row(b, h, j);
        for (int64_t c = 0; c < hd; ++c) {
          float s = 0;
          for (int64_t x = 0; x < d; ++x) s += wk[c * d + x] * kj[x];
          kh[c * m + j] = s;
        }
      }
    }
}

double AdditiveProjections::bytes(const Problem& p) {
  return double(p.batch * p.heads) * double(p.n + p.keys()) * double(p.hidden()) * sizeof(float);
}

void additive_tile(const AdditiveProjections& a, int64_t b, int64_t h, int64_t i0, int64_t rows,
                   int64_t j0, int64_t cols, float* s, int64_t rs, int64_t cs) {
  const int64_t m = a.kt.shape().dim;
  const float* wh = a.w + h * a.hidden;
  const float* kh = a.kt.view().head(b, h) + j0;
  // a strided output row is formed in a contiguous one first
  thread_local std::vector<float> row;
  if (cs != 1 && int64_t(row.size()) < cols) row.resize(size_t(cols));
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = cs == 1 ? s + r * rs : row.data();
    const float* qr = a.qp.view().row(b, h, i0 + r);
    std::fill(sr, sr + cols, 0.0f);
    for (int64_t c = 0; c < a.hidden; ++c) add_tanh_row(sr, kh + c * m, qr[c], wh[c], cols);
    if (cs != 1)
      for (int64_t c = 0; c < cols; ++c) s[r * rs + c * cs] = sr[c];
  }
}

}  // namespace attnbench
