// The machine figures file shared by the processes of one sweep (machine_figures): measured
// and kept once, read back by later processes of the same host, CPU model and thread count,
// measured again for another thread count or a file that is not such figures; concurrent
// processes measure once; the machine command and the shards of a sweep read and write
// such a file.
#include "harness/machine.h"

#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/kernels/bf16.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::CliResult;
using test::read_text;
using test::run_cli;
using test::TempDir;

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

TEST(MachineFile, MeasuredOnceThenReadBack) {
  TempDir dir;
  const std::string path = dir.file("machine.json");
  const MachineFigures first = machine_figures(path, 1, /*quick=*/true);
  EXPECT_EQ(first.source, "measured, kept in " + path);
  EXPECT_GT(first.gemm_gflops, 0);
  EXPECT_EQ(first.host, host_name());
  const nlohmann::json kept = read_json(path);
  EXPECT_EQ(kept.at("threads").get<int>(), 1);
  EXPECT_EQ(kept.at("cpu_model").get<std::string>(), cpu_model());

  const MachineFigures again = machine_figures(path, 1, /*quick=*/true);
  EXPECT_EQ(again.source, "read from " + path);
  EXPECT_EQ(again.gemm_gflops, first.gemm_gflops);  // the same figures, not a new measurement
  EXPECT_EQ(again.bandwidth_gbs, first.bandwidth_gbs);
  EXPECT_EQ(again.measured_at, first.measured_at);
  EXPECT_EQ(to_json(again).at("source").get<std::string>(), "read from " + path);
}

TEST(MachineFile, AnotherThreadCountOrHostIsMeasuredAgain) {
  TempDir dir;
  const std::string path = dir.file("machine.json");
  machine_figures(path, 1, /*quick=*/true);
  const MachineFigures two = machine_figures(path, 2, /*quick=*/true);
  EXPECT_EQ(two.source, "measured, kept in " + path);
  EXPECT_EQ(read_json(path).at("threads").get<int>(), 2);

  nlohmann::json j = read_json(path);
  j["host"] = "elsewhere";
  j["gemm_gflops"] = 12345.0;
  std::ofstream(path) << j.dump();
  const MachineFigures here = machine_figures(path, 2, /*quick=*/true);
  EXPECT_EQ(here.source, "measured, kept in " + path);
  EXPECT_NE(here.gemm_gflops, 12345.0);
  EXPECT_EQ(read_json(path).at("host").get<std::string>(), host_name());
}

// Figures read back are a day old at most where a policy says so (the kept figures of run,
// layer and sweep), and --remeasure measures them again whatever their age.
TEST(MachineFile, OldFiguresAreMeasuredAgainWhenThePolicySaysSo) {
  TempDir dir;
  const std::string path = dir.file("machine.json");
  const KeepPolicy day{.max_age_s = kMachineMaxAgeSeconds};
  const MachineFigures first = machine_figures(path, 1, /*quick=*/true, day);
  EXPECT_EQ(first.source, "measured, kept in " + path);
  EXPECT_EQ(machine_figures(path, 1, /*quick=*/true, day).source, "read from " + path);
  EXPECT_LT(age_seconds(first.measured_at), 600);
  EXPECT_NEAR(age_seconds("2000-01-01T00:00:00Z"), double(std::time(nullptr)) - 946684800.0, 2);
  EXPECT_TRUE(std::isnan(age_seconds("yesterday")));
  EXPECT_TRUE(std::isnan(age_seconds("2026-01-01T00:00:00Z trailing")));

  for (const std::string when : {"2000-01-01T00:00:00Z", "sometime"}) {
    nlohmann::json j = read_json(path);
    j["measured_at"] = when;
    j["gemm_gflops"] = 12345.0;
    std::ofstream(path) << j.dump();
    // no age limit (--machine-file): read back as they are
    EXPECT_EQ(machine_figures(path, 1, /*quick=*/true).gemm_gflops, 12345.0) << when;
    const MachineFigures again = machine_figures(path, 1, /*quick=*/true, day);
    EXPECT_EQ(again.source, "measured, kept in " + path) << when;
    EXPECT_NE(again.gemm_gflops, 12345.0) << when;
    EXPECT_NE(read_json(path).at("measured_at").get<std::string>(), when);
  }
  nlohmann::json j = read_json(path);
  j["gemm_gflops"] = 12345.0;
  std::ofstream(path) << j.dump();
  const MachineFigures fresh = machine_figures(path, 1, /*quick=*/true, {.remeasure = true});
  EXPECT_EQ(fresh.source, "measured, kept in " + path);
  EXPECT_NE(read_json(path).at("gemm_gflops").get<double>(), 12345.0);
}

// Without ATTNBENCH_MACHINE_DIR, run and sweep keep their figures in the user's cache
// directory (one file per host, thread count and kind) and read them back; set and empty, they
// keep none; --remeasure measures them again.
TEST(MachineFile, RunAndSweepKeepTheirFiguresInTheUserCache) {
  TempDir dir;
  const char* kept = std::getenv(kMachineDirVariable);
  const std::optional<std::string> saved = kept ? std::optional<std::string>(kept) : std::nullopt;
  ::unsetenv(kMachineDirVariable);
  {
    test::ScopedEnv xdg("XDG_CACHE_HOME", dir.file("cache"));
    EXPECT_EQ(machine_cache_dir(), dir.file("cache") + "/attnbench/machine");
    const std::string quick = kept_machine_file(1, true), full = kept_machine_file(1, false);
    EXPECT_EQ(quick.rfind(
                  dir.file("cache") + "/attnbench/machine/machine-" + host_name() + "-1t-quick", 0),
              0u)
        << quick;
    EXPECT_NE(quick, full);
    const std::string run =
        "run --variant flash --seq 16 --heads 1 --dim 8 --reps 1 --min-time 0 --threads 1";
    ASSERT_EQ(run_cli(run, dir).code, 0);
    const double measured = read_json(quick).at("gemm_gflops").get<double>();
    nlohmann::json j = read_json(quick);
    j["gemm_gflops"] = 12345.0;  // read back, it stays
    std::ofstream(quick) << j.dump();
    ASSERT_EQ(run_cli(run, dir).code, 0);
    EXPECT_EQ(read_json(quick).at("gemm_gflops").get<double>(), 12345.0);
    ASSERT_EQ(run_cli(run + " --remeasure", dir).code, 0);
    EXPECT_NE(read_json(quick).at("gemm_gflops").get<double>(), 12345.0);
    EXPECT_GT(measured, 0);

    const CliResult sweep = run_cli(
        "sweep --variant flash --seq 16 --heads 1 --dim 8 --reps 1 --min-time 0 --threads 1 "
        "--out '" +
            dir.file("s") + "'",
        dir);
    ASSERT_EQ(sweep.code, 0) << sweep.err;
    std::ifstream f(dir.file("s/meta.json"));
    EXPECT_EQ(nlohmann::json::parse(f).at("machine").at("source").get<std::string>(),
              "measured, kept in " + full);
  }
  {
    test::ScopedEnv none(kMachineDirVariable, "");
    EXPECT_EQ(kept_machine_file(1, true), "");
    EXPECT_EQ(kept_machine_figures(1, /*quick=*/true).source, "measured");
  }
  if (saved) ::setenv(kMachineDirVariable, saved->c_str(), 1);
}

TEST(MachineFile, ABadFileIsMeasuredAgainAndReplaced) {
  TempDir dir;
  const std::string path = dir.file("machine.json");
  for (const std::string text :
       {"", "{not json", "[1, 2]", R"({"cpu_model": "x"})", "{\"gemm_gflops\": -1}"}) {
    std::ofstream(path) << text;
    const MachineFigures m = machine_figures(path, 1, /*quick=*/true);
    EXPECT_EQ(m.source, "measured, kept in " + path) << text;
    EXPECT_GT(read_json(path).at("gemm_gflops").get<double>(), 0) << text;
  }
  nlohmann::json j = read_json(path);
  j["bandwidth_gbs"] = "fast";
  EXPECT_NE(test::error_message<Error>([&] { machine_from_json(j); }).find("bandwidth_gbs"),
            std::string::npos);
  j["bandwidth_gbs"] = 0.0;
  EXPECT_NE(test::error_message<Error>([&] { machine_from_json(j); }).find("not a positive"),
            std::string::npos);
}

// The bf16 peaks: measured where the instructions run (0 where not), the bf16 peak the best of
// them and float32 GEMM, kept in the file, and older files without them read as none; a bf16
// row's share of the peak is taken against the bf16 peak.
TEST(MachineFile, Bf16PeaksBesideGemm) {
  TempDir dir;
  const std::string path = dir.file("machine.json");
  const MachineFigures m = machine_figures(path, 1, /*quick=*/true);
  EXPECT_EQ(m.amx_bf16_gflops > 0, amx_usable());
  if (amx_usable()) {
    // 16 x 16 x 32 multiply-adds per instruction: far past float32 GEMM on one core
    EXPECT_GT(m.amx_bf16_gflops, 2 * m.gemm_gflops);
  }
  if (!cpu_has_avx512_bf16()) {
    EXPECT_EQ(m.avx512_bf16_gflops, 0.0);
  }
  EXPECT_EQ(m.bf16_gflops, std::max({m.gemm_gflops, m.amx_bf16_gflops, m.avx512_bf16_gflops}));
  EXPECT_EQ(peak_gflops(m, true), m.bf16_gflops);
  EXPECT_EQ(peak_gflops(m, false), m.gemm_gflops);
  const MachineFigures again = machine_figures(path, 1, /*quick=*/true);
  EXPECT_EQ(again.bf16_gflops, m.bf16_gflops);
  EXPECT_EQ(again.amx_bf16_gflops, m.amx_bf16_gflops);

  nlohmann::json j = read_json(path);
  j.erase("bf16_gflops");
  j.erase("amx_bf16_gflops");
  j.erase("avx512_bf16_gflops");
  const MachineFigures old = machine_from_json(j);
  EXPECT_EQ(old.bf16_gflops, 0.0);
  EXPECT_EQ(peak_gflops(old, true), old.gemm_gflops);
  j = read_json(path);
  j["amx_bf16_gflops"] = -1.0;
  EXPECT_NE(test::error_message<Error>([&] { machine_from_json(j); }).find("amx_bf16_gflops"),
            std::string::npos);
}

TEST(MachineFile, AnUnwritablePlaceKeepsTheMeasuredFigures) {
  TempDir dir;
  const std::string path = dir.file("missing/dir/machine.json");
  const MachineFigures m = machine_figures(path, 1, /*quick=*/true);
  EXPECT_EQ(m.source, "measured");
  EXPECT_GT(m.gemm_gflops, 0);
}

TEST(MachineFile, ConcurrentProcessesMeasureOnce) {
  TempDir dir;
  const std::string path = dir.file("machine.json");
  // Three processes start together; the lock lets one measure and the others read its file.
  std::string cmd;
  for (int i = 0; i < 3; ++i)
    cmd += fmt::format("'{}' machine --threads 1 --quick --json --file '{}' >'{}' 2>'{}' & ",
                       ATTNBENCH_BIN, path, dir.file("out" + std::to_string(i)),
                       dir.file("err" + std::to_string(i)));
  ASSERT_EQ(std::system((cmd + "wait").c_str()), 0);
  int measured = 0, read = 0;
  for (int i = 0; i < 3; ++i) {
    const std::string out = read_text(dir.file("out" + std::to_string(i)));
    const auto j = nlohmann::json::parse(out, nullptr, false);
    ASSERT_TRUE(j.is_object()) << out;
    const std::string source = j.at("source").get<std::string>();
    measured += source == "measured, kept in " + path;
    read += source == "read from " + path;
  }
  EXPECT_EQ(measured, 1);
  EXPECT_EQ(read, 2);
}

TEST(MachineFile, TheMachineCommandPrintsWhereItsFiguresCameFrom) {
  TempDir dir;
  const std::string path = dir.file("m.json");
  const CliResult first = run_cli("machine --threads 1 --quick --file '" + path + "'", dir);
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_CONTAINS(first.out, "figures    measured, kept in " + path);
  EXPECT_CONTAINS(first.out, "host       " + host_name());
  const CliResult second = run_cli("machine --threads 1 --quick --file '" + path + "'", dir);
  ASSERT_EQ(second.code, 0) << second.err;
  EXPECT_CONTAINS(second.out, "figures    read from " + path);
}

TEST(MachineFile, ShardsOfASweepShareTheFigures) {
  TempDir dir;
  const std::string path = dir.file("machine.json");
  std::vector<std::string> sources;
  for (int shard = 0; shard < 2; ++shard) {
    const std::string out = dir.file("shard-" + std::to_string(shard));
    const CliResult r = run_cli(
        fmt::format("sweep --variant flash --variant local --seq 32,64 --heads 1 --dim 8 --reps 1 "
                    "--min-time 0 --threads 1 --shard {}/2 --out '{}' --machine-file '{}'",
                    shard, out, path),
        dir);
    ASSERT_EQ(r.code, 0) << r.err;
    std::ifstream f(out + "/meta.json");
    const auto meta = nlohmann::json::parse(f);
    sources.push_back(meta.at("machine").at("source").get<std::string>());
  }
  EXPECT_EQ(sources[0], "measured, kept in " + path);
  EXPECT_EQ(sources[1], "read from " + path);
  const CliResult bad =
      run_cli("sweep --variant flash --seq 32 --out x '--also=--seq 64 --machine-file m'", dir);
  EXPECT_EQ(bad.code, 2);
  EXPECT_CONTAINS(bad.err, "--machine-file belongs to the whole sweep");
}

}  // namespace
}  // namespace attnbench
