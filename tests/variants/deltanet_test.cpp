// deltanet: both forms against the float64 step-by-step recurrence (ragged n, chunks that do not
// divide n, chunk 1, grouped heads, B > 1, gated and not), decode steps against the causal
// forward, gradients against finite differences of the oracle, and the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/core/backward.h"
#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "decode_util.h"
#include "harness/team.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::causal_problem;

/// Relative Frobenius error of `spec` on p against the float64 recurrence.
double oracle_error(const std::string& spec, const Problem& p) {
  const Inputs in = generate_inputs(p);
  const Tensor out = test::run(spec, p, in);
  return test::rel_fro_error(out.data(), test::expected(spec, p, in).out);
}

TEST(DeltaNet, BothFormsMatchTheRecurrence) {
  double worst = 0;
  for (const std::string gated : {"false", "true"})
    for (const std::string form : {"chunkwise,chunk=64", "chunkwise,chunk=16", "chunkwise,chunk=1",
                                   "chunkwise,chunk=48", "recurrent"})
      for (int64_t n : {1, 7, 33, 100, 257, 1000}) {
        const std::string spec = "deltanet:gated=" + gated + ",form=" + form;
        const Problem p = causal_problem(1, 2, 0, n, 64, uint64_t(n));
        SCOPED_TRACE(spec + " " + p.str());
        const double err = oracle_error(spec, p);
        EXPECT_LE(err, 1e-5);
        worst = std::max(worst, err);
      }
  std::printf("[ deltanet ] worst relative error against the recurrence: %.2e\n", worst);
}

TEST(DeltaNet, GroupedHeadsBatchesAndOddDims) {
  for (const std::string spec : {"deltanet", "deltanet:gated=true",
                                 "deltanet:form=recurrent,gated=true", "deltanet:chunk=5"})
    for (int64_t g : {1, 2, 4})
      for (int64_t d : {1, 17, 64}) {
        const Problem p = causal_problem(3, 4, g, 101, d, uint64_t(g * 7 + d));
        SCOPED_TRACE(spec + " " + p.str());
        EXPECT_LE(oracle_error(spec, p), 1e-5);
      }
}

// The recurrence sets apart what plain linear attention would give: the delta rule's output
// on repeated keys differs from sum_j v_j k^_j^T by far more than the tolerance.
TEST(DeltaNet, OracleIsNotPlainLinearAttention) {
  const Problem p = causal_problem(1, 1, 0, 50, 8, 3);
  const Inputs in = generate_inputs(p);
  std::vector<double> plain(size_t(p.n * p.dim), 0.0);
  const ConstTensorView q = in.q.view(), k = in.k.view(), v = in.v.view();
  for (int64_t i = 0; i < p.n; ++i) {
    double qs = 0;
    for (int64_t c = 0; c < p.dim; ++c) qs += double(q.row(0, 0, i)[c]) * q.row(0, 0, i)[c];
    for (int64_t j = 0; j <= i; ++j) {
      double ks = 0, kq = 0;
      for (int64_t c = 0; c < p.dim; ++c)
        ks += double(k.row(0, 0, j)[c]) * k.row(0, 0, j)[c],
            kq += double(k.row(0, 0, j)[c]) * q.row(0, 0, i)[c];
      const double w = kq / std::sqrt(ks * qs * double(p.dim));
      for (int64_t c = 0; c < p.dim; ++c) plain[size_t(i * p.dim + c)] += w * v.row(0, 0, j)[c];
    }
  }
  test::expect_oracle_far_from("deltanet", p, in, plain);
  // and the gate changes the function
  const auto ungated = test::expected("deltanet", p, in).out;
  const std::vector<float> ug(ungated.begin(), ungated.end());
  EXPECT_GT(test::rel_fro_error(ug.data(), test::expected("deltanet:gated=true", p, in).out), 1e-2);
}

// A zero key writes nothing (k^ = 0) and a zero query reads 0.
TEST(DeltaNet, ZeroKeysAndQueries) {
  const Problem p = causal_problem(1, 2, 0, 40, 16, 9);
  Inputs in = generate_inputs(p);
  for (int64_t c = 0; c < p.dim; ++c)
    in.k.view().row(0, 1, 5)[c] = 0, in.k.view().row(0, 0, 39)[c] = 0,
                          in.q.view().row(0, 0, 12)[c] = 0;
  for (const std::string spec : {"deltanet:chunk=8", "deltanet:form=recurrent,gated=true"}) {
    const Tensor out = test::run(spec, p, in);
    EXPECT_LE(test::rel_fro_error(out.data(), test::expected(spec, p, in).out), 1e-5) << spec;
    for (int64_t c = 0; c < p.dim; ++c) EXPECT_EQ(test::at(out, 0, 0, 12, c), 0.0);
  }
}

TEST(DeltaNet, RefusesNonCausalCrossAndPadding) {
  auto v = make_variant("deltanet");
  EXPECT_TRUE(v->info().caps.causal_only);
  EXPECT_FALSE(v->info().caps.exact);
  Problem p = test::problem(1, 2, 16, 0, 8, /*causal=*/false);
  EXPECT_CONTAINS(test::error_message<UnsupportedError>([&] { v->check_supported(p); }), "causal");
  p.causal = true;
  EXPECT_NO_THROW(v->check_supported(p));
  Problem cross = test::problem(1, 2, 16, 20, 8, /*causal=*/true);
  EXPECT_THROW(v->check_supported(cross), UnsupportedError);
  Problem padded = test::problem(2, 2, 16, 0, 8, /*causal=*/true);
  padded.key_lengths = {16, 9};
  EXPECT_THROW(v->check_supported(padded), UnsupportedError);
  test::expect_decodes_causal_self_attention_only(*v);
}

// Prefill t0 tokens (chunkwise), step through the rest: the causal forward's rows.
TEST(DeltaNet, DecodeStepsMatchTheForward) {
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (const std::string spec : {"deltanet", "deltanet:gated=true,chunk=7"})
      for (int64_t n : {1, 37, 100})
        for (int64_t g : {1, 3}) {
          const Problem p = causal_problem(2, 3, g, n, 17, uint64_t(n + g));
          const Inputs in = generate_inputs(p);
          auto variant = make_variant(spec);
          Tensor forward(p.q_shape());
          variant->run(p, in.q.view(), in.k.view(), in.v.view(), forward.view());
          for (int64_t t0 : {int64_t(0), n / 2, n}) {
            SCOPED_TRACE(spec + " " + p.str() + " t0=" + std::to_string(t0));
            auto state = variant->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
            EXPECT_EQ(state->length(), t0);
            EXPECT_EQ(state->state_bytes(), 4.0 * double(p.kv_head_count() * 17 * 32));
            Tensor out(p.q_shape());
            test::step_to_end(*state, p.n, in.q.view(), in.k.view(), in.v.view(), out.view());
            const std::vector<float> fw(forward.data(), forward.data() + forward.numel());
            EXPECT_LE(test::rows_error(p, out, fw, t0), 1e-5);
            if (t0 == n) {
              EXPECT_THROW(
                  state->step(test::row_view(in.q.view(), 0), test::row_view(in.k.view(), 0),
                              test::row_view(in.v.view(), 0), test::row_view(out.view(), 0)),
                  UsageError);
            }
          }
        }
  }
}

/// x rounded to multiples of 2^-12 (so that steps of the finite differences are exact).
void round_grid(Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data()[i] = float(std::nearbyint(double(t.data()[i]) * 4096.0) / 4096.0);
}

// dq, dk, dv against central differences of the float64 recurrence, gated and not, grouped
// heads, chunk spacings that do not divide n.
TEST(DeltaNet, GradientsMatchFiniteDifferences) {
  for (const std::string spec : {"deltanet", "deltanet:gated=true", "deltanet:chunk=4",
                                 "deltanet:gated=true,chunk=3,form=recurrent"})
    for (int64_t g : {2, 1})
      for (int64_t n : {1, 13}) {
        const Problem p = causal_problem(2, 2, g, n, 8, uint64_t(n * 5 + g));
        SCOPED_TRACE(spec + " " + p.str());
        auto var = make_variant(spec);
        Inputs in = generate_inputs(p);
        for (Tensor* t : {&in.q, &in.k, &in.v}) round_grid(*t);
        Tensor dout(p.q_shape()), out(p.q_shape()), dq(p.q_shape()), dk(p.kv_tensor()),
            dv(p.kv_tensor());
        std::mt19937_64 rng(p.seed);
        std::normal_distribution<double> nd;
        for (int64_t i = 0; i < dout.numel(); ++i) dout.data()[i] = float(nd(rng));
        const auto saved = var->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
        var->run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout.view(), *saved,
                          dq.view(), dk.view(), dv.view());
        const Tensor* src[3] = {&in.q, &in.k, &in.v};
        const Tensor* grads[3] = {&dq, &dk, &dv};
        for (int which = 0; which < 3; ++which) {
          SCOPED_TRACE(which);
          auto central = [&](const std::vector<double>& u) {
            auto loss = [&](double sign) {
              Tensor moved(src[which]->shape(), src[which]->group());
              for (int64_t i = 0; i < moved.numel(); ++i)
                moved.data()[i] =
                    float(double(src[which]->data()[i]) + sign * 0x1p-12 * u[size_t(i)]);
              const std::vector<double> o = var->info().oracle(
                  *var, p, (which == 0 ? moved : in.q).view(), (which == 1 ? moved : in.k).view(),
                  (which == 2 ? moved : in.v).view());
              double l = 0;
              for (size_t i = 0; i < o.size(); ++i) l += double(dout.data()[i]) * o[i];
              return l;
            };
            return (loss(1.0) - loss(-1.0)) / (2.0 * 0x1p-12);
          };
          test::expect_matches_differences(*grads[which], rng, 3, 3, 1e-3, central);
        }
      }
}

}  // namespace
}  // namespace attnbench
