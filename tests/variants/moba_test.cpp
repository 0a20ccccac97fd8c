// moba (Mixture of Block Attention): the selection against a brute-force float64 statement of
// the definition (chunk means, gate q . mean, top-k with ties to the lower chunk, the causal
// own chunk forced), the forward against a float64 softmax over that selection, ties, decode
// steps against the causal forward's rows, and the refusals.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/patterns/pattern.h"
#include "decode_util.h"
#include "harness/team.h"
#include "test_util.h"

namespace attnbench {
namespace {

std::string spec(int64_t chunk, int64_t topk, int64_t block = 8) {
  return fmt::format("moba:chunk={},topk={},block={}", chunk, topk, block);
}

/// The chunks query i of head (b, h) selects, from the definition in float64.
std::vector<int64_t> brute_selection(const Problem& p, ConstTensorView q, ConstTensorView k,
                                     int64_t b, int64_t h, int64_t i, int64_t chunk, int64_t topk) {
  const int64_t n = p.n, d = p.dim, nc = (n + chunk - 1) / chunk, own = i / chunk;
  const int64_t cand = p.causal ? own : nc;
  std::vector<double> g(static_cast<size_t>(cand));
  for (int64_t c = 0; c < cand; ++c) {
    const int64_t j0 = c * chunk, j1 = std::min(n, j0 + chunk);
    double s = 0;
    for (int64_t x = 0; x < d; ++x) {
      double mean = 0;
      for (int64_t j = j0; j < j1; ++j) mean += k.row(b, h, j)[x];
      s += double(q.row(b, h, i)[x]) * mean / double(j1 - j0);
    }
    g[size_t(c)] = s;
  }
  std::vector<int64_t> order(static_cast<size_t>(cand));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t c) { return g[size_t(a)] > g[size_t(c)]; });
  const int64_t want = p.causal ? topk - 1 : topk;
  order.resize(size_t(std::min(want, cand)));
  if (p.causal) order.push_back(own);
  std::sort(order.begin(), order.end());
  return order;
}

/// Row i's mask from the brute-force selection, with the causal mask.
std::vector<uint8_t> brute_row(const Problem& p, ConstTensorView q, ConstTensorView k, int64_t b,
                               int64_t h, int64_t i, int64_t chunk, int64_t topk) {
  const std::vector<int64_t> sel = brute_selection(p, q, k, b, h, i, chunk, topk);
  std::vector<uint8_t> row(size_t(p.n), 0);
  for (int64_t c : sel)
    for (int64_t j = c * chunk; j < std::min(p.n, (c + 1) * chunk); ++j)
      row[size_t(j)] = !p.causal || j <= i;
  return row;
}

/// Float64 softmax attention of every row over its brute-force mask.
std::vector<double> brute_forward(const Problem& p, const Inputs& in, int64_t chunk, int64_t topk) {
  const ConstTensorView q = in.q.view(), k = in.k.view(), v = in.v.view();
  const int64_t n = p.n, d = p.dim;
  std::vector<double> out(size_t(p.batch * p.heads * n * d), 0.0);
  std::vector<double> s(static_cast<size_t>(n));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < n; ++i) {
        const std::vector<uint8_t> row = brute_row(p, q, k, b, h, i, chunk, topk);
        double mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          if (!row[size_t(j)]) continue;
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += double(q.row(b, h, i)[x]) * k.row(b, h, j)[x];
          s[size_t(j)] = dot / std::sqrt(double(d));
          mx = std::max(mx, s[size_t(j)]);
        }
        double sum = 0;
        double* o = out.data() + ((b * p.heads + h) * n + i) * d;
        for (int64_t j = 0; j < n; ++j) {
          if (!row[size_t(j)]) continue;
          const double e = std::exp(s[size_t(j)] - mx);
          sum += e;
          for (int64_t x = 0; x < d; ++x) o[x] += e * v.row(b, h, j)[x];
        }
        for (int64_t x = 0; x < d; ++x) o[x] /= sum;
      }
  return out;
}

struct Case {
  int64_t n, chunk, topk, block;
};
// ragged n (not multiples of chunk), chunk < n and chunk >= n, chunk not a multiple of block,
// topk above the chunk count
const std::vector<Case>& cases() {
  static const std::vector<Case> cs = {
      {1, 4, 2, 8},    {7, 3, 2, 4},     {33, 8, 3, 8},   {100, 16, 3, 8},
      {100, 7, 2, 8},  {257, 32, 3, 16}, {257, 10, 4, 8}, {50, 64, 3, 8},
      {64, 64, 1, 16}, {90, 9, 1, 8},    {40, 5, 20, 8},
  };
  return cs;
}

TEST(Moba, PatternMatchesBruteForceSelection) {
  for (const Case& c : cases())
    for (bool causal : {false, true}) {
      Problem p = test::problem(2, 4, c.n, 0, 16, causal, uint64_t(c.n * 3 + c.chunk));
      p.kv_heads = 2;
      const Inputs in = generate_inputs(p);
      const std::string sp = spec(c.chunk, c.topk, c.block);
      SCOPED_TRACE(sp + " " + p.str());
      auto v = make_variant(sp);
      v->check_supported(p);
      auto pat = v->make_pattern(p, in.q.view(), in.k.view());
      ASSERT_NE(pat, nullptr);
      std::vector<uint8_t> row(static_cast<size_t>(p.n));
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t h = 0; h < p.heads; ++h)
          for (int64_t i = 0; i < p.n; ++i) {
            pattern_row(p, *pat, b, h, i, row.data());
            const std::vector<uint8_t> want =
                brute_row(p, in.q.view(), in.k.view(), b, h, i, c.chunk, c.topk);
            ASSERT_EQ(row, want) << "b=" << b << " h=" << h << " i=" << i;
          }
    }
}

TEST(Moba, ForwardMatchesBruteForce) {
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (const Case& c : cases())
      for (bool causal : {false, true}) {
        Problem p = test::problem(1, 4, c.n, 0, 16, causal, uint64_t(c.n + 11));
        p.kv_heads = 1;
        const Inputs in = generate_inputs(p);
        const std::string sp = spec(c.chunk, c.topk, c.block);
        SCOPED_TRACE(sp + " " + p.str() + " threads=" + std::to_string(threads));
        const Tensor out = test::run(sp, p, in);
        EXPECT_LE(test::rel_fro_error(out.data(), brute_forward(p, in, c.chunk, c.topk)), 1e-5);
        // forward_train (the engine over the pattern) gives the same function
        auto v = make_variant(sp);
        Tensor out2(p.q_shape());
        v->run_train(p, in.q.view(), in.k.view(), in.v.view(), out2.view());
        for (int64_t e = 0; e < out.numel(); ++e)
          ASSERT_NEAR(out.data()[e], out2.data()[e], 1e-5) << e;
      }
  }
}

// Equal gates (every key the same vector, n a multiple of chunk so every mean is the same
// float): the lower chunks win.
TEST(Moba, TiesGoToTheLowerChunk) {
  for (bool causal : {false, true}) {
    const Problem p = test::problem(1, 2, 96, 0, 8, causal, 4);
    Inputs in = generate_inputs(p);
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t j = 0; j < p.n; ++j)
        for (int64_t x = 0; x < p.dim; ++x) in.k.view().row(0, h, j)[x] = 0.25f * float(x % 3);
    auto v = make_variant(spec(8, 3));
    auto pat = v->make_pattern(p, in.q.view(), in.k.view());
    std::vector<uint8_t> row(static_cast<size_t>(p.n));
    for (int64_t i = 0; i < p.n; ++i) {
      pattern_row(p, *pat, 0, 1, i, row.data());
      const int64_t own = i / 8;
      for (int64_t j = 0; j < p.n; ++j) {
        const int64_t c = j / 8;
        const bool want = causal ? (c == own || c < std::min<int64_t>(2, own)) && j <= i : c < 3;
        ASSERT_EQ(bool(row[size_t(j)]), want) << "causal=" << causal << " i=" << i << " j=" << j;
      }
    }
  }
}

TEST(Moba, DecodeMatchesCausalForward) {
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (const Case& c : cases()) {
      Problem p = test::problem(2, 4, c.n, 0, 17, true, uint64_t(c.n + 5));
      p.kv_heads = 2;
      const Inputs in = generate_inputs(p);
      const std::string sp = spec(c.chunk, c.topk, c.block);
      auto var = make_variant(sp);
      var->check_decode(p);
      const Tensor forward = test::run(sp, p, in);
      for (int64_t t0 : {int64_t(0), c.n / 2, c.n - 1}) {
        SCOPED_TRACE(sp + " n=" + std::to_string(c.n) + " t0=" + std::to_string(t0) +
                     " threads=" + std::to_string(threads));
        auto state = var->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
        ASSERT_EQ(state->length(), t0);
        Tensor out(p.q_shape());
        test::step_to_end(*state, c.n, in.q.view(), in.k.view(), in.v.view(), out.view());
        EXPECT_LE(test::rows_error(p, out, forward.data(), t0), 1e-5);
      }
    }
  }
}

TEST(Moba, Refusals) {
  const Inputs in = generate_inputs(test::problem(1, 2, 40, 0, 8, true));
  auto v = make_variant("moba:chunk=8,topk=2");
  // m != n
  const Problem cross = test::problem(1, 2, 40, 60, 8, false);
  EXPECT_THROW(v->check_supported(cross), UnsupportedError);
  const Inputs cin = generate_inputs(cross);
  EXPECT_THROW(v->make_pattern(cross, cin.q.view(), cin.k.view()), UnsupportedError);
  // key padding, the additive score
  Problem padded = test::problem(2, 2, 40, 0, 8, true);
  padded.key_lengths = {40, 20};
  EXPECT_THROW(v->check_supported(padded), UnsupportedError);
  EXPECT_THROW(
      v->check_supported(test::with_score(test::problem(1, 2, 40, 0, 8, true), Score::additive)),
      UnsupportedError);
  // parameters
  EXPECT_THROW(make_variant("moba:topk=0"), SpecError);
  EXPECT_THROW(make_variant("moba:chunk=0"), SpecError);
  // the pattern depends on q and k
  EXPECT_EQ(v->make_pattern(test::problem(1, 2, 40, 0, 8, true), {}, {}), nullptr);
  // decode: causal self-attention only
  test::expect_decodes_causal_self_attention_only(*v);
}

TEST(Moba, DefaultsAndEstimates) {
  auto v = make_variant("moba");
  EXPECT_EQ(v->params().get_int("chunk"), 512);
  EXPECT_EQ(v->params().get_int("topk"), 3);
  const Problem p = test::problem(1, 8, 16384, 0, 64, true);
  // a query attends at most 3 chunks: the forward is far below flash's causal count
  const double flash = make_variant("flash")->flops(p);
  EXPECT_LT(v->flops(p), flash / 4);
  EXPECT_GT(v->memory_estimate(p), 0);
  EXPECT_GT(v->backward()->backward_flops(p), 0);
}

}  // namespace
}  // namespace attnbench
