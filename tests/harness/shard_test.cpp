// Sharded sweeps and their merge: the split of a plan into shards (a partition, the same on
// every run, balanced by estimated cost), --shard and --shard-plan through the binary, the host
// column, the resume of a shard, and `attnbench merge` of real shards against the unsharded
// sweep (the same rows in the same order, identical errors) and its refusals.
#include "harness/shard.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "harness/results.h"
#include "harness/sweep_plan.h"
#include "test_util.h"

namespace attnbench {
namespace {

namespace fs = std::filesystem;
using test::CliResult;
using test::run_cli;
using test::TempDir;

std::string q(const std::string& s) { return "'" + s + "'"; }

// The default sweep's variants over n = 256..4096, causal off and on (B = 1, H = 8, d = 64).
SweepPlan default_plan() {
  SweepAxes a;
  a.seqs = {256, 512, 1024, 2048, 4096};
  a.batches = {1};
  a.heads = {8};
  a.dims = {64};
  a.causals = {false, true};
  a.inputs = {"gaussian"};
  a.threads = 1;
  return plan_sweep(make_sweep_variants({}), a);
}

TEST(ShardSplit, IsAPartitionInPlanOrder) {
  const SweepPlan plan = default_plan();
  ASSERT_GT(plan.configs.size(), 50u);
  for (int count : {1, 2, 3, 8, 13}) {
    const ShardSplit split = split_shards(plan, count, 3, 0.1);
    ASSERT_EQ(split.shard_of.size(), plan.configs.size());
    ASSERT_EQ(split.costs.size(), size_t(count));
    std::vector<int> seen(plan.configs.size(), 0);
    size_t total = 0;
    for (int s = 0; s < count; ++s) {
      const auto members = split.members(s);
      EXPECT_EQ(members.size(), split.counts[size_t(s)]);
      EXPECT_TRUE(std::is_sorted(members.begin(), members.end())) << "shard " << s;
      for (size_t i : members) ++seen[i];
      total += members.size();
      EXPECT_GT(split.costs[size_t(s)], 0) << "shard " << s << " of " << count;
    }
    EXPECT_EQ(total, plan.configs.size());
    for (size_t i = 0; i < seen.size(); ++i)
      EXPECT_EQ(seen[i], 1) << "configuration " << i << " with " << count << " shards";
  }
}

TEST(ShardSplit, IsDeterministic) {
  const SweepPlan a = default_plan(), b = default_plan();
  const ShardSplit x = split_shards(a, 8, 3, 0.1), y = split_shards(b, 8, 3, 0.1);
  EXPECT_EQ(x.shard_of, y.shard_of);
  EXPECT_EQ(x.costs, y.costs);
  EXPECT_EQ(plan_keys(a), plan_keys(b));
}

TEST(ShardSplit, IsBalancedByEstimatedCost) {
  const SweepPlan plan = default_plan();
  const ShardSplit split = split_shards(plan, 8, 3, 0.1);
  std::printf(
      "default variants over n = 256..4096, causal off and on: %zu configurations, "
      "estimated imbalance with 8 shards %.4f (longest / mean)\n",
      plan.configs.size(), split.imbalance());
  EXPECT_LT(split.imbalance(), 1.3);
  EXPECT_GE(split.imbalance(), 1.0);
  // by cost, not by count: a shard holding the n = 4096 rows of the costliest variants has
  // fewer configurations than one of short rows
  EXPECT_NE(*std::min_element(split.counts.begin(), split.counts.end()),
            *std::max_element(split.counts.begin(), split.counts.end()));
}

TEST(ShardSplit, RefusedConfigurationsCostAlmostNothing) {
  const SweepPlan plan = default_plan();
  bool refused = false;
  for (const SweepConfig& c : plan.configs)
    if (!sweep_runnable(c)) {
      refused = true;
      EXPECT_EQ(shard_run_cost(c, 3, 0.1), kShardRefusedSeconds) << c.variant->spec();
    } else {
      EXPECT_GT(shard_run_cost(c, 3, 0.1), kShardFixedSeconds) << c.variant->spec();
    }
  if (!refused) GTEST_SKIP() << "no variant of the default set refuses a configuration";
}

TEST(ShardSplit, NumbersShardsLongestFirst) {
  const SweepPlan plan = default_plan();
  for (int count : {2, 4, 8, 13}) {
    const ShardSplit split = split_shards(plan, count, 3, 0.1);
    for (size_t s = 1; s < split.costs.size(); ++s)
      EXPECT_GE(split.costs[s - 1], split.costs[s]) << "shard " << s << " of " << count;
  }
}

// A shard computes the float64 reference of each problem it holds once: the split gathers a
// problem's configurations in few shards, and each shard's estimate counts the reference of
// each of its problems once.
TEST(ShardSplit, GathersAProblemsConfigurations) {
  const SweepPlan plan = default_plan();
  std::map<std::string, double> reference;  // problem -> its reference seconds (one thread)
  std::vector<std::string> problem(plan.configs.size());
  double run_total = 0;
  for (size_t i = 0; i < plan.configs.size(); ++i) {
    const SweepConfig& c = plan.configs[i];
    Row r = key_row(c);
    r.spec.clear();
    problem[i] = row_key(r);
    run_total += shard_run_cost(c, 3, 0.1);
    if (sweep_runnable(c)) reference[problem[i]] = sweep_reference_work(c) / kShardReferenceRate;
  }
  double once = 0, largest = 0;
  for (const auto& [key, seconds] : reference)
    once += seconds, largest = std::max(largest, seconds);
  for (int count : {2, 4, 8}) {
    const ShardSplit split = split_shards(plan, count, 3, 0.1);
    std::set<std::pair<int, std::string>> held;  // (shard, problem) of runnable configurations
    for (size_t i = 0; i < plan.configs.size(); ++i)
      if (sweep_runnable(plan.configs[i])) held.insert({split.shard_of[i], problem[i]});
    double paid = 0;
    for (const auto& [shard, key] : held) paid += reference.at(key);
    double total = 0;
    for (double c : split.costs) total += c;
    EXPECT_NEAR(total, run_total + paid, 1e-9 * total) << count << " shards";
    std::printf("%d shards: %zu problems held %zu times; references %.1f s, %.2f x once\n", count,
                reference.size(), held.size(), paid, paid / once);
    // placing each configuration by its cost alone spreads every problem over every shard
    // (10 problems held 72 times in 8 shards, the references paid 5.3 times over); filled a
    // problem at a time, at most count - 1 problems are cut between two shards, each paying
    // one reference more
    EXPECT_LE(held.size(), reference.size() + size_t(count) - 1) << count << " shards";
    EXPECT_LE(paid, once + double(count - 1) * largest + 1e-9) << count << " shards";
  }
}

TEST(ShardSplit, PassesAndReferencesShrinkWithThreads) {
  SweepAxes a;
  a.seqs = {4096};
  a.batches = {1};
  a.heads = {8};
  a.dims = {64};
  a.causals = {false};
  a.inputs = {"gaussian"};
  a.threads = 1;
  SweepPlan one = plan_sweep(make_sweep_variants({"flash"}), a);
  a.threads = 2;
  SweepPlan two = plan_sweep(make_sweep_variants({"flash"}), a);
  ASSERT_EQ(one.configs.size(), 1u);
  ASSERT_EQ(two.configs.size(), 1u);
  // flash at n = 4096: 34 GFLOP a pass, 0.69 s at 50 GFLOP/s, four passes, and a reference of
  // 2^26 pairs x 64 at 5e8 per second (8.6 s)
  const double c1 = shard_run_cost(one.configs[0], 3, 0.1),
               c2 = shard_run_cost(two.configs[0], 3, 0.1);
  EXPECT_NEAR(c1, kShardFixedSeconds + 4 * sweep_work(one.configs[0]) / kShardFlopRate, 1e-9);
  EXPECT_NEAR(c2 - kShardFixedSeconds, (c1 - kShardFixedSeconds) / 2, 1e-9);
  const ShardSplit s1 = split_shards(one, 1, 3, 0.1), s2 = split_shards(two, 1, 3, 0.1);
  EXPECT_NEAR(s2.costs[0] - kShardFixedSeconds, (s1.costs[0] - kShardFixedSeconds) / 2, 1e-9);
}

TEST(ShardSplit, ParseShard) {
  EXPECT_EQ(parse_shard("0/1"), std::make_pair(0, 1));
  EXPECT_EQ(parse_shard("3/4"), std::make_pair(3, 4));
  for (const char* bad : {"3/2", "a/b", "0/0", "-1/4", "4/4", "1", "1/", "/2", "1/2/3", " 1/2"}) {
    try {
      parse_shard(bad);
      ADD_FAILURE() << "--shard " << bad << " accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("i/N with 0 <= i < N"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

TEST(ShardSplit, SweepDefinition) {
  const auto keys = plan_keys(default_plan());
  const std::string d = sweep_definition(keys, 3, 0.1, 1, 0);
  EXPECT_EQ(d.size(), 16u);
  EXPECT_EQ(d, sweep_definition(keys, 3, 0.1, 1, 0));
  EXPECT_NE(d, sweep_definition(keys, 2, 0.1, 1, 0));
  EXPECT_NE(d, sweep_definition(keys, 3, 0.2, 1, 0));
  EXPECT_NE(d, sweep_definition(keys, 3, 0.1, 2, 0));
  EXPECT_NE(d, sweep_definition(keys, 3, 0.1, 1, 1));
  auto reversed = keys;
  std::reverse(reversed.begin(), reversed.end());
  EXPECT_NE(d, sweep_definition(reversed, 3, 0.1, 1, 0));
  auto fewer = keys;
  fewer.pop_back();
  EXPECT_NE(d, sweep_definition(fewer, 3, 0.1, 1, 0));
}

// ----- through the binary -----

// A results.csv as column -> value maps, in file order, and its header.
struct Csv {
  std::vector<std::string> header;
  std::vector<std::map<std::string, std::string>> rows;
};

Csv read_csv(const std::string& path) {
  Csv csv;
  const auto lines = test::read_lines(path);
  if (lines.empty()) return csv;
  csv.header = split_csv_line(lines[0]);
  for (size_t i = 1; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    const auto f = split_csv_line(lines[i]);
    EXPECT_EQ(f.size(), csv.header.size()) << path << " line " << i + 1;
    std::map<std::string, std::string> row;
    for (size_t c = 0; c < f.size() && c < csv.header.size(); ++c) row[csv.header[c]] = f[c];
    csv.rows.push_back(row);
  }
  return csv;
}

std::string key_of(const std::map<std::string, std::string>& row) {
  std::vector<std::string> f;
  for (const auto& c : key_columns()) f.push_back(row.count(c) ? row.at(c) : "?");
  return csv_key(f);
}

std::vector<std::string> keys_of(const Csv& csv) {
  std::vector<std::string> k;
  for (const auto& r : csv.rows) k.push_back(key_of(r));
  return k;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, false);
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream(path) << j.dump(2) << '\n';
}

std::string this_host() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// Tiny problems: full, flash and local at n = 64, 128, causal off and on, and linear (which
// some of them refuse: unsupported rows that still belong to exactly one shard).
const std::string kSweep =
    "sweep --variant full --variant flash --variant local:window=16 --variant linformer:proj=16 "
    "--seq 64,128 --causal both --heads 1 --dim 16 --reps 1 --min-time 0 --threads 1";

// One unsharded sweep and its two shards, run once for the merge tests (a sweep measures the
// machine first, several seconds).
class ShardedSweep : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    single_ = dir_->file("single");
    const CliResult r = run_cli(kSweep + " --out " + q(single_), *dir_);
    ASSERT_EQ(r.code, 0) << r.err;
    for (int i = 0; i < 2; ++i) {
      shards_.push_back(dir_->file(fmt::format("shard{}", i)));
      const CliResult s =
          run_cli(kSweep + fmt::format(" --shard {}/2 --out ", i) + q(shards_.back()), *dir_);
      ASSERT_EQ(s.code, 0) << s.err;
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
    shards_.clear();
  }
  // "A B C" of the shard directories (and `extra`), quoted.
  static std::string shard_args(const std::vector<std::string>& dirs) {
    std::string s;
    for (const auto& d : dirs) {
      s += ' ';
      s += q(d);
    }
    return s;
  }
  // A copy of a directory, for a test that edits it.
  static std::string copy_of(const std::string& src, const std::string& name, const TempDir& in) {
    const std::string dst = in.file(name);
    fs::copy(src, dst, fs::copy_options::recursive);
    return dst;
  }
  static TempDir* dir_;
  static std::string single_;
  static std::vector<std::string> shards_;
};
TempDir* ShardedSweep::dir_ = nullptr;
std::string ShardedSweep::single_;
std::vector<std::string> ShardedSweep::shards_;

TEST_F(ShardedSweep, ShardsPartitionThePlanAndRecordTheirPart) {
  ASSERT_FALSE(HasFatalFailure());
  const Csv single = read_csv(single_ + "/results.csv");
  ASSERT_EQ(single.rows.size(), 16u);
  const auto single_meta = read_json(single_ + "/meta.json");
  std::multiset<std::string> union_keys;
  std::vector<double> costs;
  for (int i = 0; i < 2; ++i) {
    const Csv csv = read_csv(shards_[size_t(i)] + "/results.csv");
    const auto keys = keys_of(csv);
    union_keys.insert(keys.begin(), keys.end());
    const auto meta = read_json(shards_[size_t(i)] + "/meta.json");
    ASSERT_TRUE(meta.is_object());
    EXPECT_EQ(meta["sweep_definition"], single_meta["sweep_definition"]);
    EXPECT_EQ(meta["shard"]["index"], i);
    EXPECT_EQ(meta["shard"]["count"], 2);
    EXPECT_EQ(meta["shard"]["configs"], csv.rows.size());
    EXPECT_EQ(meta["shard"]["configs_total"], 16);
    EXPECT_EQ(meta["shard"]["estimated_costs"].size(), 2u);
    EXPECT_EQ(meta["shard"]["estimated_costs"][size_t(i)], meta["shard"]["estimated_cost"]);
    EXPECT_EQ(meta["rows_planned"], csv.rows.size());
    EXPECT_EQ(meta["host"], this_host());
    if (i == 0) costs = meta["shard"]["estimated_costs"].get<std::vector<double>>();
    EXPECT_EQ(meta["shard"]["estimated_costs"].get<std::vector<double>>(), costs);
    // within a shard, plan order: the order of the unsharded sweep
    const auto all = keys_of(single);
    size_t pos = 0;
    for (const auto& k : keys) {
      const auto it = std::find(all.begin() + ptrdiff_t(pos), all.end(), k);
      ASSERT_NE(it, all.end()) << k << " out of plan order in shard " << i;
      pos = size_t(it - all.begin()) + 1;
    }
  }
  const auto all = keys_of(single);
  EXPECT_EQ(union_keys, std::multiset<std::string>(all.begin(), all.end()));
  // the unsharded sweep records its definition and the plan too, with no shard
  EXPECT_FALSE(single_meta.contains("shard"));
  EXPECT_EQ(single_meta["sweep_definition"].get<std::string>().size(), 16u);
  const auto plan = read_json(single_ + "/plan.json");
  ASSERT_EQ(plan["configs"].size(), 16u);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(plan["configs"][i]["key"], all[i]);
  EXPECT_EQ(plan["sweep_definition"], single_meta["sweep_definition"]);
}

TEST_F(ShardedSweep, HostColumn) {
  ASSERT_FALSE(HasFatalFailure());
  const Csv csv = read_csv(shards_[0] + "/results.csv");
  ASSERT_FALSE(csv.header.empty());
  EXPECT_EQ(csv.header.back(), "host");
  for (const auto& r : csv.rows) EXPECT_EQ(r.at("host"), this_host());
}

TEST_F(ShardedSweep, MergeEqualsTheUnshardedSweep) {
  ASSERT_FALSE(HasFatalFailure());
  TempDir tmp;
  const std::string out = tmp.file("merged");
  // the shards in another order than their indices: merge orders by the plan
  const CliResult r =
      run_cli("merge" + shard_args({shards_[1], shards_[0]}) + " --out " + q(out), tmp);
  ASSERT_EQ(r.code, 0) << r.err;
  const Csv single = read_csv(single_ + "/results.csv"), merged = read_csv(out + "/results.csv");
  EXPECT_EQ(merged.header, single.header);
  ASSERT_EQ(keys_of(merged), keys_of(single));
  bool refused = false;
  for (size_t i = 0; i < single.rows.size(); ++i) {
    const auto &a = single.rows[i], &b = merged.rows[i];
    for (const char* c : {"status", "message", "rel_fro_error", "max_abs_error", "mean_cosine",
                          "error_rows", "error_rows_total", "mass_mean", "mass_min",
                          "uniform_error", "flops", "estimated_bytes", "host", "input_source"})
      EXPECT_EQ(a.at(c), b.at(c)) << c << " of " << key_of(a);
    if (a.at("status") == "ok") {
      EXPECT_FALSE(b.at("time_median_s").empty()) << key_of(b);
      EXPECT_FALSE(b.at("rel_fro_error").empty()) << key_of(b);
    } else {
      refused = true;
    }
  }
  EXPECT_TRUE(refused) << "the sweep was meant to have a refused row";
  // benchmark.json: one context, every shard's runs
  const auto bench = read_json(out + "/benchmark.json");
  ASSERT_TRUE(bench.is_object());
  EXPECT_TRUE(bench["context"].is_object());
  size_t runs = 0;
  for (const auto& s : shards_) runs += read_json(s + "/benchmark.json")["benchmarks"].size();
  EXPECT_EQ(bench["benchmarks"].size(), runs);
  EXPECT_EQ(runs, read_json(single_ + "/benchmark.json")["benchmarks"].size());
  // meta.json: the shards' summaries, in shard order, and the hosts
  const auto meta = read_json(out + "/meta.json");
  ASSERT_EQ(meta["shards"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(meta["shards"][size_t(i)]["index"], i);
    EXPECT_EQ(meta["shards"][size_t(i)]["host"], this_host());
    EXPECT_TRUE(meta["shards"][size_t(i)].contains("duration_s"));
    EXPECT_TRUE(meta["shards"][size_t(i)].contains("cpu_model"));
    EXPECT_TRUE(meta["shards"][size_t(i)].contains("git_commit"));
  }
  EXPECT_EQ(meta["hosts"], nlohmann::json::array({this_host()}));
  EXPECT_EQ(meta["sweep_definition"], read_json(single_ + "/meta.json")["sweep_definition"]);
  EXPECT_EQ(meta["rows"], 16);
  EXPECT_FALSE(meta.contains("shard"));
  // patterns: the entries (and files) the unsharded sweep stored
  const auto single_index = test::read_lines(single_ + "/patterns/index.csv"),
             merged_index = test::read_lines(out + "/patterns/index.csv");
  EXPECT_EQ(merged_index, single_index);
  for (size_t i = 1; i < merged_index.size(); ++i) {
    const auto f = split_csv_line(merged_index[i]);
    const std::string file = f[f.size() - 2];
    if (!file.empty()) {
      EXPECT_TRUE(fs::is_regular_file(out + "/patterns/" + file)) << file;
      EXPECT_EQ(test::read_lines(out + "/patterns/" + file),
                test::read_lines(single_ + "/patterns/" + file))
          << file;
    }
  }
  EXPECT_TRUE(fs::is_regular_file(out + "/plan.json"));
}

TEST_F(ShardedSweep, MergeRefusals) {
  ASSERT_FALSE(HasFatalFailure());
  TempDir tmp;
  const std::string out = tmp.file("merged");
  auto refused = [&](const std::string& args, const std::vector<std::string>& needles) {
    const CliResult r = run_cli(args, tmp);
    EXPECT_EQ(r.code, 2) << "attnbench " << args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("attnbench: error: ", 0), 0u) << r.err;
    for (const auto& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << n << "\n" << r.err;
    return r;
  };
  // another commit
  const std::string other_commit = copy_of(shards_[1], "other_commit", tmp);
  auto meta = read_json(other_commit + "/meta.json");
  meta["git_commit"] = "0123456789abcdef0123456789abcdef01234567";
  write_json(other_commit + "/meta.json", meta);
  refused("merge" + shard_args({shards_[0], other_commit}) + " --out " + q(out),
          {"git commit", "0123456789abcdef0123456789abcdef01234567", other_commit, shards_[0]});
  // another definition
  const std::string other_def = copy_of(shards_[1], "other_def", tmp);
  meta = read_json(other_def + "/meta.json");
  meta["sweep_definition"] = "00000000deadbeef";
  write_json(other_def + "/meta.json", meta);
  refused("merge" + shard_args({shards_[0], other_def}) + " --out " + q(out),
          {"sweep_definition", "00000000deadbeef", other_def});
  // a shard missing: its configurations are named, with their count
  const size_t n1 = read_csv(shards_[1] + "/results.csv").rows.size();
  const CliResult missing = refused(
      "merge" + shard_args({shards_[0]}) + " --out " + q(out),
      {fmt::format("{} of the sweep's 16 configurations", n1), "--allow-missing", "B=1,H=1,n="});
  const CliResult allowed =
      run_cli("merge" + shard_args({shards_[0]}) + " --allow-missing --out " + q(out), tmp);
  EXPECT_EQ(allowed.code, 0) << allowed.err;
  EXPECT_NE(allowed.err.find("warning"), std::string::npos) << allowed.err;
  EXPECT_EQ(read_csv(out + "/results.csv").rows.size(), 16 - n1);
  // a configuration with two different rows; the same row twice merges
  const std::string twin = copy_of(shards_[0], "twin", tmp);
  // (--force: `out` holds the merge above, moved aside)
  const auto same = run_cli(
      "merge" + shard_args({shards_[0], twin, shards_[1]}) + " --force --out " + q(out), tmp);
  EXPECT_EQ(same.code, 0) << same.err;
  EXPECT_EQ(read_csv(out + "/results.csv").rows.size(), 16u);
  auto lines = test::read_lines(twin + "/results.csv");
  ASSERT_GE(lines.size(), 2u);
  auto f = split_csv_line(lines[1]);
  const auto header = split_csv_line(lines[0]);
  const size_t t =
      size_t(std::find(header.begin(), header.end(), "time_median_s") - header.begin());
  f[t] = f[t].empty() ? "1" : f[t] + "1";
  lines[1] = csv_key(f);
  {
    std::ofstream o(twin + "/results.csv");
    for (const auto& l : lines) o << l << '\n';
  }
  refused("merge" + shard_args({shards_[0], twin, shards_[1]}) + " --out " + q(out),
          {"different rows in two shards", shards_[0], twin});
  // --out among the inputs; a directory without results.csv
  refused("merge" + shard_args(shards_) + " --out " + q(shards_[1]), {"--out", "one of"});
  fs::create_directories(tmp.file("empty"));
  refused("merge" + shard_args({shards_[0], tmp.file("empty")}) + " --out " + q(out),
          {"has no results.csv", tmp.file("empty")});
  // another CPU model: a warning, refused with --strict
  const std::string other_cpu = copy_of(shards_[1], "other_cpu", tmp);
  meta = read_json(other_cpu + "/meta.json");
  meta["cpu_model"] = "Imaginary CPU 9000";
  write_json(other_cpu + "/meta.json", meta);
  const auto warned =
      run_cli("merge" + shard_args({shards_[0], other_cpu}) + " --force --out " + q(out), tmp);
  EXPECT_EQ(warned.code, 0) << warned.err;
  EXPECT_NE(warned.err.find("Imaginary CPU 9000"), std::string::npos) << warned.err;
  refused("merge" + shard_args({shards_[0], other_cpu}) + " --strict --out " + q(out),
          {"Imaginary CPU 9000", "--strict"});
}

TEST_F(ShardedSweep, ShardResumes) {
  ASSERT_FALSE(HasFatalFailure());
  TempDir tmp;
  const std::string dir = copy_of(shards_[1], "resumed", tmp);
  const auto before = test::read_lines(dir + "/results.csv");
  ASSERT_GE(before.size(), 3u);
  // the last row lost, and the file written before the host column existed
  const auto header = split_csv_line(before[0]);
  ASSERT_EQ(header.back(), "host");
  {
    std::ofstream o(dir + "/results.csv");
    for (size_t i = 0; i + 1 < before.size(); ++i) {
      auto f = split_csv_line(before[i]);
      f.pop_back();
      o << csv_key(f) << '\n';
    }
  }
  const CliResult r = run_cli(kSweep + " --shard 1/2 --resume --out " + q(dir), tmp);
  ASSERT_EQ(r.code, 0) << r.err;
  const Csv after = read_csv(dir + "/results.csv");
  EXPECT_EQ(after.header, header);
  EXPECT_EQ(keys_of(after), keys_of(read_csv(shards_[1] + "/results.csv")));
  for (size_t i = 0; i + 1 < after.rows.size(); ++i)
    EXPECT_EQ(after.rows[i].at("host"), "") << "a kept row of the older file";
  EXPECT_EQ(after.rows.back().at("host"), this_host());
  EXPECT_NE(r.err.find(fmt::format("{} kept", before.size() - 2)), std::string::npos) << r.err;
  // the resumed shard merges with the others
  const CliResult m =
      run_cli("merge" + shard_args({shards_[0], dir}) + " --out " + q(tmp.file("merged")), tmp);
  EXPECT_EQ(m.code, 0) << m.err;
}

TEST(ShardCli, BadShardValues) {
  TempDir tmp;
  for (const char* bad : {"3/2", "a/b", "0/0", "-1/4"}) {
    const CliResult r = run_cli(fmt::format("sweep --variant flash --seq 64 --shard {} --out {}",
                                            q(bad), q(tmp.file("out"))),
                                tmp);
    EXPECT_EQ(r.code, 2) << bad << "\n" << r.err;
    EXPECT_NE(r.err.find("i/N with 0 <= i < N"), std::string::npos) << bad << "\n" << r.err;
    EXPECT_FALSE(fs::exists(tmp.file("out"))) << "--shard " << bad << " made its directory";
  }
  const CliResult also = run_cli(
      "sweep --variant flash --seq 64 --also '--shard 0/2' --out " + q(tmp.file("out")), tmp);
  EXPECT_EQ(also.code, 2) << also.err;
  EXPECT_NE(also.err.find("--shard belongs to the whole sweep"), std::string::npos) << also.err;
}

TEST(ShardCli, ShardPlan) {
  TempDir tmp;
  const CliResult r = run_cli(kSweep + " --shard-plan 3 --out " + q(tmp.file("out")), tmp);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("imbalance (longest / mean shard): "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("total       16"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp.file("out/results.csv"))) << "--shard-plan ran the sweep";
}

}  // namespace
}  // namespace attnbench
