// The decode step of the kernel variants (common/core/decode.h): linear, performer and rfa (plain
// on the engine's state, feature_map::prefill_state; gated on its own recurrence). A
// prefill of t0 tokens and steps through t0 .. n - 1, each fed row t of q, k and v as strided
// [B, H, 1, d] views into the whole tensors, must give rows t0 .. n - 1 of the variant's causal
// forward pass on the same inputs.
//
// Tolerance. Both are float32 evaluations of one function that differ only in their order of
// rounding: the forward sums a row's keys as GEMMs over blocks plus a masked product inside its
// 16-row chunk, the decode as GEMMs over the prefill's blocks plus one rank-1 update per step;
// features are mapped in blocks or one row at a time (the projection GEMMs may round
// differently), the Performer's keys at the shift of their block or of their step; phi(q)^T S
// is a GEMM or a GEMV. Each of the two is within the variant's own error model of the float64
// function (VariantInfo::tolerance, else the default attention_tolerance;
// common/reference/oracle.h), whose terms are exactly these: the reductions over the keys and
// features (u sqrt(m + F)), the projection entering exp, sin or cos (u sqrt(d) times the exponent
// or angle), a few roundings, and for rfa the amplification of rows near the denominator floor. By
// the triangle inequality the two are within twice that of each other: 2 tol, from 1.4e-5 (linear,
// d = 64, n = 300) to about 6e-5 (performer) and 8e-4 (rfa, whose floor amplification is 4 e^2 =
// 30). The worst measured error in units of that bound is printed.
//
// The bound is loose for a correct decoder and far below what a wrong one gives: a key added
// at a scale S and z were not brought to (a skipped rescale when the Performer's shift rises)
// is off by a factor exp(rise) > e in its weight; linear:eps=1 and rfa:features=4, plain and
// gated (whose rows hit the floor), make a missing eps or floor an O(1e-2) error or more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/engines/feature_map_attention.h"
#include "common/io/inputs.h"
#include "common/reference/oracle.h"
#include "decode_util.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::row_view;

namespace fmap = feature_map;

/// Prefill t0 tokens, then a step for each of t0 .. n - 1; their outputs into rows t0 .. n - 1
/// of a [B, H, n, d] tensor (rows < t0 stay 0). The state is kept for further checks.
struct Decoded {
  Tensor out;
  std::unique_ptr<DecodeState> state;
};
Decoded decode(Variant& var, const Problem& p, const Inputs& in, int64_t t0) {
  var.check_decode(p);
  Decoder* dec = var.decoder();
  Decoded r{Tensor(p.q_shape()), dec->prefill(p, in.k.view(), in.v.view(), t0)};
  EXPECT_EQ(r.state->length(), t0);
  test::step_to_end(*r.state, p.n, in.q.view(), in.k.view(), in.v.view(), r.out.view());
  return r;
}

/// Twice the variant's error model against its float64 function (see the top).
double decode_tolerance(const Variant& var, const Problem& p, const Workload& w = Workload{}) {
  const VariantInfo& info = var.info();
  return 2.0 * (info.tolerance ? info.tolerance(var, p, w) : attention_tolerance(p, w));
}

const std::vector<std::string>& decode_specs() {
  static const std::vector<std::string> specs = {"linear",
                                                 "linear:eps=1",
                                                 "performer",
                                                 "performer:kernel=relu",
                                                 "performer:orthogonal=false",
                                                 "rfa",
                                                 "rfa:features=4",
                                                 "rfa:gate=true",
                                                 "rfa:gate=true,features=4"};
  return specs;
}

/// Decodes spec on p from each t0 and compares with the causal forward; returns the worst
/// error in units of the tolerance. `prepare`: draws prepared before the forward and the decode
/// (else each draws its own).
double expect_decode_matches_forward(const std::string& spec, const Problem& p, const Inputs& in,
                                     const std::vector<int64_t>& t0s, bool prepare,
                                     const Workload& w = Workload{}) {
  auto var = make_variant(spec);
  if (prepare) var->prepare(p);
  Tensor fwd(p.q_shape());
  var->run(p, in.q.view(), in.k.view(), in.v.view(), fwd.view());
  if (spec.find("features=4") != std::string::npos && p.n > 1) {  // the floor is exercised
    EXPECT_NE(var->notes().find("divided by the floor"), std::string::npos) << var->notes();
  }
  const double tol = decode_tolerance(*var, p, w);
  double worst = 0;
  for (int64_t t0 : t0s) {
    SCOPED_TRACE("t0 = " + std::to_string(t0));
    const Decoded dec = decode(*var, p, in, t0);
    const double err = test::rows_error(p, dec.out, fwd.data(), t0);
    EXPECT_LE(err, tol) << spec << " " << p.str();
    worst = std::max(worst, err / tol);
  }
  return worst;
}

TEST(DecodeKernel, StepsMatchTheCausalForward) {
  test::ScopedThreads threads(2);  // B H = 6 >= 2: OpenMP over (batch, head)
  for (const std::string& spec : decode_specs()) {
    double worst = 0;
    for (int64_t d : {16, 64, 17})
      for (int64_t n : {1, 37, 300}) {
        const Problem p = test::problem(2, 3, n, 0, d, true, uint64_t(11 + d + n));
        SCOPED_TRACE(spec + " " + p.str());
        const Inputs in = generate_inputs(p);
        // performer and rfa: with prepared draws (shared by the state) for odd n
        worst =
            std::max(worst, expect_decode_matches_forward(spec, p, in, {0, n / 2, n}, n % 2 == 1));
      }
    std::printf("%-28s worst decode error %.3g of the tolerance\n", spec.c_str(), worst);
  }
}

TEST(DecodeKernel, OneThreadAndFewerHeadsThanThreads) {
  for (const std::string& spec : decode_specs()) {
    SCOPED_TRACE(spec);
    {
      test::ScopedThreads threads(1);
      const Problem p = test::problem(2, 3, 300, 0, 64, true, 5);
      const Inputs in = generate_inputs(p);
      expect_decode_matches_forward(spec, p, in, {0, 150}, false);
    }
    {
      test::ScopedThreads threads(2);  // one head: the calling thread, BLAS multi-threaded
      const Problem p = test::problem(1, 1, 300, 0, 64, true, 6);
      const Inputs in = generate_inputs(p);
      expect_decode_matches_forward(spec, p, in, {0, 150}, true);
    }
  }
}

// Keys whose norm grows along the positions raise the Performer's key shift during the steps,
// so S and z must be rescaled by exp(old - new) as keys arrive.
TEST(DecodeKernel, PerformerShiftRisesDuringDecode) {
  test::ScopedThreads threads(2);
  for (int64_t d : {16, 64}) {
    const Problem p = test::problem(2, 3, 300, 0, d, true, 31);
    Inputs in = generate_inputs(p);
    // key t scaled by 0.05 + 1.2 t / (n - 1): from 0.05 to 1.25 times the gaussian's size
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t t = 0; t < p.n; ++t) {
          float* row = in.k.view().row(b, h, t);
          const float s = float(0.05 + 1.2 * double(t) / double(p.n - 1));
          for (int64_t c = 0; c < d; ++c) row[c] *= s;
        }
    const int64_t F = 256;
    for (int64_t t0 : {p.n / 8, p.n / 4}) {
      // the shift after the prefill and after every key, in double: the running max over
      // keys and features of (W k~)_f - |k~|^2 / 2; it must rise during the steps by more than
      // 1 in every (batch, head), a factor e on S and z
      for (int64_t h = 0; h < p.heads; ++h) {
        const std::vector<float> w = fmap::performer_projection(p.seed, h, F, d, true);
        const double xs = std::pow(double(d), -0.25);
        for (int64_t b = 0; b < p.batch; ++b) {
          double before = -INFINITY, after = -INFINITY;  // over keys < t0, keys >= t0
          for (int64_t t = 0; t < p.n; ++t) {
            const float* k = in.k.view().row(b, h, t);
            double half = 0, top = -INFINITY;
            for (int64_t c = 0; c < d; ++c) half += 0.5 * (k[c] * xs) * (k[c] * xs);
            for (int64_t f = 0; f < F; ++f) {
              double a = 0;
              for (int64_t c = 0; c < d; ++c) a += double(w[size_t(f * d + c)]) * k[c] * xs;
              top = std::max(top, a - half);
            }
            double& side = t < t0 ? before : after;
            side = std::max(side, top);
          }
          EXPECT_GT(after - before, 1.0) << "d " << d << " t0 " << t0 << " (b, h) " << b << h;
        }
      }
      SCOPED_TRACE("d = " + std::to_string(d));
      // the model's logit size: keys up to 1.25 times the gaussian's
      Workload w;
      w.scale = 1.25;
      for (const char* spec : {"performer", "performer:orthogonal=false,features=64"}) {
        SCOPED_TRACE(spec);
        const double worst = expect_decode_matches_forward(spec, p, in, {t0}, false, w);
        std::printf("%s d=%lld t0=%lld growing keys: %.3g of the tolerance\n", spec,
                    static_cast<long long>(d), static_cast<long long>(t0), worst);
      }
    }
  }
}

TEST(DecodeKernel, StepOnAFullStateThrows) {
  test::ScopedThreads threads(1);
  for (const std::string& spec : decode_specs()) {
    SCOPED_TRACE(spec);
    const Problem p = test::problem(1, 2, 5, 0, 8, true, 3);
    const Inputs in = generate_inputs(p);
    auto var = make_variant(spec);
    Tensor out(p.q_shape());
    auto step = [&](DecodeState& st, int64_t t) {
      st.step(row_view(in.q.view(), t), row_view(in.k.view(), t), row_view(in.v.view(), t),
              row_view(out.view(), t));
    };
    // prefilled to n: full at once
    auto full = var->decoder()->prefill(p, in.k.view(), in.v.view(), p.n);
    EXPECT_NE(test::error_message<UsageError>([&] { step(*full, p.n - 1); }).find("full"),
              std::string::npos);
    // stepped to n
    auto st = var->decoder()->prefill(p, in.k.view(), in.v.view(), 2);
    for (int64_t t = 2; t < p.n; ++t) step(*st, t);
    EXPECT_EQ(st->length(), p.n);
    EXPECT_NE(test::error_message<UsageError>([&] { step(*st, p.n - 1); }).find("full"),
              std::string::npos);
    EXPECT_EQ(st->length(), p.n);
    // a view of another shape
    Tensor wide(Shape4{1, 3, 1, 8});
    auto fresh = var->decoder()->prefill(p, in.k.view(), in.v.view(), 0);
    test::error_message<UsageError>([&] {
      fresh->step(row_view(in.q.view(), 0), row_view(in.k.view(), 0), row_view(in.v.view(), 0),
                  wide.view());
    });
    EXPECT_EQ(fresh->length(), 0);
  }
}

TEST(DecodeKernel, CheckDecodeRefusesNonCausalAndCross) {
  for (const std::string& spec : decode_specs()) {
    SCOPED_TRACE(spec);
    auto var = make_variant(spec);
    ASSERT_NE(var->decoder(), nullptr);
    EXPECT_NO_THROW(var->check_decode(test::problem(1, 2, 64, 0, 16, true)));
    EXPECT_NO_THROW(var->check_decode(test::problem(1, 2, 64, 64, 16, true)));
    test::error_message<UnsupportedError>(
        [&] { var->check_decode(test::problem(1, 2, 64, 0, 16, false)); });
    test::error_message<UnsupportedError>(
        [&] { var->check_decode(test::problem(1, 2, 64, 80, 16, true)); });
    test::error_message<UnsupportedError>(
        [&] { var->check_decode(test::problem(1, 2, 80, 64, 16, true)); });
  }
}

TEST(DecodeKernel, StateBytesIndependentOfLength) {
  test::ScopedThreads threads(1);
  struct Case {
    std::string spec;
    int64_t features;  // F, the entries of phi
  };
  const int64_t d = 16;
  const Case cases[] = {{"linear", d},
                        {"performer", 256},
                        {"performer:features=37", 37},
                        {"rfa", 256},
                        {"rfa:gate=true", 256}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec);
    const Problem p = test::problem(2, 3, 40, 0, d, true, 9);
    const Inputs in = generate_inputs(p);
    auto var = make_variant(c.spec);
    const double bytes = double(p.heads * (c.features * d + c.features + 2)) * 4.0;
    const double state_read = double(p.batch * p.heads * (c.features * d + c.features)) * 4.0;
    for (int64_t t0 : {int64_t(0), int64_t(17), p.n}) {
      // after the prefill, and after the steps to n
      auto st = var->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
      EXPECT_EQ(st->state_bytes(), bytes) << "t0 " << t0;
      EXPECT_GE(st->step_bytes_read(), state_read);
      EXPECT_GT(st->step_flops(), 4.0 * double(p.batch * p.heads * c.features * d));
      const Decoded dec = decode(*var, p, in, t0);
      EXPECT_EQ(dec.state->state_bytes(), bytes) << "t0 " << t0;
      EXPECT_EQ(dec.state->step_bytes_read(), st->step_bytes_read());
      EXPECT_EQ(dec.state->step_flops(), st->step_flops());
    }
    EXPECT_GT(var->decoder()->prefill_flops(p, 17), var->decoder()->prefill_flops(p, 0));
  }
}

}  // namespace
}  // namespace attnbench
