// The decode step of the fixed-pattern variants (common/decode/pattern_decode.h): longformer,
// global, strided, sparse_transformer and bigbird, with small windows, strides and blocks so that
// the patterns matter on short sequences. Prefilling t0 tokens and stepping through the rest must
// give the rows of the variant's own causal forward pass, on ragged n, with grouped-query
// attention (G = H, H / 2, 1: the forward on the same grouped views), on one thread and two;
// the cache keeps only the blocks later queries read and shrinks by H / G with grouping.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/decode/pattern_decode.h"
#include "common/io/inputs.h"
#include "decode_util.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::row_view;

/// Steps `state` through positions length() .. p.n - 1, each output into row t of out.
void step_to_end(DecodeState& state, const Problem& p, const Inputs& in, Tensor& out) {
  test::step_to_end(state, p.n, in.q.view(), in.k.view(), in.v.view(), out.view());
}

constexpr double kTol = 1e-5;

// Every variant with small parameters (its pattern matters at n ~ 100) and at its defaults.
const std::vector<std::string>& specs() {
  static const std::vector<std::string> s = {
      "longformer:window=5,global=3,block=8",
      "longformer:window=4,dilation=3,dilated_heads=2,global=0,block=16",
      "longformer",
      "global:global=5,block=8",
      "global:positions=2+7+30+64+131,block=16",
      "global",
      "strided:stride=5,block=8",
      "strided:stride=3,span=20,block=16",
      "strided",
      "sparse_transformer:stride=8,block=8",  // n >= 4 l: band and stride parts merged
      "sparse_transformer:stride=64",         // n < 4 l: the union on the engine
      "sparse_transformer:mode=fixed,stride=16,summary=4,block=8",
      "bigbird:block=8,window_blocks=3,random_blocks=2,global_blocks=2",
      "bigbird:block=16,window_blocks=1,random_blocks=1,global_blocks=1",
      "bigbird:block=4,window_blocks=2,random_blocks=3,global_blocks=0"};
  return s;
}

Problem grouped_problem(int64_t n, int64_t d, int64_t kv_heads, uint64_t seed) {
  Problem p = test::problem(2, 4, n, 0, d, /*causal=*/true, seed);
  p.kv_heads = kv_heads;
  return p;
}

// Every spec, ragged n, G in {4, 2, 1}, t0 in {0, n / 2, 13}: the step outputs equal the
// causal forward's rows on the same (grouped) inputs. On two threads the steps run in
// parallel over the heads (parallel_floats = 0).
TEST(PatternDecode, StepsMatchCausalForward) {
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (int64_t n : {37, 130, 201})
      for (int64_t g : {4, 2, 1}) {
        const int64_t d = n == 130 ? 33 : 16;
        const Problem p = grouped_problem(n, d, g, uint64_t(n + g));
        const Inputs in = generate_inputs(p);  // k and v grouped by p.kv_heads
        for (const std::string& spec : specs()) {
          auto variant = make_variant(spec);
          Tensor forward(p.q_shape());
          variant->run(p, in.q.view(), in.k.view(), in.v.view(), forward.view());
          Decoder* dec = variant->decoder();
          ASSERT_NE(dec, nullptr) << spec;
          variant->check_decode(p);
          for (int64_t t0 : {int64_t(0), n / 2, int64_t(13)}) {
            SCOPED_TRACE(spec + " threads=" + std::to_string(threads) + " n=" + std::to_string(n) +
                         " G=" + std::to_string(g) + " t0=" + std::to_string(t0));
            EXPECT_EQ(dec->prefill_flops(p, t0), 0.0);
            auto state = threads == 1 ? dec->prefill(p, in.k.view(), in.v.view(), t0)
                                      : pattern_decode_prefill(p, variant->make_pattern(p, {}, {}),
                                                               in.k.view(), in.v.view(), t0,
                                                               {.parallel_floats = 0});
            ASSERT_EQ(state->length(), t0);
            Tensor out(p.q_shape());
            step_to_end(*state, p, in, out);
            EXPECT_LE(test::rows_error(p, out, forward.data(), t0), kTol);
          }
        }
      }
  }
}

// longformer with a window of 5 keys on blocks of 8 and no global token: query block qb reads
// key blocks qb - 1 .. qb only, so the cache holds at most 2 blocks (the rows of block
// qb - 1 and those of qb written so far) while a full cache grows with t; the step reads and
// computes the window's min(t, 5) + 1 keys. With 3 global tokens the first block stays too.
TEST(PatternDecode, CacheKeepsOnlyTheBlocksLaterQueriesRead) {
  const int64_t B = 2, H = 4, n = 201, d = 16, bs = 8;
  const Problem p = grouped_problem(n, d, H, 5);
  const Inputs in = generate_inputs(p);        // k and v grouped by p.kv_heads
  const double row = 2.0 * d * sizeof(float);  // one key and one value row
  auto windowed = make_variant("longformer:window=5,global=0,block=8");
  auto with_globals = make_variant("longformer:window=5,global=3,block=8");
  auto ws = windowed->decoder()->prefill(p, in.k.view(), in.v.view(), 0);
  auto gs = with_globals->decoder()->prefill(p, in.k.view(), in.v.view(), 0);
  EXPECT_EQ(ws->state_bytes(), 0.0);
  Tensor out(p.q_shape());
  for (int64_t t = 0; t < n; ++t) {
    SCOPED_TRACE("t=" + std::to_string(t));
    const double keys = double(std::min<int64_t>(t, 5) + 1);
    EXPECT_EQ(ws->step_flops(), B * H * keys * 4.0 * d);
    EXPECT_EQ(ws->step_bytes_read(), B * H * (keys * row + 4.0 * d * sizeof(float)));
    for (DecodeState* s : {ws.get(), gs.get()})
      s->step(row_view(in.q.view(), t), row_view(in.k.view(), t), row_view(in.v.view(), t),
              row_view(out.view(), t));
    const int64_t len = t + 1, qb = std::min(len, n - 1) / bs;
    const int64_t held = len - std::max<int64_t>(0, (qb - 1) * bs);
    EXPECT_EQ(ws->state_bytes(), H * double(held) * row);
    const int64_t first = std::min(len, bs);  // block 0 holds the global tokens
    EXPECT_EQ(gs->state_bytes(), H * double(qb - 1 > 0 ? held + first : held) * row);
    if (len > 2 * bs) {
      EXPECT_LT(ws->state_bytes(), H * double(len) * row);
    }
    if (len > 3 * bs) {  // blocks 0, qb - 1 and qb are all of them before
      EXPECT_LT(gs->state_bytes(), H * double(len) * row);
    }
  }
  // a prefill of 150 tokens keeps blocks 17 and 18 (rows 136 .. 149)
  auto late = windowed->decoder()->prefill(p, in.k.view(), in.v.view(), 150);
  EXPECT_EQ(late->state_bytes(), H * 14.0 * row);
}

// One cache per (batch, key/value head): with the same pattern in every head the state and the
// cached rows a step reads shrink by H / G. Where the heads' patterns differ (bigbird's random
// blocks, longformer's dilated_heads) the shared cache holds the union of its heads' blocks:
// it shrinks by less, never by more.
TEST(PatternDecode, GroupedCacheShrinksByTheGroup) {
  const int64_t n = 201, d = 16, t0 = 150;
  for (const std::string& spec : specs()) {
    SCOPED_TRACE(spec);
    auto variant = make_variant(spec);
    double state[5] = {}, read[5] = {};
    for (int64_t g : {4, 2, 1}) {
      const Problem p = grouped_problem(n, d, g, 9);
      const Inputs in = generate_inputs(p);  // k and v grouped by p.kv_heads
      auto st = variant->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
      state[g] = st->state_bytes(), read[g] = st->step_bytes_read();
      // the rows read besides the cache: per (batch, head) q and out, per (batch, kv head) k, v
      read[g] -= 2.0 * (4.0 * 2 + 2.0 * double(g)) * d * sizeof(float);
    }
    EXPECT_GT(state[4], 0.0);
    const bool heads_differ =
        spec.starts_with("bigbird") || spec.find("dilated_heads") != std::string::npos;
    if (heads_differ) {
      for (int64_t g : {2, 1}) {
        EXPECT_GE(state[g], state[4] * double(g) / 4.0);
        EXPECT_LE(state[g], state[4]);
        EXPECT_GE(read[g], read[4] * double(g) / 4.0);
      }
    } else {
      EXPECT_EQ(state[2], state[4] / 2.0);
      EXPECT_EQ(state[1], state[4] / 4.0);
      EXPECT_EQ(read[2], read[4] / 2.0);
      EXPECT_EQ(read[1], read[4] / 4.0);
    }
  }
}

TEST(PatternDecode, StepOnAFullStateThrows) {
  const Problem p = grouped_problem(21, 8, 2, 3);
  const Inputs in = generate_inputs(p);  // k and v grouped by p.kv_heads
  for (const std::string& spec : specs()) {
    SCOPED_TRACE(spec);
    auto variant = make_variant(spec);
    auto state = variant->decoder()->prefill(p, in.k.view(), in.v.view(), 15);
    Tensor out(p.q_shape());
    step_to_end(*state, p, in, out);
    EXPECT_EQ(state->length(), p.n);
    EXPECT_EQ(state->step_flops(), 0.0);
    EXPECT_EQ(state->step_bytes_read(), 0.0);
    EXPECT_THROW(state->step(row_view(in.q.view(), 0), row_view(in.k.view(), 0),
                             row_view(in.v.view(), 0), row_view(out.view(), 0)),
                 UsageError);
    EXPECT_EQ(state->length(), p.n);
    auto full = variant->decoder()->prefill(p, in.k.view(), in.v.view(), p.n);
    EXPECT_THROW(full->step(row_view(in.q.view(), 0), row_view(in.k.view(), 0),
                            row_view(in.v.view(), 0), row_view(out.view(), 0)),
                 UsageError);
    EXPECT_THROW(variant->decoder()->prefill(p, in.k.view(), in.v.view(), p.n + 1), UsageError);
  }
}

TEST(PatternDecode, CheckDecodeRefusesWhatIsNotCausalSelfAttention) {
  for (const std::string& spec : specs()) {
    SCOPED_TRACE(spec);
    test::expect_decodes_causal_self_attention_only(*make_variant(spec));
  }
}

}  // namespace
}  // namespace attnbench
