#include "common/kernels/additive_score.h"

#include <algorithm>
#include <vector>

#ifdef __AVX512F__
#include "common/kernels/simd.h"
#endif

namespace attnbench {

// This file is compiled with -fno-trapping-math (CMakeLists.txt): without it GCC keeps
// fast_tanh's division under a branch and the portable loop below does not vectorise.
void add_tanh_row(float* s, const float* k, float qc, float w, int64_t cols) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 vq = _mm512_set1_ps(qc), vw = _mm512_set1_ps(w);
  const __m512 one = _mm512_set1_ps(1.0f), quarter = _mm512_set1_ps(0.25f);
  const __m512 m2log2e = _mm512_set1_ps(-2.0f * 1.44269504088896341f);
  const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff);
  for (; j + simd::kLanes <= cols; j += simd::kLanes) {
    const __m512 x = _mm512_add_ps(vq, _mm512_loadu_ps(k + j));
    const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), abs_bits));
    const __m512 a2 = _mm512_mul_ps(a, a);
    __m512 p = _mm512_set1_ps(0.021869489f);
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-0.053968254f));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(0.133333333f));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-0.333333333f));
    p = _mm512_fmadd_ps(p, a2, one);
    const __m512 small = _mm512_mul_ps(a, p);
    // e = 2^(-2 |x| log2 e) <= 1; 1 for tiny |x| is never selected (small covers it)
    const __m512 e = simd::exp2_nonpos_ps(_mm512_mul_ps(a, m2log2e));
    const __m512 large = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 t = _mm512_mask_mov_ps(large, _mm512_cmp_ps_mask(a, quarter, _CMP_LT_OQ), small);
    // the sign of x back on t (a NaN x gives NaN through e)
    const __m512 sign = _mm512_castsi512_ps(_mm512_andnot_si512(abs_bits, _mm512_castps_si512(x)));
    const __m512 th =
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_castps_si512(sign)));
    _mm512_storeu_ps(s + j, _mm512_fmadd_ps(vw, th, _mm512_loadu_ps(s + j)));
  }
#endif
  for (; j < cols; ++j) s[j] += w * fast_tanh(qc + k[j]);
}

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
