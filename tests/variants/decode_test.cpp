// The decode step (common/core/decode.h) of the exact variants: full and flash keep a KV cache of
// every position, local a ring of its window (common/decode/kv_decode.h). Prefilling t0 tokens and
// stepping through the rest must give the rows of the variant's own causal forward pass (and,
// for full, of the float64 reference), on ragged shapes, with one and two threads; the chunk
// split and its log-sum-exp merge, the ring's wrap, the state's byte and FLOP counts and the
// refusals are tested on their own.
#include "common/core/decode.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/decode/kv_decode.h"
#include "common/io/inputs.h"
#include "common/reference/reference.h"
#include "decode_util.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::row_view;
using test::rows_error;

/// Steps `state` through positions length() .. p.n - 1 with rows of in.q, in.k and in.v,
/// each output into the same row of out [B, H, n, d].
void step_to_end(DecodeState& state, const Problem& p, const Inputs& in, Tensor& out) {
  test::step_to_end(state, p.n, in.q.view(), in.k.view(), in.v.view(), out.view());
}

constexpr double kTol = 1e-5;

const std::vector<std::string>& decode_specs() {
  static const std::vector<std::string> specs = {
      "full", "flash", "local:window=0", "local:window=3", "local:window=17", "local:window=500"};
  return specs;
}

// Every spec, d in {17, 64}, ragged n, t0 in {0, n/2, n}, threads 1 and 2: the step outputs
// equal the causal forward's rows (and full's the float64 reference's).
TEST(Decode, StepsMatchCausalForward) {
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (int64_t d : {17, 64})
      for (int64_t n : {1, 37, 100, 300}) {
        const Problem p = test::problem(2, 3, n, 0, d, /*causal=*/true, /*seed=*/uint64_t(n + d));
        const Inputs in = generate_inputs(p);
        const std::vector<double> exact =
            reference_attention(p, in.q.view(), in.k.view(), in.v.view());
        for (const std::string& spec : decode_specs()) {
          auto variant = make_variant(spec);
          Tensor forward(p.q_shape());
          variant->run(p, in.q.view(), in.k.view(), in.v.view(), forward.view());
          Decoder* dec = variant->decoder();
          ASSERT_NE(dec, nullptr) << spec;
          variant->check_decode(p);
          for (int64_t t0 : {int64_t(0), n / 2, n}) {
            SCOPED_TRACE(spec + " threads=" + std::to_string(threads) + " d=" + std::to_string(d) +
                         " n=" + std::to_string(n) + " t0=" + std::to_string(t0));
            EXPECT_EQ(dec->prefill_flops(p, t0), 0.0);
            auto state = dec->prefill(p, in.k.view(), in.v.view(), t0);
            ASSERT_EQ(state->length(), t0);
            Tensor out(p.q_shape());
            step_to_end(*state, p, in, out);
            if (t0 == n) continue;
            EXPECT_LE(rows_error(p, out, forward.data(), t0), kTol);
            if (spec == "full") {
              EXPECT_LE(rows_error(p, out, exact, t0), kTol);
            }
          }
        }
      }
  }
}

// Chunks of a few keys: many chunks per (batch, head) merged by their log-sum-exps, and chunks
// that cross the ring's wrap, against the causal forward of full and of local.
TEST(Decode, SmallChunksMergeAcrossTheRing) {
  const Problem p = test::problem(2, 3, 90, 0, 33, /*causal=*/true, /*seed=*/7);
  const Inputs in = generate_inputs(p);
  for (int threads : {1, 2}) {
    ThreadTeam team(threads);
    for (int64_t window : {KvDecodeOptions::kNoWindow, int64_t(0), int64_t(6), int64_t(29)})
      for (auto [lo, hi] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {4, 64}}) {
        SCOPED_TRACE("threads=" + std::to_string(threads) + " window=" + std::to_string(window) +
                     " chunks " + std::to_string(lo) + ".." + std::to_string(hi));
        const std::string spec = window < 0 ? "full" : "local:window=" + std::to_string(window);
        const Tensor forward = test::run(spec, p, in);
        for (int64_t t0 : {int64_t(0), int64_t(41)}) {
          auto state = kv_decode_prefill(
              p, in.k.view(), in.v.view(), t0,
              {.window = window, .min_chunk = lo, .max_chunk = hi, .parallel_floats = 0});
          Tensor out(p.q_shape());
          step_to_end(*state, p, in, out);
          EXPECT_LE(rows_error(p, out, forward.data(), t0), kTol) << "t0=" << t0;
        }
      }
  }
}

// Large logits (q scaled by 30): the chunks' maxima differ by far more than exp's range, so a
// merge that did not rescale each chunk by exp((mx_c - M) / sqrt(d)) would be far off.
TEST(Decode, MergeHoldsAtLargeLogits) {
  const Problem p = test::problem(1, 2, 200, 0, 64, /*causal=*/true, /*seed=*/3);
  const Inputs in = generate_inputs(p, test::workload("gaussian", 30.0));
  const std::vector<double> exact = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
  auto state = kv_decode_prefill(p, in.k.view(), in.v.view(), 10, {.min_chunk = 8, .max_chunk = 8});
  Tensor out(p.q_shape());
  step_to_end(*state, p, in, out);
  EXPECT_LE(rows_error(p, out, exact, 10), 1e-4);
}

TEST(Decode, StepOnAFullStateThrows) {
  const Problem p = test::problem(1, 2, 5, 0, 8, /*causal=*/true);
  const Inputs in = generate_inputs(p);
  for (const std::string& spec : decode_specs()) {
    SCOPED_TRACE(spec);
    auto variant = make_variant(spec);
    auto state = variant->decoder()->prefill(p, in.k.view(), in.v.view(), 3);
    Tensor out(p.q_shape());
    step_to_end(*state, p, in, out);
    EXPECT_EQ(state->length(), 5);
    EXPECT_THROW(state->step(row_view(in.q.view(), 0), row_view(in.k.view(), 0),
                             row_view(in.v.view(), 0), row_view(out.view(), 0)),
                 UsageError);
    EXPECT_EQ(state->length(), 5);
    auto full = variant->decoder()->prefill(p, in.k.view(), in.v.view(), 5);
    EXPECT_THROW(full->step(row_view(in.q.view(), 0), row_view(in.k.view(), 0),
                            row_view(in.v.view(), 0), row_view(out.view(), 0)),
                 UsageError);
  }
}

TEST(Decode, BadShapesAndPrefillLengthsThrow) {
  const Problem p = test::problem(2, 2, 10, 0, 8, /*causal=*/true);
  const Inputs in = generate_inputs(p);
  auto variant = make_variant("flash");
  Decoder* dec = variant->decoder();
  EXPECT_THROW(dec->prefill(p, in.k.view(), in.v.view(), 11), UsageError);
  EXPECT_THROW(dec->prefill(p, in.k.view(), in.v.view(), -1), UsageError);
  auto state = dec->prefill(p, in.k.view(), in.v.view(), 4);
  Tensor out(p.q_shape());
  // a whole [B, H, n, d] tensor is not one row
  EXPECT_THROW(state->step(in.q.view(), row_view(in.k.view(), 4), row_view(in.v.view(), 4),
                           row_view(out.view(), 4)),
               UsageError);
  EXPECT_EQ(state->length(), 4);
}

TEST(Decode, CheckDecodeRefusesWhatIsNotCausalSelfAttention) {
  for (const std::string& spec : decode_specs()) {
    SCOPED_TRACE(spec);
    test::expect_decodes_causal_self_attention_only(*make_variant(spec));
  }
  // a variant without a decode step says so
  auto routing = make_variant("routing");
  EXPECT_EQ(routing->decoder(), nullptr);
  EXPECT_THROW(routing->check_decode(test::problem(1, 2, 64, 0, 16, /*causal=*/true)),
               UnsupportedError);
}

// state_bytes: local's ring stops growing once t > window, full's cache grows by one row of
// keys and values per head each step; step_bytes_read and step_flops count the visible keys
// of the next step.
TEST(Decode, StateAndStepCounts) {
  const int64_t B = 2, H = 3, n = 60, d = 16, w = 17;
  const Problem p = test::problem(B, H, n, 0, d, /*causal=*/true);
  const Inputs in = generate_inputs(p);
  const double row = 2.0 * d * sizeof(float);  // one key and one value row
  auto local = make_variant("local:window=" + std::to_string(w));
  auto full = make_variant("full");
  auto ls = local->decoder()->prefill(p, in.k.view(), in.v.view(), 0);
  auto fs = full->decoder()->prefill(p, in.k.view(), in.v.view(), 0);
  EXPECT_EQ(ls->state_bytes(), 0.0);
  EXPECT_EQ(fs->state_bytes(), 0.0);
  Tensor out(p.q_shape());
  for (int64_t t = 0; t < n; ++t) {
    SCOPED_TRACE("t=" + std::to_string(t));
    const double local_visible = double(std::min(t, w) + 1), full_visible = double(t + 1);
    EXPECT_EQ(ls->step_bytes_read(), B * H * (local_visible * row + 4.0 * d * sizeof(float)));
    EXPECT_EQ(fs->step_bytes_read(), B * H * (full_visible * row + 4.0 * d * sizeof(float)));
    EXPECT_EQ(ls->step_flops(), B * H * local_visible * 4.0 * d);
    EXPECT_EQ(fs->step_flops(), B * H * full_visible * 4.0 * d);
    const double local_before = ls->state_bytes(), full_before = fs->state_bytes();
    for (DecodeState* s : {ls.get(), fs.get()})
      s->step(row_view(in.q.view(), t), row_view(in.k.view(), t), row_view(in.v.view(), t),
              row_view(out.view(), t));
    EXPECT_EQ(fs->state_bytes(), full_before + H * row);
    EXPECT_EQ(fs->state_bytes(), H * double(t + 1) * row);
    if (t > w) {
      EXPECT_EQ(ls->state_bytes(), local_before);
    } else {
      EXPECT_EQ(ls->state_bytes(), local_before + H * row);
    }
    EXPECT_EQ(ls->state_bytes(), H * double(std::min(t + 1, w + 1)) * row);
  }
  // a prefill of more tokens than the window holds keeps only the ring
  auto lp = local->decoder()->prefill(p, in.k.view(), in.v.view(), 40);
  EXPECT_EQ(lp->state_bytes(), H * double(w + 1) * row);
  auto fp = full->decoder()->prefill(p, in.k.view(), in.v.view(), 40);
  EXPECT_EQ(fp->state_bytes(), H * 40.0 * row);
}

// The prefill reads k and v through their strides: a [B, H, n, d] view into a bigger tensor
// (heads and rows apart by more than their extent) decodes as the packed tensor does.
TEST(Decode, PrefillAndStepThroughStridedViews) {
  const Problem p = test::problem(2, 3, 50, 0, 20, /*causal=*/true, /*seed=*/11);
  const Inputs in = generate_inputs(p);
  const Tensor forward = test::run("local:window=9", p, in);
  // every tensor inside one of [B, H + 1, n, d + 5], row stride d + 5
  auto padded = [&](const Tensor& t) {
    auto big = std::make_shared<Tensor>(Shape4{p.batch, p.heads + 1, p.n, p.dim + 5});
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < p.n; ++i)
          for (int64_t c = 0; c < p.dim; ++c)
            big->view().row(b, h, i)[c] = t.view().row(b, h, i)[c];
    return big;
  };
  auto pq = padded(in.q), pk = padded(in.k), pv = padded(in.v);
  auto pout = std::make_shared<Tensor>(Shape4{p.batch, p.heads + 1, p.n, p.dim + 5});
  auto narrow = [&](const Tensor& big) {
    TensorView v(const_cast<float*>(big.data()), p.q_shape());
    v.stride_b = big.view().stride_b, v.stride_h = big.view().stride_h,
    v.stride_row = big.view().stride_row;
    return v;
  };
  auto local = make_variant("local:window=9");
  auto state = local->decoder()->prefill(p, narrow(*pk), narrow(*pv), 20);
  for (int64_t t = 20; t < p.n; ++t)
    state->step(row_view(ConstTensorView(narrow(*pq)), t),
                row_view(ConstTensorView(narrow(*pk)), t),
                row_view(ConstTensorView(narrow(*pv)), t), row_view(narrow(*pout), t));
  Tensor out(p.q_shape());
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 20; i < p.n; ++i)
        for (int64_t c = 0; c < p.dim; ++c)
          out.view().row(b, h, i)[c] = narrow(*pout).row(b, h, i)[c];
  EXPECT_LE(rows_error(p, out, forward.data(), 20), kTol);
}

}  // namespace
}  // namespace attnbench
