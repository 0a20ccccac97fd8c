#include "harness/shard.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>
#include <set>

#include "common/error.h"
#include "harness/results.h"
#include "harness/runner.h"

namespace attnbench {

Row key_row(const SweepConfig& c) {
  Row r;
  r.spec = c.variant->spec();
  r.problem = c.problem;
  r.workload = c.workload;
  r.embed = c.embed;
  return r;
}

namespace {

// The problem of a configuration: what its float64 reference rows depend on (every key
// column but the spec).
std::string problem_key(const SweepConfig& c) {
  Row r = key_row(c);
  r.spec.clear();
  return row_key(r);
}

}  // namespace

std::string csv_key(const std::vector<std::string>& fields) {
  std::string line;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) line += ',';
    line += csv_quote(fields[i]);
  }
  return line;
}

uint64_t stable_hash(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

std::pair<int, int> parse_shard(const std::string& text) {
  auto bad = [&](const std::string& why) {
    return UsageError(fmt::format(
        "--shard '{}': {}; accepted: i/N with 0 <= i < N (shard i of N, e.g. 0/4 .. 3/4)", text,
        why));
  };
  const size_t slash = text.find('/');
  if (slash == std::string::npos) throw bad("has no '/'");
  auto number = [&](const std::string& s, const char* role) {
    int v = -1;
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || v < 0)
      throw bad(fmt::format("{} '{}' is not a non-negative integer", role, s));
    return v;
  };
  const int i = number(text.substr(0, slash), "the index");
  const int n = number(text.substr(slash + 1), "the count");
  if (n < 1) throw bad("the count N must be at least 1");
  if (i >= n) throw bad(fmt::format("the index {} is not below the count {}", i, n));
  return {i, n};
}

double shard_run_cost(const SweepConfig& config, int reps, double min_time) {
  if (!sweep_runnable(config)) return kShardRefusedSeconds;
  double bytes = 0;
  try {
    if (config.embed == 0) bytes = config.variant->memory_estimate(config.problem);
  } catch (const std::exception&) {
  }
  if (!std::isfinite(bytes) || bytes < 0) bytes = 0;
  const double pass = std::max(sweep_work(config) / kShardFlopRate, bytes / kShardBandwidth);
  return kShardFixedSeconds + pass + double(std::max(1, reps)) * std::max(min_time, pass);
}

std::vector<size_t> ShardSplit::members(int s) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < shard_of.size(); ++i)
    if (shard_of[i] == s) out.push_back(i);
  return out;
}

double ShardSplit::imbalance() const {
  if (costs.empty()) return 1;
  const double mean = std::accumulate(costs.begin(), costs.end(), 0.0) / double(costs.size());
  return mean > 0 ? *std::max_element(costs.begin(), costs.end()) / mean : 1;
}

ShardSplit split_shards(const SweepPlan& plan, int count, int reps, double min_time) {
  const size_t n = plan.configs.size();
  std::vector<double> run(n), reference(n);
  std::vector<std::string> problem(n);
  for (size_t i = 0; i < n; ++i) {
    const SweepConfig& c = plan.configs[i];
    run[i] = shard_run_cost(c, reps, min_time);
    reference[i] = sweep_runnable(c) ? sweep_reference_work(c) / kShardReferenceRate : 0;
    problem[i] = c.embed > 0 ? std::string() : problem_key(c);  // "": paid by every layer row
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return run[a] + reference[a] > run[b] + reference[b];
  });
  ShardSplit split;
  split.shard_of.assign(n, 0);
  split.costs.assign(size_t(count), 0.0);
  split.counts.assign(size_t(count), 0);
  std::vector<std::set<std::string>> problems(static_cast<size_t>(count));
  for (size_t i : order) {
    const size_t s =
        size_t(std::min_element(split.costs.begin(), split.costs.end()) - split.costs.begin());
    split.shard_of[i] = int(s);
    ++split.counts[s];
    split.costs[s] += run[i];
    if (reference[i] > 0 && (problem[i].empty() || problems[s].insert(problem[i]).second))
      split.costs[s] += reference[i];
  }
  return split;
}

std::vector<std::string> plan_keys(const SweepPlan& plan) {
  std::vector<std::string> keys;
  keys.reserve(plan.configs.size());
  for (const SweepConfig& c : plan.configs) {
    keys.push_back(csv_key(key_fields(key_row(c))));
  }
  return keys;
}

std::vector<std::string> plan_names(const SweepPlan& plan) {
  std::vector<std::string> names;
  names.reserve(plan.configs.size());
  for (const SweepConfig& c : plan.configs)
    names.push_back(fmt::format("{} {}{}", c.variant->spec(),
                                c.embed > 0 ? fmt::format("layer E={} ", c.embed) : "",
                                describe(c.problem, c.workload)));
  return names;
}

std::string sweep_definition(const std::vector<std::string>& keys, int reps, double min_time,
                             int threads, uint64_t seed) {
  std::string text =
      fmt::format("reps={};min_time={};threads={};seed={}\n", reps, min_time, threads, seed);
  for (const auto& k : keys) text += k + '\n';
  return fmt::format("{:016x}", stable_hash(text));
}

}  // namespace attnbench
