// Tests of the routing variant (k-means routing): checked against its float64 oracle
// (variants/routing.h: the variant's formula in double on its own routes), against full
// attention with one cluster, and for causality and the seed.
#include "variants/routing.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/patterns/pattern.h"
#include "common/reference/reference.h"
#include "tests/padded_keys.h"
#include "tests/test_util.h"

namespace attnbench {
namespace {

using test::expect_later_values_never_reach_earlier_rows;

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
    Problem p = test::problem(2, 3, c.n, 0, c.d, c.causal, 7);
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
    EXPECT_LT(test::rel_fro_error(out.data(), want), v->info().tolerance(*v, p, Workload{}));
    // the notes report the rows left without keys
    EXPECT_CONTAINS(v->notes(),
                    fmt::format("{} of {} query rows", unrouted, p.batch * p.heads * p.n));
  }
}

TEST(Routing, PaddedKeysAreAbsent) {
  // garbage in the padded keys is never sampled, routed or attended; without causal a batch
  // element routes and attends exactly as it would with its valid keys alone (w_k and the
  // Lloyd sample follow its valid length)
  Problem p = test::problem(3, 2, 150, 90, 16, false, 5);
  p.key_lengths = {37, 0, 90};
  for (const std::string& sp : {std::string("routing:clusters=4,window=40,sample=0"),
                                std::string("routing:iterations=3,sample=64"),
                                std::string("routing:clusters=1,window=150")})
    test::expect_padded_keys_absent(sp, p, true, 1e-6);
  p.causal = true;
  p.key_lengths = {1, 60, 0};
  test::expect_padded_keys_absent("routing:clusters=4,window=40,sample=0", p, false, 0);
  // the oracle on the same definition, causal or not
  for (bool causal : {false, true}) {
    p.causal = causal;
    const Inputs in = generate_inputs(p);
    const std::string sp = "routing:clusters=4,window=40,iterations=3,sample=64";
    const test::Expected e = test::expected(sp, p, in);
    EXPECT_LE(test::rel_fro_error(test::run(sp, p, in).data(), e.out), e.tolerance) << causal;
  }
}

TEST(Routing, EachClusterTakesItsNearestTokens) {
  Problem p = test::problem(1, 2, 300, 0, 16, false, 7);
  p.m = 260;
  const Inputs in = generate_inputs(p, test::workload("clustered"));
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
    for (auto [n, m] :
         {std::pair<int64_t, int64_t>{1, 1}, {37, 37}, {200, 200}, {64, 150}, {150, 64}})
      for (int64_t d : {1, 17, 64}) {
        Problem p = test::problem(2, 3, n, 0, d, causal, 7);
        p.m = m;
        const Inputs in = generate_inputs(p);
        SCOPED_TRACE(p.str());
        const Tensor out = test::run("routing:clusters=1,window=100000", p, in);
        EXPECT_LT(test::rel_fro_error(
                      out.data(), reference_attention(p, in.q.view(), in.k.view(), in.v.view())),
                  1e-5);
      }
}

TEST(Routing, CausalValuesOfLaterTokensNeverReachEarlierRows) {
  expect_later_values_never_reach_earlier_rows("routing", test::problem(2, 3, 300, 0, 16, true, 7),
                                               170);
}

// The backward pass differentiates the function on the forward's routes: float64 central
// finite differences of oracle_on_routes with the routes held fixed (a perturbation that
// moved a query or key to another cluster would otherwise change the function itself).
TEST(Routing, BackwardMatchesFiniteDifferencesOnFrozenRoutes) {
  struct Case {
    int64_t n, m;
    bool causal;
    std::vector<int64_t> lengths;
  };
  const std::vector<Case> cases = {{40, 40, false, {}},
                                   {40, 40, true, {}},
                                   {37, 45, true, {}},
                                   {45, 37, false, {37, 20}},
                                   {33, 29, true, {29, 0}}};
  constexpr double kStep = 0x1p-9, kTol = 1e-3;
  for (const Case& c : cases) {
    Problem p = test::problem(2, 2, c.n, c.m, 8, c.causal, 19 + uint64_t(c.n));
    p.key_lengths = c.lengths;
    SCOPED_TRACE(p.str());
    Inputs in = generate_inputs(p);
    for (Tensor* t : {&in.q, &in.k, &in.v})  // on a 2^-12 grid: x +- 2^-9 is exact in float
      for (int64_t i = 0; i < t->numel(); ++i)
        t->data()[i] = float(std::nearbyint(double(t->data()[i]) * 4096.0) / 4096.0);
    Tensor dout(p.q_shape());
    std::mt19937_64 rng(c.n * 7 + c.m);
    std::normal_distribution<double> nd;
    for (int64_t i = 0; i < dout.numel(); ++i) dout.data()[i] = float(nd(rng));
    const char* spec = "routing:clusters=3,window=12,iterations=2";
    auto var = make_variant(spec);
    Tensor out(p.q_shape()), dq(p.q_shape()), dk(p.kv_shape()), dv(p.kv_shape());
    const auto saved = var->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    var->run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout.view(), *saved,
                      dq.view(), dk.view(), dv.view());
    const routing::Sizes sz = routing::sizes(p, 3, 12, 4096);
    std::vector<routing::Routes> routes;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        routes.push_back(routing::route(p, sz, 2, in.q.view(), in.k.view(), b, h));
    auto loss = [&](const Tensor& qx, const Tensor& kx, const Tensor& vx) {
      const auto o = routing::oracle_on_routes(p, sz, routes, qx.view(), kx.view(), vx.view());
      double l = 0;
      for (size_t i = 0; i < o.size(); ++i) l += double(dout.data()[i]) * o[i];
      return l;
    };
    const Tensor* src[3] = {&in.q, &in.k, &in.v};
    const Tensor* grads[3] = {&dq, &dk, &dv};
    for (int which = 0; which < 3; ++which) {
      SCOPED_TRACE(which);
      test::expect_matches_differences(
          *grads[which], rng, 3, 0, kTol, [&](const std::vector<double>& u) {
            auto moved = [&](double sign) {
              Tensor t(src[which]->shape());
              for (int64_t i = 0; i < t.numel(); ++i)
                t.data()[i] = float(double(src[which]->data()[i]) + sign * kStep * u[size_t(i)]);
              return loss(which == 0 ? t : in.q, which == 1 ? t : in.k, which == 2 ? t : in.v);
            };
            return (moved(1.0) - moved(-1.0)) / (2.0 * kStep);
          });
    }
  }
}

TEST(Routing, SeedChoosesTheCentroids) {
  Problem p = test::problem(1, 2, 256, 0, 32, false, 7);
  const Inputs in = generate_inputs(p);
  const Tensor a = test::run("routing", p, in);
  Problem p2 = p;
  p2.seed = p.seed + 1;  // same inputs, other initial centroids and sample
  const Tensor b = test::run("routing", p2, in);
  double diff = 0;
  for (int64_t t = 0; t < p.q_shape().numel(); ++t) diff += std::fabs(a.data()[t] - b.data()[t]);
  EXPECT_GT(diff, 0.0);
}

TEST(Routing, MatchesItsRegisteredOracleOnRaggedShapes) {
  test::expect_registered_oracle_holds(
      {"routing", "routing:clusters=5,iterations=3,sample=0", "routing:window=20,sample=50"}, true);
}

TEST(Routing, OracleIsFarFromFullAttention) {
  for (bool causal : {false, true}) {
    Problem p = test::problem(1, 2, 256, 200, 32, causal, 7);
    const Inputs in = generate_inputs(p);
    test::expect_oracle_far_from("routing", p, in,
                                 reference_attention(p, in.q.view(), in.k.view(), in.v.view()));
  }
}

}  // namespace
}  // namespace attnbench
