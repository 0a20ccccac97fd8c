// compressed against a plainly written double-precision version of its own definition:
// attention over mean- or conv-pooled keys and values under the causal staircase.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/patterns/pattern.h"
#include "common/reference/reference.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::at;
using test::copy;
using test::expect_matches_oracle;
using test::perturb_after;
using test::rel_fro_error;
using test::row_diff;
using test::run;

TEST(Compressed, MatchesThePooledAttentionOracle) {
  double worst = 0;
  for (const char* pool_kind : {"mean", "conv"})
    for (int64_t r : {3, 4, 1})
      for (auto [n, m] : {std::pair<int64_t, int64_t>{113, 113}, {100, 130}, {130, 100}, {1, 5}})
        for (int64_t d : {1, 17, 64})
          for (bool causal : {false, true}) {
            // one batch item (the generic tests cover batches): the double oracle is slow
            const Problem p = test::problem(1, 2, n, m, d, causal, uint64_t(7 * n + m + d + r));
            const std::string spec = "compressed:ratio=" + std::to_string(r) + ",pool=" + pool_kind;
            SCOPED_TRACE(spec + " " + p.str());
            worst = std::max(worst, expect_matches_oracle(spec, p, generate_inputs(p)));
          }
  std::printf("compressed vs oracle: worst relative error %.2e\n", worst);
}

TEST(Compressed, CausalRowsWithoutACompleteGroupAreZero) {
  const Problem p = test::problem(1, 2, 50, 0, 8, true, 3);
  Inputs in = generate_inputs(p);
  const Tensor out = run("compressed:ratio=4", p, in);
  for (int64_t i = 0; i < p.n; ++i) {
    double norm = 0;
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t c = 0; c < p.dim; ++c) norm += std::fabs(at(out, 0, h, i, c));
    if (i < 3)
      EXPECT_EQ(norm, 0.0) << "row " << i;  // sees keys 0 .. i: no group of 4
    else
      EXPECT_GT(norm, 0.0) << "row " << i;
  }
}

TEST(Compressed, RatioOneMeanIsFullAttention) {
  for (auto [n, m] :
       {std::pair<int64_t, int64_t>{113, 113}, {7, 113}, {113, 7}, {300, 257}, {1, 1}})
    for (int64_t d : {1, 17, 64})
      for (bool causal : {false, true}) {
        test::expect_full_attention("compressed:ratio=1,pool=mean",
                                    test::problem(1, 2, n, m, d, causal, 12));
      }
}

TEST(Compressed, CausalLeaksNothing) {
  for (const char* spec : {"compressed", "compressed:ratio=5,pool=conv"})
    for (auto [n, m] : {std::pair<int64_t, int64_t>{113, 113}, {100, 130}, {130, 100}}) {
      bool changed_without_causal = false;
      for (bool causal : {true, false}) {
        const Problem p = test::problem(1, 2, n, m, 17, causal, 21);
        SCOPED_TRACE(std::string(spec) + " " + p.str());
        Inputs in = generate_inputs(p);
        const Tensor base = run(spec, p, in);
        for (int64_t i : {int64_t(0), int64_t(5), int64_t(17), int64_t(60), n - 2}) {
          // query i sees keys 0 .. a(i): change every key and value after a(i)
          const int64_t a = i + (m - n);
          if (a < -1 || a >= m - 1) continue;
          Inputs changed{copy(in.q), copy(in.k), copy(in.v)};
          perturb_after(p, a, changed.k, changed.v);
          const Tensor out = run(spec, p, changed);
          double diff = 0;
          for (int64_t r = 0; r <= i; ++r) diff = std::max(diff, row_diff(p, out, base, r));
          if (causal)
            EXPECT_EQ(diff, 0.0) << "rows <= " << i << " see keys after " << a;
          else
            changed_without_causal |= diff > 1e-3;
        }
      }
      EXPECT_TRUE(changed_without_causal) << spec;
    }
}

TEST(Compressed, SeedDrivesTheConvWeightsOnly) {
  Problem p = test::problem(2, 2, 90, 70, 16, false, 5);
  Inputs in = generate_inputs(p);
  const Tensor conv1 = run("compressed:pool=conv", p, in), mean1 = run("compressed", p, in);
  const Tensor conv_again = run("compressed:pool=conv", p, in);
  p.seed = 6;  // same inputs, other seed
  const Tensor conv2 = run("compressed:pool=conv", p, in), mean2 = run("compressed", p, in);
  const size_t bytes = size_t(conv1.numel()) * sizeof(float);
  EXPECT_EQ(std::memcmp(conv1.data(), conv_again.data(), bytes), 0);
  EXPECT_NE(std::memcmp(conv1.data(), conv2.data(), bytes), 0);
  EXPECT_EQ(std::memcmp(mean1.data(), mean2.data(), bytes), 0);
  // and each matches the oracle with its own seed's weights
  const test::Expected e = test::expected("compressed:pool=conv", p, in);
  EXPECT_LE(rel_fro_error(conv2.data(), e.out), e.tolerance);
}

TEST(Compressed, HasNoPatternAndSaysSo) {
  auto v = make_variant("compressed");
  EXPECT_FALSE(v->info().caps.exact);
  EXPECT_TRUE(v->info().caps.causal);
  EXPECT_TRUE(v->info().caps.cross);
  const Problem p = test::problem(1, 1, 30, 0, 8, false, 1);
  Inputs in = generate_inputs(p);
  EXPECT_EQ(v->make_pattern(p, in.q.view(), in.k.view()), nullptr);
  test::TempDir dir;
  auto r =
      test::run_cli("pattern --variant compressed --seq 30 --output " + dir.file("x.npy"), dir);
  EXPECT_NE(r.code, 0);
  EXPECT_CONTAINS(r.err, "has no attention pattern");
  // and its result row has no mass
  auto row = test::run_cli(
      "run --variant compressed:ratio=2 --seq 64 --heads 1 --dim 8 "
      "--min-time 0.001 --reps 1 --json",
      dir);
  ASSERT_EQ(row.code, 0) << row.err;
  EXPECT_CONTAINS(row.out, "\"mass_mean\": null");
  EXPECT_CONTAINS(row.out, "\"status\": \"ok\"");
}

}  // namespace
}  // namespace attnbench
