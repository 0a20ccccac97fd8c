// Trained inputs (--input trained[:layer=L], common/io/trained.h): a synthetic cache of small
// random arrays in a temporary ATTNBENCH_CACHE, read back through the paths a run and a sweep
// take (generate_inputs, plan_sweep, run_one, the results columns, the binary).
#include "common/io/trained.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "harness/machine.h"
#include "harness/results.h"
#include "harness/runner.h"
#include "harness/sweep_plan.h"
#include "test_util.h"

namespace attnbench {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

using test::ScopedEnv;

constexpr int64_t kLayers = 2, kHeads = 2, kDim = 8, kContext = 16, kLength = 48;
const std::string kCheckpoint = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

NpyArray float_array(const std::vector<float>& x, std::vector<int64_t> shape) {
  return test::float_npy(std::move(shape), x);
}

// A synthetic trained cache: meta.json and layer{L}.npz of random arrays [1, H, len, d], with
// ATTNBENCH_CACHE pointing at it while it lives.
class TrainedCache {
 public:
  TrainedCache() : env_("ATTNBENCH_CACHE", dir_.path().string()) {
    fs::create_directories(qkv());
    write_meta();
    std::mt19937 gen(1234);
    std::normal_distribution<float> normal;
    for (int64_t l = 0; l < kLayers; ++l) {
      for (auto& x : data_[size_t(l)]) {
        x.resize(size_t(kHeads * kLength * kDim));
        for (auto& e : x) e = normal(gen);
      }
      write_layer(l);
    }
  }

  std::string qkv() const { return (dir_.path() / "trained" / "qkv").string(); }
  std::string layer_file(int64_t l) const { return fmt::format("{}/layer{}.npz", qkv(), l); }
  // Array t (0 q, 1 k, 2 v) of layer l as written.
  const std::vector<float>& array(int64_t l, int t) const { return data_[size_t(l)][size_t(t)]; }

  void write_meta(const nlohmann::json& extra = nlohmann::json::object()) const {
    nlohmann::json j = {{"format", 1},
                        {"layers", kLayers},
                        {"heads", kHeads},
                        {"dim", kDim},
                        {"context", kContext},
                        {"length", kLength},
                        {"checkpoint", kCheckpoint},
                        {"corpus", "synthetic"},
                        {"text", "held-out"},
                        {"extra_key", {1, 2}}};
    for (const auto& [k, v] : extra.items()) j[k] = v;
    test::write_text(qkv() + "/meta.json", j.dump());
  }
  // Writes layer l's arrays; `shape` replaces their shape (the data as it is).
  void write_layer(int64_t l, std::vector<int64_t> shape = {1, kHeads, kLength, kDim}) const {
    const auto& d = data_[size_t(l)];
    write_npz(layer_file(l), {{"q", float_array(d[0], shape)},
                              {"k", float_array(d[1], shape)},
                              {"v", float_array(d[2], shape)}});
  }
  std::array<std::vector<float>, 3>& mutable_layer(int64_t l) { return data_[size_t(l)]; }

 private:
  TempDir dir_;
  ScopedEnv env_;
  std::array<std::array<std::vector<float>, 3>, kLayers> data_;
};

Problem problem(int64_t n, int64_t batch = 1, int64_t heads = kHeads, int64_t dim = kDim) {
  Problem p;
  p.batch = batch, p.heads = heads, p.n = n, p.dim = dim;
  return p;
}

Workload trained(int64_t layer = 0) {
  Workload w;
  w.input = fmt::format("trained:layer={}", layer);
  return w;
}

// Whether head h of tensor t [1, H, n, d] holds the first n positions of head h of `full`
// [1, H, kLength, d], bit for bit.
void expect_prefix(const Tensor& t, const std::vector<float>& full, int64_t n, const char* what) {
  ASSERT_EQ(t.shape().len, n);
  for (int64_t h = 0; h < t.shape().heads; ++h)
    EXPECT_EQ(std::memcmp(t.data() + h * n * kDim, full.data() + h * kLength * kDim,
                          size_t(n * kDim) * sizeof(float)),
              0)
        << what << " head " << h << " n " << n;
}

std::string usage_message(const std::function<void()>& f) {
  return test::error_message<UsageError>(f);
}

TEST(Trained, InputsAreThePrefixOfTheLayersArrays) {
  TrainedCache cache;
  for (int64_t layer : {0, 1})
    for (int64_t n : {int64_t(7), int64_t(16), int64_t(33), kLength}) {
      Problem p = problem(n);
      const Inputs in = generate_inputs(p, trained(layer));
      expect_prefix(in.q, cache.array(layer, 0), n, "q");
      expect_prefix(in.k, cache.array(layer, 1), n, "k");
      expect_prefix(in.v, cache.array(layer, 2), n, "v");
      // kv_heads given as the heads: the same arrays
      p.kv_heads = kHeads;
      const Inputs same = generate_inputs(p, trained(layer));
      expect_prefix(same.k, cache.array(layer, 1), n, "k (kv_heads = H)");
      // one head alone, as the pattern export takes it
      const Inputs one = generate_head_inputs(problem(n), 0, 1, trained(layer));
      EXPECT_EQ(std::memcmp(one.q.data(), cache.array(layer, 0).data() + kLength * kDim,
                            size_t(n * kDim) * sizeof(float)),
                0);
    }
  // "trained" is layer 0; the two layers differ
  Workload plain;
  plain.input = "trained";
  const Inputs a = generate_inputs(problem(7), plain), b = generate_inputs(problem(7), trained(1));
  expect_prefix(a.q, cache.array(0, 0), 7, "q of 'trained'");
  EXPECT_NE(std::memcmp(a.q.data(), b.q.data(), size_t(7 * kDim) * sizeof(float)), 0);
}

TEST(Trained, ScaleMultipliesQAndTheSeedPlaysNoPart) {
  TrainedCache cache;
  Problem p = problem(9);
  Workload w = trained(1);
  w.scale = 2.5;
  const Inputs in = generate_inputs(p, w);
  for (int64_t i = 0; i < 9 * kDim; ++i)
    EXPECT_EQ(in.q.data()[i], cache.array(1, 0)[size_t(i)] * 2.5f);
  expect_prefix(in.k, cache.array(1, 1), 9, "k");
  p.seed = 77;
  expect_prefix(generate_inputs(p, trained(1)).q, cache.array(1, 0), 9, "q, seed 77");
}

TEST(Trained, NamesAreCanonical) {
  EXPECT_EQ(canonical_input("trained"), "trained:layer=0");
  EXPECT_EQ(canonical_input("trained:layer=3"), "trained:layer=3");
  EXPECT_EQ(canonical_input("local"), "local");
  EXPECT_EQ(parse_input_list("gaussian,trained,trained:layer=1"),
            (std::vector<std::string>{"gaussian", "trained:layer=0", "trained:layer=1"}));
  EXPECT_EQ(trained_layer("trained"), 0);
  EXPECT_EQ(trained_layer("trained:layer=1"), 1);
  EXPECT_EQ(trained_layer("gaussian"), std::nullopt);
  EXPECT_CONTAINS(accepted_inputs(), "trained[:layer=L]");
  EXPECT_FALSE(describe_distribution("trained").empty());
  for (const std::string bad : {"trained:layr=1", "trained:layer=1,x=2", "trained:layer"}) {
    const std::string msg = usage_message([&] { canonical_input(bad); });
    EXPECT_CONTAINS(msg, "unknown option");
    EXPECT_CONTAINS(msg, "layer=L");
  }
  for (const std::string bad :
       {"trained:layer=x", "trained:layer=-1", "trained:layer=", "trained:layer=1.5"})
    EXPECT_CONTAINS(usage_message([&] { canonical_input(bad); }), "not a layer number");
  EXPECT_CONTAINS(usage_message([&] { canonical_input("trained:layer=0,layer=1"); }), "twice");
  EXPECT_CONTAINS(usage_message([&] { canonical_input("trained:"); }), "no option");
  const std::string unknown = usage_message([&] { canonical_input("trainedx"); });
  EXPECT_CONTAINS(unknown, "unknown input distribution 'trainedx'");
  EXPECT_CONTAINS(unknown, "trained[:layer=L]");
  EXPECT_CONTAINS(usage_message([&] { parse_input_list("gaussian,trained:lay=1"); }), "--input");
}

// Each refusal through the two ways in: reading the inputs, and planning a sweep.
void expect_refused(const Problem& p, const Workload& w, const std::vector<std::string>& words) {
  const std::string msg = usage_message([&] { generate_inputs(p, w); });
  for (const auto& word : words) EXPECT_CONTAINS(msg, word);
  SweepAxes axes;
  axes.seqs = {p.n};
  if (p.m > 0) axes.seq_ks = {p.m};
  axes.batches = {p.batch}, axes.heads = {p.heads}, axes.dims = {p.dim}, axes.causals = {true};
  axes.kv_heads = {p.kv_heads};
  axes.inputs = {w.input};
  const std::string plan_msg = usage_message([&] {
    std::vector<std::unique_ptr<Variant>> v;
    v.push_back(make_variant("flash"));
    plan_sweep(std::move(v), axes);
  });
  for (const auto& word : words) EXPECT_CONTAINS(plan_msg, word);
}

TEST(Trained, RefusesWhatDoesNotFit) {
  TrainedCache cache;
  const std::string model = "for the model in " + cache.qkv();
  expect_refused(problem(8, 1, 3), trained(), {"heads must be 2", model, "got 3"});
  expect_refused(problem(8, 1, kHeads, 16), trained(), {"dim must be 8", "got 16"});
  expect_refused(problem(8, 2), trained(), {"batch must be 1", "got 2"});
  expect_refused(problem(kLength + 1), trained(),
                 {"n = 49 exceeds the captured length 48", cache.qkv()});
  expect_refused(problem(8), trained(2), {"layer must be 0..1 " + model, "got 2"});
  Problem grouped = problem(8);
  grouped.kv_heads = 1;
  expect_refused(grouped, trained(), {"kv_heads must be 0 or 2", "got 1"});
  Problem cross = problem(8);
  cross.m = 12;
  expect_refused(cross, trained(), {"m must equal n", "m = 12"});
  // the pattern export's single head: one of the model's
  EXPECT_CONTAINS(usage_message([&] { generate_head_inputs(problem(8, 1, 5), 0, 4, trained()); }),
                  "head must be 0..1");
}

TEST(Trained, RefusesAMissingOrBrokenCache) {
  {
    TempDir empty;
    ScopedEnv env("ATTNBENCH_CACHE", empty.path().string());
    expect_refused(
        problem(8), trained(),
        {"trained inputs not found: " + empty.path().string() + "/trained/qkv/meta.json is missing",
         "scripts/train_lm.py", "scripts/capture_qkv.py", "ATTNBENCH_CACHE"});
  }
  {
    TrainedCache cache;
    fs::remove(cache.layer_file(1));
    expect_refused(problem(8), trained(1),
                   {"trained inputs not found: " + cache.layer_file(1) + " is missing"});
    // layer 0 still reads
    EXPECT_NO_THROW(generate_inputs(problem(8), trained(0)));
  }
  {
    TrainedCache cache;
    cache.mutable_layer(0)[1][size_t(5 * kLength * kDim / 4)] = NAN;
    cache.write_layer(0);
    expect_refused(problem(8), trained(), {cache.layer_file(0), "'k'", "non-finite"});
  }
  {
    TrainedCache cache;
    cache.mutable_layer(0)[2][3] = std::numeric_limits<float>::infinity();
    cache.write_layer(0);
    expect_refused(problem(8), trained(), {"'v'", "non-finite"});
  }
  {
    TrainedCache cache;
    const std::string bytes = test::read_text(cache.layer_file(0));
    test::write_text(cache.layer_file(0), bytes.substr(0, bytes.size() / 2));
    expect_refused(problem(8), trained(), {cache.layer_file(0)});
  }
  {
    TrainedCache cache;  // shaped [1, H, 24, 2 d]: the right size, the wrong shape
    cache.write_layer(0, {1, kHeads, kLength / 2, 2 * kDim});
    expect_refused(problem(8), trained(), {"expected [1, heads, length, dim] = [1, 2, 48, 8]"});
  }
  {
    TrainedCache cache;
    NpyArray d = float_array(cache.array(0, 0), {1, kHeads, kLength, kDim});
    d.dtype = "<i4";
    write_npz(cache.layer_file(0), {{"q", d},
                                    {"k", float_array(cache.array(0, 1), d.shape)},
                                    {"v", float_array(cache.array(0, 2), d.shape)}});
    expect_refused(problem(8), trained(), {"'q' has dtype <i4, expected float32"});
  }
  {
    TrainedCache cache;
    cache.write_meta({{"format", 2}});
    expect_refused(problem(8), trained(), {"format 2", "format 1"});
    cache.write_meta({{"heads", "eight"}});
    expect_refused(problem(8), trained(), {"'heads'"});
    test::write_text(cache.qkv() + "/meta.json", "{not json");
    expect_refused(problem(8), trained(), {"not a JSON object"});
  }
}

// A file replaced while the process runs is read again (the per-process cache is keyed by
// the file's path, size and modification time).
TEST(Trained, ARewrittenLayerFileIsReadAgain) {
  TrainedCache cache;
  const Inputs before = generate_inputs(problem(7), trained());
  expect_prefix(before.q, cache.array(0, 0), 7, "q");
  cache.mutable_layer(0)[0][0] += 1.0f;
  cache.write_layer(0);  // the same size: the modification time tells it apart
  fs::last_write_time(cache.layer_file(0),
                      fs::last_write_time(cache.layer_file(0)) + std::chrono::seconds(2));
  const Inputs after = generate_inputs(problem(7), trained());
  EXPECT_EQ(after.q.data()[0], cache.array(0, 0)[0]);
}

TEST(Trained, PlanAcceptsWhatFits) {
  TrainedCache cache;
  SweepAxes axes;
  axes.seqs = {7, 16, 33};
  axes.batches = {1}, axes.heads = {kHeads}, axes.dims = {kDim}, axes.causals = {false, true};
  axes.inputs = parse_input_list("trained,trained:layer=0,trained:layer=1,gaussian");
  std::vector<std::unique_ptr<Variant>> v;
  v.push_back(make_variant("flash"));
  const SweepPlan plan = plan_sweep(std::move(v), axes);
  // trained and trained:layer=0 are one input: its rows are planned once
  EXPECT_EQ(plan.configs.size(), 3u * 2u * 3u);
  EXPECT_EQ(plan.duplicates.size(), 6u);
  EXPECT_EQ(plan.configs.front().workload.input, "trained:layer=0");
}

std::map<std::string, std::string> csv_row(const Row& row) {
  const auto fields = split_csv_line(csv_line(row));
  std::map<std::string, std::string> m;
  for (size_t i = 0; i < fields.size() && i < csv_columns().size(); ++i)
    m[csv_columns()[i]] = fields[i];
  return m;
}

TEST(Trained, RowsCarryLayerSourceAndContextNote) {
  TrainedCache cache;
  auto flash = make_variant("flash");
  const RunOptions opt{.reps = 1, .min_time = 0};
  for (int64_t n : {16, 33}) {
    Problem p = problem(n);
    p.causal = true;
    const Row row = run_one(*flash, p, trained(1), nullptr, MachineFigures{}, opt);
    ASSERT_EQ(row.status, "ok") << row.message;
    EXPECT_LT(row.error.rel_fro, 1e-5);
    const auto f = csv_row(row);
    EXPECT_EQ(f.at("input"), "trained:layer=1");
    EXPECT_EQ(f.at("input_layer"), "1");
    EXPECT_EQ(f.at("input_source"), "trained@" + kCheckpoint.substr(0, 12));
    if (n > kContext)
      EXPECT_CONTAINS(f.at("notes"), "beyond the trained context (C = 16)");
    else
      EXPECT_EQ(f.at("notes").find("beyond"), std::string::npos) << f.at("notes");
  }
  // a row the variant refuses (linformer: not causal) names the checkpoint too
  Problem causal = problem(16);
  causal.causal = true;
  const Row refused =
      run_one(*make_variant("linformer"), causal, trained(), nullptr, MachineFigures{}, opt);
  EXPECT_EQ(refused.status, "unsupported") << refused.message;
  EXPECT_EQ(csv_row(refused).at("input_source"), "trained@" + kCheckpoint.substr(0, 12));
  const Row gen = run_one(*flash, problem(16), Workload{}, nullptr, MachineFigures{}, opt);
  const auto g = csv_row(gen);
  EXPECT_EQ(g.at("input_layer"), "");
  EXPECT_EQ(g.at("input_source"), "generated");
  Workload file;
  file.input = "file";
  Inputs in = generate_inputs(problem(16));
  const auto f = csv_row(run_one(*flash, problem(16), file, &in, MachineFigures{}, opt));
  EXPECT_EQ(f.at("input_source"), "file");
  EXPECT_EQ(f.at("input_layer"), "");
  // neither column is a key: the layer is in the input's name already
  for (const char* c : {"input_layer", "input_source"})
    EXPECT_EQ(std::find(key_columns().begin(), key_columns().end(), c), key_columns().end());
}

// A results.csv written before input_layer and input_source resumes, its rows given the
// source their input means (no older row had trained inputs).
TEST(Trained, OldResultsFilesResumeWithTheNewColumns) {
  TempDir dir;
  const std::string out = dir.file("r");
  fs::create_directories(out);
  Row a;
  a.spec = "flash", a.variant = "flash";
  a.problem = problem(64);
  a.workload.threads = 1;
  a.time_median = a.time_min = a.time_max = 1e-3;
  Row b = a;
  b.workload.input = "file";
  std::vector<size_t> keep;
  for (size_t c = 0; c < csv_columns().size(); ++c)
    if (csv_columns()[c] != "input_layer" && csv_columns()[c] != "input_source") keep.push_back(c);
  auto old_line = [&](const std::vector<std::string>& f) { return test::csv_line_of(f, keep); };
  test::write_text(out + "/results.csv", old_line(csv_columns()) +
                                             old_line(split_csv_line(csv_line(a))) +
                                             old_line(split_csv_line(csv_line(b))));
  {
    ResultsDir rd(out, true);
    EXPECT_EQ(rd.rows_kept(), 2u);
    EXPECT_TRUE(rd.done(a));
    EXPECT_TRUE(rd.done(b));
  }
  const auto lines = test::read_lines(out + "/results.csv");
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(split_csv_line(lines[0]), csv_columns());
  EXPECT_EQ(split_csv_line(lines[1]), split_csv_line(csv_line(a)));
  EXPECT_EQ(split_csv_line(lines[2]), split_csv_line(csv_line(b)));
  const auto cols = csv_columns();
  const size_t src = size_t(std::find(cols.begin(), cols.end(), "input_source") - cols.begin());
  EXPECT_EQ(split_csv_line(lines[1])[src], "generated");
  EXPECT_EQ(split_csv_line(lines[2])[src], "file");
}

// Through the binary: run with --input trained on the synthetic cache, and the usage errors.
TEST(Trained, CliRunsAndRefuses) {
  TrainedCache cache;
  TempDir dir;
  const std::string base = "run --heads 2 --dim 8 --causal --reps 1 --min-time 0 --threads 1 ";
  auto r = test::run_cli(base + "--variant flash --input trained --seq 20 --json --output '" +
                             dir.file("flash.npy") + "'",
                         dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("input"), "trained:layer=0");
  EXPECT_EQ(j.at("input_layer"), 0);
  EXPECT_EQ(j.at("input_source"), "trained@" + kCheckpoint.substr(0, 12));
  EXPECT_CONTAINS(j.at("notes").get<std::string>(), "beyond the trained context (C = 16)");
  ASSERT_TRUE(j.at("rel_fro_error").is_number());
  EXPECT_LT(j.at("rel_fro_error").get<double>(), 1e-5);
  r = test::run_cli(base + "--variant full --input trained:layer=0 --seq 20 --output '" +
                        dir.file("full.npy") + "'",
                    dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const NpyArray fo = read_npy(dir.file("flash.npy")), fu = read_npy(dir.file("full.npy"));
  ASSERT_EQ(fo.shape, fu.shape);
  ASSERT_EQ(fo.shape, (std::vector<int64_t>{1, kHeads, 20, kDim}));
  const auto* x = reinterpret_cast<const float*>(fo.data.data());
  const auto* y = reinterpret_cast<const float*>(fu.data.data());
  for (int64_t i = 0; i < fo.numel(); ++i) EXPECT_NEAR(x[i], y[i], 1e-5) << i;

  r = test::run_cli(base + "--variant flash --input trained:layer=5 --seq 20", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "layer must be 0..1");
  r = test::run_cli(base + "--variant flash --input trained:depth=1 --seq 20", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "unknown option 'depth=1'");
  r = test::run_cli(base + "--variant flash --input trained --seq 64", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "n = 64 exceeds the captured length 48");
  // a sweep refuses before measuring anything
  r = test::run_cli(
      "sweep --variant flash --heads 2 --dim 8 --seq 16,64 --input gaussian,trained "
      "--out '" +
          dir.file("s") + "'",
      dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_CONTAINS(r.err, "n = 64 exceeds the captured length 48");
  EXPECT_EQ(r.err.find("attnbench: machine figures ("), std::string::npos) << r.err;
  {
    TempDir empty;
    ScopedEnv env("ATTNBENCH_CACHE", empty.path().string());
    r = test::run_cli("sweep --variant flash --heads 2 --dim 8 --seq 16 --input trained --out '" +
                          dir.file("s2") + "'",
                      dir);
    EXPECT_EQ(r.code, 2);
    EXPECT_CONTAINS(r.err, "trained inputs not found");
  }
}

// One small sweep: rows of two layers and meta.json's record of the trained inputs.
TEST(Trained, CliSweepRecordsTheTrainedMeta) {
  TrainedCache cache;
  TempDir dir;
  const std::string out = dir.file("s");
  const auto r = test::run_cli(
      "sweep --variant flash --heads 2 --dim 8 --seq 8,24 --input trained,trained:layer=1 "
      "--causal on --reps 1 --min-time 0 --threads 1 --out '" +
          out + "'",
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto lines = test::read_lines(out + "/results.csv");
  ASSERT_EQ(lines.size(), 5u);
  const auto header = split_csv_line(lines[0]);
  auto col = [&](const std::string& line, const std::string& c) {
    return split_csv_line(
        line)[size_t(std::find(header.begin(), header.end(), c) - header.begin())];
  };
  EXPECT_EQ(col(lines[1], "input"), "trained:layer=0");
  EXPECT_EQ(col(lines[3], "input_layer"), "1");
  EXPECT_EQ(col(lines[2], "notes"), "beyond the trained context (C = 16)");
  for (size_t i = 1; i < lines.size(); ++i) EXPECT_EQ(col(lines[i], "status"), "ok") << lines[i];
  const auto meta = nlohmann::json::parse(test::read_text(out + "/meta.json"));
  const auto& t = meta.at("trained_inputs");
  EXPECT_EQ(t.at("checkpoint"), kCheckpoint);
  EXPECT_EQ(t.at("context"), kContext);
  EXPECT_EQ(t.at("length"), kLength);
  EXPECT_EQ(t.at("dir"), cache.qkv());
  EXPECT_EQ(t.at("inputs"), (nlohmann::json{"trained:layer=0", "trained:layer=1"}));
}

}  // namespace
}  // namespace attnbench
