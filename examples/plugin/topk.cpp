// topk: exact top-k attention. Each query attends, with an exact softmax, only the k keys of
// largest logit among the keys it may see:
//
//   s_ij = q_i . k_j / sqrt(d)  for the visible keys j < p.visible(i)
//   T(i) = the min(k, visible) visible keys of largest s_ij
//   out_i = sum_{j in T(i)} softmax_j(s_ij) v_j
//
// Ties: keys are ranked by logit, and among equal logits the lower key index ranks first, so
// T(i) is always well defined. With k >= the number of visible keys this is exact attention.
//
// Time O(B H n m d) for the logits plus O(B H n m) for the selection (expected, by
// std::nth_element) and O(B H n k d) for the output; memory O(threads m) for one row of
// logits and one row of key indices per thread. The selection needs every logit, so top-k
// saves only the work of the output, not of the scores.
//
// Papers: Gupta et al., "Memory-efficient Transformers via Top-k Attention" (2021); also
// Wang et al., "KVT: k-NN Attention for Boosting Vision Transformers" (2022).
//
// This file is a complete out-of-tree variant: it uses only the installed attnbench headers,
// and CMakeLists.txt builds it with attnbench_add_plugin.
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <vector>

#include "common/core/error.h"
#include "common/core/parallel_for.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/patterns/pattern.h"

namespace topk {

using attnbench::ConstTensorView;
using attnbench::Problem;

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRows = Eigen::Map<const RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;

// Per-thread working memory: the logits of one query row and the key indices being ranked.
struct Scratch {
  std::vector<float> logits;
  std::vector<int32_t> keys;
  explicit Scratch(int64_t m) : logits(size_t(m)), keys(size_t(m)) {}
};

// Query row i of head (b, h): computes its logits (unscaled, q_i . k_j) into s.logits and
// leaves the keys it attends in s.keys[0, count), in increasing key order. Returns count.
// forward() and the pattern both call this, so the pattern is exactly what forward uses.
int64_t select_keys(const Problem& p, ConstTensorView q, ConstTensorView k, int64_t b, int64_t h,
                    int64_t i, int64_t top_k, Scratch& s) {
  const int64_t visible = p.visible(i), d = p.dim;
  if (visible == 0) return 0;

  // pass 1: logits of the visible keys, one matrix-vector product
  ConstRows keys(k.head(b, h), visible, d, Eigen::OuterStride<>(k.stride_row));
  Eigen::Map<const Eigen::VectorXf> query(q.row(b, h, i), d);
  Eigen::Map<Eigen::VectorXf> logits(s.logits.data(), visible);
  logits.noalias() = keys * query;

  // pass 2: the top_k best keys. "Better" is a strict total order (larger logit, then lower
  // index), so the selected set is deterministic even with ties.
  const int64_t count = std::min(top_k, visible);
  std::iota(s.keys.begin(), s.keys.begin() + visible, 0);
  if (count < visible) {
    const float* l = s.logits.data();
    auto better = [l](int32_t a, int32_t c) { return l[a] > l[c] || (l[a] == l[c] && a < c); };
    std::nth_element(s.keys.begin(), s.keys.begin() + count, s.keys.begin() + visible, better);
    // increasing key order: a fixed summation order for the output, and the pattern's rows
    std::sort(s.keys.begin(), s.keys.begin() + count);
  }
  return count;
}

// The data-dependent pattern: the keys every query row selects, per (batch, head). Exported by
// `attnbench pattern`, and used by the harness to measure the softmax mass top-k keeps.
class TopkPattern final : public attnbench::SparsePattern {
 public:
  static constexpr int64_t kBlock = 64;

  TopkPattern(const Problem& p, ConstTensorView q, ConstTensorView k, int64_t top_k)
      : n_(p.n), m_(p.keys()), heads_(p.heads) {
    const int64_t rows = p.batch * p.heads * p.n;
    start_.assign(size_t(rows) + 1, 0);
    std::vector<std::vector<int32_t>> per_row(static_cast<size_t>(rows));
    // one Scratch per thread; an exception in any row is rethrown here, after the loop
    attnbench::parallel_for(
        rows, [&] { return Scratch(m_); },
        [&](int64_t r, Scratch& scratch) {
          const int64_t bh = r / n_, i = r % n_;
          const int64_t count = select_keys(p, q, k, bh / heads_, bh % heads_, i, top_k, scratch);
          per_row[size_t(r)].assign(scratch.keys.begin(), scratch.keys.begin() + count);
        },
        {.chunk = 16});
    for (int64_t r = 0; r < rows; ++r)
      start_[size_t(r) + 1] = start_[size_t(r)] + int64_t(per_row[size_t(r)].size());
    keys_.reserve(size_t(start_.back()));
    for (auto& row : per_row) keys_.insert(keys_.end(), row.begin(), row.end());
  }

  int64_t block() const override { return kBlock; }

  void key_blocks(int64_t b, int64_t h, int64_t qb,
                  std::vector<attnbench::KeyBlock>& out) const override {
    out.clear();
    const int64_t i0 = qb * kBlock, i1 = std::min(n_, i0 + kBlock);
    // pairs of the tile in the pattern, per key block; a block is full only if all are
    std::vector<int64_t> pairs(size_t((m_ + kBlock - 1) / kBlock), 0);
    for (int64_t i = i0; i < i1; ++i)
      for (int32_t j : row(b, h, i)) ++pairs[size_t(j / kBlock)];
    for (int64_t kb = 0; kb < int64_t(pairs.size()); ++kb) {
      if (pairs[size_t(kb)] == 0) continue;
      const int64_t cols = std::min(m_, (kb + 1) * kBlock) - kb * kBlock;
      out.push_back({kb, pairs[size_t(kb)] < (i1 - i0) * cols});
    }
  }

  void block_mask(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    std::fill(mask, mask + rows * cols, uint8_t(0));
    for (int64_t r = 0; r < rows; ++r)
      for (int32_t j : row(b, h, i0 + r))
        if (j >= j0 && j < j0 + cols) mask[r * cols + (j - j0)] = 1;
  }

  double bytes() const override {
    return double(keys_.size()) * sizeof(int32_t) + double(start_.size()) * sizeof(int64_t);
  }

 private:
  // Keys query i of head (b, h) attends, increasing.
  std::span<const int32_t> row(int64_t b, int64_t h, int64_t i) const {
    const size_t r = size_t((b * heads_ + h) * n_ + i);
    return {keys_.data() + start_[r], size_t(start_[r + 1] - start_[r])};
  }

  int64_t n_, m_, heads_;
  std::vector<int64_t> start_;  // row r's keys are keys_[start_[r], start_[r + 1])
  std::vector<int32_t> keys_;
};

class TopkAttention final : public attnbench::Variant {
 public:
  explicit TopkAttention(int64_t top_k) : top_k_(top_k) {}

  // q: [B, H, n, d], k, v: [B, H, m, d], out: [B, H, n, d] (checked by the harness).
  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               attnbench::TensorView out) override {
    if (p.keys() > INT32_MAX)
      throw attnbench::UnsupportedError("topk indexes keys with 32-bit integers (m < 2^31)");
    const int64_t rows = p.batch * p.heads * p.n, d = p.dim;
    const float scale = p.softmax_scale();
    attnbench::parallel_for(
        rows, [&] { return Scratch(p.keys()); },
        [&](int64_t r, Scratch& s) {
          const int64_t bh = r / p.n, i = r % p.n, b = bh / p.heads, h = bh % p.heads;
          // passes 1 and 2: logits and the selected keys
          const int64_t count = select_keys(p, q, k, b, h, i, top_k_, s);
          Eigen::Map<Eigen::VectorXf> o(out.row(b, h, i), d);
          o.setZero();
          if (count == 0) return;  // no visible key: a zero row
          // pass 3: exact softmax over the selected logits (max first, for stability)
          float max = -INFINITY;
          for (int64_t t = 0; t < count; ++t)
            max = std::max(max, s.logits[size_t(s.keys[size_t(t)])]);
          // pass 4: the weights w_t = exp(scale (s_{j_t} - max)), in place of the logits, and
          // their sum
          float sum = 0.0f;
          for (int64_t t = 0; t < count; ++t) {
            float& l = s.logits[size_t(s.keys[size_t(t)])];
            l = std::exp(scale * (l - max));
            sum += l;
          }
          // pass 5: out_i = sum_t (w_t / sum) v_{j_t}, normalised as it goes: a convex
          // combination of value rows stays finite whenever they are (sum_t w_t v_{j_t} can
          // overflow for values near the float maximum)
          const float inv = 1.0f / sum;
          for (int64_t t = 0; t < count; ++t) {
            const int32_t j = s.keys[size_t(t)];
            o += (s.logits[size_t(j)] * inv) * Eigen::Map<const Eigen::VectorXf>(v.row(b, h, j), d);
          }
        },
        {.chunk = 16});
  }

  double flops(const Problem& p) const override {
    // 2 d per logit of a visible key, 2 d per selected key for the output; the comparisons of
    // the selection and the exponentials are not counted (as in every variant)
    double visible = 0, selected = 0;
    for (int64_t i = 0; i < p.n; ++i) {
      visible += double(p.visible(i));
      selected += double(std::min(top_k_, p.visible(i)));
    }
    return double(p.batch * p.heads) * 2.0 * double(p.dim) * (visible + selected);
  }

  double memory_estimate(const Problem& p) const override {
    // one Scratch per thread: m logits (float) and m key indices (int32)
    const int threads = attnbench::team_threads();
    return double(threads) * double(p.keys()) * (sizeof(float) + sizeof(int32_t));
  }

  std::unique_ptr<attnbench::SparsePattern> make_pattern(const Problem& p, ConstTensorView q,
                                                         ConstTensorView k) const override {
    if (!q.data || !k.data)
      throw attnbench::InputError("the topk pattern depends on q and k; pass the inputs");
    return std::make_unique<TopkPattern>(p, q, k, top_k_);
  }

 private:
  int64_t top_k_;
};

// Registration, exactly as for a variant inside attnbench.
ATTNBENCH_REGISTER_VARIANT(
    topk, attnbench::VariantInfo{
              .name = "topk",
              .summary = "exact top-k attention: softmax over the k largest visible logits of "
                         "each query (ties: lower key index)",
              .complexity = "time O(n m d + n k d), memory O(threads m)",
              .family = "pattern",
              .display = "Top-k attention",
              .paper = "Gupta et al. 2021 (arXiv:2106.06899)",
              .look = {.color = "#1b9e77", .marker = "h"},
              .params = {attnbench::ParamSpec::Int("k", 32, 1, int64_t(1) << 30,
                                                   "keys each query attends: its k largest "
                                                   "visible logits")},
              .caps = {.causal = true, .cross = true, .exact = true},
              .make = [](const attnbench::ParamValues& v) {
                return std::make_unique<TopkAttention>(v.get_int("k"));
              }});

}  // namespace topk
