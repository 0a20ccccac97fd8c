// Finite mask values down to -FLT_MAX (tests/extreme_mask.h) through every variant that
// honours an attention mask, against the float64 reference restricted to the variant's
// pattern: a row masked wholly by such values is the uniform average of its values (as in the
// reference and torch), never NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/core/registry.h"
#include "common/reference/reference.h"
#include "tests/extreme_mask.h"
#include "tests/test_util.h"

namespace attnbench {
namespace {

// The specs to run: every registered variant with Capabilities::attn_mask (its defaults),
// and small blocks for the engine's partial blocks and several key blocks per row.
std::vector<std::string> masked_specs() {
  std::vector<std::string> specs;
  for (const VariantInfo* info : Registry::instance().all())
    if (info->caps.attn_mask) specs.push_back(info->name);
  for (const char* s :
       {"flash:block_q=16,block_k=8", "flash:block_q=7,block_k=13", "local:window=8,block=8",
        "bigbird:block=8,window_blocks=3,random_blocks=1,global_blocks=1"})
    specs.push_back(s);
  return specs;
}

// Largest |got - want| over the output, relative to the largest |want|; infinity for a
// non-finite element.
double worst_error(const Tensor& got, const std::vector<double>& want) {
  double diff = 0, scale = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    const double x = got.data()[e];
    if (!std::isfinite(x)) return INFINITY;
    diff = std::max(diff, std::abs(x - want[e]));
    scale = std::max(scale, std::abs(want[e]));
  }
  return diff / scale;
}

void check_all(const Problem& p, const char* what) {
  const Inputs in = generate_inputs(p);
  int ran = 0;
  for (const std::string& spec : masked_specs()) {
    SCOPED_TRACE(spec + " " + what);
    auto var = make_variant(spec);
    try {
      var->check_supported(p);
    } catch (const UnsupportedError&) {
      continue;
    }
    const Tensor out = test::run(spec, p, in);
    auto pat = var->make_pattern(p, in.q.view(), in.k.view());
    const auto ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view(), pat.get());
    EXPECT_LT(worst_error(out, ref), 1e-5);
    ++ran;
  }
  EXPECT_GE(ran, 8);
}

TEST(MaskExtremes, HugeFiniteValuesMatchTheReference) {
  Problem p = test::problem(2, 3, 37, 53, 64, false, 5);
  p.attn_mask = test::extreme_mask(p, 2, 1);
  check_all(p, "cross");
  Problem c = test::problem(1, 2, 45, 0, 16, true, 6);
  c.attn_mask = test::extreme_mask(c, 1, 2);
  c.key_lengths = {40};
  check_all(c, "causal padded");
}

TEST(MaskExtremes, RowOfLowestIsTheUniformAverage) {
  // d = 256: -FLT_MAX * sqrt(d) is far past float's range
  Problem p = test::problem(1, 1, 8, 20, 256, false, 7);
  p.attn_mask = test::extreme_mask(p, 1, 1);
  const Inputs in = generate_inputs(p);
  for (const char* spec : {"full", "flash", "flash:block_q=16,block_k=8"}) {
    SCOPED_TRACE(spec);
    const Tensor out = test::run(spec, p, in);
    for (int64_t c = 0; c < p.dim; ++c) {
      double mean = 0;
      for (int64_t j = 0; j < p.m; ++j) mean += in.v.view().row(0, 0, j)[c];
      mean /= double(p.m);
      EXPECT_NEAR(out.view().row(0, 0, 1)[c], mean, 1e-5) << "column " << c;
      EXPECT_NEAR(out.view().row(0, 0, 2)[c], mean, 1e-5) << "column " << c;
      EXPECT_NEAR(out.view().row(0, 0, 5)[c], in.v.view().row(0, 0, 0)[c], 1e-6) << "column " << c;
    }
  }
}

}  // namespace
}  // namespace attnbench
