// Grouped-query and multi-query attention (Problem::kv_heads): k and v are stored with G heads
// and read through grouped views, so every variant and pass applies it through one head
// mapping. A grouped problem must give exactly what the same variant gives on k and v copied
// out to one head per query head (repeat_interleave in PyTorch's terms), its gradients of k
// and v must be the sums of the copies' over each group, and its decode state must hold G
// heads, not H.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/backward.h"
#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/decode/kv_decode.h"
#include "common/io/inputs.h"
#include "common/reference/reference.h"
#include "harness/metrics.h"
#include "harness/sweep_plan.h"
#include "test_util.h"

namespace attnbench {
namespace {

/// p without grouping (G = H).
Problem ungrouped(Problem p) {
  p.kv_heads = 0;
  return p;
}

/// A grouped k or v copied out to one stored head per query head.
Tensor expand(const Tensor& t) {
  const ConstTensorView g = t.view();
  Tensor out(g.shape);
  for (int64_t b = 0; b < g.shape.batch; ++b)
    for (int64_t h = 0; h < g.shape.heads; ++h)
      std::copy(g.head(b, h), g.head(b, h) + g.shape.len * g.shape.dim, out.view().head(b, h));
  return out;
}

/// The largest |a - b| / max|b| over two tensors of the same size.
double max_rel_diff(const float* a, const float* b, int64_t count) {
  double diff = 0, top = 0;
  for (int64_t i = 0; i < count; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    top = std::max(top, std::abs(double(b[i])));
  }
  return top > 0 ? diff / top : diff;
}

TEST(Gqa, ProblemMapsQueryHeadsToTheirGroup) {
  Problem p = test::problem(2, 8, 16, 0, 4, false);
  EXPECT_EQ(p.kv_head_count(), 8);
  EXPECT_EQ(p.kv_group(), 1);
  EXPECT_EQ(p.str().find("G="), std::string::npos);  // ungrouped names are unchanged
  p.kv_heads = 2;
  p.validate();
  EXPECT_EQ(p.kv_group(), 4);
  EXPECT_EQ(p.kv_head(3), 0);
  EXPECT_EQ(p.kv_head(4), 1);
  EXPECT_EQ(p.kv_storage_shape(), (Shape4{2, 2, 16, 4}));
  EXPECT_EQ(p.kv_shape(), (Shape4{2, 8, 16, 4}));
  EXPECT_NE(p.str().find("H=8,G=2,"), std::string::npos) << p.str();
  Tensor k = p.kv_tensor();
  EXPECT_EQ(k.numel(), 2 * 2 * 16 * 4);
  EXPECT_EQ(k.view().head(1, 5), k.data() + (1 * 2 + 1) * 16 * 4);
  for (int64_t bad : {3, 16, -1}) {
    p.kv_heads = bad;
    EXPECT_CONTAINS(test::error_message<UsageError>([&] { p.validate(); }),
                    "a divisor of the heads");
  }
}

// Generated inputs: G = H draws the streams it always drew; grouped k and v are one draw per
// key/value head, and q keeps one draw per query head.
TEST(Gqa, GeneratedInputsDrawOnePerKeyValueHead) {
  for (const std::string input : {"gaussian", "local", "clustered", "lowrank"}) {
    SCOPED_TRACE(input);
    Problem p = test::problem(2, 4, 24, 0, 8, false, 5);
    const Inputs all = generate_inputs(p, test::workload(input));
    p.kv_heads = 2;
    const Inputs grouped = generate_inputs(p, test::workload(input));
    EXPECT_EQ(grouped.k.shape(), (Shape4{2, 2, 24, 8}));
    const int64_t head = 24 * 8;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 4; ++h) {
        // gaussian query heads are those of the ungrouped problem (the structured inputs
        // build q from its key/value head's latent)
        if (input == "gaussian") {
          EXPECT_TRUE(std::equal(grouped.q.view().head(b, h), grouped.q.view().head(b, h) + head,
                                 all.q.view().head(b, h)));
        }
        // key/value head g is what ungrouped head g drew (the same stream)
        if (h < 2) {
          EXPECT_TRUE(std::equal(grouped.k.data() + (b * 2 + h) * head,
                                 grouped.k.data() + (b * 2 + h + 1) * head,
                                 all.k.view().head(b, h)));
          EXPECT_TRUE(std::equal(grouped.v.data() + (b * 2 + h) * head,
                                 grouped.v.data() + (b * 2 + h + 1) * head,
                                 all.v.view().head(b, h)));
        }
      }
    // a one-head slice gives the same numbers as the whole problem's head
    const Inputs one = generate_head_inputs(p, 1, 3, test::workload(input));
    EXPECT_TRUE(std::equal(one.k.data(), one.k.data() + head, grouped.k.view().head(1, 3)));
    EXPECT_TRUE(std::equal(one.q.data(), one.q.data() + head, grouped.q.view().head(1, 3)));
  }
}

// Every variant, causal where it can be, G in {2, 1}: the output on grouped k and v equals the
// output on their copies, and the float64 reference follows the grouping.
TEST(Gqa, EveryVariantEqualsItsRunOnCopiedHeads) {
  for (const VariantInfo* info : Registry::instance().all()) {
    for (bool causal : {false, true}) {
      if (causal && !info->caps.causal) continue;
      if (!causal && info->caps.causal_only) continue;
      for (int64_t g : {2, 1}) {
        SCOPED_TRACE(info->name + (causal ? " causal" : "") + " G=" + std::to_string(g));
        Problem p = test::problem(2, 4, 67, 0, 16, causal, 11);
        p.kv_heads = g;
        const Inputs in = generate_inputs(p);
        auto variant = make_variant(info->name);
        Tensor out(p.q_shape()), want(p.q_shape());
        variant->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
        const Tensor k = expand(in.k), v = expand(in.v);
        auto again = make_variant(info->name);
        again->run(ungrouped(p), in.q.view(), k.view(), v.view(), want.view());
        EXPECT_LE(max_rel_diff(out.data(), want.data(), out.numel()), 1e-6);
        if (info->name == "full") {
          const std::vector<double> ref =
              reference_attention(p, in.q.view(), in.k.view(), in.v.view());
          EXPECT_LE(test::rel_fro_error(out.data(), ref), 1e-5);
        }
      }
    }
  }
}

// Shapes: ungrouped k for a grouped problem, and grouped k for an ungrouped one, are refused
// with the expected storage named.
TEST(Gqa, MismatchedGroupingIsRefused) {
  Problem p = test::problem(1, 4, 8, 0, 4, false);
  p.kv_heads = 2;
  const Inputs in = generate_inputs(p);
  auto variant = make_variant("flash");
  Tensor out(p.q_shape());
  const Tensor k = expand(in.k);
  EXPECT_CONTAINS(test::error_message<InputError>(
                      [&] { variant->run(p, in.q.view(), k.view(), in.v.view(), out.view()); }),
                  "expected [1, 2, 8, 4] (2 key/value heads");
  EXPECT_CONTAINS(test::error_message<InputError>([&] {
                    variant->run(ungrouped(p), in.q.view(), in.k.view(), k.view(), out.view());
                  }),
                  "k holds 2 key/value heads");
}

// Every variant with a backward: dq equals the copies' dq, and dk, dv of a key/value head the
// sum of its copies' gradients over the group; the harness's float64 gradient check agrees.
TEST(Gqa, GradientsOfSharedHeadsSumOverTheGroup) {
  for (const VariantInfo* info : Registry::instance().all()) {
    auto variant = make_variant(info->name);
    if (!variant->backward()) continue;
    const bool causal = info->caps.causal;
    SCOPED_TRACE(info->name);
    Problem p = test::problem(2, 4, 45, 0, 8, causal, 3);
    p.kv_heads = 2;
    const Inputs in = generate_inputs(p);
    const Tensor dout = generate_dout(p);
    Tensor out(p.q_shape()), dq(p.q_shape()), dk = p.kv_tensor(), dv = p.kv_tensor();
    auto saved = variant->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    variant->run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout.view(), *saved,
                          dq.view(), dk.view(), dv.view());

    const Problem u = ungrouped(p);
    const Tensor k = expand(in.k), v = expand(in.v);
    auto again = make_variant(info->name);
    Tensor out2(p.q_shape()), dq2(p.q_shape()), dk2(p.kv_shape()), dv2(p.kv_shape());
    auto saved2 = again->run_train(u, in.q.view(), k.view(), v.view(), out2.view());
    again->run_backward(u, in.q.view(), k.view(), v.view(), out2.view(), dout.view(), *saved2,
                        dq2.view(), dk2.view(), dv2.view());
    EXPECT_LE(max_rel_diff(dq.data(), dq2.data(), dq.numel()), 1e-6);
    // sum the copies' gradients over each group
    Tensor dk_sum = p.kv_tensor(), dv_sum = p.kv_tensor();
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t e = 0; e < p.keys() * p.dim; ++e) {
          dk_sum.view().head(b, h)[e] += dk2.view().head(b, h)[e];
          dv_sum.view().head(b, h)[e] += dv2.view().head(b, h)[e];
        }
    EXPECT_LE(max_rel_diff(dk.data(), dk_sum.data(), dk.numel()), 1e-5);
    EXPECT_LE(max_rel_diff(dv.data(), dv_sum.data(), dv.numel()), 1e-5);
    if (info->name == "full" || info->name == "flash") {
      const GradErrorStats st =
          measure_grad_error(p, in.q.view(), in.k.view(), in.v.view(), dout.view(), dq.view(),
                             dk.view(), dv.view(), 1e12);
      EXPECT_LE(st.k, 1e-5);
      EXPECT_LE(st.v, 1e-5);
      EXPECT_LE(st.q, 1e-5);
      // a gradient of one query head's copy alone is far from the group's sum
      const GradErrorStats wrong = measure_grad_error(
          p, in.q.view(), in.k.view(), in.v.view(), dout.view(), dq.view(),
          ConstTensorView(dk2.data(), p.kv_storage_shape(), p.kv_group()), dv.view(), 1e12);
      EXPECT_GT(wrong.k, 0.1);
    }
  }
}

// The KV cache of full, flash and local holds G heads: decoding a grouped problem gives the
// grouped forward's rows, with a state H / G times smaller than the ungrouped one.
TEST(Gqa, KvCacheDecodeHoldsOneHeadPerGroup) {
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (const std::string spec : {"full", "flash", "local:window=9"})
      for (int64_t g : {4, 2, 1}) {
        SCOPED_TRACE(spec + " G=" + std::to_string(g) + " threads=" + std::to_string(threads));
        Problem p = test::problem(2, 4, 131, 0, 16, true, 9);
        p.kv_heads = g;
        const Inputs in = generate_inputs(p);
        auto variant = make_variant(spec);
        Tensor forward(p.q_shape());
        variant->run(p, in.q.view(), in.k.view(), in.v.view(), forward.view());
        variant->check_decode(p);
        for (int64_t t0 : {int64_t(0), int64_t(70)}) {
          auto state = variant->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
          const double bytes = state->state_bytes();
          const int64_t kept = spec == "local:window=9" ? std::min<int64_t>(t0, 10) : t0;
          EXPECT_EQ(bytes, double(g * kept * 2 * 16 * 4));
          Tensor out(p.q_shape());
          for (int64_t t = t0; t < p.n; ++t) {
            auto row = [&](auto view) {
              view.data = view.row(0, 0, t);
              view.shape.len = 1;
              return view;
            };
            state->step(row(in.q.view()), row(in.k.view()), row(in.v.view()), row(out.view()));
          }
          double diff = 0, norm = 0;
          for (int64_t b = 0; b < p.batch; ++b)
            for (int64_t h = 0; h < p.heads; ++h)
              for (int64_t i = t0; i < p.n; ++i)
                for (int64_t c = 0; c < p.dim; ++c) {
                  const double x = out.view().row(b, h, i)[c], r = forward.view().row(b, h, i)[c];
                  diff += (x - r) * (x - r), norm += r * r;
                }
          EXPECT_LE(std::sqrt(diff / norm), 1e-5) << "t0=" << t0;
        }
      }
  }
}

// Small chunks: many chunks per key/value head, each scored for every query head of the group.
TEST(Gqa, KvCacheChunksServeEveryHeadOfTheGroup) {
  Problem p = test::problem(1, 8, 300, 0, 24, true, 2);
  p.kv_heads = 2;
  const Inputs in = generate_inputs(p);
  Tensor forward(p.q_shape());
  make_variant("full")->run(p, in.q.view(), in.k.view(), in.v.view(), forward.view());
  ThreadTeam team(2);
  KvDecodeOptions opt;
  opt.min_chunk = 7, opt.max_chunk = 13, opt.parallel_floats = 0;
  auto state = kv_decode_prefill(p, in.k.view(), in.v.view(), 150, opt);
  EXPECT_EQ(state->step_bytes_read(), double((2 * (151 * 2 + 2) + 8 * 2) * 24 * 4));
  Tensor out(p.q_shape());
  for (int64_t t = 150; t < p.n; ++t) {
    auto row = [&](auto view) {
      view.data = view.row(0, 0, t);
      view.shape.len = 1;
      return view;
    };
    state->step(row(in.q.view()), row(in.k.view()), row(in.v.view()), row(out.view()));
  }
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t i = 150; i < p.n; ++i)
      for (int64_t c = 0; c < p.dim; ++c)
        ASSERT_NEAR(out.view().row(0, h, i)[c], forward.view().row(0, h, i)[c], 1e-5)
            << "h=" << h << " i=" << i;
}

TEST(Gqa, SweepCrossesKvHeadsWithHeads) {
  SweepAxes axes;
  axes.seqs = {64};
  axes.batches = {1};
  axes.heads = {4, 6};
  axes.dims = {8};
  axes.causals = {false};
  axes.inputs = {"gaussian"};
  axes.kv_heads = {0, 2, 4};
  std::vector<std::unique_ptr<Variant>> variants;
  variants.push_back(make_variant("flash"));
  const SweepPlan plan = plan_sweep(std::move(variants), axes);
  std::vector<std::string> got;
  for (const auto& c : plan.configs)
    got.push_back(std::to_string(c.problem.heads) + "/" +
                  std::to_string(c.problem.kv_head_count()));
  // H = 4: G = 4 (as 0 and as 4, one row), 2; H = 6: G = 6, 2 (4 does not divide 6)
  EXPECT_EQ(got, (std::vector<std::string>{"4/4", "4/2", "6/6", "6/2"}));
  EXPECT_EQ(plan.duplicates.size(), 1u);
  axes.kv_heads = {5};
  std::vector<std::unique_ptr<Variant>> again;
  again.push_back(make_variant("flash"));
  EXPECT_CONTAINS(test::error_message<UsageError>([&] { plan_sweep(std::move(again), axes); }),
                  "--kv-heads 5 divides none of the head counts");
}

}  // namespace
}  // namespace attnbench
