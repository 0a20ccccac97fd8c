// The backward of kernel ("linear") attention (common/engines/feature_map_attention.h,
// attend_backward) and of efficient attention: linear, performer, rfa and efficient differentiate
// their own function, checked against float64 central finite differences of each variant's
// registered oracle (same random draws) on small ragged problems, causal, key padding and m != n.
//
// Inputs are multiples of 2^-12 and perturbed by h = 2^-9 along random +-1 directions u, so
// x +- h u is exact in float. (L(x + h u) - L(x - h u)) / 2h, L = sum(dO o oracle), is
// compared with <grad, u>. Tolerance 1e-3 of ||grad||_2 (the size of <grad, u> for random
// signs): the central difference is off by h^2/6 L''' (about 1e-6 relative for these smooth
// functions of O(1) inputs), the float32 gradient by roundings of about 1e-6 relative per
// entry, and a wrong or missing term moves <grad, u> by a sizeable fraction of ||grad||_2.
// Single entries are compared within 1e-3 of max |grad|.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "test_util.h"
#include "variants/clustered.h"

namespace attnbench {
namespace {

constexpr double kStep = 0x1p-9;  // h
// Kinks take smaller steps (x +- 2^-k stays exact in float while |x| < 2^(24 - k)): the
// Performer's relu kernel is piecewise linear, and a feature W x~ crossing 0 inside the step
// moves the difference by O(h) (about 5% at h = 2^-9 with F = 16), so it takes 2^-13; RFA's
// floor max(den, floor) bends rows whose den is near the floor (the difference there converges
// to the gradient only below h = 2^-17 in a D = 1 case), so rfa takes 2^-20 (exact for
// |x| < 2^4).
constexpr double kReluStep = 0x1p-13;
constexpr double kRfaStep = 0x1p-20;
constexpr double kTol = 1e-3;

/// x rounded to multiples of 2^-12.
void round_grid(Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data()[i] = float(std::nearbyint(double(t.data()[i]) * 4096.0) / 4096.0);
}

Tensor random_tensor(Shape4 s, uint64_t seed) {
  Tensor t(s);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = float(nd(rng));
  return t;
}

struct Case {
  std::string spec;
  Problem p;
};

struct Checker {
  Case c;
  std::unique_ptr<Variant> var;
  Tensor q, k, v, dout, out, dq, dk, dv;

  double step;

  explicit Checker(Case cs)
      : c(std::move(cs)),
        var(make_variant(c.spec)),
        step(c.spec.find("relu") != std::string::npos ? kReluStep
             : c.spec.rfind("rfa", 0) == 0            ? kRfaStep
                                                      : kStep) {
    const Problem& p = c.p;
    Inputs in = generate_inputs(p);
    q = std::move(in.q), k = std::move(in.k), v = std::move(in.v);
    for (Tensor* t : {&q, &k, &v}) round_grid(*t);
    dout = random_tensor(p.q_shape(), p.seed + 99);
    out = Tensor(p.q_shape());
    dq = Tensor(p.q_shape()), dk = Tensor(p.kv_shape()), dv = Tensor(p.kv_shape());
    const auto saved = var->run_train(p, q.view(), k.view(), v.view(), out.view());
    var->run_backward(p, q.view(), k.view(), v.view(), out.view(), dout.view(), *saved, dq.view(),
                      dk.view(), dv.view());
  }

  // The function whose finite differences the gradient is checked against (the registered
  // oracle unless a test sets another, e.g. one with the discrete choices frozen).
  std::function<std::vector<double>(const Tensor&, const Tensor&, const Tensor&)> oracle;

  double loss(const Tensor& qx, const Tensor& kx, const Tensor& vx) const {
    const std::vector<double> o =
        oracle ? oracle(qx, kx, vx)
               : var->info().oracle(*var, c.p, qx.view(), kx.view(), vx.view());
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += double(dout.data()[i]) * o[i];
    return l;
  }

  // L(x + h u) - L(x - h u) over 2h, tensor `which` (0 q, 1 k, 2 v) moved along u
  double central(int which, const std::vector<double>& u) const {
    auto moved = [&](double sign) {
      const Tensor* src[3] = {&q, &k, &v};
      Tensor t(src[which]->shape());
      for (int64_t i = 0; i < t.numel(); ++i)
        t.data()[i] = float(double(src[which]->data()[i]) + sign * step * u[size_t(i)]);
      return loss(which == 0 ? t : q, which == 1 ? t : k, which == 2 ? t : v);
    };
    return (moved(1.0) - moved(-1.0)) / (2.0 * step);
  }

  void check(int directions = 3, int entries = 2) const {
    const char* names[3] = {"dq", "dk", "dv"};
    const Tensor* grads[3] = {&dq, &dk, &dv};
    std::mt19937_64 rng(c.p.seed * 7 + 5);
    for (int which = 0; which < 3; ++which) {
      SCOPED_TRACE(names[which]);
      test::expect_matches_differences(
          *grads[which], rng, directions, entries, kTol,
          [&](const std::vector<double>& u) { return central(which, u); });
    }
  }
};

Problem problem(int64_t n, int64_t m, bool causal, std::vector<int64_t> lengths = {},
                uint64_t seed = 3) {
  Problem p = test::problem(2, 2, n, m, 8, causal, seed + uint64_t(n * 31 + m));
  p.key_lengths = std::move(lengths);
  return p;
}

/// The small ragged problems: self and cross, causal (rows with no key when m < n), padding
/// (including an element with no valid key).
std::vector<Problem> ragged(bool causal_too) {
  std::vector<Problem> ps = {problem(21, 21, false), problem(19, 23, false),
                             problem(23, 19, false, {19, 4})};
  if (causal_too) {
    ps.push_back(problem(21, 21, true));
    ps.push_back(problem(19, 23, true));
    ps.push_back(problem(23, 19, true));  // rows 0-3 see no key
    ps.push_back(problem(21, 23, true, {23, 0}));
    ps.push_back(problem(23, 23, true, {9, 17}));
  }
  return ps;
}

void check_all(const std::string& spec, bool causal_too) {
  for (const Problem& p : ragged(causal_too)) {
    SCOPED_TRACE(spec + " " + p.str());
    Checker(Case{spec, p}).check();
  }
}

TEST(BackwardKernel, LinearMatchesFiniteDifferences) { check_all("linear", true); }

TEST(BackwardKernel, PerformerMatchesFiniteDifferences) {
  check_all("performer:features=16", true);
  check_all("performer:features=16,orthogonal=false,kernel=relu", true);
}

TEST(BackwardKernel, RfaMatchesFiniteDifferences) {
  check_all("rfa:features=8", true);
  check_all("rfa:features=32,sigma=2", true);
}

TEST(BackwardKernel, RfaFlooredRowsMatchFiniteDifferences) {
  // D = 1: phi(q)^T phi(k) = cos(a_q - a_k), so many denominators fall below the floor, which
  // is then a constant of the row
  for (bool causal : {false, true}) {
    const Problem p = problem(21, 23, causal);
    SCOPED_TRACE(p.str());
    const Checker ch(Case{"rfa:features=1", p});
    EXPECT_NE(ch.var->notes().find("divided by the floor"), std::string::npos) << ch.var->notes();
    ch.check();
  }
}

TEST(BackwardKernel, EfficientMatchesFiniteDifferences) { check_all("efficient", false); }

TEST(BackwardKernel, DefaultsMatchFiniteDifferences) {
  // performer (F = 256, 256-row blocks) and rfa (2 D = 256) with their default parameters
  for (const char* spec : {"performer", "rfa"})
    for (bool causal : {false, true}) {
      const Problem p = problem(19, 23, causal);
      SCOPED_TRACE(std::string(spec) + " " + p.str());
      Checker(Case{spec, p}).check(2, 1);
    }
}

TEST(BackwardKernel, AcrossBlocksAndKeyScales) {
  // several row blocks: performer at F = 512 runs blocks of 128 rows, and under the causal
  // mask each block maps its keys at a larger running shift (pass 2 rescales U between them);
  // linear at F = d = 4 runs blocks of 1024 rows
  struct Big {
    const char* spec;
    int64_t n, m, d;
  };
  for (const Big& c : {Big{"performer:features=512", 200, 190, 8},
                       Big{"performer:features=512", 190, 200, 8}, Big{"linear", 1040, 1030, 4}})
    for (bool causal : {true, false}) {
      Problem p = test::problem(1, 1, c.n, c.m, c.d, causal, 17);
      if (!causal) p.key_lengths = {c.m - 5};
      SCOPED_TRACE(std::string(c.spec) + " " + p.str());
      Checker(Case{c.spec, p}).check(2, 1);
    }
}

TEST(BackwardKernel, PaddedKeysAndEmptyRowsGetZero) {
  for (const char* spec : {"linear", "performer:features=16", "rfa:features=8", "efficient"}) {
    const bool causal = std::string(spec) != "efficient";
    const Problem p = problem(23, 19, causal, {12, 0});
    SCOPED_TRACE(std::string(spec) + " " + p.str());
    const Checker ch(Case{spec, p});
    const int64_t d = p.dim;
    for (int64_t h = 0; h < p.heads; ++h) {
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t j = p.key_lengths[size_t(b)]; j < p.keys(); ++j)
          for (int64_t c = 0; c < d; ++c) {
            EXPECT_EQ(ch.dk.view().row(b, h, j)[c], 0.0f);
            EXPECT_EQ(ch.dv.view().row(b, h, j)[c], 0.0f);
          }
      for (int64_t i = 0; i < p.n; ++i) {
        if (p.visible(1, i) != 0) continue;
        for (int64_t c = 0; c < d; ++c) EXPECT_EQ(ch.dq.view().row(1, h, i)[c], 0.0f);
      }
    }
  }
}

TEST(BackwardKernel, LinformerMatchesFiniteDifferences) {
  check_all("linformer:proj=8", false);
  check_all("linformer:proj=8,share_kv=true", false);
  // more keys than one chunk of generated columns (256), key padding ending in the second
  for (const auto& lengths : {std::vector<int64_t>{}, std::vector<int64_t>{300, 150}}) {
    Problem p = test::problem(2, 1, 20, 300, 4, false, 31);
    p.key_lengths = lengths;
    SCOPED_TRACE(p.str());
    Checker(Case{"linformer:proj=4", p}).check(2, 2);
  }
}

TEST(BackwardKernel, LinformerPreparedProjectionsGiveTheSameGradients) {
  Problem p = test::problem(2, 2, 30, 290, 8, false, 41);
  p.key_lengths = {290, 100};
  const Checker fresh(Case{"linformer:proj=16", p});
  auto v = make_variant("linformer:proj=16");
  ASSERT_TRUE(v->prepare(p));
  Tensor out(p.q_shape()), dq(p.q_shape()), dk(p.kv_shape()), dv(p.kv_shape());
  const auto saved = v->run_train(p, fresh.q.view(), fresh.k.view(), fresh.v.view(), out.view());
  v->run_backward(p, fresh.q.view(), fresh.k.view(), fresh.v.view(), out.view(), fresh.dout.view(),
                  *saved, dq.view(), dk.view(), dv.view());
  EXPECT_NE(v->notes().find("prepare_s"), std::string::npos) << v->notes();
  for (const auto& [a, b] : {std::pair{&dq, &fresh.dq}, {&dk, &fresh.dk}, {&dv, &fresh.dv}})
    EXPECT_EQ(std::memcmp(a->data(), b->data(), size_t(a->numel()) * sizeof(float)), 0);
}

TEST(BackwardKernel, CompressedMatchesFiniteDifferences) {
  // mean and conv pooling, ratios that leave a ragged last group, causal staircases with rows
  // that see no complete group, key padding ending inside a group
  for (const char* spec : {"compressed", "compressed:ratio=2,pool=conv", "compressed:ratio=1"})
    check_all(spec, true);
  // more pooled keys and query rows than one 64-row tile of the engine
  for (bool causal : {false, true}) {
    Problem p = test::problem(1, 2, 150, 203, 4, causal, 37);
    if (!causal) p.key_lengths = {190};
    SCOPED_TRACE(p.str());
    Checker(Case{"compressed:ratio=2", p}).check(2, 2);
    Checker(Case{"compressed:ratio=3,pool=conv", p}).check(2, 2);
  }
}

TEST(BackwardKernel, NystromMatchesFiniteDifferences) {
  // through the landmark means, the three softmaxes and the pinv iteration as it runs; the
  // oracle iterates in double, so the iteration does too (pinv_dtype=float64)
  check_all("nystrom:landmarks=4,pinv_iterations=3,pinv_dtype=float64", false);
  check_all("nystrom:landmarks=7,pinv_dtype=float64", false);
  // more keys than one 512-key chunk, key padding ending in the second, ragged segments
  for (const auto& lengths : {std::vector<int64_t>{}, std::vector<int64_t>{600, 530}}) {
    Problem p = test::problem(2, 1, 30, 600, 4, false, 43);
    p.key_lengths = lengths;
    SCOPED_TRACE(p.str());
    Checker(Case{"nystrom:landmarks=5,pinv_iterations=4,pinv_dtype=float64", p}).check(2, 2);
  }
  // the default float32 iteration: the backward differentiates it at its float iterates, which
  // are the double ones to about cond(A) 6e-8 relative (cond(A) <= 1e3 on these inputs), far
  // inside the 1e-3 of the check
  check_all("nystrom:landmarks=7", false);
}

// clustered: the clusters and top keys are the forward's, held fixed (finite differences of
// oracle_on_choices): a perturbation that moved a query to another cluster, or a key into a
// group's top keys, would change the function itself.
TEST(BackwardKernel, ClusteredMatchesFiniteDifferencesOnFrozenChoices) {
  for (const char* spec : {"clustered:clusters=4,bits=8", "clustered:clusters=3,bits=0,topk=5",
                           "clustered:clusters=5,topk=3", "clustered:clusters=2,topk=40"})
    for (Problem p : ragged(false)) {
      SCOPED_TRACE(std::string(spec) + " " + p.str());
      Checker ch(Case{spec, p});
      const ParamValues& pv = ch.var->params();
      const clustered::Settings s{.clusters = pv.get_int("clusters"),
                                  .iterations = pv.get_int("iterations"),
                                  .bits = int(pv.get_int("bits"))};
      const int64_t topk = pv.get_int("topk");
      const auto frozen = clustered::choices(p, s, topk, ch.q.view(), ch.k.view());
      ch.oracle = [&, topk](const Tensor& qx, const Tensor& kx, const Tensor& vx) {
        return clustered::oracle_on_choices(p, topk, frozen, qx.view(), kx.view(), vx.view());
      };
      ch.check();
    }
}

TEST(BackwardKernel, GatedRfaMatchesFiniteDifferences) {
  // the causal ragged problems (rows with no key, key padding with an empty element, m != n)
  for (const char* spec : {"rfa:gate=true,features=8", "rfa:gate=true,features=32,sigma=2"})
    for (const Problem& p : ragged(true)) {
      if (!p.causal) continue;
      SCOPED_TRACE(std::string(spec) + " " + p.str());
      Checker(Case{spec, p}).check();
    }
}

TEST(BackwardKernel, GatedRfaAcrossChunks) {
  // several checkpoint chunks of 64 keys (the last one partial), self and cross, key padding
  // ending inside a chunk, and rows past the last valid key reading the final state
  struct Shape {
    int64_t n, m;
    std::vector<int64_t> lengths;
  };
  for (const Shape& s : {Shape{150, 150, {}}, Shape{131, 160, {}}, Shape{140, 129, {}},
                         Shape{145, 145, {100, 64}}}) {
    Problem p = test::problem(2, 1, s.n, s.m, 4, true, 23 + uint64_t(s.n));
    p.key_lengths = s.lengths;
    SCOPED_TRACE(p.str());
    Checker(Case{"rfa:gate=true,features=4", p}).check(2, 2);
  }
}

TEST(BackwardKernel, GatedRfaFlooredRowsMatchFiniteDifferences) {
  // one frequency: den = phi(q)^T z is often below the floor, whose weight sum depends on the
  // gates
  const Problem p = problem(21, 23, true);
  const Checker ch(Case{"rfa:gate=true,features=1", p});
  EXPECT_NE(ch.var->notes().find("divided by the floor"), std::string::npos) << ch.var->notes();
  ch.check();
}

TEST(BackwardKernel, GatedRfaBackwardIsCausalOnly) {
  EXPECT_NE(make_variant("rfa:gate=true")->backward(), nullptr);
  const Problem p = problem(8, 8, false);
  EXPECT_THROW(make_variant("rfa:gate=true")->check_backward(p), UnsupportedError);
  EXPECT_NO_THROW(make_variant("rfa:gate=true")->check_backward(problem(8, 8, true)));
}

}  // namespace
}  // namespace attnbench
