// The backward pass of exact attention: full (P kept), flash (the engine's dense backward from
// the rows' log-sum-exps) and the pattern variants (the engine's block-sparse backward), each
// against the float64 gradients of reference_head_gradients (restricted to the variant's
// pattern) on small ragged problems, under the causal mask, key padding, an attention mask,
// m != n and the dot and bilinear scores.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"
#include "tests/extreme_mask.h"

namespace attnbench {
namespace {

/// The variants with a backward, with blocks small enough that the test problems (n, m about
/// 40) span several query tiles and key blocks, and patterns with partial blocks.
const std::vector<std::string>& exact_specs() {
  static const std::vector<std::string> specs = {
      "full",
      "flash",
      "flash:block_q=16,block_k=8",
      "flash:block_q=7,block_k=13",
      "local:window=8,block=8",
      "local:window=5,sinks=11,block=8",
      "strided:stride=3,block=8",
      "strided:stride=4,span=12,block=8",
      "strided:stride=9,block=8",  // 9 classes: in parallel, one thread each
      "global:global=5,block=8",
      "longformer:window=6,global=3,block=8",
      "longformer:window=6,dilation=2,dilated_heads=2,global=2,block=8",
      "bigbird:block=8,window_blocks=3,random_blocks=1,global_blocks=1",
      "sparse_transformer:mode=strided,stride=6,block=8",
      "sparse_transformer:mode=strided,stride=9,block=8",
      "sparse_transformer:mode=fixed,stride=8,summary=2,block=4",
      "sinkhorn:block=8",
      "moba:chunk=8,topk=2,block=8",
      "moba:chunk=12,topk=3,block=8",
  };
  return specs;
}

double norm(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e * e;
  return std::sqrt(s);
}

/// ‖got − want‖_F / ‖want‖_F of one head's rows (len x d of got's head (b, h)); when want is
/// 0, ‖got‖_F itself.
double rel_error(const Tensor& got, int64_t b, int64_t h, const std::vector<double>& want) {
  const int64_t len = got.shape().len, d = got.shape().dim;
  double diff = 0;
  for (int64_t i = 0; i < len; ++i)
    for (int64_t c = 0; c < d; ++c) {
      const double x = got.view().row(b, h, i)[c];
      if (!std::isfinite(x)) return INFINITY;
      const double e = x - want[size_t(i * d + c)];
      diff += e * e;
    }
  const double ref = norm(want);
  return ref > 0 ? std::sqrt(diff) / ref : std::sqrt(diff);
}

struct Grads {
  Tensor out, dq, dk, dv;
};

/// forward_train and backward of `spec` on p through the registry's checked entry points, into
/// gradients filled with NaN first.
Grads train(Variant& var, const Problem& p, const Inputs& in, const Tensor& dout) {
  Grads g{Tensor(p.q_shape()), Tensor(p.q_shape()), Tensor(p.kv_shape()), Tensor(p.kv_shape())};
  // the backward overwrites its gradients: every entry it leaves alone stays NaN
  for (Tensor* t : {&g.dq, &g.dk, &g.dv}) std::fill_n(t->data(), t->numel(), NAN);
  auto saved = var.run_train(p, in.q.view(), in.k.view(), in.v.view(), g.out.view());
  var.run_backward(p, in.q.view(), in.k.view(), in.v.view(), g.out.view(), dout.view(), *saved,
                   g.dq.view(), g.dk.view(), g.dv.view());
  return g;
}

// Float32 against float64: the gradients sum O(m) products of float terms, and the engine
// recomputes P from the float log-sum-exp, whose rounding (|L| ulp) enters every p. The errors
// seen on these problems stay below 2e-6.
constexpr double kTol = 1e-5;

/// Runs every variant that supports p (and has a backward) and compares its gradients with
/// the reference for every head. Returns how many variants ran.
int check_all(const Problem& p, const std::string& what, bool only_dense = false) {
  const Inputs in = generate_inputs(p);
  const Tensor dout = generate_dout(p);
  int ran = 0;
  for (const std::string& spec : exact_specs()) {
    if (only_dense && spec.rfind("full", 0) != 0 && spec.rfind("flash", 0) != 0) continue;
    auto var = make_variant(spec);
    try {
      var->check_backward(p);
    } catch (const UnsupportedError&) {
      continue;
    }
    // sinkhorn's and moba's patterns are chosen from q and k: the dot and bilinear scores map
    // q first
    if ((spec.rfind("sinkhorn", 0) == 0 || spec.rfind("moba", 0) == 0) &&
        p.score != Score::scaled_dot)
      continue;
    SCOPED_TRACE(spec + " " + what);
    const Grads g = train(*var, p, in, dout);
    // forward_train gives the forward's output
    const Tensor fwd = test::run(spec, p, in);
    auto pat = var->make_pattern(p, in.q.view(), in.k.view());
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h) {
        const HeadGradients ref = reference_head_gradients(p, in.q.view(), in.k.view(), in.v.view(),
                                                           dout.view(), b, h, pat.get());
        EXPECT_LT(rel_error(g.dq, b, h, ref.dq), kTol) << "dq, head " << b << "," << h;
        EXPECT_LT(rel_error(g.dk, b, h, ref.dk), kTol) << "dk, head " << b << "," << h;
        EXPECT_LT(rel_error(g.dv, b, h, ref.dv), kTol) << "dv, head " << b << "," << h;
        double worst = 0;
        for (int64_t i = 0; i < p.n; ++i)
          for (int64_t c = 0; c < p.dim; ++c)
            worst = std::max(
                worst, std::abs(double(g.out.view().row(b, h, i)[c]) - fwd.view().row(b, h, i)[c]));
        EXPECT_LT(worst, 1e-5) << "forward_train output, head " << b << "," << h;
      }
    ++ran;
  }
  return ran;
}

Problem small(int64_t n, int64_t m, bool causal, uint64_t seed = 3) {
  return test::problem(2, 3, n, m, 16, causal, seed);
}

TEST(BackwardExact, SelfAttention) {
  EXPECT_EQ(check_all(small(45, 0, false), "n=m=45"), int(exact_specs().size()));
}

TEST(BackwardExact, SelfAttentionCausal) {
  EXPECT_EQ(check_all(small(45, 0, true), "n=m=45 causal"), int(exact_specs().size()));
}

TEST(BackwardExact, CrossAttention) {
  EXPECT_GE(check_all(small(37, 53, false), "n=37 m=53"), 8);
  EXPECT_GE(check_all(small(37, 53, true), "n=37 m=53 causal"), 8);
}

TEST(BackwardExact, FewerQueriesThanTheStride) {
  // n = 5 < stride 9: the strided reshape's classes without a query hold keys whose gradients
  // are 0
  EXPECT_GE(check_all(small(5, 30, false), "n=5 m=30"), 8);
  EXPECT_GE(check_all(small(5, 30, true), "n=5 m=30 causal"), 8);
}

TEST(BackwardExact, CausalWithFewerKeysLeavesRowsWithoutKeys) {
  // m < n under the causal mask: the first n - m rows see no key (gradients 0, no NaN)
  EXPECT_GE(check_all(small(45, 30, true), "n=45 m=30 causal"), 8);
}

TEST(BackwardExact, KeyPadding) {
  Problem p = small(45, 0, false);
  p.key_lengths = {27, 0};  // batch element 1 has no key: its rows and gradients are 0
  EXPECT_GE(check_all(p, "key padding"), 8);
  p.causal = true;
  p.key_lengths = {45, 19};
  EXPECT_GE(check_all(p, "key padding causal"), 8);
}

TEST(BackwardExact, AttentionMask) {
  Problem p = small(37, 53, false);
  // finite bias in [-5, 3] and a quarter -inf, per batch element and head; row 5 wholly masked
  p.attn_mask = test::random_mask(p, 2, 3, false, 5);
  EXPECT_GE(check_all(p, "attention mask"), 8);
  Problem c = small(45, 0, true);
  c.attn_mask = test::random_mask(c, 1, 3, false, 0);
  c.key_lengths = {40, 45};
  EXPECT_GE(check_all(c, "attention mask causal padded"), 8);
}

TEST(BackwardExact, HugeFiniteMaskValues) {
  // -FLT_MAX (torch.finfo(torch.float32).min) and -1e30 on whole rows, beside -inf and
  // ordinary values (tests/extreme_mask.h): the float64 reference's gradients, no NaN
  Problem p = small(37, 53, false);
  p.attn_mask = test::extreme_mask(p, 2, 1);
  EXPECT_GE(check_all(p, "extreme mask"), 8);
  Problem c = small(45, 0, true);
  c.attn_mask = test::extreme_mask(c, 1, 3);
  c.key_lengths = {40, 45};
  EXPECT_GE(check_all(c, "extreme mask causal padded"), 8);
}

TEST(BackwardExact, DotAndBilinearScores) {
  EXPECT_GE(check_all(test::with_score(small(37, 53, true), Score::dot), "dot"), 8);
  EXPECT_GE(check_all(test::with_score(small(45, 0, false), Score::bilinear), "bilinear"), 8);
}

TEST(BackwardExact, RowWithoutKeysGivesZeroGradients) {
  Problem p = small(37, 53, false);
  p.attn_mask = test::random_mask(p, 1, 1, true, 4);  // row 4 sees no key
  const Inputs in = generate_inputs(p);
  const Tensor dout = generate_dout(p);
  for (const char* spec : {"full", "flash:block_q=16,block_k=8", "local:window=8,block=8"}) {
    SCOPED_TRACE(spec);
    auto var = make_variant(spec);
    const Grads g = train(*var, p, in, dout);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t c = 0; c < p.dim; ++c) ASSERT_EQ(g.dq.view().row(b, h, 4)[c], 0.0f);
    for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
      for (int64_t e = 0; e < t->numel(); ++e) ASSERT_TRUE(std::isfinite(t->data()[e]));
  }
}

TEST(BackwardExact, AdditiveScoreIsRefused) {
  const Problem p = test::with_score(small(16, 0, false), Score::additive);
  const Inputs in = generate_inputs(p);
  for (const std::string& spec : exact_specs()) {
    auto var = make_variant(spec);
    ASSERT_NE(var->backward(), nullptr) << spec;
    Tensor out(p.q_shape());
    EXPECT_THROW(var->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view()),
                 UnsupportedError)
        << spec;
  }
}

TEST(BackwardExact, FullAndFlashAgree) {
  Problem p = small(61, 70, true);
  p.key_lengths = {66, 50};
  const Inputs in = generate_inputs(p);
  const Tensor dout = generate_dout(p);
  auto full = make_variant("full");
  auto flash = make_variant("flash");
  const Grads a = train(*full, p, in, dout), b = train(*flash, p, in, dout);
  const std::pair<const Tensor*, const Tensor*> pairs[] = {
      {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}};
  for (const auto& [x, y] : pairs) {
    double diff = 0, ref = 0;
    for (int64_t e = 0; e < x->numel(); ++e) {
      diff += std::pow(double(x->data()[e]) - y->data()[e], 2);
      ref += std::pow(double(x->data()[e]), 2);
    }
    EXPECT_LT(std::sqrt(diff / ref), kTol);
  }
}

TEST(BackwardExact, EstimatesArePositive) {
  const Problem p = small(45, 0, true);
  for (const std::string& spec : exact_specs()) {
    auto var = make_variant(spec);
    const Backward* bw = var->backward();
    ASSERT_NE(bw, nullptr) << spec;
    EXPECT_GT(bw->backward_flops(p), 0) << spec;
    EXPECT_GT(bw->saved_estimate(p), 0) << spec;
    EXPECT_GT(bw->backward_memory_estimate(p), 0) << spec;
  }
}

}  // namespace
}  // namespace attnbench
