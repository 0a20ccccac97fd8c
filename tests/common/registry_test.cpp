// Spec strings, the variant registry and parse_int_list.
//
// The registry is a process-wide singleton, so test-only variants are registered into it with
// names starting "test_" (and parameters starting "test_"), each once per process. They are
// added inside test bodies, after the parameterised variant tests have been enumerated, so the
// exactness tests never see them.
#include "common/core/registry.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/io/inputs.h"
#include "common/reference/reference.h"
#include "harness/cli.h"
#include "test_util.h"

namespace attnbench {
namespace {

template <class F>
std::string spec_error(F&& f) {
  return test::error_message<SpecError>(std::forward<F>(f));
}

// A correct but slow variant for the registry tests: copies the reference.
std::atomic<int> g_forward_calls{0};
class ReferenceVariant final : public Variant {
 public:
  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    ++g_forward_calls;
    auto ref = reference_attention(p, q, k, v);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t i = 0; i < p.n; ++i)
          for (int64_t c = 0; c < p.dim; ++c)
            out.row(b, h, i)[c] = float(ref[size_t(((b * p.heads + h) * p.n + i) * p.dim + c)]);
  }
  double flops(const Problem&) const override { return 1; }
  double memory_estimate(const Problem&) const override { return 0; }
};

VariantInfo test_info(std::string name, std::vector<ParamSpec> params = {},
                      Capabilities caps = {.causal = true, .cross = true}) {
  return VariantInfo{
      .name = std::move(name),
      .summary = "test-only variant",
      .complexity = "n/a",
      .params = std::move(params),
      .caps = caps,
      .make = [](const ParamValues&) { return std::make_unique<ReferenceVariant>(); }};
}

// Test-only variants used by several tests, registered once per process.
void register_test_variants() {
  static const bool once = [] {
    Registry::instance().add(test_info("test_caps_none", {}, {.causal = false, .cross = false}));
    Registry::instance().add(test_info(
        "test_params", {ParamSpec::Int("test_count", 3, -5, 10, "an int"),
                        ParamSpec::Float("test_alpha", 0.5, 0.0, 1.0, "a float"),
                        ParamSpec::Bool("test_flag", false, "a bool"),
                        ParamSpec::Choice("test_mode", "fast", {"fast", "slow"}, "a choice")}));
    return true;
  }();
  (void)once;
}

// ----- canonical specs -----

TEST(Registry, CanonicalSpec) {
  const VariantInfo* flash = Registry::instance().find("flash");
  ASSERT_NE(flash, nullptr);
  ASSERT_EQ(flash->params.size(), 2u);
  ASSERT_EQ(flash->params[0].name, "block_q");
  const std::string dq = flash->params[0].default_value, dk = flash->params[1].default_value;
  EXPECT_EQ(make_variant("flash")->spec(), "flash:block_q=" + dq + ",block_k=" + dk);
  EXPECT_EQ(make_variant("flash:block_k=128")->spec(), "flash:block_q=" + dq + ",block_k=128");
  // declared order, whatever the order given; numbers in canonical form
  EXPECT_EQ(make_variant("flash:block_k=128,block_q=32")->spec(), "flash:block_q=32,block_k=128");
  EXPECT_EQ(make_variant("flash:block_q=0032")->spec(), "flash:block_q=32,block_k=" + dk);
  EXPECT_EQ(make_variant("full")->spec(), "full");
  // the canonical spec builds the same variant again
  auto v = make_variant("flash:block_q=7,block_k=13");
  EXPECT_EQ(make_variant(v->spec())->spec(), v->spec());
  EXPECT_EQ(v->params().get_int("block_q"), 7);
  EXPECT_EQ(v->params().get_int("block_k"), 13);
  EXPECT_EQ(v->info().name, "flash");
  EXPECT_THROW(v->params().text("block_x"), SpecError);
}

TEST(Registry, TypedParameters) {
  register_test_variants();
  auto v = make_variant("test_params");
  EXPECT_EQ(v->spec(), "test_params:test_count=3,test_alpha=0.5,test_flag=false,test_mode=fast");
  v = make_variant("test_params:test_mode=slow,test_flag=on,test_alpha=0.250,test_count=-5");
  EXPECT_EQ(v->spec(), "test_params:test_count=-5,test_alpha=0.25,test_flag=true,test_mode=slow");
  EXPECT_EQ(v->params().get_int("test_count"), -5);
  EXPECT_DOUBLE_EQ(v->params().get_float("test_alpha"), 0.25);
  EXPECT_TRUE(v->params().get_bool("test_flag"));
  EXPECT_EQ(v->params().get_choice("test_mode"), "slow");
  EXPECT_EQ(make_variant("test_params:test_alpha=1e-1")->params().text("test_alpha"), "0.1");
  EXPECT_FALSE(make_variant("test_params:test_flag=0")->params().get_bool("test_flag"));

  EXPECT_CONTAINS(spec_error([] { make_variant("test_params:test_alpha=1.5"); }), "[0, 1]");
  EXPECT_CONTAINS(spec_error([] { make_variant("test_params:test_alpha=nan"); }), "[0, 1]");
  EXPECT_CONTAINS(spec_error([] { make_variant("test_params:test_alpha=inf"); }), "test_alpha");
  EXPECT_CONTAINS(spec_error([] { make_variant("test_params:test_alpha=0.5x"); }), "test_alpha");
  EXPECT_CONTAINS(spec_error([] { make_variant("test_params:test_flag=maybe"); }), "true|false");
  EXPECT_CONTAINS(spec_error([] { make_variant("test_params:test_mode=medium"); }), "fast|slow");
  EXPECT_CONTAINS(spec_error([] { make_variant("test_params:test_count=11"); }), "[-5, 10]");
  EXPECT_CONTAINS(spec_error([] { make_variant("test_params:test_count=-6"); }), "[-5, 10]");
}

// ----- errors -----

TEST(Registry, UnknownVariantListsTheRegisteredNames) {
  const std::string msg = spec_error([] { make_variant("nosuch"); });
  EXPECT_CONTAINS(msg, "nosuch");
  ASSERT_FALSE(Registry::instance().all().empty());
  for (const VariantInfo* v : Registry::instance().all()) EXPECT_CONTAINS(msg, v->name);
  EXPECT_CONTAINS(spec_error([] { make_variant("nosuch:block_q=3"); }), "flash");
  EXPECT_CONTAINS(spec_error([] { make_variant("Flash"); }), "Flash");
}

TEST(Registry, UnknownKeyListsTheVariantsParameters) {
  const std::string msg = spec_error([] { make_variant("flash:block_x=3"); });
  EXPECT_CONTAINS(msg, "block_x");
  EXPECT_CONTAINS(msg, "block_q");
  EXPECT_CONTAINS(msg, "block_k");
  EXPECT_CONTAINS(spec_error([] { make_variant("full:block_q=3"); }), "(none)");
}

TEST(Registry, MalformedSpecs) {
  for (const char* spec : {"", ":", "flash:", "flash:block_q", "flash:block_q=", "flash:=3",
                           "flash:block_q=1,block_q=2", "flash:block_q=1,", "flash:,block_q=1",
                           ":block_q=1", "fla,sh", "flash:block_q=1,,block_k=2"}) {
    SCOPED_TRACE(std::string("spec '") + spec + "'");
    EXPECT_THROW(parse_spec(spec), SpecError);
    const std::string msg = spec_error([&] { make_variant(spec); });
    EXPECT_CONTAINS(msg, "malformed");
  }
}

TEST(Registry, ParseSpecSplitsInOrder) {
  auto [name, kv] = parse_spec("flash:block_k=2,block_q=1");
  EXPECT_EQ(name, "flash");
  ASSERT_EQ(kv.size(), 2u);
  EXPECT_EQ(kv[0], (std::pair<std::string, std::string>{"block_k", "2"}));
  EXPECT_EQ(kv[1], (std::pair<std::string, std::string>{"block_q", "1"}));
  auto [name2, kv2] = parse_spec("anything");
  EXPECT_EQ(name2, "anything");
  EXPECT_TRUE(kv2.empty());
}

TEST(Registry, OutOfRangeAndNonNumericValuesMentionTheRange) {
  const ParamSpec& bq = Registry::instance().find("flash")->params[0];
  const std::string range =
      "[" + std::to_string(int64_t(bq.min)) + ", " + std::to_string(int64_t(bq.max)) + "]";
  ASSERT_EQ(range, "[1, 4096]");
  for (const char* spec :
       {"flash:block_q=0", "flash:block_q=4097", "flash:block_q=-1", "flash:block_q=abc",
        "flash:block_q=1.5", "flash:block_q=1e3", "flash:block_q= 8", "flash:block_q=+8",
        "flash:block_q=0x10", "flash:block_q=99999999999999999999999"}) {
    SCOPED_TRACE(spec);
    const std::string msg = spec_error([&] { make_variant(spec); });
    EXPECT_CONTAINS(msg, range);
    EXPECT_CONTAINS(msg, "block_q");
  }
  EXPECT_NO_THROW(make_variant("flash:block_q=1"));
  EXPECT_NO_THROW(make_variant("flash:block_q=4096"));
}

TEST(Registry, ParameterTypeClashIsRejected) {
  // block_q is an int in flash; a float block_q anywhere else is refused
  const std::string msg = spec_error([] {
    Registry::instance().add(
        test_info("test_typeclash_a", {ParamSpec::Float("block_q", 1.0, 0.0, 2.0, "clash")}));
  });
  EXPECT_CONTAINS(msg, "block_q");
  EXPECT_EQ(Registry::instance().find("test_typeclash_a"), nullptr);
  // the same name with the same type is fine
  EXPECT_NO_THROW(Registry::instance().add(
      test_info("test_typeclash_b", {ParamSpec::Int("block_q", 8, 1, 64, "same type")})));
  EXPECT_NE(Registry::instance().find("test_typeclash_b"), nullptr);
  EXPECT_THROW(Registry::instance().add(test_info(
                   "test_typeclash_c", {ParamSpec::Choice("block_q", "a", {"a", "b"}, "clash")})),
               SpecError);
  EXPECT_EQ(Registry::instance().find("test_typeclash_c"), nullptr);
}

// A rejected variant leaves no parameter types behind: test_leak_b must not be refused with
// "it is int in another variant" because a rejected variant once declared test_leak_param.
TEST(Registry, RejectedVariantLeavesNoParameterTypesBehind) {
  // test_leak_a is refused (its block_q clashes with flash's), so nothing of it should stay:
  // in particular its other parameter test_leak_param must not now be typed as int.
  EXPECT_THROW(Registry::instance().add(
                   test_info("test_leak_a", {ParamSpec::Int("test_leak_param", 1, 0, 9, "first"),
                                             ParamSpec::Float("block_q", 1.0, 0.0, 2.0, "clash")})),
               SpecError);
  EXPECT_EQ(Registry::instance().find("test_leak_a"), nullptr);
  // no registered variant declares test_leak_param, so a float of that name is fine
  EXPECT_NO_THROW(Registry::instance().add(
      test_info("test_leak_b", {ParamSpec::Float("test_leak_param", 0.5, 0.0, 1.0, "second")})));
}

TEST(Registry, DuplicateAndInvalidNamesAreRejected) {
  EXPECT_CONTAINS(spec_error([] { Registry::instance().add(test_info("flash")); }), "flash");
  // the original flash survives the attempt
  EXPECT_EQ(Registry::instance().find("flash")->params.size(), 2u);
  EXPECT_NO_THROW(Registry::instance().add(test_info("test_dup")));
  EXPECT_THROW(Registry::instance().add(test_info("test_dup")), SpecError);
  for (const char* bad : {"", "test:x", "test,x", "test=x", "test x"})
    EXPECT_THROW(Registry::instance().add(test_info(bad)), SpecError) << "'" << bad << "'";
  // a parameter declared twice, or with a default outside its own range
  EXPECT_THROW(
      Registry::instance().add(test_info("test_twice", {ParamSpec::Int("test_p2", 1, 0, 9, ""),
                                                        ParamSpec::Int("test_p2", 2, 0, 9, "")})),
      SpecError);
  EXPECT_THROW(Registry::instance().add(
                   test_info("test_bad_default", {ParamSpec::Int("test_p3", 0, 1, 9, "")})),
               SpecError);
  EXPECT_EQ(Registry::instance().find("test_twice"), nullptr);
  EXPECT_EQ(Registry::instance().find("test_bad_default"), nullptr);
}

TEST(Registry, AllIsSortedAndFindWorks) {
  register_test_variants();
  auto all = Registry::instance().all();
  ASSERT_GE(all.size(), 2u);
  EXPECT_TRUE(
      std::is_sorted(all.begin(), all.end(), [](auto* a, auto* b) { return a->name < b->name; }));
  EXPECT_NE(Registry::instance().find("full"), nullptr);
  EXPECT_NE(Registry::instance().find("test_caps_none"), nullptr);
  EXPECT_EQ(Registry::instance().find("ful"), nullptr);
  EXPECT_EQ(Registry::instance().find(""), nullptr);
  const std::string names = Registry::instance().names();
  std::string joined;
  for (const VariantInfo* v : all) joined += (joined.empty() ? "" : ", ") + v->name;
  EXPECT_EQ(names, joined);
  for (const VariantInfo* v : all) {
    EXPECT_TRUE(v->make) << v->name;
    EXPECT_FALSE(v->summary.empty()) << v->name;
  }
}

// ----- capabilities -----

TEST(Registry, CheckSupportedFollowsCapabilities) {
  register_test_variants();
  auto v = make_variant("test_caps_none");
  Problem p;
  p.batch = 1, p.heads = 1, p.n = 8, p.m = 0, p.dim = 4;
  EXPECT_NO_THROW(v->check_supported(p));
  p.m = 8;  // m given explicitly but equal to n: still self-attention
  EXPECT_NO_THROW(v->check_supported(p));

  Problem causal = p;
  causal.causal = true;
  EXPECT_THROW(v->check_supported(causal), UnsupportedError);
  Problem cross = p;
  cross.m = 9;
  EXPECT_THROW(v->check_supported(cross), UnsupportedError);

  // run() refuses before computing anything
  Inputs in = generate_inputs(causal);
  Tensor out(causal.q_shape());
  const int calls = g_forward_calls;
  EXPECT_THROW(v->run(causal, in.q.view(), in.k.view(), in.v.view(), out.view()), UnsupportedError);
  Inputs in2 = generate_inputs(cross);
  Tensor out2(cross.q_shape());
  EXPECT_THROW(v->run(cross, in2.q.view(), in2.k.view(), in2.v.view(), out2.view()),
               UnsupportedError);
  EXPECT_EQ(g_forward_calls, calls);
  EXPECT_NO_THROW(v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()));
  EXPECT_EQ(g_forward_calls, calls + 1);

  // full and flash claim both capabilities
  for (const char* name : {"full", "flash"}) {
    auto f = make_variant(name);
    EXPECT_NO_THROW(f->check_supported(causal)) << name;
    EXPECT_NO_THROW(f->check_supported(cross)) << name;
  }
}

// ----- parse_int_list -----

TEST(ParseIntList, ListsAndRanges) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(parse_int_list("256..2048", "--seq"), (V{256, 512, 1024, 2048}));
  EXPECT_EQ(parse_int_list("100,256..512", "--seq"), (V{100, 256, 512}));
  EXPECT_EQ(parse_int_list("7", "--seq"), (V{7}));
  EXPECT_EQ(parse_int_list("1..1", "--seq"), (V{1}));
  EXPECT_EQ(parse_int_list("3..24", "--seq"), (V{3, 6, 12, 24}));
  EXPECT_EQ(parse_int_list("256..8192", "--seq"), (V{256, 512, 1024, 2048, 4096, 8192}));
  EXPECT_EQ(parse_int_list("64,32", "--seq"), (V{64, 32}));
  EXPECT_EQ(parse_int_list("1..4,1000", "--seq"), (V{1, 2, 4, 1000}));
  // step rules: every value up to the end, the end itself when it is reached
  EXPECT_EQ(parse_int_list("256..5000:x2", "--seq"), (V{256, 512, 1024, 2048, 4096}));
  EXPECT_EQ(parse_int_list("3..20:x2", "--seq"), (V{3, 6, 12}));
  EXPECT_EQ(parse_int_list("1..81:x3", "--seq"), (V{1, 3, 9, 27, 81}));
  EXPECT_EQ(parse_int_list("256..1000:+256", "--seq"), (V{256, 512, 768}));
  EXPECT_EQ(parse_int_list("256..1024:+256", "--seq"), (V{256, 512, 768, 1024}));
  EXPECT_EQ(parse_int_list("5..5:+3,7..7:x2", "--seq"), (V{5, 7}));
  EXPECT_EQ(parse_int_list("1..2147483647:x65536", "--seq"), (V{1, 65536}));
  EXPECT_EQ(parse_int_list("2147483000..2147483647:+600", "--seq"), (V{2147483000, 2147483600}));
  EXPECT_EQ(parse_int_list("1..10000:+1", "--seq").size(), 10000u);
  // --seq-k: `same` is m = n, written 0
  EXPECT_EQ(parse_seq_k_list("same,64..256:x4"), (V{0, 64, 256}));
}

TEST(ParseIntList, Errors) {
  std::vector<std::string> all;
  for (const char* bad : {"", "a", "0", "10..5", "1,,2", "1,", ",1", "-5", "1..", "..4", "1...4",
                          "1.5", " 1", "1 ,2", "0..4", "99999999999999999999999", "same"})
    all.push_back(bad);
  // ranges: inexact doubling, malformed step rules, too many values
  for (const char* bad :
       {"3..20", "256..5000", "1..8:", "1..8:x", "1..8:x1", "1..8:x0", "1..8:+0", "1..8:-1",
        "1..8:*2", "1..8:x1.5", "1..8:+2:+2", "1..10001:+1", "1..9999:+1,1..2:+1"})
    all.push_back(bad);
  for (const std::string& bad : all) {
    SCOPED_TRACE("'" + bad + "'");
    try {
      parse_int_list(bad, "--seq");
      ADD_FAILURE() << "accepted";
    } catch (const UsageError& e) {
      EXPECT_CONTAINS(std::string(e.what()), "--seq");
      EXPECT_CONTAINS(std::string(e.what()), "A..B:+S");  // the accepted forms
    }
  }
  // an inexact doubling range names both ways to write what was meant
  try {
    parse_int_list("128,256..5000", "--seq");
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_CONTAINS(std::string(e.what()), "256..5000, which does not reach 5000 by doubling");
    EXPECT_CONTAINS(std::string(e.what()), "256..5000:x2 to stop at 4096");
    EXPECT_CONTAINS(std::string(e.what()), "256..5000:+256");
  }
  try {
    parse_seq_k_list("same,sometimes");
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_CONTAINS(std::string(e.what()), "--seq-k");
    EXPECT_CONTAINS(std::string(e.what()), "sometimes");
    EXPECT_CONTAINS(std::string(e.what()), "same (m = n)");
  }
}

// Exit code of a check run in a death-test child: parse_int_list(text) must either refuse the
// text with a UsageError or return the powers of two from 1 up to at most `hi`. The child's
// address space is capped and an alarm set, so a runaway list cannot take the machine down.
int check_huge_range(const char* text, int64_t hi) {
  struct rlimit rl = {rlim_t(2) << 30, rlim_t(2) << 30};
  setrlimit(RLIMIT_AS, &rl);
  alarm(30);
  try {
    auto v = parse_int_list(text, "--seq");
    if (v.empty() || v.size() > 64 || v[0] != 1) return 3;
    for (size_t i = 1; i < v.size(); ++i)
      if (v[i] <= 0 || v[i] != 2 * v[i - 1]) return 4;
    if (v.back() > hi || v.back() <= hi / 2) return 5;  // the last power of two <= hi
    return 0;
  } catch (const UsageError&) {
    return 0;
  } catch (const std::bad_alloc&) {
    return 6;
  } catch (...) {
    return 7;
  }
}

TEST(ParseIntListDeathTest, LargeRangeInAChild) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(
      "the child caps its address space (RLIMIT_AS) below what AddressSanitizer reserves");
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(check_huge_range("1..1048576", 1 << 20)), testing::ExitedWithCode(0), "");
  // a step of 1 over the whole int32 range is refused before its values are listed
  EXPECT_EXIT(std::exit(check_huge_range("1..2147483647:+1", 1)), testing::ExitedWithCode(0), "");
  EXPECT_EXIT(std::exit(check_huge_range("1..4611686018427387903", (int64_t(1) << 62) - 1)),
              testing::ExitedWithCode(0), "");
}

// A..B with B near the int64 limit must stop before the doubling overflows (it once grew the
// list until std::bad_alloc).
TEST(ParseIntListDeathTest, RangeEndNearInt64MaxDoesNotOverflow) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(
      "the child caps its address space (RLIMIT_AS) below what AddressSanitizer reserves");
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // doubling 2^62 overflows int64: the loop must stop at the end of the range anyway
  EXPECT_EXIT(std::exit(check_huge_range("1..9223372036854775807", INT64_MAX)),
              testing::ExitedWithCode(0), "");
  EXPECT_EXIT(std::exit(check_huge_range("1..4611686018427387904", int64_t(1) << 62)),
              testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace attnbench
