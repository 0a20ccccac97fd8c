// The hand-vectorised elementary functions of common/simd.h against double precision, over
// their whole documented range, including the edges (underflow to 0, overflow to inf, NaN).
#include "common/simd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

/// Distance in units of the float spacing at the reference value (at least the smallest
/// normal's, so that results near 0 are judged on an absolute scale).
double ulps(float got, double want) {
  const double spacing = std::max(std::ldexp(std::abs(want), -23), double(FLT_MIN) * 0x1p-23);
  return std::abs(double(got) - want) / spacing;
}

/// Evenly spaced points of [lo, hi] plus their neighbours in float.
std::vector<float> grid(float lo, float hi, int count) {
  std::vector<float> x;
  for (int i = 0; i <= count; ++i) {
    const float v = lo + (hi - lo) * float(i) / float(count);
    x.push_back(v);
    x.push_back(std::nextafter(v, hi));
  }
  while (x.size() % 16 != 0) x.push_back(lo);
  return x;
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

TEST(SimdAvx2, SincosIsWithinAFewUlpOfTheArgumentsAngle) {
  // float arguments up to the limit; the error is judged against the value a float
  // argument's sine has (absolute near the zeros, as the reduction of a float x is exact to
  // about 2^-24 of pi/2 at most)
  const std::vector<float> x = grid(-v8::kSincosLimit, v8::kSincosLimit, 200000);
  std::vector<float> s(x.size()), c(x.size());
  for (size_t i = 0; i < x.size(); i += 8) {
    __m256 sv, cv;
    v8::sincos_ps(_mm256_loadu_ps(&x[i]), sv, cv);
    _mm256_storeu_ps(&s[i], sv);
    _mm256_storeu_ps(&c[i], cv);
  }
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, std::abs(double(s[i]) - std::sin(double(x[i]))));
    worst = std::max(worst, std::abs(double(c[i]) - std::cos(double(x[i]))));
  }
  EXPECT_LE(worst, 3e-7);
  // small arguments keep their relative accuracy: sin x ~ x
  const std::vector<float> small = grid(-0.75f, 0.75f, 3000);
  double worst_rel = 0;
  for (size_t i = 0; i < small.size(); i += 8) {
    __m256 sv, cv;
    v8::sincos_ps(_mm256_loadu_ps(&small[i]), sv, cv);
    float sa[8], ca[8];
    _mm256_storeu_ps(sa, sv);
    _mm256_storeu_ps(ca, cv);
    for (int l = 0; l < 8; ++l) {
      const double a = double(small[i + size_t(l)]);
      if (a != 0) worst_rel = std::max(worst_rel, ulps(sa[l], std::sin(a)));
      worst_rel = std::max(worst_rel, ulps(ca[l], std::cos(a)));
    }
  }
  EXPECT_LE(worst_rel, 3.0);
}
#else
TEST(SimdAvx2, Exp2IsWithinTwoUlpOverTheNormalRange) {
  GTEST_SKIP() << "the build does not target AVX2 with FMA";
}
#endif

}  // namespace
