// Decoding with given inputs: gla's g and deltanet's beta and g reach the decode recurrence
// token by token (Decoder::prefill_given, DecodeState::step_given). The steps equal the causal
// forward pass given the same tensors; a state keeps to the inputs its prefill took; a
// token's input of the wrong shape and a decoder that takes none are refused, naming why.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

// Every input `v` takes on p, uniform in (lo, hi) of its range: the log decays in
// [-0.5, -0.01], beta in [0.1, 0.9].
std::shared_ptr<ExtraInputs> given_inputs(const Variant& v, const Problem& p, uint64_t seed) {
  auto extra = std::make_shared<ExtraInputs>();
  for (const InputSpec* in : v.inputs()) {
    const bool decay = in->max <= 0.0;
    extra->emplace(in->name, test::uniform_input(v, p, in->name, decay ? -0.5 : 0.1,
                                                 decay ? -0.01 : 0.9, seed++));
  }
  return extra;
}

double rows_error(const Tensor& got, const Tensor& want, const Problem& p, int64_t t0) {
  double num = 0, den = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t t = t0; t < p.n; ++t)
        for (int64_t j = 0; j < p.dim; ++j) {
          const double x = got.view().row(b, h, t)[j], y = want.view().row(b, h, t)[j];
          num += (x - y) * (x - y), den += y * y;
        }
  return std::sqrt(num / den);
}

TEST(DecodeInputs, StepsMatchTheForwardGivenTheSameInputs) {
  for (const std::string spec :
       {"gla", "gla:form=recurrent,chunk=5", "deltanet", "deltanet:gated=true,chunk=6"})
    for (const auto& [g, n, t0] : {std::tuple<int64_t, int64_t, int64_t>{2, 37, 20}, {1, 9, 0}}) {
      Problem p = test::causal_problem(2, 4, g, n, 16, uint64_t(n + g));
      SCOPED_TRACE(spec + " " + p.str() + " t0 " + std::to_string(t0));
      auto var = make_variant(spec);
      const Inputs in = generate_inputs(p);
      p.extra_inputs = given_inputs(*var, p, 7);
      Tensor want(p.q_shape()), got(p.q_shape());
      var->forward(p, in.q.view(), in.k.view(), in.v.view(), want.view());
      // prefill_given on the problem without them; then the problem's own (prefill through p)
      Problem plain = p;
      plain.extra_inputs.reset();
      for (const bool through_p : {false, true}) {
        std::unique_ptr<DecodeState> st =
            through_p ? var->decoder()->prefill(p, in.k.view(), in.v.view(), t0)
                      : var->decoder()->prefill_given(plain, in.k.view(), in.v.view(), t0,
                                                      *p.extra_inputs);
        for (int64_t t = t0; t < n; ++t) {
          const ExtraInputs token = token_inputs(*var, p, t);
          EXPECT_NO_THROW(var->check_token_inputs(plain, token, 1, false));
          st->step_given(test::row_view(in.q.view(), t), test::row_view(in.k.view(), t),
                         test::row_view(in.v.view(), t), token, test::row_view(got.view(), t));
        }
        EXPECT_LT(rows_error(got, want, p, t0), 2e-6);
      }
      // the stand-ins' forward is another function: the inputs were used
      Tensor stood(p.q_shape());
      var->forward(plain, in.q.view(), in.k.view(), in.v.view(), stood.view());
      EXPECT_GT(rows_error(stood, want, p, t0), 1e-3);
    }
}

TEST(DecodeInputs, AStateKeepsToTheInputsOfItsPrefill) {
  Problem p = test::causal_problem(1, 2, 2, 12, 8, 3);
  auto var = make_variant("deltanet:gated=true");
  const Inputs in = generate_inputs(p);
  p.extra_inputs = given_inputs(*var, p, 1);
  Problem plain = p;
  plain.extra_inputs.reset();
  Tensor out(Shape4{1, 2, 1, 8});
  auto q = test::row_view(in.q.view(), 6), k = test::row_view(in.k.view(), 6),
       v = test::row_view(in.v.view(), 6);
  const ExtraInputs token = token_inputs(*var, p, 6);
  auto given = var->decoder()->prefill(p, in.k.view(), in.v.view(), 6);
  EXPECT_CONTAINS(test::error_message<UsageError>([&] { given->step(q, k, v, out.view()); }),
                  "a decode step given no input on a state prefilled with the inputs beta+g");
  ExtraInputs beta_only = token;
  beta_only.erase("g");
  EXPECT_CONTAINS(
      test::error_message<UsageError>([&] { given->step_given(q, k, v, beta_only, out.view()); }),
      "given the inputs beta on a state prefilled with the inputs beta+g");
  auto stood = var->decoder()->prefill(plain, in.k.view(), in.v.view(), 6);
  EXPECT_CONTAINS(
      test::error_message<UsageError>([&] { stood->step_given(q, k, v, token, out.view()); }),
      "prefilled without them (their stand-ins): give them to the prefill as well");
  // shapes: a step takes one token, a prefill at least t0
  ExtraInputs two = token_inputs(*var, p, 6);
  two.erase("g");
  two.at("beta").shape[2] = 2;
  two.at("beta").data.assign(4, 0.5f);
  EXPECT_CONTAINS(
      test::error_message<UsageError>([&] { var->check_token_inputs(plain, two, 1, false); }),
      "the input 'beta' of a decode step has shape [1, 2, 2]; deltanet:");
  EXPECT_CONTAINS(
      test::error_message<UsageError>([&] { var->check_token_inputs(plain, two, 1, false); }),
      "takes beta [B, G, n] with exactly 1 on its token axis (n)");
  EXPECT_CONTAINS(
      test::error_message<UsageError>([&] { var->check_token_inputs(plain, two, 5, true); }),
      "with at least 5 on its token axis");
  EXPECT_NO_THROW(var->check_token_inputs(plain, two, 2, true));
  ExtraInputs high = token;
  high.at("beta").data[0] = 1.5f;
  EXPECT_CONTAINS(
      test::error_message<UsageError>([&] { var->check_token_inputs(plain, high, 1, false); }),
      "holds 1.5 at flat index 0; accepted: values in [0, 1]");
  // a decoder whose recurrence takes no given input says so
  auto rfa = make_variant("rfa:gate=true");
  Problem rp = test::causal_problem(1, 2, 2, 12, 8, 3);
  rp.extra_inputs = given_inputs(*rfa, rp, 2);
  EXPECT_CONTAINS(test::error_message<UnsupportedError>([&] { rfa->check_decode(rp); }),
                  "the decode step takes no given input (g)");
}

// The harness's decode row with an inputs file's learned inputs: ok, nothing stood in.
TEST(DecodeInputs, TheDecodeRowTakesThem) {
  Problem p = test::causal_problem(1, 4, 2, 40, 16, 5);
  auto var = make_variant("gla");
  p.extra_inputs = given_inputs(*var, p, 3);
  Workload w;
  w.pass = "decode";
  const Row row =
      run_one(*var, p, w, nullptr, MachineFigures{}, RunOptions{.reps = 1, .min_time = 0});
  ASSERT_EQ(row.status, "ok") << row.message;
  EXPECT_EQ(row.stand_ins, "");
  EXPECT_GT(row.time_per_token, 0.0);
}

}  // namespace
}  // namespace attnbench
