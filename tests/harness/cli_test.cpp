// End-to-end tests through the real attnbench binary (ATTNBENCH_BIN): exit codes, messages,
// JSON and the result files of a sweep. Every run is tiny; `sweep` measures the machine
// first (several seconds), so there are only three sweeps.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/patterns/pattern.h"
#include "common/reference/reference.h"
#include "harness/machine.h"
#include "harness/results.h"
#include "test_util.h"

namespace attnbench {
namespace {

namespace fs = std::filesystem;
using test::CliResult;
using test::run_cli;
using test::TempDir;

std::string q(const std::string& s) { return "'" + s + "'"; }

nlohmann::json parse_json(const std::string& text) {
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not valid JSON (" << e.what() << "):\n" << text;
    return nlohmann::json();
  }
}

// A results.csv: its header and its rows as column -> value maps.
struct Csv {
  std::vector<std::string> header;
  std::vector<std::map<std::string, std::string>> rows;
  std::vector<std::string> lines;  // data lines as written
};

Csv read_csv(const std::string& path) {
  Csv csv;
  auto lines = test::read_lines(path);
  if (lines.empty()) {
    ADD_FAILURE() << path << " is empty";
    return csv;
  }
  csv.header = split_csv_line(lines[0]);
  for (size_t i = 1; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    auto f = split_csv_line(lines[i]);
    EXPECT_EQ(f.size(), csv.header.size()) << "line " << i << ": " << lines[i];
    std::map<std::string, std::string> row;
    for (size_t c = 0; c < std::min(f.size(), csv.header.size()); ++c) row[csv.header[c]] = f[c];
    csv.rows.push_back(row);
    csv.lines.push_back(lines[i]);
  }
  return csv;
}

// The configuration key of a row (what --resume matches on).
std::string key_of(const std::map<std::string, std::string>& row) {
  std::string k;
  for (const char* c :
       {"spec", "batch", "heads", "n", "m", "dim", "causal", "input", "scale", "seed", "threads"})
    k += row.at(c) + "|";
  return k;
}

// Every row of `csv` has a configuration key of its own.
void expect_one_row_per_key(const Csv& csv) {
  std::set<std::string> keys;
  for (const auto& row : csv.rows)
    EXPECT_TRUE(keys.insert(key_of(row)).second) << "duplicate row " << key_of(row);
}

// A sweep through the binary that must succeed, and the results.csv it wrote in `out`.
struct SweepRun {
  CliResult result;
  Csv csv;
};
SweepRun run_sweep(const std::string& args, const TempDir& dir, const std::string& out) {
  SweepRun s{run_cli(args, dir), {}};
  EXPECT_EQ(s.result.code, 0) << "attnbench " << args << "\n" << s.result.err;
  if (s.result.code == 0) s.csv = read_csv(out + "/results.csv");
  return s;
}

// The progress lines of a sweep's stderr.
std::vector<std::string> progress_lines(const std::string& err) {
  std::istringstream in(err);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    if (line.rfind("[", 0) == 0) lines.push_back(line);
  return lines;
}

void expect_usage_error(const CliResult& r, const std::string& args) {
  EXPECT_EQ(r.code, 2) << "attnbench " << args << "\nstdout: " << r.out << "\nstderr: " << r.err;
  EXPECT_FALSE(r.err.empty()) << "attnbench " << args << ": no message on stderr";
  // one format for every error, the command-line parser's included
  EXPECT_EQ(r.err.rfind("attnbench: error: ", 0), 0u) << "attnbench " << args << ": " << r.err;
}

// ----- list -----

TEST(Cli, List) {
  TempDir dir;
  CliResult r = run_cli("list", dir);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "full");
  EXPECT_CONTAINS(r.out, "flash");
  EXPECT_CONTAINS(r.out, "block_q");
}

TEST(Cli, ListOneVariantOrOneLineEach) {
  TempDir dir;
  CliResult r = run_cli("list local", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "window=256");
  EXPECT_EQ(r.out.find("block_q"), std::string::npos) << "list local printed other variants";
  r = run_cli("list --json local flash", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = parse_json(r.out);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0].at("name"), "local");
  EXPECT_EQ(j[1].at("name"), "flash");
  r = run_cli("list --brief", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> lines;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  CliResult all = run_cli("list --json", dir);
  ASSERT_EQ(all.code, 0) << all.err;
  ASSERT_EQ(lines.size(), parse_json(all.out).size() + 2) << r.out;
  for (const std::string& line : lines) EXPECT_LE(line.size(), 100u) << line;
  EXPECT_EQ(lines[1].rfind("bigbird ", 0), 0u) << lines[1];
  r = run_cli("list flsh", dir);
  expect_usage_error(r, "list flsh");
  EXPECT_CONTAINS(r.err, "unknown variant 'flsh' (did you mean 'flash'?)");
}

TEST(Cli, ListJson) {
  TempDir dir;
  CliResult r = run_cli("list --json", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = parse_json(r.out);
  ASSERT_TRUE(j.is_array());
  std::map<std::string, nlohmann::json> by_name;
  for (const auto& v : j) by_name[v.at("name").get<std::string>()] = v;
  ASSERT_TRUE(by_name.count("full"));
  ASSERT_TRUE(by_name.count("flash"));
  const auto& flash = by_name["flash"];
  EXPECT_EQ(flash.at("causal"), true);
  EXPECT_EQ(flash.at("cross"), true);
  EXPECT_EQ(flash.at("key_padding"), true);
  EXPECT_EQ(flash.at("attn_mask"), true);
  EXPECT_EQ(by_name.at("nystrom").at("attn_mask"), false);
  ASSERT_EQ(flash.at("params").size(), 2u);
  EXPECT_EQ(flash["params"][0].at("name"), "block_q");
  EXPECT_EQ(flash["params"][0].at("type"), "int");
  EXPECT_EQ(flash["params"][0].at("default"), "64");
  EXPECT_EQ(flash["params"][0].at("range"), nlohmann::json::array({1, 4096}));
  EXPECT_EQ(flash["params"][1].at("name"), "block_k");
  EXPECT_TRUE(by_name["full"].at("params").empty());
}

// ----- run -----

TEST(Cli, RunJson) {
  TempDir dir;
  const std::string args =
      "run --variant flash --seq 64 --heads 2 --dim 16 --reps 1 --min-time 0.01 --json";
  CliResult r = run_cli(args, dir);
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = parse_json(r.out);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.at("status"), "ok");
  EXPECT_EQ(j.at("spec"), "flash:block_q=64,block_k=256");
  EXPECT_EQ(j.at("n"), 64);
  EXPECT_EQ(j.at("m"), 64);
  EXPECT_EQ(j.at("heads"), 2);
  EXPECT_EQ(j.at("dim"), 16);
  EXPECT_EQ(j.at("input"), "gaussian");
  ASSERT_TRUE(j.at("rel_fro_error").is_number());
  EXPECT_LT(j["rel_fro_error"].get<double>(), 1e-5);
  EXPECT_EQ(j.at("error_rows"), 128);
  EXPECT_GT(j.at("time_median_s").get<double>(), 0);
  EXPECT_EQ(j.at("reps"), 1);
  // every CSV column is a JSON field, in the same order
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  std::vector<std::string> cols = csv_columns();
  std::sort(keys.begin(), keys.end());
  std::sort(cols.begin(), cols.end());
  EXPECT_EQ(keys, cols);
}

TEST(Cli, RunTakesCausalBareOrOnOrOff) {
  TempDir dir;
  const std::string args =
      "run --variant flash --seq 32 --heads 1 --dim 8 --reps 1 --min-time 0 --json ";
  for (const auto& [words, causal] :
       std::vector<std::pair<std::string, bool>>{{"--causal", true},
                                                 {"--causal on", true},
                                                 {"--causal=on", true},
                                                 {"--causal off", false},
                                                 {"--causal --pass fwd", true},
                                                 {"", false}}) {
    CliResult r = run_cli(args + words, dir);
    ASSERT_EQ(r.code, 0) << words << ": " << r.err;
    EXPECT_EQ(parse_json(r.out).at("causal"), causal) << words;
  }
  // a size with k, and the text of one repetition: no spread, not x1.00
  CliResult r =
      run_cli("run --variant flash --seq 1k --heads 1 --dim 8 --reps 1 --min-time 0", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "n=1024");
  EXPECT_CONTAINS(r.out, "no spread (one repetition)");
  EXPECT_EQ(r.out.find("processes not measured (run too short) processors"), std::string::npos);
}

// A sweep says how long it expects to take, leads its progress lines with n, and ends with a
// table of what it measured at its largest n (speed over flash on the same problem) and the
// command that plots it.
TEST(Cli, ASweepEndsWithATableAndTheNextCommand) {
  TempDir dir;
  const std::string out = dir.file("s");
  CliResult r = run_cli(
      "sweep --variant flash --variant local:window=16 --seq 32,64 --heads 1 "
      "--dim 8 --causal on --reps 1 --min-time 0 --out " +
          q(out),
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "4 configurations to measure, estimated ");
  EXPECT_CONTAINS(r.err, "| n=32 causal fwd: flash:");
  EXPECT_CONTAINS(r.out, "At n = 64, causal, input gaussian: fwd time");
  // the table's lines: a header and one line per variant at n = 64
  std::vector<std::string> lines;
  for (size_t at = 0, end; at < r.out.size(); at = end + 1) {
    end = r.out.find('\n', at);
    if (end == std::string::npos) end = r.out.size();
    lines.push_back(r.out.substr(at, end - at));
  }
  const auto starting = [&](const std::string& start) {
    std::vector<std::string> found;
    for (const auto& l : lines)
      if (l.rfind(start, 0) == 0) found.push_back(l);
    return found;
  };
  ASSERT_EQ(starting("variant ").size(), 1u) << r.out;
  EXPECT_CONTAINS(starting("variant ")[0], "fwd x flash");
  // one line per variant, named by its non-default parameters
  ASSERT_EQ(starting("flash ").size(), 1u) << "one line per variant: " << r.out;
  ASSERT_EQ(starting("local:window=16 ").size(), 1u) << r.out;
  EXPECT_CONTAINS(starting("flash ")[0], " 1.00 ");
  EXPECT_CONTAINS(r.out, "Next: ");
  EXPECT_CONTAINS(r.out, "plot.py " + out);
}

// --profile quick: its problems in one sweep (the plan of one variant: 4 lengths x causal off
// and on x fwd and fwdbwd, one decode context, 4 lengths x 2 inputs), refusing problem options
// beside it.
TEST(Cli, TheQuickProfile) {
  TempDir dir;
  CliResult r = run_cli(
      "sweep --profile quick --variant flash --shard-plan 1 --out " + q(dir.file("p")), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "total       25");
  EXPECT_CONTAINS(r.err,
                  "--profile quick: --seq 512..4096 --causal both --pass fwd,fwdbwd --reps 2 "
                  "--min-time 0.05 --also='--seq 4096 --causal on --pass decode --variant flash'");
  r = run_cli("sweep --profile quick --seq 256 --out " + q(dir.file("p")), dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--seq with --profile quick: the profile sets the problems");
  r = run_cli("sweep --profile qick --out " + q(dir.file("p")), dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "quick");
  r = run_cli("sweep --variant flash --seq 64 --also '--profile quick' --out " + q(dir.file("p")),
              dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "--profile belongs to the whole sweep");
}

// A run estimated above 10 s says so and reports its stages; --max-time refuses one estimated
// above it, before any work. The estimate prices a pass at half the machine's GEMM rate: kept
// figures of a very slow machine make a small problem a long one.
TEST(Cli, LongRunsSpeak) {
  TempDir dir;
  CliResult r = run_cli("run --variant full --seq 64k --heads 64 --max-time 60", dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_CONTAINS(r.err, "full on B=1,H=64,n=65536");
  EXPECT_CONTAINS(r.err, "above --max-time 60; a smaller problem");

  test::ScopedEnv kept(kMachineDirVariable, dir.file("machine"));
  const std::string run =
      "run --variant flash --seq 64 --heads 1 --dim 8 --reps 2 --min-time 0 --threads 1";
  r = run_cli(run, dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("estimated"), std::string::npos) << r.err;
  const std::string file = kept_machine_file(1, /*quick=*/true);
  nlohmann::json m = nlohmann::json::parse(test::read_text(file));
  m["gemm_gflops"] = 1e-6;  // 1000 FLOP/s: a pass of flash's 4 n^2 d FLOPs takes minutes
  m["bf16_gflops"] = 1e-6;
  std::ofstream(file) << m.dump();
  r = run_cli(run, dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "attnbench: estimated ");
  EXPECT_CONTAINS(r.err, " s a pass at half the machine's 1e-06 GFLOP/s, 2 repetitions");
  EXPECT_CONTAINS(r.err, "] the checked pass and its error against the float64 reference");
  EXPECT_CONTAINS(r.err, "] 2 timed repetitions, each at least ");
  EXPECT_LT(r.err.find("] the checked pass"), r.err.find("] 2 timed repetitions"));
  r = run_cli(run + " --max-time 60", dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_CONTAINS(r.err, "flash:block_q=64,block_k=256 on B=1,H=1,n=64");
  EXPECT_CONTAINS(r.err, "above --max-time 60");
}

TEST(Cli, RunWritesTheOutput) {
  TempDir dir;
  const std::string out = dir.file("out.npy");
  CliResult r = run_cli(
      "run --variant full --seq 64 --heads 2 --dim 16 --causal --reps 1 "
      "--min-time 0.01 --output " +
          q(out),
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  NpyArray a = read_npy(out);
  EXPECT_EQ(a.dtype, "<f4");
  ASSERT_EQ(a.shape, (std::vector<int64_t>{1, 2, 64, 16}));
  // it is the attention of the problem's own inputs (seed 0, gaussian)
  Problem p;
  p.batch = 1, p.heads = 2, p.n = 64, p.dim = 16, p.causal = true, p.seed = 0;
  Inputs in = generate_inputs(p);
  auto ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
  ASSERT_EQ(a.data.size(), ref.size() * sizeof(float));
  EXPECT_LT(test::rel_fro_error(reinterpret_cast<const float*>(a.data.data()), ref), 1e-5);
}

// --key-padding and --attn-mask on run: the row carries them (key columns and name), the error
// is against the masked reference, and a bad mask or length list is refused with a message
// saying what is accepted.
TEST(Cli, RunWithMasks) {
  TempDir dir;
  const std::string mask = dir.file("m.npy");
  NpyArray a;
  a.dtype = "|b1";
  a.shape = {48, 48};
  a.data.assign(48 * 48, 0);
  for (int64_t j = 0; j < 48; ++j) a.data[size_t(5 * 48 + j)] = 1;  // row 5: no key
  for (int64_t i = 0; i < 48; ++i) a.data[size_t(i * 48 + (i * 7) % 48)] = 1;
  write_npy(mask, a);
  const std::string base =
      "run --variant flash --seq 48 --batch 2 --heads 2 --dim 16 --reps 1 "
      "--min-time 0 --json ";
  CliResult r = run_cli(base + "--key-padding 30,48 --attn-mask " + q(mask), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = parse_json(r.out);
  EXPECT_EQ(j.at("key_padding"), "30+48");
  EXPECT_EQ(j.at("attn_mask"), "m.npy");
  EXPECT_LT(j.at("rel_fro_error").get<double>(), 1e-5);
  EXPECT_CONTAINS(j.at("notes").get<std::string>(), "4 masked rows without keys");
  // without masks the row's columns are empty
  r = run_cli(base, dir);
  ASSERT_EQ(r.code, 0) << r.err;
  j = parse_json(r.out);
  EXPECT_EQ(j.at("key_padding"), "");
  EXPECT_EQ(j.at("attn_mask"), "");
  // a variant without the capability refuses
  r = run_cli(
      "run --variant nystrom --seq 48 --dim 16 --reps 1 --min-time 0 --attn-mask " + q(mask), dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_CONTAINS(r.err, "does not support an attention mask");
  // a mask of the wrong shape, dtype or with NaN
  a.shape = {48, 47};
  a.data.resize(48 * 47);
  write_npy(mask, a);
  r = run_cli(base + "--attn-mask " + q(mask), dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "attention mask of shape [48, 47]");
  EXPECT_CONTAINS(r.err, "accepted");
  NpyArray f;
  f.dtype = "<f8";
  f.shape = {48, 48};
  f.data.assign(48 * 48 * 8, 0);
  write_npy(mask, f);
  r = run_cli(base + "--attn-mask " + q(mask), dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "dtype '<f8'");
  f.dtype = "<f4";
  f.data.assign(48 * 48 * 4, 0);
  const float nan = NAN;
  std::memcpy(f.data.data() + 4 * 100, &nan, 4);
  write_npy(mask, f);
  r = run_cli(base + "--attn-mask " + q(mask), dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "nan at flat index 100");
  r = run_cli(base + "--key-padding 30,48,2", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "3 lengths for a batch of 2");
  r = run_cli(base + "--key-padding 49", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "out of range");
}

// A sweep over key padding settings and a padding fraction: one row per setting, and a
// results file written before the mask columns existed still resumes.
TEST(Cli, SweepKeyPaddingAndOldResultsFiles) {
  TempDir dir;
  const std::string out = dir.file("r");
  const std::string base =
      "sweep --variant flash --seq 64 --batch 2 --heads 1 --dim 8 --reps 1 "
      "--min-time 0 --out " +
      q(out);
  auto [r, csv] = run_sweep(base + " --key-padding '10,64;none' --padding-fraction 0.5", dir, out);
  ASSERT_EQ(csv.rows.size(), 3u);
  EXPECT_EQ(csv.rows[0].at("key_padding"), "10+64");
  EXPECT_EQ(csv.rows[1].at("key_padding"), "");
  EXPECT_NE(csv.rows[2].at("key_padding"), "");
  for (const auto& row : csv.rows) EXPECT_EQ(row.at("status"), "ok") << row.at("message");
  // the same file without the two columns, as an older attnbench wrote it
  std::vector<size_t> keep;
  for (size_t c = 0; c < csv.header.size(); ++c)
    if (csv.header[c] != "key_padding" && csv.header[c] != "attn_mask") keep.push_back(c);
  auto old_line = [&](const std::vector<std::string>& f) { return test::csv_line_of(f, keep); };
  std::string text = old_line(csv.header);
  std::vector<std::string> unpadded;
  for (const auto& c : csv.header) unpadded.push_back(csv.rows[1].at(c));
  text += old_line(unpadded);
  test::write_text(out + "/results.csv", text);
  r = run_cli(base + " --key-padding 'none;10,64' --resume", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "1 kept");
  Csv csv2 = read_csv(out + "/results.csv");
  EXPECT_EQ(csv2.header, csv_columns());
  ASSERT_EQ(csv2.rows.size(), 2u);
  EXPECT_EQ(csv2.rows[0].at("key_padding"), "");
  EXPECT_EQ(csv2.rows[1].at("key_padding"), "10+64");
}

TEST(Cli, PatternExportsTheAttendedPairs) {
  TempDir dir;
  const std::string out = dir.file("pattern.npy");
  // causal local window of 2 on n = 10, m = 12: query i sees keys a(i) - 2 .. a(i), a(i) = i + 2
  CliResult r = run_cli(
      "pattern --variant local:window=2,block=3 --seq 10 --seq-k 12 --causal "
      "--head 1 --output " +
          q(out),
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  NpyArray a = read_npy(out);
  EXPECT_EQ(a.dtype, "|u1");
  ASSERT_EQ(a.shape, (std::vector<int64_t>{10, 12}));
  int64_t wrong = 0;
  for (int64_t i = 0; i < 10; ++i)
    for (int64_t j = 0; j < 12; ++j) {
      const bool want = j <= i + 2 && j >= i;
      wrong += (a.data[size_t(i * 12 + j)] != 0) != want;
    }
  EXPECT_EQ(wrong, 0);
  // a variant without a pattern, a variant that refuses the problem, a bad head
  CliResult none = run_cli("pattern --variant flash --seq 10 --output " + q(out), dir);
  expect_usage_error(none, "pattern --variant flash");
  EXPECT_CONTAINS(none.err, "no attention pattern");
  CliResult refused =
      run_cli("pattern --variant bigbird --seq 10 --seq-k 12 --output " + q(out), dir);
  EXPECT_NE(refused.code, 0);
  EXPECT_CONTAINS(refused.err, "m != n");
}

// pattern generates only the exported head's inputs; a data-dependent pattern of that head
// must be the one a run on the whole problem uses.
TEST(Cli, PatternOfOneHeadMatchesTheWholeProblem) {
  TempDir dir;
  for (const std::string input : {"gaussian", "local", "clustered", "lowrank"}) {
    for (const std::string spec : {"reformer:chunk=16", "sinkhorn:block=8"}) {
      const std::string out = dir.file("p.npy");
      CliResult r =
          run_cli("pattern --variant " + spec + " --seq 48 --dim 8 --head 5 --seed 3 --input " +
                      input + " --output " + q(out),
                  dir);
      ASSERT_EQ(r.code, 0) << r.err;
      NpyArray a = read_npy(out);
      Problem p;
      p.batch = 1, p.heads = 6, p.n = 48, p.dim = 8, p.seed = 3;
      const Workload w = test::workload(input);
      Inputs in = generate_inputs(p, w);
      Inputs one = generate_head_inputs(p, 0, 5, w);
      EXPECT_EQ(0, std::memcmp(one.q.data(), in.q.view().head(0, 5), 48 * 8 * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(one.k.data(), in.k.view().head(0, 5), 48 * 8 * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(one.v.data(), in.v.view().head(0, 5), 48 * 8 * sizeof(float)));
      auto v = make_variant(spec);
      auto pat = v->make_pattern(p, in.q.view(), in.k.view());
      ASSERT_TRUE(pat);
      std::vector<uint8_t> row(48);
      int64_t wrong = 0;
      for (int64_t i = 0; i < 48; ++i) {
        pattern_row(p, *pat, 0, 5, i, row.data());
        for (int64_t j = 0; j < 48; ++j)
          wrong += (a.data[size_t(i * 48 + j)] != 0) != (row[size_t(j)] != 0);
      }
      EXPECT_EQ(wrong, 0) << spec << " on " << input;
    }
  }
}

TEST(Cli, RunFromAnInputsFile) {
  TempDir dir;
  Problem p;
  p.batch = 1, p.heads = 2, p.n = 32, p.m = 48, p.dim = 16, p.seed = 99;
  Inputs in = generate_inputs(p, test::workload("clustered"));
  const std::string path = dir.file("in.npz"), out = dir.file("out.npy");
  write_npz(path, {{"q", to_npy(in.q)}, {"k", to_npy(in.k)}, {"v", to_npy(in.v)}});
  CliResult r = run_cli("run --variant flash:block_q=5,block_k=7 --inputs " + q(path) +
                            " --causal --reps 1 --min-time 0.01 --json --output " + q(out),
                        dir);
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = parse_json(r.out);
  EXPECT_EQ(j.at("status"), "ok");
  EXPECT_EQ(j.at("input"), "file");
  EXPECT_EQ(j.at("n"), 32);
  EXPECT_EQ(j.at("m"), 48);
  EXPECT_EQ(j.at("heads"), 2);
  EXPECT_EQ(j.at("dim"), 16);
  EXPECT_EQ(j.at("causal"), true);
  EXPECT_LT(j.at("rel_fro_error").get<double>(), 1e-5);
  p.causal = true;
  NpyArray a = read_npy(out);
  ASSERT_EQ(a.shape, (std::vector<int64_t>{1, 2, 32, 16}));
  auto ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
  EXPECT_LT(test::rel_fro_error(reinterpret_cast<const float*>(a.data.data()), ref), 1e-5);
}

// ----- sizes -----

// Element counts that overflow int64 once wrapped to 0, so the memory guard and the
// truncation checks passed and kernels walked off a tiny buffer.
TEST(Sizes, OverflowingShapesAreRefused) {
  const int64_t big = int64_t(1) << 32;
  EXPECT_THROW(Tensor(Shape4{big, big, 1, 1}), InputError);
  EXPECT_THROW(Tensor(Shape4{big, big, big, 1}), InputError);
  EXPECT_THROW(Tensor(Shape4{1, -1, 1, 1}), InputError);
  Problem p;
  p.batch = Problem::kMaxBatchOrHeads, p.heads = Problem::kMaxBatchOrHeads, p.n = 1, p.dim = 1;
  EXPECT_NO_THROW(p.validate());  // 2^48 elements: refused later by the memory guard
  p.n = p.dim = 1 << 20;          // q alone would hold 2^88 elements
  try {
    p.validate();
    ADD_FAILURE() << "accepted " << p.str();
  } catch (const UsageError& e) {
    EXPECT_CONTAINS(std::string(e.what()), "exceeds");
  }
  p.batch = p.heads = 1, p.n = 1 << 30, p.m = 1 << 30, p.dim = 1;  // n m = 2^60 scores
  EXPECT_THROW(p.validate(), UsageError);
  p.heads = Problem::kMaxBatchOrHeads + 1, p.n = p.m = 1;
  EXPECT_THROW(p.validate(), UsageError);
}

// ----- bad command lines -----

TEST(Cli, BadArgumentsExitWithUsageErrors) {
  TempDir dir;
  // input files with a NaN, with float64 q
  Problem p;
  p.batch = 1, p.heads = 1, p.n = 8, p.dim = 4;
  Inputs in = generate_inputs(p);
  NpyArray qa = to_npy(in.q), ka = to_npy(in.k), va = to_npy(in.v);
  NpyArray nan_q = qa;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan_q.data.data() + 4 * 5, &nan, 4);
  write_npz(dir.file("nan.npz"), {{"q", nan_q}, {"k", ka}, {"v", va}});
  NpyArray f8{"<f8", qa.shape, std::vector<char>(qa.data.size() * 2, 0)};
  write_npz(dir.file("f8.npz"), {{"q", f8}, {"k", ka}, {"v", va}});
  write_npz(dir.file("good.npz"), {{"q", qa}, {"k", ka}, {"v", va}});
  const std::string sweep_out = dir.file("sweep_out");

  const std::string run = "run --reps 1 --min-time 0.01 ";
  struct Case {
    std::string args, wanted;  // wanted: a piece of the stderr message
  };
  const std::vector<Case> cases = {
      {run + "--variant nosuch", "flash"},
      {run + "--variant nosuch", "nosuch"},
      {run + "--variant flash:block_q", "malformed"},
      {run + "--variant flash:block_q=0", "[1, 4096]"},
      {run + "--variant flash:bogus=1", "block_k"},
      {"bogus", "unknown command 'bogus'"},
      {"--plugin x.so bogus", "unknown command 'bogus'"},
      {"", "subcommand"},
      {run, "--variant"},
      {run + "--variant flash --seq 0", "--seq"},
      {run + "--variant flash --seq abc", "abc"},
      {run + "--variant flash --seq -5", "--seq"},
      {run + "--variant flash --dim 0", "--dim"},
      {run + "--variant flash --causal both", "sweep --causal both"},
      {run + "--variant flash --causal maybe", "'maybe' is not on or off"},
      {run + "--variant flash --causal=bogus", "bogus"},
      {run + "--variant flash --input bogus", "bogus"},
      {run + "--variant flash --reps 0", "--reps"},
      {run + "--variant flash --scale 0", "--scale"},
      {run + "--variant flash --inputs " + q(dir.file("missing.npz")), "missing.npz"},
      {run + "--variant flash --inputs " + q(dir.file("nan.npz")), "non-finite"},
      {run + "--variant flash --inputs " + q(dir.file("f8.npz")), "float32"},
      {run + "--variant flash --inputs " + q(dir.file("good.npz")) + " --input local", "--input"},
      {run + "--variant flash --min-time nan", "[0, 3600]"},
      {run + "--variant flash --min-time -1", "[0, 3600]"},
      {run + "--variant flash --threads 100000", "[0, "},
      {run + "--variant flash --threads -1", "--threads"},
      {"machine --threads 100000", "[0, "},
      {run + "--variant flash --batch 4294967296 --heads 4294967296 --seq 1 --dim 1", "--batch"},
      {run + "--variant flash --seq 99999999999999999999", "out of range"},
      {run + "--variant flash --seq 1.5", "not an integer"},
      {run + "--variant flash --seed -1", "not a seed"},
      {run + "--variant flash --seed 18446744073709551616", "not a seed"},
      {run + "--variant flash --inputs " + q(dir.file("good.npz")) + " --seq 512", "disagrees"},
      {run + "--variant flash --inputs " + q(dir.file("good.npz")) + " --heads 7", "--heads 7"},
      {"pattern --variant local --seq 64 --head 16777216 --output " + q(dir.file("p.npy")),
       "--head"},
      {"sweep --variant flash --seq 3000000000 --out " + q(sweep_out), "larger than"},
      {"sweep --variant flash --heads 16777217 --out " + q(sweep_out), "2^24"},
      {"sweep --variant flash --seq 10..5 --out " + q(sweep_out), "10..5"},
      {"sweep --variant flash --seq 32,abc --out " + q(sweep_out), "abc"},
      {"sweep --variant flash --dim 0 --out " + q(sweep_out), "--dim"},
      {"sweep --variant flash --causal maybe --out " + q(sweep_out), "maybe"},
      {"sweep --variant flash --input gaussian,bogus --out " + q(sweep_out), "bogus"},
      {"sweep --variant nosuch --out " + q(sweep_out), "nosuch"},
      {"sweep --variant flash --seq 32", "--out"},
      {"sweep --variant flash --seq 256..5000 --out " + q(sweep_out), "256..5000:x2"},
      {"sweep --variant flash --seq 256..5000:x1 --out " + q(sweep_out), "integer >= 2"},
      {"sweep --variant flash --batch 1..4:+0 --out " + q(sweep_out), "--batch"},
      {"sweep --variant flash --seq-k 64,often --out " + q(sweep_out), "often"},
      {"sweep --variant flash --seq 64 --seq-k 64 --scale 1,0 --out " + q(sweep_out), "--scale"},
      {"sweep --variant flash --embed 64 --scale 2 --out " + q(sweep_out), "--scale 2"},
      {"sweep --variant 'local:window=|64' --out " + q(sweep_out), "parameter 'window'"},
      {"sweep --variant 'local:window=64||128' --out " + q(sweep_out), "parameter 'window'"},
      {"sweep --variant 'local:window=64|64' --out " + q(sweep_out), "'64' twice"},
      {"sweep --out " + q(sweep_out) + " --also='--scale -1'", "--scale"},
      // a grid is a sweep feature: the commands that run one spec say so
      {run + "--variant 'local:window=64|128'", "sweep feature"},
      {run + "--variant 'local:window=64|128'", "--variant 'local:window=64'"},
      {"layer --embed 16 --variant 'local:window=1|2'", "sweep feature"},
      {"pattern --seq 16 --variant 'local:window=1|2' --output " + q(dir.file("g.npy")),
       "sweep feature"},
      {run + "--variant 'local:window=|2'", "parameter 'window'"},
      // "did you mean": variants, parameters, options, commands; a parameter as an option
      {run + "--variant flsh", "unknown variant 'flsh' (did you mean 'flash'?)"},
      {run + "--variant Flash", "(did you mean 'flash'?)"},
      {run + "--variant local:windw=64", "no parameter 'windw' (did you mean 'window'?)"},
      {run + "--variant flash --causl", "did you mean --causal for --causl?"},
      {run + "--variant local --window 64",
       "not expected: --window 64; --window is a parameter of local: write it in the spec, "
       "--variant local:window=64"},
      {"sweep --variant local:block=32 --window=8 --out " + q(sweep_out),
       "--variant local:block=32,window=8"},
      {"swep --variant flash", "unknown command 'swep' (did you mean 'sweep'?)"},
      {run + "--variant flash --variant local", "sweep --variant flash --variant local"},
      {run + "--variant flash --seq 256,512", "`attnbench sweep --seq 256,512`"},
      {run + "--variant flash --seq 1..4", "run measures one length"},
      {run + "--variant flash --seq 2097152k", "out of range"},
      {"sweep --variant flash --seq 1k,2q --out " + q(sweep_out), "'2q'"},
  };
  for (const auto& c : cases) {
    CliResult r = run_cli(c.args, dir);
    expect_usage_error(r, c.args);
    EXPECT_CONTAINS(r.err, c.wanted) << "attnbench " << c.args;
  }
  // a sweep that fails on its arguments leaves no results behind
  EXPECT_FALSE(fs::exists(fs::path(sweep_out) / "results.csv"));
}

// ----- result files, in process -----

Row sample_row(int64_t n, const std::string& status = "ok") {
  Row r;
  r.spec = "flash:block_q=64,block_k=256";
  r.variant = "flash";
  r.problem.batch = 1, r.problem.heads = 2, r.problem.n = n, r.problem.dim = 16;
  r.workload.threads = 2;
  r.status = status;
  r.time_median = r.time_min = r.time_max = 1e-3;
  r.message = status == "ok" ? "" : "needs \"about\" 1 GiB, more than allowed";
  return r;
}

TEST(Results, CsvLineRoundTripsThroughSplit) {
  Row r = sample_row(64, "skipped");
  auto fields = split_csv_line(csv_line(r));
  ASSERT_EQ(fields.size(), csv_columns().size());
  std::map<std::string, std::string> row;
  for (size_t i = 0; i < fields.size(); ++i) row[csv_columns()[i]] = fields[i];
  EXPECT_EQ(row["spec"], r.spec);        // has commas: quoted in the file
  EXPECT_EQ(row["message"], r.message);  // has quotes and a comma
  EXPECT_EQ(row["n"], "64");
  EXPECT_EQ(row["m"], "64");
  EXPECT_EQ(row["causal"], "0");
  EXPECT_EQ(row["status"], "skipped");
  EXPECT_EQ(row["gflops"], "");  // NaN is an empty field
  EXPECT_EQ(split_csv_line("a,\"b,c\",\"d\"\"e\","),
            (std::vector<std::string>{"a", "b,c", "d\"e", ""}));
  EXPECT_NE(row_key(sample_row(64)), row_key(sample_row(128)));
  EXPECT_EQ(row_key(sample_row(64)), row_key(sample_row(64, "error")));
}

// With resume, a torn last line (no trailing newline, from an interrupted write) is dropped,
// so the next row starts on a line of its own and is not lost.
TEST(Results, ResumeAfterATornLastLine) {
  // An interrupted sweep can leave a partial last line without its newline. Resuming keeps
  // the complete rows, and the rows it appends must still be whole lines of their own.
  TempDir dir;
  const std::string out = dir.file("r");
  {
    ResultsDir rd(out, false);
    rd.append(sample_row(32), nlohmann::json());
  }
  {
    std::ofstream f(out + "/results.csv", std::ios::app);
    f << csv_line(sample_row(64)).substr(0, 25);  // torn: no newline
  }
  {
    ResultsDir rd(out, true);
    EXPECT_EQ(rd.rows_kept(), 1u);
    EXPECT_TRUE(rd.done(sample_row(32)));
    EXPECT_FALSE(rd.done(sample_row(64)));
    rd.append(sample_row(128), nlohmann::json());
  }
  auto lines = test::read_lines(out + "/results.csv");
  EXPECT_TRUE(std::find(lines.begin(), lines.end(), csv_line(sample_row(128))) != lines.end())
      << "the appended row is not a line of its own:\n"
      << test::read_text(out + "/results.csv");
  ResultsDir again(out, true);
  EXPECT_TRUE(again.done(sample_row(128)));
}

// With --force, both results.csv and benchmark.json start anew (the old ones moved aside, never
// deleted), even when no new row brings benchmark runs.
TEST(Results, WithForceOldFilesAreMovedAside) {
  TempDir dir;
  const std::string out = dir.file("r");
  {
    ResultsDir rd(out, false);
    nlohmann::json bench = {{"context", {{"host_name", "old"}}},
                            {"benchmarks", {{{"name", "old_run"}}}}};
    rd.append(sample_row(32), bench);
  }
  ASSERT_NE(test::read_text(out + "/benchmark.json").find("old_run"), std::string::npos);
  {
    ResultsDir rd(out, false, /*force=*/true);
    rd.append(sample_row(64, "skipped"), nlohmann::json());
  }
  Csv csv = read_csv(out + "/results.csv");
  ASSERT_EQ(csv.rows.size(), 1u);
  EXPECT_EQ(csv.rows[0].at("n"), "64");
  EXPECT_FALSE(test::read_text(out + "/benchmark.json").find("old_run") != std::string::npos)
      << "benchmark.json still holds the previous sweep's runs";
  bool aside = false;
  for (const auto& e : fs::directory_iterator(out))
    if (e.path().filename().string().rfind("earlier-", 0) == 0)
      aside = test::read_text((e.path() / "benchmark.json").string()).find("old_run") !=
              std::string::npos;
  EXPECT_TRUE(aside) << "the previous benchmark.json was not kept aside";
}

// A complete line that cannot be a finished row is reported, set aside (never deleted) and
// its configuration runs again.
TEST(Results, MalformedCompleteRowIsSetAsideAndRunAgain) {
  TempDir dir;
  const std::string out = dir.file("r");
  {
    ResultsDir rd(out, false);
    rd.append(sample_row(32), nlohmann::json());
  }
  std::string bad = csv_line(sample_row(64));
  bad.replace(bad.find(",ok,"), 4, ",bogus,");
  {
    std::ofstream f(out + "/results.csv", std::ios::app);
    f << bad << '\n';
  }
  ResultsDir rd(out, true);
  EXPECT_EQ(rd.rows_kept(), 1u);
  EXPECT_TRUE(rd.done(sample_row(32)));
  EXPECT_FALSE(rd.done(sample_row(64)));
  EXPECT_EQ(test::read_text(out + "/results.csv").find("bogus"), std::string::npos);
  EXPECT_CONTAINS(test::read_text(out + "/results.malformed.csv"), bad);
}

TEST(Results, UnreadableBenchmarkJsonIsSetAside) {
  TempDir dir;
  const std::string out = dir.file("r");
  {
    ResultsDir rd(out, false);
    rd.append(sample_row(32), nlohmann::json());
  }
  {
    std::ofstream f(out + "/benchmark.json");
    f << R"({"benchmarks":5})";
  }
  ResultsDir rd(out, true);
  nlohmann::json bench = {{"context", {{"host_name", "h"}}},
                          {"benchmarks", {{{"name", "new_run"}}}}};
  rd.append(sample_row(64), bench);  // once threw a raw JSON-library error
  EXPECT_EQ(test::read_text(out + "/benchmark.json.unreadable"), R"({"benchmarks":5})");
  auto j = parse_json(test::read_text(out + "/benchmark.json"));
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.at("benchmarks").size(), 1u);
}

TEST(Results, AResultFileThatIsADirectoryIsNamed) {
  for (const std::string name : {"results.csv", "meta.json", "benchmark.json"}) {
    TempDir dir;
    const std::string out = dir.file("r");
    fs::create_directories(fs::path(out) / name);
    for (bool resume : {false, true}) {
      try {
        ResultsDir rd(out, resume);
        ADD_FAILURE() << name << " as a directory was accepted";
      } catch (const UsageError& e) {
        EXPECT_CONTAINS(std::string(e.what()), name);
        EXPECT_CONTAINS(std::string(e.what()), "not a regular file");
      }
    }
  }
}

// A resumed directory keeps every earlier run's meta record, machine figures included.
TEST(Results, ResumedMetaKeepsEachRunsMachineFigures) {
  TempDir dir;
  const std::string out = dir.file("r");
  {
    ResultsDir rd(out, false);
    rd.append(sample_row(32), nlohmann::json());
    rd.write_meta({{"command_line", "first"}, {"machine", {{"gemm_gflops", 100.0}}}});
  }
  {
    ResultsDir rd(out, true);
    rd.write_meta({{"command_line", "second"}, {"machine", {{"gemm_gflops", 50.0}}}});
  }
  {
    ResultsDir rd(out, true);
    rd.write_meta({{"command_line", "third"}, {"machine", {{"gemm_gflops", 75.0}}}});
  }
  auto meta = parse_json(test::read_text(out + "/meta.json"));
  EXPECT_EQ(meta.at("machine").at("gemm_gflops"), 75.0);
  ASSERT_EQ(meta.at("earlier_runs").size(), 2u);
  EXPECT_EQ(meta["earlier_runs"][0].at("machine").at("gemm_gflops"), 100.0);
  EXPECT_EQ(meta["earlier_runs"][1].at("machine").at("gemm_gflops"), 50.0);
  EXPECT_EQ(meta["earlier_runs"][1].at("command_line"), "second");
  EXPECT_EQ(meta.at("earlier_command_lines"), nlohmann::json({"first", "second"}));
}

// --min-time 0 is one forward pass per repetition (Google Benchmark itself refuses 0).
TEST(Cli, MinTimeZeroIsOnePassPerRepetition) {
  TempDir dir;
  CliResult r =
      run_cli("run --variant flash --seq 32 --heads 1 --dim 8 --reps 2 --min-time 0 --json", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = parse_json(r.out);
  EXPECT_EQ(j.at("status"), "ok");
  EXPECT_EQ(j.at("reps"), 2);
  EXPECT_EQ(j.at("iterations"), 1);
}

// ----- sweep -----

TEST(Cli, SweepAlsoPlansMoreProblemsAndProgressFitsAHundredColumns) {
  TempDir dir;
  const std::string out = dir.file("results");
  // the second set repeats n = 32 (left out) and adds causal rows of linformer (refused)
  auto [r, csv] = run_sweep(
      "sweep --variant full --seq 32,64 --heads 2 --dim 16 --reps 1 --min-time 0.01 --out " +
          q(out) +
          " --also='--variant full --variant linformer --seq 32 --heads 2 --dim 16 --causal "
          "on --key-padding 20'",
      dir, out);
  ASSERT_EQ(csv.rows.size(), 4u);
  EXPECT_EQ(csv.rows[2].at("causal"), "1");
  EXPECT_EQ(csv.rows[2].at("key_padding"), "20");
  EXPECT_EQ(csv.rows[3].at("status"), "unsupported");
  const auto progress = progress_lines(r.err);
  for (const auto& line : progress) {
    EXPECT_LE(line.size(), 100u) << line;
    EXPECT_CONTAINS(line, "ETA");
  }
  EXPECT_EQ(progress.size(), 4u);
  // options of the whole sweep are refused inside --also, naming it
  r = run_cli("sweep --out " + q(out) + " --also='--threads 1'", dir);
  expect_usage_error(r, "--also");
  EXPECT_CONTAINS(r.err, "--threads belongs to the whole sweep");
  r = run_cli("sweep --out " + q(out) + " --also='--seq 0'", dir);
  expect_usage_error(r, "--also");
  EXPECT_CONTAINS(r.err, "--also '--seq 0'");
}

// Lists of scales and key lengths, parameter grids and --also make one cross product: every
// row is written once, the progress and meta.json count exactly the rows written, and
// --resume recognises every one of them.
TEST(Cli, SweepListsAndGridsAreCrossProducts) {
  TempDir dir;
  const std::string out = dir.file("results");
  // bigbird refuses m != n: those rows are "unsupported" rows
  const std::string args =
      "sweep --variant 'local:window=8|16' --variant full --variant "
      "'bigbird:block=8,random_blocks=0|1' --seq 64..128 --seq-k same,32 --scale 1,4 "
      "--heads 1 --dim 8 --reps 1 --min-time 0 --out " +
      q(out) + " --also='--variant full --seq 64 --seq-k 16,same --scale 2,4 --heads 1 --dim 8'";
  auto [r, csv] = run_sweep(args, dir, out);
  // 5 specs x 2 n x 2 m x 2 scales, then full at n = 64 with m in {16, 64} and scale in
  // {2, 4}, less the one row planned already (m = 64, scale 4)
  const size_t rows = 5 * 2 * 2 * 2 + 3;
  ASSERT_EQ(csv.rows.size(), rows);
  expect_one_row_per_key(csv);
  std::set<std::string> specs;
  std::map<std::string, int> per_scale, per_m, per_status;
  for (const auto& row : csv.rows) {
    specs.insert(row.at("spec"));
    ++per_scale[row.at("scale")], ++per_m[row.at("m") == row.at("n") ? "n" : row.at("m")];
    ++per_status[row.at("status")];
    if (row.at("status") != "ok") {
      EXPECT_EQ(row.at("variant"), "bigbird");
      EXPECT_NE(row.at("m"), row.at("n"));
    }
  }
  ASSERT_EQ(specs.size(), 5u);
  EXPECT_EQ(specs.count(make_variant("local:window=8")->spec()), 1u);
  EXPECT_EQ(specs.count(make_variant("local:window=16")->spec()), 1u);
  EXPECT_EQ(specs.count(make_variant("bigbird:block=8,random_blocks=0")->spec()), 1u);
  EXPECT_EQ(specs.count(make_variant("bigbird:block=8,random_blocks=1")->spec()), 1u);
  EXPECT_EQ(per_scale, (std::map<std::string, int>{{"1", 20}, {"2", 2}, {"4", 21}}));
  EXPECT_EQ(per_m, (std::map<std::string, int>{{"n", 21}, {"32", 20}, {"16", 2}}));
  EXPECT_EQ(per_status, (std::map<std::string, int>{{"ok", 35}, {"unsupported", 8}}));
  // the progress counts the rows written, and so does meta.json
  const auto progress = progress_lines(r.err);
  ASSERT_EQ(progress.size(), rows);
  EXPECT_EQ(progress.front().rfind(fmt::format("[1/{}]", rows), 0), 0u) << progress.front();
  EXPECT_EQ(progress.back().rfind(fmt::format("[{}/{}]", rows, rows), 0), 0u) << progress.back();
  auto meta = parse_json(test::read_text(out + "/meta.json"));
  EXPECT_EQ(meta.at("rows_planned"), rows);
  // --resume keeps every row: nothing is measured again
  r = run_cli(args + " --resume", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, fmt::format("{} kept", rows));
  EXPECT_TRUE(progress_lines(r.err).empty()) << r.err;
  EXPECT_EQ(read_csv(out + "/results.csv").lines, csv.lines);
}

TEST(Cli, SweepThenResume) {
  TempDir dir;
  const std::string out = dir.file("results");
  // flash:block_q=64 is flash at its defaults: the same canonical spec, measured once
  const std::string base =
      "sweep --variant full --variant flash --variant flash:block_q=64 "
      "--heads 2 --dim 16 --causal both "
      "--reps 1 --min-time 0.01 --out " +
      q(out);
  CliResult r = run_cli(base + " --seq 32,64,32", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "10 duplicate configurations left out");

  Csv csv = read_csv(out + "/results.csv");
  EXPECT_EQ(csv.header, csv_columns());
  ASSERT_EQ(csv.rows.size(), 8u);  // 2 variants x 2 lengths x 2 masks
  expect_one_row_per_key(csv);
  std::map<std::string, int> per_variant, per_n, per_causal;
  for (const auto& row : csv.rows) {
    EXPECT_EQ(row.at("status"), "ok") << row.at("message");
    ++per_variant[row.at("variant")], ++per_n[row.at("n")], ++per_causal[row.at("causal")];
    EXPECT_EQ(row.at("heads"), "2");
    EXPECT_EQ(row.at("dim"), "16");
    EXPECT_EQ(row.at("m"), row.at("n"));
    EXPECT_LT(std::stod(row.at("rel_fro_error")), 1e-5);
    EXPECT_GT(std::stod(row.at("time_median_s")), 0);
    EXPECT_GT(std::stod(row.at("gflops")), 0);
  }
  EXPECT_EQ(per_variant, (std::map<std::string, int>{{"flash", 4}, {"full", 4}}));
  EXPECT_EQ(per_n, (std::map<std::string, int>{{"32", 4}, {"64", 4}}));
  EXPECT_EQ(per_causal, (std::map<std::string, int>{{"0", 4}, {"1", 4}}));

  nlohmann::json bench = parse_json(test::read_text(out + "/benchmark.json"));
  ASSERT_TRUE(bench.is_object());
  ASSERT_TRUE(bench.contains("context"));
  EXPECT_TRUE(bench["context"].is_object());
  ASSERT_TRUE(bench.contains("benchmarks"));
  ASSERT_TRUE(bench["benchmarks"].is_array());
  EXPECT_EQ(bench["benchmarks"].size(), 8u);  // one run per row with --reps 1

  nlohmann::json meta = parse_json(test::read_text(out + "/meta.json"));
  ASSERT_TRUE(meta.is_object());
  ASSERT_TRUE(meta.contains("git_commit"));
  EXPECT_FALSE(meta["git_commit"].get<std::string>().empty());
  ASSERT_TRUE(meta.contains("machine"));
  EXPECT_GT(meta["machine"].at("gemm_gflops").get<double>(), 0);
  ASSERT_TRUE(meta.contains("command_line"));
  EXPECT_CONTAINS(meta["command_line"].get<std::string>(), "sweep");
  EXPECT_CONTAINS(meta["command_line"].get<std::string>(), "--seq 32,64");
  ASSERT_TRUE(meta.contains("git_dirty"));
  EXPECT_TRUE(meta["git_dirty"].is_boolean());
  ASSERT_TRUE(meta.contains("git_changes"));
  EXPECT_EQ(meta["git_dirty"].get<bool>(), !meta["git_changes"].empty());
  EXPECT_EQ(meta["git_dirty"].get<bool>(),
            meta["git_commit"].get<std::string>().find("-dirty") != std::string::npos);

  // --resume with one more length: only the 4 new configurations run
  r = run_cli(base + " --seq 32,64,128 --resume", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_CONTAINS(r.err, "8 kept");
  Csv csv2 = read_csv(out + "/results.csv");
  EXPECT_EQ(csv2.header, csv_columns());
  ASSERT_EQ(csv2.rows.size(), 12u);
  // the old rows are untouched, the new ones are appended
  for (size_t i = 0; i < csv.lines.size(); ++i) EXPECT_EQ(csv2.lines[i], csv.lines[i]);
  expect_one_row_per_key(csv2);
  for (const auto& row : csv2.rows) EXPECT_EQ(row.at("status"), "ok") << row.at("message");
  for (size_t i = 8; i < 12; ++i) EXPECT_EQ(csv2.rows[i].at("n"), "128");
  bench = parse_json(test::read_text(out + "/benchmark.json"));
  EXPECT_EQ(bench.at("benchmarks").size(), 12u);
  meta = parse_json(test::read_text(out + "/meta.json"));
  EXPECT_EQ(meta.at("rows_planned"), 12);
  EXPECT_EQ(meta.at("rows_kept_from_earlier_runs"), 8);
  // the first sweep's command line is kept: the directory says how every row was made
  EXPECT_CONTAINS(meta.at("command_line").get<std::string>(), "--seq 32,64,128 --resume");
  ASSERT_EQ(meta.at("earlier_command_lines").size(), 1u);
  ASSERT_EQ(meta.at("earlier_runs").size(), 1u);
  EXPECT_GT(meta["earlier_runs"][0].at("machine").at("gemm_gflops").get<double>(), 0);
  EXPECT_EQ(meta.at("earlier_command_lines")[0].get<std::string>().find("--resume"),
            std::string::npos);
  EXPECT_CONTAINS(meta.at("earlier_command_lines")[0].get<std::string>(), "--seq 32,64");
}

TEST(Cli, SweepSkipsWhatCannotFit) {
  TempDir dir;
  const std::string out = dir.file("big");
  // full materialises B H n m floats: 64 * 2^40 * 4 bytes here
  CliResult r =
      run_cli("sweep --variant full --seq 1048576 --heads 64 --reps 1 --out " + q(out), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  Csv csv = read_csv(out + "/results.csv");
  EXPECT_EQ(csv.header, csv_columns());
  ASSERT_EQ(csv.rows.size(), 1u);
  EXPECT_EQ(csv.rows[0].at("status"), "skipped");
  EXPECT_FALSE(csv.rows[0].at("message").empty());
  EXPECT_CONTAINS(csv.rows[0].at("message"), "GiB");
  EXPECT_EQ(csv.rows[0].at("n"), "1048576");
  EXPECT_EQ(csv.rows[0].at("time_median_s"), "");  // nothing was timed
  EXPECT_EQ(std::stod(csv.rows[0].at("estimated_bytes")), 64.0 * 1048576.0 * 1048576.0 * 4);
  EXPECT_CONTAINS(r.err, "skipped");
}

}  // namespace
}  // namespace attnbench
