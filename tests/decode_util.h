// Helpers shared by the decode tests: stepping a state through the rest of a problem (with
// test::row_view, test_util.h), and the error of the generated rows.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/problem.h"
#include "common/core/registry.h"
#include "common/core/tensor.h"
#include "test_util.h"

namespace attnbench::test {

/// Steps `state` through positions length() .. n - 1 with rows of q, k and v, each output
/// into the same row of out [B, H, n, d].
inline void step_to_end(DecodeState& state, int64_t n, ConstTensorView q, ConstTensorView k,
                        ConstTensorView v, TensorView out) {
  for (int64_t t = state.length(); t < n; ++t) {
    state.step(row_view(q, t), row_view(k, t), row_view(v, t), row_view(out, t));
    ASSERT_EQ(state.length(), t + 1);
  }
}

/// ||out - ref||_F / ||ref||_F over rows t0 .. n - 1 of every (batch, head); out a packed
/// [B, H, n, d] tensor, ref its values in the same order (floats or float64).
template <class Ref>
double rows_error(const Problem& p, const Tensor& out, const Ref& ref, int64_t t0) {
  double diff = 0, norm = 0;
  const int64_t d = p.dim;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = t0; i < p.n; ++i)
        for (int64_t c = 0; c < d; ++c) {
          const size_t at = size_t(((b * p.heads + h) * p.n + i) * d + c);
          const double r = double(ref[at]), x = double(out.data()[at]);
          diff += (x - r) * (x - r), norm += r * r;
        }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

/// check_decode accepts causal self-attention and refuses (UnsupportedError) a problem that is
/// not causal, m != n (longer and shorter), key padding and another score than scaled_dot.
inline void expect_decodes_causal_self_attention_only(const Variant& variant) {
  EXPECT_NO_THROW(variant.check_decode(problem(1, 2, 64, 0, 16, /*causal=*/true)));
  EXPECT_THROW(variant.check_decode(problem(1, 2, 64, 0, 16, /*causal=*/false)), UnsupportedError);
  EXPECT_THROW(variant.check_decode(problem(1, 2, 64, 80, 16, /*causal=*/true)), UnsupportedError);
  EXPECT_THROW(variant.check_decode(problem(1, 2, 64, 48, 16, /*causal=*/true)), UnsupportedError);
  Problem padded = problem(2, 2, 64, 0, 16, /*causal=*/true);
  padded.key_lengths = {64, 40};
  EXPECT_THROW(variant.check_decode(padded), UnsupportedError);
  Problem dot = problem(1, 2, 64, 0, 16, /*causal=*/true);
  dot.score = Score::dot;
  EXPECT_THROW(variant.check_decode(dot), UnsupportedError);
}

}  // namespace attnbench::test
