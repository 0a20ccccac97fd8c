// Numerical range of the exact variants and of the harness: logits far past exp's range,
// values near FLT_MAX, logits that overflow float, scales that do not fit a float, and error
// figures that are not finite. The rule: a result is finite and exact whenever the float64
// reference is finite, or it is not finite at all (the harness reports an error), never a
// finite wrong value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/reference/reference.h"
#include "harness/machine.h"
#include "harness/metrics.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::rel_fro_error;

bool all_finite(const Tensor& t) {
  return std::all_of(t.data(), t.data() + t.numel(), [](float x) { return std::isfinite(x); });
}

// Every exact variant with its default parameters, and flash with small tiles (many key
// blocks per row, so the online rescaling between blocks is exercised too).
std::vector<std::string> exact_specs() {
  std::vector<std::string> specs;
  for (const VariantInfo* v : Registry::instance().all())
    if (v->caps.exact) specs.push_back(v->name);
  specs.push_back("flash:block_q=16,block_k=16");
  return specs;
}

// Ragged shapes, causal and not, the first within one key block, the others across several.
const std::tuple<int64_t, int64_t, int64_t, bool> kShapes[] = {{37, 53, 13, false},
                                                               {37, 53, 13, true},
                                                               {53, 37, 13, true},
                                                               {150, 600, 13, false},
                                                               {150, 600, 20, true}};

class ExactNumerics : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { variant_ = make_variant(GetParam()); }

  // p adjusted to what the variant supports (m = n without cross-attention, no mask without
  // causal support, always the mask for a causal-only variant).
  Problem problem(int64_t n, int64_t m, int64_t d, bool causal, uint64_t seed) const {
    const Capabilities& caps = variant_->info().caps;
    return test::problem(1, 2, n, caps.cross ? m : 0, d,
                         (causal && caps.causal) || caps.causal_only, seed);
  }

  std::vector<double> reference(const Problem& p, const Inputs& in) const {
    auto pattern = variant_->make_pattern(p, in.q.view(), in.k.view());
    return reference_attention(p, in.q.view(), in.k.view(), in.v.view(), pattern.get());
  }

  Tensor run(const Problem& p, const Inputs& in) const {
    Tensor out(p.q_shape());
    variant_->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    return out;
  }

  // The output is finite and within tol of the reference (which must be finite itself).
  void expect_exact(const Problem& p, const Inputs& in, double tol) const {
    SCOPED_TRACE(p.str());
    const std::vector<double> ref = reference(p, in);
    ASSERT_TRUE(std::all_of(ref.begin(), ref.end(), [](double x) { return std::isfinite(x); }));
    Tensor out = run(p, in);
    int64_t bad = 0;
    for (int64_t i = 0; i < out.numel(); ++i) bad += !std::isfinite(out.data()[i]);
    EXPECT_EQ(bad, 0) << "non-finite outputs where the reference is finite";
    EXPECT_LE(rel_fro_error(out.data(), ref), tol);
  }

  std::unique_ptr<Variant> variant_;
};

TEST_P(ExactNumerics, HugeLogitScaleStaysFiniteAndExact) {
  // q scaled by 1e9 and 1e30: logits of that size in float, attention one-hot up to
  // exp(-huge) = 0, the output the value row of each row's top key. Rounding max s and x s
  // separately puts x s - max s past exp's range here; the max must go first.
  for (double scale : {1e9, 1e30})
    for (auto [n, m, d, causal] : kShapes) {
      const Problem p = problem(n, m, d, causal, 21);
      const Workload w = test::workload("gaussian", scale);
      ASSERT_NO_THROW(w.validate(p));
      expect_exact(p, generate_inputs(p, w), 1e-5);
    }
}

TEST_P(ExactNumerics, ValuesNearFloatMaxGiveFiniteExactOutput) {
  // |v| up to 3e38 (finite): the output, a convex combination of v rows, is finite, but
  // sum_j p_j v_j over a few keys of similar weight is not, in float
  for (auto [n, m, d, causal] : kShapes) {
    Problem p = problem(n, m, d, causal, 22);
    Inputs in = generate_inputs(p);
    const int64_t dim = p.dim;
    float* v = in.v.data();
    for (int64_t i = 0; i < in.v.numel(); ++i) {
      const float sign = (i % dim) % 3 == 0 ? -1.0f : 1.0f;
      v[i] = sign * 3e38f * (0.75f + 0.25f * std::tanh(v[i]));
    }
    expect_exact(p, in, 1e-5);
    // and with larger logits too (fewer keys share the weight)
    Inputs in4 = generate_inputs(p, test::workload("gaussian", 4));
    std::copy(in.v.data(), in.v.data() + in.v.numel(), in4.v.data());
    expect_exact(p, in4, 1e-5);
  }
}

TEST_P(ExactNumerics, LogitsPastFloatAreNeverFiniteAndWrong) {
  // |q| = |k| = 1e20: every product q_c k_c is +-1e40, inf in float, so the float logits are
  // +-inf or NaN while the float64 reference is finite. A float kernel cannot compute this;
  // it must not return a finite wrong answer (the harness turns non-finite outputs into an
  // error). Signs: random (NaN logits), all q = -k (every logit -inf), all equal (+inf).
  for (int mode = 0; mode < 3; ++mode)
    for (auto [n, m, d, causal] : kShapes) {
      Problem p = problem(n, m, d, causal, 23);
      SCOPED_TRACE(p.str() + " mode " + std::to_string(mode));
      Inputs in = generate_inputs(p);
      for (Tensor* t : {&in.q, &in.k}) {
        const float sign = mode == 1 && t == &in.k ? -1.0f : 1.0f;
        for (int64_t i = 0; i < t->numel(); ++i) {
          float& x = t->data()[i];
          x = sign * (mode == 0 ? std::copysign(1e20f, x) : 1e20f) * (1.0f + 0.01f * (i % 7));
        }
      }
      Tensor out = run(p, in);
      if (!all_finite(out)) continue;  // reported as an error: fine
      // finite: then it must be right
      const std::vector<double> ref = reference(p, in);
      EXPECT_LE(rel_fro_error(out.data(), ref), 1e-5) << "a finite wrong output";
    }
}

INSTANTIATE_TEST_SUITE_P(Exact, ExactNumerics, testing::ValuesIn(exact_specs()),
                         test::spec_test_name);

// ----- the workload's scale, as the kernels see it -----

TEST(WorkloadScale, ValidateChecksTheFloatValue) {
  const Problem p = test::problem(1, 1, 8, 8, 16, false);
  Workload w;
  for (double ok : {1e-30, 1.0, 1e9, 1e30, 3e38}) {
    w.scale = ok;
    EXPECT_NO_THROW(w.validate(p)) << ok;
  }
  // finite as a double, inf as a float: once status ok with error -nan
  w.scale = 1e39;
  const std::string msg = test::error_message<UsageError>([&] { w.validate(p); });
  EXPECT_CONTAINS(msg, "scale");
  EXPECT_CONTAINS(msg, "float32");
  EXPECT_CONTAINS(msg, "accepted range");
  EXPECT_CONTAINS(msg, "3.402823e+38");
  EXPECT_CONTAINS(msg, "1e+39");
  // 0 in float, or 0 once divided by sqrt(d); and what was refused before
  for (double bad : {1e-50, 2e-45, 0.0, -1.0, double(NAN), double(INFINITY), 1e300}) {
    w.scale = bad;
    EXPECT_THROW(w.validate(p), UsageError) << bad;
  }
}

TEST(WorkloadScale, ScaleThatOverflowsQIsAnInputError) {
  // 3e38 is finite in float, but q = N(0, 1) 3e38 is not for |N| > 1.14
  const Problem p = test::problem(1, 1, 64, 64, 16, false);
  const Workload w = test::workload("gaussian", 3e38);
  ASSERT_NO_THROW(w.validate(p));
  const std::string msg = test::error_message<InputError>([&] { generate_inputs(p, w); });
  EXPECT_CONTAINS(msg, "overflows q");
}

// ----- error figures that are not finite -----

TEST(ErrorMetrics, NonFiniteOutputOrReferenceThrows) {
  Problem p = test::problem(1, 2, 20, 30, 8, false);
  Inputs in = generate_inputs(p);
  Tensor out(p.q_shape());
  const std::vector<double> ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
  std::copy(ref.begin(), ref.end(), out.data());
  const ErrorStats e = measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  EXPECT_LT(e.rel_fro, 1e-6);
  // a NaN in the output
  out.data()[5] = NAN;
  std::string msg = test::error_message<Error>(
      [&] { measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view()); });
  EXPECT_CONTAINS(msg, "the output");
  out.data()[5] = INFINITY;
  EXPECT_THROW(measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view()), Error);
  // a finite output against a reference that is not: inf in q makes its logits inf/NaN
  out.data()[5] = 0;
  in.q.data()[3] = INFINITY;
  msg = test::error_message<Error>(
      [&] { measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view()); });
  EXPECT_CONTAINS(msg, "float64 reference");
}

TEST(ErrorMetrics, FiguresAreTheirFloat64Definitions) {
  // rel_fro_error, max_abs_error and mean_cosine against their definitions written out in
  // float64, on every row (a problem small enough for the whole reference). Head 1's values
  // are zero, so its reference rows are zero: a zero output row there counts cosine 1 and a
  // nonzero one cosine 0, as does a zero output row against a nonzero reference row in head 0.
  const Problem p = test::problem(1, 2, 20, 30, 8, false);
  Inputs in = generate_inputs(p);
  for (int64_t j = 0; j < p.keys(); ++j) std::fill_n(in.v.view().row(0, 1, j), p.dim, 0.f);
  const std::vector<double> ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
  Tensor out(p.q_shape());
  for (size_t t = 0; t < ref.size(); ++t)
    out.data()[t] = float(ref[t] * (1.0 + 0.4 * std::sin(double(t))) + 0.05 * std::cos(3.0 * t));
  std::fill_n(out.view().row(0, 0, 2), p.dim, 0.f);  // zero against nonzero: cosine 0
  std::fill_n(out.view().row(0, 1, 0), p.dim, 0.f);  // zero against zero: cosine 1
  for (int64_t i = 2; i < p.n; ++i) std::fill_n(out.view().row(0, 1, i), p.dim, 0.f);
  // out row (0, 1, 1) stays nonzero against a zero reference row: cosine 0
  double diff2 = 0, ref2 = 0, max_abs = 0, cos_sum = 0;
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t i = 0; i < p.n; ++i) {
      const float* o = out.view().row(0, h, i);
      const double* r = ref.data() + size_t((h * p.n + i) * p.dim);
      double dot = 0, oo = 0, rr = 0;
      for (int64_t c = 0; c < p.dim; ++c) {
        diff2 += (o[c] - r[c]) * (o[c] - r[c]);
        ref2 += r[c] * r[c];
        max_abs = std::max(max_abs, std::abs(o[c] - r[c]));
        dot += o[c] * r[c];
        oo += double(o[c]) * o[c];
        rr += r[c] * r[c];
      }
      cos_sum += oo == 0 && rr == 0 ? 1.0 : oo == 0 || rr == 0 ? 0.0 : dot / std::sqrt(oo * rr);
    }
  const ErrorStats e = measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  ASSERT_EQ(e.rows_used, p.heads * p.n);
  EXPECT_EQ(e.rows_total, p.heads * p.n);
  EXPECT_NEAR(e.rel_fro, std::sqrt(diff2 / ref2), 1e-12);
  EXPECT_NEAR(e.max_abs, max_abs, 1e-12);
  EXPECT_NEAR(e.mean_cos, cos_sum / double(p.heads * p.n), 1e-12);
  // the perturbation is large enough for the cosine to tell: well below 1, above the 2 of the
  // 40 rows counted 0 alone
  EXPECT_LT(e.mean_cos, 0.97);
  EXPECT_GT(e.mean_cos, 0.5);
  // the exact output has cosine 1 on every row (zero rows of head 1 included)
  Tensor exact(p.q_shape());
  std::copy(ref.begin(), ref.end(), exact.data());
  EXPECT_NEAR(measure_error(p, in.q.view(), in.k.view(), in.v.view(), exact.view()).mean_cos, 1.0,
              1e-6);
}

TEST(ErrorMetrics, UniformErrorIsTheErrorOfAveragingTheVisibleKeys) {
  // causal with m != n, key padding and an additive mask holding -inf and finite biases
  Problem p = test::problem(2, 2, 9, 13, 5, true);
  p.key_lengths = {13, 7};
  auto mask = std::make_shared<AttnMask>();
  mask->batch = 1, mask->heads = 2, mask->n = p.n, mask->m = p.keys();
  mask->bias.resize(size_t(2 * p.n * p.keys()));
  for (size_t t = 0; t < mask->bias.size(); ++t)
    mask->bias[t] = t % 5 == 0 ? -INFINITY : float(t % 3) * 0.5f;
  p.attn_mask = mask;
  Inputs in = generate_inputs(p);
  // the uniform-average output written out by hand: weights exp(bias) over visible keys
  Tensor uni(p.q_shape());
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.n; ++i) {
        const int64_t last = std::min<int64_t>({i + p.keys() - p.n, p.key_lengths[size_t(b)] - 1});
        double wsum = 0;
        std::vector<double> o(size_t(p.dim), 0.0);
        for (int64_t j = 0; j <= last; ++j) {
          const double w = std::exp(double(mask->at(b, h, i, j)));
          wsum += w;
          for (int64_t c = 0; c < p.dim; ++c) o[size_t(c)] += w * in.v.view().row(b, h, j)[c];
        }
        for (int64_t c = 0; c < p.dim; ++c)
          uni.view().row(b, h, i)[c] = wsum > 0 ? float(o[size_t(c)] / wsum) : 0.f;
      }
  std::vector<int64_t> rows(size_t(p.n));
  for (int64_t i = 0; i < p.n; ++i) rows[size_t(i)] = i;
  std::vector<double> got(size_t(p.n * p.dim));
  uniform_rows(p, in.k.view(), in.v.view(), 1, 1, rows, got.data());
  for (int64_t i = 0; i < p.n; ++i)
    for (int64_t c = 0; c < p.dim; ++c)
      EXPECT_NEAR(got[size_t(i * p.dim + c)], uni.view().row(1, 1, i)[c], 1e-6) << i << "," << c;
  // the uniform output's own error is the uniform_error every row reports
  const ErrorStats e = measure_error(p, in.q.view(), in.k.view(), in.v.view(), uni.view());
  EXPECT_GT(e.uniform_rel_fro, 0.05);
  EXPECT_NEAR(e.rel_fro, e.uniform_rel_fro, 1e-6 * e.uniform_rel_fro);
  // and an output of zeros has error 1
  Tensor zero(p.q_shape());
  std::fill(zero.data(), zero.data() + zero.numel(), 0.f);
  EXPECT_NEAR(measure_error(p, in.q.view(), in.k.view(), in.v.view(), zero.view()).rel_fro, 1.0,
              1e-12);
}

TEST(ErrorMetrics, KeptReferenceRowsFollowTheInputs) {
  // measure_error keeps the last problem's reference rows: inputs that change under the same
  // problem name (a file, a new mask bias) must never be measured against stale rows
  Problem p = test::problem(1, 2, 600, 600, 8, false);
  Inputs in = generate_inputs(p);
  auto exact_out = [&] {
    Tensor out(p.q_shape());
    const auto ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
    std::copy(ref.begin(), ref.end(), out.data());
    return out;
  };
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    if (round == 1) in.v.data()[17] += 1.0f;  // one value changes
    if (round == 2) in.k.data()[3] -= 0.5f;   // one key changes
    const Tensor out = exact_out();
    const ErrorStats first = measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    const ErrorStats again = measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    EXPECT_LT(first.rel_fro, 1e-6);
    EXPECT_EQ(first.rel_fro, again.rel_fro);
    EXPECT_EQ(first.uniform_rel_fro, again.uniform_rel_fro);
  }
  // sampled rows (a smaller limit) are picked and measured afresh, not taken from the cache
  const Tensor out = exact_out();
  const ErrorStats all = measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  const ErrorStats sampled =
      measure_error(p, in.q.view(), in.k.view(), in.v.view(), out.view(), 1e5);
  EXPECT_LT(sampled.rows_used, all.rows_used);
  EXPECT_LT(sampled.rel_fro, 1e-6);
}

TEST(ErrorMetrics, RunOneNeverReportsOkWithANonFiniteError) {
  test::ScopedThreads threads(1);
  MachineFigures mf;
  RunOptions opt{.reps = 1, .min_time = 0.001};
  const Problem p = test::problem(1, 2, 40, 60, 16, false);
  Workload w = test::workload("file");
  w.threads = 1;
  for (const char* spec : {"full", "flash", "local"}) {
    SCOPED_TRACE(spec);
    auto v = make_variant(spec);
    // inputs whose reference is not finite: an error row
    Inputs bad = generate_inputs(p);
    bad.q.data()[7] = INFINITY;
    Row row = run_one(*v, p, w, &bad, mf, opt);
    EXPECT_EQ(row.status, "error") << row.message;
    EXPECT_FALSE(row.message.empty());
    // v near FLT_MAX: finite, so ok, and the error finite and small
    Inputs big = generate_inputs(p);
    for (int64_t i = 0; i < big.v.numel(); ++i)
      big.v.data()[i] = 3e38f * std::tanh(big.v.data()[i]);
    row = run_one(*v, p, w, &big, mf, opt);
    EXPECT_EQ(row.status, "ok") << row.message;
    EXPECT_TRUE(std::isfinite(row.error.rel_fro));
    EXPECT_LT(row.error.rel_fro, 1e-5);
  }
  // a scale whose q overflows float: an error row, not ok with a NaN error
  auto v = make_variant("flash");
  w = test::workload("gaussian", 3e38);
  w.threads = 1;
  Row row = run_one(*v, p, w, nullptr, mf, opt);
  EXPECT_EQ(row.status, "error");
  EXPECT_CONTAINS(row.message, "overflows q");
}

}  // namespace
}  // namespace attnbench
