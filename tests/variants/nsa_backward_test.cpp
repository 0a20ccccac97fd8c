// nsa's backward pass (variants/nsa_backward.cpp): dq, dk, dv and the gradients of the given
// gates g_cmp, g_slc, g_swa against central differences of nsa's float64 oracle, with the
// gates stood in (sigmoid(q . u): their share of dq), given, or some of each; grouped and
// ungrouped heads, ragged lengths, small blocks so that every branch matters and the selection
// leaves blocks out. The selection is held fixed by the backward: the inputs are drawn until
// no position's top-n choice is near a tie, and the steps (2^-20 on inputs on a 2^-12 grid,
// exact in float) are far too small to change it.
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

#include "common/core/backward.h"
#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "harness/team.h"
#include "test_util.h"

namespace attnbench {
namespace {

constexpr double kStep = 0x1p-20;

struct Setting {
  std::string spec;
  int64_t l, s, ls, top;
};

// A: 1 block of up to 16 chosen by score (l = 2 s); B: 2 of up to 7, pooled blocks of 3 strides.
const Setting kA{"nsa:cmp_block=8,cmp_stride=4,sel_block=8,sel_top=4,window=12", 8, 4, 8, 4};
const Setting kB{"nsa:cmp_block=12,cmp_stride=4,sel_block=16,sel_top=5,window=20", 12, 4, 16, 5};

// x rounded to multiples of 2^-12: x +- 2^-20 is then exact in float (|x| < 16).
void snap(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = float(std::nearbyint(double(x[i]) * 4096.0) / 4096.0);
}

// The smallest relative gap, over every batch element, kv group and position that leaves a
// block out, between the last block its top-n takes by score and the first it leaves: the
// float64 block scores of nsa's definition (pooled keys, compression softmax of every head of
// the group, overlaps in stride units).
double min_selection_gap(const Setting& c, const Problem& p, const Inputs& in) {
  const int64_t d = p.dim, gs = p.kv_group(), nc = p.n >= c.l ? (p.n - c.l) / c.s + 1 : 0;
  const double scale = 1.0 / std::sqrt(double(d));
  double gap = 1.0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t g = 0; g < p.kv_head_count(); ++g) {
      std::vector<double> kc(size_t(nc * d), 0.0);
      for (int64_t i = 0; i < nc; ++i)
        for (int64_t j = i * c.s; j < i * c.s + c.l; ++j)
          for (int64_t e = 0; e < d; ++e)
            kc[size_t(i * d + e)] += test::at(in.k, b, g * gs, j, e) / double(c.l);
      for (int64_t t = 0; t < p.n; ++t) {
        const int64_t cur = t / c.ls;
        if (cur + 1 <= c.top || cur - 2 <= c.top - 3) continue;  // nothing left out
        std::vector<double> score(size_t(cur + 1), 0.0);
        for (int64_t h = g * gs; h < (g + 1) * gs; ++h) {
          std::vector<double> z;
          for (int64_t i = 0; i < nc && i * c.s + c.l - 1 <= t; ++i) {
            double dot = 0;
            for (int64_t e = 0; e < d; ++e)
              dot += test::at(in.q, b, h, t, e) * kc[size_t(i * d + e)];
            z.push_back(dot * scale);
          }
          const double mx = *std::max_element(z.begin(), z.end());
          double sum = 0;
          for (double& x : z) sum += (x = std::exp(x - mx));
          for (size_t i = 0; i < z.size(); ++i)
            for (int64_t j = 0; j <= cur; ++j) {
              const int64_t a0 = int64_t(i) * c.s, a1 = a0 + c.l;
              const int64_t ov = std::min(a1, (j + 1) * c.ls) - std::max(a0, j * c.ls);
              if (ov > 0) score[size_t(j)] += z[i] / sum * double(ov) / double(c.s);
            }
        }
        std::vector<double> rest(score.begin() + 1, score.begin() + cur - 1);
        std::sort(rest.begin(), rest.end(), std::greater<>());
        const double taken = rest[size_t(c.top - 4)], left = rest[size_t(c.top - 3)];
        gap = std::min(gap, (taken - left) / taken);
      }
    }
  return gap;
}

// Inputs of p on the 2^-12 grid whose selection has no near tie: a relative gap above 1e-4,
// against score changes of at most about 2 s (|q|_1 + |k~|_1) 2^-20 < 2e-5 from a step (and
// float32 rounding of the kernel's scores, about 1e-6). p's seed, or the next that gives them
// (p.seed is updated).
Inputs untied_inputs(const Setting& c, Problem& p) {
  for (int tries = 0; tries < 40; ++tries, ++p.seed) {
    Inputs in = generate_inputs(p);
    for (Tensor* t : {&in.q, &in.k, &in.v}) snap(t->data(), t->numel());
    if (min_selection_gap(c, p, in) > 1e-4) return in;
  }
  ADD_FAILURE() << "no seed without a near tie in the selection";
  return generate_inputs(p);
}

// Gates in [0.05, 0.95] on the grid, [B, H, n].
ExtraInput gate_input(const Problem& p, uint64_t seed) {
  ExtraInput t;
  t.shape = {p.batch, p.heads, p.n};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> ud(0.05, 0.95);
  for (int64_t i = 0; i < p.batch * p.heads * p.n; ++i) t.data.push_back(float(ud(rng)));
  snap(t.data.data(), int64_t(t.data.size()));
  return t;
}

// The worst error seen per gradient: |<g, u> - central| / |g|_2 along the random directions,
// |g_i - central| / max|g| for the single entries.
std::map<std::string, double>& worst() {
  static std::map<std::string, double> w;
  return w;
}

struct Case {
  const Setting* setting;
  int64_t n, g;
  std::vector<std::string> given;  // the gates given (the others stood in)
};

void check_case(const Case& cs) {
  const Setting& c = *cs.setting;
  Problem p = test::causal_problem(2, 4, cs.g, cs.n, 16, uint64_t(cs.n * 13 + cs.g));
  Inputs in = untied_inputs(c, p);
  SCOPED_TRACE(c.spec + " " + p.str() + " given " + std::to_string(cs.given.size()));
  auto var = make_variant(c.spec);
  ExtraInputs gates;
  for (size_t x = 0; x < cs.given.size(); ++x)
    gates.emplace(cs.given[x], gate_input(p, p.seed * 7 + x));
  auto with = [&](const ExtraInputs& e) {
    Problem q = p;
    if (!e.empty()) q.extra_inputs = std::make_shared<ExtraInputs>(e);
    return q;
  };
  const Problem pg = with(gates);
  std::mt19937_64 rng(p.seed);
  const test::TrainStep step = test::train_step(*var, pg, in, rng);
  const Tensor &dout = step.dout, &dq = step.dq, &dk = step.dk, &dv = step.dv;
  const InputGrads& dinputs = step.dinputs;
  ASSERT_EQ(dinputs.size(), cs.given.size());
  // L along u of one tensor x (q, k, v or a gate): central differences of the oracle
  auto check = [&](const std::string& name, const Tensor& grad, float* x) {
    const int64_t count = grad.numel();
    double norm = 0, top = 0;
    for (int64_t i = 0; i < count; ++i)
      norm += double(grad.data()[i]) * grad.data()[i],
          top = std::max(top, std::abs(double(grad.data()[i])));
    norm = std::sqrt(norm);
    auto central = [&](const std::vector<double>& u) {
      std::vector<float> keep(x, x + count);
      auto loss = [&](double sign) {
        for (int64_t i = 0; i < count; ++i)
          x[i] = float(double(keep[size_t(i)]) + sign * kStep * u[size_t(i)]);
        const Problem moved = with(gates);
        const std::vector<double> o =
            var->info().oracle(*var, moved, in.q.view(), in.k.view(), in.v.view());
        double l = 0;
        for (size_t i = 0; i < o.size(); ++i) l += double(dout.data()[i]) * o[i];
        return l;
      };
      const double diff = (loss(1.0) - loss(-1.0)) / (2.0 * kStep);
      std::copy(keep.begin(), keep.end(), x);
      double dot = 0;
      int64_t nonzero = 0;
      for (int64_t i = 0; i < count; ++i)
        dot += u[size_t(i)] * grad.data()[i], nonzero += u[size_t(i)] != 0;
      double& w = worst()[name];
      w = std::max(w, std::abs(dot - diff) / (nonzero == 1 ? top : norm));
      return diff;
    };
    SCOPED_TRACE(name);
    test::expect_matches_differences(grad, rng, 3, 3, 1e-3, central);
  };
  // the oracle reads q, k, v and the gates through these: perturbed in place, then restored
  check("dq", dq, in.q.data());
  check("dk", dk, in.k.data());
  check("dv", dv, in.v.data());
  for (const std::string& name : cs.given) {
    ASSERT_EQ(dinputs.at(name).size(), gates.at(name).data.size()) << name;
    Tensor dg(Shape4{p.batch, p.heads, p.n, 1});
    std::copy(dinputs.at(name).begin(), dinputs.at(name).end(), dg.data());
    check("d" + name, dg, gates.at(name).data.data());
  }
}

void report_worst() {
  std::string line;
  for (const auto& [name, err] : worst()) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s %.1e", name.c_str(), err);
    line += buf;
  }
  std::printf("nsa backward, worst relative error:%s\n", line.c_str());
  worst().clear();
}

// The seeded gates stand in: their gradient goes into dq.
TEST(NsaBackward, StandInGatesMatchDifferences) {
  check_case({&kA, 37, 2, {}});
  check_case({&kA, 150, 1, {}});
  check_case({&kB, 101, 4, {}});
  report_worst();
}

// All three gates given: their gradients dL/dg_c = dout . o_c, and dq without the gates' share.
TEST(NsaBackward, GivenGatesMatchDifferences) {
  check_case({&kA, 150, 2, {"g_cmp", "g_slc", "g_swa"}});
  check_case({&kB, 150, 2, {"g_cmp", "g_slc", "g_swa"}});
  report_worst();
}

// Some gates given, the others stood in.
TEST(NsaBackward, SomeGatesGivenMatchDifferences) {
  check_case({&kB, 101, 2, {"g_slc"}});
  check_case({&kA, 64, 2, {"g_cmp", "g_swa"}});
  report_worst();
}

bool same(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::equal(a.data(), a.data() + a.numel(), b.data());
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    m = std::max(m, std::abs(double(a.data()[i]) - double(b.data()[i])));
  return m;
}

// A problem large enough for the team (the paper's block shapes at n = 1100, several tasks per
// thread): forward_train's output is the forward's (up to the rounding of the forward's
// vectorised sums, which follow the alignment of its buffers), every gradient entry is written
// and finite, and the backward on one thread or two gives the same bits (each task owns its
// head's gradients).
TEST(NsaBackward, TeamAndForwardTrainAgree) {
  const std::string spec = "nsa:sel_top=6,window=128";
  Problem p = test::causal_problem(2, 4, 2, 1100, 32, 5);
  const Inputs in = generate_inputs(p);
  const Tensor dout = generate_dout(p);
  auto extra = std::make_shared<ExtraInputs>();
  extra->emplace("g_slc", gate_input(p, 3));
  p.extra_inputs = extra;
  auto var = make_variant(spec);
  Tensor out(p.q_shape());
  const auto saved = var->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  EXPECT_LT(max_abs_diff(out, test::run(spec, p, in)), 1e-6);
  struct Grads {
    Tensor dq, dk, dv;
    InputGrads dinputs;
  };
  auto backward = [&](int threads) {
    ThreadTeam team(threads);
    Grads g{Tensor(p.q_shape()), p.kv_tensor(), p.kv_tensor(), {}};
    for (Tensor* t : {&g.dq, &g.dk, &g.dv}) std::fill_n(t->data(), t->numel(), NAN);
    var->run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout.view(), *saved,
                      g.dq.view(), g.dk.view(), g.dv.view(), &g.dinputs);
    return g;
  };
  const Grads one = backward(1), two = backward(2);
  for (const Tensor* t : {&one.dq, &one.dk, &one.dv})
    EXPECT_TRUE(
        std::all_of(t->data(), t->data() + t->numel(), [](float x) { return std::isfinite(x); }));
  EXPECT_TRUE(same(one.dq, two.dq));
  EXPECT_TRUE(same(one.dk, two.dk));
  EXPECT_TRUE(same(one.dv, two.dv));
  ASSERT_EQ(one.dinputs.size(), 1u);
  EXPECT_EQ(one.dinputs.at("g_slc"), two.dinputs.at("g_slc"));
}

// The training pass is declared and estimated; another variant's saved state is refused.
TEST(NsaBackward, DeclaredAndEstimated) {
  auto var = make_variant("nsa");
  ASSERT_NE(var->backward(), nullptr);
  EXPECT_TRUE(var->backward()->gives_input_grads());
  const Problem p = test::causal_problem(1, 8, 8, 4096, 64, 1);
  EXPECT_NO_THROW(var->check_backward(p));
  const Backward& bw = *var->backward();
  EXPECT_GT(bw.backward_flops(p), 2.0 * var->flops(p));
  EXPECT_LT(bw.backward_flops(p), 3.0 * var->flops(p));
  // the branch outputs (3 B H n d floats) dominate the saved state
  EXPECT_GE(bw.saved_estimate(p), 3.0 * 8 * 4096 * 64 * 4);
  EXPECT_GT(bw.backward_memory_estimate(p), 0);
  const Problem small = test::causal_problem(1, 2, 2, 40, 8, 1);
  const Inputs in = generate_inputs(small);
  Tensor out(small.q_shape()), dq(small.q_shape()), dk(small.kv_shape()), dv(small.kv_shape());
  NothingSaved other;
  EXPECT_CONTAINS(test::error_message<UsageError>([&] {
                    var->run_backward(small, in.q.view(), in.k.view(), in.v.view(), out.view(),
                                      out.view(), other, dq.view(), dk.view(), dv.view());
                  }),
                  "not from its forward_train");
}

}  // namespace
}  // namespace attnbench
