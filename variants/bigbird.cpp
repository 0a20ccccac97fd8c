// bigbird (ITC): block-sparse attention on blocks of b = `block` positions. With nb blocks
// (query block qb = positions [qb b, (qb + 1) b), the last one ragged), W = window_blocks,
// G = global_blocks and r = random_blocks:
//
//   global blocks:  the first ceil(G/2) and the last floor(G/2) blocks (G = 2: first and last)
//   window of qb:   blocks qb - floor((W-1)/2) .. qb + floor(W/2)   (W = 3: qb-1, qb, qb+1)
//   random of qb:   r distinct blocks drawn uniformly, per (head, query block), among those
//                   outside the window and the global blocks (all of them if fewer than r)
//
// A global query block attends every key block; any other query block attends the global
// blocks, its window and its random blocks, every pair of those tiles. About (W + G + r) b
// keys per query. The random blocks come from the problem's seed through a stream keyed by
// (head, query block) only, so a head's pattern does not depend on the number of heads, and
// every batch item shares it (as the HF code does). Causal masking is applied by the engine
// inside the pattern (random blocks past the query are then hidden, not redrawn).
// Self-attention only: m != n is refused (caps.cross = false).
// Time O(n (W + G + r) b d + G b n d); memory O(threads block (block + d)) plus the random
// table (8 H nb r bytes).
// Decode (generation): the pattern cache of common/decode/pattern_decode.h. The last global blocks
// and the random draws are those of the problem's n (the decode capacity), so the steps equal the
// causal forward on those n tokens.
// Paper: Zaheer et al., "Big Bird: Transformers for Longer Sequences" (NeurIPS 2020); block
// size 64 and r = 3 as in the HF implementation.
#include <algorithm>
#include <array>
#include <memory>
#include <utility>
#include <vector>

#include "common/core/random.h"
#include "common/decode/pattern_decode.h"
#include "common/engines/block_sparse.h"

namespace attnbench {
namespace {

constexpr uint64_t kRandomBlockStream = 0x62696762697264ULL;  // "bigbird"

class BigBirdPattern final : public SparsePattern {
 public:
  BigBirdPattern(int64_t n, int64_t m, int64_t block, int64_t window_blocks, int64_t random_blocks,
                 int64_t global_blocks, int64_t heads, uint64_t seed)
      : bs_(block),
        nbq_((n + block - 1) / block),
        nbk_((m + block - 1) / block),
        wlo_(window_blocks > 0 ? (window_blocks - 1) / 2 : 0),
        whi_(window_blocks / 2),
        has_window_(window_blocks > 0),
        gfirst_((global_blocks + 1) / 2),
        glast_(global_blocks / 2),
        r_(std::min(random_blocks, nbk_)),  // more than nbk_ random blocks cannot exist
        heads_(heads) {
    // the random key blocks of every (head, query block), drawn once, sorted
    random_.assign(size_t(heads_ * nbq_ * r_), 0);
    count_.assign(size_t(heads_ * nbq_), 0);
    std::vector<int64_t> pick;
    for (int64_t h = 0; h < heads_; ++h)
      for (int64_t qb = 0; qb < nbq_; ++qb) {
        if (global_query(qb) || r_ == 0) continue;
        draw(seed, h, qb, pick);
        std::copy(pick.begin(), pick.end(), random_.begin() + (h * nbq_ + qb) * r_);
        count_[size_t(h * nbq_ + qb)] = int32_t(pick.size());
      }
  }

  int64_t block() const override { return bs_; }

  void key_blocks(int64_t, int64_t h, int64_t qb, std::vector<KeyBlock>& out) const override {
    out.clear();
    if (qb < 0 || qb >= nbq_) return;
    if (global_query(qb)) {
      for (int64_t kb = 0; kb < nbk_; ++kb) out.push_back({kb, false});
      return;
    }
    // whole tiles: never partial. The fixed ranges are sorted and disjoint, and the random
    // blocks (sorted) lie outside them: merge the two sorted lists.
    const Ranges fixed = excluded(qb);
    const int64_t* rnd = random_row(h, qb);
    const int64_t* rnd_end = rnd + count(h, qb);
    for (int e = 0; e < fixed.count; ++e) {
      for (; rnd != rnd_end && *rnd < fixed.r[size_t(e)].first; ++rnd) out.push_back({*rnd, false});
      for (int64_t kb = fixed.r[size_t(e)].first; kb < fixed.r[size_t(e)].second; ++kb)
        out.push_back({kb, false});
    }
    for (; rnd != rnd_end; ++rnd) out.push_back({*rnd, false});
  }

  void block_mask(int64_t, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qb = (i0 + r) / bs_;
      for (int64_t c = 0; c < cols; ++c) mask[r * cols + c] = allowed(h, qb, (j0 + c) / bs_);
    }
  }

  double bytes() const override {
    return double(random_.capacity() * sizeof(int64_t) + count_.capacity() * sizeof(int32_t));
  }

 private:
  bool global_query(int64_t qb) const { return qb < gfirst_ || qb >= nbq_ - glast_; }
  bool global_key(int64_t kb) const { return kb < gfirst_ || kb >= nbk_ - glast_; }
  bool in_window(int64_t qb, int64_t kb) const {
    return has_window_ && kb >= qb - wlo_ && kb <= qb + whi_;
  }
  const int64_t* random_row(int64_t h, int64_t qb) const {
    return h >= 0 && h < heads_ ? random_.data() + (h * nbq_ + qb) * r_ : random_.data();
  }
  int64_t count(int64_t h, int64_t qb) const {
    return h >= 0 && h < heads_ ? count_[size_t(h * nbq_ + qb)] : 0;
  }

  bool allowed(int64_t h, int64_t qb, int64_t kb) const {
    if (qb >= nbq_ || kb >= nbk_) return false;
    if (global_query(qb) || global_key(kb) || in_window(qb, kb)) return true;
    const int64_t* rnd = random_row(h, qb);
    return std::binary_search(rnd, rnd + count(h, qb), kb);
  }

  // Up to three sorted, disjoint half-open ranges of key blocks.
  struct Ranges {
    std::array<std::pair<int64_t, int64_t>, 3> r;
    int count = 0;
  };

  // Key blocks a non-global query block attends besides its random ones, as sorted, merged
  // half-open ranges: the first global blocks, the window, the last global blocks.
  Ranges excluded(int64_t qb) const {
    std::array<std::pair<int64_t, int64_t>, 3> raw = {
        std::pair<int64_t, int64_t>{0, std::min(gfirst_, nbk_)},
        {has_window_ ? std::clamp<int64_t>(qb - wlo_, 0, nbk_) : 0,
         has_window_ ? std::clamp<int64_t>(qb + whi_ + 1, 0, nbk_) : 0},
        {std::max<int64_t>(nbk_ - glast_, 0), nbk_}};
    std::sort(raw.begin(), raw.end());
    Ranges merged;
    for (auto [lo, hi] : raw) {
      if (lo >= hi) continue;
      if (merged.count > 0 && lo <= merged.r[size_t(merged.count - 1)].second)
        merged.r[size_t(merged.count - 1)].second =
            std::max(merged.r[size_t(merged.count - 1)].second, hi);
      else
        merged.r[size_t(merged.count++)] = {lo, hi};
    }
    return merged;
  }

  // r random key blocks for (h, qb) outside `excluded(qb)`, sorted; every candidate if there
  // are at most r. Floyd's algorithm picks r distinct candidate indices in O(r^2) worst case.
  void draw(uint64_t seed, int64_t h, int64_t qb, std::vector<int64_t>& pick) const {
    pick.clear();
    const Ranges ex = excluded(qb);
    int64_t candidates = nbk_;
    for (int e = 0; e < ex.count; ++e) candidates -= ex.r[size_t(e)].second - ex.r[size_t(e)].first;
    if (candidates <= r_) {
      for (int64_t k = 0; k < candidates; ++k) pick.push_back(k);
    } else {
      const RandomStream rs(seed, mix64(mix64(kRandomBlockStream + uint64_t(h)) + uint64_t(qb)));
      uint64_t draw_index = 0;
      for (int64_t top = candidates - r_; top < candidates; ++top) {
        const int64_t t = int64_t(rs.below(draw_index++, uint64_t(top + 1)));
        auto it = std::lower_bound(pick.begin(), pick.end(), t);
        if (it != pick.end() && *it == t)
          pick.insert(std::upper_bound(pick.begin(), pick.end(), top), top);
        else
          pick.insert(it, t);
      }
    }
    // candidate index -> block number, skipping the excluded ranges (indices are sorted)
    int e = 0;
    int64_t skipped = 0;
    for (int64_t& k : pick) {
      for (; e < ex.count && ex.r[size_t(e)].first <= k + skipped; ++e)
        skipped += ex.r[size_t(e)].second - ex.r[size_t(e)].first;
      k += skipped;
    }
  }

  int64_t bs_, nbq_, nbk_, wlo_, whi_;
  bool has_window_;
  int64_t gfirst_, glast_, r_, heads_;
  std::vector<int64_t> random_;  ///< [heads][nbq][r] sorted random key blocks
  std::vector<int32_t> count_;   ///< [heads][nbq] how many of the r slots are used
};

class BigBird final : public FixedPatternVariant {
 public:
  BigBird(int64_t block, int64_t window_blocks, int64_t random_blocks, int64_t global_blocks)
      : block_(block), window_(window_blocks), random_(random_blocks), global_(global_blocks) {}

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView,
                                              ConstTensorView) const override {
    // m != n is refused by the capabilities; the pattern still exists (blocks by index) so
    // flops and memory estimates of such a problem can be computed
    return std::make_unique<BigBirdPattern>(p.n, p.keys(), block_, window_, random_, global_,
                                            p.heads, p.seed);
  }

 private:
  int64_t block_, window_, random_, global_;
};

ATTNBENCH_REGISTER_VARIANT(
    bigbird,
    VariantInfo{
        .name = "bigbird",
        .summary = "BigBird ITC: blocks of a window, global first/last blocks and r random "
                   "blocks per (head, query block)",
        .complexity = "time O(n (window_blocks + global_blocks + random_blocks) block d), "
                      "memory O(threads block (block + d) + H (n / block) random_blocks)",
        .family = "pattern",
        .display = "BigBird",
        .paper = "Zaheer et al. 2020 (arXiv:2007.14062)",
        .look = {.color = "#637939", .marker = "X"},
        .params =
            {block_param(),
             ParamSpec::Int("window_blocks", 3, 0, int64_t(1) << 20,
                            "W blocks around the query block: qb-floor((W-1)/2) .. qb+floor(W/2)"),
             ParamSpec::Int("random_blocks", 3, 0, 4096,
                            "random key blocks per (head, query block), outside window and global"),
             ParamSpec::Int("global_blocks", 2, 0, int64_t(1) << 20,
                            "global blocks: the first ceil(G/2) and the last floor(G/2)")},
        .caps = {.causal = true,
                 .cross = false,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true,
                 .bf16 = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<BigBird>(v.get_int("block"), v.get_int("window_blocks"),
                                           v.get_int("random_blocks"), v.get_int("global_blocks"));
        }});

}  // namespace
}  // namespace attnbench
