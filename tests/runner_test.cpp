// run_one's promise: a variant's failure anywhere, its estimates included, is the row's status,
// never an exception.
//
// The test-only variants are registered in the test bodies (once per process, names starting
// "test_"), after the parameterised variant tests have been enumerated.
#include "harness/runner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <utility>

#include "common/error.h"
#include "common/registry.h"
#include "test_util.h"

namespace attnbench {
namespace {

std::atomic<int> g_forward_calls{0};

// Which of its estimates a ThrowingVariant throws from.
enum class Throws { Flops, Memory };

// Throws from one of its estimates; its forward pass only counts that it was called.
class ThrowingVariant final : public Variant {
 public:
  explicit ThrowingVariant(Throws where) : where_(where) {}
  void forward(const Problem&, ConstTensorView, ConstTensorView, ConstTensorView,
               TensorView) override {
    ++g_forward_calls;
  }
  double flops(const Problem&) const override {
    if (where_ == Throws::Flops) throw SpecError("test_flops_throws: no FLOP count for this");
    return 1;
  }
  double memory_estimate(const Problem&) const override {
    if (where_ == Throws::Memory)
      throw UnsupportedError("test_memory_throws: no memory estimate for this");
    return 0;
  }

 private:
  Throws where_;
};

void register_throwing_variants() {
  static const bool once = [] {
    for (auto [name, where] : {std::pair{"test_flops_throws", Throws::Flops},
                               std::pair{"test_memory_throws", Throws::Memory}})
      Registry::instance().add(VariantInfo{.name = name,
                                           .summary = "test-only variant whose estimate throws",
                                           .complexity = "n/a",
                                           .params = {},
                                           .caps = {.causal = true, .cross = true},
                                           .make = [where = where](const ParamValues&) {
                                             return std::make_unique<ThrowingVariant>(where);
                                           }});
    return true;
  }();
  (void)once;
}

Row run_tiny(const std::string& spec) {
  register_throwing_variants();
  auto v = make_variant(spec);
  const Problem p = test::problem(1, 2, 16, 0, 8, false);
  const RunOptions opt{.reps = 1, .min_time = 0};
  Row row;
  EXPECT_NO_THROW(row = run_one(*v, p, Workload{}, nullptr, MachineFigures{}, opt));
  return row;
}

TEST(RunOne, FlopsThatThrowGiveAnErrorRow) {
  const int calls = g_forward_calls;
  const Row row = run_tiny("test_flops_throws");
  EXPECT_EQ(row.status, "error");
  EXPECT_EQ(row.message, "test_flops_throws: no FLOP count for this");
  EXPECT_EQ(row.spec, "test_flops_throws");
  EXPECT_EQ(row.variant, "test_flops_throws");
  EXPECT_EQ(row.problem.n, 16);
  EXPECT_EQ(g_forward_calls, calls) << "the variant ran although its estimate failed";
}

TEST(RunOne, MemoryEstimateThatThrowsGivesARowOfItsKind) {
  const int calls = g_forward_calls;
  const Row row = run_tiny("test_memory_throws");
  EXPECT_EQ(row.status, "unsupported");
  EXPECT_EQ(row.message, "test_memory_throws: no memory estimate for this");
  EXPECT_EQ(row.flops, 1);  // computed before the estimate that failed
  EXPECT_TRUE(std::isnan(row.time_median));
  EXPECT_EQ(g_forward_calls, calls) << "the variant ran although its estimate failed";
}

}  // namespace
}  // namespace attnbench
