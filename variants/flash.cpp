// flash: exact softmax attention, tiled with an online softmax; the n x m score matrix is
// never stored.
//
//   out_i = sum_j softmax_j(q_i . k_j / sqrt(d) + mask_ij) v_j
//
// Each task is one query tile (block_q rows of one batch item and head). It walks the key
// blocks (block_k keys) up to the last key visible to its last row, keeping per row a running
// max mx of the raw scores and a running sum l:
//   S = Q_blk K_blk^T;  mx' = max(mx, rowmax S);  P = exp((S - mx') / sqrt(d))
//   l = l exp((mx - mx') / sqrt(d)) + rowsum P;  acc = acc exp((mx - mx') / sqrt(d)) + P V_blk
// and finally out = acc / l (rows with no visible key give 0). The max is subtracted before
// scaling, so no exponential overflows at any logit size; a tile whose acc overflowed (v near
// FLT_MAX) is run again with scaled weights (see common/attention_kernels.h).
//
// Time O(B H n m d); memory O(threads block_q (block_k + d)).
// Dao et al. 2022, "FlashAttention"; Milakov & Gimelshein 2018 for the online softmax.
//
// Two implementations of the same recurrence:
//
// * AVX-512 (when the compiler targets it): hand-written register-blocked kernels. The scores
//   are kept transposed, S^T (keys x query rows), so that one 16-float register holds one
//   key's scores for 16 consecutive query rows: the row max, the exponentials and the row
//   sums are all lane-wise, with no horizontal reductions, and the P V product broadcasts
//   p values straight from S^T. Q^T is packed once per task (d x block_q, reused by every
//   key block); K and V are read as stored. P = 2^((S - mx) log2(e)/sqrt(d)) is a
//   subtraction, a product and a polynomial exp2 per 16 scores (the scale
//   is not folded into Q: rounding q log2(e)/sqrt(d) would add an error to every logit).
//   Per key block:
//     pass 1  S^T = K Q^T: register tile of 6 keys x 64 rows (24 accumulators), k values
//             broadcast from K, block row max on the way out;
//     pass 2  blocks crossing the causal diagonal only: keys past the diagonal -> -inf,
//             and the block row max again over the visible keys;
//     pass 3  mx', correction c = 2^((mx - mx') s), P = 2^((S - mx') s) in place of S, l;
//     pass 4  acc = acc c + P V: register tile of up to 6 rows x 64 features
//             (24 accumulators) summing the block's P V from 0, then one FMA into acc;
//   and after the last block, pass 5: out = acc / l. Key blocks wholly past the diagonal
//   are never visited; tasks are scheduled dynamically, heaviest causal tiles first.
//   At B=1 H=8 n=4096 d=64 on 2 Zen 4 cores this runs at about 205 GFLOP/s, as fast as
//   OpenBLAS sgemm on the same cores (the Eigen version of the same passes: about 75).
// * Portable: the same passes with Eigen tile products and the scalar fast_exp.
//
// The passes themselves live in common/attention_kernels.h, shared with the block-sparse
// engine (common/block_sparse.cpp); this file only walks the key blocks of each query tile.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "common/attention_kernels.h"
#include "common/omp_guard.h"
#include "common/registry.h"

namespace attnbench {
namespace {

#ifdef __AVX512F__
namespace fast {

using namespace kernels;

void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
             TensorView out, int64_t block_q, int64_t block_k) {
  const Tiles tl(block_q, block_k, p.dim);
  const int64_t n = p.n, bq = tl.bq, bk = tl.bk;
  const int64_t qblocks = (n + bq - 1) / bq, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale() * kLog2e;  // applied in pass 3: base-2 weights

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles, allocated once per forward pass
    std::optional<AlignedBuffer> buf;
    guard.run([&] { buf.emplace(tl.bytes()); });

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) guard.run([&] {
      const Workspace w(tl, buf->floats());
      // within a head, the last query tiles first: under a causal mask they see the most keys
      const int64_t bh = t / qblocks, i0 = (qblocks - 1 - t % qblocks) * bq;
      const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
      // keys visible to some row of the tile (the last row sees the most)
      const int64_t kend = p.visible(i0 + rows - 1);
      // again with scaled weights if acc overflowed (huge v; see attention_kernels.h)
      for (float pscale = 1.0f;; pscale = safe_pscale(kend)) {
        begin_tile(tl, w, q.row(b, h, i0), q.stride_row, rows);
        for (int64_t j0 = 0; j0 < kend; j0 += bk) {
          const int64_t cols = std::min(bk, kend - j0);
          attend_block(tl, w, rows, k.row(b, h, j0), k.stride_row, v.row(b, h, j0),
                       v.stride_row, cols, scale, causal_first(p, i0, j0), nullptr, pscale);
        }
        if (finish_tile(tl, w, rows, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) break;
      }
    });
  }
  guard.rethrow();
}

}  // namespace fast
#endif  // __AVX512F__

namespace portable {

using namespace kernels::portable;

[[maybe_unused]] void forward(const Problem& p, ConstTensorView q, ConstTensorView k,
                              ConstTensorView v, TensorView out, int64_t bq, int64_t bk) {
  const int64_t n = p.n, d = p.dim;
  const int64_t qblocks = (n + bq - 1) / bq, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale();

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles, allocated once per forward pass
    std::optional<Workspace> ws;
    guard.run([&] { ws.emplace(bq, bk, d); });
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) guard.run([&] {
      Workspace& w = *ws;
      const int64_t bh = t / qblocks, i0 = (qblocks - 1 - t % qblocks) * bq;
      const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
      // keys visible to some row of this block: the last row sees the most
      const int64_t kend = p.visible(i0 + rows - 1);
      for (float pscale = 1.0f;; pscale = kernels::safe_pscale(kend)) {
        begin_tile(w, rows);
        for (int64_t j0 = 0; j0 < kend; j0 += bk) {
          const int64_t cols = std::min(bk, kend - j0);
          attend_block(w, q.row(b, h, i0), q.stride_row, rows, d, k.row(b, h, j0),
                       k.stride_row, v.row(b, h, j0), v.stride_row, cols, scale,
                       kernels::causal_first(p, i0, j0), nullptr, pscale);
        }
        if (finish_tile(w, rows, d, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) break;
      }
    });
  }
  guard.rethrow();
}

}  // namespace portable

class Flash final : public Variant {
 public:
  Flash(int64_t bq, int64_t bk) : bq_(bq), bk_(bk) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
#ifdef __AVX512F__
    fast::forward(p, q, k, v, out, bq_, bk_);
#else
    portable::forward(p, q, k, v, out, bq_, bk_);
#endif
  }

  double flops(const Problem& p) const override {
    // QK^T and PV over the visible pairs (whole key blocks past the diagonal are skipped)
    return 4.0 * double(p.batch * p.heads) * p.visible_pairs() * double(p.dim);
  }

  double memory_estimate(const Problem& p) const override {
#ifdef __AVX512F__
    const double per_thread = double(kernels::Tiles(bq_, bk_, p.dim).bytes());
#else
    const double per_thread = double(kernels::portable::floats(bq_, bk_, p.dim)) * sizeof(float);
#endif
    const int threads = p.threads > 0 ? p.threads : omp_get_max_threads();
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
        .params = {ParamSpec::Int("block_q", 64, 1, 4096,
                                  "query rows per tile (multiples of 64 use the full kernels)"),
                   ParamSpec::Int("block_k", 256, 1, 65536, "keys per tile")},
        .caps = {.causal = true, .cross = true},
        .make = [](const ParamValues& pv) {
          return std::make_unique<Flash>(pv.get_int("block_q"), pv.get_int("block_k"));
        }});

}  // namespace
}  // namespace attnbench
