// retention and gla (common/engines/decay_attention.h): both forms against the float64 recurrence
// on ragged lengths, chunks that do not divide n, chunk 1, grouped-query heads and B > 1; retention
// against its parallel form (s Q K^T o D) V; strong decays; decode steps against the causal
// forward; gradients against finite differences; the refusals.
#include "common/engines/decay_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "decode_util.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::causal_problem;

// Relative Frobenius error of spec's output against the float64 recurrence.
double error_vs_recurrence(const std::string& spec, const Problem& p, const Inputs& in) {
  const Tensor out = test::run(spec, p, in);
  auto var = make_variant(spec);
  const std::vector<double> ref =
      var->info().oracle(*var, p, in.q.view(), in.k.view(), in.v.view());
  return test::rel_fro_error(out.data(), ref);
}

TEST(DecayAttention, BothFormsMatchTheRecurrenceOnRaggedLengths) {
  const std::vector<std::string> specs = {"retention",          "retention:form=recurrent",
                                          "retention:chunk=7",  "retention:chunk=1",
                                          "retention:chunk=48", "gla",
                                          "gla:form=recurrent", "gla:chunk=7",
                                          "gla:chunk=1",        "gla:chunk=40"};
  for (int64_t n : {1, 7, 33, 100, 257, 1000})
    for (const std::string& spec : specs) {
      SCOPED_TRACE(spec + std::string(" n=") + std::to_string(n));
      // B = 2, H = 4 over G = 2 key/value heads
      const Problem p = causal_problem(2, 4, 2, n, n == 1000 ? 64 : 16, uint64_t(n));
      const Inputs in = generate_inputs(p);
      EXPECT_LE(error_vs_recurrence(spec, p, in), 1e-5);
    }
}

TEST(DecayAttention, RetentionEqualsItsParallelForm) {
  for (int64_t n : {1, 33, 257}) {
    const Problem p = causal_problem(1, 8, 4, n, 32, 7);
    const Inputs in = generate_inputs(p);
    const double s = 1.0 / std::sqrt(double(p.dim));
    for (const char* spec : {"retention", "retention:form=recurrent", "retention:chunk=5"}) {
      const Tensor out = test::run(spec, p, in);
      double diff = 0, norm = 0;
      for (int64_t h = 0; h < p.heads; ++h) {
        const double gamma = 1.0 - std::ldexp(1.0, int(-5 - h));
        for (int64_t i = 0; i < n; ++i)
          for (int64_t c = 0; c < p.dim; ++c) {
            double o = 0;
            for (int64_t j = 0; j <= i; ++j) {
              double dot = 0;
              for (int64_t e = 0; e < p.dim; ++e)
                dot += double(in.q.view().row(0, h, i)[e]) * in.k.view().row(0, h, j)[e];
              o += s * dot * std::pow(gamma, double(i - j)) * in.v.view().row(0, h, j)[c];
            }
            const double x = out.view().row(0, h, i)[c];
            diff += (x - o) * (x - o), norm += o * o;
          }
      }
      EXPECT_LE(std::sqrt(diff / norm), 1e-5) << spec << " n=" << n;
    }
  }
}

TEST(DecayAttention, GlaStaysExactUnderStrongDecays) {
  // tau = 1 and keys 10 times larger: log a_t down to about -30 per step on half the
  // dimensions, so a sub-chunk's own decay passes e^60 and its diagonal takes the direct path
  for (const char* spec : {"gla:tau=1", "gla:tau=1,chunk=64", "gla:tau=1,chunk=13",
                           "gla:tau=1,form=recurrent", "gla:tau=4"}) {
    for (int64_t n : {33, 257, 1000}) {
      const Problem p = causal_problem(1, 2, 1, n, 32, 11);
      Inputs in = generate_inputs(p);
      for (int64_t i = 0; i < in.k.numel(); ++i) in.k.data()[i] *= 10.0f;
      const double err = error_vs_recurrence(spec, p, in);
      EXPECT_LE(err, 1e-5) << spec << " n=" << n;
      EXPECT_TRUE(std::isfinite(err));
    }
  }
}

TEST(DecayAttention, DecodeStepsEqualTheCausalForward) {
  for (const char* spec : {"retention", "gla", "gla:chunk=5"})
    for (int64_t t0 : {0, 1, 37, 70}) {
      const Problem p = causal_problem(2, 4, 2, 71, 16, 5);
      const Inputs in = generate_inputs(p);
      auto var = make_variant(spec);
      const Tensor ref = test::run(spec, p, in);
      Tensor out(p.q_shape());
      auto state = var->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
      test::step_to_end(*state, p.n, in.q.view(), in.k.view(), in.v.view(), out.view());
      EXPECT_LE(test::rows_error(p, out, ref.data(), t0), 1e-5) << spec << " t0=" << t0;
      EXPECT_THROW(state->step(test::row_view(in.q.view(), 0), test::row_view(in.k.view(), 0),
                               test::row_view(in.v.view(), 0), test::row_view(out.view(), 0)),
                   UsageError);
    }
}

TEST(DecayAttention, GradientsMatchFiniteDifferences) {
  constexpr double kStep = 0x1p-9, kTol = 1e-3;
  for (const char* spec :
       {"retention:chunk=4", "retention:chunk=64", "gla:chunk=4", "gla:tau=2,chunk=3"}) {
    SCOPED_TRACE(spec);
    // H = 4 over G = 2: gla's state is shared by two query heads
    const Problem p = causal_problem(2, 4, 2, 13, 8, 21);
    Inputs in = generate_inputs(p);
    for (Tensor* t : {&in.q, &in.k, &in.v})  // on a grid: x +- h stays exact in float
      for (int64_t i = 0; i < t->numel(); ++i)
        t->data()[i] = float(std::nearbyint(double(t->data()[i]) * 4096.0) / 4096.0);
    auto var = make_variant(spec);
    std::mt19937_64 rng(5);
    std::normal_distribution<double> nd;
    Tensor dout(p.q_shape()), out(p.q_shape()), dq(p.q_shape());
    for (int64_t i = 0; i < dout.numel(); ++i) dout.data()[i] = float(nd(rng));
    Tensor dk(p.kv_storage_shape(), p.kv_group()), dv(p.kv_storage_shape(), p.kv_group());
    const auto saved = var->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    var->run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout.view(), *saved,
                      dq.view(), dk.view(), dv.view());
    auto loss = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
      const std::vector<double> o = var->info().oracle(*var, p, q.view(), k.view(), v.view());
      double l = 0;
      for (size_t i = 0; i < o.size(); ++i) l += double(dout.data()[i]) * o[i];
      return l;
    };
    const Tensor* inputs[3] = {&in.q, &in.k, &in.v};
    const Tensor* grads[3] = {&dq, &dk, &dv};
    for (int which = 0; which < 3; ++which) {
      SCOPED_TRACE(which);
      test::expect_matches_differences(
          *grads[which], rng, 3, 3, kTol, [&](const std::vector<double>& u) {
            auto moved = [&](double sign) {
              Tensor t(inputs[which]->shape(), inputs[which]->group());
              for (int64_t i = 0; i < t.numel(); ++i)
                t.data()[i] = float(double(inputs[which]->data()[i]) + sign * kStep * u[size_t(i)]);
              return loss(which == 0 ? t : in.q, which == 1 ? t : in.k, which == 2 ? t : in.v);
            };
            return (moved(1.0) - moved(-1.0)) / (2.0 * kStep);
          });
    }
  }
}

TEST(DecayAttention, RefusesNonCausalAndCrossProblems) {
  for (const char* spec : {"retention", "gla"}) {
    auto var = make_variant(spec);
    EXPECT_TRUE(var->info().caps.causal_only);
    EXPECT_FALSE(var->info().caps.cross);
    EXPECT_FALSE(var->info().caps.exact);
    EXPECT_THROW(var->check_supported(test::problem(1, 2, 16, 0, 8, /*causal=*/false)),
                 UnsupportedError);
    EXPECT_THROW(var->check_supported(test::problem(1, 2, 16, 24, 8, /*causal=*/true)),
                 UnsupportedError);
    EXPECT_NO_THROW(var->check_supported(test::problem(1, 2, 16, 0, 8, /*causal=*/true)));
    test::expect_decodes_causal_self_attention_only(*var);
  }
}

}  // namespace
}  // namespace attnbench
