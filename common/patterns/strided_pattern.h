// The dilated pattern on aligned positions a(i) = i + (m - n) (bottom-right aligned, like the
// causal mask), as a block pattern for the block-sparse engine:
//
//   P(i) = { j : (a(i) - j) mod stride == 0  and  |a(i) - j| <= limit  and  |a(i) - j| >= gap }
//
// with the mathematical mod (keys after a(i) count too), limit < 0 meaning no limit and gap 0
// no gap. stride 1 with a limit is a band (a sliding window on both sides); gap 1 leaves out
// the query's own position. `strided` exports it as its pattern; the reshape of
// common/engines/strided_attention.h runs the band (stride 1) inside each residue class, and
// `sparse_transformer` runs its band part (stride 1, gap 1) on the engine.
//
// A block x block tile holds 2 block - 1 consecutive differences a(i) - j: with stride
// < 2 block every tile holds an allowed pair, so the engine would score O(n m) pairs for what
// is only about n m / stride; that is why `strided` runs the reshape instead.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "common/patterns/pattern.h"

namespace attnbench {

class StridedPattern final : public AlignedBlockPattern {
 public:
  StridedPattern(int64_t n, int64_t m, int64_t stride, int64_t limit, int64_t gap, int64_t block)
      : AlignedBlockPattern(n, m, block), s_(stride), limit_(limit), gap_(gap) {}

  void aligned_key_blocks(int64_t a0, int64_t a1, std::vector<KeyBlock>& out) const override {
    if (limit_ >= 0 && limit_ < gap_) return;  // nothing is both near enough and far enough
    // Row a attends j = a - t stride. The t whose keys [a0 - t s, a1 - t s] meet [0, m):
    int64_t tlo = ceil_div(a0 - (m_ - 1), s_), thi = floor_div(a1, s_);
    if (limit_ >= 0) {  // |t s| <= limit
      tlo = std::max(tlo, -(limit_ / s_));
      thi = std::min(thi, limit_ / s_);
    }
    if (tlo > thi) return;
    if (a1 - a0 + 1 >= s_) {
      // the rows hold every residue: consecutive intervals touch, their union is one range
      add_range(a0, a1, std::max<int64_t>(0, a0 - thi * s_), std::min(m_ - 1, a1 - tlo * s_), out);
    } else {
      for (int64_t t = thi; t >= tlo; --t)  // increasing keys
        add_range(a0, a1, std::max<int64_t>(0, a0 - t * s_), std::min(m_ - 1, a1 - t * s_), out);
    }
  }

  // Row by row, as ranges: key c of the tile has difference x = x0 - c (x0 = a - j0), so the
  // limit keeps c in [x0 - limit, x0 + limit], the gap leaves out (x0 - gap, x0 + gap), and
  // the stride keeps c = x0 mod stride.
  void block_mask(int64_t, int64_t, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* row = mask + r * cols;
      std::fill(row, row + cols, uint8_t(0));
      const int64_t x0 = i0 + r + off_ - j0;
      int64_t lo = 0, hi = cols - 1;
      if (limit_ >= 0) lo = std::max(lo, x0 - limit_), hi = std::min(hi, x0 + limit_);
      auto keep = [&](int64_t from, int64_t to) {  // the c of [from, to] on the stride
        from = std::max(from, lo), to = std::min(to, hi);
        if (from > to) return;
        if (s_ == 1) {
          std::fill(row + from, row + to + 1, uint8_t(1));
          return;
        }
        for (int64_t c = from + pmod(x0 - from, s_); c <= to; c += s_) row[c] = 1;
      };
      if (gap_ == 0) {
        keep(lo, hi);
      } else {
        keep(lo, x0 - gap_);
        keep(x0 + gap_, hi);
      }
    }
  }

 private:
  bool allowed(int64_t x) const {
    const int64_t ax = std::llabs(x);
    return pmod(x, s_) == 0 && (limit_ < 0 || ax <= limit_) && ax >= gap_;
  }

  // Appends the key blocks of keys [lo, hi] not yet listed (ranges come in increasing order).
  void add_range(int64_t a0, int64_t a1, int64_t lo, int64_t hi, std::vector<KeyBlock>& out) const {
    if (lo > hi) return;
    int64_t kb = lo / bs_;
    if (!out.empty()) kb = std::max(kb, out.back().index + 1);
    for (; kb <= hi / bs_; ++kb) {
      const int64_t j0 = kb * bs_, j1 = std::min(m_, j0 + bs_) - 1;
      // the tile's differences a - j fill [xlo, xhi]; all allowed only if each is a multiple
      // of the stride (so stride 1, or a single difference), within the limit and outside the
      // gap
      const int64_t xlo = a0 - j1, xhi = a1 - j0;
      if (xlo == xhi && !allowed(xlo)) continue;  // a single pair, left out
      const bool full = (s_ == 1 || (xlo == xhi && pmod(xlo, s_) == 0)) &&
                        (limit_ < 0 || (xlo >= -limit_ && xhi <= limit_)) &&
                        (gap_ == 0 || xlo >= gap_ || xhi <= -gap_);
      out.push_back({kb, !full});
    }
  }

  int64_t s_, limit_, gap_;
};

}  // namespace attnbench
