// Pieces the block-sparse engine's forward and backward files share: not installed.
#pragma once

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "common/core/error.h"
#include "common/core/threads.h"
#include "common/engines/block_sparse.h"
#include "common/kernels/amx_kernels.h"
#include "common/kernels/attention_kernels.h"
#include "common/kernels/bf16.h"
#include "common/kernels/softmax.h"
#include "common/patterns/mask_bias.h"

namespace attnbench::block_sparse_detail {

/// Key blocks on the amx kernel start at a multiple of this many keys (its packed V^T chunks).
constexpr int64_t kAmxKeyAlign = 32;

/// Key blocks a thread's block list can hold without growing: a query block lists each key
/// block at most once.
inline int64_t max_key_blocks(const Problem& p, int64_t block) {
  return (p.keys() + block - 1) / block;
}

using kernels::ScoreHook;

/// The additive score's projections, formed once per call (the score-tile hook reads them);
/// none for the dot-product scores.
inline std::optional<AdditiveProjections> additive_projections(const Problem& p, ConstTensorView q,
                                                               ConstTensorView k) {
  if (p.score != Score::additive) return std::nullopt;
  return std::optional<AdditiveProjections>(std::in_place, p, q, k);
}

/// The factor of the raw scores in the softmax: 1/sqrt(d) for q . k, 1 for the additive
/// score (its logits are the scores).
inline float logit_scale(const Problem& p) {
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
    const bool split = lse->max != nullptr;  // max and log-sum apart (LseView::max)
    if (split) lse->max_at(b, h, i0 + r) = lr > 0 && !std::isnan(m) ? m : 0.0f;
    if (std::isnan(m) || std::isnan(lr))
      dst = NAN;
    else
      dst = lr > 0 ? float((split ? 0.0 : double(m) * scale) + std::log(double(lr) / pscale))
                   : -INFINITY;
  }
}

/// Query rows and keys of one thread's tiles: block_q and block_k clipped to the problem (a
/// tile larger than n or m is never filled).
inline int64_t tile_rows(const Problem& p, int64_t block_q) { return std::min(block_q, p.n); }
inline int64_t tile_cols(const Problem& p, int64_t block_k) { return std::min(block_k, p.keys()); }

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
    bool partial = false;
    if constexpr (kDense) {
      j0 = i * bk_;
    } else {
      j0 = blocks_[size_t(i)].index * bk_;
      if (j0 >= kend_) {
        mask = nullptr, bias = nullptr;
        return false;
      }
      partial = blocks_[size_t(i)].partial;
    }
    return pair(b_, h_, i0_, rows_, kend_, j0, partial, cols, mask, bias);
  }

  /// The key block from key j0 (j0 < kend) for the query tile of rows i0 .. i0 + rows - 1 of
  /// head (b, h) whose rows see no key at or past kend, `partial` as the pattern lists it:
  /// block() for a pair named directly, without start() (the backward's key-block tasks walk
  /// the pairs from the key side).
  bool pair(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t kend, int64_t j0, bool partial,
            int64_t& cols, const uint8_t*& mask, const float*& bias) const {
    mask = nullptr;
    bias = nullptr;
    cols = std::min(bk_, kend - j0);
    if constexpr (!kDense) {
      if (partial) {
        pat_->block_mask(b, h, i0, rows, j0, cols, mask_);
        mask = mask_;
      }
    }
    if (am_) {
      if (!mask) std::fill(mask_, mask_ + rows * cols, uint8_t(1));
      bool any = false;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float x = am_->at(b, h, i0 + r, j0 + c);
          const bool keep = mask_[r * cols + c] && x != -INFINITY;
          mask_[r * cols + c] = uint8_t(keep);
          bias_[r * cols + c] = keep ? mask_bias_raw(x, root_) : 0.0f;
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

}  // namespace attnbench::block_sparse_detail
