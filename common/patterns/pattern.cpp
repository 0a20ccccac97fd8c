#include "common/patterns/pattern.h"

#include <algorithm>

namespace attnbench {

void SparsePattern::row_mask(int64_t b, int64_t h, int64_t i, int64_t m, uint8_t* row) const {
  const int64_t bs = block();
  std::fill(row, row + m, uint8_t(0));
  std::vector<KeyBlock> blocks;
  key_blocks(b, h, i / bs, blocks);
  for (const KeyBlock& kb : blocks) {
    const int64_t j0 = kb.index * bs, cols = std::min(bs, m - j0);
    if (cols <= 0) continue;
    if (kb.partial)
      block_mask(b, h, i, 1, j0, cols, row + j0);
    else
      std::fill(row + j0, row + j0 + cols, uint8_t(1));
  }
}

void pattern_row(const Problem& p, const SparsePattern& pat, int64_t b, int64_t h, int64_t i,
                 uint8_t* row) {
  const int64_t m = p.keys();
  pat.row_mask(b, h, i, m, row);
  std::fill(row + p.visible(i), row + m, uint8_t(0));
}

double pattern_pairs(const Problem& p, const SparsePattern& pat, int64_t b, int64_t h) {
  std::vector<uint8_t> row(size_t(p.keys()));
  double total = 0;
  for (int64_t i = 0; i < p.n; ++i) {
    pattern_row(p, pat, b, h, i, row.data());
    for (uint8_t x : row) total += x;
  }
  return total;
}

double pattern_scores(const Problem& p, const SparsePattern& pat, int64_t b, int64_t h) {
  const int64_t n = p.n, m = p.keys(), bs = pat.block();
  std::vector<KeyBlock> blocks;
  double total = 0;
  for (int64_t qb = 0; qb * bs < n; ++qb) {
    const int64_t rows = std::min(bs, n - qb * bs);
    const int64_t kend = p.visible(qb * bs + rows - 1);  // keys visible to the block's last row
    pat.key_blocks(b, h, qb, blocks);
    for (const KeyBlock& kb : blocks) {
      const int64_t j0 = kb.index * bs;
      if (j0 >= kend) continue;
      total += double(rows) * double(std::min(bs, m - j0));
    }
  }
  return total;
}

}  // namespace attnbench
