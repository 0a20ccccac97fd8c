// Tests of the hashing and routing variants: reformer (LSH attention) and routing (k-means
// routing). Each is checked against its float64 oracle (variants/reformer.h, variants/routing.h:
// the variant's definition in double on its own buckets or routes), against full attention in
// its degenerate settings, and for the effect of more effort.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "common/inputs.h"
#include "common/pattern.h"
#include "common/reference.h"
#include "common/registry.h"
#include "tests/test_util.h"
#include "variants/reformer.h"
#include "variants/routing.h"

namespace attnbench {
namespace {

Problem make_problem(int64_t n, int64_t d, bool causal, const std::string& input = "gaussian",
                     int64_t batch = 2, int64_t heads = 3, uint64_t seed = 7) {
  Problem p;
  p.batch = batch;
  p.heads = heads;
  p.n = n;
  p.dim = d;
  p.causal = causal;
  p.input = input;
  p.seed = seed;
  return p;
}

/// Changing the values of tokens cut.. must leave the outputs of rows < cut bit-identical
/// under a causal mask (values are the only input that reaches a row only through attention).
void expect_later_values_never_reach_earlier_rows(const std::string& spec, Problem p,
                                                   int64_t cut) {
  Inputs in = generate_inputs(p);
  const Tensor before = test::run(spec, p, in);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t j = cut; j < p.n; ++j)
        for (int64_t x = 0; x < p.dim; ++x) in.v.view().row(b, h, j)[x] += 100.0f;
  const Tensor after = test::run(spec, p, in);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < cut; ++i)
        for (int64_t x = 0; x < p.dim; ++x)
          ASSERT_EQ(before.view().row(b, h, i)[x], after.view().row(b, h, i)[x])
              << spec << ": row " << i << " changed with later values";
}

// ----- reformer -----

/// Shared-QK logit of query i and key j: q_i . q_j / |q_j| in double.
double shared_logit(const Problem& p, ConstTensorView q, int64_t b, int64_t h, int64_t i,
                    int64_t j) {
  const float* qi = q.row(b, h, i);
  const float* qj = q.row(b, h, j);
  double dot = 0, nn = 0;
  for (int64_t x = 0; x < p.dim; ++x) {
    dot += double(qi[x]) * double(qj[x]);
    nn += double(qj[x]) * double(qj[x]);
  }
  return nn > 0 ? dot / std::sqrt(nn) : 0.0;
}

/// Softmax of row i over `keys` under the shared-QK rule (itself only if nothing else is
/// visible, at logit -1e5): output row and log-sum-exp.
void shared_row(const Problem& p, ConstTensorView q, ConstTensorView v, int64_t b, int64_t h,
                int64_t i, const std::vector<int64_t>& keys, double* out, double* lse) {
  std::vector<int64_t> use;
  for (int64_t j : keys)
    if (j != i && j < p.visible(i)) use.push_back(j);
  std::fill(out, out + p.dim, 0.0);
  if (use.empty()) {
    for (int64_t x = 0; x < p.dim; ++x) out[x] = v.row(b, h, i)[x];
    *lse = -1e5;
    return;
  }
  std::vector<double> l(use.size());
  double mx = -INFINITY;
  for (size_t t = 0; t < use.size(); ++t) mx = std::max(mx, l[t] = shared_logit(p, q, b, h, i, use[t]));
  double sum = 0;
  for (size_t t = 0; t < use.size(); ++t) sum += (l[t] = std::exp(l[t] - mx));
  for (size_t t = 0; t < use.size(); ++t)
    for (int64_t x = 0; x < p.dim; ++x) out[x] += l[t] / sum * v.row(b, h, use[t])[x];
  *lse = mx + std::log(sum);
}

/// Shared-QK full attention (every visible key but itself), [B, H, n, d] in double.
std::vector<double> shared_full(const Problem& p, const Inputs& in) {
  std::vector<double> out(size_t(p.q_shape().numel()));
  std::vector<int64_t> all(static_cast<size_t>(p.n));
  std::iota(all.begin(), all.end(), 0);
  double lse;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.n; ++i)
        shared_row(p, in.q.view(), in.v.view(), b, h, i, all,
                   out.data() + ((b * p.heads + h) * p.n + i) * p.dim, &lse);
  return out;
}

TEST(Reformer, MatchesItsDefinition) {
  struct Case {
    int64_t n, d;
    bool causal;
    std::vector<int64_t> factors;  // empty: automatic
    int64_t hashes, chunk;
  };
  const std::vector<Case> cases = {
      {100, 17, false, {}, 3, 16},      {100, 17, true, {}, 3, 16},
      {77, 64, false, {4, 8}, 2, 8},    {77, 64, true, {4, 8}, 2, 8},
      {130, 1, false, {6}, 2, 32},      {33, 5, true, {2}, 1, 64},
      {257, 32, true, {}, 4, 64},
  };
  for (const Case& c : cases) {
    const Problem p = make_problem(c.n, c.d, c.causal);
    const Inputs in = generate_inputs(p);
    std::string buckets = "none";
    if (!c.factors.empty()) {
      buckets.clear();
      for (int64_t f : c.factors) {
        if (!buckets.empty()) buckets += '+';
        buckets += std::to_string(f);
      }
    }
    const std::string spec = "reformer:buckets=" + buckets + ",hashes=" +
                             std::to_string(c.hashes) + ",chunk=" + std::to_string(c.chunk);
    SCOPED_TRACE(spec + " " + p.str());
    const auto v = make_variant(spec);
    const Tensor out = test::run(spec, p, in);
    std::vector<std::vector<int64_t>> attended;
    const std::vector<double> want = reformer::oracle(
        p, reformer::plan(p, c.factors, c.hashes, c.chunk), in.q.view(), in.v.view(), &attended);
    EXPECT_LT(test::rel_fro_error(out.data(), want), v->info().tolerance(*v, p));

    // the exported pattern is the set of keys each row attends
    auto pat = make_variant(spec)->make_pattern(p, in.q.view(), in.k.view());
    ASSERT_NE(pat, nullptr);
    std::vector<uint8_t> row(static_cast<size_t>(p.n));
    int64_t wrong = 0;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < p.n; ++i) {
          pattern_row(p, *pat, b, h, i, row.data());
          const auto& keys = attended[size_t((b * p.heads + h) * p.n + i)];
          for (int64_t j = 0; j < p.n; ++j)
            wrong += row[size_t(j)] != uint8_t(std::binary_search(keys.begin(), keys.end(), j));
        }
    EXPECT_EQ(wrong, 0) << "pattern entries that differ from the keys the definition attends";
  }
}

TEST(Reformer, OneBucketOneChunkIsSharedQkFullAttention) {
  for (bool causal : {false, true})
    for (int64_t n : {1, 2, 37, 200})
      for (int64_t d : {1, 17, 64}) {
        const Problem p = make_problem(n, d, causal);
        const Inputs in = generate_inputs(p);
        SCOPED_TRACE(p.str());
        const Tensor out = test::run("reformer:buckets=1,hashes=3,chunk=4096", p, in);
        EXPECT_LT(test::rel_fro_error(out.data(), shared_full(p, in)), 1e-5);
      }
}

TEST(Reformer, MoreHashesMoreMassLessError) {
  // clustered tokens: LSH buckets follow the clusters, and each round adds keys
  const Problem p = make_problem(1024, 64, false, "clustered", 1, 2);
  const Inputs in = generate_inputs(p);
  const std::vector<double> exact = shared_full(p, in);
  double last_error = INFINITY, last_mass = 0;
  for (int64_t hashes : {1, 2, 4, 8}) {
    const std::string spec = "reformer:chunk=32,hashes=" + std::to_string(hashes);
    SCOPED_TRACE(spec);
    const Tensor out = test::run(spec, p, in);
    const double error = test::rel_fro_error(out.data(), exact);
    // mass: share of each row's exact shared-QK softmax inside the keys it attends
    auto pat = make_variant(spec)->make_pattern(p, in.q.view(), in.k.view());
    std::vector<uint8_t> row(static_cast<size_t>(p.n));
    double mass = 0;
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.n; i += 7) {
        pattern_row(p, *pat, 0, h, i, row.data());
        double mx = -INFINITY, in_sum = 0, all = 0;
        std::vector<double> l(size_t(p.n), -INFINITY);
        for (int64_t j = 0; j < p.n; ++j)
          if (j != i) mx = std::max(mx, l[size_t(j)] = shared_logit(p, in.q.view(), 0, h, i, j));
        for (int64_t j = 0; j < p.n; ++j) {
          const double e = j == i ? 0.0 : std::exp(l[size_t(j)] - mx);
          all += e;
          if (row[size_t(j)]) in_sum += e;
        }
        mass += in_sum / all;
      }
    EXPECT_GT(mass, last_mass);
    EXPECT_LT(error, 0.9 * last_error);
    last_error = error;
    last_mass = mass;
  }
}

TEST(Reformer, CausalValuesOfLaterTokensNeverReachEarlierRows) {
  const Problem p = make_problem(150, 16, true);
  expect_later_values_never_reach_earlier_rows("reformer:chunk=16", p, 90);
  const Inputs in = generate_inputs(p);
  const Tensor before = test::run("reformer:chunk=16", p, in);
  // the first token sees only itself
  EXPECT_EQ(before.view().row(0, 0, 0)[0], in.v.view().row(0, 0, 0)[0]);
}

TEST(Reformer, SeedChoosesTheRotations) {
  Problem p = make_problem(256, 32, false, "gaussian", 1, 2);
  const Inputs in = generate_inputs(p);
  const Tensor a = test::run("reformer:chunk=16", p, in);
  Problem p2 = p;
  p2.seed = p.seed + 1;  // same inputs, other rotations
  const Tensor b = test::run("reformer:chunk=16", p2, in);
  double diff = 0;
  for (int64_t t = 0; t < p.q_shape().numel(); ++t) diff += std::fabs(a.data()[t] - b.data()[t]);
  EXPECT_GT(diff, 0.0);
}

TEST(Reformer, RefusesCrossAttentionAndOddBuckets) {
  Problem p = make_problem(64, 16, false);
  p.m = 80;
  const Inputs in = generate_inputs(p);
  EXPECT_CONTAINS(test::error_message<UnsupportedError>([&] { test::run("reformer", p, in); }),
                  "m != n");
  const Problem q = make_problem(64, 16, false);
  const Inputs qin = generate_inputs(q);
  EXPECT_CONTAINS(test::error_message<SpecError>([&] { test::run("reformer:buckets=3", q, qin); }),
                  "even");
}

// ----- routing -----

TEST(Routing, MatchesItsFormulaOnItsRoutes) {
  struct Case {
    int64_t n, m, d;
    bool causal;
    int64_t clusters, window, iterations, sample;
  };
  const std::vector<Case> cases = {
      {200, 200, 17, false, 0, 0, 2, 4096}, {200, 200, 17, true, 0, 0, 2, 4096},
      {150, 90, 64, false, 5, 0, 3, 0},     {90, 150, 64, true, 0, 40, 1, 64},
      {77, 77, 1, true, 3, 30, 0, 4096},    {300, 300, 32, true, 4, 100, 2, 100},
  };
  for (const Case& c : cases) {
    Problem p = make_problem(c.n, c.d, c.causal);
    p.m = c.m;
    const Inputs in = generate_inputs(p);
    const std::string spec = fmt::format("routing:clusters={},window={},iterations={},sample={}",
                                         c.clusters, c.window, c.iterations, c.sample);
    SCOPED_TRACE(spec + " " + p.str());
    auto v = make_variant(spec);
    Tensor out(p.q_shape());
    v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    int64_t unrouted = 0;
    const auto want =
        routing::oracle(p, routing::sizes(p, c.clusters, c.window, c.sample), c.iterations,
                        in.q.view(), in.k.view(), in.v.view(), &unrouted);
    EXPECT_LT(test::rel_fro_error(out.data(), want), v->info().tolerance(*v, p));
    // the notes report the rows left without keys
    EXPECT_CONTAINS(v->notes(), fmt::format("{} of {} query rows", unrouted,
                                            p.batch * p.heads * p.n));
  }
}

TEST(Routing, EachClusterTakesItsNearestTokens) {
  Problem p = make_problem(300, 16, false, "clustered", 1, 2);
  p.m = 260;
  const Inputs in = generate_inputs(p);
  const routing::Sizes sz = routing::sizes(p, 6, 0, 0);
  for (int64_t h = 0; h < p.heads; ++h) {
    const routing::Routes r = routing::route(p, sz, 3, in.q.view(), in.k.view(), 0, h);
    for (bool queries : {true, false}) {
      const int64_t len = queries ? p.n : p.keys(), w = queries ? sz.wq : sz.wk;
      ConstTensorView x = queries ? in.q.view() : in.k.view();
      for (int64_t u = 0; u < sz.c; ++u) {
        std::vector<double> cosine(static_cast<size_t>(len));
        for (int64_t t = 0; t < len; ++t) {
          double dot = 0, nn = 0;
          for (int64_t j = 0; j < p.dim; ++j) {
            dot += double(x.row(0, h, t)[j]) * r.centroids[size_t(u * p.dim + j)];
            nn += double(x.row(0, h, t)[j]) * double(x.row(0, h, t)[j]);
          }
          cosine[size_t(t)] = dot / std::sqrt(nn);
        }
        const int32_t* sel = (queries ? r.queries.data() : r.keys.data()) + u * w;
        std::vector<uint8_t> chosen(static_cast<size_t>(len), 0);
        double worst_in = INFINITY, best_out = -INFINITY;
        for (int64_t t = 0; t < w; ++t) {
          ASSERT_EQ(chosen[size_t(sel[t])], 0) << "a token selected twice by one cluster";
          chosen[size_t(sel[t])] = 1;
          worst_in = std::min(worst_in, cosine[size_t(sel[t])]);
          if (t > 0) {
            EXPECT_LT(sel[t - 1], sel[t]);
          }
        }
        for (int64_t t = 0; t < len; ++t)
          if (!chosen[size_t(t)]) best_out = std::max(best_out, cosine[size_t(t)]);
        EXPECT_GE(worst_in, best_out - 1e-5) << "cluster " << u << " skipped a nearer token";
      }
    }
    // centroids are unit vectors
    for (int64_t u = 0; u < sz.c; ++u) {
      double nn = 0;
      for (int64_t j = 0; j < p.dim; ++j) nn += std::pow(r.centroids[size_t(u * p.dim + j)], 2);
      EXPECT_NEAR(nn, 1.0, 1e-5);
    }
  }
}

TEST(Routing, OneClusterIsFullAttention) {
  for (bool causal : {false, true})
    for (auto [n, m] : {std::pair<int64_t, int64_t>{1, 1}, {37, 37}, {200, 200}, {64, 150}, {150, 64}})
      for (int64_t d : {1, 17, 64}) {
        Problem p = make_problem(n, d, causal);
        p.m = m;
        const Inputs in = generate_inputs(p);
        SCOPED_TRACE(p.str());
        const Tensor out = test::run("routing:clusters=1,window=100000", p, in);
        EXPECT_LT(test::rel_fro_error(out.data(), reference_attention(p, in.q.view(), in.k.view(),
                                                                      in.v.view())),
                  1e-5);
      }
}

TEST(Routing, CausalValuesOfLaterTokensNeverReachEarlierRows) {
  expect_later_values_never_reach_earlier_rows("routing", make_problem(300, 16, true), 170);
}

TEST(Routing, SeedChoosesTheCentroids) {
  Problem p = make_problem(256, 32, false, "gaussian", 1, 2);
  const Inputs in = generate_inputs(p);
  const Tensor a = test::run("routing", p, in);
  Problem p2 = p;
  p2.seed = p.seed + 1;  // same inputs, other initial centroids and sample
  const Tensor b = test::run("routing", p2, in);
  double diff = 0;
  for (int64_t t = 0; t < p.q_shape().numel(); ++t) diff += std::fabs(a.data()[t] - b.data()[t]);
  EXPECT_GT(diff, 0.0);
}

// ----- the registered oracles (what tests/variants_test.cpp holds every variant to) -----

/// Every spec against its registered oracle and tolerance on small ragged shapes (B = H = 2),
/// causal and not, and with m != n if `cross`.
void expect_registered_oracle_holds(const std::vector<std::string>& specs, bool cross) {
  for (const std::string& spec : specs) {
    double worst = 0;  // in units of the tolerance
    for (int64_t n : {1, 7, 60, 113})
      for (int64_t m : {1, 7, 60, 113})
        for (int64_t d : {1, 17, 64})
          for (bool causal : {false, true}) {
            if (m != n && !cross) continue;
            const Problem p = test::problem(2, 2, n, m, d, causal, uint64_t(n + 3 * m + d));
            SCOPED_TRACE(spec + " " + p.str());
            const Inputs in = generate_inputs(p);
            const test::Expected e = test::expected(spec, p, in);
            const double err = test::rel_fro_error(test::run(spec, p, in).data(), e.out);
            EXPECT_LE(err, e.tolerance);
            worst = std::max(worst, err / e.tolerance);
          }
    fmt::print("[ oracle ] {:<45} worst error {:.3f} of its tolerance\n", spec, worst);
  }
}

/// The oracle of `spec` differs from `other` (what a plausible wrong variant would give) by
/// far more than the tolerance, so the comparison with the oracle can fail.
void expect_oracle_far_from(const std::string& spec, const Problem& p, const Inputs& in,
                            const std::vector<double>& other) {
  const test::Expected e = test::expected(spec, p, in);
  const std::vector<float> oracle(e.out.begin(), e.out.end());
  EXPECT_GT(test::rel_fro_error(oracle.data(), other), 100 * e.tolerance) << spec;
}

TEST(Reformer, MatchesItsRegisteredOracleOnRaggedShapes) {
  expect_registered_oracle_holds(
      {"reformer", "reformer:chunk=8,hashes=3", "reformer:buckets=4+6,hashes=2,chunk=16",
       "reformer:buckets=1,hashes=2,chunk=4"},
      false);
}

TEST(Reformer, OracleIsFarFromSharedQkFullAttention) {
  for (bool causal : {false, true}) {
    const Problem p = make_problem(256, 32, causal, "gaussian", 1, 2);
    const Inputs in = generate_inputs(p);
    expect_oracle_far_from("reformer:chunk=16", p, in, shared_full(p, in));
  }
}

TEST(Routing, MatchesItsRegisteredOracleOnRaggedShapes) {
  expect_registered_oracle_holds(
      {"routing", "routing:clusters=5,iterations=3,sample=0", "routing:window=20,sample=50"}, true);
}

TEST(Routing, OracleIsFarFromFullAttention) {
  for (bool causal : {false, true}) {
    Problem p = make_problem(256, 32, causal, "gaussian", 1, 2);
    p.m = 200;
    const Inputs in = generate_inputs(p);
    expect_oracle_far_from("routing", p, in,
                           reference_attention(p, in.q.view(), in.k.view(), in.v.view()));
  }
}

}  // namespace
}  // namespace attnbench
