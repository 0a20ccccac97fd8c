// Every parameter of every registered variant at and past the ends of its range: a value out
// of range (or not a value of its type) is refused with SpecError when the variant is made;
// a value in range either makes a variant whose estimates on a small problem do not throw, or
// is refused at make with SpecError; nothing of another type comes later. Plus the
// regressions of the reliability issue (items 9, 13, 15) and OmpGuard.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::error_message;
using test::problem;

std::string int_text(double x) { return std::to_string(int64_t(x)); }

struct Values {
  std::vector<std::string> in_range, refused;
};

// Boundary values of one parameter: in range (min, max, the default, each choice) and out of
// range or of the wrong type.
Values values_of(const ParamSpec& ps) {
  Values v;
  v.in_range.push_back(ps.default_value);
  switch (ps.type) {
    case ParamType::Int:
      v.in_range.insert(v.in_range.end(), {int_text(ps.min), int_text(ps.max)});
      v.refused = {int_text(ps.min - 1),  int_text(ps.max + 1), "abc", "1.5", "1e3", "0x10", " 1",
                   "99999999999999999999"};
      break;
    case ParamType::Float:
      v.in_range.insert(v.in_range.end(), {fmt::format("{}", ps.min), fmt::format("{}", ps.max)});
      v.refused = {fmt::format("{}", ps.min - std::max(1.0, std::abs(ps.min))),
                   fmt::format("{}", ps.max + std::max(1.0, std::abs(ps.max))),
                   "abc",
                   "inf",
                   "nan",
                   "1e-310",
                   "1e-400",
                   "1e400",
                   "1.5.2"};
      break;
    case ParamType::Bool:
      v.in_range.insert(v.in_range.end(), {"true", "false", "0", "1", "on", "off"});
      v.refused = {"maybe", "2", "TRUE "};
      break;
    case ParamType::Choice:
      v.in_range.insert(v.in_range.end(), ps.choices.begin(), ps.choices.end());
      v.refused = {"no_such_choice", ps.choices.front() + "x"};
      break;
    case ParamType::IntList:
      v.in_range.insert(v.in_range.end(), {"none", int_text(ps.min), int_text(ps.max),
                                           int_text(ps.min) + "+" + int_text(ps.max)});
      v.refused = {int_text(ps.min - 1),
                   int_text(ps.max + 1),
                   int_text(ps.min) + "+" + int_text(ps.max + 1),
                   "a",
                   "1++2",
                   "+1",
                   "1+",
                   "1.5",
                   "99999999999999999999"};
      break;
  }
  return v;
}

// Small problems the variant supports: self-attention (causal if it must be), causal and m != n
// if it can.
std::vector<Problem> small_problems(const VariantInfo& info) {
  std::vector<Problem> ps;
  if (!info.caps.causal_only) ps.push_back(problem(1, 2, 64, 0, 16, false));
  if (info.caps.causal) ps.push_back(problem(1, 2, 37, 0, 16, true));
  if (info.caps.cross) ps.push_back(problem(2, 1, 29, 71, 8, info.caps.causal_only));
  return ps;
}

// The estimates of a made variant must not throw and must be finite and non-negative; if the
// working memory is small, the forward pass must run too, or refuse the problem with an
// UnsupportedError that names the parameter `param` whose value rules it out (rfa:gate=true is
// causal only, which the capabilities of the variant as a whole cannot say).
void check_made(Variant& v, const VariantInfo& info, const std::string& param) {
  for (const Problem& p : small_problems(info)) {
    SCOPED_TRACE(p.str());
    double flops = -1, bytes = -1;
    try {
      flops = v.flops(p);
      bytes = v.memory_estimate(p);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "an estimate threw: " << e.what();
      continue;
    }
    EXPECT_TRUE(std::isfinite(flops) && flops >= 0) << flops;
    EXPECT_TRUE(std::isfinite(bytes) && bytes >= 0) << bytes;
    if (bytes > double(64 << 20)) continue;  // the harness would refuse or skip; so do we
    const Inputs in = generate_inputs(p);
    Tensor out(p.q_shape());
    try {
      v.run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    } catch (const UnsupportedError& e) {
      EXPECT_NE(std::string(e.what()).find(param + "="), std::string::npos)
          << "refused without naming the parameter: " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "forward threw: " << e.what();
    }
  }
}

// One case per registered variant (plugins' included), so `--gtest_filter='*/NAME'` picks a
// variant's.
class VariantParamBounds : public testing::TestWithParam<std::string> {};

TEST_P(VariantParamBounds, BoundaryAndOutOfRangeValues) {
  test::ScopedThreads threads(2);
  const VariantInfo* info = Registry::instance().find(GetParam());
  ASSERT_NE(info, nullptr);
  for (const ParamSpec& ps : info->params) {
    const Values vals = values_of(ps);
    for (const std::string& value : vals.refused) {
      const std::string spec = fmt::format("{}:{}={}", info->name, ps.name, value);
      SCOPED_TRACE(spec);
      const std::string msg = error_message<SpecError>([&] { make_variant(spec); });
      if (!msg.empty()) {  // names the parameter, the value and what is accepted
        EXPECT_NE(msg.find("'" + ps.name + "'"), std::string::npos) << msg;
        EXPECT_NE(msg.find("'" + value + "'"), std::string::npos) << msg;
        EXPECT_NE(msg.find("accepted: " + ps.accepted()), std::string::npos) << msg;
      }
    }
    for (const std::string& value : vals.in_range) {
      const std::string spec = fmt::format("{}:{}={}", info->name, ps.name, value);
      SCOPED_TRACE(spec);
      std::unique_ptr<Variant> v;
      try {
        v = make_variant(spec);
      } catch (const SpecError& e) {
        // refused when made: allowed, if it says which parameter
        EXPECT_NE(std::string(e.what()).find(ps.name), std::string::npos) << e.what();
        continue;
      } catch (const std::exception& e) {
        ADD_FAILURE() << "make threw something other than SpecError: " << e.what();
        continue;
      }
      // the canonical spec makes the same variant again
      EXPECT_NO_THROW(make_variant(v->spec())) << v->spec();
      check_made(*v, *info, ps.name);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, VariantParamBounds, testing::ValuesIn(test::variant_names()),
                         test::spec_test_name);

// Item 9: reformer checks its buckets when it is made, not when its FLOPs are estimated.
TEST(VariantParams, ReformerOddBucketsRefusedWhenMade) {
  for (const char* spec : {"reformer:buckets=3", "reformer:buckets=2+5", "reformer:buckets=7"}) {
    SCOPED_TRACE(spec);
    const std::string msg = error_message<SpecError>([&] { make_variant(spec); });
    EXPECT_NE(msg.find("'buckets'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1 (no hashing) or even"), std::string::npos) << msg;
  }
  // factors of 1 and even factors are fine, and their estimates do not throw
  auto v = make_variant("reformer:buckets=1+2+64");
  const Problem p = problem(1, 2, 128, 0, 16, false);
  EXPECT_NO_THROW(v->flops(p));
  EXPECT_NO_THROW(v->memory_estimate(p));
}

// Item 13: the product of the bucket factors is bounded when the variant is made (it once
// overflowed and indexed past the sort's counters, or threw length_error in an OpenMP region).
TEST(VariantParams, ReformerBucketProductBoundedWhenMade) {
  for (const char* spec : {"reformer:buckets=2+4+8+16+32+64+128+256+512+1024+2048,hashes=1",
                           "reformer:buckets=16777216+16777214+16777212"}) {
    SCOPED_TRACE(spec);
    const std::string msg = error_message<SpecError>([&] { make_variant(spec); });
    EXPECT_NE(msg.find("'buckets'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("at most 16777216"), std::string::npos) << msg;
  }
  // the largest product is accepted; its estimates say how much memory it needs, so the
  // harness refuses it on a machine that cannot hold it
  auto v = make_variant("reformer:buckets=2048+8192,hashes=1");  // (a list is deduplicated)
  const Problem p = problem(1, 1, 64, 0, 16, false);
  EXPECT_NO_THROW(v->flops(p));
  EXPECT_GE(v->memory_estimate(p), 4.0 * double(1 << 24));
}

// Item 15: a float accepted when the spec is read can always be read back; subnormal and
// underflowing values are refused with the accepted range.
TEST(VariantParams, FloatsReadBackWhatTheParserAccepted) {
  for (const char* spec : {"linear:eps=1e-310", "linear:eps=4.9e-324", "linear:eps=1e-400"}) {
    SCOPED_TRACE(spec);
    const std::string msg = error_message<SpecError>([&] { make_variant(spec); });
    EXPECT_NE(msg.find("'eps'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("subnormal"), std::string::npos) << msg;
  }
  for (const char* value : {"0", "1e-300", "2.2250738585072014e-308", "0.5", "1"}) {
    SCOPED_TRACE(value);
    auto v = make_variant(fmt::format("linear:eps={}", value));
    EXPECT_EQ(v->params().get_float("eps"), std::stod(value));
  }
}

// The getters read with the parser the spec was read with, and throw SpecError (never
// std::invalid_argument or std::out_of_range) on text it would not have accepted.
TEST(VariantParams, GettersThrowSpecErrorOnUnreadableText) {
  ParamValues pv;
  pv.values = {{"i", "12x"}, {"f", "1e-310"}, {"l", "1+x"}, {"big", "99999999999999999999"}};
  EXPECT_THROW(pv.get_int("i"), SpecError);
  EXPECT_THROW(pv.get_int("big"), SpecError);
  EXPECT_THROW(pv.get_float("f"), SpecError);
  EXPECT_THROW(pv.get_int_list("l"), SpecError);
  EXPECT_THROW(pv.get_int("missing"), SpecError);
  pv.values = {{"i", "-7"}, {"f", "0.25"}, {"l", "1+5+9"}, {"n", "none"}};
  EXPECT_EQ(pv.get_int("i"), -7);
  EXPECT_EQ(pv.get_float("f"), 0.25);
  EXPECT_EQ(pv.get_int_list("l"), (std::vector<int64_t>{1, 5, 9}));
  EXPECT_TRUE(pv.get_int_list("n").empty());
}

// OmpGuard: an exception thrown on a worker thread comes out after the region, the first
// one only, and the region ends normally (no std::terminate).
TEST(OmpGuard, CarriesTheFirstExceptionOutOfTheRegion) {
  test::ScopedThreads threads(2);
  OmpGuard guard;
  std::atomic<int> ran{0};
#pragma omp parallel
  {
    std::vector<int> buf;
    guard.run([&] { buf.resize(4); });
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < 100; ++i)
      guard.run([&] {
        ran.fetch_add(1);
        if (i == 10) throw std::length_error("task 10");
      });
  }
  EXPECT_TRUE(guard.failed());
  EXPECT_LE(ran.load(), 100);
  try {
    guard.rethrow();
    ADD_FAILURE() << "nothing rethrown";
  } catch (const std::length_error& e) {
    EXPECT_STREQ(e.what(), "task 10");
  }
}

TEST(OmpGuard, NestedRegionsAndNoFailure) {
  test::ScopedThreads threads(2);
  OmpGuard outer;
#pragma omp parallel
  {
#pragma omp for
    for (int i = 0; i < 4; ++i)
      outer.run([&] {
        OmpGuard inner;
#pragma omp parallel for
        for (int j = 0; j < 4; ++j)
          inner.run([&] {
            if (i == 2 && j == 3) throw SpecError("inner");
          });
        inner.rethrow();
      });
  }
  EXPECT_THROW(outer.rethrow(), SpecError);

  OmpGuard fine;
  int sum = 0;
#pragma omp parallel for reduction(+ : sum)
  for (int i = 0; i < 10; ++i) fine.run([&] { sum += i; });
  EXPECT_FALSE(fine.failed());
  EXPECT_NO_THROW(fine.rethrow());
  EXPECT_EQ(sum, 45);
}

}  // namespace
}  // namespace attnbench
