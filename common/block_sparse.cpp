#include "common/block_sparse.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "common/attention_kernels.h"
#include "common/omp_guard.h"
#include "common/threads.h"

namespace attnbench {
namespace {

/// Key blocks a thread's block list can hold without growing: a query block lists each key
/// block at most once.
int64_t max_key_blocks(const Problem& p, int64_t block) { return (p.keys() + block - 1) / block; }

using kernels::ScoreHook;

/// The additive score's projections, formed once per call (the score-tile hook reads them);
/// none for the dot-product scores.
std::optional<AdditiveProjections> additive_projections(const Problem& p, ConstTensorView q,
                                                        ConstTensorView k) {
  if (p.score != Score::additive) return std::nullopt;
  return std::optional<AdditiveProjections>(std::in_place, p, q, k);
}

/// The factor of the raw scores in the softmax: 1/sqrt(d) for q . k, 1 for the additive
/// score (its logits are the scores).
float logit_scale(const Problem& p) {
  return p.score == Score::additive ? 1.0f : p.softmax_scale();
}

/// Query rows and keys of one thread's tiles: block_q and block_k clipped to the problem (a
/// tile larger than n or m is never filled).
int64_t tile_rows(const Problem& p, int64_t block_q) { return std::min(block_q, p.n); }
int64_t tile_cols(const Problem& p, int64_t block_k) { return std::min(block_k, p.keys()); }

/// The key blocks one thread's tasks walk. kDense: every block of bk keys up to the last key
/// the tile's last row sees, none masked, and no pattern (pat is null). Otherwise the blocks
/// pat lists (bk = pat->block()), a partial one masked element by element into `mask` (rows x
/// cols bytes).
template <bool kDense>
class KeyWalk {
 public:
  /// One per thread (the block list is reserved for every key block, so it never grows).
  KeyWalk(const Problem& p, int64_t bk, const SparsePattern* pat, uint8_t* mask)
      : bk_(bk), pat_(pat), mask_(mask) {
    if constexpr (!kDense) blocks_.reserve(size_t(max_key_blocks(p, bk)));
  }

  /// Starts the task of query tile qb (rows i0 .. i0 + rows - 1) of head (b, h), whose rows see
  /// no key at or past kend. Returns the number of key blocks to walk.
  int64_t start(int64_t b, int64_t h, int64_t qb, int64_t i0, int64_t rows, int64_t kend) {
    b_ = b, h_ = h, i0_ = i0, rows_ = rows, kend_ = kend;
    if constexpr (kDense) return (kend + bk_ - 1) / bk_;
    pat_->key_blocks(b, h, qb, blocks_);
    return int64_t(blocks_.size());
  }

  /// Key block i of the task: its first key j0, its keys cols (none past kend: they are hidden
  /// from every row, not computed) and its element mask (null: none). False if the block lies
  /// wholly past kend (past the causal diagonal, or past m).
  bool block(int64_t i, int64_t& j0, int64_t& cols, const uint8_t*& mask) const {
    mask = nullptr;
    if constexpr (kDense) {
      j0 = i * bk_;
    } else {
      j0 = blocks_[size_t(i)].index * bk_;
      if (j0 >= kend_) return false;
    }
    cols = std::min(bk_, kend_ - j0);
    if constexpr (!kDense) {
      if (blocks_[size_t(i)].partial) {
        pat_->block_mask(b_, h_, i0_, rows_, j0, cols, mask_);
        mask = mask_;
      }
    }
    return true;
  }

 private:
  int64_t bk_;
  const SparsePattern* pat_;
  uint8_t* mask_;
  std::vector<KeyBlock> blocks_;
  int64_t b_ = 0, h_ = 0, i0_ = 0, rows_ = 0, kend_ = 0;
};

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
  const std::optional<AdditiveProjections> add = additive_projections(p, q, k);
  const float scale = logit_scale(p) * kLog2e;  // applied in pass 3: base-2 weights

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles (and mask and block list), allocated once per call
    std::optional<AlignedBuffer> buf;
    std::optional<KeyWalk<kDense>> walk;
    guard.run([&] {
      buf.emplace(thread_bytes(tl, kDense));
      walk.emplace(p, bk, pat, buf->bytes() + tl.bytes());
    });

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      // try/catch in place rather than guard.run([&] {...}): the task body inlined in a
      // lambda measured about 5% slower on `local`
      if (guard.failed()) continue;
      try {
        const Workspace w(tl, buf->floats());
        // within a head, the last query tiles first: under a causal mask they see the most keys
        const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bq;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
        // keys visible to some row of the tile (the last row sees the most)
        const int64_t kend = p.visible(i0 + rows - 1);
        const int64_t nb = walk->start(b, h, qb, i0, rows, kend);
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
            int64_t j0, cols;
            const uint8_t* mk;
            if (!walk->block(i, j0, cols, mk)) continue;
            const ScoreHook hook{add ? &*add : nullptr, b, h, i0, j0};
            attend_block(tl, w, rows, k.row(b, h, j0), k.stride_row, v.row(b, h, j0), v.stride_row,
                         cols, scale, causal_first(p, i0, j0), mk, pscale, add ? &hook : nullptr);
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
  const std::optional<AdditiveProjections> add = additive_projections(p, q, k);
  const float scale = logit_scale(p);

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles (and mask and block list), allocated once per call
    const int64_t max_rows = tile_rows(p, bq), max_cols = tile_cols(p, bk);
    std::optional<Workspace> ws;
    std::vector<uint8_t> mask;
    std::optional<KeyWalk<kDense>> walk;
    guard.run([&] {
      ws.emplace(max_rows, max_cols, d);
      if constexpr (!kDense) mask.resize(size_t(max_rows * max_cols));
      walk.emplace(p, bk, pat, mask.data());
    });
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t)
      guard.run([&] {
        Workspace& w = *ws;
        const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bq;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
        const int64_t kend = p.visible(i0 + rows - 1);
        const int64_t nb = walk->start(b, h, qb, i0, rows, kend);
        for (float pscale = 1.0f;; pscale = kernels::safe_pscale(kend)) {
          begin_tile(w, rows);
          for (int64_t i = 0; i < nb; ++i) {
            int64_t j0, cols;
            const uint8_t* mk;
            if (!walk->block(i, j0, cols, mk)) continue;
            const ScoreHook hook{add ? &*add : nullptr, b, h, i0, j0};
            attend_block(w, q.row(b, h, i0), q.stride_row, rows, d, k.row(b, h, j0), k.stride_row,
                         v.row(b, h, j0), v.stride_row, cols, scale,
                         kernels::causal_first(p, i0, j0), mk, pscale, add ? &hook : nullptr);
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
  const int threads = team_threads();
#ifdef __AVX512F__
  const double tile_bytes = double(fast::thread_bytes(fast::tiles(p, bq, bk), dense));
#else
  const double tile_bytes = double(portable::thread_bytes(p, bq, bk, dense));
#endif
  const double list = dense ? 0.0 : double(max_key_blocks(p, bk)) * sizeof(KeyBlock);
  const double additive = p.score == Score::additive ? AdditiveProjections::bytes(p) : 0.0;
  return (tile_bytes + list) * threads + additive;
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
  return (logit_flops(p) + 2.0 * double(p.dim)) * scores;
}

double PatternVariant::memory_estimate(const Problem& p) const {
  auto pat = make_pattern(p, {}, {});
  return block_sparse_memory(p, pat->block()) + pat->bytes();
}

}  // namespace attnbench
