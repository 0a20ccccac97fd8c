// run_one's promise: a variant's failure anywhere, its estimates included, is the row's status,
// never an exception.
//
// The test-only variants are registered in the test bodies (once per process, names starting
// "test_"), after the parameterised variant tests have been enumerated.
#include "harness/runner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "common/core/error.h"
#include "common/core/registry.h"
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

// Variant::prepare: the variants whose forward() draws random projections from the seed and
// shapes alone draw them once in prepare(); forward() reuses them only on a problem with the
// same seed, heads and head dimension, and computes exactly what an unprepared forward() does.
TEST(Prepare, PreparedDrawsGiveTheSameOutputAndAreReported) {
  const Problem p = test::problem(2, 3, 40, 50, 16, true, 11);
  const Inputs in = generate_inputs(p);
  for (const std::string spec :
       {"performer", "performer:orthogonal=false,kernel=relu", "rfa", "rfa:gate=true"}) {
    SCOPED_TRACE(spec);
    const Tensor fresh = test::run(spec, p, in);
    auto v = make_variant(spec);
    const double unprepared_flops = v->flops(p);
    Tensor out(p.q_shape());
    v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    EXPECT_EQ(v->notes().find("prepare"), std::string::npos) << "nothing was prepared";
    ASSERT_TRUE(v->prepare(p));
    EXPECT_LE(v->flops(p), unprepared_flops);
    v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    EXPECT_NE(v->notes().find("prepare_s"), std::string::npos) << v->notes();
    EXPECT_EQ(std::memcmp(out.data(), fresh.data(), size_t(out.numel()) * sizeof(float)), 0);
    // another seed (or head dimension) is drawn afresh, never served the prepared draws
    Problem other = p;
    other.seed = 12;
    const Inputs in2 = generate_inputs(other);
    const Tensor fresh2 = test::run(spec, other, in2);
    v->run(other, in2.q.view(), in2.k.view(), in2.v.view(), out.view());
    EXPECT_EQ(v->notes().find("prepare"), std::string::npos) << v->notes();
    EXPECT_EQ(std::memcmp(out.data(), fresh2.data(), size_t(out.numel()) * sizeof(float)), 0);
  }
  // the orthogonal performer's QRs leave its per-pass work once prepared
  auto performer = make_variant("performer");
  const double before = performer->flops(p);
  performer->prepare(p);
  EXPECT_LT(performer->flops(p), before);
}

// linformer keeps E and F (k x m per head) when they fit in its budget: the output is
// bit-identical, a shorter m is served by the kept columns, a longer m or another seed draws
// afresh, and a problem over the budget prepares nothing.
TEST(Prepare, LinformerKeepsItsProjectionsWithinABudget) {
  for (const std::string spec : {"linformer:proj=24", "linformer:proj=24,share_kv=true"}) {
    SCOPED_TRACE(spec);
    Problem p = test::problem(2, 3, 37, 300, 16, false, 5);
    p.key_lengths = {300, 211};
    auto v = make_variant(spec);
    ASSERT_TRUE(v->prepare(p));
    auto same = [&](const Problem& q, bool prepared) {
      SCOPED_TRACE(q.str());
      const Inputs in = generate_inputs(q);
      const Tensor fresh = test::run(spec, q, in);
      Tensor out(q.q_shape());
      v->run(q, in.q.view(), in.k.view(), in.v.view(), out.view());
      EXPECT_EQ(v->notes().find("prepare_s") != std::string::npos, prepared) << v->notes();
      EXPECT_EQ(std::memcmp(out.data(), fresh.data(), size_t(out.numel()) * sizeof(float)), 0);
    };
    same(p, true);
    Problem shorter = p;
    shorter.m = 257, shorter.key_lengths = {};
    same(shorter, true);
    Problem longer = p;
    longer.m = 301;
    same(longer, false);
    Problem reseeded = p;
    reseeded.seed = 6;
    same(reseeded, false);
    // 8 heads x 2^17 keys x 24 x 4 bytes (x 2 without share_kv) is over the 64 MiB budget
    Problem big = test::problem(1, 8, 16, int64_t(1) << 17, 16, false, 5);
    EXPECT_FALSE(v->prepare(big));
  }
}

TEST(Prepare, RunOneReportsThePreparationTime) {
  const Problem p = test::problem(1, 2, 32, 0, 8, false);
  const RunOptions opt{.reps = 1, .min_time = 0};
  auto performer = make_variant("performer");
  const Row row = run_one(*performer, p, Workload{}, nullptr, MachineFigures{}, opt);
  ASSERT_EQ(row.status, "ok") << row.message;
  EXPECT_GT(row.prepare_seconds, 0.0);
  EXPECT_TRUE(to_json(row)["prepare_s"].is_number());
  EXPECT_NE(row.notes.find("prepare_s"), std::string::npos) << row.notes;
  EXPECT_EQ(row.flops, performer->flops(p)) << "the per-pass work leaves the preparation out";
  // a variant with nothing to prepare: no time, a null column, no note
  auto flash = make_variant("flash");
  const Row plain = run_one(*flash, p, Workload{}, nullptr, MachineFigures{}, opt);
  ASSERT_EQ(plain.status, "ok") << plain.message;
  EXPECT_TRUE(std::isnan(plain.prepare_seconds));
  EXPECT_TRUE(to_json(plain)["prepare_s"].is_null());
  EXPECT_EQ(plain.notes.find("prepare"), std::string::npos);
}

}  // namespace
}  // namespace attnbench
