// The tiled attention engine (common/engines/block_sparse.h). Its block-sparse case on a test-only
// pattern with seeded random key-block lists and random partial masks: against the masked exact
// reference, against flash on a dense pattern, with large logits, rows with no allowed key, and
// its memory figure. Its dense case with any query and key tile sizes.
#include "common/engines/block_sparse.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/reference/reference.h"
#include "harness/memory.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::rel_fro_error;

// A pattern given block by block. Each (b, h, query block) draws its own key-block list:
//  - some query blocks list nothing (their rows attend no key);
//  - a listed block is full, or partial with a random mask: dense, sparse, with some rows
//    left empty, or even empty altogether (listed though it holds no pair, which the
//    interface forbids but the engine must survive);
//  - in "partial only" query blocks some rows are empty in every listed block, so the row
//    attends no key at all while its neighbours do.
// `dense` lists every key block, full.
class TestPattern final : public SparsePattern {
 public:
  TestPattern(const Problem& p, int64_t block, uint64_t seed, bool dense = false)
      : bs_(block),
        heads_(p.heads),
        qblocks_((p.n + block - 1) / block),
        kblocks_((p.keys() + block - 1) / block) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0, 1);
    const int64_t tiles = p.batch * p.heads * qblocks_ * kblocks_;
    kind_.assign(size_t(tiles), kNone);
    mask_index_.assign(size_t(tiles), -1);
    for (int64_t t = 0; t < p.batch * p.heads * qblocks_; ++t) {
      const double mode = u(rng);
      if (!dense && mode < 0.1) continue;  // nothing listed
      const bool partial_only = mode < 0.3;
      std::vector<uint8_t> empty_row(static_cast<size_t>(bs_));
      for (auto& e : empty_row) e = partial_only && u(rng) < 0.3;
      const double keep = dense ? 1 : 0.2 + 0.5 * u(rng);  // share of key blocks listed
      for (int64_t kb = 0; kb < kblocks_; ++kb) {
        const size_t id = size_t(t * kblocks_ + kb);
        if (u(rng) >= keep) continue;
        const double kind = u(rng);
        if (dense || (!partial_only && kind < 0.3)) {
          kind_[id] = kFull;
          continue;
        }
        kind_[id] = kPartial;
        mask_index_[id] = int64_t(masks_.size());
        masks_.resize(masks_.size() + size_t(bs_ * bs_), 0);
        uint8_t* m = &masks_[size_t(mask_index_[id])];
        if (kind < 0.4) continue;  // listed, but every pair masked
        const double density = kind < 0.55 ? 0.05 : kind < 0.7 ? 0.95 : u(rng);
        for (int64_t r = 0; r < bs_; ++r) {
          if (empty_row[size_t(r)] || u(rng) < 0.05) continue;  // an empty row of the tile
          for (int64_t c = 0; c < bs_; ++c) m[r * bs_ + c] = u(rng) < density;
        }
      }
    }
  }

  int64_t block() const override { return bs_; }

  void key_blocks(int64_t b, int64_t h, int64_t qb, std::vector<KeyBlock>& out) const override {
    out.clear();
    const int64_t base = ((b * heads_ + h) * qblocks_ + qb) * kblocks_;
    for (int64_t kb = 0; kb < kblocks_; ++kb)
      if (kind_[size_t(base + kb)] != kNone)
        out.push_back({kb, kind_[size_t(base + kb)] == kPartial});
  }

  void block_mask(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = i0 + r, j = j0 + c;
        const size_t id = size_t(((b * heads_ + h) * qblocks_ + i / bs_) * kblocks_ + j / bs_);
        uint8_t x = 0;
        if (kind_[id] == kFull)
          x = 1;
        else if (kind_[id] == kPartial)
          x = masks_[size_t(mask_index_[id] + (i % bs_) * bs_ + j % bs_)];
        mask[r * cols + c] = x;
      }
  }

 private:
  enum Kind : uint8_t { kNone, kFull, kPartial };
  int64_t bs_, heads_, qblocks_, kblocks_;
  std::vector<uint8_t> kind_;        // per (b, h, qb, kb)
  std::vector<int64_t> mask_index_;  // offset of the tile's mask in masks_
  std::vector<uint8_t> masks_;       // bs x bs per partial tile
};

struct Result {
  double error = 0;        // relative Frobenius error against the masked reference
  int64_t bad_empty = 0;   // elements of rows with no allowed key that are not exactly 0
  int64_t non_finite = 0;  // non-finite elements elsewhere
  int64_t empty_rows = 0;  // rows with no allowed key
};

// Runs the engine on p with pattern `pat` (output pre-filled with NaN) and checks it.
Result run_and_check(const Problem& p, const SparsePattern& pat, const Workload& w = Workload{}) {
  const Inputs in = generate_inputs(p, w);
  Tensor out(p.q_shape());
  std::fill(out.data(), out.data() + out.numel(), NAN);
  block_sparse_attention(p, in.q.view(), in.k.view(), in.v.view(), out.view(), pat);
  Result res;
  std::vector<uint8_t> row(size_t(p.keys()));
  const TensorView o = out.view();
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.n; ++i) {
        pattern_row(p, pat, b, h, i, row.data());
        const bool empty = std::none_of(row.begin(), row.end(), [](uint8_t x) { return x; });
        res.empty_rows += empty;
        for (int64_t c = 0; c < p.dim; ++c) {
          const float x = o.row(b, h, i)[c];
          if (empty)
            res.bad_empty += !(x == 0.0f);
          else
            res.non_finite += !std::isfinite(x);
        }
      }
  res.error = rel_fro_error(out.data(),
                            reference_attention(p, in.q.view(), in.k.view(), in.v.view(), &pat));
  return res;
}

TEST(BlockSparse, RandomPatternsMatchMaskedReference) {
  const int64_t blocks[] = {1, 7, 16, 64, 100}, lens[] = {1, 7, 113, 300}, dims[] = {1, 17, 64};
  int64_t empty_rows = 0;
  uint64_t seed = 1;
  for (int64_t bs : blocks)
    for (int64_t n : lens)
      for (int64_t m : lens)
        for (int64_t d : dims)
          for (bool causal : {false, true}) {
            const Problem p = test::problem(2, 2, n, m, d, causal, seed++);
            const TestPattern pat(p, bs, seed * 7919);
            SCOPED_TRACE("block=" + std::to_string(bs) + " " + p.str());
            const Result r = run_and_check(p, pat);
            EXPECT_LE(r.error, 1e-5);
            EXPECT_EQ(r.bad_empty, 0) << "rows with no allowed key must be exactly 0";
            EXPECT_EQ(r.non_finite, 0);
            empty_rows += r.empty_rows;
          }
  EXPECT_GT(empty_rows, 0) << "the patterns should leave some rows with no key";
}

TEST(BlockSparse, LargeLogitsStayFinite) {
  // q scaled by 1e3: nearly one-hot softmax; float logits carry ~1e-4 absolute error, hence
  // the looser tolerance (see variants_test.cpp)
  uint64_t seed = 100;
  for (int64_t bs : {7, 16, 64})
    for (auto [n, m, d] :
         {std::tuple<int64_t, int64_t, int64_t>{113, 113, 64}, {300, 113, 17}, {113, 300, 64}})
      for (bool causal : {false, true}) {
        const Problem p = test::problem(2, 2, n, m, d, causal, seed++);
        const Workload w = test::workload("gaussian", 1000);
        const TestPattern pat(p, bs, seed * 31);
        SCOPED_TRACE("block=" + std::to_string(bs) + " " + describe(p, w));
        const Result r = run_and_check(p, pat, w);
        EXPECT_LE(r.error, 1e-4);
        EXPECT_EQ(r.bad_empty, 0);
        EXPECT_EQ(r.non_finite, 0);
      }
}

TEST(BlockSparse, DensePatternEqualsFlashAndReference) {
  auto flash = make_variant("flash");
  uint64_t seed = 200;
  for (int64_t bs : {1, 7, 16, 64, 100})
    for (auto [n, m] : {std::pair<int64_t, int64_t>{113, 113}, {300, 113}, {7, 300}, {300, 300}})
      for (bool causal : {false, true}) {
        const Problem p = test::problem(2, 2, n, m, 64, causal, seed++);
        const TestPattern pat(p, bs, seed, /*dense=*/true);
        SCOPED_TRACE("block=" + std::to_string(bs) + " " + p.str());
        const Inputs in = generate_inputs(p);
        Tensor out(p.q_shape()), ref_out(p.q_shape());
        block_sparse_attention(p, in.q.view(), in.k.view(), in.v.view(), out.view(), pat);
        flash->run(p, in.q.view(), in.k.view(), in.v.view(), ref_out.view());
        const std::vector<double> fl(ref_out.data(), ref_out.data() + ref_out.numel());
        EXPECT_LE(rel_fro_error(out.data(), fl), 1e-6) << "against flash";
        EXPECT_LE(rel_fro_error(out.data(), reference_attention(p, in.q.view(), in.k.view(),
                                                                in.v.view(), &pat)),
                  1e-5)
            << "against the reference";
      }
}

// The dense case with query and key tiles of their own sizes (one row, one key, a tile past n
// or m, ragged last tiles), causal and not: against the exact reference, and equal to the
// block-sparse case on a dense pattern when the two tile sizes agree.
TEST(DenseAttention, AnyTileShapesMatchReference) {
  uint64_t seed = 300;
  for (auto [bq, bk] : {std::pair<int64_t, int64_t>{1, 1},
                        {7, 64},
                        {64, 7},
                        {16, 16},
                        {64, 256},
                        {100, 13},
                        {512, 512}})
    for (auto [n, m] : {std::pair<int64_t, int64_t>{113, 113}, {300, 113}, {7, 300}})
      for (bool causal : {false, true}) {
        const Problem p = test::problem(2, 2, n, m, 24, causal, seed++);
        SCOPED_TRACE("block_q=" + std::to_string(bq) + " block_k=" + std::to_string(bk) + " " +
                     p.str());
        const Inputs in = generate_inputs(p);
        Tensor out(p.q_shape());
        dense_attention(p, in.q.view(), in.k.view(), in.v.view(), out.view(), bq, bk);
        EXPECT_LE(rel_fro_error(out.data(), reference_attention(p, in.q.view(), in.k.view(),
                                                                in.v.view(), nullptr)),
                  1e-5);
        if (bq != bk) continue;
        const TestPattern pat(p, bq, seed, /*dense=*/true);
        Tensor sparse(p.q_shape());
        block_sparse_attention(p, in.q.view(), in.k.view(), in.v.view(), sparse.view(), pat);
        EXPECT_TRUE(std::equal(out.data(), out.data() + out.numel(), sparse.data()))
            << "dense and block-sparse cases differ";
      }
}

TEST(BlockSparse, MemoryFigureMatchesHeap) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  // 4096 > n: the tiles are clipped to the problem, and so is the figure
  for (int64_t bs : {16, 64, 128, 4096}) {
    Problem p;
    p.batch = 1, p.heads = 4, p.n = 2048, p.dim = 64, p.seed = 3;
    const TestPattern pat(p, bs, 5);
    const Inputs in = generate_inputs(p);
    Tensor out(p.q_shape());
    block_sparse_attention(p, in.q.view(), in.k.view(), in.v.view(), out.view(), pat);  // warm-up
    const int64_t base = heap_reset_peak();
    block_sparse_attention(p, in.q.view(), in.k.view(), in.v.view(), out.view(), pat);
    const double got = double(heap_peak_bytes() - base), est = block_sparse_memory(p, bs);
    SCOPED_TRACE("block=" + std::to_string(bs));
    EXPECT_GT(got, 0);
    EXPECT_LE(got, 2 * est) << "estimate " << est << ", measured " << got;
    EXPECT_GE(got, est / 2) << "estimate " << est << ", measured " << got;
  }
}

}  // namespace
}  // namespace attnbench
