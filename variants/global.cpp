// global: a set G of global token positions and nothing else. Global queries attend every
// key; every query attends the global keys; no other pair is attended:
//
//   P(i) = all keys                if a(i) in G
//        = G                       otherwise
//
// G is the first `global` positions, or the explicit list `positions` if given (it overrides
// `global`). Positions index KEYS (0 <= j < m; larger ones are dropped). Queries are matched
// to key positions by the bottom-right alignment of the causal mask, a(i) = i + (m - n): query
// i is global iff a(i) is in G (so with m == n, query i is global iff i is in G; when
// decoding n = 1 against m keys the query is global only if m - 1 is). Causal masking is
// applied by the engine (a global query then attends keys j <= a(i)).
// Time O(n |G| d + |G| m d) scored pairs (tiles of `block` around each global position);
// memory O(threads block (block + d)) plus the run list of G (16 bytes per run of
// consecutive positions).
// Decode (generation): the pattern cache of common/decode/pattern_decode.h (the blocks of global
// keys, and every block while global queries lie ahead). Paper: Beltagy, Peters, Cohan,
// "Longformer" (2020), global attention; Zaheer et al., "Big Bird" (2020), global tokens (ITC);
// Ainslie et al., "ETC" (2020).
#include <algorithm>
#include <iterator>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "common/decode/pattern_decode.h"
#include "common/engines/block_sparse.h"

namespace attnbench {
namespace {

/// A set of positions stored as sorted, disjoint, non-touching runs [lo, hi).
class PositionSet {
 public:
  void add_run(int64_t lo, int64_t hi) {
    if (lo >= hi) return;
    if (!runs_.empty() && runs_.back().hi >= lo)
      runs_.back().hi = std::max(runs_.back().hi, hi);
    else
      runs_.push_back({lo, hi});
  }
  /// Smallest position >= x, or max int64 if none.
  int64_t next(int64_t x) const {
    auto it = std::upper_bound(runs_.begin(), runs_.end(), x,
                               [](int64_t v, const Run& r) { return v < r.lo; });
    if (it != runs_.begin() && std::prev(it)->hi > x) return x;
    return it == runs_.end() ? std::numeric_limits<int64_t>::max() : it->lo;
  }
  bool contains(int64_t x) const { return next(x) == x; }
  /// Every position of [lo, hi] (inclusive) in the set? True for an empty range.
  bool covers(int64_t lo, int64_t hi) const {
    if (lo > hi) return true;
    auto it = std::upper_bound(runs_.begin(), runs_.end(), lo,
                               [](int64_t v, const Run& r) { return v < r.lo; });
    return it != runs_.begin() && std::prev(it)->hi > hi;
  }
  /// Some position of [lo, hi] in the set?
  bool meets(int64_t lo, int64_t hi) const { return lo <= hi && next(lo) <= hi; }
  double bytes() const { return double(runs_.capacity() * sizeof(Run)); }

 private:
  struct Run {
    int64_t lo, hi;
  };
  std::vector<Run> runs_;
};

class GlobalPattern final : public AlignedBlockPattern {
 public:
  GlobalPattern(int64_t n, int64_t m, PositionSet g, int64_t block)
      : AlignedBlockPattern(n, m, block), g_(std::move(g)) {}

  void aligned_key_blocks(int64_t a0, int64_t a1, std::vector<KeyBlock>& out) const override {
    const bool all_rows = a0 >= 0 && g_.covers(a0, a1);
    if (g_.meets(std::max<int64_t>(a0, 0), a1)) {
      // a global row attends every key block
      for (int64_t kb = 0; kb * bs_ < m_; ++kb) {
        const int64_t j0 = kb * bs_, j1 = std::min(m_, j0 + bs_) - 1;
        out.push_back({kb, !(all_rows || g_.covers(j0, j1))});
      }
      return;
    }
    // no global row: the blocks holding global keys, jumping from one to the next
    for (int64_t j = g_.next(0); j < m_; j = g_.next((j / bs_ + 1) * bs_)) {
      const int64_t kb = j / bs_, j0 = kb * bs_, j1 = std::min(m_, j0 + bs_) - 1;
      out.push_back({kb, !g_.covers(j0, j1)});
    }
  }

  void block_mask(int64_t, int64_t, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    const uint8_t* plain = nullptr;  // the first non-global row: the global key columns
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* row = mask + r * cols;
      if (g_.contains(i0 + r + off_)) {
        std::fill(row, row + cols, uint8_t(1));
      } else if (plain) {
        std::copy(plain, plain + cols, row);
      } else {
        for (int64_t c = 0; c < cols; ++c) row[c] = g_.contains(j0 + c);
        plain = row;
      }
    }
  }

  double bytes() const override { return g_.bytes(); }

 private:
  PositionSet g_;
};

class Global final : public FixedPatternVariant {
 public:
  Global(int64_t global, std::vector<int64_t> positions, int64_t block)
      : global_(global), positions_(std::move(positions)), block_(block) {}

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView,
                                              ConstTensorView) const override {
    const int64_t m = p.keys();
    PositionSet g;
    if (positions_.empty()) {
      g.add_run(0, std::min(global_, m));
    } else {
      for (int64_t x : positions_)  // sorted and unique (the registry canonicalises lists)
        if (x < m) g.add_run(x, x + 1);
    }
    return std::make_unique<GlobalPattern>(p.n, m, std::move(g), block_);
  }

 private:
  int64_t global_;
  std::vector<int64_t> positions_;
  int64_t block_;
};

ATTNBENCH_REGISTER_VARIANT(
    global,
    VariantInfo{
        .name = "global",
        .summary = "global tokens only: global queries see every key, every query sees the "
                   "global keys",
        .complexity = "time O((n g + g m) d), memory O(threads block (block + d))",
        .family = "pattern",
        .display = "Global tokens",
        .paper = "Ainslie et al. 2020 (arXiv:2004.08483)",
        .look = {.color = "#393b79", .marker = "D"},
        .params = {ParamSpec::Int("global", 64, 0, int64_t(1) << 30,
                                  "number of global tokens: the first g positions"),
                   ParamSpec::IntList("positions", "none", 0, int64_t(1) << 30,
                                      "explicit global key positions (override global); query i "
                                      "is global iff i + m - n is one"),
                   block_param()},
        .caps = {.causal = true,
                 .cross = true,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true,
                 .bf16 = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<Global>(v.get_int("global"), v.get_int_list("positions"),
                                          v.get_int("block"));
        }});

}  // namespace
}  // namespace attnbench
