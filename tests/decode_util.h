// Helpers shared by the decode tests: a token's row of a [B, H, len, d] view, stepping a state
// through the rest of a problem, and the error of the generated rows.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <gtest/gtest.h>

#include "common/decode.h"
#include "common/problem.h"
#include "common/tensor.h"

namespace attnbench::test {

/// Row t of every (batch, head) of `full` as a [B, H, 1, d] view with full's strides (and
/// grouping).
template <class T>
View4<T> row_view(View4<T> full, int64_t t) {
  View4<T> r = full;
  r.data = full.data + t * full.stride_row;
  r.shape.len = 1;
  return r;
}

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

}  // namespace attnbench::test
