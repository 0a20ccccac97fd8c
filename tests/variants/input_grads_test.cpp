// The gradients of the learned inputs (Backward::backward_inputs) of deltanet (beta, and g when
// gated), gated rfa (g) and linformer (E, and F without share_kv): each given input's gradient
// against central differences of the variant's float64 oracle with that input moved, and dq,
// dk, dv with the inputs given against central differences in q, k and v (the given inputs
// held, so nothing of the stand-ins' dependence on k may remain in dk). Ragged shapes: n not a
// multiple of the chunk spacings, grouped heads, two batch elements, cross attention and key
// padding where the variant takes them. Every input and every step lies on a grid of 2^-12,
// so the steps are exact. Each test prints the worst relative error of each gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "test_util.h"

namespace attnbench {
namespace {

void snap(Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = test::on_grid(t.data()[i]);
}

struct Given {
  std::string name;
  double lo, hi;
};

// The worst relative error of each gradient over a test's cases, printed when it ends.
class Worst {
 public:
  explicit Worst(std::string test) : test_(std::move(test)) {}
  ~Worst() {
    for (const auto& [name, e] : worst_)
      std::printf("[ worst    ] %s: d%s %.3g\n", test_.c_str(), name.c_str(), e);
  }
  void see(const std::string& name, double e) { worst_[name] = std::max(worst_[name], e); }

 private:
  std::string test_;
  std::map<std::string, double> worst_;
};

// test::expect_matches_differences on a float gradient of `count` entries, returning the
// worst relative error: |<g, u> - c| / |g| over `directions` random +-1 directions, and
// |g_e - c| / max |g| over `entries` random entries (c the central difference; the absolute
// error for a zero gradient).
double check_differences(const float* g, size_t count, std::mt19937_64& rng, int directions,
                         int entries, double tol,
                         const std::function<double(const std::vector<double>&)>& central) {
  double norm = 0, top = 0, worst = 0;
  for (size_t i = 0; i < count; ++i) {
    if (!std::isfinite(g[i])) {
      ADD_FAILURE() << "entry " << i << " of the gradient is " << g[i];
      return NAN;
    }
    norm += double(g[i]) * g[i], top = std::max(top, std::abs(double(g[i])));
  }
  norm = std::sqrt(norm);
  // a zero gradient (the log decay of a state that is still 0) must be exactly so
  auto relative = [](double err, double scale) { return scale > 0 ? err / scale : err; };
  std::vector<double> u(count);
  for (int t = 0; t < directions; ++t) {
    double dot = 0;
    for (size_t i = 0; i < count; ++i) {
      u[i] = (rng() & 1) ? 1.0 : -1.0;
      dot += u[i] * double(g[i]);
    }
    const double c = central(u);
    EXPECT_NEAR(dot, c, tol * norm) << "direction " << t << ", |grad| " << norm;
    worst = std::max(worst, relative(std::abs(dot - c), norm));
  }
  for (int t = 0; t < entries; ++t) {
    const size_t e = size_t(rng() % uint64_t(count));
    std::fill(u.begin(), u.end(), 0.0);
    u[e] = 1.0;
    const double c = central(u);
    EXPECT_NEAR(double(g[e]), c, tol * top) << "entry " << e;
    worst = std::max(worst, relative(std::abs(double(g[e]) - c), top));
  }
  return worst;
}

constexpr double kTol = 2e-4;
constexpr double kInputStep = 0x1p-12, kQkvStep = 0x1p-12;

// Runs the training pass of `spec` on p with `given` inputs and checks the gradient of each
// given input, and dq, dk and dv, against central differences of the oracle.
void check_input_grads(const std::string& spec, const Problem& p, const std::vector<Given>& given,
                       Worst& worst) {
  SCOPED_TRACE(spec + " " + p.str());
  auto var = make_variant(spec);
  Inputs in = generate_inputs(p);
  snap(in.q), snap(in.k), snap(in.v);
  auto extra = std::make_shared<ExtraInputs>();
  uint64_t seed = p.seed;
  for (const Given& g : given)
    extra->emplace(g.name, test::uniform_input(*var, p, g.name, g.lo, g.hi, ++seed, true));
  Problem pg = p;
  pg.extra_inputs = extra;
  std::mt19937_64 rng(p.seed);
  const test::TrainStep step = test::train_step(*var, pg, in, rng);
  const Tensor &dout = step.dout, &dq = step.dq, &dk = step.dk, &dv = step.dv;
  const InputGrads& dinputs = step.dinputs;
  ASSERT_EQ(dinputs.size(), given.size());
  // L = sum(dout o oracle) on the inputs as moved
  auto loss = [&](const Problem& with, const Tensor& q, const Tensor& k, const Tensor& v) {
    const std::vector<double> o = var->info().oracle(*var, with, q.view(), k.view(), v.view());
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += double(dout.data()[i]) * o[i];
    return l;
  };
  for (const Given& g : given) {
    ASSERT_EQ(dinputs.count(g.name), 1u) << g.name;
    const std::vector<float>& grad = dinputs.at(g.name);
    const ExtraInput& x = extra->at(g.name);
    ASSERT_EQ(grad.size(), x.data.size()) << g.name;
    auto central = [&](const std::vector<double>& u) {
      auto at = [&](double sign) {
        auto moved = std::make_shared<ExtraInputs>(*extra);
        std::vector<float>& data = moved->at(g.name).data;
        for (size_t i = 0; i < data.size(); ++i)
          data[i] = float(double(x.data[i]) + sign * kInputStep * u[i]);
        Problem pm = p;
        pm.extra_inputs = moved;
        return loss(pm, in.q, in.k, in.v);
      };
      return (at(1.0) - at(-1.0)) / (2.0 * kInputStep);
    };
    SCOPED_TRACE("d" + g.name);
    worst.see(g.name, check_differences(grad.data(), grad.size(), rng, 3, 3, kTol, central));
  }
  // dq, dk and dv of the function with the given inputs held
  auto qkv = [&](const char* which, const Tensor& grad) {
    auto central = [&](const std::vector<double>& u) {
      auto at = [&](double sign) {
        const Tensor& base = which[0] == 'q' ? in.q : which[0] == 'k' ? in.k : in.v;
        Tensor moved(base.shape(), base.group());
        for (int64_t i = 0; i < moved.numel(); ++i)
          moved.data()[i] = float(double(base.data()[i]) + sign * kQkvStep * u[size_t(i)]);
        return loss(pg, which[0] == 'q' ? moved : in.q, which[0] == 'k' ? moved : in.k,
                    which[0] == 'v' ? moved : in.v);
      };
      return (at(1.0) - at(-1.0)) / (2.0 * kQkvStep);
    };
    SCOPED_TRACE(which);
    worst.see(which,
              check_differences(grad.data(), size_t(grad.numel()), rng, 2, 2, kTol, central));
  };
  qkv("q", dq);
  qkv("k", dk);
  qkv("v", dv);
}

// deltanet's dL/dbeta and dL/dg (g = log alpha, gated), per key/value head; both forms, chunk
// spacings that do not divide n, either input given alone (the other stood in).
TEST(InputGrads, DeltanetBetaAndG) {
  Worst worst("InputGrads.DeltanetBetaAndG");
  const Given beta{"beta", 0.05, 0.95}, g{"g", -0.5, -0.01};
  const std::vector<std::pair<std::string, std::vector<Given>>> cases = {
      {"deltanet", {beta}},
      {"deltanet:chunk=4", {beta}},
      {"deltanet:form=recurrent,chunk=3", {beta}},
      {"deltanet:gated=true", {beta, g}},
      {"deltanet:gated=true,chunk=5", {beta, g}},
      {"deltanet:gated=true,form=recurrent,chunk=4", {beta, g}},
      {"deltanet:gated=true,chunk=4", {g}},
      {"deltanet:gated=true,chunk=3", {beta}}};
  for (const auto& [spec, given] : cases)
    for (int64_t n : {1, 13}) {
      const Problem p = test::causal_problem(2, 4, 2, n, 8, uint64_t(n * 3 + given.size()));
      check_input_grads(spec, p, given, worst);
    }
}

// gated rfa's dL/dg_j per key and query head: self- and cross-attention (the causal mask
// bottom-right aligned), grouped heads, and key padding (the keys past L_b get 0).
TEST(InputGrads, RfaGate) {
  Worst worst("InputGrads.RfaGate");
  const std::vector<Given> g = {{"g", 0.05, 0.95}};
  for (int64_t m : {0, 21}) {
    Problem p = test::problem(2, 4, 13, m, 8, /*causal=*/true, uint64_t(m + 2));
    p.kv_heads = 2;
    check_input_grads("rfa:gate=true,features=16", p, g, worst);
  }
  Problem padded = test::problem(2, 2, 13, 0, 8, /*causal=*/true, 5);
  padded.key_lengths = {13, 6};
  check_input_grads("rfa:gate=true,features=8,sigma=2", padded, g, worst);
  // more keys than one chunk of the backward's checkpoints (64)
  check_input_grads("rfa:gate=true,features=8", test::causal_problem(1, 2, 1, 70, 4, 6), g, worst);
}

// linformer's dL/dE and dL/dF per query head (a key/value head's k and v under each of its
// query heads' projections), with share_kv (E serves keys and values: both parts), E or F given
// alone, cross attention and key padding (the columns past L_b get nothing from element b).
TEST(InputGrads, LinformerProjections) {
  Worst worst("InputGrads.LinformerProjections");
  const Given e{"E", -0.25, 0.25}, f{"F", -0.25, 0.25};
  const std::vector<std::pair<std::string, std::vector<Given>>> cases = {
      {"linformer:proj=8", {e, f}},
      {"linformer:proj=8,share_kv=true", {e}},
      {"linformer:proj=5", {e}},
      {"linformer:proj=5", {f}}};
  for (const auto& [spec, given] : cases) {
    Problem p = test::problem(2, 4, 13, 21, 8, /*causal=*/false, 7);
    p.kv_heads = 2;
    check_input_grads(spec, p, given, worst);
    p.key_lengths = {21, 9};
    check_input_grads(spec, p, given, worst);
  }
}

// With no input given the backward is the stand-ins' as before: run_backward without a place
// for input gradients, and dk differs from the one with the same values given (the stand-in's
// dependence on k reaches dk only when it is the stand-in).
TEST(InputGrads, StandInsStillGoIntoDk) {
  const Problem p = test::causal_problem(1, 2, 2, 9, 8, 11);
  auto var = make_variant("deltanet:gated=true");
  const Inputs in = generate_inputs(p);
  const Tensor dout = generate_dout(p);
  auto grads = [&](const Problem& q, InputGrads* dinputs) {
    Tensor out(p.q_shape()), dq(p.q_shape()), dk(p.kv_tensor()), dv(p.kv_tensor());
    const auto saved = var->run_train(q, in.q.view(), in.k.view(), in.v.view(), out.view());
    var->run_backward(q, in.q.view(), in.k.view(), in.v.view(), out.view(), dout.view(), *saved,
                      dq.view(), dk.view(), dv.view(), dinputs);
    return dk;
  };
  const Tensor stood = grads(p, nullptr);
  auto extra = std::make_shared<ExtraInputs>();
  extra->emplace("beta", ExtraInput{{1, 2, 9}, std::vector<float>(18, 0.5f)});
  Problem pg = p;
  pg.extra_inputs = extra;
  EXPECT_CONTAINS(test::error_message<UsageError>([&] { grads(pg, nullptr); }),
                  "needs somewhere to write their gradients");
  InputGrads dinputs;
  const Tensor held = grads(pg, &dinputs);
  EXPECT_EQ(dinputs.size(), 1u);
  std::vector<double> a(stood.data(), stood.data() + stood.numel());
  EXPECT_GT(test::rel_fro_error(held.data(), a), 1e-3);
}

}  // namespace
}  // namespace attnbench
