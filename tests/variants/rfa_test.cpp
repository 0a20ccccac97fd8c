// Random Feature Attention (variants/rfa.cpp): plain and gated forms against their float64
// oracle on ragged shapes and across blocks, the oracle's distance from plausible wrong
// answers, the law (error against softmax(q^.k^ / sigma^2) falls as D^-1/2), the refusal of
// non-causal gating, causality, seeding, and the count of rows raised to the denominator floor.
#include <gtest/gtest.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/reference/reference.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::rel_fro_error;
using test::run;

// ----- against the oracle -----

TEST(Rfa, MatchesItsFormulaOnRaggedShapesPlainAndGated) {
  struct Case {
    const char* spec;
    bool gated;
  };
  // the plain form at 2 D = 256 features runs blocks of R = 256 rows (n = 300 crosses one),
  // at 2 D = 74 blocks of 512; the gated recurrence maps features in blocks of 256 keys
  const Case cases[] = {{"rfa", false},
                        {"rfa:features=37,sigma=1.5", false},
                        {"rfa:gate=true", true},
                        {"rfa:gate=true,features=50,sigma=0.8", true}};
  const int64_t lens[] = {1, 7, 113, 300}, dims[] = {1, 17, 64};
  for (const Case& c : cases) {
    double worst = 0;
    for (int64_t n : lens)
      for (int64_t m : lens)
        for (int64_t d : dims)
          for (bool causal : {false, true}) {
            if ((n == 300 || m == 300) && d != 17) continue;  // keep it quick
            const Problem p = test::problem(2, 2, n, m, d, causal, uint64_t(n + 3 * m + d));
            SCOPED_TRACE(std::string(c.spec) + " " + p.str());
            const Inputs in = generate_inputs(p);
            if (c.gated && !causal) {
              auto v = make_variant(c.spec);
              Tensor out(p.q_shape());
              EXPECT_THROW(v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()),
                           UnsupportedError);
              continue;
            }
            const test::Expected e = test::expected(c.spec, p, in);
            const double err = rel_fro_error(run(c.spec, p, in).data(), e.out);
            EXPECT_LE(err, e.tolerance);
            worst = std::max(worst, err / e.tolerance);
          }
    std::printf("[ oracle ] %-40s worst error %.3f of its tolerance\n", c.spec, worst);
  }
}

TEST(Rfa, GatedLongSequenceMatchesItsFormula) {
  // many 256-key blocks, m != n both ways, one head per thread and more
  for (auto [n, m] : {std::pair<int64_t, int64_t>{1000, 1000}, {700, 1100}, {1100, 700}}) {
    const Problem p = test::problem(1, 3, n, m, 32, true, 12);
    SCOPED_TRACE(p.str());
    test::expect_matches_oracle("rfa:gate=true", p, generate_inputs(p));
  }
}

TEST(Rfa, KeyPaddingMatchesItsFormula) {
  // plain and gated under key padding: lengths past the 256-key blocks of the gated recurrence,
  // inside them, 0 and 1; m != n both ways, so rows whose causal prefix ends in the padding
  // read the state after the last valid key
  for (const char* spec : {"rfa", "rfa:features=37,sigma=1.5", "rfa:gate=true"})
    for (auto [n, m] : {std::pair<int64_t, int64_t>{300, 300}, {113, 700}, {600, 113}})
      for (bool causal : {false, true}) {
        if (!causal && std::string(spec) == "rfa:gate=true") continue;
        Problem p = test::problem(3, 2, n, m, 17, causal, uint64_t(n + m));
        p.key_lengths = {m * 2 / 3 + 1, 0, 1};
        SCOPED_TRACE(std::string(spec) + " " + p.str());
        const Inputs in = generate_inputs(p);
        test::expect_matches_oracle(spec, p, in);
        // the padded oracle is far from the unpadded one (what ignoring the padding gives)
        Problem unpadded = p;
        unpadded.key_lengths.clear();
        test::expect_oracle_far_from(spec, p, in, test::expected(spec, unpadded, in).out);
      }
}

// The oracle differs from what a plausible mistake would give by far more than its tolerance.
TEST(Rfa, OracleIsFarFromPlausibleWrongAnswers) {
  const Problem p = test::problem(1, 2, 113, 113, 17, true, 3);
  const Inputs in = generate_inputs(p);
  // gated, but the gate ignored (the plain form)
  test::expect_oracle_far_from("rfa:gate=true", p, in, test::expected("rfa", p, in).out);
  // sigma^2 where the kernel identity needs sigma^-2 as the variance of W
  test::expect_oracle_far_from("rfa:sigma=0.7", p, in,
                               test::expected("rfa:sigma=1.4285714", p, in).out);
  // features from another seed's W (a projection not drawn from the problem's seed)
  Problem other = p;
  other.seed = 4;
  test::expect_oracle_far_from("rfa", p, in, test::expected("rfa", other, in).out);
  // the non-causal sums under a causal problem
  Problem full = p;
  full.causal = false;
  test::expect_oracle_far_from("rfa", p, in, test::expected("rfa", full, in).out);
}

// ----- the law: error against softmax(q^.k^ / sigma^2) ~ D^-1/2 -----

// Inputs with unit-norm rows of q and k (v as generated).
Inputs unit_inputs(const Problem& p) {
  Inputs in = generate_inputs(p);
  for (Tensor* t : {&in.q, &in.k})
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < t->shape().len; ++i) {
          float* r = t->view().row(b, h, i);
          double ss = 0;
          for (int64_t c = 0; c < p.dim; ++c) ss += double(r[c]) * r[c];
          for (int64_t c = 0; c < p.dim; ++c) r[c] = float(r[c] / std::sqrt(ss));
        }
  return in;
}

// Each kernel value phi(q)^T phi(k) is a mean of D cosines cos(w.(q^ - k^)), an unbiased
// estimate of exp(-|q^ - k^|^2 / 2 sigma^2) with standard deviation ~ D^-1/2; the output is
// a ratio of such sums, whose error is to first order linear in theirs (bias O(1/D)). The
// log-log slope of the mean error against D is therefore near -1/2; [-0.65, -0.35] leaves
// room for the 1/D terms at D = 16 and the noise of 4-seed means.
TEST(Rfa, SoftmaxErrorOnUnitVectorsFallsAsOneOverSqrtFeatures) {
  const double sigma = 1.0;
  Problem p = test::problem(1, 2, 256, 256, 16, false, 1);
  const Inputs in = unit_inputs(p);
  // the reference scales logits by 1/sqrt(d): q sqrt(d) / sigma^2 gives logits q^.k^ / sigma^2
  Tensor qs = test::copy(in.q);
  const float up = float(std::sqrt(double(p.dim)) / (sigma * sigma));
  for (int64_t i = 0; i < qs.numel(); ++i) qs.data()[i] *= up;
  ASSERT_FLOAT_EQ(p.softmax_scale(), float(1.0 / std::sqrt(double(p.dim))));
  const auto ref = reference_attention(p, qs.view(), in.k.view(), in.v.view());
  std::vector<double> counts, errors;
  double prev = INFINITY;
  for (int64_t D : {16, 64, 256, 1024}) {
    double err = 0;
    const int seeds = 4;
    for (int s = 0; s < seeds; ++s) {
      Problem ps = p;
      ps.seed = uint64_t(200 + s);
      err += rel_fro_error(run("rfa:features=" + std::to_string(D), ps, in).data(), ref) / seeds;
    }
    EXPECT_LT(err, prev) << "features " << D;
    prev = err;
    counts.push_back(double(D)), errors.push_back(err);
  }
  const double slope = test::loglog_slope(counts, errors);
  RecordProperty("slope", std::to_string(slope));
  std::printf("[ law ] rfa error against softmax: slope %.3f, error %.4f at D = 1024\n", slope,
              prev);
  EXPECT_GE(slope, -0.65);
  EXPECT_LE(slope, -0.35);
}

// ----- refusals, causality, seeding -----

TEST(Rfa, GatedRefusesNonCausalWithAClearMessage) {
  const Problem p = test::problem(1, 2, 16, 16, 8, false);
  const Inputs in = generate_inputs(p);
  auto v = make_variant("rfa:gate=true");
  Tensor out(p.q_shape());
  const std::string msg = test::error_message<UnsupportedError>(
      [&] { v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()); });
  EXPECT_CONTAINS(msg, "gate=true");
  EXPECT_CONTAINS(msg, "causal");
}

TEST(Rfa, LaterValuesNeverReachEarlierRows) {
  for (const char* spec : {"rfa", "rfa:gate=true"}) {
    SCOPED_TRACE(spec);
    test::expect_later_values_never_reach_earlier_rows(
        spec, test::problem(1, 2, 300, 300, 16, true), 140);
  }
}

TEST(Rfa, SameSeedSameOutputOtherSeedOtherOutput) {
  for (const char* spec : {"rfa", "rfa:gate=true"})
    for (bool causal : {false, true}) {
      if (!causal && std::strstr(spec, "gate")) continue;
      SCOPED_TRACE(std::string(spec) + (causal ? " causal" : ""));
      Problem p = test::problem(2, 3, 100, 80, 16, causal, 5);
      const Inputs in = generate_inputs(p);
      const Tensor a = run(spec, p, in), b = run(spec, p, in);
      const size_t bytes = size_t(a.numel()) * sizeof(float);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), bytes), 0);
      Problem q = p;
      q.seed = 6;  // same inputs, other W and gates
      const Tensor c = run(spec, q, in);
      EXPECT_GT(rel_fro_error(c.data(), std::vector<double>(a.data(), a.data() + a.numel())), 1e-3);
      // a head's draws depend on its index, not on the number of heads
      Problem two = p;
      two.heads = 2;
      const Tensor e = run(spec, two, generate_inputs(two));
      for (int64_t bi = 0; bi < p.batch; ++bi)
        for (int64_t h = 0; h < 2; ++h)
          EXPECT_EQ(std::memcmp(e.view().head(bi, h), a.view().head(bi, h),
                                size_t(p.n * p.dim) * sizeof(float)),
                    0);
    }
}

// ----- the denominator floor -----

// The count in notes() ("N of M query rows ..."), or -1 if notes() is empty.
int64_t clamped_in_notes(const Variant& v) {
  const std::string notes = v.notes();
  if (notes.empty()) return -1;
  int64_t clamped = -1, rows = -1;
  EXPECT_EQ(std::sscanf(notes.c_str(), "%" SCNd64 " of %" SCNd64, &clamped, &rows), 2) << notes;
  return clamped;
}

// d = 1, one frequency, every q = +1 and every k = -1: each kernel value of head h is
// cos(2 w_h), so a row that sees c keys has the denominator c cos(2 w_h) (gated: the key
// weight times cos(2 w_h)) and is raised to the floor exactly when cos(2 w_h) is below
// exp(-2) / 4. An unraised plain row is the mean of its visible values; a raised one is that
// mean times cos(2 w_h) / (exp(-2) / 4). The test counts the rows that are not the mean.
TEST(Rfa, NotesCountTheRowsRaisedToTheFloor) {
  Problem p = test::problem(1, 24, 40, 40, 1, true, 31);
  Inputs in = generate_inputs(p);
  std::fill(in.q.data(), in.q.data() + in.q.numel(), 1.0f);
  std::fill(in.k.data(), in.k.data() + in.k.numel(), -1.0f);
  auto plain = make_variant("rfa:features=1");
  Tensor out(p.q_shape());
  plain->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  int64_t not_mean = 0;
  for (int64_t h = 0; h < p.heads; ++h) {
    double sum = 0;
    for (int64_t i = 0; i < p.n; ++i) {
      sum += in.v.view().row(0, h, i)[0];
      const double mean = sum / double(i + 1), o = out.view().row(0, h, i)[0];
      not_mean += std::abs(o - mean) > 1e-4 * std::max(1.0, std::abs(mean));
    }
  }
  const int64_t rows = p.heads * p.n;
  EXPECT_GT(not_mean, 0);  // both kinds of head occur under this seed
  EXPECT_LT(not_mean, rows);
  EXPECT_EQ(clamped_in_notes(*plain), not_mean) << plain->notes();
  EXPECT_CONTAINS(plain->notes(), " of " + std::to_string(rows) + " query rows");
  // the oracle applies the same floor
  test::expect_matches_oracle("rfa:features=1", p, in);
  // non-causal: every row of the same heads (each causal row here sees at least one key)
  Problem full = p;
  full.causal = false;
  plain->run(full, in.q.view(), in.k.view(), in.v.view(), out.view());
  EXPECT_EQ(clamped_in_notes(*plain), not_mean) << plain->notes();
  test::expect_matches_oracle("rfa:features=1", full, in);
  // gated: the same W, so the same heads fall below the floor, every row of them
  auto gated = make_variant("rfa:features=1,gate=true");
  gated->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  EXPECT_EQ(clamped_in_notes(*gated), not_mean) << gated->notes();
  test::expect_matches_oracle("rfa:features=1,gate=true", p, in);
  // ordinary inputs at the default D raise no row: notes() stays empty
  const Problem q = test::problem(2, 2, 200, 200, 64, true, 9);
  const Inputs iq = generate_inputs(q);
  for (const char* spec : {"rfa", "rfa:gate=true"}) {
    auto v = make_variant(spec);
    Tensor o(q.q_shape());
    v->run(q, iq.q.view(), iq.k.view(), iq.v.view(), o.view());
    EXPECT_EQ(v->notes(), "") << spec;
  }
}

}  // namespace
}  // namespace attnbench
