// Tests of the reformer variant (LSH attention): checked against its float64 oracle
// (variants/reformer.h: the variant's definition in double on its own buckets), against full
// attention in its degenerate settings, and for the effect of more hash rounds.
#include "variants/reformer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/patterns/pattern.h"
#include "tests/test_util.h"

namespace attnbench {
namespace {

using test::expect_later_values_never_reach_earlier_rows;

/// Shared-QK logit of query i and key j: q_i . q_j / |q_j| in double.
double shared_logit(const Problem& p, ConstTensorView q, int64_t b, int64_t h, int64_t i,
                    int64_t j) {
  const float* qi = q.row(b, h, i);
  const float* qj = q.row(b, h, j);
  double dot = 0, nn = 0;
  for (int64_t x = 0; x < p.dim; ++x) {
    dot += double(qi[x]) * double(qj[x]);
    nn += double(qj[x]) * double(qj[x]);
  }
  return nn > 0 ? dot / std::sqrt(nn) : 0.0;
}

/// Softmax of row i over `keys` under the shared-QK rule (itself only if nothing else is
/// visible, at logit -1e5): output row and log-sum-exp.
void shared_row(const Problem& p, ConstTensorView q, ConstTensorView v, int64_t b, int64_t h,
                int64_t i, const std::vector<int64_t>& keys, double* out, double* lse) {
  std::vector<int64_t> use;
  for (int64_t j : keys)
    if (j != i && j < p.visible(i)) use.push_back(j);
  std::fill(out, out + p.dim, 0.0);
  if (use.empty()) {
    for (int64_t x = 0; x < p.dim; ++x) out[x] = v.row(b, h, i)[x];
    *lse = -1e5;
    return;
  }
  std::vector<double> l(use.size());
  double mx = -INFINITY;
  for (size_t t = 0; t < use.size(); ++t)
    mx = std::max(mx, l[t] = shared_logit(p, q, b, h, i, use[t]));
  double sum = 0;
  for (size_t t = 0; t < use.size(); ++t) sum += (l[t] = std::exp(l[t] - mx));
  for (size_t t = 0; t < use.size(); ++t)
    for (int64_t x = 0; x < p.dim; ++x) out[x] += l[t] / sum * v.row(b, h, use[t])[x];
  *lse = mx + std::log(sum);
}

/// Shared-QK full attention (every visible key but itself), [B, H, n, d] in double.
std::vector<double> shared_full(const Problem& p, const Inputs& in) {
  std::vector<double> out(size_t(p.q_shape().numel()));
  std::vector<int64_t> all(static_cast<size_t>(p.n));
  std::iota(all.begin(), all.end(), 0);
  double lse;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.n; ++i)
        shared_row(p, in.q.view(), in.v.view(), b, h, i, all,
                   out.data() + ((b * p.heads + h) * p.n + i) * p.dim, &lse);
  return out;
}

TEST(Reformer, MatchesItsDefinition) {
  struct Case {
    int64_t n, d;
    bool causal;
    std::vector<int64_t> factors;  // empty: automatic
    int64_t hashes, chunk;
  };
  const std::vector<Case> cases = {
      {100, 17, false, {}, 3, 16},  {100, 17, true, {}, 3, 16},  {77, 64, false, {4, 8}, 2, 8},
      {77, 64, true, {4, 8}, 2, 8}, {130, 1, false, {6}, 2, 32}, {33, 5, true, {2}, 1, 64},
      {257, 32, true, {}, 4, 64},
  };
  for (const Case& c : cases) {
    const Problem p = test::problem(2, 3, c.n, 0, c.d, c.causal, 7);
    const Inputs in = generate_inputs(p);
    std::string buckets = "none";
    if (!c.factors.empty()) {
      buckets.clear();
      for (int64_t f : c.factors) {
        if (!buckets.empty()) buckets += '+';
        buckets += std::to_string(f);
      }
    }
    const std::string spec = "reformer:buckets=" + buckets + ",hashes=" + std::to_string(c.hashes) +
                             ",chunk=" + std::to_string(c.chunk);
    SCOPED_TRACE(spec + " " + p.str());
    const auto v = make_variant(spec);
    const Tensor out = test::run(spec, p, in);
    std::vector<std::vector<int64_t>> attended;
    const std::vector<double> want =
        reformer::oracle(p, c.factors, c.hashes, c.chunk, in.q.view(), in.v.view(), &attended);
    EXPECT_LT(test::rel_fro_error(out.data(), want), v->info().tolerance(*v, p, Workload{}));

    // the exported pattern is the set of keys each row attends
    auto pat = make_variant(spec)->make_pattern(p, in.q.view(), in.k.view());
    ASSERT_NE(pat, nullptr);
    std::vector<uint8_t> row(static_cast<size_t>(p.n));
    int64_t wrong = 0;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < p.n; ++i) {
          pattern_row(p, *pat, b, h, i, row.data());
          const auto& keys = attended[size_t((b * p.heads + h) * p.n + i)];
          for (int64_t j = 0; j < p.n; ++j)
            wrong += row[size_t(j)] != uint8_t(std::binary_search(keys.begin(), keys.end(), j));
        }
    EXPECT_EQ(wrong, 0) << "pattern entries that differ from the keys the definition attends";
  }
}

TEST(Reformer, OneBucketOneChunkIsSharedQkFullAttention) {
  for (bool causal : {false, true})
    for (int64_t n : {1, 2, 37, 200})
      for (int64_t d : {1, 17, 64}) {
        const Problem p = test::problem(2, 3, n, 0, d, causal, 7);
        const Inputs in = generate_inputs(p);
        SCOPED_TRACE(p.str());
        const Tensor out = test::run("reformer:buckets=1,hashes=3,chunk=4096", p, in);
        EXPECT_LT(test::rel_fro_error(out.data(), shared_full(p, in)), 1e-5);
      }
}

TEST(Reformer, MoreHashesMoreMassLessError) {
  // clustered tokens: LSH buckets follow the clusters, and each round adds keys
  const Problem p = test::problem(1, 2, 1024, 0, 64, false, 7);
  const Inputs in = generate_inputs(p, test::workload("clustered"));
  const std::vector<double> exact = shared_full(p, in);
  double last_error = INFINITY, last_mass = 0;
  for (int64_t hashes : {1, 2, 4, 8}) {
    const std::string spec = "reformer:chunk=32,hashes=" + std::to_string(hashes);
    SCOPED_TRACE(spec);
    const Tensor out = test::run(spec, p, in);
    const double error = test::rel_fro_error(out.data(), exact);
    // mass: share of each row's exact shared-QK softmax inside the keys it attends
    auto pat = make_variant(spec)->make_pattern(p, in.q.view(), in.k.view());
    std::vector<uint8_t> row(static_cast<size_t>(p.n));
    double mass = 0;
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.n; i += 7) {
        pattern_row(p, *pat, 0, h, i, row.data());
        double mx = -INFINITY, in_sum = 0, all = 0;
        std::vector<double> l(size_t(p.n), -INFINITY);
        for (int64_t j = 0; j < p.n; ++j)
          if (j != i) mx = std::max(mx, l[size_t(j)] = shared_logit(p, in.q.view(), 0, h, i, j));
        for (int64_t j = 0; j < p.n; ++j) {
          const double e = j == i ? 0.0 : std::exp(l[size_t(j)] - mx);
          all += e;
          if (row[size_t(j)]) in_sum += e;
        }
        mass += in_sum / all;
      }
    EXPECT_GT(mass, last_mass);
    EXPECT_LT(error, 0.9 * last_error);
    last_error = error;
    last_mass = mass;
  }
}

TEST(Reformer, CausalValuesOfLaterTokensNeverReachEarlierRows) {
  const Problem p = test::problem(2, 3, 150, 0, 16, true, 7);
  expect_later_values_never_reach_earlier_rows("reformer:chunk=16", p, 90);
  const Inputs in = generate_inputs(p);
  const Tensor before = test::run("reformer:chunk=16", p, in);
  // the first token sees only itself
  EXPECT_EQ(before.view().row(0, 0, 0)[0], in.v.view().row(0, 0, 0)[0]);
}

TEST(Reformer, SeedChoosesTheRotations) {
  Problem p = test::problem(1, 2, 256, 0, 32, false, 7);
  const Inputs in = generate_inputs(p);
  const Tensor a = test::run("reformer:chunk=16", p, in);
  Problem p2 = p;
  p2.seed = p.seed + 1;  // same inputs, other rotations
  const Tensor b = test::run("reformer:chunk=16", p2, in);
  double diff = 0;
  for (int64_t t = 0; t < p.q_shape().numel(); ++t) diff += std::fabs(a.data()[t] - b.data()[t]);
  EXPECT_GT(diff, 0.0);
}

TEST(Reformer, RefusesCrossAttentionAndOddBuckets) {
  Problem p = test::problem(2, 3, 64, 0, 16, false, 7);
  p.m = 80;
  const Inputs in = generate_inputs(p);
  EXPECT_CONTAINS(test::error_message<UnsupportedError>([&] { test::run("reformer", p, in); }),
                  "m != n");
  const Problem q = test::problem(2, 3, 64, 0, 16, false, 7);
  const Inputs qin = generate_inputs(q);
  EXPECT_CONTAINS(test::error_message<SpecError>([&] { test::run("reformer:buckets=3", q, qin); }),
                  "even");
}

TEST(Reformer, PaddedTokensAreQueriesButNoKeys) {
  // batch element 0 has 70 valid tokens of 150 (3 chunks of 32: the last one short), 1 has
  // all; garbage of size 1e4 in the padded queries (which are the keys) and values must not
  // reach a valid row, and the padded values reach no row
  for (bool causal : {false, true}) {
    const std::string spec = "reformer:chunk=32,hashes=3";
    Problem p = test::problem(2, 2, 150, 0, 16, causal, 7);
    p.key_lengths = {70, 150};
    const int64_t L = 70;
    SCOPED_TRACE(p.str());
    Inputs in = generate_inputs(p);
    const auto fill = [&](Tensor& t, int64_t from, float scale, uint64_t salt) {
      const RandomStream rs(salt, 3);
      uint64_t x = 0;
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t j = from; j < p.n; ++j)
          for (int64_t c = 0; c < p.dim; ++c)
            t.view().row(0, h, j)[c] = float(scale * rs.normal(x++));
    };
    fill(in.q, L, 1e4f, 1);
    fill(in.v, L, 1e4f, 2);
    const Tensor a = test::run(spec, p, in);
    Inputs other{test::copy(in.q), test::copy(in.k), test::copy(in.v)};
    fill(other.q, L, 1e4f, 3);
    fill(other.v, L, 1e4f, 4);
    const Tensor b = test::run(spec, p, other);
    Inputs other_v{test::copy(in.q), test::copy(in.k), test::copy(in.v)};  // new padded values
    fill(other_v.v, L, 1e4f, 5);
    const Tensor c = test::run(spec, p, other_v);
    for (int64_t h = 0; h < p.heads; ++h) {
      for (int64_t i = 0; i < L; ++i)
        for (int64_t x = 0; x < p.dim; ++x)
          ASSERT_EQ(a.view().row(0, h, i)[x], b.view().row(0, h, i)[x]) << "row " << i;
      for (int64_t i = 0; i < p.n; ++i)
        for (int64_t x = 0; x < p.dim; ++x)
          ASSERT_EQ(a.view().row(0, h, i)[x], c.view().row(0, h, i)[x]) << "row " << i;
      // a padded row averages valid values only: far below the garbage
      for (int64_t i = L; i < p.n; ++i)
        for (int64_t x = 0; x < p.dim; ++x)
          ASSERT_LT(std::fabs(a.view().row(0, h, i)[x]), 100.0f) << "row " << i;
    }

    // the valid rows are those of the problem of the 70 valid tokens alone
    const Problem s = test::problem(1, 2, L, 0, 16, causal, 7);
    Inputs short_in = generate_inputs(s);
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t j = 0; j < L; ++j) {
        std::copy_n(in.q.view().row(0, h, j), p.dim, short_in.q.view().row(0, h, j));
        std::copy_n(in.v.view().row(0, h, j), p.dim, short_in.v.view().row(0, h, j));
      }
    const Tensor alone = test::run(spec, s, short_in);
    double worst = 0, size = 0;
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t x = 0; x < p.dim; ++x) {
          worst = std::max(
              worst, double(std::fabs(a.view().row(0, h, i)[x] - alone.view().row(0, h, i)[x])));
          size = std::max(size, double(std::fabs(alone.view().row(0, h, i)[x])));
        }
    EXPECT_LE(worst, 1e-6 * size);

    // the padded problem matches its oracle, and its pattern is the keys the oracle attends
    std::vector<std::vector<int64_t>> attended;
    const std::vector<double> want =
        reformer::oracle(p, {}, 3, 32, in.q.view(), in.v.view(), &attended);
    const auto v = make_variant(spec);
    EXPECT_LT(test::rel_fro_error(a.data(), want), v->info().tolerance(*v, p, Workload{}));
    auto pat = v->make_pattern(p, in.q.view(), in.k.view());
    ASSERT_NE(pat, nullptr);
    std::vector<uint8_t> row(static_cast<size_t>(p.n));
    int64_t wrong = 0, padded_keys = 0;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < p.n; ++i) {
          pattern_row(p, *pat, b, h, i, row.data());
          const auto& keys = attended[size_t((b * p.heads + h) * p.n + i)];
          for (int64_t j = 0; j < p.n; ++j) {
            wrong += row[size_t(j)] != uint8_t(std::binary_search(keys.begin(), keys.end(), j));
            padded_keys += b == 0 && j >= L && row[size_t(j)];
          }
        }
    EXPECT_EQ(wrong, 0);
    EXPECT_EQ(padded_keys, 0);
  }
}

TEST(Reformer, MatchesItsRegisteredOracleOnRaggedShapes) {
  test::expect_registered_oracle_holds(
      {"reformer", "reformer:chunk=8,hashes=3", "reformer:buckets=4+6,hashes=2,chunk=16",
       "reformer:buckets=1,hashes=2,chunk=4"},
      false);
}

TEST(Reformer, OracleIsFarFromSharedQkFullAttention) {
  for (bool causal : {false, true}) {
    const Problem p = test::problem(1, 2, 256, 0, 32, causal, 7);
    const Inputs in = generate_inputs(p);
    test::expect_oracle_far_from("reformer:chunk=16", p, in, shared_full(p, in));
  }
}

// ----- the backward pass -----

/// x rounded to multiples of 2^-12 (x +- 2^-9 is then exact in float).
void round_grid(Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data()[i] = float(std::nearbyint(double(t.data()[i]) * 4096.0) / 4096.0);
}

/// The gradients of `spec` on p (inputs on the 2^-12 grid, a random dO) against float64
/// central differences of L = sum(dO o oracle_on_buckets) with the forward's buckets frozen
/// (hash_all on the unperturbed q: a step that moved a token to another bucket would change
/// the function itself). Along `directions` random +-1 directions u, <grad, u> within 1e-3 of
/// ||grad||_2 of (L(x + h u) - L(x - h u)) / 2h, h = 2^-9; `entries` single entries within
/// 1e-3 of max |grad|. The k input is unused: dk must be exactly zero. Unless `zero_dq`, both
/// gradients must be nonzero (a zero one checks nothing). Returns (dq, dv).
std::pair<Tensor, Tensor> expect_backward_matches_differences(const std::string& spec,
                                                              const Problem& p,
                                                              bool zero_dq = false) {
  constexpr int directions = 3, entries = 3;
  constexpr double kStep = 0x1p-9, kTol = 1e-3;
  auto var = make_variant(spec);
  const ParamValues& pv = var->params();
  const std::vector<int64_t> factors = pv.get_int_list("buckets");
  const int64_t hashes = pv.get_int("hashes"), chunk = pv.get_int("chunk");
  Inputs in = generate_inputs(p);
  for (Tensor* t : {&in.q, &in.k, &in.v}) round_grid(*t);
  const Tensor dout = generate_dout(p);
  Tensor out(p.q_shape()), dq(p.q_shape()), dk(p.kv_shape()), dv(p.kv_shape());
  for (Tensor* t : {&dq, &dk, &dv})  // the backward must overwrite them
    for (int64_t e = 0; e < t->numel(); ++e) t->data()[e] = 7.0f;
  const auto saved = var->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  var->run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout.view(), *saved,
                    dq.view(), dk.view(), dv.view());
  // forward_train gives the forward's output
  const Tensor fwd = test::run(spec, p, in);
  EXPECT_EQ(std::memcmp(out.data(), fwd.data(), size_t(out.numel()) * sizeof(float)), 0);
  // shared QK: the keys are the normalised queries, the k input gets no gradient
  int64_t nonzero_dk = 0;
  for (int64_t e = 0; e < dk.numel(); ++e) nonzero_dk += dk.data()[e] != 0.0f;
  EXPECT_EQ(nonzero_dk, 0);

  const std::vector<int32_t> frozen = reformer::hash_all(p, factors, hashes, chunk, in.q.view());
  auto loss = [&](const Tensor& qx, const Tensor& vx) {
    const std::vector<double> o =
        reformer::oracle_on_buckets(p, factors, hashes, chunk, frozen, qx.view(), vx.view());
    double l = 0;
    for (size_t e = 0; e < o.size(); ++e) l += double(dout.data()[e]) * o[e];
    return l;
  };
  auto central = [&](int which, const std::vector<double>& u) {
    const Tensor& src = which == 0 ? in.q : in.v;
    auto moved = [&](double sign) {
      Tensor t(src.shape());
      for (int64_t e = 0; e < t.numel(); ++e)
        t.data()[e] = float(double(src.data()[e]) + sign * kStep * u[size_t(e)]);
      return which == 0 ? loss(t, in.v) : loss(in.q, t);
    };
    return (moved(1.0) - moved(-1.0)) / (2.0 * kStep);
  };
  std::mt19937_64 rng(p.seed * 7 + 5);
  for (int which = 0; which < 2; ++which) {
    SCOPED_TRACE(which == 0 ? "dq" : "dv");
    const double norm = test::expect_matches_differences(
        which == 0 ? dq : dv, rng, directions, entries, kTol,
        [&](const std::vector<double>& u) { return central(which, u); });
    if (which == 1 || !zero_dq) {
      EXPECT_GT(norm, 0.0) << "a zero gradient checks nothing";
    }
  }
  return {std::move(dq), std::move(dv)};
}

// Several chunks and buckets per round (n not a multiple of the chunk: a short last chunk),
// one and three rounds, causal (row 0 sees no key in any round: its own value) and not.
TEST(Reformer, BackwardMatchesFiniteDifferencesOnFrozenBuckets) {
  struct Case {
    int64_t n;
    const char* spec;
  };
  for (const Case& c :
       {Case{37, "reformer:chunk=8,hashes=1"}, Case{37, "reformer:chunk=8,hashes=3"},
        Case{70, "reformer:chunk=16,hashes=3"}, Case{130, "reformer:chunk=16,hashes=3"},
        Case{130, "reformer:buckets=4+4,chunk=8,hashes=2"}})
    for (bool causal : {false, true}) {
      const Problem p = test::problem(2, 2, c.n, 0, 16, causal, 11 + uint64_t(c.n));
      SCOPED_TRACE(std::string(c.spec) + " " + p.str());
      expect_backward_matches_differences(c.spec, p);
    }
}

// One head: fewer heads than threads, so the chunks of a round run in parallel (each thread
// writing only its chunks' key rows) instead of one head per thread.
TEST(Reformer, BackwardWithChunksInParallel) {
  for (bool causal : {false, true})
    for (const auto& lengths : {std::vector<int64_t>{}, std::vector<int64_t>{100}}) {
      Problem p = test::problem(1, 1, 130, 0, 16, causal, 29);
      p.key_lengths = lengths;
      SCOPED_TRACE(p.str());
      expect_backward_matches_differences("reformer:chunk=8,hashes=3", p);
    }
}

// Key padding: padded tokens are queries only (their dv is zero, their dq comes from the
// query role), a batch element without valid tokens has zero gradients.
TEST(Reformer, BackwardMatchesFiniteDifferencesUnderKeyPadding) {
  struct Case {
    int64_t n;
    std::vector<int64_t> lengths;
  };
  for (const Case& c : {Case{70, {45, 70}}, Case{37, {37, 0}}, Case{130, {9, 100}}})
    for (bool causal : {false, true}) {
      Problem p = test::problem(2, 2, c.n, 0, 16, causal, 5 + uint64_t(c.n));
      p.key_lengths = c.lengths;
      SCOPED_TRACE(p.str());
      const auto [dq, dv] = expect_backward_matches_differences("reformer:chunk=16,hashes=3", p);
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t h = 0; h < p.heads; ++h)
          for (int64_t i = 0; i < p.n; ++i)
            for (int64_t x = 0; x < p.dim; ++x) {
              if (i >= p.key_lengths[size_t(b)]) {
                ASSERT_EQ(dv.view().row(b, h, i)[x], 0.0f) << "padded value " << b << "," << i;
              }
              if (p.key_lengths[size_t(b)] == 0) {
                ASSERT_EQ(dq.view().row(b, h, i)[x], 0.0f) << "empty element " << i;
              }
            }
    }
}

// One bucket and one chunk: shared-QK full attention; a single token attends only itself.
TEST(Reformer, BackwardOneBucketOneChunk) {
  for (bool causal : {false, true}) {
    for (int64_t n : {1, 37}) {
      const Problem p = test::problem(2, 2, n, 0, 16, causal, 3 + uint64_t(n));
      SCOPED_TRACE(p.str());
      const auto [dq, dv] =
          expect_backward_matches_differences("reformer:buckets=1,chunk=4096,hashes=2", p, n == 1);
      if (n == 1) {  // its own value at a constant logit: dv = dO, dq = 0
        const Tensor dout = generate_dout(p);
        for (int64_t e = 0; e < dq.numel(); ++e) {
          EXPECT_EQ(dq.data()[e], 0.0f);
          EXPECT_FLOAT_EQ(dv.data()[e], dout.data()[e]);
        }
      }
    }
  }
}

TEST(Reformer, BackwardRefusesAnotherVariantsState) {
  const Problem p = test::problem(1, 2, 32, 0, 8, false, 3);
  const Inputs in = generate_inputs(p);
  const Tensor dout = generate_dout(p);
  auto var = make_variant("reformer:chunk=8");
  ASSERT_NE(var->backward(), nullptr);
  Tensor out(p.q_shape()), dq(p.q_shape()), dk(p.kv_shape()), dv(p.kv_shape());
  auto flash = make_variant("flash");
  const auto other = flash->run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  EXPECT_CONTAINS(test::error_message<UsageError>([&] {
                    var->run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(),
                                      dout.view(), *other, dq.view(), dk.view(), dv.view());
                  }),
                  "not from its forward_train");
}

}  // namespace
}  // namespace attnbench
