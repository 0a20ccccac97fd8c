// bfloat16 as a problem dimension (Problem::dtype): the rounding itself, flash's bf16 path
// against a float64 reference on the bf16-rounded inputs within a bound derived from bf16's
// unit roundoff, and the refusals of what has no bf16 path.
#include "common/kernels/bf16.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/reference/reference.h"
#include "harness/results.h"
#include "test_util.h"
#include "tests/extreme_mask.h"

namespace attnbench {
namespace {

using test::problem;

float bits_to_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

TEST(Bf16, RoundsToNearestEven) {
  const float ulp1 = std::ldexp(1.0f, -7);  // bf16's spacing at 1 (8 significant bits)
  EXPECT_EQ(bf16_round(1.0f), 1.0f);
  EXPECT_EQ(bf16_round(1.0f + ulp1), 1.0f + ulp1);
  // halfway cases go to the even neighbour
  EXPECT_EQ(bf16_round(1.0f + ulp1 / 2), 1.0f);
  EXPECT_EQ(bf16_round(1.0f + 3 * ulp1 / 2), 1.0f + 2 * ulp1);
  EXPECT_EQ(bf16_round(-1.0f - ulp1 / 2), -1.0f);
  // just past halfway goes up, just below goes down
  EXPECT_EQ(bf16_round(std::nextafter(1.0f + ulp1 / 2, 2.0f)), 1.0f + ulp1);
  EXPECT_EQ(bf16_round(std::nextafter(1.0f + ulp1 / 2, 0.0f)), 1.0f);
  // 1/3 = 0x3eaaaaab: the low half 0xaaab is above halfway, so up to 0x3eab
  EXPECT_EQ(bf16_bits(1.0f / 3), 0x3eab);
  // signed zeros, infinities, NaN
  EXPECT_EQ(bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(bf16_round(INFINITY), INFINITY);
  EXPECT_EQ(bf16_round(-INFINITY), -INFINITY);
  EXPECT_TRUE(std::isnan(bf16_round(NAN)));
  EXPECT_TRUE(std::isnan(bf16_round(bits_to_float(0x7f800001u))));  // a NaN that would round to inf
  // the largest float rounds past the largest bf16 to infinity, as torch's conversion does
  EXPECT_EQ(bf16_round(FLT_MAX), INFINITY);
  EXPECT_EQ(bf16_round(bits_to_float(0x7f7f0000u)), bits_to_float(0x7f7f0000u));
  // subnormals round on the same grid
  EXPECT_EQ(bf16_bits(bits_to_float(0x00018000u)), 0x0002);
  EXPECT_EQ(bf16_bits(bits_to_float(0x00008000u)), 0x0000);
  // every value is a bf16 value after rounding, within half a spacing of the input
  for (float x = -3.0f; x < 3.0f; x += 0.0137f) {
    const float r = bf16_round(x);
    EXPECT_EQ(bf16_round(r), r);
    EXPECT_LE(std::abs(double(r) - x), std::ldexp(std::abs(double(x)), -8) * (1 + 1e-12)) << x;
  }
}

TEST(Bf16, RoundedTensorKeepsShapeAndGrouping) {
  Problem p = problem(2, 4, 5, 7, 3, false);
  p.kv_heads = 2;
  const Inputs in = generate_inputs(p);
  const Tensor k = rounded_bf16(in.k);
  EXPECT_TRUE(k.shape() == in.k.shape());
  EXPECT_EQ(k.group(), in.k.group());
  for (int64_t i = 0; i < k.numel(); ++i) EXPECT_EQ(k.data()[i], bf16_round(in.k.data()[i]));
}

// flash's bf16 path on bf16 inputs: q, k, v are bf16 values, so the products Q K^T and their
// float32 sums are those of float32 flash; P is rounded to bf16 for P V. Each weight then
// carries a relative error of at most u = 2^-8 (bf16's unit roundoff) against the float32
// path, and the row sum is taken before the rounding, so every output element obeys
//   |o - o*| <= u sum_j p_j |v_j| + (float32 rounding, well below it)
// with o* the float64 reference on the same (rounded) inputs and sum_j p_j |v_j| the
// reference's attention over |v|.
struct Case {
  const char* name;
  Problem p;
};

std::vector<Case> ragged_cases() {
  std::vector<Case> cases;
  cases.push_back({"self", problem(2, 3, 77, 0, 40, false, 3)});
  cases.push_back({"causal", problem(1, 2, 130, 0, 64, true, 4)});
  cases.push_back({"cross_causal", problem(1, 2, 61, 203, 24, true, 5)});
  Problem gqa = problem(1, 4, 96, 0, 32, true, 6);
  gqa.kv_heads = 2;
  cases.push_back({"grouped", gqa});
  Problem padded = problem(3, 2, 50, 90, 16, false, 7);
  padded.key_lengths = {90, 17, 1};
  cases.push_back({"key_padding", padded});
  Problem masked = problem(2, 2, 45, 70, 32, false, 8);
  masked.attn_mask = test::random_mask(masked, 2, 1, /*is_bool=*/false, /*empty_row=*/3);
  cases.push_back({"attn_mask", masked});
  // -FLT_MAX and -1e30 rows beside -inf and ordinary values (tests/extreme_mask.h)
  Problem extreme = problem(1, 2, 45, 70, 32, false, 9);
  extreme.attn_mask = test::extreme_mask(extreme, 1, 2);
  cases.push_back({"extreme_mask", extreme});
  return cases;
}

// The largest |o - o*| / (u sum_j p_j |v_j|) over the elements (u = 2^-8).
double worst_ratio(const Problem& p, const Inputs& rounded, const Tensor& out) {
  Problem p32 = p;
  p32.dtype = DType::f32;
  const auto ref = reference_attention(p32, rounded.q.view(), rounded.k.view(), rounded.v.view());
  Tensor abs_v = rounded_bf16(rounded.v);  // a copy with the same grouping (already bf16)
  for (int64_t i = 0; i < abs_v.numel(); ++i) abs_v.data()[i] = std::abs(abs_v.data()[i]);
  const auto scale = reference_attention(p32, rounded.q.view(), rounded.k.view(), abs_v.view());
  const double u = std::ldexp(1.0, -8);
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::abs(double(out.data()[i]) - ref[i]);
    // an element whose bound is 0 (a row with no key) must be exactly 0
    if (scale[i] == 0) {
      EXPECT_EQ(err, 0.0) << "element " << i;
      continue;
    }
    worst = std::max(worst, err / (u * scale[i]));
  }
  return worst;
}

// The bf16 kernels this machine can run (ATTNBENCH_BF16_KERNEL values): f32 everywhere, amx
// where amx_usable().
std::vector<std::string> bf16_kernels() {
  std::vector<std::string> k = {"f32"};
  if (amx_usable()) k.push_back("amx");
  return k;
}

Inputs rounded_inputs(const Inputs& in) {
  Inputs r;
  r.q = rounded_bf16(in.q), r.k = rounded_bf16(in.k), r.v = rounded_bf16(in.v);
  return r;
}

TEST(Bf16Flash, WithinTheRoundoffBoundOnRaggedShapes) {
  std::vector<Case> cases = ragged_cases();
  // a head dimension past two AMX depth steps, and rows past one tile
  cases.push_back({"wide", problem(1, 2, 150, 0, 72, true, 10)});
  for (const std::string& kernel : bf16_kernels()) {
    SCOPED_TRACE(kernel);
    const test::ScopedEnv env(kBf16KernelEnv, kernel);
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      Problem p = c.p;
      const Inputs rounded = rounded_inputs(generate_inputs(p));
      for (const char* spec :
           {"flash", "flash:block_q=16,block_k=32", "flash:block_q=48,block_k=64"}) {
        SCOPED_TRACE(spec);
        p.dtype = DType::bf16;
        auto flash = make_variant(spec);
        Tensor bf(p.q_shape());
        flash->run(p, rounded.q.view(), rounded.k.view(), rounded.v.view(), bf.view());
        EXPECT_EQ(flash->notes().rfind("bf16 kernel: " + kernel, 0), 0u) << flash->notes();
        p.dtype = DType::f32;
        const Tensor f32 = test::run(spec, p, rounded);
        const double bf_ratio = worst_ratio(p, rounded, bf),
                     f32_ratio = worst_ratio(p, rounded, f32);
        std::printf("%s %s %s: worst |o - o*| / (u sum p|v|) %.3f (bf16), %.2e (f32)\n",
                    kernel.c_str(), c.name, spec, bf_ratio, f32_ratio);
        // within the bound (a 2% margin for the float32 part of the arithmetic) ...
        EXPECT_LE(bf_ratio, 1.02);
        // ... and the bound is the bf16 rounding's: the float32 path on the same inputs stays
        // far inside it, and the bf16 path uses a good part of it
        EXPECT_LT(f32_ratio, 0.01);
        EXPECT_GT(bf_ratio, 0.05);
      }
    }
  }
}

// The pattern variants on the engine's bf16 path. Their float64 references differ per
// pattern, so the bound is taken against their own float32 path on the same rounded inputs
// (itself within ~1e-6 of those references, tests/common/patterns_test.cpp and the variants'
// tests):
//   |o_bf16 - o_f32| <= u sum_j p_j |v_j|, the sum being the variant's float32 output on |v|
// (the same pattern: these patterns do not depend on v). Every element, on every kernel and
// the ragged shapes the engine masks (causal, key padding, attention mask, partial blocks).
TEST(Bf16Patterns, WithinTheRoundoffBoundOfTheirFloat32Path) {
  std::vector<Case> cases = ragged_cases();
  std::erase_if(cases, [](const Case& c) { return std::string(c.name) == "self"; });
  for (const std::string& kernel : bf16_kernels()) {
    SCOPED_TRACE(kernel);
    const test::ScopedEnv env(kBf16KernelEnv, kernel);
    for (const char* spec : {"local:window=20,block=32", "local:window=9,sinks=3,block=16",
                             "bigbird:block=32,window_blocks=3,random_blocks=1,global_blocks=1",
                             "global:global=5,block=32", "longformer:window=12,global=4,block=32",
                             "strided:stride=5,span=40,block=32", "strided:stride=9,block=32",
                             "sparse_transformer:stride=24,block=32",
                             "sparse_transformer:mode=fixed,stride=24,summary=4,block=32"}) {
      SCOPED_TRACE(spec);
      for (const Case& c : cases) {
        SCOPED_TRACE(c.name);
        Problem p = c.p;
        auto variant = make_variant(spec);
        if (p.keys() != p.n && !variant->info().caps.cross) continue;
        const Inputs rounded = rounded_inputs(generate_inputs(p));
        Inputs abs_in = rounded_inputs(rounded);
        for (int64_t i = 0; i < abs_in.v.numel(); ++i)
          abs_in.v.data()[i] = std::abs(abs_in.v.data()[i]);
        p.dtype = DType::bf16;
        Tensor bf(p.q_shape());
        // a block size amx cannot start at says so (an error when amx is asked for), the
        // others run the kernel asked for
        const bool aligned = std::string(spec).find("block=16") == std::string::npos;
        if (!aligned && kernel == "amx") {
          EXPECT_THROW(
              variant->run(p, rounded.q.view(), rounded.k.view(), rounded.v.view(), bf.view()),
              UnsupportedError);
          continue;
        }
        variant->run(p, rounded.q.view(), rounded.k.view(), rounded.v.view(), bf.view());
        EXPECT_EQ(variant->notes().rfind("bf16 kernel: " + (aligned ? kernel : "f32"), 0), 0u)
            << variant->notes();
        p.dtype = DType::f32;
        const Tensor f32 = test::run(spec, p, rounded), scale = test::run(spec, p, abs_in);
        const double u = std::ldexp(1.0, -8);
        double worst = 0;
        for (int64_t i = 0; i < bf.numel(); ++i) {
          const double err = std::abs(double(bf.data()[i]) - f32.data()[i]);
          // the float32 path's own rounding: far below u at these sizes
          const double bound = u * scale.data()[i] * 1.02 + 1e-6 * std::abs(f32.data()[i]);
          if (scale.data()[i] == 0) {
            EXPECT_EQ(bf.data()[i], 0.0f) << i;
            continue;
          }
          worst = std::max(worst, err / bound);
        }
        EXPECT_LE(worst, 1.0);
        EXPECT_GT(worst, 0.05);  // the rounding of P shows: bf16 ran
      }
    }
  }
}

// Values near the top of the bf16 range: P V overflows float32 when summed plainly, and the
// tile runs again with scaled weights (attention_kernels.h), on every kernel. The output, a
// convex combination of v rows, is finite and within bf16 rounding of the reference.
TEST(Bf16Flash, HugeValuesRunAgainScaled) {
  for (const std::string& kernel : bf16_kernels()) {
    SCOPED_TRACE(kernel);
    const test::ScopedEnv env(kBf16KernelEnv, kernel);
    Problem p = problem(1, 2, 70, 0, 32, false, 11);
    Inputs in = rounded_inputs(generate_inputs(p));
    for (int64_t i = 0; i < in.v.numel(); ++i)
      in.v.data()[i] = bf16_round(in.v.data()[i] > 0 ? 3e38f : -3e38f);
    p.dtype = DType::bf16;
    const Tensor out = test::run("flash", p, in);
    p.dtype = DType::f32;
    const auto ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_TRUE(std::isfinite(out.data()[i])) << i;
      ASSERT_LE(std::abs(out.data()[i] - ref[i]), 3e38 * std::ldexp(1.0, -7)) << i;
    }
  }
}

// Which bf16 kernel runs: the environment variable's choice, amx wherever it can run unless
// told otherwise, the f32 kernel with the reason where it cannot, and errors for what cannot be
// done.
TEST(Bf16Dispatch, PicksTheKernelAndSaysWhy) {
  Problem p = problem(1, 2, 100, 0, 32, true, 12);
  p.dtype = DType::bf16;
  const Inputs in = rounded_inputs(generate_inputs(p));
  auto notes_of = [&](const std::string& spec) {
    auto v = make_variant(spec);
    Tensor out(p.q_shape());
    v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    return v->notes();
  };
  {
    const test::ScopedEnv env(kBf16KernelEnv, "auto");
    const std::string notes = notes_of("flash");
    if (amx_usable()) {
      EXPECT_EQ(notes.rfind("bf16 kernel: amx", 0), 0u) << notes;
      EXPECT_EQ(amx_unusable_reason(), "");
    } else {
      EXPECT_EQ(notes.rfind("bf16 kernel: f32", 0), 0u) << notes;
      EXPECT_NE(notes.find("amx not used: " + amx_unusable_reason()), std::string::npos) << notes;
    }
    // key blocks amx cannot start at take the f32 kernel, saying so
    const std::string odd = notes_of("flash:block_k=48");
    EXPECT_EQ(odd.rfind("bf16 kernel: f32", 0), 0u) << odd;
    if (amx_usable()) {
      EXPECT_NE(odd.find("key blocks of 48 keys"), std::string::npos) << odd;
    }
  }
  {
    const test::ScopedEnv env(kBf16KernelEnv, "f32");
    const std::string notes = notes_of("flash");
    EXPECT_NE(notes.find("amx not used: ATTNBENCH_BF16_KERNEL=f32"), std::string::npos) << notes;
  }
  {
    // amx asked for where it cannot run is an error, never the other kernel quietly
    const test::ScopedEnv env(kBf16KernelEnv, "amx");
    const std::string spec = amx_usable() ? "flash:block_k=48" : "flash";
    const std::string msg = test::error_message<UnsupportedError>([&] { notes_of(spec); });
    EXPECT_NE(msg.find("ATTNBENCH_BF16_KERNEL=amx"), std::string::npos) << msg;
  }
  {
    const test::ScopedEnv env(kBf16KernelEnv, "avx512");
    const std::string msg = test::error_message<UsageError>([&] { notes_of("flash"); });
    EXPECT_NE(msg.find("accepted: auto, amx, f32"), std::string::npos) << msg;
  }
  // on a CPU that reports AMX-BF16, a build for it must use it: the f32 kernel would pass
  // every other test here at a third of the speed
  std::ifstream cpuinfo("/proc/cpuinfo");
  const std::string info((std::istreambuf_iterator<char>(cpuinfo)), {});
  if (info.find(" amx_bf16") != std::string::npos &&
      amx_unusable_reason().rfind("not built", 0) != 0) {
    EXPECT_TRUE(amx_usable()) << amx_unusable_reason();
  }
}

// The dot and bilinear scores map q first; under bf16 the mapped query is rounded like q, so
// bilinear bf16 is scaled_dot bf16 on the rounded map, bit for bit.
TEST(Bf16Flash, RoundsTheMappedQuery) {
  Problem p = test::with_score(problem(1, 2, 40, 0, 16, true, 9), Score::bilinear);
  p.dtype = DType::bf16;
  const Inputs in = generate_inputs(p);
  Inputs rounded;
  rounded.q = rounded_bf16(in.q), rounded.k = rounded_bf16(in.k), rounded.v = rounded_bf16(in.v);
  const Tensor out = test::run("flash", p, rounded);
  Inputs mapped;
  mapped.q = linear_score_query(p, rounded.q.view());
  round_to_bf16(mapped.q.data(), mapped.q.numel());
  mapped.k = rounded_bf16(rounded.k), mapped.v = rounded_bf16(rounded.v);
  const Problem scaled = linear_score_problem(p);
  ASSERT_EQ(scaled.dtype, DType::bf16);
  const Tensor expect = test::run("flash", scaled, mapped);
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.data()[i], expect.data()[i]) << i;
}

TEST(Bf16Refusals, WhatHasNoBf16Path) {
  Problem p = problem(1, 2, 32, 0, 16, true);
  p.dtype = DType::bf16;
  // a variant without a bf16 path
  auto linear = make_variant("linear");
  const std::string no_path =
      test::error_message<UnsupportedError>([&] { linear->check_supported(p); });
  EXPECT_NE(no_path.find("linear has no bf16 path"), std::string::npos) << no_path;
  EXPECT_THROW(linear->check_supported(p), UnsupportedError);
  // flash's backward and decode run in float32 only
  auto flash = make_variant("flash");
  flash->check_supported(p);
  EXPECT_THROW(flash->check_backward(p), UnsupportedError);
  EXPECT_THROW(flash->check_decode(p), UnsupportedError);
  // the additive score has no bf16 path in any variant
  Problem additive = test::with_score(p, Score::additive);
  EXPECT_THROW(flash->check_supported(additive), UnsupportedError);
  // names: bf16 problems say so, f32 ones keep their names
  EXPECT_NE(p.str().find(",dtype=bf16"), std::string::npos);
  p.dtype = DType::f32;
  EXPECT_EQ(p.str().find("dtype"), std::string::npos);
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_THROW(parse_dtype("fp16"), UsageError);
}

// sweep --dtype f32,bf16: a row per precision, the bf16 rows of flash with both errors, the
// variant without a bf16 path unsupported, and the dtype a key column (--resume keeps both).
TEST(Bf16Cli, SweepCrossesThePrecisions) {
  test::TempDir dir;
  const std::string out = dir.file("sweep");
  const std::string args =
      "sweep --variant flash --variant linear --seq 64,96 --heads 2 --dim 16 "
      "--dtype f32,bf16 --reps 1 --min-time 0 --threads 1 --out '" +
      out + "'";
  const test::CliResult r = test::run_cli(args, dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto lines = test::read_lines(out + "/results.csv");
  ASSERT_EQ(lines.size(), 1u + 2 * 2 * 2) << r.err;
  const auto header = split_csv_line(lines[0]);
  auto col = [&](const char* name) {
    const auto it = std::find(header.begin(), header.end(), name);
    EXPECT_NE(it, header.end()) << name;
    return size_t(it - header.begin());
  };
  const size_t spec = col("spec"), dtype = col("dtype"), status = col("status"),
               err = col("rel_fro_error"), rounding = col("rounded_input_error"),
               notes = col("notes");
  int bf16_ok = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    const auto f = split_csv_line(lines[i]);
    const bool flash = f[spec].rfind("flash", 0) == 0, bf16 = f[dtype] == "bf16";
    EXPECT_TRUE(f[dtype] == "f32" || bf16) << lines[i];
    if (!flash && bf16) {
      EXPECT_EQ(f[status], "unsupported") << lines[i];
      continue;
    }
    EXPECT_EQ(f[status], "ok") << lines[i];
    const double e = std::stod(f[err]);
    if (bf16) {
      ++bf16_ok;
      const double e_round = std::stod(f[rounding]);
      // bf16 costs about its unit roundoff; the rounding of the inputs is a part of it
      EXPECT_GT(e, 1e-4) << lines[i];
      EXPECT_LT(e, 2e-2) << lines[i];
      EXPECT_GT(e_round, 1e-4) << lines[i];
      EXPECT_LT(e_round, e * 1.5) << lines[i];
      EXPECT_NE(f[notes].find("bf16 kernel: "), std::string::npos) << lines[i];
    } else {
      if (flash) {
        EXPECT_LT(e, 1e-5) << lines[i];  // (linear approximates)
      }
      EXPECT_EQ(f[rounding], "") << lines[i];
    }
  }
  EXPECT_EQ(bf16_ok, 2);
  // meta.json records the bf16 kernels this machine runs
  const auto meta = nlohmann::json::parse(test::read_text(out + "/meta.json"));
  const auto& kernels = meta.at("bf16_kernels");
  EXPECT_EQ(kernels.at("amx_usable").get<bool>(), amx_usable());
  EXPECT_EQ(kernels.at("amx_unusable_reason").get<std::string>(), amx_unusable_reason());
  EXPECT_EQ(kernels.at("default_kernel").get<std::string>(), amx_usable() ? "amx" : "f32");
  EXPECT_EQ(kernels.at("cpu_avx512_bf16").get<bool>(), cpu_has_avx512_bf16());
  // resumed, every row is kept: f32 and bf16 rows of one problem are distinct keys
  const test::CliResult again = test::run_cli(args + " --resume", dir);
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.err.find("8 kept"), std::string::npos) << again.err;
  // a bad precision is refused, naming the accepted ones
  const test::CliResult bad = test::run_cli(
      "sweep --variant flash --seq 64 --dtype f32,fp16 --out '" + dir.file("bad") + "'", dir);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("accepted: f32, bf16"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace attnbench
