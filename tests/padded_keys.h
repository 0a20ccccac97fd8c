// A check that a variant treats padded keys as absent (Problem::key_lengths): garbage in the
// padded keys and values never reaches an output, and, where the variant's definition makes it
// exact, a batch element computes what the variant computes on its valid keys alone.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "common/core/problem.h"
#include "common/io/inputs.h"
#include "tests/test_util.h"

namespace attnbench::test {

/// Fills the padded keys and values (rows j >= key_lengths[b]) of every batch element b with
/// `garbage` (element c of row j gets garbage * (1 + (j + c) % 3), so that the rows differ).
inline void fill_padding(const Problem& p, Inputs& in, float garbage) {
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t j = p.key_lengths[size_t(b)]; j < p.keys(); ++j)
        for (int64_t c = 0; c < p.dim; ++c) {
          const float x = garbage * float(1 + (j + c) % 3);
          in.k.view().row(b, h, j)[c] = x;
          in.v.view().row(b, h, j)[c] = x;
        }
}

/// Runs `spec` on the padded problem p with two different garbages (1e4 and -3e4) in its padded
/// keys and values: the outputs must be bit-identical, finite, and rows of a batch element
/// without keys 0. With `alone` (for a non-causal p and a variant whose definition makes it so),
/// each batch element with some valid key must also give, within `tol` relative (Frobenius, per
/// batch element), the output of `spec` on the problem of that element alone with only its
/// valid keys (batch 1, m = its key length, the same seed and heads).
inline void expect_padded_keys_absent(const std::string& spec, const Problem& p, bool alone,
                                      double tol) {
  SCOPED_TRACE(spec + " " + p.str());
  Inputs a = generate_inputs(p), g = generate_inputs(p);
  fill_padding(p, a, 1e4f);
  fill_padding(p, g, -3e4f);
  const Tensor out_a = run(spec, p, a), out_g = run(spec, p, g);
  ASSERT_TRUE(std::all_of(out_a.data(), out_a.data() + out_a.numel(),
                          [](float x) { return std::isfinite(x); }));
  ASSERT_EQ(std::memcmp(out_a.data(), out_g.data(), size_t(out_a.numel()) * sizeof(float)), 0)
      << "the padded keys or values reach the output";
  // The same two inputs without the padding do differ (the check above can fail), wherever
  // some key is padded.
  if (std::any_of(p.key_lengths.begin(), p.key_lengths.end(),
                  [&](int64_t len) { return len < p.keys(); })) {
    Problem unpadded = p;
    unpadded.key_lengths.clear();
    const Tensor ua = run(spec, unpadded, a), ug = run(spec, unpadded, g);
    EXPECT_NE(std::memcmp(ua.data(), ug.data(), size_t(ua.numel()) * sizeof(float)), 0)
        << "the garbage in the padded positions changes nothing even without padding";
  }
  const ConstTensorView o = out_a.view();
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = p.key_lengths[size_t(b)];
    if (len == 0) {
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < p.n; ++i)
          for (int64_t c = 0; c < p.dim; ++c) ASSERT_EQ(o.row(b, h, i)[c], 0.0f);
      continue;
    }
    if (!alone) continue;
    Problem one = p;
    one.batch = 1, one.m = len, one.key_lengths.clear();
    Inputs in{Tensor(one.q_shape()), Tensor(one.kv_shape()), Tensor(one.kv_shape())};
    for (int64_t h = 0; h < p.heads; ++h) {
      for (int64_t i = 0; i < p.n; ++i)
        std::copy_n(a.q.view().row(b, h, i), p.dim, in.q.view().row(0, h, i));
      for (int64_t j = 0; j < len; ++j) {
        std::copy_n(a.k.view().row(b, h, j), p.dim, in.k.view().row(0, h, j));
        std::copy_n(a.v.view().row(b, h, j), p.dim, in.v.view().row(0, h, j));
      }
    }
    const Tensor want = run(spec, one, in);
    const ConstTensorView w = want.view();
    double diff = 0, norm = 0;
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.n; ++i)
        for (int64_t c = 0; c < p.dim; ++c) {
          const double x = o.row(b, h, i)[c], y = w.row(0, h, i)[c];
          diff += (x - y) * (x - y), norm += y * y;
        }
    EXPECT_LE(std::sqrt(diff), tol * std::sqrt(norm))
        << "batch element " << b << " differs from its valid keys alone";
  }
}

}  // namespace attnbench::test
