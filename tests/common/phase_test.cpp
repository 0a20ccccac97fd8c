// Phases of a forward pass (common/core/phase.h): the sink sees every phase a variant marks, from
// any thread, and nothing once removed; run_one writes the phase times into the row.
#include "common/core/phase.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "harness/results.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

// Counts the phases it is told about, by name.
class CountingSink final : public PhaseSink {
 public:
  double begin(const char*) override { return 42.0; }
  void end(const char* name, double mark) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++ends[name];
    if (mark != 42.0) ++bad_marks;
  }
  std::mutex mutex_;
  std::map<std::string, int> ends;
  int bad_marks = 0;
};

TEST(Phase, ReachesTheInstalledSinkFromEveryThread) {
  ASSERT_EQ(phase_sink(), nullptr);  // none by default
  CountingSink sink;
  ASSERT_EQ(set_phase_sink(&sink), nullptr);
#pragma omp parallel for num_threads(4)
  for (int i = 0; i < 100; ++i) {
    Phase a("a");
    if (i % 2) Phase b("b");
  }
  EXPECT_EQ(set_phase_sink(nullptr), &sink);
  { Phase ignored("c"); }  // no sink: not seen
  EXPECT_EQ((sink.ends), (std::map<std::string, int>{{"a", 100}, {"b", 50}}));
  EXPECT_EQ(sink.bad_marks, 0);
}

// The phase times of the timed passes are in the row, for the variants that mark phases, and
// no forward pass leaves a sink behind.
TEST(Phase, RunOneReportsTheVariantsPhases) {
  test::ScopedThreads threads(2);
  const Problem p = test::problem(1, 2, 256, 0, 32, false, 3);
  MachineFigures mf;
  RunOptions opt{.reps = 2, .min_time = 0.01};
  const std::map<std::string, std::vector<std::string>> expected = {
      {"reformer", {"attend", "hash"}}, {"routing", {"attend", "route"}}, {"full", {}}};
  for (const auto& [spec, names] : expected) {
    SCOPED_TRACE(spec);
    auto v = make_variant(spec);
    Row row = run_one(*v, p, Workload{}, nullptr, mf, opt);
    ASSERT_EQ(row.status, "ok") << row.message;
    EXPECT_EQ(phase_sink(), nullptr);
    std::vector<std::string> got;
    double sum = 0;
    for (const auto& [name, seconds] : row.phases) {
      got.push_back(name);
      EXPECT_GT(seconds, 0) << name;
      sum += seconds;
    }
    EXPECT_EQ(got, names);
    // thread-seconds of a pass on 2 threads: at most twice the slowest repetition's mean
    // pass (no lower bound: on a busy machine a pass mostly waits for descheduled threads)
    EXPECT_LE(sum, 2.0 * row.time_max);
    const std::string text = to_json(row).at("phases").get<std::string>();
    if (names.empty()) {
      EXPECT_EQ(text, "");
    } else {
      auto j = nlohmann::json::parse(text);
      for (const auto& [name, seconds] : row.phases) EXPECT_DOUBLE_EQ(j.at(name), seconds);
    }
  }
}

}  // namespace
}  // namespace attnbench
