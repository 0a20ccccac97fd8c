// nsa against its float64 oracle (ragged lengths, grouped heads, the paper's defaults), its
// block selection against a brute force per kv group, its decode steps against the causal
// forward, and its refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/patterns/pattern.h"
#include "common/patterns/row_pattern.h"
#include "decode_util.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::expect_matches_oracle;
using test::run;

const char* kSmall = "nsa:cmp_block=8,cmp_stride=4,sel_block=16,sel_top=5,window=16";

Problem grouped(int64_t h, int64_t g, int64_t n, int64_t d, uint64_t seed) {
  Problem p = test::problem(1, h, n, 0, d, true, seed);
  p.kv_heads = g;
  return p;
}

// The block scores of kv group g at row t, in double: the compression branch's probabilities of
// every head of the group (mean-pooled keys of l keys every s), summed, weighted by the overlap
// of each compressed block with each selection block of ls keys, in units of the stride.
std::vector<double> block_scores(const Problem& p, const Inputs& in, int64_t l, int64_t s,
                                 int64_t ls, int64_t g, int64_t t) {
  const int64_t d = p.dim, gs = p.kv_group(), cur = t / ls;
  std::vector<double> score(size_t(cur + 1), 0.0);
  for (int64_t h = g * gs; h < (g + 1) * gs; ++h) {
    std::vector<double> logit;
    for (int64_t i = 0; i * s + l - 1 <= t; ++i) {
      double dot = 0;
      for (int64_t e = 0; e < d; ++e) {
        double kc = 0;
        for (int64_t j = i * s; j < i * s + l; ++j)
          kc += test::at(in.k, 0, h, j, e);  // the grouped view: kv head of h
        dot += double(test::at(in.q, 0, h, t, e)) * kc / double(l);
      }
      logit.push_back(dot / std::sqrt(double(d)));
    }
    if (logit.empty()) continue;
    const double mx = *std::max_element(logit.begin(), logit.end());
    double sum = 0;
    for (double x : logit) sum += std::exp(x - mx);
    for (size_t i = 0; i < logit.size(); ++i)
      for (int64_t j = 0; j <= cur; ++j) {
        const int64_t a0 = int64_t(i) * s, a1 = a0 + l;
        const int64_t ov = std::min(a1, (j + 1) * ls) - std::max(a0, j * ls);
        if (ov > 0) score[size_t(j)] += std::exp(logit[i] - mx) / sum * double(ov / s);
      }
  }
  return score;
}

// Whether row t of kv group g has a near tie at the edge of its top-n choice: the last block
// taken by score and the first one left scoring within `tie` of each other (relative). float32
// scores cannot order such blocks reliably: either choice is the function's value within float
// rounding.
bool near_tie(const Problem& p, const Inputs& in, int64_t l, int64_t s, int64_t ls, int64_t top,
              int64_t g, int64_t t, double tie) {
  const int64_t cur = t / ls;
  if (cur + 1 <= top || top == 3) return false;
  const std::vector<double> score = block_scores(p, in, l, s, ls, g, t);
  std::vector<double> rest(score.begin() + 1, score.begin() + (cur - 1));
  if (int64_t(rest.size()) <= top - 3) return false;
  std::sort(rest.begin(), rest.end(), std::greater<>());
  return rest[size_t(top - 4)] - rest[size_t(top - 3)] <= tie * rest[size_t(top - 4)];
}

// Against the oracle, ragged lengths and grouped heads. Rows with a near tie in their block
// choice (near_tie: the kernel's float32 scores may order the tied blocks either way) are left
// out of the comparison and counted; they must stay rare.
TEST(Nsa, MatchesItsOracleOnRaggedLengths) {
  struct Spec {
    std::string text;
    int64_t l, s, ls, top;
  };
  double worst = 0;
  int64_t tied = 0, rows = 0;
  for (const Spec& spec :
       {Spec{kSmall, 8, 4, 16, 5},
        Spec{"nsa:cmp_block=8,cmp_stride=4,sel_block=16,sel_top=3,window=16", 8, 4, 16, 3},
        Spec{"nsa:cmp_block=16,cmp_stride=8,sel_block=8,sel_top=4,window=0", 16, 8, 8, 4}})
    for (int64_t n : {1, 7, 33, 100, 300, 1000})
      for (auto [h, g] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}, {3, 1}})
        for (int64_t d : {16, 64}) {
          if (n == 1000 && d == 16) continue;
          const Problem p = grouped(h, g, n, d, uint64_t(n + 7 * h + d));
          SCOPED_TRACE(spec.text + " " + p.str());
          const Inputs in = generate_inputs(p);
          const Tensor out = run(spec.text, p, in);
          const test::Expected e = test::expected(spec.text, p, in);
          double diff2 = 0, ref2 = 0;
          for (int64_t head = 0; head < h; ++head)
            for (int64_t t = 0; t < n; ++t) {
              ++rows;
              if (near_tie(p, in, spec.l, spec.s, spec.ls, spec.top, p.kv_head(head), t, 1e-5)) {
                ++tied;
                continue;
              }
              const size_t at = size_t((head * n + t) * d);
              for (int64_t c = 0; c < d; ++c) {
                const double x = double(out.data()[at + size_t(c)]), y = e.out[at + size_t(c)];
                diff2 += (x - y) * (x - y), ref2 += y * y;
              }
            }
          const double err = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
          EXPECT_LE(err, e.tolerance);
          worst = std::max(worst, err);
        }
  std::printf(
      "nsa vs oracle: worst relative error %.2e; %lld of %lld rows left out for a near "
      "tie in their block choice\n",
      worst, (long long)tied, (long long)rows);
  EXPECT_LE(tied * 200, rows) << "near ties should be rare on random inputs";
}

TEST(Nsa, MatchesItsOracleAtTheDefaults) {
  for (auto [h, g] : {std::pair<int64_t, int64_t>{2, 2}, {4, 1}}) {
    const Problem p = grouped(h, g, 2048, 64, 11);
    SCOPED_TRACE(p.str());
    const double err = expect_matches_oracle("nsa", p, generate_inputs(p));
    std::printf("nsa defaults n=2048 H=%lld G=%lld: relative error %.2e\n", (long long)h,
                (long long)g, err);
  }
}

// The blocks a group chooses, by brute force in double: the compression branch's
// probabilities of every head of the group, summed, weighted by the overlap of each
// compressed block with each selection block (in units of the stride), the initial and two
// local blocks forced, the rest by score. The pattern's row keys must be exactly those
// blocks (up to t) and the window, and every head of a group must attend the same blocks.
TEST(Nsa, SelectionIsSharedByTheGroupAndMatchesABruteForce) {
  const int64_t l = 8, s = 4, ls = 16, top = 5, w = 16, d = 16;
  const Problem p = grouped(4, 2, 300, d, 5);
  const Inputs in = generate_inputs(p);
  auto var = make_variant(kSmall);
  const auto pat = var->make_pattern(p, in.q.view(), in.k.view());
  ASSERT_TRUE(pat);
  const auto* rows = dynamic_cast<const RowKeysPattern*>(pat.get());
  ASSERT_TRUE(rows);
  const int64_t gs = p.kv_group();
  int64_t differing_groups = 0;
  std::vector<int64_t> got, got_other;
  for (int64_t g = 0; g < p.kv_head_count(); ++g)
    for (int64_t t = 0; t < p.n; ++t) {
      const int64_t cur = t / ls;
      const std::vector<double> score = block_scores(p, in, l, s, ls, g, t);
      std::set<int64_t> blocks;
      if (cur + 1 <= top) {
        for (int64_t j = 0; j <= cur; ++j) blocks.insert(j);
      } else {
        blocks = {0, cur - 1, cur};
        std::vector<int64_t> rest;
        for (int64_t j = 1; j <= cur - 2; ++j) rest.push_back(j);
        std::stable_sort(rest.begin(), rest.end(),
                         [&](int64_t a, int64_t b) { return score[size_t(a)] > score[size_t(b)]; });
        blocks.insert(rest.begin(), rest.begin() + (top - 3));
      }
      std::set<int64_t> keys;
      for (int64_t j : blocks)
        for (int64_t key = j * ls; key < (j + 1) * ls && key <= t; ++key) keys.insert(key);
      for (int64_t key = std::max<int64_t>(0, t - w + 1); key <= t; ++key) keys.insert(key);
      const std::vector<int64_t> want(keys.begin(), keys.end());
      for (int64_t h = g * gs; h < (g + 1) * gs; ++h) {
        rows->row_keys(0, h, t, got);
        std::vector<int64_t> visible;
        for (int64_t key : got)
          if (key <= t) visible.push_back(key);
        ASSERT_EQ(visible, want) << "group " << g << " head " << h << " row " << t;
      }
      rows->row_keys(0, (1 - g) * gs, t, got_other);
      if (got_other != got) ++differing_groups;
    }
  EXPECT_GT(differing_groups, 0) << "the two groups never chose differently";
}

TEST(Nsa, DecodeStepsEqualTheCausalForward) {
  for (const std::string& spec : {std::string(kSmall), std::string("nsa")})
    for (auto [h, g] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}}) {
      const int64_t n = spec == "nsa" ? 700 : 150;
      const Problem p = grouped(h, g, n, 32, 9);
      SCOPED_TRACE(spec + " " + p.str());
      const Inputs in = generate_inputs(p);
      auto var = make_variant(spec);
      ASSERT_TRUE(var->decoder());
      const Tensor want = run(spec, p, in);
      for (int64_t t0 : {int64_t(0), n / 3}) {
        Tensor out(p.q_shape());
        auto state = var->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
        test::step_to_end(*state, n, in.q.view(), in.k.view(), in.v.view(), out.view());
        EXPECT_LE(test::rows_error(p, out, want.data(), t0), 1e-5) << "t0 " << t0;
      }
    }
  test::expect_decodes_causal_self_attention_only(*make_variant("nsa"));
}

TEST(Nsa, RefusesNonCausalCrossAndBadParameters) {
  auto var = make_variant("nsa");
  EXPECT_TRUE(var->info().caps.causal_only);
  for (Problem p : {test::problem(1, 2, 64, 0, 16, false), test::problem(1, 2, 64, 80, 16, true)}) {
    const Inputs in = generate_inputs(p);
    Tensor out(p.q_shape());
    EXPECT_THROW(var->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()), UnsupportedError)
        << p.str();
  }
  for (const char* bad : {"nsa:cmp_block=24,cmp_stride=16", "nsa:cmp_block=8,cmp_stride=16",
                          "nsa:sel_block=40", "nsa:sel_top=2"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(make_variant(bad), SpecError);
  }
  const std::string msg = test::error_message<SpecError>([] { make_variant("nsa:sel_block=40"); });
  EXPECT_NE(msg.find("multiple of cmp_stride"), std::string::npos) << msg;
}

}  // namespace
}  // namespace attnbench
