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

/// Writes the log-sum-exp of the `rows` rows of a finished tile (rows i0 ..) of head (b, h):
/// mx[r] is the row's running max in raw score units, l[r] its sum of exp((s - mx) scale)
/// times pscale (the overflow retry's factor, 1 otherwise).
template <class Vec>
void write_lse(const LseView* lse, int64_t b, int64_t h, int64_t i0, int64_t rows, const Vec& mx,
               const Vec& l, float scale, float pscale) {
  if (!lse) return;
  for (int64_t r = 0; r < rows; ++r) {
    const float lr = l[r], m = mx[r];
    float& dst = lse->at(b, h, i0 + r);
    if (std::isnan(m) || std::isnan(lr))
      dst = NAN;
    else
      dst = lr > 0 ? float(double(m) * scale + std::log(double(lr) / pscale)) : -INFINITY;
  }
}

/// Query rows and keys of one thread's tiles: block_q and block_k clipped to the problem (a
/// tile larger than n or m is never filled).
int64_t tile_rows(const Problem& p, int64_t block_q) { return std::min(block_q, p.n); }
int64_t tile_cols(const Problem& p, int64_t block_k) { return std::min(block_k, p.keys()); }

/// The key blocks one thread's tasks walk. kDense: every block of bk keys up to the last key
/// the tile's last row sees, and no pattern (pat is null). Otherwise the blocks pat lists
/// (bk = pat->block()), a partial one masked element by element into `mask` (rows x cols
/// bytes). With an attention mask, every block gets its element mask (what the pattern keeps
/// and the attention mask does not set to -inf) and its bias tile (rows x cols floats, the
/// mask's finite values in raw score units), and a block the mask hides wholly is skipped.
template <bool kDense>
class KeyWalk {
 public:
  /// One per thread (the block list is reserved for every key block, so it never grows).
  /// mask and bias: the thread's tiles (mask null in the dense case without attention mask,
  /// bias null without attention mask).
  KeyWalk(const Problem& p, int64_t bk, const SparsePattern* pat, uint8_t* mask, float* bias)
      : bk_(bk),
        pat_(pat),
        am_(p.attn_mask.get()),
        root_(1.0f / logit_scale(p)),
        mask_(mask),
        bias_(bias) {
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
  /// from every row, not computed), its element mask (null: none) and bias (null: none).
  /// False if the block lies wholly past kend (past the causal diagonal, the key padding or
  /// m) or the attention mask hides all of it.
  bool block(int64_t i, int64_t& j0, int64_t& cols, const uint8_t*& mask,
             const float*& bias) const {
    mask = nullptr;
    bias = nullptr;
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
    if (am_) {
      if (!mask) std::fill(mask_, mask_ + rows_ * cols, uint8_t(1));
      bool any = false;
      for (int64_t r = 0; r < rows_; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float x = am_->at(b_, h_, i0_ + r, j0 + c);
          const bool keep = mask_[r * cols + c] && x != -INFINITY;
          mask_[r * cols + c] = uint8_t(keep);
          bias_[r * cols + c] = keep ? x * root_ : 0.0f;
          any |= keep;
        }
      if (!any) return false;
      mask = mask_;
      bias = bias_;
    }
    return true;
  }

 private:
  int64_t bk_;
  const SparsePattern* pat_;
  const AttnMask* am_;
  float root_;  // 1 / the softmax scale (sqrt(d), or 1 for the additive score): the mask's bias in
                // raw score units
  uint8_t* mask_;
  float* bias_;
  std::vector<KeyBlock> blocks_;
  int64_t b_ = 0, h_ = 0, i0_ = 0, rows_ = 0, kend_ = 0;
};

#ifdef __AVX512F__
namespace fast {

using namespace kernels;

Tiles tiles(const Problem& p, int64_t bq, int64_t bk) {
  return Tiles(tile_rows(p, bq), tile_cols(p, bk), p.dim);
}

/// One thread's working block: the tiles of the shared kernels, then (pattern case, or an
/// attention mask) the element-mask tile, then (attention mask) the bias tile.
int64_t thread_bytes(const Tiles& tl, bool dense, bool biased) {
  return tl.bytes() + (dense && !biased ? 0 : mask_tile_bytes(tl.bq, tl.bk)) +
         (biased ? round_up(tl.bq * tl.bk * int64_t(sizeof(float)), 64) : 0);
}

template <bool kDense>
void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
         int64_t bq, int64_t bk, const SparsePattern* pat, const LseView* lse) {
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
      const bool biased = p.attn_mask != nullptr;
      buf.emplace(thread_bytes(tl, kDense, biased));
      uint8_t* mask = buf->bytes() + tl.bytes();
      float* bias =
          biased ? reinterpret_cast<float*>(mask + mask_tile_bytes(tl.bq, tl.bk)) : nullptr;
      walk.emplace(p, bk, pat, mask, bias);
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
        const int64_t kend = p.visible(b, i0 + rows - 1);
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
            const float* bias;
            if (!walk->block(i, j0, cols, mk, bias)) continue;
            const ScoreHook hook{add ? &*add : nullptr, b, h, i0, j0};
            attend_block(tl, w, rows, k.row(b, h, j0), k.stride_row, v.row(b, h, j0), v.stride_row,
                         cols, scale, causal_first(p, i0, j0), mk, pscale, add ? &hook : nullptr,
                         bias);
          }
          if (kPrefetch && pscale == 1.0f) prefetch_upto(rows);
          if (finish_tile(tl, w, rows, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) {
            write_lse(lse, b, h, i0, rows, w.mx, w.l, logit_scale(p), pscale);
            break;
          }
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

/// One thread's working bytes: the tiles, then (pattern case, or an attention mask) the
/// element-mask tile, then (attention mask) the bias tile.
[[maybe_unused]] int64_t thread_bytes(const Problem& p, int64_t bq, int64_t bk, bool dense) {
  const int64_t rows = tile_rows(p, bq), cols = tile_cols(p, bk);
  const bool biased = p.attn_mask != nullptr;
  return floats(rows, cols, p.dim) * int64_t(sizeof(float)) + (dense && !biased ? 0 : rows * cols) +
         (biased ? rows * cols * int64_t(sizeof(float)) : 0);
}

template <bool kDense>
[[maybe_unused]] void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          TensorView out, int64_t bq, int64_t bk, const SparsePattern* pat,
                          const LseView* lse) {
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
    std::vector<float> bias;
    std::optional<KeyWalk<kDense>> walk;
    guard.run([&] {
      ws.emplace(max_rows, max_cols, d);
      if (!kDense || p.attn_mask) mask.resize(size_t(max_rows * max_cols));
      if (p.attn_mask) bias.resize(size_t(max_rows * max_cols));
      walk.emplace(p, bk, pat, mask.data(), bias.data());
    });
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t)
      guard.run([&] {
        Workspace& w = *ws;
        const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bq;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
        const int64_t kend = p.visible(b, i0 + rows - 1);
        const int64_t nb = walk->start(b, h, qb, i0, rows, kend);
        for (float pscale = 1.0f;; pscale = kernels::safe_pscale(kend)) {
          begin_tile(w, rows);
          for (int64_t i = 0; i < nb; ++i) {
            int64_t j0, cols;
            const uint8_t* mk;
            const float* bias;
            if (!walk->block(i, j0, cols, mk, bias)) continue;
            const ScoreHook hook{add ? &*add : nullptr, b, h, i0, j0};
            attend_block(w, q.row(b, h, i0), q.stride_row, rows, d, k.row(b, h, j0), k.stride_row,
                         v.row(b, h, j0), v.stride_row, cols, scale,
                         kernels::causal_first(p, i0, j0), mk, pscale, add ? &hook : nullptr, bias);
          }
          if (finish_tile(w, rows, d, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) {
            write_lse(lse, b, h, i0, rows, w.mx, w.l, scale, pscale);
            break;
          }
        }
      });
  }
  guard.rethrow();
}

}  // namespace portable

template <bool kDense>
void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
         int64_t bq, int64_t bk, const SparsePattern* pat, const LseView* lse) {
#ifdef __AVX512F__
  fast::run<kDense>(p, q, k, v, out, bq, bk, pat, lse);
#else
  portable::run<kDense>(p, q, k, v, out, bq, bk, pat, lse);
#endif
}

/// Bytes the engine allocates beyond inputs, output and the pattern, on every thread.
double engine_memory(const Problem& p, int64_t bq, int64_t bk, bool dense) {
  const int threads = team_threads();
#ifdef __AVX512F__
  const double tile_bytes =
      double(fast::thread_bytes(fast::tiles(p, bq, bk), dense, p.attn_mask != nullptr));
#else
  const double tile_bytes = double(portable::thread_bytes(p, bq, bk, dense));
#endif
  const double list = dense ? 0.0 : double(max_key_blocks(p, bk)) * sizeof(KeyBlock);
  const double additive = p.score == Score::additive ? AdditiveProjections::bytes(p) : 0.0;
  return (tile_bytes + list) * threads + additive;
}

}  // namespace

void dense_attention(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     TensorView out, int64_t block_q, int64_t block_k, const LseView* lse) {
  run<true>(p, q, k, v, out, block_q, block_k, nullptr, lse);
}

double dense_attention_memory(const Problem& p, int64_t block_q, int64_t block_k) {
  return engine_memory(p, block_q, block_k, /*dense=*/true);
}

void block_sparse_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, TensorView out, const SparsePattern& pat,
                            const LseView* lse) {
  run<false>(p, q, k, v, out, pat.block(), pat.block(), &pat, lse);
}

void merge_attention(const Problem& p, TensorView out, const LseView& lse_out,
                     ConstTensorView other, const LseView& lse_other) {
  const int64_t d = p.dim, heads = p.batch * p.heads;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / p.heads, h = bh % p.heads;
    for (int64_t i = 0; i < p.n; ++i) {
      float& la = lse_out.at(b, h, i);
      const float lb = lse_other.at(b, h, i);
      float* o = out.row(b, h, i);
      const float* x = other.row(b, h, i);
      if (std::isnan(la) || std::isnan(lb)) {
        std::fill(o, o + d, NAN);
        la = NAN;
        continue;
      }
      const float mx = std::max(la, lb);
      if (mx == -INFINITY) {  // neither part attended a key
        std::fill(o, o + d, 0.0f);
        continue;
      }
      const float wa = std::exp(la - mx), wb = std::exp(lb - mx), inv = 1.0f / (wa + wb);
      const float ca = wa * inv, cb = wb * inv;
      for (int64_t c = 0; c < d; ++c) o[c] = ca * o[c] + cb * x[c];
      la = mx + std::log(wa + wb);
    }
  }
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
