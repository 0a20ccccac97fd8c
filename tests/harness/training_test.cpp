// The training-pass spine: the float64 gradient of exact attention (reference_head_gradients)
// against finite differences of the float64 reference itself, and the harness's training rows
// (--pass bwd / fwdbwd): saved bytes, gradient error, FLOPs, refusals and the CLI.
//
// The test-only variant is registered in the test bodies (once per process, name starting
// "test_"), after the parameterised variant tests have been enumerated.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/backward.h"
#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/patterns/pattern.h"
#include "common/reference/reference.h"
#include "harness/memory.h"
#include "harness/metrics.h"
#include "harness/results.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

// ----- the float64 gradient against finite differences of the float64 forward -----

/// Inputs whose entries are multiples of 2^-13 in [-4, 4]: x +- h u with h = 2^-11 and u in
/// {-1, 0, 1} is then exact in float, so the differences see the perturbation exactly.
Inputs grid_inputs(const Problem& p) {
  Inputs in = generate_inputs(p);
  for (Tensor* t : {&in.q, &in.k, &in.v})
    for (int64_t i = 0; i < t->numel(); ++i)
      t->data()[i] =
          std::ldexp(std::round(std::ldexp(std::clamp(t->data()[i], -4.0f, 4.0f), 13)), -13);
  return in;
}

/// L = sum(dO * O) with O the float64 reference (restricted to the pattern, if any).
double loss(const Problem& p, const Inputs& in, const Tensor& dout, const SparsePattern* pat) {
  const std::vector<double> o = reference_attention(p, in.q.view(), in.k.view(), in.v.view(), pat);
  double l = 0;
  for (int64_t i = 0; i < dout.numel(); ++i) l += double(dout.data()[i]) * o[size_t(i)];
  return l;
}

/// <grad, u> against (L(x + h u) - L(x - h u)) / (2 h) for a seeded direction u of +-1 over
/// each of q, k and v in turn.
void expect_reference_gradient_matches_differences(const Problem& p, bool with_pattern = false) {
  const Inputs in = grid_inputs(p);
  const Tensor dout = generate_dout(p);
  std::unique_ptr<SparsePattern> pat;
  if (with_pattern)
    pat = make_variant("local:window=5,block=4")->make_pattern(p, in.q.view(), in.k.view());
  std::vector<HeadGradients> g;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      g.push_back(reference_head_gradients(p, in.q.view(), in.k.view(), in.v.view(), dout.view(), b,
                                           h, pat.get()));
  const double step = std::ldexp(1.0, -11);
  uint64_t x = 0x1234567ULL + p.seed;
  for (int t = 0; t < 3; ++t) {
    Inputs plus = {test::copy(in.q), test::copy(in.k), test::copy(in.v)};
    Inputs minus = {test::copy(in.q), test::copy(in.k), test::copy(in.v)};
    Tensor* tp[3] = {&plus.q, &plus.k, &plus.v};
    Tensor* tm[3] = {&minus.q, &minus.k, &minus.v};
    const int64_t len = t == 0 ? p.n : p.keys(), d = p.dim;
    double directional = 0;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h) {
        const HeadGradients& hg = g[size_t(b * p.heads + h)];
        const std::vector<double>& grad = t == 0 ? hg.dq : (t == 1 ? hg.dk : hg.dv);
        for (int64_t i = 0; i < len; ++i)
          for (int64_t c = 0; c < d; ++c) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            const double u = double(int64_t(x % 3) - 1);
            tp[t]->view().row(b, h, i)[c] += float(step * u);
            tm[t]->view().row(b, h, i)[c] -= float(step * u);
            directional += u * grad[size_t(i * d + c)];
          }
      }
    const double fd =
        (loss(p, plus, dout, pat.get()) - loss(p, minus, dout, pat.get())) / (2 * step);
    SCOPED_TRACE(t == 0 ? "dq" : (t == 1 ? "dk" : "dv"));
    // central differences err by O(h^2) times the third derivative along u: at h = 2^-8 that
    // was 2e-5 of the derivative; at 2^-11, 64 times less
    EXPECT_NEAR(directional, fd, 2e-6 * std::max(1.0, std::abs(fd)));
    EXPECT_GT(std::abs(fd), 1e-3) << "a direction with no change checks nothing";
  }
}

TEST(ReferenceGradient, MatchesDifferencesOfTheReference) {
  expect_reference_gradient_matches_differences(test::problem(2, 2, 13, 0, 8, false, 3));
}

TEST(ReferenceGradient, MatchesDifferencesCausalCrossAndPadded) {
  Problem p = test::problem(2, 2, 11, 17, 8, true, 4);
  p.key_lengths = {17, 9};
  expect_reference_gradient_matches_differences(p);
  Problem q = test::problem(1, 2, 19, 7, 8, true, 5);  // m < n: early rows see no key
  expect_reference_gradient_matches_differences(q);
}

TEST(ReferenceGradient, MatchesDifferencesUnderAMask) {
  Problem p = test::problem(2, 2, 12, 15, 8, false, 6);
  p.attn_mask = test::random_mask(p, 2, 1, false, 3);
  expect_reference_gradient_matches_differences(p);
}

TEST(ReferenceGradient, MatchesDifferencesForTheDotAndBilinearScores) {
  expect_reference_gradient_matches_differences(
      test::with_score(test::problem(1, 2, 10, 14, 8, false, 7), Score::dot));
  expect_reference_gradient_matches_differences(
      test::with_score(test::problem(1, 2, 10, 14, 8, true, 8), Score::bilinear));
}

TEST(ReferenceGradient, MatchesDifferencesRestrictedToAPattern) {
  expect_reference_gradient_matches_differences(test::problem(1, 2, 21, 0, 8, true, 9), true);
}

TEST(ReferenceGradient, RefusesTheAdditiveScore) {
  const Problem p = test::with_score(test::problem(1, 1, 4, 0, 4, false), Score::additive);
  const Inputs in = generate_inputs(p);
  const Tensor dout = generate_dout(p);
  EXPECT_THROW(
      reference_head_gradients(p, in.q.view(), in.k.view(), in.v.view(), dout.view(), 0, 0),
      UnsupportedError);
}

// ----- the harness -----

// A variant whose training forward keeps exactly kSavedFloats floats, and whose output and
// gradients are 0: what run_one reports for it is known exactly.
constexpr int64_t kSavedFloats = 1 << 18;  // 1 MiB

class KeepsState final : public SavedState {
 public:
  std::vector<float> kept = std::vector<float>(size_t(kSavedFloats), 1.0f);
};

class ZeroWithBackward final : public Variant, public Backward {
 public:
  void forward(const Problem&, ConstTensorView, ConstTensorView, ConstTensorView,
               TensorView out) override {
    fill(out);
  }
  double flops(const Problem&) const override { return 10; }
  double memory_estimate(const Problem&) const override { return 0; }
  Backward* backward() override { return this; }
  std::unique_ptr<SavedState> forward_train(const Problem&, ConstTensorView, ConstTensorView,
                                            ConstTensorView, TensorView out) override {
    fill(out);
    return std::make_unique<KeepsState>();
  }
  void backward(const Problem&, ConstTensorView, ConstTensorView, ConstTensorView, ConstTensorView,
                ConstTensorView, const SavedState& saved, TensorView dq, TensorView dk,
                TensorView dv) override {
    EXPECT_NE(dynamic_cast<const KeepsState*>(&saved), nullptr);
    fill(dq), fill(dk), fill(dv);
  }
  double backward_flops(const Problem&) const override { return 25; }
  double saved_estimate(const Problem&) const override { return double(kSavedFloats) * 4; }
  double backward_memory_estimate(const Problem&) const override { return 0; }

 private:
  static void fill(TensorView t) {
    for (int64_t b = 0; b < t.shape.batch; ++b)
      for (int64_t h = 0; h < t.shape.heads; ++h)
        for (int64_t i = 0; i < t.shape.len; ++i)
          std::fill(t.row(b, h, i), t.row(b, h, i) + t.shape.dim, 0.0f);
  }
};

/// The same forward without a backward pass.
class ZeroWithoutBackward final : public Variant {
 public:
  void forward(const Problem&, ConstTensorView, ConstTensorView, ConstTensorView,
               TensorView out) override {
    for (int64_t b = 0; b < out.shape.batch; ++b)
      for (int64_t h = 0; h < out.shape.heads; ++h)
        for (int64_t i = 0; i < out.shape.len; ++i)
          std::fill(out.row(b, h, i), out.row(b, h, i) + out.shape.dim, 0.0f);
  }
  double flops(const Problem&) const override { return 10; }
  double memory_estimate(const Problem&) const override { return 0; }
};

void register_zero_variant() {
  static const bool once = [] {
    Registry::instance().add(VariantInfo{
        .name = "test_zero_backward",
        .summary = "test-only variant: output and gradients 0, a 1 MiB saved state",
        .complexity = "n/a",
        .params = {},
        .caps = {.causal = true, .cross = true, .exact = false},
        .make = [](const ParamValues&) { return std::make_unique<ZeroWithBackward>(); }});
    Registry::instance().add(VariantInfo{
        .name = "test_zero_no_backward",
        .summary = "test-only variant: output 0, no backward pass",
        .complexity = "n/a",
        .params = {},
        .caps = {.causal = true, .cross = true, .exact = false},
        .make = [](const ParamValues&) { return std::make_unique<ZeroWithoutBackward>(); }});
    return true;
  }();
  (void)once;
}

Row run_pass(const std::string& spec, const Problem& p, const std::string& pass,
             Gradients* grads = nullptr) {
  register_zero_variant();
  auto v = make_variant(spec);
  Workload w;
  w.pass = pass;
  const RunOptions opt{.reps = 1, .min_time = 0};
  return run_one(*v, p, w, nullptr, MachineFigures{}, opt, nullptr, nullptr, grads);
}

TEST(TrainingRows, SavedBytesFlopsAndGradientErrorOfAKnownVariant) {
  const Problem p = test::problem(2, 3, 20, 0, 8, false);
  const Row bwd = run_pass("test_zero_backward", p, "bwd");
  ASSERT_EQ(bwd.status, "ok") << bwd.message;
  EXPECT_EQ(bwd.flops, 25);
  EXPECT_EQ(bwd.saved_estimate_bytes, double(kSavedFloats) * 4);
  if (heap_counting()) {
    // the vector's block, and at most a page of bookkeeping (the state object itself)
    EXPECT_GE(bwd.saved_bytes, double(kSavedFloats) * 4);
    EXPECT_LE(bwd.saved_bytes, double(kSavedFloats) * 4 + 4096);
  }
  // zero gradients are as far from the exact ones as they can be, relatively: 1
  EXPECT_NEAR(bwd.grad_err_q, 1.0, 1e-12);
  EXPECT_NEAR(bwd.grad_err_k, 1.0, 1e-12);
  EXPECT_NEAR(bwd.grad_err_v, 1.0, 1e-12);
  EXPECT_EQ(bwd.grad_heads, 6);
  const Row both = run_pass("test_zero_backward", p, "fwdbwd");
  ASSERT_EQ(both.status, "ok") << both.message;
  EXPECT_EQ(both.flops, 35);
  if (heap_counting()) {
    EXPECT_GE(both.peak_bytes, double(kSavedFloats) * 4);
  }
  const Row fwd = run_pass("test_zero_backward", p, "fwd");
  ASSERT_EQ(fwd.status, "ok") << fwd.message;
  EXPECT_EQ(fwd.flops, 10);
  EXPECT_TRUE(std::isnan(fwd.saved_bytes));
  EXPECT_TRUE(std::isnan(fwd.grad_err_q));
  EXPECT_EQ(fwd.grad_heads, 0);
}

TEST(TrainingRows, AVariantWithoutABackwardIsUnsupported) {
  // every registered variant has a backward pass: a test-only one without
  register_zero_variant();
  const Problem p = test::problem(1, 2, 16, 0, 8, false);
  ASSERT_EQ(make_variant("test_zero_no_backward")->backward(), nullptr);
  for (const char* pass : {"bwd", "fwdbwd"}) {
    const Row row = run_pass("test_zero_no_backward", p, pass);
    EXPECT_EQ(row.status, "unsupported") << pass;
    EXPECT_NE(row.message.find("no backward pass"), std::string::npos) << row.message;
  }
  EXPECT_EQ(run_pass("test_zero_no_backward", p, "fwd").status, "ok");
}

TEST(TrainingRows, TheAdditiveScoreIsRefusedByDefault) {
  const Problem p = test::with_score(test::problem(1, 2, 16, 0, 8, false), Score::additive);
  register_zero_variant();
  auto v = make_variant("test_zero_backward");
  EXPECT_THROW(v->backward()->check_backward(p), UnsupportedError);
}

TEST(TrainingRows, GradientHeadsAreSampledAndNoneAboveTheLimit) {
  const Problem p = test::problem(4, 8, 100, 100, 8, false);
  EXPECT_EQ(pick_gradient_heads(p, 1e9).size(), 32u);
  const std::vector<int64_t> some = pick_gradient_heads(p, 5 * 100 * 100 + 1);
  EXPECT_EQ(some.size(), 5u);
  EXPECT_TRUE(std::is_sorted(some.begin(), some.end()));
  EXPECT_EQ(some, pick_gradient_heads(p, 5 * 100 * 100 + 1)) << "the same seed, the same heads";
  EXPECT_TRUE(pick_gradient_heads(p, 100 * 100 - 1).empty());
}

TEST(TrainingRows, DotAndBilinearGradientsGoBackThroughTheMappedQuery) {
  // the mapped-q wrapper (Variant::compute_backward) with the exact variants' own check: the
  // gradient of a variant that has one matches the reference under every linear score
  for (const VariantInfo* info : Registry::instance().all()) {
    auto v = Registry::instance().make(info->name);
    if (!v->backward() || !info->caps.exact || info->name.rfind("test_", 0) == 0) continue;
    SCOPED_TRACE(info->name);
    for (Score s : {Score::dot, Score::bilinear}) {
      const Problem p = test::with_score(test::problem(1, 2, 24, 0, 16, false, 3), s);
      const Inputs in = generate_inputs(p);
      const Tensor dout = generate_dout(p);
      Tensor out(p.q_shape()), dq(p.q_shape()), dk(p.kv_shape()), dv(p.kv_shape());
      auto saved = v->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
      v->run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout.view(), *saved,
                      dq.view(), dk.view(), dv.view());
      auto pat = v->make_pattern(p, in.q.view(), in.k.view());
      for (int64_t h = 0; h < p.heads; ++h) {
        const HeadGradients g = reference_head_gradients(p, in.q.view(), in.k.view(), in.v.view(),
                                                         dout.view(), 0, h, pat.get());
        EXPECT_LT(test::rel_fro_error(dq.view().head(0, h), g.dq), 2e-5) << score_name(s);
        EXPECT_LT(test::rel_fro_error(dk.view().head(0, h), g.dk), 2e-5) << score_name(s);
        EXPECT_LT(test::rel_fro_error(dv.view().head(0, h), g.dv), 2e-5) << score_name(s);
      }
    }
  }
}

TEST(TrainingCli, PassOptionsAndSavedGradients) {
  test::TempDir dir;
  // --save-grads needs a backward pass; an unknown pass is named
  auto r = test::run_cli("run --variant flash --seq 16 --save-grads " + dir.file("g.npz"), dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--save-grads needs a backward pass"), std::string::npos) << r.err;
  r = test::run_cli("run --variant flash --seq 16 --pass backward", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--pass"), std::string::npos) << r.err;
  r = test::run_cli("sweep --variant flash --seq 16 --pass fwd,back --out " + dir.file("s"), dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("unknown pass 'back'; accepted: fwd, bwd, fwdbwd, decode"),
            std::string::npos)
      << r.err;
  // a 'do' of the wrong shape is named
  const Problem p = test::problem(1, 2, 8, 0, 4, false);
  const Inputs in = generate_inputs(p);
  Tensor bad(Shape4{1, 2, 7, 4});
  write_npz(dir.file("in.npz"),
            {{"q", to_npy(in.q)}, {"k", to_npy(in.k)}, {"v", to_npy(in.v)}, {"do", to_npy(bad)}});
  r = test::run_cli("run --variant flash --pass bwd --inputs " + dir.file("in.npz"), dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("'do' has shape (1, 2, 7, 4) but q has (1, 2, 8, 4)"), std::string::npos)
      << r.err;
}

TEST(TrainingCli, SweepWritesAPassColumnAndResumes) {
  test::TempDir dir;
  // flash is exact; reformer approximates (shared QK: its k input gets no gradient); the
  // additive score has no backward pass (reformer has no additive forward either)
  const std::string args =
      "sweep --variant flash --variant reformer --score scaled_dot,additive --seq 32 --heads 2 "
      "--dim 8 --pass fwd,bwd,fwdbwd --reps 1 --min-time 0 --out " +
      dir.file("s");
  auto r = test::run_cli(args, dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<std::string> lines = test::read_lines(dir.file("s/results.csv"));
  ASSERT_EQ(lines.size(), 13u);
  const std::vector<std::string> header = split_csv_line(lines[0]);
  const auto col = [&](const std::string& name) {
    return size_t(std::find(header.begin(), header.end(), name) - header.begin());
  };
  for (const char* c : {"pass", "saved_bytes", "saved_estimate_bytes", "grad_rel_err_q",
                        "grad_rel_err_k", "grad_rel_err_v", "grad_heads"})
    ASSERT_LT(col(c), header.size()) << c;
  int training_ok = 0, unsupported = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    const auto f = split_csv_line(lines[i]);
    const std::string& pass = f[col("pass")];
    if (pass == "fwd") {
      EXPECT_EQ(f[col("grad_rel_err_q")], "");
      continue;
    }
    if (f[col("score")] == "additive") {
      EXPECT_EQ(f[col("status")], "unsupported") << lines[i];
      unsupported += f[col("status")] == "unsupported";
      continue;
    }
    ASSERT_EQ(f[col("status")], "ok") << lines[i];
    ++training_ok;
    EXPECT_EQ(f[col("grad_heads")], "2");
    if (f[col("variant")] == "flash") {
      EXPECT_LT(std::stod(f[col("grad_rel_err_q")]), 1e-5) << lines[i];
      EXPECT_LT(std::stod(f[col("grad_rel_err_k")]), 1e-5) << lines[i];
      EXPECT_LT(std::stod(f[col("grad_rel_err_v")]), 1e-5) << lines[i];
      continue;
    }
    // reformer: far from exact attention's gradients, and a zero dk is off by all of it
    EXPECT_EQ(f[col("variant")], "reformer") << lines[i];
    EXPECT_GT(std::stod(f[col("grad_rel_err_q")]), 1e-2) << lines[i];
    EXPECT_EQ(std::stod(f[col("grad_rel_err_k")]), 1.0) << lines[i];
    EXPECT_GT(std::stod(f[col("grad_rel_err_v")]), 1e-2) << lines[i];
  }
  EXPECT_EQ(training_ok, 4);  // flash and reformer, bwd and fwdbwd
  EXPECT_EQ(unsupported, 4);  // both, bwd and fwdbwd, under the additive score
  // resuming keeps every row: nothing left to run
  r = test::run_cli(args + " --resume", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(test::read_lines(dir.file("s/results.csv")).size(), 13u);
}

}  // namespace
}  // namespace attnbench
