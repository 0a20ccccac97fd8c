// Key padding in efficient, rfa (plain and gated) and sinkhorn: the keys j >= L_b of batch
// element b are absent. Whatever sits in the padded keys and values leaves the output as it
// is, and where the definition makes it exact (no causal alignment to keep) the output is that
// of the same problem with only the valid keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/inputs.h"
#include "common/registry.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::rel_fro_error;

// Sets the padded keys and values of every batch element and head to large values of size
// `size` (signs and sizes varying with the position, so no summary of them is neutral).
void fill_padding(const Problem& p, Inputs& in, float size) {
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t j = p.key_lengths[size_t(b)]; j < p.keys(); ++j)
        for (int64_t c = 0; c < p.dim; ++c) {
          const float x = size * float(1 + (j + 3 * c + h) % 5) * ((j + c) % 2 ? 1.0f : -1.0f);
          in.k.view().row(b, h, j)[c] = x;
          in.v.view().row(b, h, j)[c] = 0.5f * x;
        }
}

bool same(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data(), b.data(), size_t(a.numel()) * sizeof(float)) == 0;
}

// Every element of batch element b (all heads).
std::vector<float> batch_item(const Problem& p, const Tensor& t, int64_t b) {
  std::vector<float> out;
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t i = 0; i < t.shape().len; ++i)
      for (int64_t c = 0; c < p.dim; ++c) out.push_back(t.view().row(b, h, i)[c]);
  return out;
}

struct Case {
  std::string spec;
  bool causal;
};

const Case kCases[] = {{"efficient", false},
                       {"rfa", false},
                       {"rfa", true},
                       {"rfa:features=32,sigma=2", true},
                       {"rfa:gate=true", true},
                       {"sinkhorn:block=16", false},
                       {"sinkhorn:block=16", true},
                       {"sinkhorn:block=7,iterations=9", true}};

TEST(KeyPadding, PaddedKeysAndValuesChangeNothing) {
  for (const Case& c : kCases) {
    // sinkhorn is self-attention only; the others run cross-attention too
    const bool self = c.spec.rfind("sinkhorn", 0) == 0;
    Problem p = test::problem(3, 2, 100, self ? 0 : 130, 16, c.causal, 5);
    const int64_t m = p.keys();
    p.key_lengths = {37, 0, m - 9};
    SCOPED_TRACE(c.spec + " " + p.str());
    Inputs in = generate_inputs(p);
    Inputs big{test::copy(in.q), test::copy(in.k), test::copy(in.v)};
    Inputs other{test::copy(in.q), test::copy(in.k), test::copy(in.v)};
    fill_padding(p, big, 1e4f);
    fill_padding(p, other, -3e2f);
    const Tensor base = test::run(c.spec, p, in);
    const Tensor out = test::run(c.spec, p, big);
    EXPECT_TRUE(std::all_of(out.data(), out.data() + out.numel(),
                            [](float x) { return std::isfinite(x); }));
    EXPECT_TRUE(same(base, out)) << "the padded keys or values reached the output";
    EXPECT_TRUE(same(base, test::run(c.spec, p, other)))
        << "the padded keys or values reached the output";
    // the same garbage without the padding does change the output (the check above can fail)
    Problem unpadded = p;
    unpadded.key_lengths.clear();
    EXPECT_FALSE(same(test::run(c.spec, unpadded, in), test::run(c.spec, unpadded, big)));
    // batch element 1 has no key: exactly 0
    for (float x : batch_item(p, out, 1)) ASSERT_EQ(x, 0.0f);
  }
}

TEST(KeyPadding, NonCausalIsTheProblemOfTheValidKeys) {
  // without a causal mask nothing depends on m but the keys themselves: padding to m is the
  // problem with the L valid keys (B = 1, so one length)
  for (const char* spec : {"efficient", "rfa", "rfa:features=16,sigma=0.5"})
    for (auto [n, m, len] :
         {std::tuple<int64_t, int64_t, int64_t>{100, 130, 57}, {7, 1000, 600}, {300, 40, 1}}) {
      Problem p = test::problem(1, 3, n, m, 16, false, 8);
      p.key_lengths = {len};
      SCOPED_TRACE(std::string(spec) + " " + p.str());
      Inputs in = generate_inputs(p);
      fill_padding(p, in, 1e4f);
      Problem valid = p;
      valid.m = len;
      valid.key_lengths.clear();
      Inputs cut{test::copy(in.q), Tensor(valid.kv_shape()), Tensor(valid.kv_shape())};
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t j = 0; j < len; ++j) {
          std::copy_n(in.k.view().row(0, h, j), p.dim, cut.k.view().row(0, h, j));
          std::copy_n(in.v.view().row(0, h, j), p.dim, cut.v.view().row(0, h, j));
        }
      const Tensor padded = test::run(spec, p, in), plain = test::run(spec, valid, cut);
      std::vector<double> want(plain.data(), plain.data() + plain.numel());
      EXPECT_LE(rel_fro_error(padded.data(), want), 1e-6);
    }
}

}  // namespace
}  // namespace attnbench
