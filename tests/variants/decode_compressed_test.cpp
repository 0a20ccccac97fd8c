// The decode step of compressed (mean and conv pooling): a pooled cache plus the group being
// filled. Prefilling t0 tokens (none, half, a count that leaves a partial group, all) and
// stepping through the rest must give every row of compressed's own causal forward pass, for
// ratios 1 .. 8 and ragged n, under grouped-query attention (G = H, H / 2, 1) with k and v in
// grouped storage; the state holds about n / r pooled rows, one per key/value head for mean
// pooling and one per query head for conv.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::row_view;

/// Prefills t0 tokens, steps through the rest; returns out [B, H, n, d] (rows < t0 zero).
Tensor decode(Decoder& dec, const Problem& p, const Inputs& in, int64_t t0) {
  Tensor out(p.q_shape());
  auto state = dec.prefill(p, in.k.view(), in.v.view(), t0);
  EXPECT_EQ(state->length(), t0);
  for (int64_t t = t0; t < p.n; ++t) {
    state->step(row_view(in.q.view(), t), row_view(in.k.view(), t), row_view(in.v.view(), t),
                row_view(out.view(), t));
    EXPECT_EQ(state->length(), t + 1);
  }
  return out;
}

/// The largest relative error ||out_i - ref_i|| / ||ref_i|| over rows t0 .. n - 1 of every
/// (batch, head); a zero reference row needs a zero output row.
double worst_row_error(const Problem& p, const Tensor& out, const Tensor& ref, int64_t t0) {
  double worst = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = t0; i < p.n; ++i) {
        const float* x = out.view().row(b, h, i);
        const float* r = ref.view().row(b, h, i);
        double diff = 0, norm = 0;
        for (int64_t c = 0; c < p.dim; ++c)
          diff += double(x[c] - r[c]) * double(x[c] - r[c]), norm += double(r[c]) * r[c];
        const double e = norm > 0 ? std::sqrt(diff / norm) : (diff > 0 ? INFINITY : 0.0);
        worst = std::max(worst, e);
      }
  return worst;
}

Problem gqa_problem(int64_t n, int64_t d, int64_t kv_heads, uint64_t seed) {
  Problem p = test::problem(2, 4, n, 0, d, /*causal=*/true, seed);
  p.kv_heads = kv_heads;
  return p;
}

std::string spec(const std::string& pool, int64_t r) {
  return "compressed:ratio=" + std::to_string(r) + ",pool=" + pool;
}

// Mean and conv, r in {1, 3, 4, 8}, n in {37, 130}, G in {4, 2, 1}, t0 in {0, n / 2, a count
// that leaves a partial group, n}, on one thread and two: every generated row equals the
// causal forward's on the whole sequence.
TEST(DecodeCompressed, StepsMatchCausalForward) {
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (const std::string pool : {"mean", "conv"})
      for (int64_t r : {1, 3, 4, 8})
        for (int64_t n : {37, 130})
          for (int64_t g : {4, 2, 1}) {
            const Problem p = gqa_problem(n, 16, g, uint64_t(n + r + g));
            const Inputs in = generate_inputs(p);  // k and v grouped by p.kv_heads
            auto variant = make_variant(spec(pool, r));
            variant->check_decode(p);
            Tensor forward(p.q_shape());
            variant->run(p, in.q.view(), in.k.view(), in.v.view(), forward.view());
            const int64_t partial = (n / 2) / r * r + (r > 1 ? 1 : 0);
            for (int64_t t0 : {int64_t(0), n / 2, partial, n}) {
              SCOPED_TRACE(spec(pool, r) + " threads=" + std::to_string(threads) +
                           " n=" + std::to_string(n) + " G=" + std::to_string(g) +
                           " t0=" + std::to_string(t0));
              const Tensor out = decode(*variant->decoder(), p, in, t0);
              EXPECT_LE(worst_row_error(p, out, forward, t0), 1e-5);
            }
          }
  }
}

// A larger head dimension and ratio with many steps, where the step runs on two threads: the
// team's split of the pooling and the attention gives the forward's rows.
TEST(DecodeCompressed, ParallelStepsMatchCausalForward) {
  ThreadTeam team(2);
  for (const std::string pool : {"mean", "conv"}) {
    SCOPED_TRACE(pool);
    const Problem p = gqa_problem(700, 64, 2, 5);
    const Inputs in = generate_inputs(p);  // k and v grouped by p.kv_heads
    auto variant = make_variant(spec(pool, 5));
    Tensor forward(p.q_shape());
    variant->run(p, in.q.view(), in.k.view(), in.v.view(), forward.view());
    const Tensor out = decode(*variant->decoder(), p, in, 333);
    EXPECT_LE(worst_row_error(p, out, forward, 333), 1e-5);
  }
}

// state_bytes: the pooled rows so far (ceil or floor of t / r) and the pending group's buffer,
// not t rows; mean pooling keeps one cache per key/value head (H / G times smaller), conv one
// per query head. step_flops and step_bytes_read count the pooled rows the next step sees.
TEST(DecodeCompressed, StateHoldsPooledRows) {
  const int64_t B = 2, H = 4, n = 130, d = 16, r = 4;
  const double f = sizeof(float);
  for (const std::string pool : {"mean", "conv"}) {
    const bool conv = pool == "conv";
    std::vector<double> final_bytes;
    for (int64_t g : {4, 2, 1}) {
      SCOPED_TRACE(pool + " G=" + std::to_string(g));
      const Problem p = gqa_problem(n, d, g, 3);
      const Inputs in = generate_inputs(p);  // k and v grouped by p.kv_heads
      auto variant = make_variant(spec(pool, r));
      const int64_t cache_heads = conv ? H : g, pending = g * (conv ? r : 1) * 2 * d;
      auto state = variant->decoder()->prefill(p, in.k.view(), in.v.view(), 0);
      EXPECT_EQ(state->state_bytes(), double(pending) * f);
      Tensor out(p.q_shape());
      for (int64_t t = 0; t < n; ++t) {
        SCOPED_TRACE("t=" + std::to_string(t));
        const int64_t seen = t + 1 == n ? (n + r - 1) / r : (t + 1) / r;  // rows query t sees
        EXPECT_GE(state->step_flops(), double(B * H * seen) * 4.0 * d);
        EXPECT_GE(state->step_bytes_read(), double(B * cache_heads * seen * 2 * d) * f);
        state->step(row_view(in.q.view(), t), row_view(in.k.view(), t), row_view(in.v.view(), t),
                    row_view(out.view(), t));
        EXPECT_EQ(state->state_bytes(), double(cache_heads * seen * 2 * d + pending) * f);
      }
      // about n / r rows: far below a KV cache of n rows per query head
      EXPECT_LT(state->state_bytes(), 2.0 * H * n * 2 * d * f / r);
      EXPECT_EQ(state->step_flops(), 0.0);
      EXPECT_EQ(state->step_bytes_read(), 0.0);
      final_bytes.push_back(state->state_bytes());
      // a prefill of every token holds the same rows
      auto whole = variant->decoder()->prefill(p, in.k.view(), in.v.view(), n);
      EXPECT_EQ(whole->state_bytes(), state->state_bytes());
    }
    if (!conv) {  // G = 4, 2, 1: the state halves each time
      EXPECT_EQ(final_bytes[0], 2.0 * final_bytes[1]);
      EXPECT_EQ(final_bytes[1], 2.0 * final_bytes[2]);
    } else {  // only the pending raw rows shrink
      EXPECT_LT(final_bytes[1], final_bytes[0]);
      EXPECT_GT(final_bytes[2], 0.75 * final_bytes[0]);
    }
  }
}

TEST(DecodeCompressed, PrefillFlopsCountThePooling) {
  const Problem p = gqa_problem(130, 16, 2, 1);
  auto mean = make_variant(spec("mean", 4));
  auto conv = make_variant(spec("conv", 4));
  EXPECT_EQ(mean->decoder()->prefill_flops(p, 0), 0.0);
  EXPECT_EQ(mean->decoder()->prefill_flops(p, 65), 2.0 * 2 * 2 * 65 * 16);
  // conv pools the 64 keys of complete groups (1 is pending), all 130 at t0 = n
  EXPECT_EQ(conv->decoder()->prefill_flops(p, 65), 2.0 * 4 * 4 * 64 * 16 * 16);
  EXPECT_EQ(conv->decoder()->prefill_flops(p, 130), 2.0 * 4 * 4 * 130 * 16 * 16);
}

TEST(DecodeCompressed, StepOnAFullStateThrows) {
  const Problem p = gqa_problem(9, 8, 2, 2);
  const Inputs in = generate_inputs(p);  // k and v grouped by p.kv_heads
  for (const std::string pool : {"mean", "conv"}) {
    SCOPED_TRACE(pool);
    auto variant = make_variant(spec(pool, 4));
    Tensor out(p.q_shape());
    for (int64_t t0 : {int64_t(5), int64_t(9)}) {
      auto state = variant->decoder()->prefill(p, in.k.view(), in.v.view(), t0);
      for (int64_t t = t0; t < p.n; ++t)
        state->step(row_view(in.q.view(), t), row_view(in.k.view(), t), row_view(in.v.view(), t),
                    row_view(out.view(), t));
      EXPECT_THROW(state->step(row_view(in.q.view(), 0), row_view(in.k.view(), 0),
                               row_view(in.v.view(), 0), row_view(out.view(), 0)),
                   UsageError);
      EXPECT_EQ(state->length(), 9);
    }
    EXPECT_THROW(variant->decoder()->prefill(p, in.k.view(), in.v.view(), 10), UsageError);
  }
}

TEST(DecodeCompressed, CheckDecodeRefusesWhatIsNotCausalSelfAttention) {
  auto variant = make_variant("compressed");
  ASSERT_NE(variant->decoder(), nullptr);
  EXPECT_NO_THROW(variant->check_decode(test::problem(1, 2, 64, 0, 16, /*causal=*/true)));
  EXPECT_THROW(variant->check_decode(test::problem(1, 2, 64, 0, 16, /*causal=*/false)),
               UnsupportedError);
  EXPECT_THROW(variant->check_decode(test::problem(1, 2, 64, 80, 16, /*causal=*/true)),
               UnsupportedError);
  Problem padded = test::problem(2, 2, 64, 0, 16, /*causal=*/true);
  padded.key_lengths = {64, 30};
  EXPECT_THROW(variant->check_decode(padded), UnsupportedError);
}

}  // namespace
}  // namespace attnbench
