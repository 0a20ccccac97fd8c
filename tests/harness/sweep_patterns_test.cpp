// The patterns a sweep stores with its results (harness/patterns.h): which problem of each
// spec and causal setting is stored, what the file holds, the index that names its row, and
// what resuming or replacing a results directory does to them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/npy.h"
#include "harness/output_dir.h"
#include "harness/patterns.h"
#include "harness/results.h"
#include "test_util.h"

namespace attnbench {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// One configuration of a sweep.
struct Config {
  std::string spec;
  Problem p;
  Workload w;
};

Problem sweep_problem(int64_t n, bool causal, int64_t dim = 8) {
  return test::problem(1, 2, n, 0, dim, causal, 3);
}

Workload sweep_workload(const std::string& input) {
  Workload w = test::workload(input);
  w.threads = 1;
  return w;
}

const Workload kGaussian = sweep_workload("gaussian");

// index.csv as column -> value maps, one per line.
std::vector<std::map<std::string, std::string>> read_index(const std::string& results_dir) {
  auto lines = test::read_lines(results_dir + "/patterns/index.csv");
  std::vector<std::map<std::string, std::string>> rows;
  if (lines.empty()) {
    ADD_FAILURE() << "index.csv is missing or empty";
    return rows;
  }
  EXPECT_EQ(split_csv_line(lines[0]), PatternStore::index_columns());
  for (size_t i = 1; i < lines.size(); ++i) {
    auto f = split_csv_line(lines[i]);
    EXPECT_EQ(f.size(), PatternStore::index_columns().size()) << lines[i];
    std::map<std::string, std::string> row;
    for (size_t c = 0; c < std::min(f.size(), PatternStore::index_columns().size()); ++c)
      row[PatternStore::index_columns()[c]] = f[c];
    rows.push_back(row);
  }
  return rows;
}

// The index's entries in a fixed order (a resumed sweep may list them in another).
std::vector<std::map<std::string, std::string>> sorted_index(const std::string& results_dir) {
  auto rows = read_index(results_dir);
  std::sort(rows.begin(), rows.end());
  return rows;
}

std::set<std::string> npy_files(const std::string& results_dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(results_dir + "/patterns"))
    if (e.path().extension() == ".npy") out.insert(e.path().filename().string());
  return out;
}

// Runs a whole sweep's worth of configurations through a store, every row with `status`.
void sweep(const std::string& dir, bool resume, const std::vector<Config>& configs,
           const std::string& status = "ok") {
  PatternStore store(dir, resume);
  std::vector<std::unique_ptr<Variant>> variants;
  for (const auto& c : configs) {
    variants.push_back(make_variant(c.spec));
    store.plan(variants.back()->spec(), c.p, c.w);
  }
  for (size_t i = 0; i < configs.size(); ++i)
    store.row_done(*variants[i], configs[i].p, configs[i].w, status);
}

// Two input distributions, three lengths, both causal settings, a pattern variant and one
// without a pattern, in the order a sweep lists them.
std::vector<Config> grid() {
  std::vector<Config> out;
  for (const char* input : {"local", "gaussian"})
    for (bool causal : {false, true})
      for (int64_t n : {256, 2048, 512})
        for (const char* spec : {"local:window=2,block=3", "linear"})
          out.push_back({spec, sweep_problem(n, causal), sweep_workload(input)});
  return out;
}

TEST(SweepPatterns, OnePerSpecAndCausalAtTheLengthNearest1024WithGaussianInputs) {
  test::ScopedThreads one(1);
  TempDir dir;
  const std::string out = dir.file("results");
  sweep(out, false, grid());
  auto index = read_index(out);
  ASSERT_EQ(index.size(), 4u);  // 2 specs x 2 causal settings
  std::set<std::string> groups;
  for (const auto& row : index) {
    EXPECT_TRUE(groups.insert(row.at("spec") + "/" + row.at("causal")).second);
    // 512 and 2048 are equally near 1024: the shorter one
    EXPECT_EQ(row.at("n"), "512");
    EXPECT_EQ(row.at("m"), "512");
    EXPECT_EQ(row.at("input"), "gaussian");
    EXPECT_EQ(row.at("heads"), "2");
    EXPECT_EQ(row.at("seed"), "3");
    if (row.at("spec") == "linear:eps=1e-06") {
      EXPECT_EQ(row.at("file"), "");
      EXPECT_EQ(row.at("message"), "no attention pattern");
    } else {
      EXPECT_EQ(row.at("message"), "");
      Problem p = sweep_problem(512, row.at("causal") == "1");
      EXPECT_EQ(row.at("file"), pattern_file_name(row.at("spec"), p, kGaussian));
    }
  }
  EXPECT_EQ(npy_files(out).size(), 2u);

  // The file is the window pattern itself: |i - j| <= 2, and j <= i under the causal mask.
  for (bool causal : {false, true}) {
    const std::string file =
        out + "/patterns/" +
        pattern_file_name("local:window=2,block=3", sweep_problem(512, causal), kGaussian);
    NpyArray a = read_npy(file);
    EXPECT_EQ(a.dtype, "|u1");
    ASSERT_EQ(a.shape, (std::vector<int64_t>{512, 512}));
    int64_t wrong = 0;
    for (int64_t i = 0; i < 512; ++i)
      for (int64_t j = 0; j < 512; ++j) {
        const bool in = std::abs(i - j) <= 2 && (!causal || j <= i);
        wrong += a.data[size_t(i * 512 + j)] != (in ? 1 : 0);
      }
    EXPECT_EQ(wrong, 0) << file;
  }
}

TEST(SweepPatterns, FirstInputWithoutGaussianAndOnlyOkRows) {
  test::ScopedThreads one(1);
  TempDir dir;
  const std::string out = dir.file("results");
  std::vector<Config> configs;
  for (const char* input : {"clustered", "local"})
    for (int64_t n : {64, 128})
      configs.push_back({"local:window=2,block=3", sweep_problem(n, false), sweep_workload(input)});
  sweep(out, false, configs);
  auto index = read_index(out);
  ASSERT_EQ(index.size(), 1u);
  EXPECT_EQ(index[0].at("input"), "clustered");
  EXPECT_EQ(index[0].at("n"), "128");

  // rows that failed get no pattern
  const std::string failed = dir.file("failed");
  sweep(failed, false, configs, "error");
  EXPECT_TRUE(read_index(failed).empty());
  EXPECT_TRUE(npy_files(failed).empty());
}

TEST(SweepPatterns, ResumeNeitherLosesNorDuplicates) {
  test::ScopedThreads one(1);
  TempDir dir;
  const std::string out = dir.file("results");
  const auto configs = grid();
  sweep(out, false, configs);
  const auto index = sorted_index(out);
  const auto files = npy_files(out);
  ASSERT_EQ(files.size(), 2u);
  const std::string first = out + "/patterns/" + *files.begin();
  const std::string bytes = test::read_text(first);

  // a resumed sweep (the kept rows reported again) changes nothing
  sweep(out, true, configs);
  EXPECT_EQ(sorted_index(out), index);
  EXPECT_EQ(npy_files(out), files);
  EXPECT_EQ(test::read_text(first), bytes);

  // a resumed sweep with other lengths keeps the stored ones: one per spec and causal setting
  std::vector<Config> longer;
  for (bool causal : {false, true})
    longer.push_back(
        {"local:window=2,block=3", sweep_problem(1024, causal), sweep_workload("gaussian")});
  sweep(out, true, longer);
  EXPECT_EQ(sorted_index(out), index);
  EXPECT_EQ(npy_files(out), files);

  // a file that went missing is stored again, once
  fs::remove(first);
  testing::internal::CaptureStderr();
  sweep(out, true, configs);
  EXPECT_CONTAINS(testing::internal::GetCapturedStderr(), "which does not exist");
  EXPECT_EQ(sorted_index(out), index);
  EXPECT_EQ(npy_files(out), files);
  EXPECT_EQ(test::read_text(first), bytes);

  // without resume (after --force moved the earlier results aside, as a sweep does), the
  // earlier sweep's patterns are kept aside with its rows and a new index starts
  const std::string aside = set_aside(out);
  sweep(out, false, longer);
  auto fresh = read_index(out);
  ASSERT_EQ(fresh.size(), 2u);
  for (const auto& row : fresh) EXPECT_EQ(row.at("n"), "1024");
  EXPECT_EQ(npy_files(out).size(), 2u);
  EXPECT_EQ(npy_files(out).count(*files.begin()), 0u);
  EXPECT_EQ(npy_files(aside), files);
  EXPECT_EQ(test::read_text(aside + "/patterns/" + *files.begin()), bytes);
}

TEST(SweepPatterns, AFailedPatternIsReportedNotThrown) {
  test::ScopedThreads one(1);
  TempDir dir;
  const std::string out = dir.file("results");
  // sinkhorn's pattern needs m = n: its make_pattern refuses this problem
  Problem p = sweep_problem(64, false);
  p.m = 128;
  testing::internal::CaptureStderr();
  EXPECT_NO_THROW(sweep(out, false, {{"sinkhorn", p, kGaussian}}));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_CONTAINS(err, "is not stored");
  EXPECT_CONTAINS(err, "sinkhorn");
  EXPECT_TRUE(read_index(out).empty());
  // and a resumed sweep tries again (nothing was recorded for it)
  testing::internal::CaptureStderr();
  sweep(out, true, {{"sinkhorn", p, kGaussian}});
  EXPECT_CONTAINS(testing::internal::GetCapturedStderr(), "is not stored");
}

TEST(SweepPatterns, LargeProblemsAreNotStored) {
  test::ScopedThreads one(1);
  TempDir dir;
  const std::string out = dir.file("results");
  sweep(out, false,
        {{"local:window=2,block=64", sweep_problem(8192, false), sweep_workload("gaussian")}});
  EXPECT_TRUE(read_index(out).empty());
  EXPECT_TRUE(npy_files(out).empty());
}

TEST(SweepPatterns, FileNamesFollowSpecAndProblem) {
  const Problem p = sweep_problem(512, true);
  const std::string name = pattern_file_name("local:window=2,block=3", p, kGaussian);
  EXPECT_EQ(name.rfind("local_window=2_block=3-n512-m512-causal-", 0), 0u) << name;
  EXPECT_EQ(name.size(), std::string("local_window=2_block=3-n512-m512-causal-").size() + 16 + 4);
  EXPECT_EQ(name, pattern_file_name("local:window=2,block=3", p, kGaussian));  // deterministic
  // specs or problems that read alike in the name still differ in the hash
  EXPECT_NE(name, pattern_file_name("local:window=2_block=3", p, kGaussian));
  // a long spec is cut, and the hash keeps two such names apart
  const std::string a = pattern_file_name("global:positions=" + std::string(300, '1') + "+2", p,
                                          kGaussian),
                    b = pattern_file_name("global:positions=" + std::string(300, '1') + "+3", p,
                                          kGaussian);
  EXPECT_LT(a.size(), 200u);
  EXPECT_NE(a, b);
  Problem other = p;
  other.seed = 4;
  EXPECT_NE(name, pattern_file_name("local:window=2,block=3", other, kGaussian));
}

TEST(SweepPatterns, AResumedIndexWithOtherColumnsIsRefused) {
  TempDir dir;
  const std::string out = dir.file("results");
  fs::create_directories(out + "/patterns");
  test::write_text(out + "/patterns/index.csv", "spec,file\nfull,x.npy\n");
  std::string msg = test::error_message<UsageError>([&] { PatternStore store(out, true); });
  EXPECT_CONTAINS(msg, "cannot resume");
  EXPECT_CONTAINS(msg, "index.csv");
}

}  // namespace
}  // namespace attnbench
