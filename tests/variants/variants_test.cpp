// Every registered variant against its oracle (the exact double-precision reference restricted
// to its pattern, or the float64 statement of its own function), on ragged shapes, causal and
// not, self- and cross-attention; plus the input generators.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/reference/oracle.h"
#include "common/reference/reference.h"
#include "test_util.h"
#include "tests/padded_keys.h"

namespace attnbench {
namespace {

using test::rel_fro_error;

// Why `info` cannot be checked, or "" if it can: an approximation (exact = false) must give an
// oracle, a float64 statement of its own function (common/reference/oracle.h); an exact variant is
// checked against softmax attention restricted to its pattern.
std::string missing_oracle(const VariantInfo& info) {
  if (info.caps.exact || info.oracle) return "";
  return "variant '" + info.name +
         "' says exact = false but gives no oracle: set VariantInfo::oracle to a float64 "
         "statement of its function (common/reference/oracle.h), and VariantInfo::tolerance if its "
         "float32 arithmetic has a longer error chain than softmax attention";
}

bool supports(const VariantInfo& info, const Problem& p) {
  const bool linear = p.score == Score::dot || p.score == Score::bilinear;
  return (!p.causal || info.caps.causal) && (p.causal || !info.caps.causal_only) &&
         (p.keys() == p.n || info.caps.cross) && (!linear || info.caps.linear_score) &&
         (p.score != Score::additive || info.caps.additive) &&
         (p.key_lengths.empty() || info.caps.key_padding) && (!p.attn_mask || info.caps.attn_mask);
}

using test::problem;

// Runs `spec` on p with generated inputs; returns the output.
Tensor run_variant(Variant& v, const Problem& p, const Inputs& in) {
  Tensor out(p.q_shape());
  v.run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  return out;
}

bool all_finite(const Tensor& t) {
  return std::all_of(t.data(), t.data() + t.numel(), [](float x) { return std::isfinite(x); });
}

class VariantTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    info_ = Registry::instance().find(GetParam());
    ASSERT_NE(info_, nullptr);
    ASSERT_EQ(missing_oracle(*info_), "");
    variant_ = make_variant(GetParam());
  }

  // Checks the variant on p against its oracle (or that it refuses p, if its capabilities say
  // so).
  void check(const Problem& p, const Workload& w = Workload{}) {
    SCOPED_TRACE(describe(p, w));
    Inputs in = generate_inputs(p, w);
    Tensor out(p.q_shape());
    if (!supports(*info_, p)) {
      EXPECT_THROW(variant_->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()),
                   UnsupportedError);
      return;
    }
    variant_->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    ASSERT_TRUE(all_finite(out));
    expect_matches_oracle(out.data(), p, in, w);
  }

  // Its oracle's output (for an exact variant softmax attention restricted to its own
  // pattern), within the tolerance of its error model.
  void expect_matches_oracle(const float* out, const Problem& p, const Inputs& in,
                             const Workload& w = Workload{}) const {
    const test::Expected e = test::expected(*variant_, p, in, w);
    EXPECT_LE(rel_fro_error(out, e.out), e.tolerance);
  }

  const VariantInfo* info_ = nullptr;
  std::unique_ptr<Variant> variant_;
};

TEST_P(VariantTest, MatchesReferenceOnRaggedShapes) {
  const int64_t lens[] = {1, 7, 113, 1000}, dims[] = {1, 17, 64};
  for (int64_t n : lens)
    for (int64_t m : lens)
      for (int64_t d : dims)
        for (bool causal : {false, true}) {
          // B = H = 2 where it is cheap, one head when the score matrix is large.
          const int64_t bh = n * m >= 100000 ? 1 : 2;
          // m = 0 means m = n; pass it explicitly anyway, both spellings must work
          check(problem(bh, bh, n, m == n && d == 17 ? 0 : m, d, causal));
        }
}

// Every scoring function on ragged shapes: dot and bilinear through Variant::compute's map of
// q (an exact variant against the float64 reference, which forms those logits itself; an
// approximation against its oracle on the mapped q), additive against the reference where
// the variant computes it, refused (UnsupportedError) where it does not.
TEST_P(VariantTest, ScoringFunctions) {
  for (Score score : {Score::dot, Score::bilinear, Score::additive})
    for (int64_t n : {1, 7, 113})
      for (int64_t m : {7, 113})
        for (int64_t d : {1, 17})
          for (bool causal : {false, true}) {
            const int64_t hidden = score == Score::additive && d == 17 ? 5 : 0;
            check(test::with_score(problem(2, 2, n, m, d, causal, uint64_t(n + m + d)), score,
                                   hidden));
          }
}

TEST_P(VariantTest, RowsWithNoVisibleKeyAreZero) {
  // causal with n > m: bottom-right alignment leaves rows i < n - m with no key at all
  for (auto [n, m] : {std::pair<int64_t, int64_t>{113, 7}, {1000, 1}, {8, 7}}) {
    Problem p = problem(2, 2, n, m, 17, true);
    SCOPED_TRACE(p.str());
    Inputs in = generate_inputs(p);
    Tensor out(p.q_shape());
    if (!supports(*info_, p)) {
      EXPECT_THROW(variant_->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()),
                   UnsupportedError);
      continue;
    }
    // a garbage output buffer: the variant must write every element, zeros included
    std::fill(out.data(), out.data() + out.numel(), NAN);
    variant_->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    const TensorView o = out.view();
    int64_t bad_empty = 0, bad_visible = 0;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < p.n; ++i) {
          ASSERT_EQ(p.visible(i) == 0, i < n - m);
          for (int64_t c = 0; c < p.dim; ++c) {
            const float x = o.row(b, h, i)[c];
            if (i < n - m && !(x == 0.0f)) ++bad_empty;  // NaN counts as bad
            if (i >= n - m && !std::isfinite(x)) ++bad_visible;
          }
        }
    EXPECT_EQ(bad_empty, 0) << "elements of key-less rows that are not exactly 0";
    EXPECT_EQ(bad_visible, 0) << "non-finite elements in rows with visible keys";
    expect_matches_oracle(out.data(), p, in);
  }
}

TEST_P(VariantTest, MasksMatchTheMaskedOracle) {
  // key padding (one batch element with no key at all), float and bool attention masks
  // (broadcast over heads, or per batch and head), each alone, together and with causal; the
  // exact variants against the masked reference, the others against their masked oracle.
  // A variant without the capability must refuse.
  for (auto [n, m, d] :
       {std::tuple<int64_t, int64_t, int64_t>{113, 113, 17}, {70, 130, 64}, {200, 200, 8}})
    for (bool causal : {false, true}) {
      Problem base = problem(3, 2, n, m, d, causal);
      const int64_t keys = base.keys();
      Problem padded = base;
      padded.key_lengths = {keys / 2 + 3, 0, keys};
      check(padded);
      Problem ragged = base;
      ragged.key_lengths = {1, keys - 1, keys / 3};
      check(ragged);
      for (bool is_bool : {false, true}) {
        Problem masked = base;
        masked.attn_mask = test::random_mask(base, 1, 1, is_bool, n / 2);
        check(masked);
        Problem both = padded;
        both.attn_mask = test::random_mask(base, 3, 2, is_bool, 5);
        check(both);
      }
    }
}

TEST_P(VariantTest, MasksUnderEveryScore) {
  // key padding and a float mask together with causal under the dot, bilinear and additive
  // scores: the mask's bias enters in logit units whatever the score's scale (1 for additive)
  for (Score score : {Score::dot, Score::bilinear, Score::additive}) {
    Problem p = test::with_score(problem(2, 2, 90, 90, 16, true, 11), score);
    p.key_lengths = {60, 90};
    p.attn_mask = test::random_mask(p, 2, 1, false, 7);
    check(p);
  }
}

TEST_P(VariantTest, PaddedKeysNeverReachTheOutput) {
  // Garbage of two sizes in the padded keys and values gives bit-identical outputs (and the
  // same garbage without padding does not), for every variant that claims key padding, causal
  // and not, self- and cross-attention as it supports them.
  if (!info_->caps.key_padding) return;
  for (auto [n, m] : {std::pair<int64_t, int64_t>{96, 96}, {70, 130}})
    for (bool causal : {false, true}) {
      Problem p = problem(3, 2, n, m, 16, causal, 9);
      p.key_lengths = {m / 2 + 1, 0, m - 3};
      if (!supports(*info_, p)) continue;
      test::expect_padded_keys_absent(GetParam(), p, false, 0);
    }
}

TEST_P(VariantTest, MaskedRowsWithNoKeyAreZero) {
  Problem p = problem(2, 2, 64, 96, 16, false);
  p.key_lengths = {0, 50};
  Inputs in = generate_inputs(p);
  Tensor out(p.q_shape());
  if (!supports(*info_, p)) {
    EXPECT_THROW(variant_->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()),
                 UnsupportedError);
    return;
  }
  std::fill(out.data(), out.data() + out.numel(), NAN);
  variant_->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t i = 0; i < p.n; ++i)
      for (int64_t c = 0; c < p.dim; ++c) ASSERT_EQ(out.view().row(0, h, i)[c], 0.0f);
  ASSERT_TRUE(all_finite(out));
}

TEST_P(VariantTest, LargeLogitsStayFiniteAndExact) {
  // q scaled by 1e3: logits in the thousands, softmax nearly one-hot. Any exp without the
  // max subtracted overflows to inf/NaN here. Float32 logits then carry an absolute error
  // proportional to their size (a float32 GEMM accumulating 64 products of size ~1e3 is off by
  // ~1e-4 in the logit), which moves the weights of near-tied keys by as much; the error model
  // (common/reference/oracle.h) takes that from the workload's scale: u sqrt(d) S, 4.8e-4 at d = 64
  // and S = 1e3, so the default bound is about 2e-3. (Measured at n = m = 1000, d = 64, seed 7:
  // correctly rounded float32 logits, everything else in double, give 2.4e-6, full and flash
  // 1.2e-5: one-hot weights move less than the near-uniform worst case the model assumes.)
  // The bound still catches every real failure: an exp overflow or a missing max subtraction
  // gives inf/NaN, a wrong mask or normalisation an O(1) error.
  for (auto [n, m, d, causal] : {std::tuple<int64_t, int64_t, int64_t, bool>{113, 113, 64, false},
                                 {113, 113, 17, true},
                                 {7, 113, 64, true},
                                 {113, 7, 64, true},
                                 {1000, 1000, 64, false}}) {
    check(problem(1, 2, n, m, d, causal, 7), test::workload("gaussian", 1000));
  }
}

TEST_P(VariantTest, SameInputsGiveBitIdenticalOutput) {
  for (bool causal : {false, true}) {
    Problem p = problem(2, 3, 300, 257, 64, causal, 42);
    if (!supports(*info_, p)) continue;  // refusal is checked in the shape test
    Inputs in = generate_inputs(p);
    Tensor a = run_variant(*variant_, p, in);
    Tensor b = run_variant(*variant_, p, in);
    // and again from freshly generated inputs with the same seed, by a new instance
    Inputs in2 = generate_inputs(p);
    auto v2 = make_variant(GetParam());
    Tensor c = run_variant(*v2, p, in2);
    const size_t bytes = size_t(a.numel()) * sizeof(float);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), bytes), 0) << "causal=" << causal;
    EXPECT_EQ(std::memcmp(a.data(), c.data(), bytes), 0) << "causal=" << causal;
  }
}

TEST_P(VariantTest, EveryInputDistribution) {
  for (const auto& dist : input_distributions())
    for (bool causal : {false, true}) {
      check(problem(2, 2, 64, 96, 32, causal, 3), test::workload(dist));
    }
}

TEST_P(VariantTest, StridedViews) {
  // The interface allows any strides but the feature axis: embed q, k, v and out in padded
  // buffers (rows of d + 5, heads with 3 extra rows, batch items with an extra head's worth).
  Problem p = problem(2, 3, 45, 70, 24, true, 11);
  if (!info_->caps.causal) p.causal = false;
  if (!info_->caps.cross) p.m = 0;
  Inputs in = generate_inputs(p);
  auto padded = [&](const Tensor& t, std::vector<float>& buf, float fill) {
    const Shape4 s = t.shape();
    View4<float> v;
    v.shape = s;
    v.stride_row = s.dim + 5;
    v.stride_h = (s.len + 3) * v.stride_row;
    v.stride_b = (s.heads + 1) * v.stride_h;
    buf.assign(size_t(s.batch * v.stride_b), fill);
    v.data = buf.data();
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < s.heads; ++h)
        for (int64_t i = 0; i < s.len; ++i)
          std::memcpy(v.row(b, h, i), t.view().row(b, h, i), size_t(s.dim) * sizeof(float));
    return v;
  };
  std::vector<float> qb, kb, vb, ob;
  // NaN padding in the inputs: reading any of it poisons the output
  TensorView q = padded(in.q, qb, NAN), k = padded(in.k, kb, NAN), v = padded(in.v, vb, NAN);
  Tensor zero(p.q_shape());
  TensorView o = padded(zero, ob, 12345.0f);
  variant_->run(p, q, k, v, o);
  std::vector<float> dense(size_t(p.q_shape().numel()));
  int64_t pad_changed = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.n; ++i) {
        std::memcpy(dense.data() + ((b * p.heads + h) * p.n + i) * p.dim, o.row(b, h, i),
                    size_t(p.dim) * sizeof(float));
        for (int64_t c = p.dim; c < o.stride_row; ++c) pad_changed += o.row(b, h, i)[c] != 12345.0f;
      }
  // what the strided run must reproduce: the oracle (on contiguous tensors)
  expect_matches_oracle(dense.data(), p, in);
  EXPECT_EQ(pad_changed, 0) << "the variant wrote into the padding between output rows";
}

TEST_P(VariantTest, FlopsAndMemoryEstimatesArePositive) {
  Problem p = problem(1, 2, 128, 0, 64, false);
  EXPECT_GT(variant_->flops(p), 0);
  EXPECT_GE(variant_->memory_estimate(p), 0);
  EXPECT_EQ(variant_->spec().rfind(GetParam(), 0), 0u) << variant_->spec();
}

INSTANTIATE_TEST_SUITE_P(AllVariants, VariantTest, testing::ValuesIn(test::variant_names()),
                         test::spec_test_name);

// An approximation without an oracle cannot pass the shared test: a plugin must give one.
TEST(Oracles, ApproximationWithoutAnOracleIsRefused) {
  VariantInfo info;
  info.name = "approx";
  info.caps.exact = false;
  EXPECT_CONTAINS(missing_oracle(info), "'approx' says exact = false but gives no oracle");
  info.oracle = [](const Variant&, const Problem&, ConstTensorView, ConstTensorView,
                   ConstTensorView) { return std::vector<double>(); };
  EXPECT_EQ(missing_oracle(info), "");
  info.oracle = nullptr;
  info.caps.exact = true;
  EXPECT_EQ(missing_oracle(info), "");
  for (const VariantInfo* v : Registry::instance().all()) EXPECT_EQ(missing_oracle(*v), "");
}

// ----- the error model -----

TEST(ErrorModel, DefaultToleranceGrowsWithTheProblem) {
  // u (sqrt(d) S + sqrt(m) + 4) with a margin of 4: 1.0e-5 at d = 64, m = 1000, S = 1
  const Problem p = problem(1, 1, 1000, 1000, 64, false);
  const Workload w, sharp = test::workload("gaussian", 1000);
  EXPECT_NEAR(attention_tolerance(p, w), 4 * 0x1.0p-24 * (8 + std::sqrt(1000.0) + 4), 1e-12);
  EXPECT_LT(attention_tolerance(problem(1, 1, 7, 7, 17, false), w), attention_tolerance(p, w));
  EXPECT_GT(attention_tolerance(p, sharp), 100 * attention_tolerance(p, w));
  EXPECT_LT(attention_tolerance(p, sharp), 1e-2);
}

// ----- flash with other tile sizes -----

TEST(Flash, NonDefaultBlocksAreStillExact) {
  for (const char* spec : {"flash:block_q=7,block_k=13", "flash:block_q=1,block_k=1",
                           "flash:block_q=4096,block_k=65536", "flash:block_q=13,block_k=7"}) {
    auto v = make_variant(spec);
    for (auto [n, m] :
         {std::pair<int64_t, int64_t>{113, 113}, {113, 7}, {7, 113}, {1, 1000}, {100, 100}})
      for (bool causal : {false, true}) {
        Problem p = problem(2, 2, n, m, 17, causal, 5);
        SCOPED_TRACE(std::string(spec) + " " + p.str());
        Inputs in = generate_inputs(p);
        Tensor out = run_variant(*v, p, in);
        ASSERT_TRUE(all_finite(out));
        EXPECT_LE(rel_fro_error(out.data(),
                                reference_attention(p, in.q.view(), in.k.view(), in.v.view())),
                  attention_tolerance(p, Workload{}));
      }
  }
}

TEST(Variant, RunRejectsWrongShapes) {
  auto v = make_variant("flash");
  Problem p = problem(1, 2, 16, 24, 8, false);
  Inputs in = generate_inputs(p);
  Tensor out(p.q_shape()), bad_out(Shape4{1, 2, 24, 8});
  EXPECT_THROW(v->run(p, in.q.view(), in.k.view(), in.v.view(), bad_out.view()), InputError);
  EXPECT_THROW(v->run(p, in.k.view(), in.k.view(), in.v.view(), out.view()), InputError);
  EXPECT_THROW(v->run(p, in.q.view(), in.q.view(), in.v.view(), out.view()), InputError);
  EXPECT_THROW(v->run(p, in.q.view(), in.k.view(), in.q.view(), out.view()), InputError);
  EXPECT_NO_THROW(v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()));
}

// ----- inputs -----

bool same_tensor(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), size_t(a.numel()) * sizeof(float)) == 0;
}

TEST(Inputs, SameSeedSameTensorsOtherSeedOtherTensors) {
  for (const auto& dist : input_distributions()) {
    SCOPED_TRACE(dist);
    Problem p = problem(2, 2, 50, 70, 16, false, 123);
    const Workload w = test::workload(dist);
    Inputs a = generate_inputs(p, w), b = generate_inputs(p, w);
    EXPECT_TRUE(same_tensor(a.q, b.q));
    EXPECT_TRUE(same_tensor(a.k, b.k));
    EXPECT_TRUE(same_tensor(a.v, b.v));
    p.seed = 124;
    Inputs c = generate_inputs(p, w);
    EXPECT_FALSE(same_tensor(a.q, c.q));
    EXPECT_FALSE(same_tensor(a.k, c.k));
    EXPECT_FALSE(same_tensor(a.v, c.v));
    // heads and batch items are independent streams, not copies of each other
    const size_t head = size_t(50 * 16);
    EXPECT_NE(std::memcmp(a.q.data(), a.q.data() + head, head * sizeof(float)), 0);
    EXPECT_NE(std::memcmp(a.q.data(), a.q.data() + 2 * head, head * sizeof(float)), 0);
  }
}

TEST(Inputs, ThreadCountDoesNotChangeInputs) {
  // large enough that the generators open their parallel regions on two threads (smaller
  // ones run on one, common/core/parallel.h)
  Problem p = problem(2, 3, 600, 600, 64, false, 9);
  {
    test::ScopedThreads two(2);
    ASSERT_TRUE(parallel_worth(20.0 * double(p.batch * p.heads * p.n * p.dim), 6));
  }
  for (const auto& dist : input_distributions()) {
    SCOPED_TRACE(dist);
    const Workload w = test::workload(dist);
    Inputs a, b;
    {
      test::ScopedThreads one(1);
      a = generate_inputs(p, w);
    }
    {
      test::ScopedThreads two(2);
      b = generate_inputs(p, w);
    }
    EXPECT_TRUE(same_tensor(a.q, b.q));
    EXPECT_TRUE(same_tensor(a.k, b.k));
    EXPECT_TRUE(same_tensor(a.v, b.v));
  }
}

TEST(Inputs, EveryDistributionIsFiniteAndNotDegenerate) {
  ASSERT_FALSE(input_distributions().empty());
  for (const auto& dist : input_distributions()) {
    for (auto [n, m, d] :
         {std::tuple<int64_t, int64_t, int64_t>{100, 100, 64}, {1, 7, 1}, {33, 5, 17}}) {
      Problem p = problem(2, 2, n, m, d, false, 77);
      const Workload w = test::workload(dist);
      SCOPED_TRACE(describe(p, w));
      Inputs in = generate_inputs(p, w);
      EXPECT_EQ(in.q.shape(), p.q_shape());
      EXPECT_EQ(in.k.shape(), p.kv_shape());
      EXPECT_EQ(in.v.shape(), p.kv_shape());
      for (const Tensor* t : {&in.q, &in.k, &in.v}) {
        EXPECT_TRUE(all_finite(*t));
        double sum = 0, sum2 = 0;
        for (int64_t i = 0; i < t->numel(); ++i)
          sum += t->data()[i], sum2 += double(t->data()[i]) * t->data()[i];
        const double var = sum2 / double(t->numel()) - std::pow(sum / double(t->numel()), 2);
        EXPECT_GT(var, 0) << "all entries equal";
      }
    }
    EXPECT_FALSE(describe_distribution(dist).empty()) << dist;
  }
}

TEST(Inputs, ScaleMultipliesQOnly) {
  Problem p = problem(1, 2, 20, 30, 8, false, 4);
  Inputs a = generate_inputs(p);
  Inputs b = generate_inputs(p, test::workload("gaussian", 1000));
  for (int64_t i = 0; i < a.q.numel(); ++i) ASSERT_EQ(b.q.data()[i], a.q.data()[i] * 1000.0f);
  EXPECT_TRUE(same_tensor(a.k, b.k));
  EXPECT_TRUE(same_tensor(a.v, b.v));
}

TEST(Inputs, UnknownDistributionIsAUsageError) {
  Problem p = problem(1, 1, 4, 4, 4, false);
  EXPECT_THROW(generate_inputs(p, test::workload("bogus")), UsageError);
}

// ----- the reference itself, on cases small enough to check by hand -----

TEST(Reference, OneKeyGivesItsValue) {
  Problem p = problem(1, 1, 3, 1, 2, false);
  Tensor q(p.q_shape()), k(p.kv_shape()), v(p.kv_shape());
  for (int i = 0; i < 6; ++i) q.data()[i] = float(i - 3);
  k.data()[0] = 0.5f, k.data()[1] = -2;
  v.data()[0] = 3, v.data()[1] = -4;
  auto out = reference_attention(p, q.view(), k.view(), v.view());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out[size_t(2 * i)], 3.0);
    EXPECT_EQ(out[size_t(2 * i + 1)], -4.0);
  }
}

TEST(Reference, TwoKeysByHand) {
  // d = 1: logits q k / sqrt(1); p = softmax([0, log 3]) = [1/4, 3/4]
  Problem p = problem(1, 1, 1, 2, 1, false);
  Tensor q(p.q_shape()), k(p.kv_shape()), v(p.kv_shape());
  q.data()[0] = 1;
  k.data()[0] = 0, k.data()[1] = float(std::log(3.0));
  v.data()[0] = 8, v.data()[1] = 4;
  auto out = reference_attention(p, q.view(), k.view(), v.view());
  EXPECT_NEAR(out[0], 8 * 0.25 + 4 * 0.75, 1e-6);
  // causal, n = m = 2: row 0 sees only key 0
  Problem c = problem(1, 1, 2, 2, 1, true);
  Tensor q2(c.q_shape());
  q2.data()[0] = 1, q2.data()[1] = 1;
  auto out2 = reference_attention(c, q2.view(), k.view(), v.view());
  EXPECT_EQ(out2[0], 8.0);
  EXPECT_NEAR(out2[1], 8 * 0.25 + 4 * 0.75, 1e-6);
}

TEST(Problem, VisibleIsBottomRightAligned) {
  Problem p = problem(1, 1, 3, 5, 4, true);
  EXPECT_EQ(p.visible(0), 3);
  EXPECT_EQ(p.visible(2), 5);
  Problem q = problem(1, 1, 5, 3, 4, true);
  EXPECT_EQ(q.visible(0), 0);
  EXPECT_EQ(q.visible(1), 0);
  EXPECT_EQ(q.visible(2), 1);
  EXPECT_EQ(q.visible(4), 3);
  EXPECT_EQ(q.visible_pairs(), 6.0);
  Problem r = problem(1, 1, 5, 3, 4, false);
  EXPECT_EQ(r.visible(0), 3);
  EXPECT_EQ(r.visible_pairs(), 15.0);
}

}  // namespace
}  // namespace attnbench
