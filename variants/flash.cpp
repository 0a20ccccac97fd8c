// flash: exact softmax attention, tiled with an online softmax; the n x m score matrix is
// never stored.
//
// For each query block (block_q rows) walk the key blocks (block_k keys) up to the last
// visible key, keeping per row a running max mx and running sum l:
//   S = Q_blk K_blk^T / sqrt(d);  mx' = max(mx, rowmax S);  P = exp(S - mx')
//   l = l exp(mx - mx') + rowsum P;  acc = acc exp(mx - mx') + P V_blk
// and finally out = acc / l (rows with no visible key give 0).
//
// Time O(B H n m d); memory O(threads (block_q block_k + block_q d)).
// Dao et al. 2022, "FlashAttention"; Milakov & Gimelshein 2018 for the online softmax.
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/registry.h"
#include "common/softmax.h"

namespace attnbench {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMat, Eigen::Unaligned, Eigen::OuterStride<>>;
using Map = Eigen::Map<RowMat, Eigen::Unaligned, Eigen::OuterStride<>>;

class Flash final : public Variant {
 public:
  Flash(int64_t bq, int64_t bk) : bq_(bq), bk_(bk) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const int64_t n = p.n, d = p.dim;
    const int64_t qblocks = (n + bq_ - 1) / bq_, tasks = p.batch * p.heads * qblocks;
    const float scale = p.softmax_scale();

#pragma omp parallel
    {
      // per-thread tiles, allocated once per forward pass
      RowMat s(bq_, bk_), acc(bq_, d);
      std::vector<float> mx(static_cast<size_t>(bq_)), l(static_cast<size_t>(bq_));
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < tasks; ++t) {
        const int64_t bh = t / qblocks, i0 = (t % qblocks) * bq_;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq_, n - i0);
        // keys visible to some row of this block: the last row sees the most
        const int64_t kend = p.visible(i0 + rows - 1);
        ConstMap qb(q.row(b, h, i0), rows, d, Eigen::OuterStride<>(q.stride_row));
        acc.topRows(rows).setZero();
        std::fill(mx.begin(), mx.end(), -INFINITY);
        std::fill(l.begin(), l.end(), 0.0f);
        for (int64_t j0 = 0; j0 < kend; j0 += bk_) {
          const int64_t cols = std::min(bk_, kend - j0);
          ConstMap kb(k.row(b, h, j0), cols, d, Eigen::OuterStride<>(k.stride_row));
          ConstMap vb(v.row(b, h, j0), cols, d, Eigen::OuterStride<>(v.stride_row));
          auto sb = s.topLeftCorner(rows, cols);
          // pass 1: raw scores
          sb.noalias() = qb * kb.transpose();
          // pass 2: per row, mask, new max, exponentials, rescale the running state
          for (int64_t r = 0; r < rows; ++r) {
            float* sr = s.row(r).data();
            const int64_t vis = std::clamp<int64_t>(p.visible(i0 + r) - j0, 0, cols);
            float bm = -INFINITY;
            for (int64_t c = 0; c < vis; ++c) bm = std::fmax(bm, sr[c]);
            const float new_mx = std::fmax(mx[size_t(r)], bm * scale);
            if (new_mx == -INFINITY) {  // nothing visible yet in this row
              std::fill(sr, sr + cols, 0.0f);
              continue;
            }
            const float corr = fast_exp(mx[size_t(r)] - new_mx);
            float sum = 0.0f;
            for (int64_t c = 0; c < vis; ++c) {
              sr[c] = fast_exp(sr[c] * scale - new_mx);
              sum += sr[c];
            }
            std::fill(sr + vis, sr + cols, 0.0f);
            l[size_t(r)] = l[size_t(r)] * corr + sum;
            mx[size_t(r)] = new_mx;
            if (corr != 1.0f) acc.row(r) *= corr;
          }
          // pass 3: acc += P V
          acc.topRows(rows).noalias() += sb * vb;
        }
        // pass 4: normalise; rows with no visible key stay 0
        for (int64_t r = 0; r < rows; ++r) {
          float* o = out.row(b, h, i0 + r);
          const float inv = l[size_t(r)] > 0 ? 1.0f / l[size_t(r)] : 0.0f;
          for (int64_t c = 0; c < d; ++c) o[c] = acc(r, c) * inv;
        }
      }
    }
  }

  double flops(const Problem& p) const override {
    // QK^T and PV over the visible pairs (whole key blocks past the diagonal are skipped)
    return 4.0 * double(p.batch * p.heads) * p.visible_pairs() * double(p.dim);
  }

  double memory_estimate(const Problem& p) const override {
    const double per_thread = double(bq_ * bk_ + bq_ * p.dim + 2 * bq_) * sizeof(float);
    int threads = p.threads > 0 ? p.threads : omp_get_max_threads();
    return per_thread * threads;
  }

 private:
  int64_t bq_, bk_;
};

ATTNBENCH_REGISTER_VARIANT(
    flash,
    VariantInfo{
        .name = "flash",
        .summary = "exact softmax attention, tiled with an online softmax, n x m never stored",
        .complexity = "time O(n m d), memory O(threads block_q (block_k + d))",
        .params = {ParamSpec::Int("block_q", 64, 1, 4096, "query rows per tile"),
                   ParamSpec::Int("block_k", 256, 1, 65536, "keys per tile")},
        .caps = {.causal = true, .cross = true},
        .make = [](const ParamValues& pv) {
          return std::make_unique<Flash>(pv.get_int("block_q"), pv.get_int("block_k"));
        }});

}  // namespace
}  // namespace attnbench
