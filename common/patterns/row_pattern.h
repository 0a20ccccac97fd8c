// Data-dependent patterns given row by row: the keys each query attends, chosen from the
// inputs (hash buckets, clusters, top-k keys). Variants that pick keys this way run their
// own kernels; the pattern is what they report: `attnbench pattern` exports it and the
// harness's mass column measures it. RowKeysPattern turns a row_keys() rule into the block
// interface of SparsePattern; GroupPattern is the common case where rows join groups (a
// hash chunk, a cluster) and a row attends the union of its groups' keys.
#pragma once

#include <cstdint>
#include <vector>

#include "common/core/problem.h"
#include "common/patterns/pattern.h"

namespace attnbench {

/// A pattern stated row by row. The block interface (key_blocks, block_mask) is derived from
/// row_keys(): a key block is listed when some row of the query block attends a key in it,
/// and marked full only when every (row, key) pair of the tile is attended.
class RowKeysPattern : public SparsePattern {
 public:
  RowKeysPattern(int64_t n, int64_t m, int64_t block = 64) : n_(n), m_(m), bs_(block) {}

  /// Keys query i of head (b, h) attends, ascending, without duplicates (before the causal
  /// mask, which consumers apply).
  virtual void row_keys(int64_t b, int64_t h, int64_t i, std::vector<int64_t>& keys) const = 0;

  int64_t block() const override { return bs_; }
  void key_blocks(int64_t b, int64_t h, int64_t qb, std::vector<KeyBlock>& out) const override;
  void block_mask(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override;
  void row_mask(int64_t b, int64_t h, int64_t i, int64_t m, uint8_t* row) const override;

 protected:
  int64_t n_, m_, bs_;
};

/// Rows join groups; each group has a key list; row i attends the union of the keys of its
/// groups. Filled head by head with add_group / add_membership, then finish_head().
///
/// With self_rule set (Reformer's shared-QK rule, self-attention only), a row never attends
/// its own position unless nothing else of its union is visible to it; then it attends itself
/// only (or nothing, if its own position is not visible to it: a padded key).
class GroupPattern final : public RowKeysPattern {
 public:
  GroupPattern(const Problem& p, bool self_rule = false, int64_t block = 64);

  /// Starts head (b, h); heads must be filled in order b * H + h.
  void begin_head();
  /// Adds a group with the given keys (any order, duplicates allowed); returns its index in
  /// the current head.
  int32_t add_group(const int32_t* keys, int64_t count);
  /// Query i (of the current head) belongs to group g.
  void add_membership(int64_t i, int32_t g);
  /// Ends the current head (builds the row -> group index).
  void finish_head();

  void row_keys(int64_t b, int64_t h, int64_t i, std::vector<int64_t>& keys) const override;
  double bytes() const override;

 private:
  struct Head {
    std::vector<int64_t> group_start{0};  // group g: keys[group_start[g] .. group_start[g+1])
    std::vector<int32_t> keys;
    std::vector<std::pair<int32_t, int32_t>> pending;  // (row, group) while filling
    std::vector<int64_t> row_start;  // row i: groups[row_start[i] .. row_start[i+1])
    std::vector<int32_t> groups;
  };
  Problem p_;
  bool self_rule_;
  std::vector<Head> heads_;
};

}  // namespace attnbench
