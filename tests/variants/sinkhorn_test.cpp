// sinkhorn against a plainly written double-precision version of its own definition: the
// Sinkhorn block matching, and the attention it restricts.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/patterns/pattern.h"
#include "common/reference/reference.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::at;
using test::copy;
using test::perturb_after;
using test::rel_fro_error;
using test::row_diff;
using test::run;
using Matrix = std::vector<std::vector<double>>;

// Softmax attention of every query over the keys allowed(b, h, i, j) says, in double; rows
// with no allowed key are 0. [B, H, n, d] flat.
template <class Allowed>
std::vector<double> attention_where(const Problem& p, const Tensor& q, const Tensor& k,
                                    const Tensor& v, Allowed allowed) {
  const int64_t n = p.n, m = k.shape().len, d = p.dim;
  std::vector<double> out(size_t(p.batch * p.heads * n * d), 0.0);
  std::vector<double> s(static_cast<size_t>(m));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < n; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < m; ++j) {
          s[size_t(j)] = -std::numeric_limits<double>::infinity();
          if (!allowed(b, h, i, j)) continue;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += at(q, b, h, i, c) * at(k, b, h, j, c);
          s[size_t(j)] = dot / std::sqrt(double(d));
          mx = std::max(mx, s[size_t(j)]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0;
        for (int64_t j = 0; j < m; ++j) sum += s[size_t(j)] = std::exp(s[size_t(j)] - mx);
        double* o = out.data() + ((b * p.heads + h) * n + i) * d;
        for (int64_t j = 0; j < m; ++j)
          for (int64_t c = 0; c < d; ++c) o[c] += s[size_t(j)] / sum * at(v, b, h, j, c);
      }
  return out;
}

struct SinkhornSpec {
  int64_t block;
  double temperature;
  int64_t iterations;
  std::string str() const {
    return "sinkhorn:block=" + std::to_string(block) +
           ",temperature=" + std::to_string(temperature) +
           ",iterations=" + std::to_string(iterations);
  }
};

// log(sum exp) of a list with at least one finite entry.
double lse(const std::vector<double>& x) {
  double mx = -std::numeric_limits<double>::infinity();
  for (double e : x) mx = std::max(mx, e);
  double s = 0;
  for (double e : x) s += std::exp(e - mx);
  return mx + std::log(s);
}

// The documented matching of head (b, h), written plainly: pi(i) for every query block. Under
// key padding a key block's mean is over its valid keys, and blocks without one are no
// candidates.
std::vector<int64_t> sinkhorn_oracle(const Problem& p, const Tensor& q, const Tensor& k,
                                     const SinkhornSpec& s, int64_t b, int64_t h) {
  const int64_t n = p.n, d = p.dim, bs = s.block, nb = (n + bs - 1) / bs;
  const int64_t len = p.key_lengths.empty() ? n : p.key_lengths[size_t(b)];
  auto mean_rows = [&](const Tensor& x, int64_t r0, int64_t r1) {
    std::vector<double> mu(size_t(d), 0.0);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < d; ++c) mu[size_t(c)] += at(x, b, h, r, c) / double(r1 - r0);
    return mu;
  };
  Matrix sq, sk;
  for (int64_t i = 0; i < nb; ++i) {
    sk.push_back(mean_rows(k, i * bs, std::min(len, (i + 1) * bs)));
    sq.push_back(p.causal ? mean_rows(q, std::max<int64_t>(0, i * bs - bs + 1), i * bs + 1)
                          : mean_rows(q, i * bs, std::min(n, (i + 1) * bs)));
  }
  // candidates: every block holding a valid key, and under a causal mask a past one (j < i)
  auto cand = [&](int64_t i, int64_t j) { return j * bs < len && (p.causal ? j < i : true); };
  Matrix l(size_t(nb), std::vector<double>(size_t(nb), 0.0));
  for (int64_t i = 0; i < nb; ++i)
    for (int64_t j = 0; j < nb; ++j) {
      if (!cand(i, j)) continue;
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += sq[size_t(i)][size_t(c)] * sk[size_t(j)][size_t(c)];
      const double r = std::max(dot / std::sqrt(double(d)), 0.0);
      l[size_t(i)][size_t(j)] = std::log(r + 1e-6) / s.temperature;
    }
  for (int64_t it = 0; it < s.iterations; ++it) {
    for (int64_t i = 0; i < nb; ++i) {  // rows
      std::vector<double> row;
      for (int64_t j = 0; j < nb; ++j)
        if (cand(i, j)) row.push_back(l[size_t(i)][size_t(j)]);
      if (row.empty()) continue;
      const double z = lse(row);
      for (int64_t j = 0; j < nb; ++j)
        if (cand(i, j)) l[size_t(i)][size_t(j)] -= z;
    }
    const Matrix before = l;  // columns: sums over the rows, or the rows j < i' <= i if causal
    for (int64_t i = 0; i < nb; ++i)
      for (int64_t j = 0; j < nb; ++j) {
        if (!cand(i, j)) continue;
        std::vector<double> col;
        for (int64_t i2 = 0; i2 < nb; ++i2)
          if (cand(i2, j) && (!p.causal || i2 <= i)) col.push_back(before[size_t(i2)][size_t(j)]);
        l[size_t(i)][size_t(j)] = before[size_t(i)][size_t(j)] - lse(col);
      }
  }
  std::vector<int64_t> pi(size_t(nb), 0);
  for (int64_t i = 0; i < nb; ++i) {
    pi[size_t(i)] = i;  // no candidate: its own block alone
    double best = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < nb; ++j)
      if (cand(i, j) && std::exp(l[size_t(i)][size_t(j)]) > best) {
        best = std::exp(l[size_t(i)][size_t(j)]);
        pi[size_t(i)] = j;
      }
  }
  return pi;
}

// The key blocks a pattern lists for query block qb of head (b, h).
std::vector<int64_t> listed(const SparsePattern& pat, int64_t b, int64_t h, int64_t qb) {
  std::vector<KeyBlock> blocks;
  pat.key_blocks(b, h, qb, blocks);
  std::vector<int64_t> out;
  for (const KeyBlock& kb : blocks) {
    EXPECT_FALSE(kb.partial);
    out.push_back(kb.index);
  }
  return out;
}

// What query block i must visit when matched to block j: i and j, sorted, once each.
std::vector<int64_t> expected_blocks(int64_t i, int64_t j) {
  if (i == j) return {i};
  return {std::min(i, j), std::max(i, j)};
}

const SinkhornSpec kSinkhornCases[] = {{16, 0.75, 5}, {7, 0.75, 5}, {32, 0.3, 12},
                                       {64, 0.75, 5}, {5, 2.0, 0},  {1, 0.75, 3}};

TEST(Sinkhorn, MatchingMatchesAPlainImplementation) {
  int64_t moved = 0, total = 0;
  for (const SinkhornSpec& s : kSinkhornCases)
    for (auto [n, d] : {std::pair<int64_t, int64_t>{113, 17}, {300, 64}, {7, 1}, {40, 5}})
      for (bool causal : {false, true}) {
        if (s.block == 1 && n > 113) continue;  // nb^3 oracle steps
        const Problem p = test::problem(2, 2, n, 0, d, causal, uint64_t(n + d + s.block));
        SCOPED_TRACE(s.str() + " " + p.str());
        Inputs in = generate_inputs(p);
        auto pat = make_variant(s.str())->make_pattern(p, in.q.view(), in.k.view());
        ASSERT_NE(pat, nullptr);
        ASSERT_EQ(pat->block(), s.block);
        for (int64_t b = 0; b < p.batch; ++b)
          for (int64_t h = 0; h < p.heads; ++h) {
            const auto pi = sinkhorn_oracle(p, in.q, in.k, s, b, h);
            for (int64_t i = 0; i < int64_t(pi.size()); ++i) {
              const int64_t j = pi[size_t(i)];
              if (causal) {
                EXPECT_TRUE(i == 0 ? j == 0 : j < i) << "block " << i;
              }
              EXPECT_EQ(listed(*pat, b, h, i), expected_blocks(i, j))
                  << "b " << b << " h " << h << " block " << i;
              moved += j != i, ++total;
            }
          }
      }
  // the matching is not the identity: most blocks attend a second block
  EXPECT_GT(moved, total / 2) << moved << " of " << total;
}

TEST(Sinkhorn, PaddedKeyBlocksAreNoCandidates) {
  // key padding: the matching of the valid keys (block means over them, blocks of padding never
  // matched), and attention over the matched blocks' valid keys
  for (const SinkhornSpec& s : {SinkhornSpec{16, 0.75, 5}, SinkhornSpec{7, 0.3, 9}})
    for (auto [n, d] : {std::pair<int64_t, int64_t>{113, 17}, {300, 64}, {40, 5}})
      for (bool causal : {false, true}) {
        Problem p = test::problem(3, 2, n, 0, d, causal, uint64_t(n + d));
        p.key_lengths = {n / 2 + 3, 0, s.block + 1};
        SCOPED_TRACE(s.str() + " " + p.str());
        Inputs in = generate_inputs(p);
        auto pat = make_variant(s.str())->make_pattern(p, in.q.view(), in.k.view());
        std::vector<std::vector<int64_t>> pis;
        for (int64_t b = 0; b < p.batch; ++b)
          for (int64_t h = 0; h < p.heads; ++h) {
            const auto pi = sinkhorn_oracle(p, in.q, in.k, s, b, h);
            const int64_t kb = (p.key_lengths[size_t(b)] + s.block - 1) / s.block;
            for (int64_t i = 0; i < int64_t(pi.size()); ++i) {
              const int64_t j = pi[size_t(i)];
              EXPECT_TRUE(j == i || j < kb) << "b " << b << " block " << i << " matched " << j;
              EXPECT_EQ(listed(*pat, b, h, i), expected_blocks(i, j))
                  << "b " << b << " h " << h << " block " << i;
            }
            pis.push_back(pi);
          }
        const auto ref =
            attention_where(p, in.q, in.k, in.v, [&](int64_t b, int64_t h, int64_t i, int64_t j) {
              const int64_t qb = i / s.block, kb = j / s.block;
              return (kb == qb || kb == pis[size_t(b * 2 + h)][size_t(qb)]) && j < p.visible(b, i);
            });
        EXPECT_LE(rel_fro_error(run(s.str(), p, in).data(), ref),
                  attention_tolerance(p, Workload{}));
      }
}

TEST(Sinkhorn, ExportedPatternIsTheMatching) {
  // `attnbench pattern` on head 1 of the CLI's problem (B = 1, H = 2, gaussian inputs)
  test::TempDir dir;
  for (bool causal : {false, true}) {
    const SinkhornSpec s{16, 0.75, 5};
    const Problem p = test::problem(1, 2, 150, 0, 24, causal, 9);
    const std::string f = dir.file(causal ? "c.npy" : "nc.npy");
    auto r =
        test::run_cli("pattern --variant " + s.str() + " --seq 150 --dim 24 --head 1 --seed 9 " +
                          (causal ? "--causal " : "") + "--output " + f,
                      dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const NpyArray a = read_npy(f);
    ASSERT_EQ(a.shape, (std::vector<int64_t>{150, 150}));
    Inputs in = generate_inputs(p);
    const auto pi = sinkhorn_oracle(p, in.q, in.k, s, 0, 1);
    int64_t wrong = 0;
    for (int64_t i = 0; i < p.n; ++i)
      for (int64_t j = 0; j < p.n; ++j) {
        const int64_t qb = i / s.block, kb = j / s.block;
        const bool want = (kb == qb || kb == pi[size_t(qb)]) && j < p.visible(i);
        wrong += (a.data[size_t(i * p.n + j)] != 0) != want;
      }
    EXPECT_EQ(wrong, 0) << "causal " << causal;
  }
}

TEST(Sinkhorn, OutputIsAttentionOverTheMatchedBlocks) {
  for (const SinkhornSpec& s : {SinkhornSpec{16, 0.75, 5}, SinkhornSpec{7, 0.5, 3}})
    for (auto [n, d] : {std::pair<int64_t, int64_t>{113, 17}, {200, 64}, {1, 1}})
      for (bool causal : {false, true}) {
        const Problem p = test::problem(2, 2, n, 0, d, causal, 4);
        SCOPED_TRACE(s.str() + " " + p.str());
        Inputs in = generate_inputs(p);
        std::vector<std::vector<int64_t>> pis;
        for (int64_t bh = 0; bh < 4; ++bh)
          pis.push_back(sinkhorn_oracle(p, in.q, in.k, s, bh / 2, bh % 2));
        const auto ref =
            attention_where(p, in.q, in.k, in.v, [&](int64_t b, int64_t h, int64_t i, int64_t j) {
              const int64_t qb = i / s.block, kb = j / s.block;
              return (kb == qb || kb == pis[size_t(b * 2 + h)][size_t(qb)]) && j < p.visible(i);
            });
        EXPECT_LE(rel_fro_error(run(s.str(), p, in).data(), ref),
                  attention_tolerance(p, Workload{}));
      }
}

TEST(Sinkhorn, OneBlockIsFullAttention) {
  for (int64_t n : {1, 7, 113, 1000})
    for (bool causal : {false, true}) {
      test::expect_full_attention("sinkhorn:block=1000", test::problem(1, 2, n, 0, 17, causal, 3));
    }
}

TEST(Sinkhorn, DeterministicAcrossRunsAndThreadCounts) {
  for (bool causal : {false, true}) {
    const Problem p = test::problem(2, 3, 500, 0, 32, causal, 8);
    Inputs in = generate_inputs(p);
    Tensor one, two;
    {
      test::ScopedThreads t(1);
      one = run("sinkhorn:block=16", p, in);
    }
    {
      test::ScopedThreads t(2);
      two = run("sinkhorn:block=16", p, in);
    }
    Tensor again = run("sinkhorn:block=16", p, generate_inputs(p));
    const size_t bytes = size_t(one.numel()) * sizeof(float);
    EXPECT_EQ(std::memcmp(one.data(), two.data(), bytes), 0);
    EXPECT_EQ(std::memcmp(one.data(), again.data(), bytes), 0);
  }
}

TEST(Sinkhorn, CausalLeaksNothing) {
  for (const char* spec : {"sinkhorn:block=16", "sinkhorn:block=7,iterations=9"})
    for (int64_t n : {113, 300}) {
      bool changed_without_causal = false;
      for (bool causal : {true, false}) {
        const Problem p = test::problem(1, 2, n, 0, 17, causal, 21);
        SCOPED_TRACE(std::string(spec) + " " + p.str());
        Inputs in = generate_inputs(p);
        const Tensor base = run(spec, p, in);
        for (int64_t i : {int64_t(0), int64_t(5), int64_t(16), int64_t(40), int64_t(77), n - 2}) {
          Inputs changed{copy(in.q), copy(in.k), copy(in.v)};
          perturb_after(p, i, changed.k, changed.v);
          const Tensor out = run(spec, p, changed);
          // rows up to i see nothing that changed
          double diff = 0;
          for (int64_t r = 0; r <= i; ++r) diff = std::max(diff, row_diff(p, out, base, r));
          if (causal)
            EXPECT_EQ(diff, 0.0) << "rows <= " << i << " see keys after " << i;
          else
            changed_without_causal |= diff > 1e-3;
        }
      }
      EXPECT_TRUE(changed_without_causal) << spec << " n " << n;
    }
}

TEST(Sinkhorn, CrossAttentionIsUnsupported) {
  auto v = make_variant("sinkhorn");
  EXPECT_TRUE(v->info().caps.causal);
  EXPECT_FALSE(v->info().caps.cross);
  EXPECT_TRUE(v->info().caps.exact);
  const Problem p = test::problem(1, 2, 64, 96, 16, false, 1);
  Inputs in = generate_inputs(p);
  Tensor out(p.q_shape());
  EXPECT_CONTAINS(test::error_message<UnsupportedError>(
                      [&] { v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()); }),
                  "m != n");
  EXPECT_THROW(v->make_pattern(p, in.q.view(), in.k.view()), UnsupportedError);
}

TEST(Sinkhorn, ZeroSimilarityIsFinite) {
  // all-zero queries: R = 0 everywhere, every logit is log(1e-6) / temperature; the matching
  // is still defined (ties go to the lowest block) and the output finite
  for (bool causal : {false, true}) {
    const Problem p = test::problem(1, 1, 100, 0, 8, causal, 2);
    Inputs in = generate_inputs(p);
    std::fill(in.q.data(), in.q.data() + in.q.numel(), 0.0f);
    const SinkhornSpec s{10, 0.75, 5};
    auto pat = make_variant(s.str())->make_pattern(p, in.q.view(), in.k.view());
    const auto pi = sinkhorn_oracle(p, in.q, in.k, s, 0, 0);
    for (int64_t i = 0; i < 10; ++i) {
      EXPECT_EQ(listed(*pat, 0, 0, i), expected_blocks(i, pi[size_t(i)]));
    }
    const Tensor out = run(s.str(), p, in);
    EXPECT_TRUE(std::all_of(out.data(), out.data() + out.numel(),
                            [](float x) { return std::isfinite(x); }));
  }
}

TEST(Sinkhorn, EstimatesBoundTheWork) {
  // the estimates are upper bounds: at least the scores of the pattern actually used
  for (bool causal : {false, true}) {
    const Problem p = test::problem(1, 2, 1000, 0, 64, causal, 5);
    Inputs in = generate_inputs(p);
    auto v = make_variant("sinkhorn");
    auto pat = v->make_pattern(p, in.q.view(), in.k.view());
    const double used = 4.0 * 64 * (pattern_scores(p, *pat, 0, 0) + pattern_scores(p, *pat, 0, 1));
    EXPECT_GE(v->flops(p), used);
    EXPECT_LE(v->flops(p), 3 * used);
    EXPECT_GT(v->memory_estimate(p), pat->bytes());
  }
}

}  // namespace
}  // namespace attnbench
