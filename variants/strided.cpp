// strided: dilated attention. Query i attends every stride-th key counted from its aligned
// position a(i) = i + (m - n) (bottom-right aligned, like the causal mask), before and after
// it, optionally only within `span` positions:
//
//   P(i) = { j : (a(i) - j) mod stride == 0  and  (span == 0 or |a(i) - j| <= span) }
//
// with the mathematical mod (negative differences work: j after a(i) too). Causal masking is
// applied by the engine (j <= a(i)). stride = 1 with span = 0 is full attention.
// Time: about m / stride keys per row (2 span / stride + 1 with a span), but the
// block-sparse engine scores whole tiles, and a block x block tile holds 2 block - 1
// consecutive differences a(i) - j: with stride < 2 block every tile holds an allowed pair,
// so the work is O(n m d) (plus masking) as for full attention; with stride >= 2 block it is
// about O(n (m / stride) 2 block d). Pick block <= stride / 2 for a saving. Memory
// O(threads block (block + d)); the pattern holds nothing.
// Paper: Child, Gray, Radford, Sutskever, "Generating Long Sequences with Sparse
// Transformers" (2019), the stride head; dilated windows in Beltagy et al. 2020.
#include <algorithm>
#include <cstdlib>
#include <memory>

#include "common/block_sparse.h"

namespace attnbench {
namespace {

class StridedPattern final : public AlignedBlockPattern {
 public:
  StridedPattern(int64_t n, int64_t m, int64_t stride, int64_t span, int64_t block)
      : AlignedBlockPattern(n, m, block), s_(stride), span_(span) {}

  void aligned_key_blocks(int64_t a0, int64_t a1, std::vector<KeyBlock>& out) const override {
    // Row a attends j = a - t stride. The t whose keys [a0 - t s, a1 - t s] meet [0, m):
    int64_t tlo = ceil_div(a0 - (m_ - 1), s_), thi = floor_div(a1, s_);
    if (span_ > 0) {  // |t s| <= span
      tlo = std::max(tlo, -(span_ / s_));
      thi = std::min(thi, span_ / s_);
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

  void block_mask(int64_t, int64_t, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = i0 + r + off_;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t x = a - (j0 + c);
        mask[r * cols + c] = pmod(x, s_) == 0 && (span_ == 0 || std::llabs(x) <= span_);
      }
    }
  }

 private:
  // Appends the key blocks of keys [lo, hi] not yet listed (ranges come in increasing order).
  void add_range(int64_t a0, int64_t a1, int64_t lo, int64_t hi, std::vector<KeyBlock>& out) const {
    if (lo > hi) return;
    int64_t kb = lo / bs_;
    if (!out.empty()) kb = std::max(kb, out.back().index + 1);
    for (; kb <= hi / bs_; ++kb) {
      const int64_t j0 = kb * bs_, j1 = std::min(m_, j0 + bs_) - 1;
      // the tile's differences a - j fill [xlo, xhi]; all allowed only if each is a multiple
      // of the stride (so stride 1, or a single difference) and within the span
      const int64_t xlo = a0 - j1, xhi = a1 - j0;
      const bool full = (s_ == 1 || (xlo == xhi && pmod(xlo, s_) == 0)) &&
                        (span_ == 0 || (xlo >= -span_ && xhi <= span_));
      out.push_back({kb, !full});
    }
  }

  int64_t s_, span_;
};

class Strided final : public PatternVariant {
 public:
  Strided(int64_t stride, int64_t span, int64_t block)
      : stride_(stride), span_(span), block_(block) {}

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView,
                                              ConstTensorView) const override {
    return std::make_unique<StridedPattern>(p.n, p.keys(), stride_, span_, block_);
  }

 private:
  int64_t stride_, span_, block_;
};

ATTNBENCH_REGISTER_VARIANT(
    strided,
    VariantInfo{
        .name = "strided",
        .summary = "dilated: query i sees keys with (a(i) - j) mod stride == 0, optionally |a(i) - "
                   "j| <= span",
        .complexity = "time O(n (m / stride) 2 block d) scored, O(n m d) when stride < 2 block; "
                      "memory O(threads block (block + d))",
        .params = {ParamSpec::Int("stride", 128, 1, int64_t(1) << 30,
                                  "distance between attended keys (Sparse Transformer's l)"),
                   ParamSpec::Int("span", 0, 0, int64_t(1) << 30,
                                  "only keys with |a(i) - j| <= span (one side); 0 = unlimited"),
                   block_param()},
        .caps = {.causal = true,
                 .cross = true,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<Strided>(v.get_int("stride"), v.get_int("span"),
                                           v.get_int("block"));
        }});

}  // namespace
}  // namespace attnbench
