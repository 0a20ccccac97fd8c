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

/// Query rows and keys of one thread's tiles: block_q and block_k clipped to the problem (a
/// tile larger than n or m is never filled).
int64_t tile_rows(const Problem& p, int64_t block_q) { return std::min(block_q, p.n); }
int64_t tile_cols(const Problem& p, int64_t block_k) { return std::min(block_k, p.keys()); }

// The task loop, once for both cases. kDense: every key block up to the last key the tile's
// last row sees, none masked, and no pattern (pat is null). Otherwise the key blocks pat lists
// (bk = pat->block()), partial ones masked element by element.

#ifdef __AVX512F__
namespace fast {

using namespace kernels;

Tiles tiles(const Problem& p, int64_t bq, int64_t bk) {
  return Tiles(tile_rows(p, bq), tile_cols(p, bk), p.dim);
}

/// One thread's working block: the tiles of the shared kernels, then (pattern case) the
/// element-mask tile.
int64_t thread_bytes(const Tiles& tl, bool dense) {
  return tl.bytes() + (dense ? 0 : mask_tile_bytes(tl.bq, tl.bk));
}

template <bool kDense>
void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
         int64_t bq, int64_t bk, const SparsePattern* pat) {
  const Tiles tl = tiles(p, bq, bk);
  const int64_t n = p.n, qblocks = (n + bq - 1) / bq, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale() * kLog2e;  // applied in pass 3: base-2 weights

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles (and mask and block list), allocated once per call
    std::optional<AlignedBuffer> buf;
    std::vector<KeyBlock> blocks;
    guard.run([&] {
      buf.emplace(thread_bytes(tl, kDense));
      if constexpr (!kDense) blocks.reserve(size_t(max_key_blocks(p, bk)));
    });

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      // try/catch in place rather than guard.run([&] {...}): the task body inlined in a
      // lambda measured about 5% slower on `local`
      if (guard.failed()) continue;
      try {
        const Workspace w(tl, buf->floats());
        uint8_t* const mask = buf->bytes() + tl.bytes();
        // within a head, the last query tiles first: under a causal mask they see the most keys
        const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bq;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
        // keys visible to some row of the tile (the last row sees the most)
        const int64_t kend = p.visible(i0 + rows - 1);
        int64_t nb;  // key blocks to walk
        if constexpr (kDense) {
          nb = (kend + bk - 1) / bk;
        } else {
          pat->key_blocks(b, h, qb, blocks);
          nb = int64_t(blocks.size());
        }
        // Pattern case: Q and out are touched once per task, fetch this task's output tile and
        // the Q tiles of the next query tiles of this head (the next tasks, of this thread or
        // another) into L2 while this one computes, a share of the rows before each key block
        // (all at once stalls on the miss buffers). The dense case, whose tiles stream every
        // key block, runs without these prefetches.
        constexpr bool kPrefetch = !kDense;
        const int64_t ahead = std::min<int64_t>(2, qb);
        int64_t fetched = 0;  // rows of those tiles prefetched so far
        auto prefetch_upto = [&](int64_t upto) {
          prefetch_rows(out.row(b, h, i0 + fetched), upto - fetched, out.stride_row, tl.d, true);
          for (int64_t a = 1; a <= ahead; ++a)
            prefetch_rows(q.row(b, h, i0 - a * bq + fetched), upto - fetched, q.stride_row, tl.d,
                          false);
          fetched = upto;
        };
        // the key blocks; again with scaled weights if acc overflowed (huge v, see
        // attention_kernels.h: rare, so the prefetches are not repeated)
        for (float pscale = 1.0f;; pscale = safe_pscale(kend)) {
          begin_tile(tl, w, q.row(b, h, i0), q.stride_row, rows);
          for (int64_t i = 0; i < nb; ++i) {
            if (kPrefetch && pscale == 1.0f) prefetch_upto(rows * (i + 1) / nb);
            int64_t j0;
            const uint8_t* mk = nullptr;
            if constexpr (kDense) {
              j0 = i * bk;
            } else {
              const KeyBlock& kb = blocks[size_t(i)];
              j0 = kb.index * bk;
              if (j0 >= kend) continue;  // wholly past the causal diagonal (or past m)
              if (kb.partial) mk = mask;
            }
            // keys past kend are hidden from every row: not computed
            const int64_t cols = std::min(bk, kend - j0);
            if (mk) pat->block_mask(b, h, i0, rows, j0, cols, mask);
            attend_block(tl, w, rows, k.row(b, h, j0), k.stride_row, v.row(b, h, j0), v.stride_row,
                         cols, scale, causal_first(p, i0, j0), mk, pscale);
          }
          if (kPrefetch && pscale == 1.0f) prefetch_upto(rows);
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

/// One thread's working bytes: the tiles, then (pattern case) the element-mask tile.
[[maybe_unused]] int64_t thread_bytes(const Problem& p, int64_t bq, int64_t bk, bool dense) {
  const int64_t rows = tile_rows(p, bq), cols = tile_cols(p, bk);
  return floats(rows, cols, p.dim) * int64_t(sizeof(float)) + (dense ? 0 : rows * cols);
}

template <bool kDense>
[[maybe_unused]] void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          TensorView out, int64_t bq, int64_t bk, const SparsePattern* pat) {
  const int64_t n = p.n, d = p.dim;
  const int64_t qblocks = (n + bq - 1) / bq, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale();

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles (and mask and block list), allocated once per call
    const int64_t max_rows = tile_rows(p, bq), max_cols = tile_cols(p, bk);
    std::optional<Workspace> ws;
    std::vector<uint8_t> mask;
    std::vector<KeyBlock> blocks;
    guard.run([&] {
      ws.emplace(max_rows, max_cols, d);
      if constexpr (!kDense) {
        mask.resize(size_t(max_rows * max_cols));
        blocks.reserve(size_t(max_key_blocks(p, bk)));
      }
    });
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t)
      guard.run([&] {
        Workspace& w = *ws;
        const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bq;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
        const int64_t kend = p.visible(i0 + rows - 1);
        int64_t nb;
        if constexpr (kDense) {
          nb = (kend + bk - 1) / bk;
        } else {
          pat->key_blocks(b, h, qb, blocks);
          nb = int64_t(blocks.size());
        }
        for (float pscale = 1.0f;; pscale = kernels::safe_pscale(kend)) {
          begin_tile(w, rows);
          for (int64_t i = 0; i < nb; ++i) {
            int64_t j0;
            const uint8_t* mk = nullptr;
            if constexpr (kDense) {
              j0 = i * bk;
            } else {
              const KeyBlock& kb = blocks[size_t(i)];
              j0 = kb.index * bk;
              if (j0 >= kend) continue;
              if (kb.partial) mk = mask.data();
            }
            const int64_t cols = std::min(bk, kend - j0);
            if (mk) pat->block_mask(b, h, i0, rows, j0, cols, mask.data());
            attend_block(w, q.row(b, h, i0), q.stride_row, rows, d, k.row(b, h, j0), k.stride_row,
                         v.row(b, h, j0), v.stride_row, cols, scale,
                         kernels::causal_first(p, i0, j0), mk, pscale);
          }
          if (finish_tile(w, rows, d, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) break;
        }
      });
  }
  guard.rethrow();
}

}  // namespace portable

template <bool kDense>
void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
         int64_t bq, int64_t bk, const SparsePattern* pat) {
#ifdef __AVX512F__
  fast::run<kDense>(p, q, k, v, out, bq, bk, pat);
#else
  portable::run<kDense>(p, q, k, v, out, bq, bk, pat);
#endif
}

/// Bytes the engine allocates beyond inputs, output and the pattern, on every thread.
double engine_memory(const Problem& p, int64_t bq, int64_t bk, bool dense) {
  const int threads = p.threads > 0 ? p.threads : omp_get_max_threads();
#ifdef __AVX512F__
  const double tile_bytes = double(fast::thread_bytes(fast::tiles(p, bq, bk), dense));
#else
  const double tile_bytes = double(portable::thread_bytes(p, bq, bk, dense));
#endif
  const double list = dense ? 0.0 : double(max_key_blocks(p, bk)) * sizeof(KeyBlock);
  return (tile_bytes + list) * threads;
}

}  // namespace

void dense_attention(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     TensorView out, int64_t block_q, int64_t block_k) {
  run<true>(p, q, k, v, out, block_q, block_k, nullptr);
}

double dense_attention_memory(const Problem& p, int64_t block_q, int64_t block_k) {
  return engine_memory(p, block_q, block_k, /*dense=*/true);
}

void block_sparse_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, TensorView out, const SparsePattern& pat) {
  run<false>(p, q, k, v, out, pat.block(), pat.block(), &pat);
}

double block_sparse_memory(const Problem& p, int64_t block) {
  return engine_memory(p, block, block, /*dense=*/false);
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
