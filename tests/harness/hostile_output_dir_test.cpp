// Hostile inputs on results directories, merge and shard: nothing a user measured is ever lost.
// One writer at a time (the lock), files written whole or not at all (a failed write leaves the
// previous file), a sweep or merge into a directory holding results refused unless asked
// (--resume, --force), and shards no sweep wrote refused with a message naming the line.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "harness/machine.h"
#include "harness/merge.h"
#include "harness/output_dir.h"
#include "harness/patterns.h"
#include "harness/results.h"
#include "harness/shard.h"
#include "test_util.h"

namespace attnbench {
namespace {

namespace fs = std::filesystem;
using test::CliResult;
using test::read_text;
using test::run_cli;
using test::TempDir;

std::string q(const std::string& s) { return "'" + s + "'"; }

Row row_of(int64_t n, const std::string& status = "ok") {
  Row r;
  r.spec = "flash";
  r.variant = "flash";
  r.problem.batch = 1, r.problem.heads = 2, r.problem.n = n, r.problem.dim = 16;
  r.workload.threads = 1;
  r.status = status;
  r.time_median = r.time_min = r.time_max = 1e-3;
  return r;
}

size_t data_lines(const std::string& csv_path) {
  const auto lines = test::read_lines(csv_path);
  size_t n = 0;
  for (size_t i = 1; i < lines.size(); ++i) n += !lines[i].empty();
  return n;
}

// A machine figures file for sweeps run by the tests: this host, this CPU, `threads` threads,
// so a sweep reads it instead of measuring the machine (seconds per sweep).
std::string machine_file(const TempDir& dir, int threads = 1) {
  MachineFigures m;
  m.cpu_model = cpu_model();
  m.host = host_name();
  m.threads = threads;
  m.gemm_gflops = m.blas_gflops = m.eigen_gflops = m.bf16_gflops = 100;
  m.gemm_size = 1024;
  m.bandwidth_gbs = 10;
  m.measured_at = utc_now();
  const std::string path = dir.file("machine.json");
  test::write_text(path, to_json(m).dump(2));
  return path;
}

std::string sweep_args(const std::string& variants, const std::string& out,
                       const std::string& machine) {
  return fmt::format(
      "sweep {} --seq 32,64 --heads 1 --dim 8 --reps 1 --min-time 0 --threads 1 --out {} "
      "--machine-file {}",
      variants, q(out), q(machine));
}

// A file-size limit for this process (RLIMIT_FSIZE): writes past it fail with EFBIG, as writes
// on a full disk fail with ENOSPC. Restored (and SIGXFSZ's action with it) when it goes.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &old_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

// ----- writes -----

TEST(OutputDir, AFailedWriteLeavesThePreviousFile) {
  TempDir dir;
  const std::string path = dir.file("benchmark.json");
  write_file_atomic(path, "previous\n");
  try {
    FileSizeLimit limit(4096);
    write_file_atomic(path, std::string(64 * 1024, 'x'));
    ADD_FAILURE() << "a write past the limit did not throw";
  } catch (const WriteError& e) {
    EXPECT_CONTAINS(std::string(e.what()), path);
    EXPECT_CONTAINS(std::string(e.what()), "left as it was");
  }
  EXPECT_EQ(read_text(path), "previous\n");
  EXPECT_FALSE(fs::exists(path + ".tmp")) << "the temporary file was left behind";
}

TEST(OutputDir, AFailedAppendCutsItsPartialLine) {
  TempDir dir;
  const std::string path = dir.file("results.csv");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  append_synced(fd, path, "header\n");
  append_synced(fd, path, "row 1\n");
  try {
    FileSizeLimit limit(4096);
    append_synced(fd, path, std::string(8192, 'x') + "\n");
    ADD_FAILURE() << "an append past the limit did not throw";
  } catch (const WriteError& e) {
    EXPECT_CONTAINS(std::string(e.what()), path);
  }
  ::close(fd);
  EXPECT_EQ(read_text(path), "header\nrow 1\n");
}

// ----- the lock -----

TEST(OutputDir, ASecondWriterIsRefusedNamingTheFirst) {
  TempDir dir;
  const std::string out = dir.file("r");
  fs::create_directories(out);
  {
    DirLock first(out, "attnbench sweep --out r --seq 64");
    try {
      DirLock second(out, "attnbench sweep --out r --seq 128");
      ADD_FAILURE() << "a second writer took the lock";
    } catch (const UsageError& e) {
      const std::string what = e.what();
      EXPECT_CONTAINS(what, "being written by another process");
      EXPECT_CONTAINS(what, fmt::format("pid {}", ::getpid()));
      EXPECT_CONTAINS(what, "attnbench sweep --out r --seq 64");
    }
    // through the binary: a sweep into the locked directory exits 2 and writes nothing
    const std::string machine = machine_file(dir);
    const CliResult r = run_cli(sweep_args("--variant flash", out, machine), dir);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_CONTAINS(r.err, "being written by another process");
    EXPECT_FALSE(fs::exists(out + "/results.csv"));
  }
  DirLock again(out, "later");  // released with its holder
  EXPECT_TRUE(again.held());
}

TEST(OutputDir, TwoSweepsStartedTogetherIntoOneDirectory) {
  // shard 0/2 and 1/2 into the same --out: one runs, the other is refused; no row is torn or
  // lost, and no configuration is measured twice
  TempDir dir;
  const std::string out = dir.file("r"), machine = machine_file(dir);
  const std::string base = sweep_args("--variant flash --variant local", out, machine);
  const std::string cmd = fmt::format(
      "('{0}' {1} --shard 0/2 >'{2}/a.out' 2>'{2}/a.err'; echo $? >'{2}/a.rc') & "
      "('{0}' {1} --shard 1/2 >'{2}/b.out' 2>'{2}/b.err'; echo $? >'{2}/b.rc') & wait",
      ATTNBENCH_BIN, base, dir.path().string());
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const std::string a = read_text(dir.file("a.rc")), b = read_text(dir.file("b.rc"));
  const std::string errs = read_text(dir.file("a.err")) + read_text(dir.file("b.err"));
  // either both ran one after the other (each then refused the other's rows: only one can
  // succeed) or one was refused by the lock; never both "ok" into one file
  EXPECT_TRUE((a == "0\n") != (b == "0\n")) << "exit codes " << a << " and " << b << "\n" << errs;
  EXPECT_TRUE(errs.find("being written by another process") != std::string::npos ||
              errs.find("already holds results") != std::string::npos)
      << errs;
  const auto lines = test::read_lines(out + "/results.csv");
  const size_t fields = split_csv_line(lines.at(0)).size();
  for (const auto& line : lines) {
    if (line.empty()) continue;
    EXPECT_EQ(split_csv_line(line).size(), fields) << "torn line: " << line;
  }
}

// ----- earlier results -----

TEST(OutputDir, ASweepIntoADirectoryWithRowsIsRefusedWithoutResumeOrForce) {
  TempDir dir;
  const std::string out = dir.file("r"), machine = machine_file(dir);
  CliResult r = run_cli(sweep_args("--variant flash", out, machine), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string before = read_text(out + "/results.csv"),
                    bench = read_text(out + "/benchmark.json");
  r = run_cli(sweep_args("--variant local", out, machine), dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_CONTAINS(r.err, "already holds results");
  EXPECT_CONTAINS(r.err, "--resume");
  EXPECT_CONTAINS(r.err, "--force");
  EXPECT_EQ(read_text(out + "/results.csv"), before);
  EXPECT_EQ(read_text(out + "/benchmark.json"), bench);
  // --resume keeps them and adds the new rows
  r = run_cli(sweep_args("--variant local", out, machine) + " --resume", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(data_lines(out + "/results.csv"), 4u);
  // --force moves them aside, whole
  r = run_cli(sweep_args("--variant flash", out, machine) + " --force", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "moved to");
  EXPECT_EQ(data_lines(out + "/results.csv"), 2u);
  std::vector<fs::path> aside;
  for (const auto& e : fs::directory_iterator(out))
    if (e.path().filename().string().rfind("earlier-", 0) == 0) aside.push_back(e.path());
  ASSERT_EQ(aside.size(), 1u);
  EXPECT_EQ(data_lines((aside[0] / "results.csv").string()), 4u);
  for (const char* name : {"benchmark.json", "meta.json", "plan.json", "patterns"})
    EXPECT_TRUE(fs::exists(aside[0] / name)) << name;
  // --resume with --force is a contradiction
  r = run_cli(sweep_args("--variant flash", out, machine) + " --force --resume", dir);
  EXPECT_EQ(r.code, 2);
}

TEST(OutputDir, ResultsDirWithoutResumeRefusesEarlierRows) {
  TempDir dir;
  const std::string out = dir.file("r");
  {
    ResultsDir rd(out, false);
    rd.append(row_of(32), {{"context", nullptr}, {"benchmarks", {{{"name", "old_run"}}}}});
  }
  EXPECT_THROW(ResultsDir(out, false), UsageError);
  EXPECT_NE(read_text(out + "/benchmark.json").find("old_run"), std::string::npos);
  {
    ResultsDir rd(out, false, /*force=*/true);
    rd.append(row_of(64), nlohmann::json());
  }
  EXPECT_EQ(read_text(out + "/benchmark.json").find("old_run"), std::string::npos);
  EXPECT_EQ(data_lines(out + "/results.csv"), 1u);
}

TEST(OutputDir, ResumeStoresATruncatedPatternAgain) {
  TempDir dir;
  const std::string out = dir.file("r"), machine = machine_file(dir);
  const std::string args = sweep_args("--variant local:window=8", out, machine);
  CliResult r = run_cli(args, dir);
  ASSERT_EQ(r.code, 0) << r.err;
  std::string npy;
  for (const auto& e : fs::directory_iterator(out + "/patterns"))
    if (e.path().extension() == ".npy") npy = e.path().string();
  ASSERT_FALSE(npy.empty());
  const std::string whole = read_text(npy);
  fs::resize_file(npy, whole.size() / 2);
  EXPECT_NE(pattern_file_problem(npy), "");
  r = run_cli(args + " --resume", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "not a whole pattern");
  EXPECT_EQ(read_text(npy), whole);
  EXPECT_EQ(pattern_file_problem(npy), "");
}

// ----- rows no sweep writes -----

TEST(OutputDir, MalformedRowsAreNamed) {
  const auto& cols = csv_columns();
  auto with = [&](const std::string& col, const std::string& value) {
    auto f = split_csv_line(csv_line(row_of(64)));
    f[size_t(std::find(cols.begin(), cols.end(), col) - cols.begin())] = value;
    return malformed_reason(cols, f);
  };
  EXPECT_EQ(malformed_reason(cols, split_csv_line(csv_line(row_of(64)))), "");
  EXPECT_CONTAINS(with("status", "bogus"), "status");
  EXPECT_CONTAINS(with("n", "abc"), "n is 'abc'");
  EXPECT_CONTAINS(with("rel_fro_error", "nan"), "rel_fro_error");
  EXPECT_CONTAINS(with("rel_fro_error", "inf"), "not a finite number");
  EXPECT_CONTAINS(with("time_median_s", "-1"), "time_median_s");
  EXPECT_CONTAINS(with("time_min_s", "0"), "not a positive time");
  EXPECT_CONTAINS(with("peak_bytes", "-5"), "negative");
  EXPECT_EQ(with("mean_cosine", "-0.5"), "");  // a cosine may be negative
}

// ----- merge -----

struct Shards {
  std::string s0, s1, machine;
};

Shards make_shards(const TempDir& dir) {
  Shards s{dir.file("s0"), dir.file("s1"), machine_file(dir)};
  for (int i = 0; i < 2; ++i) {
    const CliResult r = run_cli(
        sweep_args("--variant flash --variant local:window=8", i == 0 ? s.s0 : s.s1, s.machine) +
            fmt::format(" --shard {}/2", i),
        dir);
    EXPECT_EQ(r.code, 0) << r.err;
  }
  return s;
}

TEST(OutputDir, MergeIntoADirectoryWithResultsIsRefused) {
  TempDir dir;
  const Shards s = make_shards(dir);
  const std::string out = dir.file("merged");
  CliResult r = run_cli(fmt::format("merge {} {} --out {}", q(s.s0), q(s.s1), q(out)), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string before = read_text(out + "/results.csv");
  // into an existing sweep (a shard's own sibling, here the merged directory itself)
  r = run_cli(fmt::format("merge {} {} --out {}", q(s.s0), q(s.s1), q(out)), dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_CONTAINS(r.err, "already holds results");
  EXPECT_CONTAINS(r.err, "--force");
  EXPECT_EQ(read_text(out + "/results.csv"), before);
  r = run_cli(fmt::format("merge {} {} --out {} --force", q(s.s0), q(s.s1), q(out)), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "moved to");
  EXPECT_EQ(read_text(out + "/results.csv"), before);
}

TEST(OutputDir, MergeRefusesRowsNoSweepWrites) {
  TempDir dir;
  const Shards s = make_shards(dir);
  const std::string csv = s.s1 + "/results.csv", good = read_text(csv);
  auto lines = test::read_lines(csv);
  ASSERT_GE(lines.size(), 2u);
  auto header = split_csv_line(lines[0]);
  auto set_field = [&](const std::string& col, const std::string& value) {
    auto f = split_csv_line(lines[1]);
    f[size_t(std::find(header.begin(), header.end(), col) - header.begin())] = value;
    std::string text = lines[0] + '\n';
    for (size_t i = 0; i < f.size(); ++i) {
      if (i > 0) text += ',';
      text += csv_quote(f[i]);
    }
    text += '\n';
    for (size_t i = 2; i < lines.size(); ++i) text += lines[i] + '\n';
    test::write_text(csv, text);
  };
  for (const auto& [col, value] : std::vector<std::pair<std::string, std::string>>{
           {"status", "bogus"}, {"n", "abc"}, {"rel_fro_error", "nan"}, {"time_min_s", "-1"}}) {
    set_field(col, value);
    const std::string out = dir.file("m-" + col);
    const CliResult r = run_cli(fmt::format("merge {} {} --out {}", q(s.s0), q(s.s1), q(out)), dir);
    EXPECT_EQ(r.code, 2) << col << ": " << r.err;
    EXPECT_CONTAINS(r.err, "line 2");
    EXPECT_CONTAINS(r.err, col);
    EXPECT_FALSE(fs::exists(out + "/results.csv")) << col;
  }
  test::write_text(csv, good);
}

TEST(OutputDir, MergeWarnsOfAMissingBenchmarkJsonAndATruncatedPattern) {
  TempDir dir;
  const Shards s = make_shards(dir);
  fs::remove(s.s1 + "/benchmark.json");
  std::string npy;
  for (const auto& d : {s.s0, s.s1})
    for (const auto& e : fs::directory_iterator(d + "/patterns"))
      if (e.path().extension() == ".npy") npy = e.path().string();
  ASSERT_FALSE(npy.empty());
  fs::resize_file(npy, 40);
  const std::string out = dir.file("merged");
  const CliResult r = run_cli(fmt::format("merge {} {} --out {}", q(s.s0), q(s.s1), q(out)), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "has no benchmark.json");
  EXPECT_CONTAINS(r.err, "not a whole pattern");
  for (const auto& e : fs::directory_iterator(out + "/patterns")) {
    if (e.path().extension() != ".npy") continue;
    EXPECT_EQ(pattern_file_problem(e.path().string()), "");
  }
}

TEST(OutputDir, MergeRefusesAShardBeingWritten) {
  TempDir dir;
  const Shards s = make_shards(dir);
  DirLock writer(s.s1, "attnbench sweep --shard 1/2");
  const CliResult r =
      run_cli(fmt::format("merge {} {} --out {}", q(s.s0), q(s.s1), q(dir.file("merged"))), dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_CONTAINS(r.err, "being written by another process");
  EXPECT_CONTAINS(r.err, "--shard 1/2");
}

// ----- shard counts and output files -----

TEST(OutputDir, ShardCountsBeyondTheCapAreRefusedByName) {
  for (const std::string text : {"0/2147483648", "0/1000000", "5/100001", "0/99999999999999999999"})
    try {
      parse_shard(text);
      ADD_FAILURE() << text << " was accepted";
    } catch (const UsageError& e) {
      EXPECT_CONTAINS(std::string(e.what()), "largest shard count accepted");
    }
  EXPECT_EQ(parse_shard("3/100000"), std::make_pair(3, 100000));
  TempDir dir;
  const CliResult r =
      run_cli("sweep --variant flash --seq 32 --shard 0/2147483647 --out " + q(dir.file("r")), dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "100000");
  EXPECT_FALSE(fs::exists(dir.file("r") + "/meta.json"));
}

TEST(OutputDir, BadOutputFilesAreRefusedBeforeAnyWork) {
  TempDir dir;
  const std::string base = "run --variant flash --seq 32 --heads 1 --dim 8 --reps 1 ";
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {base + "--output ''", "is empty"},
      {base + "--pass bwd --save-grads ''", "is empty"},
      {base + "--pass bwd --save-grads /dev/null", "not a regular file"},
      {base + "--pass bwd --save-grads " + q(dir.path().string()), "is a directory"},
      {base + "--pass bwd --save-grads " + q(dir.file("missing/g.npz")), "does not exist"},
      {"layer --variant flash --seq 8 --embed 16 --heads 2 --output ''", "is empty"},
      {"pattern --variant local --seq 16 --output ''", "is empty"},
      {"sweep --variant flash --seq 32 --out ''", "--out"},
  };
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args, dir);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_CONTAINS(r.err, c.expect);
    EXPECT_EQ(r.out, "") << c.args << ": measured before refusing";
  }
}

}  // namespace
}  // namespace attnbench
