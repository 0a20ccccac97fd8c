#include "common/block_sparse.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "common/attention_kernels.h"
#include "common/omp_guard.h"

namespace attnbench {
namespace {

/// Key blocks a thread's block list can hold without growing: a query block lists each key
/// block at most once.
int64_t max_key_blocks(const Problem& p, int64_t block) { return (p.keys() + block - 1) / block; }

#ifdef __AVX512F__
namespace fast {

using namespace kernels;

/// The tiles of one thread: query tiles of `block` rows, key blocks of `block` keys, both
/// clipped to the problem (a block larger than n or m needs no larger tile).
Tiles tiles(const Problem& p, int64_t block) {
  return Tiles(std::min(block, p.n), std::min(block, p.keys()), p.dim);
}

/// One thread's working block: the tiles of the shared kernels, then the element-mask tile.
int64_t thread_bytes(const Tiles& tl) { return tl.bytes() + mask_tile_bytes(tl.bq, tl.bk); }

void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
         TensorView out, const SparsePattern& pat) {
  const int64_t bs = pat.block();
  const Tiles tl = tiles(p, bs);
  const int64_t n = p.n, qblocks = (n + bs - 1) / bs, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale() * kLog2e;  // applied in pass 3: base-2 weights

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles, mask and block list, allocated once per call
    std::optional<AlignedBuffer> buf;
    std::vector<KeyBlock> blocks;
    guard.run([&] {
      buf.emplace(thread_bytes(tl));
      blocks.reserve(size_t(max_key_blocks(p, bs)));
    });

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      // try/catch in place rather than guard.run([&] {...}): the task body inlined in a
      // lambda measured about 5% slower on `local`
      if (guard.failed()) continue;
      try {
        const Workspace w(tl, buf->floats());
        uint8_t* const mask = buf->bytes() + tl.bytes();
        // within a head, the last query blocks first: under a causal mask they see the most keys
        const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bs;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bs, n - i0);
        // keys visible to some row of the block (the last row sees the most)
        const int64_t kend = p.visible(i0 + rows - 1);
        pat.key_blocks(b, h, qb, blocks);
        // Q and out are touched once per task: fetch this task's output tile and the Q tiles of
        // the next query blocks of this head (the next tasks, of this thread or another) into L2
        // while this one computes, a share of the rows before each key block (all at once
        // stalls on the miss buffers)
        const int64_t ahead = std::min<int64_t>(2, qb);
        const int64_t nb = std::max<int64_t>(int64_t(blocks.size()), 1);
        int64_t fetched = 0;  // rows of those tiles prefetched so far
        auto prefetch_upto = [&](int64_t upto) {
          prefetch_rows(out.row(b, h, i0 + fetched), upto - fetched, out.stride_row, tl.d, true);
          for (int64_t a = 1; a <= ahead; ++a)
            prefetch_rows(q.row(b, h, i0 - a * bs + fetched), upto - fetched, q.stride_row, tl.d,
                          false);
          fetched = upto;
        };
        // the key blocks; again with scaled weights if acc overflowed (huge v, see
        // attention_kernels.h: rare, so the prefetches are not repeated)
        for (float pscale = 1.0f;; pscale = safe_pscale(kend)) {
          begin_tile(tl, w, q.row(b, h, i0), q.stride_row, rows);
          for (size_t i = 0; i < blocks.size(); ++i) {
            if (pscale == 1.0f) prefetch_upto(rows * int64_t(i + 1) / nb);
            const KeyBlock& kb = blocks[i];
            const int64_t j0 = kb.index * bs;
            if (j0 >= kend) continue;  // wholly past the causal diagonal (or past m)
            // keys past kend are hidden from every row: not computed
            const int64_t cols = std::min(bs, kend - j0);
            const uint8_t* mk = nullptr;
            if (kb.partial) {
              pat.block_mask(b, h, i0, rows, j0, cols, mask);
              mk = mask;
            }
            attend_block(tl, w, rows, k.row(b, h, j0), k.stride_row, v.row(b, h, j0),
                         v.stride_row, cols, scale, causal_first(p, i0, j0), mk, pscale);
          }
          if (pscale == 1.0f) prefetch_upto(rows);
          if (finish_tile(tl, w, rows, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) break;
        }
      } catch (...) {
        guard.capture();
      }
    }
  }
  guard.rethrow();
}

}  // namespace fast
#endif  // __AVX512F__

namespace portable {

using namespace kernels::portable;

[[maybe_unused]] void run(const Problem& p, ConstTensorView q, ConstTensorView k,
                          ConstTensorView v, TensorView out, const SparsePattern& pat) {
  const int64_t bs = pat.block(), n = p.n, d = p.dim;
  const int64_t qblocks = (n + bs - 1) / bs, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale();

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles, mask and block list, allocated once per call
    const int64_t max_rows = std::min(bs, n), max_cols = std::min(bs, p.keys());
    std::optional<Workspace> ws;
    std::vector<uint8_t> mask;
    std::vector<KeyBlock> blocks;
    guard.run([&] {
      ws.emplace(max_rows, max_cols, d);
      mask.resize(size_t(max_rows * max_cols));
      blocks.reserve(size_t(max_key_blocks(p, bs)));
    });
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) guard.run([&] {
      Workspace& w = *ws;
      const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bs;
      const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bs, n - i0);
      const int64_t kend = p.visible(i0 + rows - 1);
      pat.key_blocks(b, h, qb, blocks);
      for (float pscale = 1.0f;; pscale = kernels::safe_pscale(kend)) {
        begin_tile(w, rows);
        for (const KeyBlock& kb : blocks) {
          const int64_t j0 = kb.index * bs;
          if (j0 >= kend) continue;
          const int64_t cols = std::min(bs, kend - j0);
          const uint8_t* mk = nullptr;
          if (kb.partial) {
            pat.block_mask(b, h, i0, rows, j0, cols, mask.data());
            mk = mask.data();
          }
          attend_block(w, q.row(b, h, i0), q.stride_row, rows, d, k.row(b, h, j0),
                       k.stride_row, v.row(b, h, j0), v.stride_row, cols, scale,
                       kernels::causal_first(p, i0, j0), mk, pscale);
        }
        if (finish_tile(w, rows, d, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) break;
      }
    });
  }
  guard.rethrow();
}

}  // namespace portable
}  // namespace

void block_sparse_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, TensorView out, const SparsePattern& pat) {
#ifdef __AVX512F__
  fast::run(p, q, k, v, out, pat);
#else
  portable::run(p, q, k, v, out, pat);
#endif
}

double block_sparse_memory(const Problem& p, int64_t block) {
  const int threads = p.threads > 0 ? p.threads : omp_get_max_threads();
#ifdef __AVX512F__
  const double tile_bytes = double(fast::thread_bytes(fast::tiles(p, block)));
#else
  const int64_t rows = std::min(block, p.n), cols = std::min(block, p.keys());
  const double tile_bytes =
      double(kernels::portable::floats(rows, cols, p.dim)) * sizeof(float) + double(rows * cols);
#endif
  const double list = double(max_key_blocks(p, block)) * sizeof(KeyBlock);
  return (tile_bytes + list) * threads;
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
