#include "common/block_sparse.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/softmax.h"

namespace attnbench {

void block_sparse_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, TensorView out, const SparsePattern& pat) {
  const int64_t n = p.n, m = p.keys(), d = p.dim, bs = pat.block();
  const int64_t qblocks = (n + bs - 1) / bs, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale();
#pragma omp parallel
  {
    std::vector<float> s(size_t(bs * bs)), acc(size_t(bs * d)), mx(static_cast<size_t>(bs)),
        l(static_cast<size_t>(bs));
    std::vector<uint8_t> mask(size_t(bs * bs));
    std::vector<KeyBlock> blocks;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t bh = t / qblocks, qb = t % qblocks, i0 = qb * bs;
      const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bs, n - i0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(mx.begin(), mx.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.0f);
      pat.key_blocks(b, h, qb, blocks);
      for (const KeyBlock& kb : blocks) {
        const int64_t j0 = kb.index * bs, cols = std::min(bs, m - j0);
        if (cols <= 0 || j0 >= p.visible(i0 + rows - 1)) continue;
        if (kb.partial) pat.block_mask(b, h, i0, rows, j0, cols, mask.data());
        for (int64_t r = 0; r < rows; ++r) {
          // pass 1: scores of the allowed, visible keys; the rest -inf
          const float* qi = q.row(b, h, i0 + r);
          const int64_t vis = std::clamp<int64_t>(p.visible(i0 + r) - j0, 0, cols);
          float* sr = s.data() + r * bs;
          float bm = -INFINITY;
          for (int64_t c = 0; c < cols; ++c) {
            if (c >= vis || (kb.partial && !mask[size_t(r * cols + c)])) {
              sr[c] = -INFINITY;
              continue;
            }
            const float* kj = k.row(b, h, j0 + c);
            float dot = 0;
            for (int64_t x = 0; x < d; ++x) dot += qi[x] * kj[x];
            sr[c] = dot * scale;
            bm = std::fmax(bm, sr[c]);
          }
          if (bm == -INFINITY) continue;  // nothing of this block is attended by row r
          // pass 2: online softmax update and acc += P V
          const float new_mx = std::fmax(mx[size_t(r)], bm);
          const float corr = fast_exp(mx[size_t(r)] - new_mx);
          float* ar = acc.data() + r * d;
          for (int64_t x = 0; x < d; ++x) ar[x] *= corr;
          float sum = 0;
          for (int64_t c = 0; c < cols; ++c) {
            const float e = fast_exp(sr[c] - new_mx);
            if (e == 0.0f) continue;
            sum += e;
            const float* vj = v.row(b, h, j0 + c);
            for (int64_t x = 0; x < d; ++x) ar[x] += e * vj[x];
          }
          l[size_t(r)] = l[size_t(r)] * corr + sum;
          mx[size_t(r)] = new_mx;
        }
      }
      // pass 3: normalise; rows that attended nothing are 0
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out.row(b, h, i0 + r);
        const float inv = l[size_t(r)] > 0 ? 1.0f / l[size_t(r)] : 0.0f;
        for (int64_t x = 0; x < d; ++x) o[x] = acc[size_t(r * d + x)] * inv;
      }
    }
  }
}

double block_sparse_memory(const Problem& p, int64_t block) {
  const int threads = p.threads > 0 ? p.threads : omp_get_max_threads();
  const double per_thread = double(block * block) * (sizeof(float) + 1) +
                            double(block * p.dim + 2 * block) * sizeof(float) +
                            double((p.keys() + block - 1) / block) * sizeof(KeyBlock);
  return per_thread * threads;
}

void PatternVariant::forward(const Problem& p, ConstTensorView q, ConstTensorView k,
                             ConstTensorView v, TensorView out) {
  auto pat = make_pattern(p, q, k);
  block_sparse_attention(p, q, k, v, out, *pat);
}

double PatternVariant::flops(const Problem& p) const {
  auto pat = make_pattern(p, {}, {});
  double scores = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) scores += pattern_scores(p, *pat, b, h);
  return 4.0 * double(p.dim) * scores;
}

double PatternVariant::memory_estimate(const Problem& p) const {
  auto pat = make_pattern(p, {}, {});
  return block_sparse_memory(p, pat->block()) + pat->bytes();
}

}  // namespace attnbench
