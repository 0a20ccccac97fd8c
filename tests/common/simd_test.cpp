// The hand-vectorised elementary functions of common/kernels/simd.h against double precision, over
// their whole documented range, including the edges (underflow to 0, overflow to inf, NaN).
#include "common/kernels/simd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/kernels/softmax.h"

namespace {

/// Distance in units of the float spacing at the reference value (at least the smallest
/// normal's, so that results near 0 are judged on an absolute scale).
[[maybe_unused]] double ulps(float got, double want) {
  const double spacing = std::max(std::ldexp(std::abs(want), -23), double(FLT_MIN) * 0x1p-23);
  return std::abs(double(got) - want) / spacing;
}

/// Evenly spaced points of [lo, hi] plus their neighbours in float.
[[maybe_unused]] std::vector<float> grid(float lo, float hi, int count) {
  std::vector<float> x;
  for (int i = 0; i <= count; ++i) {
    const float v = lo + (hi - lo) * float(i) / float(count);
    x.push_back(v);
    x.push_back(std::nextafter(v, hi));
  }
  while (x.size() % 16 != 0) x.push_back(lo);
  return x;
}

// row_max and exp_sum (common/kernels/softmax.h) take their vector path on whole groups of lanes
// and a scalar one on the rest: every length up to a few groups, against double precision.
TEST(Softmax, RowMaxAndExpSumMatchDoubleOnEveryLength) {
  for (int64_t len = 0; len <= 70; ++len) {
    std::vector<float> x(static_cast<size_t>(len));
    for (int64_t j = 0; j < len; ++j) x[size_t(j)] = float(std::sin(double(j) * 1.7) * 6.0);
    if (len > 3) x[size_t(len / 3)] = -INFINITY;  // a key left out
    double mx = -INFINITY;
    for (float v : x) mx = std::max(mx, double(v));
    ASSERT_EQ(double(attnbench::row_max(x.data(), len)), mx) << len;
    const float scale = 0.37f, m = float(mx);
    std::vector<float> y = x;
    const float sum = attnbench::exp_sum(y.data(), len, scale, m);
    double want_sum = 0;
    for (int64_t j = 0; j < len; ++j) {
      const double e = std::exp((double(x[size_t(j)]) - m) * scale);
      want_sum += e;
      EXPECT_NEAR(y[size_t(j)], e, 4e-7 * e + 1e-30) << len << " " << j;
    }
    EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum) << len;
  }
  // fast_exp over the top of its range, where 2^n reaches 2^128
  for (float top : {88.0f, 88.3f, 88.69f})
    EXPECT_NEAR(attnbench::fast_exp(top), std::exp(double(top)), 3e-7 * std::exp(double(top)));
  // a NaN score is passed over by the max, and makes the sum NaN
  std::vector<float> x(40, 1.0f);
  x[21] = NAN;
  EXPECT_EQ(attnbench::row_max(x.data(), 40), 1.0f);
  EXPECT_TRUE(std::isnan(attnbench::exp_sum(x.data(), 40, 1.0f, 1.0f)));
}

#if defined(__AVX2__) && defined(__FMA__)
namespace v8 = attnbench::simd::avx2;

std::vector<float> exp2_avx2(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); i += 8)
    _mm256_storeu_ps(&y[i], v8::exp2_ps(_mm256_loadu_ps(&x[i])));
  return y;
}

TEST(SimdAvx2, Exp2IsWithinTwoUlpOverTheNormalRange) {
  const std::vector<float> x = grid(-126.0f, 127.9f, 20000);
  const std::vector<float> y = exp2_avx2(x);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i)
    worst = std::max(worst, ulps(y[i], std::exp2(double(x[i]))));
  EXPECT_LE(worst, 2.0);
}

TEST(SimdAvx2, Exp2GoesThroughTheSubnormalsToZeroAndOverflowsToInf) {
  const std::vector<float> x = {-126.5f,   -130.0f, -140.25f, -149.0f,  -151.0f, -1000.0f,
                                -INFINITY, 128.0f,  500.0f,   INFINITY, NAN,     0.0f,
                                -0.0f,     1.0f,    -1.0f,    127.0f};
  const std::vector<float> y = exp2_avx2(x);
  for (int i = 0; i < 4; ++i) {
    const double want = std::exp2(double(x[size_t(i)]));
    // a subnormal result keeps fewer bits: within two of its units
    EXPECT_LE(std::abs(double(y[size_t(i)]) - want), 2.0 * 0x1p-149) << x[size_t(i)];
    EXPECT_GT(y[size_t(i)], 0.0f) << x[size_t(i)];
  }
  EXPECT_EQ(y[4], 0.0f);
  EXPECT_EQ(y[5], 0.0f);
  EXPECT_EQ(y[6], 0.0f);
  EXPECT_EQ(y[7], INFINITY);
  EXPECT_EQ(y[8], INFINITY);
  EXPECT_EQ(y[9], INFINITY);
  EXPECT_TRUE(std::isnan(y[10]));
  EXPECT_EQ(y[11], 1.0f);
  EXPECT_EQ(y[12], 1.0f);
  EXPECT_EQ(y[13], 2.0f);
  EXPECT_EQ(y[14], 0.5f);
  EXPECT_EQ(y[15], 0x1p127f);
}

std::vector<float> exp_avx2(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); i += 8)
    _mm256_storeu_ps(&y[i], v8::exp_ps(_mm256_loadu_ps(&x[i])));
  return y;
}

TEST(SimdAvx2, ExpIsFastExpLaneByLaneAndWithinAFewUlp) {
  std::vector<float> x = grid(-87.3f, 88.7f, 20000);
  for (float top : {88.0f, 88.3f, 88.5f, 88.69f}) x.push_back(top);  // 2^128 < e^x
  while (x.size() % 8 != 0) x.push_back(0.0f);
  const std::vector<float> y = exp_avx2(x);
  double worst = 0, worst_scalar = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, ulps(y[i], std::exp(double(x[i]))));
    worst_scalar = std::max(worst_scalar, ulps(y[i], double(attnbench::fast_exp(x[i]))));
  }
  EXPECT_LE(worst, 3.0);
  EXPECT_LE(worst_scalar, 1.0);  // the scalar form may round one FMA differently
}

TEST(SimdAvx2, ExpIsZeroBelowItsRangeInfAboveAndKeepsNaN) {
  const std::vector<float> x = {-87.34f, -100.0f, -INFINITY, 88.71f, 1000.0f, INFINITY, NAN, 0.0f};
  const std::vector<float> y = exp_avx2(x);
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 0.0f);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], INFINITY);
  EXPECT_EQ(y[4], INFINITY);
  EXPECT_EQ(y[5], INFINITY);
  EXPECT_TRUE(std::isnan(y[6]));
  EXPECT_EQ(y[7], 1.0f);
}

// sin and cos of every x by one SIMD width's sincos_ps (x.size() a multiple of the lanes)
using SincosFn = void (*)(const float* x, float* s, float* c);

void expect_sincos_within_a_few_ulp(SincosFn fn, size_t lanes) {
  // float arguments up to the limit; the error is judged against the value a float
  // argument's sine has (absolute near the zeros, as the reduction of a float x is exact to
  // about 2^-24 of pi/2 at most)
  const std::vector<float> x =
      grid(-attnbench::simd::kSincosLimit, attnbench::simd::kSincosLimit, 200000);
  ASSERT_EQ(x.size() % lanes, 0u);
  std::vector<float> s(x.size()), c(x.size());
  for (size_t i = 0; i < x.size(); i += lanes) fn(&x[i], &s[i], &c[i]);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, std::abs(double(s[i]) - std::sin(double(x[i]))));
    worst = std::max(worst, std::abs(double(c[i]) - std::cos(double(x[i]))));
  }
  EXPECT_LE(worst, 3e-7);
  // small arguments keep their relative accuracy: sin x ~ x
  const std::vector<float> small = grid(-0.75f, 0.75f, 3000);
  ASSERT_EQ(small.size() % lanes, 0u);
  std::vector<float> ss(small.size()), cs(small.size());
  for (size_t i = 0; i < small.size(); i += lanes) fn(&small[i], &ss[i], &cs[i]);
  double worst_rel = 0;
  for (size_t i = 0; i < small.size(); ++i) {
    const double a = double(small[i]);
    if (a != 0) worst_rel = std::max(worst_rel, ulps(ss[i], std::sin(a)));
    worst_rel = std::max(worst_rel, ulps(cs[i], std::cos(a)));
  }
  EXPECT_LE(worst_rel, 3.0);
}

TEST(SimdAvx2, SincosIsWithinAFewUlpOfTheArgumentsAngle) {
  expect_sincos_within_a_few_ulp(
      [](const float* x, float* s, float* c) {
        __m256 sv, cv;
        v8::sincos_ps(_mm256_loadu_ps(x), sv, cv);
        _mm256_storeu_ps(s, sv);
        _mm256_storeu_ps(c, cv);
      },
      8);
}

#ifdef __AVX512F__
TEST(SimdAvx512, SincosIsWithinAFewUlpOfTheArgumentsAngle) {
  expect_sincos_within_a_few_ulp(
      [](const float* x, float* s, float* c) {
        __m512 sv, cv;
        attnbench::simd::sincos_ps(_mm512_loadu_ps(x), sv, cv);
        _mm512_storeu_ps(s, sv);
        _mm512_storeu_ps(c, cv);
      },
      16);
}

TEST(SimdAvx512, SincosEqualsTheAvx2OneLaneByLane) {
  const std::vector<float> x = grid(-1000.0f, 1000.0f, 4096);
  for (size_t i = 0; i < x.size(); i += 16) {
    __m512 s16, c16;
    attnbench::simd::sincos_ps(_mm512_loadu_ps(&x[i]), s16, c16);
    float a16[16], b16[16], a8[16], b8[16];
    _mm512_storeu_ps(a16, s16);
    _mm512_storeu_ps(b16, c16);
    for (int h = 0; h < 2; ++h) {
      __m256 s8, c8;
      v8::sincos_ps(_mm256_loadu_ps(&x[i + 8 * size_t(h)]), s8, c8);
      _mm256_storeu_ps(a8 + 8 * h, s8);
      _mm256_storeu_ps(b8 + 8 * h, c8);
    }
    for (int l = 0; l < 16; ++l) {
      ASSERT_EQ(a16[l], a8[l]) << "sin of " << x[i + size_t(l)];
      ASSERT_EQ(b16[l], b8[l]) << "cos of " << x[i + size_t(l)];
    }
  }
}
#endif
#else
TEST(SimdAvx2, Exp2IsWithinTwoUlpOverTheNormalRange) {
  GTEST_SKIP() << "the build does not target AVX2 with FMA";
}
#endif

}  // namespace
