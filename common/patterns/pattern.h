// Attention patterns: which keys each query attends to, described block by block so one
// block-sparse engine (common/engines/block_sparse.h) can run every pattern variant.
//
// A pattern is built for one problem (and, for data-dependent patterns, its q and k). It
// covers every (batch, head): patterns may differ per head (BigBird's random blocks). The
// causal mask is NOT part of a pattern: the engine, the masked reference and the exported
// pattern all intersect the pattern with the problem's causal mask (key j visible to query i
// iff j < p.visible(i)), so a pattern only states its own structure.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/core/problem.h"
#include "common/core/tensor.h"

namespace attnbench {

/// One key block visited by a query block.
struct KeyBlock {
  int64_t index;  ///< key block number: keys [index * block, (index + 1) * block) clipped to m
  bool partial;   ///< true if some (query, key) pair of the tile is outside the pattern
};

class SparsePattern {
 public:
  virtual ~SparsePattern() = default;

  /// Block size: query block qb holds queries [qb * block, ...), key block kb keys
  /// [kb * block, ...), both clipped to n and m.
  virtual int64_t block() const = 0;
  /// Key blocks query block qb of head (b, h) visits, in increasing order, without
  /// duplicates. A block marked full must have every pair in the pattern; a block with no
  /// pair in the pattern must not be listed.
  virtual void key_blocks(int64_t b, int64_t h, int64_t qb, std::vector<KeyBlock>& out) const = 0;
  /// mask[r * cols + c] = 1 if query i0 + r attends key j0 + c in head (b, h), else 0.
  /// Called for partial blocks only (and by the generic helpers below).
  virtual void block_mask(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                          uint8_t* mask) const = 0;
  /// row[j] = 1 if query i of head (b, h) attends key j (length m), before the causal mask.
  /// The default assembles the row from key_blocks and block_mask; patterns stated row by row
  /// override it.
  virtual void row_mask(int64_t b, int64_t h, int64_t i, int64_t m, uint8_t* row) const;
  /// Heap bytes the pattern object holds (block tables and the like).
  virtual double bytes() const { return 0; }
};

/// Base of the fixed patterns stated on aligned positions a(i) = i + m - n (the position of
/// query i among the keys) with one block size for queries and keys: a pattern states the key
/// blocks of a query block from the aligned positions of its first and last query.
class AlignedBlockPattern : public SparsePattern {
 public:
  AlignedBlockPattern(int64_t n, int64_t m, int64_t block)
      : n_(n), m_(m), off_(m - n), bs_(block) {}

  int64_t block() const override { return bs_; }
  void key_blocks(int64_t, int64_t, int64_t qb, std::vector<KeyBlock>& out) const final {
    out.clear();
    const int64_t i0 = qb * bs_, i1 = i0 + bs_ < n_ ? i0 + bs_ : n_;
    if (i0 < 0 || i0 >= i1) return;
    aligned_key_blocks(i0 + off_, i1 - 1 + off_, out);
  }

 protected:
  /// Appends to `out` (empty) the key blocks of the query block whose first and last queries
  /// sit at aligned positions a0 <= a1, with the contract of key_blocks.
  virtual void aligned_key_blocks(int64_t a0, int64_t a1, std::vector<KeyBlock>& out) const = 0;

  int64_t n_, m_, off_, bs_;
};

/// Floor division, for b > 0 (rounds toward minus infinity).
inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
/// Ceiling division, for b > 0.
inline int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }
/// Mathematical a mod b in [0, b), for b > 0.
inline int64_t pmod(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return r < 0 ? r + b : r;
}

/// Row i of head (b, h) of the pattern intersected with the causal mask: row[j] = 1 if
/// query i attends key j (length m).
void pattern_row(const Problem& p, const SparsePattern& pat, int64_t b, int64_t h, int64_t i,
                 uint8_t* row);

/// Number of (query, key) pairs attended in head (b, h), causal mask included.
double pattern_pairs(const Problem& p, const SparsePattern& pat, int64_t b, int64_t h);

/// Number of scores the block-sparse engine computes in head (b, h): every listed block in
/// full, minus key blocks wholly hidden by the causal mask.
double pattern_scores(const Problem& p, const SparsePattern& pat, int64_t b, int64_t h);

}  // namespace attnbench
