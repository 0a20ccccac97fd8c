// Key padding of linformer, nystrom and compressed: padded keys are absent. Garbage in the
// padded keys and values must not move any output, and a padded batch element must compute
// what the variant computes on an unpadded problem whose keys are just its valid ones (these
// variants' random draws are indexed by key position, so the two are the same function).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/inputs.h"
#include "common/random.h"
#include "common/registry.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::run;

// Keys and values j >= L_b of every batch element b replaced by values of size `size` drawn
// from `stream`.
void fill_padding(const Problem& p, Inputs& in, double size, uint64_t stream) {
  const RandomStream rs(p.seed, stream);
  uint64_t x = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t j = p.key_lengths[size_t(b)]; j < p.keys(); ++j)
        for (int64_t c = 0; c < p.dim; ++c) {
          in.k.view().row(b, h, j)[c] = float(size * rs.normal(x++));
          in.v.view().row(b, h, j)[c] = float(size * rs.normal(x++));
        }
}

// Relative Frobenius difference of batch element b of `padded` from the unpadded output `one`
// (batch 1).
double batch_difference(const Problem& p, const Tensor& padded, int64_t b, const Tensor& one) {
  double diff2 = 0, ref2 = 0;
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t i = 0; i < p.n; ++i)
      for (int64_t c = 0; c < p.dim; ++c) {
        const double x = padded.view().row(b, h, i)[c], y = one.view().row(0, h, i)[c];
        diff2 += (x - y) * (x - y);
        ref2 += y * y;
      }
  return ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
}

// `spec` on p (key_lengths set): garbage of size 1e4 in the padded keys and values gives the
// same output, bit for bit, as other garbage; and (non-causal) every batch element with valid
// keys matches the variant run alone on its valid keys within `tol`.
void expect_padding_is_absent(const std::string& spec, const Problem& p, double tol) {
  SCOPED_TRACE(spec + " " + p.str());
  Inputs in = generate_inputs(p);
  fill_padding(p, in, 1e4, 101);
  const Tensor a = run(spec, p, in);
  fill_padding(p, in, 3e3, 202);
  const Tensor b = run(spec, p, in);
  ASSERT_TRUE(std::equal(a.data(), a.data() + a.numel(), b.data()))
      << "padded keys or values reach the output";
  for (int64_t e = 0; e < p.batch; ++e) {
    const int64_t len = p.key_lengths[size_t(e)];
    if (len == 0) {
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < p.n; ++i)
          for (int64_t c = 0; c < p.dim; ++c)
            ASSERT_EQ(a.view().row(e, h, i)[c], 0.0f) << "batch " << e << " has no key";
      continue;
    }
    if (p.causal) continue;  // the causal diagonal is the full m's: no unpadded equivalent
    Problem one = p;
    one.batch = 1, one.m = len, one.key_lengths.clear();
    Inputs sub{Tensor(one.q_shape()), Tensor(one.kv_shape()), Tensor(one.kv_shape())};
    for (int64_t h = 0; h < p.heads; ++h) {
      for (int64_t i = 0; i < p.n; ++i)
        std::copy_n(in.q.view().row(e, h, i), p.dim, sub.q.view().row(0, h, i));
      for (int64_t j = 0; j < len; ++j) {
        std::copy_n(in.k.view().row(e, h, j), p.dim, sub.k.view().row(0, h, j));
        std::copy_n(in.v.view().row(e, h, j), p.dim, sub.v.view().row(0, h, j));
      }
    }
    EXPECT_LT(batch_difference(p, a, e, run(spec, one, sub)), tol)
        << "batch " << e << " (" << len << " valid keys) differs from its keys run unpadded";
  }
}

TEST(PaddingLowRank, LinformerIgnoresPaddedKeys) {
  for (const char* spec : {"linformer:proj=32", "linformer:proj=16,share_kv=true"})
    for (auto [n, m] : {std::pair<int64_t, int64_t>{70, 130}, {300, 600}}) {
      Problem p = test::problem(4, 2, n, m, 16, false, 5);
      p.key_lengths = {m / 2 + 3, 0, m, 1};
      expect_padding_is_absent(spec, p, 1e-5);
    }
}

TEST(PaddingLowRank, NystromIgnoresPaddedKeys) {
  for (const char* spec : {"nystrom:landmarks=8", "nystrom:landmarks=16,pinv_iterations=3"})
    for (auto [n, m] : {std::pair<int64_t, int64_t>{70, 130}, {300, 1100}}) {
      Problem p = test::problem(4, 2, n, m, 16, false, 5);
      p.key_lengths = {m / 2 + 3, 0, m, 5};
      expect_padding_is_absent(spec, p, 1e-4);
    }
}

TEST(PaddingLowRank, CompressedIgnoresPaddedKeys) {
  for (const char* spec : {"compressed:ratio=3", "compressed:ratio=4,pool=conv"})
    for (bool causal : {false, true})
      for (auto [n, m] : {std::pair<int64_t, int64_t>{70, 130}, {200, 200}}) {
        Problem p = test::problem(4, 2, n, m, 16, causal, 5);
        p.key_lengths = {m / 2 + 2, 0, m, 1};
        expect_padding_is_absent(spec, p, 1e-5);
      }
}

}  // namespace
}  // namespace attnbench
