// The scoring functions (docs/cli.md, "Scoring functions"): the vectorised tanh of the
// additive score, the scaling of the seeded weights, reading them from an inputs file, the
// refusals, and the score column of results.csv (older files resume as scaled_dot). Each
// variant against the reference or its oracle under every score: variants_test.cpp,
// VariantTest.ScoringFunctions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/kernels/additive_score.h"
#include "common/reference/reference.h"
#include "harness/results.h"
#include "harness/sweep_plan.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::problem;
using test::with_score;

TEST(FastTanh, WithinItsStatedErrorOnAllOfR) {
  // every 1e-4 of [-12, 12], tiny and huge values, both signs; the array path (add_tanh_row,
  // vectorised) and the scalar one agree with std::tanh within 3e-7 relative, 1.5e-7 absolute
  std::vector<float> x;
  for (int i = -120000; i <= 120000; ++i) x.push_back(float(i) * 1e-4f);
  for (float t : {1e-30f, 1e-8f, 3e-3f, 0.2499f, 0.25f, 8.99f, 9.0f, 50.0f, 1e30f}) {
    x.push_back(t);
    x.push_back(-t);
  }
  std::vector<float> s(x.size(), 0.0f);
  add_tanh_row(s.data(), x.data(), 0.0f, 1.0f, int64_t(x.size()));
  double worst_rel = 0, worst_abs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = std::tanh(double(x[i]));
    for (double got : {double(s[i]), double(fast_tanh(x[i]))}) {
      const double err = std::fabs(got - ref);
      worst_abs = std::max(worst_abs, err);
      if (ref != 0) worst_rel = std::max(worst_rel, err / std::fabs(ref));
    }
  }
  EXPECT_LE(worst_rel, 3e-7);
  EXPECT_LE(worst_abs, 1.5e-7);
  EXPECT_TRUE(std::isnan(fast_tanh(NAN)));
  std::printf("[ tanh ] worst error %.3g relative, %.3g absolute\n", worst_rel, worst_abs);
}

TEST(ScoreWeights, TanhVarianceConstantMatchesSampling) {
  RandomStream rs(7, 1);
  double sum = 0;
  const int samples = 400000;
  for (int i = 0; i < samples; ++i) {
    const double t = std::tanh(std::sqrt(2.0) * rs.normal(uint64_t(i)));
    sum += t * t;
  }
  // E[tanh^2] < 1: the sample mean has sd < 1/sqrt(samples) = 1.6e-3
  EXPECT_NEAR(additive_tanh_variance(), sum / samples, 5e-3);
  EXPECT_NEAR(additive_tanh_variance(), 0.52, 0.01);
}

// The sample variance of the logits of p's score on generated gaussian inputs, over every
// (query, key) pair of every head, the logits formed here from their definition.
double logit_variance(const Problem& p) {
  const Inputs in = generate_inputs(p);
  const ScoreWeights* w = p.score_weights.get();
  const int64_t d = p.dim, hd = p.hidden();
  double sum = 0, sum2 = 0, count = 0;
  for (int64_t h = 0; h < p.heads; ++h) {
    // the additive score's projections of every key of the head
    std::vector<double> kp(size_t(p.keys() * hd), 0.0);
    if (p.score == Score::additive)
      for (int64_t j = 0; j < p.keys(); ++j)
        for (int64_t c = 0; c < hd; ++c)
          for (int64_t x = 0; x < d; ++x)
            kp[size_t(j * hd + c)] +=
                double(w->w_k[size_t((h * hd + c) * d + x)]) * in.k.view().row(0, h, j)[x];
    for (int64_t i = 0; i < p.n; ++i) {
      const float* q = in.q.view().row(0, h, i);
      std::vector<double> qp(size_t(hd), 0.0);
      if (p.score == Score::additive)
        for (int64_t c = 0; c < hd; ++c)
          for (int64_t x = 0; x < d; ++x)
            qp[size_t(c)] += double(w->w_q[size_t((h * hd + c) * d + x)]) * q[x];
      for (int64_t j = 0; j < p.keys(); ++j) {
        const float* k = in.k.view().row(0, h, j);
        double l = 0;
        if (p.score == Score::additive) {
          for (int64_t c = 0; c < hd; ++c)
            l += double(w->w_score[size_t(h * hd + c)]) *
                 std::tanh(qp[size_t(c)] + kp[size_t(j * hd + c)]);
        } else if (p.score == Score::bilinear) {
          for (int64_t r = 0; r < d; ++r)
            for (int64_t c = 0; c < d; ++c)
              l += double(q[r]) * double(w->w_bilinear[size_t((h * d + r) * d + c)]) * k[c];
        } else {
          for (int64_t c = 0; c < d; ++c) l += double(q[c]) * double(k[c]);
          if (p.score == Score::scaled_dot) l /= std::sqrt(double(d));
        }
        sum += l, sum2 += l * l, count += 1;
      }
    }
  }
  const double mean = sum / count;
  return sum2 / count - mean * mean;
}

TEST(ScoreWeights, SeededWeightsGiveUnitVarianceLogits) {
  // q.k / sqrt(d) has unit variance on these inputs; bilinear and additive are scaled to match
  // (make_score_weights). Given the weights of a head the variance is off by about
  // sqrt(2/d^2) (bilinear) or sqrt(2/h) (additive); over 8 heads, a few percent.
  const Problem base = problem(1, 8, 32, 128, 64, false, 3);
  EXPECT_NEAR(logit_variance(base), 1.0, 0.1);
  EXPECT_NEAR(logit_variance(with_score(base, Score::bilinear)), 1.0, 0.15);
  EXPECT_NEAR(logit_variance(with_score(base, Score::additive)), 1.0, 0.2);
  EXPECT_NEAR(logit_variance(with_score(base, Score::additive, 16)), 1.0, 0.3);
  // dot: sqrt(d) times larger logits
  EXPECT_NEAR(logit_variance(with_score(base, Score::dot)), 64.0, 6.4);
}

TEST(ScoreWeights, FromTheSeedIndependentOfTheInputs) {
  Problem p = with_score(problem(2, 3, 8, 8, 4, false, 11), Score::additive, 6);
  const auto again = make_score_weights(p);
  EXPECT_EQ(p.score_weights->w_q, again->w_q);
  EXPECT_EQ(p.score_weights->w_q.size(), size_t(3 * 6 * 4));
  EXPECT_EQ(p.score_weights->w_score.size(), size_t(3 * 6));
  EXPECT_NE(p.score_weights->w_q, again->w_k);
  Problem other = p;
  other.seed = 12;
  EXPECT_NE(make_score_weights(other)->w_q, p.score_weights->w_q);
  // q, k, v are the same with or without a score
  const Inputs a = generate_inputs(p), b = generate_inputs(problem(2, 3, 8, 8, 4, false, 11));
  EXPECT_EQ(0, std::memcmp(a.q.data(), b.q.data(), size_t(a.q.numel()) * sizeof(float)));
  EXPECT_EQ(make_score_weights(problem(1, 1, 4, 4, 4, false)), nullptr);
}

TEST(Score, ProblemNamesKeepScaledDotAsItWas) {
  Problem p = problem(1, 8, 1024, 0, 64, false, 0);
  EXPECT_EQ(p.str(), "B=1,H=8,n=1024,m=1024,d=64,causal=0,seed=0");
  p.score = Score::dot;
  EXPECT_EQ(p.str(), "B=1,H=8,n=1024,m=1024,d=64,causal=0,score=dot,seed=0");
  p.score = Score::additive;
  EXPECT_EQ(p.str(), "B=1,H=8,n=1024,m=1024,d=64,causal=0,score=additive,h=64,seed=0");
  EXPECT_EQ(parse_score("bilinear"), Score::bilinear);
  EXPECT_CONTAINS(test::error_message<UsageError>([] { parse_score("cosine"); }),
                  "scaled_dot, dot, bilinear, additive");
}

TEST(Score, UnsupportedCombinationsAreRefused) {
  const Problem p = problem(1, 2, 16, 16, 8, false);
  const Inputs in = generate_inputs(p);
  Tensor out(p.q_shape());
  // additive on a variant without its kernels
  auto linear = make_variant("linear");
  EXPECT_FALSE(linear->info().caps.additive);
  EXPECT_CONTAINS(test::error_message<UnsupportedError>([&] {
                    linear->run(with_score(p, Score::additive), in.q.view(), in.k.view(),
                                in.v.view(), out.view());
                  }),
                  "additive");
  // dot and bilinear where the keys are not k
  auto reformer = make_variant("reformer");
  EXPECT_FALSE(reformer->info().caps.linear_score);
  for (Score s : {Score::dot, Score::bilinear})
    EXPECT_CONTAINS(test::error_message<UnsupportedError>([&] {
                      reformer->run(with_score(p, s), in.q.view(), in.k.view(), in.v.view(),
                                    out.view());
                    }),
                    std::string(score_name(s)));
  // weights missing
  Problem bare = p;
  bare.score = Score::bilinear;
  EXPECT_CONTAINS(test::error_message<UsageError>([&] {
                    make_variant("flash")->run(bare, in.q.view(), in.k.view(), in.v.view(),
                                               out.view());
                  }),
                  "weights");
}

// q, k, v of p as .npz arrays.
std::map<std::string, NpyArray> arrays_of(const Problem& p) {
  const Inputs in = generate_inputs(p);
  return {{"q", to_npy(in.q)}, {"k", to_npy(in.k)}, {"v", to_npy(in.v)}};
}

NpyArray floats(std::vector<int64_t> shape, const std::vector<float>& x) {
  NpyArray a{"<f4", std::move(shape), {}};
  a.data.resize(x.size() * sizeof(float));
  std::memcpy(a.data.data(), x.data(), a.data.size());
  return a;
}

TEST(Score, WeightsReadFromTheInputsFile) {
  const Problem seeded = with_score(problem(1, 2, 5, 6, 3, false, 4), Score::additive, 7);
  const ScoreWeights& w = *seeded.score_weights;
  auto arrays = arrays_of(seeded);
  std::vector<float> wq = w.w_q;
  for (float& x : wq) x *= 2;  // not the seeded ones
  arrays["w_q"] = floats({2, 7, 3}, wq);
  arrays["w_k"] = floats({2, 7, 3}, w.w_k);
  arrays["w_score"] = floats({2, 7}, w.w_score);
  Problem p;
  p.score = Score::additive;
  inputs_from_arrays(arrays, "in.npz", &p);
  ASSERT_NE(p.score_weights, nullptr);
  EXPECT_EQ(p.hidden(), 7);  // from the file's w_q
  EXPECT_EQ(p.score_weights->w_q, wq);
  EXPECT_NO_THROW(p.validate());
  // one array missing: named, with the shapes accepted
  auto partial = arrays;
  partial.erase("w_k");
  Problem q;
  q.score = Score::additive;
  const std::string missing =
      test::error_message<InputError>([&] { inputs_from_arrays(partial, "in.npz", &q); });
  EXPECT_CONTAINS(missing, "'w_k'");
  EXPECT_CONTAINS(missing, "[H, h, d]");
  // mis-shaped
  auto bad = arrays;
  bad["w_score"] = floats({2, 6}, std::vector<float>(12, 0.0f));
  Problem r;
  r.score = Score::additive;
  const std::string shape =
      test::error_message<InputError>([&] { inputs_from_arrays(bad, "in.npz", &r); });
  EXPECT_CONTAINS(shape, "'w_score'");
  EXPECT_CONTAINS(shape, "(2, 7)");
  // bilinear, and a file without the score's arrays: the weights are left to the seed
  Problem bl;
  bl.score = Score::bilinear;
  auto bil = arrays_of(seeded);
  inputs_from_arrays(bil, "in.npz", &bl);
  EXPECT_EQ(bl.score_weights, nullptr);
  bil["w_bilinear"] = floats({2, 3, 3}, std::vector<float>(18, 0.5f));
  inputs_from_arrays(bil, "in.npz", &bl);
  ASSERT_NE(bl.score_weights, nullptr);
  EXPECT_EQ(bl.score_weights->w_bilinear, std::vector<float>(18, 0.5f));
}

TEST(Score, FlashAdditiveMatchesFullAndTheReference) {
  // larger than the ragged shapes of VariantTest: several query tiles and key blocks
  const Problem p = with_score(problem(1, 2, 300, 517, 64, true, 9), Score::additive);
  const Inputs in = generate_inputs(p);
  const Tensor flash = test::run("flash:block_q=64,block_k=128", p, in);
  const Tensor full = test::run("full", p, in);
  const std::vector<double> ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
  const double tol = attention_tolerance(p, Workload{});
  EXPECT_LE(test::rel_fro_error(flash.data(), ref), tol);
  EXPECT_LE(test::rel_fro_error(full.data(), ref), tol);
  // and far from scaled_dot on the same inputs, so the comparison can fail
  const Problem plain = problem(1, 2, 300, 517, 64, true, 9);
  const Tensor dot = test::run("flash", plain, in);
  EXPECT_GT(test::rel_fro_error(dot.data(), ref), 100 * tol);
}

TEST(Score, SweepPlansEveryScoreWithItsWeights) {
  SweepAxes axes;
  axes.seqs = {16};
  axes.batches = {1};
  axes.heads = {2};
  axes.dims = {8};
  axes.causals = {false};
  axes.inputs = {"gaussian"};
  axes.scores = parse_score_list("scaled_dot,additive,bilinear");
  const SweepPlan plan = plan_sweep(make_sweep_variants({"flash"}), axes);
  ASSERT_EQ(plan.configs.size(), 3u);
  EXPECT_EQ(plan.configs[0].problem.score_weights, nullptr);
  EXPECT_EQ(plan.configs[1].problem.score, Score::additive);
  ASSERT_NE(plan.configs[1].problem.score_weights, nullptr);
  ASSERT_NE(plan.configs[2].problem.score_weights, nullptr);
  EXPECT_CONTAINS(test::error_message<UsageError>([] { parse_score_list("dot,cosine"); }),
                  "cosine");
}

TEST(Score, OlderResultsWithoutTheScoreColumnResumeAsScaledDot) {
  test::TempDir dir;
  // a results.csv as written before the score columns
  Row row;
  row.spec = "flash";
  row.problem = problem(1, 8, 256, 0, 64, false, 0);
  row.workload.threads = 1;
  row.status = "unsupported";
  // the line this version writes, less the two fields
  const auto fields = split_csv_line(csv_line(row));
  std::string header, line;
  for (size_t i = 0; i < fields.size(); ++i) {
    const std::string& c = csv_columns()[i];
    if (c == "score" || c == "score_hidden") continue;
    header += (header.empty() ? "" : ",") + c;
    line += (i == 0 ? "" : ",") + csv_quote(fields[i]);
  }
  test::write_text(dir.file("results.csv"), header + "\n" + line + "\n");
  ResultsDir results(dir.path().string(), /*resume=*/true);
  EXPECT_EQ(results.rows_kept(), 1);
  EXPECT_TRUE(results.done(row));  // the same row under scaled_dot
  Row additive = row;
  additive.problem = with_score(row.problem, Score::additive);
  EXPECT_FALSE(results.done(additive));
  const auto lines = test::read_lines(dir.file("results.csv"));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(split_csv_line(lines[0]), csv_columns());
  EXPECT_EQ(lines[1], csv_line(row));
}

}  // namespace
}  // namespace attnbench
