// Noisy timings: the rule (harness/runner.h, noise_reason), the load of other processes
// (harness/machine.h) measured while busy processes the test starts compete for the
// processors, and the sweep's warning, `noisy` column, --retry-noisy and meta.json records.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/core/registry.h"
#include "harness/machine.h"
#include "harness/results.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

// `count` child processes that spin until the object is destroyed; with a `trigger` path,
// they wait (sleeping) until that file exists, then spin.
class BusyProcesses {
 public:
  explicit BusyProcesses(int count, const std::string& trigger = "") {
    for (int i = 0; i < count; ++i) {
      const pid_t pid = fork();
      if (pid == 0) {
        while (!trigger.empty() && access(trigger.c_str(), F_OK) != 0) usleep(5000);
        volatile unsigned long x = 0;
        for (;;) x = x + 1;
      }
      if (pid > 0) pids_.push_back(pid);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let them start
  }
  ~BusyProcesses() {
    for (pid_t pid : pids_) kill(pid, SIGKILL);
    for (pid_t pid : pids_) waitpid(pid, nullptr, 0);
  }
  size_t size() const { return pids_.size(); }

 private:
  std::vector<pid_t> pids_;
};

Row ok_row(int threads, int reps, double spread, double other) {
  Row r;
  r.workload.threads = threads;
  r.reps = reps;
  r.time_min = 1.0, r.time_max = spread, r.time_spread = spread;
  r.other_load = other;
  r.load_avg = 0.5;
  return r;
}

TEST(Noise, RuleNamesTheSpreadAndTheLoadOfOtherProcesses) {
  EXPECT_EQ(noise_reason(ok_row(2, 3, 1.2, 0.1), 2), "");
  EXPECT_EQ(noise_reason(ok_row(2, 3, 1.2, NAN), 2), "");  // load not measured: not judged
  const std::string spread = noise_reason(ok_row(2, 3, 2.0, 0.1), 2);
  EXPECT_NE(spread.find("spread 2.00x"), std::string::npos) << spread;
  EXPECT_EQ(spread.find("other processes"), std::string::npos) << spread;
  EXPECT_EQ(noise_reason(ok_row(2, 1, 2.0, 0.1), 2), "");  // one repetition has no spread
  // 2 threads on 2 processors leave none free: 0.6 other processors is noise
  const std::string load = noise_reason(ok_row(2, 3, 1.1, 0.6), 2);
  EXPECT_NE(load.find("other processes kept 0.6 processors busy"), std::string::npos) << load;
  // 1 thread on 4 processors leaves 3 free: 3.2 is not
  EXPECT_EQ(noise_reason(ok_row(1, 3, 1.1, 3.2), 4), "");
  Row failed = ok_row(2, 3, 3.0, 2.0);
  failed.status = "error";
  EXPECT_EQ(noise_reason(failed, 2), "");
}

TEST(Noise, OtherLoadCountsBusyProcessesAndNotThisOne) {
  const int procs = omp_get_num_procs();
  {
    BusyProcesses busy(procs);
    ASSERT_EQ(int(busy.size()), procs);
    const CpuSample a = sample_cpu();
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    const double load = other_load(a, sample_cpu());
    ASSERT_FALSE(std::isnan(load)) << "the CPU counters cannot be read";
    EXPECT_GT(load, 0.7 * procs);
  }
  // This process's own threads are not "other" load.
  const CpuSample a = sample_cpu();
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  volatile double x = 0;
  while (std::chrono::steady_clock::now() < end) x = x + 1;
  const CpuSample b = sample_cpu();
  EXPECT_GT(b.own - a.own, 0.05);
  // too short an interval is not judged
  EXPECT_TRUE(std::isnan(other_load(b, b)));
}

TEST(Noise, RunOneMarksARowTimedBesideBusyProcesses) {
  // The scheduler decides how much processor time the busy processes get while the row is
  // timed (other tests may run beside this one), so the measurement is tried up to three
  // times; every attempt must time the row, and one must see the load and mark the row.
  const int procs = omp_get_num_procs();
  auto v = make_variant("flash");
  Problem p;
  p.batch = 1, p.heads = 2, p.n = 256, p.dim = 32;
  std::string attempts;
  bool marked = false;
  for (int attempt = 1; attempt <= 3 && !marked; ++attempt) {
    BusyProcesses busy(procs);
    ASSERT_EQ(int(busy.size()), procs) << "fork failed";
    const Row row = run_one(*v, p, Workload{.threads = procs}, nullptr, MachineFigures{},
                            RunOptions{.reps = 3, .min_time = 0.15});
    ASSERT_EQ(row.status, "ok") << row.message;
    EXPECT_FALSE(std::isnan(row.load_avg));
    EXPECT_NEAR(row.time_spread, row.time_max / row.time_min, 1e-12);
    const std::string why = noise_reason(row);
    marked = row.other_load > 0.5 && row.noisy && why.find("other processes") != std::string::npos;
    attempts += fmt::format("attempt {}: other_load {:.2f}, noisy {}, reason '{}'\n", attempt,
                            row.other_load, row.noisy, why);
  }
  EXPECT_TRUE(marked) << describe(p, Workload{.threads = procs}) << "\n" << attempts;
}

TEST(Noise, SweepWarnsMarksRetriesAndRecordsTheRun) {
  test::TempDir dir;
  const int procs = omp_get_num_procs();
  test::CliResult r;
  {
    // busy once the sweep has measured the machine and written meta.json: during the row
    BusyProcesses busy(procs, dir.file("out/meta.json"));
    r = test::run_cli(fmt::format("sweep --variant full --seq 128 --heads 2 --dim 32 --threads {} "
                                  "--reps 3 --min-time 0.15 --retry-noisy 1 --out {}",
                                  procs, dir.file("out")),
                      dir);
  }
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("warning: noisy timing: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("measuring again (1/1)"), std::string::npos) << r.err;
  const std::string csv = test::read_text(dir.file("out/results.csv"));
  std::vector<std::string> lines;
  std::istringstream in(csv);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(line);
  ASSERT_EQ(lines.size(), 2u) << csv;
  const auto header = split_csv_line(lines[0]), row = split_csv_line(lines[1]);
  auto col = [&](const std::string& name) {
    const auto it = std::find(header.begin(), header.end(), name);
    EXPECT_NE(it, header.end()) << name;
    return it == header.end() ? std::string() : row[size_t(it - header.begin())];
  };
  EXPECT_EQ(col("noisy"), "1");
  EXPECT_NE(col("other_load"), "");
  EXPECT_NE(col("load_avg"), "");
  EXPECT_NE(col("notes").find("timed 2 times for noise"), std::string::npos) << col("notes");
  std::ifstream f(dir.file("out/meta.json"));
  const auto meta = nlohmann::json::parse(f);
  EXPECT_TRUE(meta.at("duration_s").is_number());
  EXPECT_GT(meta.at("duration_s").get<double>(), 0.0);
  EXPECT_TRUE(meta.contains("load_avg_start"));
  EXPECT_TRUE(meta.contains("load_avg_end"));
  EXPECT_EQ(meta.at("rows_noisy").get<int>(), 1);
  EXPECT_TRUE(meta.at("machine").contains("gemm_gflops"));
  EXPECT_TRUE(meta.at("machine").contains("bandwidth_gbs"));
}

}  // namespace
}  // namespace attnbench
