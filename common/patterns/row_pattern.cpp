#include "common/patterns/row_pattern.h"

#include <algorithm>

namespace attnbench {

void RowKeysPattern::key_blocks(int64_t b, int64_t h, int64_t qb,
                                std::vector<KeyBlock>& out) const {
  out.clear();
  const int64_t i0 = qb * bs_, rows = std::min(bs_, n_ - i0), nbk = (m_ + bs_ - 1) / bs_;
  if (rows <= 0) return;
  std::vector<int64_t> pairs(size_t(nbk), 0), keys;
  for (int64_t r = 0; r < rows; ++r) {
    row_keys(b, h, i0 + r, keys);
    for (int64_t j : keys) ++pairs[size_t(j / bs_)];
  }
  for (int64_t kb = 0; kb < nbk; ++kb) {
    if (pairs[size_t(kb)] == 0) continue;
    const int64_t cols = std::min(bs_, m_ - kb * bs_);
    out.push_back({kb, pairs[size_t(kb)] != rows * cols});
  }
}

void RowKeysPattern::block_mask(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                                int64_t cols, uint8_t* mask) const {
  std::fill(mask, mask + rows * cols, uint8_t(0));
  std::vector<int64_t> keys;
  for (int64_t r = 0; r < rows; ++r) {
    row_keys(b, h, i0 + r, keys);
    auto it = std::lower_bound(keys.begin(), keys.end(), j0);
    for (; it != keys.end() && *it < j0 + cols; ++it) mask[r * cols + (*it - j0)] = 1;
  }
}

void RowKeysPattern::row_mask(int64_t b, int64_t h, int64_t i, int64_t m, uint8_t* row) const {
  std::fill(row, row + m, uint8_t(0));
  std::vector<int64_t> keys;
  row_keys(b, h, i, keys);
  for (int64_t j : keys) row[j] = 1;
}

GroupPattern::GroupPattern(const Problem& p, bool self_rule, int64_t block)
    : RowKeysPattern(p.n, p.keys(), block), p_(p), self_rule_(self_rule) {
  heads_.reserve(size_t(p.batch * p.heads));
}

void GroupPattern::begin_head() { heads_.emplace_back(); }

int32_t GroupPattern::add_group(const int32_t* keys, int64_t count) {
  Head& hd = heads_.back();
  hd.keys.insert(hd.keys.end(), keys, keys + count);
  hd.group_start.push_back(int64_t(hd.keys.size()));
  return int32_t(hd.group_start.size() - 2);
}

void GroupPattern::add_membership(int64_t i, int32_t g) {
  heads_.back().pending.emplace_back(int32_t(i), g);
}

void GroupPattern::finish_head() {
  Head& hd = heads_.back();
  hd.row_start.assign(size_t(n_ + 1), 0);
  for (auto [i, g] : hd.pending) ++hd.row_start[size_t(i) + 1];
  for (int64_t i = 0; i < n_; ++i) hd.row_start[size_t(i + 1)] += hd.row_start[size_t(i)];
  hd.groups.resize(hd.pending.size());
  std::vector<int64_t> fill(hd.row_start.begin(), hd.row_start.end() - 1);
  for (auto [i, g] : hd.pending) hd.groups[size_t(fill[size_t(i)]++)] = g;
  hd.pending.clear();
  hd.pending.shrink_to_fit();
}

void GroupPattern::row_keys(int64_t b, int64_t h, int64_t i, std::vector<int64_t>& keys) const {
  const Head& hd = heads_[size_t(b * p_.heads + h)];
  keys.clear();
  for (int64_t t = hd.row_start[size_t(i)]; t < hd.row_start[size_t(i + 1)]; ++t) {
    const int32_t g = hd.groups[size_t(t)];
    for (int64_t e = hd.group_start[size_t(g)]; e < hd.group_start[size_t(g) + 1]; ++e)
      keys.push_back(hd.keys[size_t(e)]);
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  if (!self_rule_) return;
  // the shared-QK rule: itself only when nothing else it may see is in the union (and
  // nothing for a padded position: it is no key, not even its own)
  const int64_t visible = p_.visible(b, i);
  const bool other =
      std::any_of(keys.begin(), keys.end(), [&](int64_t j) { return j != i && j < visible; });
  if (other) {
    keys.erase(std::remove(keys.begin(), keys.end(), i), keys.end());
  } else if (i < visible) {
    keys.assign(1, i);
  } else {
    keys.clear();
  }
}

double GroupPattern::bytes() const {
  double total = 0;
  for (const Head& hd : heads_)
    total += 8.0 * double(hd.group_start.size() + hd.row_start.size()) +
             4.0 * double(hd.keys.size() + hd.groups.size());
  return total;
}

}  // namespace attnbench
