// local's attention sinks (local:sinks=S, StreamingLLM): the pattern equals the dense mask of
// its definition { j : |a(i) - j| <= window } u { j : j < S } (with the causal mask j <= a(i)),
// the forward equals the masked reference, and decode steps equal the causal forward's rows.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "common/core/registry.h"
#include "common/decode/kv_decode.h"
#include "common/io/inputs.h"
#include "common/patterns/pattern.h"
#include "common/reference/reference.h"
#include "decode_util.h"
#include "test_util.h"

namespace attnbench {
namespace {

std::string spec(int64_t window, int64_t sinks, int64_t block) {
  return "local:window=" + std::to_string(window) + ",sinks=" + std::to_string(sinks) +
         ",block=" + std::to_string(block);
}

// Every row of the exported pattern (pattern_row: key_blocks, their full flags and block_mask,
// then the causal mask) against the definition, self and cross, causal or not, sinks inside,
// across and past the band and longer than the keys.
TEST(LocalSinks, PatternEqualsDefinition) {
  struct Case {
    int64_t n, m, window, sinks, block;
  };
  const std::vector<Case> cases = {{1, 0, 0, 1, 4},     {7, 0, 1, 2, 4},     {33, 0, 2, 4, 8},
                                   {100, 0, 5, 4, 8},   {100, 0, 0, 13, 4},  {257, 0, 17, 4, 16},
                                   {257, 0, 3, 70, 8},  {40, 60, 3, 9, 8},   {60, 40, 4, 5, 8},
                                   {50, 0, 10, 500, 8}, {64, 0, 0, 0, 8},    {90, 0, 200, 3, 16},
                                   {100, 0, 2, 64, 8},  {100, 0, 2, 63, 64}, {129, 0, 7, 65, 64}};
  for (const Case& c : cases)
    for (bool causal : {false, true}) {
      const Problem p = test::problem(1, 1, c.n, c.m, 8, causal);
      const std::string sp = spec(c.window, c.sinks, c.block);
      SCOPED_TRACE(sp + " " + p.str());
      auto v = make_variant(sp);
      v->check_supported(p);
      auto pat = v->make_pattern(p, {}, {});
      const int64_t m = p.keys();
      std::vector<uint8_t> row(static_cast<size_t>(m));
      for (int64_t i = 0; i < p.n; ++i) {
        pattern_row(p, *pat, 0, 0, i, row.data());
        const int64_t a = i + m - p.n;
        for (int64_t j = 0; j < m; ++j) {
          const bool want = (std::llabs(a - j) <= c.window || j < c.sinks) && (!causal || j <= a);
          ASSERT_EQ(bool(row[size_t(j)]), want) << "i=" << i << " j=" << j;
        }
      }
    }
}

// The spec leaves sinks out at its default (local's earlier specs keep their names) and
// states it otherwise.
TEST(LocalSinks, SpecOmitsSinksAtZero) {
  EXPECT_EQ(make_variant("local:sinks=0")->spec(), "local:window=256,block=64");
  EXPECT_EQ(make_variant("local:sinks=4")->spec(), "local:window=256,sinks=4,block=64");
  EXPECT_EQ(make_variant("local:window=256,sinks=4,block=64")->spec(),
            "local:window=256,sinks=4,block=64");
}

// sinks = 0 is the plain window: the same output bit for bit.
TEST(LocalSinks, NoSinksIsThePlainWindow) {
  const Problem p = test::problem(1, 2, 100, 0, 16, true, 5);
  const Inputs in = generate_inputs(p);
  const Tensor a = test::run("local:window=9,block=8", p, in);
  const Tensor b = test::run("local:window=9,sinks=0,block=8", p, in);
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.data()[i], b.data()[i]);
}

// The forward against the float64 reference restricted to the pattern, ragged n, G < H.
TEST(LocalSinks, ForwardMatchesReference) {
  for (int64_t n : {1, 7, 33, 100, 257})
    for (bool causal : {false, true}) {
      Problem p = test::problem(2, 4, n, 0, 16, causal, uint64_t(n));
      p.kv_heads = 2;
      const Inputs in = generate_inputs(p);
      for (const std::string& sp : {spec(5, 4, 8), spec(16, 40, 16), spec(0, 1, 4)}) {
        SCOPED_TRACE(sp + " " + p.str());
        const test::Expected e = test::expected(sp, p, in);
        EXPECT_LE(test::rel_fro_error(test::run(sp, p, in).data(), e.out), e.tolerance);
      }
    }
}

// Decode: prefill t0 tokens and step to the end; the steps equal the causal forward's rows,
// through the variant's decoder and through small chunks that merge sinks and ring rows.
TEST(LocalSinks, DecodeMatchesCausalForward) {
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (int64_t n : {1, 7, 33, 100, 257}) {
      Problem p = test::problem(2, 4, n, 0, 17, true, uint64_t(n + 1));
      p.kv_heads = 2;
      const Inputs in = generate_inputs(p);
      for (auto [window, sinks] : {std::pair<int64_t, int64_t>{0, 1}, {5, 4}, {3, 20}, {40, 4}}) {
        const std::string sp = spec(window, sinks, 8);
        auto var = make_variant(sp);
        const Tensor forward = test::run(sp, p, in);
        for (int64_t t0 : {int64_t(0), n / 2, n - 1}) {
          SCOPED_TRACE(sp + " n=" + std::to_string(n) + " t0=" + std::to_string(t0) +
                       " threads=" + std::to_string(threads));
          auto state = var->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
          Tensor out(p.q_shape());
          test::step_to_end(*state, n, in.q.view(), in.k.view(), in.v.view(), out.view());
          EXPECT_LE(test::rows_error(p, out, forward.data(), t0), 1e-5);
          auto small = kv_decode_prefill(p, in.k.view(), in.v.view(), t0,
                                         {.window = window,
                                          .sinks = sinks,
                                          .min_chunk = 3,
                                          .max_chunk = 5,
                                          .parallel_floats = 0});
          Tensor out2(p.q_shape());
          test::step_to_end(*small, n, in.q.view(), in.k.view(), in.v.view(), out2.view());
          EXPECT_LE(test::rows_error(p, out2, forward.data(), t0), 1e-5);
        }
      }
    }
  }
}

TEST(LocalSinks, DecodeStateCountsTheSinkRows) {
  const Problem p = test::problem(1, 2, 64, 0, 8, true);
  const Inputs in = generate_inputs(p);
  auto plain = make_variant("local:window=4")->decoder()->prefill(p, in.k.view(), in.v.view(), 30);
  auto sinks =
      make_variant("local:window=4,sinks=4")->decoder()->prefill(p, in.k.view(), in.v.view(), 30);
  // 4 sink rows of keys and values per head; the next step reads them too
  EXPECT_EQ(sinks->state_bytes() - plain->state_bytes(), 2.0 * 4 * 2 * 8 * sizeof(float));
  EXPECT_GT(sinks->step_flops(), plain->step_flops());
  EXPECT_THROW(kv_decode_prefill(p, in.k.view(), in.v.view(), 0, {.window = 4, .sinks = -1}),
               UsageError);
}

}  // namespace
}  // namespace attnbench
