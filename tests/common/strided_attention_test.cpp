// Dilated attention as a reshape (common/engines/strided_attention.h), the engine's log-sum-exps
// and the merge of two disjoint parts (common/engines/block_sparse.h): against the float64
// reference on StridedPattern (common/patterns/strided_pattern.h), over strides, limits, ragged n
// and m both ways, causal, key padding, attention masks, the additive score, and one or two threads
// (the classes in parallel or one after another).
#include "common/engines/strided_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/io/inputs.h"
#include "common/patterns/strided_pattern.h"
#include "common/reference/reference.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::rel_fro_error;

/// The float64 reference output and log-sum-exps of p on pat.
struct Ref {
  std::vector<double> out, lse;
};

Ref reference(const Problem& p, const Inputs& in, const SparsePattern& pat) {
  Ref r;
  r.out.resize(size_t(p.q_shape().numel()));
  r.lse.resize(size_t(p.batch * p.heads * p.n));
  std::vector<int64_t> rows(size_t(p.n));
  for (int64_t i = 0; i < p.n; ++i) rows[size_t(i)] = i;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t bh = b * p.heads + h;
      reference_rows(p, in.q.view(), in.k.view(), in.v.view(), b, h, rows,
                     r.out.data() + bh * p.n * p.dim, &pat, r.lse.data() + bh * p.n);
    }
  return r;
}

/// Largest difference between the log-sum-exps (equal infinities count as 0; a NaN as inf).
double lse_error(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double e = std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(want[i]));
    worst = std::max(worst, std::isnan(e) ? INFINITY : e);
  }
  return worst;
}

LseView lse_view(const Problem& p, std::vector<float>& lse) {
  lse.assign(size_t(p.batch * p.heads * p.n), 12345.0f);  // never a value the engine writes
  return {lse.data(), p.heads * p.n, p.n, 1};
}

TEST(StridedAttention, MatchesTheReferenceOnItsPattern) {
  std::mt19937_64 rng(7);
  auto pick = [&](std::initializer_list<int64_t> xs) {
    return *(xs.begin() + std::uniform_int_distribution<size_t>(0, xs.size() - 1)(rng));
  };
  int cases = 0, parallel_cases = 0;
  for (int t = 0; t < 160; ++t) {
    const int64_t stride = pick({1, 2, 3, 5, 16, 64, 200});
    const int64_t limit = pick({-1, -1, 0, 4, 11, 70});
    const int64_t n = pick({1, 7, 113, 300}), m = pick({1, 7, 113, 300});
    const int64_t block = pick({1, 7, 16, 64});
    const bool causal = t % 2;
    Problem p = test::problem(2, 2, n, m, 16, causal, uint64_t(1000 + t));
    const int64_t masks = t % 4;  // none, key padding, attention mask, both
    if (masks & 1) p.key_lengths = {std::max<int64_t>(1, m / 3), m};
    if (masks & 2) p.attn_mask = test::random_mask(p, 1, 2, t % 8 < 4, n / 2);
    if (t % 5 == 0) p = test::with_score(p, Score::additive, 8);
    const int threads = t % 3 == 0 ? 1 : 2;
    SCOPED_TRACE("stride=" + std::to_string(stride) + " limit=" + std::to_string(limit) +
                 " block=" + std::to_string(block) + " threads=" + std::to_string(threads) + " " +
                 p.str() + mask_suffix(p));
    const Inputs in = generate_inputs(p);
    const StridedPattern pat(n, m, stride, limit, 0, block);
    const Ref ref = reference(p, in, pat);

    Tensor out(p.q_shape());
    std::fill(out.data(), out.data() + out.numel(), NAN);  // every row must be written
    std::vector<float> lse;
    const LseView lv = lse_view(p, lse);
    {
      test::ScopedThreads scoped(threads);
      strided_attention(p, in.q.view(), in.k.view(), in.v.view(), out.view(), stride, limit, block,
                        &lv);
    }
    EXPECT_LE(rel_fro_error(out.data(), ref.out), 1e-5);
    for (int64_t x = 0; x < out.numel(); ++x)
      if (ref.out[size_t(x)] == 0.0 && out.data()[x] != 0.0f) {
        ADD_FAILURE() << "a row the reference leaves at 0 is not 0 at element " << x;
        break;
      }
    EXPECT_LE(lse_error(lse, ref.lse), 1e-5);

    // and the engine on the same pattern gives the same log-sum-exps
    Tensor engine(p.q_shape());
    std::vector<float> engine_lse;
    const LseView ev = lse_view(p, engine_lse);
    block_sparse_attention(p, in.q.view(), in.k.view(), in.v.view(), engine.view(), pat, &ev);
    EXPECT_LE(lse_error(engine_lse, ref.lse), 1e-5);
    ++cases;
    parallel_cases += threads > 1 && std::min(n, stride) >= 8;
  }
  EXPECT_GT(parallel_cases, 10) << "too few cases run the classes in parallel";
  EXPECT_EQ(cases, 160);
}

TEST(StridedAttention, ScoresCountTheReshapesWork) {
  // stride 128 at n = m = 8192: 128 classes of 64 x 64, one 64-row tile each
  Problem p = test::problem(1, 8, 8192, 8192, 64, false);
  EXPECT_DOUBLE_EQ(strided_attention_scores(p, 128, -1, 64), 8.0 * 8192 * 64);
  // causal: each class's tile scores up to its last row, all 64 keys
  p.causal = true;
  EXPECT_DOUBLE_EQ(strided_attention_scores(p, 128, -1, 64), 8.0 * 8192 * 64);
  // a band of one class key on each side (span = stride), tiles of 4: each 4-row tile scores
  // its band's 2 or 3 key blocks of 4
  p.causal = false;
  const double band = strided_attention_scores(p, 128, 128, 4);
  EXPECT_GT(band, 8.0 * 8192 * 3);
  EXPECT_LE(band, 8.0 * 8192 * 12);
}

TEST(DenseAttention, LogSumExpMatchesTheReference) {
  uint64_t seed = 50;
  for (auto [n, m] : {std::pair<int64_t, int64_t>{113, 113}, {300, 7}, {7, 300}})
    for (bool causal : {false, true}) {
      Problem p = test::problem(2, 2, n, m, 24, causal, seed++);
      p.key_lengths = {m, 1 + m / 2};
      SCOPED_TRACE(p.str());
      const Inputs in = generate_inputs(p);
      const StridedPattern every(n, m, 1, -1, 0, 16);
      const Ref ref = reference(p, in, every);
      Tensor out(p.q_shape());
      std::vector<float> lse;
      const LseView lv = lse_view(p, lse);
      dense_attention(p, in.q.view(), in.k.view(), in.v.view(), out.view(), 64, 256, &lv);
      EXPECT_LE(rel_fro_error(out.data(), ref.out), 1e-5);
      EXPECT_LE(lse_error(lse, ref.lse), 1e-5);
    }
}

/// The union of two patterns (every listed block partial; a pair is in it if either has it).
class UnionPattern final : public SparsePattern {
 public:
  UnionPattern(const SparsePattern& a, const SparsePattern& b) : a_(a), b_(b) {}
  int64_t block() const override { return a_.block(); }
  void key_blocks(int64_t b, int64_t h, int64_t qb, std::vector<KeyBlock>& out) const override {
    std::vector<KeyBlock> x, y;
    a_.key_blocks(b, h, qb, x);
    b_.key_blocks(b, h, qb, y);
    std::vector<int64_t> ids;
    for (const KeyBlock& k : x) ids.push_back(k.index);
    for (const KeyBlock& k : y) ids.push_back(k.index);
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    out.clear();
    for (int64_t id : ids) out.push_back({id, true});
  }
  void block_mask(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    std::vector<uint8_t> other(size_t(rows * cols));
    a_.block_mask(b, h, i0, rows, j0, cols, mask);
    b_.block_mask(b, h, i0, rows, j0, cols, other.data());
    for (size_t x = 0; x < other.size(); ++x) mask[x] = mask[x] || other[x];
  }

 private:
  const SparsePattern &a_, &b_;
};

TEST(MergeAttention, TwoDisjointPartsGiveTheSoftmaxOverTheirUnion) {
  uint64_t seed = 70;
  for (auto [n, m] : {std::pair<int64_t, int64_t>{113, 113}, {300, 40}, {40, 300}})
    for (bool causal : {false, true}) {
      Problem p = test::problem(2, 3, n, m, 16, causal, seed++);
      p.key_lengths = {m, 0};  // batch element 1 sees no key: rows stay 0
      SCOPED_TRACE(p.str());
      const Inputs in = generate_inputs(p);
      // a band without the own key, and every 5th key with it: disjoint
      const StridedPattern band(n, m, 1, 3, 1, 16), fifth(n, m, 5, -1, 0, 16);
      const UnionPattern both(band, fifth);
      const Ref ref = reference(p, in, both);
      Tensor a(p.q_shape()), b(p.q_shape());
      std::vector<float> la, lb;
      const LseView va = lse_view(p, la), vb = lse_view(p, lb);
      block_sparse_attention(p, in.q.view(), in.k.view(), in.v.view(), a.view(), band, &va);
      strided_attention(p, in.q.view(), in.k.view(), in.v.view(), b.view(), 5, -1, 16, &vb);
      merge_attention(p, a.view(), va, b.view(), vb);
      EXPECT_LE(rel_fro_error(a.data(), ref.out), 1e-5);
      EXPECT_LE(lse_error(la, ref.lse), 1e-5) << "the merged log-sum-exp is the union's";
    }
}

TEST(MergeAttention, NaNInEitherPartMakesTheRowNaN) {
  const Problem p = test::problem(1, 1, 3, 3, 2, false);
  Tensor a(p.q_shape()), b(p.q_shape());
  std::fill(a.data(), a.data() + a.numel(), 1.0f);
  std::fill(b.data(), b.data() + b.numel(), 3.0f);
  std::vector<float> la = {0.0f, NAN, -INFINITY}, lb = {0.0f, 0.0f, -INFINITY};
  const LseView va{la.data(), 3, 3, 1}, vb{lb.data(), 3, 3, 1};
  merge_attention(p, a.view(), va, b.view(), vb);
  EXPECT_FLOAT_EQ(a.data()[0], 2.0f);  // equal weights
  EXPECT_FLOAT_EQ(la[0], std::log(2.0f));
  EXPECT_TRUE(std::isnan(a.data()[2]) && std::isnan(a.data()[3]));
  EXPECT_TRUE(std::isnan(la[1]));
  EXPECT_EQ(la[2], -INFINITY);
  EXPECT_EQ(a.data()[4], 0.0f) << "a row with no key in either part is 0";
}

}  // namespace
}  // namespace attnbench
