#include "harness/shard.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

#include "common/core/error.h"
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
    const bool digits =
        !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!digits) throw bad(fmt::format("{} '{}' is not a non-negative integer", role, s));
    int64_t v = -1;
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || v > kMaxShards)
      throw bad(fmt::format("{} '{}' is above {}, the largest shard count accepted", role, s,
                            kMaxShards));
    return int(v);
  };
  const int i = number(text.substr(0, slash), "the index");
  const int n = number(text.substr(slash + 1), "the count");
  if (n < 1) throw bad("the count N must be at least 1");
  if (i >= n) throw bad(fmt::format("the index {} is not below the count {}", i, n));
  return {i, n};
}

namespace {

// The threads a configuration runs on (0: every core; counted as 1, the split depends on the
// plan alone).
double config_threads(const SweepConfig& c) { return double(std::max(1, c.workload.threads)); }

}  // namespace

double shard_run_cost(const SweepConfig& config, int reps, double min_time) {
  if (!sweep_runnable(config)) return kShardRefusedSeconds;
  double bytes = 0;
  try {
    if (config.embed == 0) bytes = config.variant->memory_estimate(config.problem);
  } catch (const std::exception&) {
  }
  if (!std::isfinite(bytes) || bytes < 0) bytes = 0;
  const double t = config_threads(config);
  const double pass =
      std::max(sweep_work(config) / (kShardFlopRate * t), bytes / (kShardBandwidth * t));
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

namespace {

// Estimated costs of a plan's configurations for the split.
struct SplitCosts {
  std::vector<double> run, reference;
  std::vector<std::string> problem;  // "" for one that shares no reference (layer, refused)
  // what configuration i adds to a shard holding the problems `held`: its run, and its
  // problem's reference when the shard holds none of that problem's configurations yet
  double added(size_t i, const std::set<std::string>& held) const {
    const bool pays = reference[i] > 0 && (problem[i].empty() || !held.count(problem[i]));
    return run[i] + (pays ? reference[i] : 0.0);
  }
};

// A split's shard of each configuration and each shard's estimated cost.
struct Assignment {
  std::vector<int> shard_of;
  std::vector<double> costs;
  double longest() const { return *std::max_element(costs.begin(), costs.end()); }
};

// Longest processing time first: configurations by cost descending (ties by plan index), each
// to the shard where it ends earliest (ties to the lowest index).
Assignment longest_first(const SplitCosts& k, int count) {
  const size_t n = k.run.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return k.run[a] + k.reference[a] > k.run[b] + k.reference[b];
  });
  Assignment a{std::vector<int>(n, 0), std::vector<double>(size_t(count), 0.0)};
  std::vector<std::set<std::string>> held(static_cast<size_t>(count));
  for (size_t i : order) {
    size_t best = 0;
    for (size_t s = 1; s < size_t(count); ++s)
      if (a.costs[s] + k.added(i, held[s]) < a.costs[best] + k.added(i, held[best])) best = s;
    a.shard_of[i] = int(best);
    a.costs[best] += k.added(i, held[best]);
    if (!k.problem[i].empty()) held[best].insert(k.problem[i]);
  }
  return a;
}

// Problems whole, in order: the configurations in `order` (each problem's together) fill shard
// 0 up to `capacity`, then shard 1, and so on; a problem split between two shards pays its
// reference in both. The last shard takes what is left, beyond the capacity if need be.
Assignment fill(const SplitCosts& k, const std::vector<size_t>& order, int count, double capacity) {
  Assignment a{std::vector<int>(k.run.size(), 0), std::vector<double>(size_t(count), 0.0)};
  std::set<std::string> held;
  size_t s = 0;
  for (size_t i : order) {
    if (a.costs[s] > 0 && a.costs[s] + k.added(i, held) > capacity && s + 1 < size_t(count)) {
      ++s;
      held.clear();
    }
    a.shard_of[i] = int(s);
    a.costs[s] += k.added(i, held);
    if (!k.problem[i].empty()) held.insert(k.problem[i]);
  }
  return a;
}

// The fill at the smallest capacity (to 1e-6 relative, by bisection) that needs no more than
// `count` shards: few problems are split, so few references are paid twice.
Assignment packed(const SplitCosts& k, int count) {
  const size_t n = k.run.size();
  // problems by their estimated cost descending (ties by first plan index); within one, its
  // configurations by cost descending (ties by plan index); a configuration with no shared
  // reference is a problem of its own
  std::map<std::string, size_t> group_of;
  std::vector<std::vector<size_t>> groups;
  std::vector<double> group_cost;
  for (size_t i = 0; i < n; ++i) {
    size_t g = groups.size();
    if (!k.problem[i].empty()) {
      const auto [it, fresh] = group_of.emplace(k.problem[i], groups.size());
      g = it->second;
      if (!fresh) {
        groups[g].push_back(i);
        group_cost[g] += k.run[i];
        continue;
      }
    }
    groups.push_back({i});
    group_cost.push_back(k.run[i] + k.reference[i]);
  }
  std::vector<size_t> by_cost(groups.size());
  std::iota(by_cost.begin(), by_cost.end(), size_t(0));
  std::stable_sort(by_cost.begin(), by_cost.end(),
                   [&](size_t a, size_t b) { return group_cost[a] > group_cost[b]; });
  std::vector<size_t> order;
  order.reserve(n);
  for (size_t g : by_cost) {
    std::stable_sort(groups[g].begin(), groups[g].end(),
                     [&](size_t a, size_t b) { return k.run[a] > k.run[b]; });
    order.insert(order.end(), groups[g].begin(), groups[g].end());
  }
  double lo = 0, hi = 0;
  for (size_t i = 0; i < n; ++i) hi += k.run[i] + k.reference[i];  // fits in one shard
  for (int step = 0; step < 200 && hi - lo > 1e-6 * hi; ++step) {
    const double mid = 0.5 * (lo + hi);
    (fill(k, order, count, mid).longest() <= mid ? hi : lo) = mid;
  }
  return fill(k, order, count, hi);
}

}  // namespace

ShardSplit split_shards(const SweepPlan& plan, int count, int reps, double min_time) {
  const size_t n = plan.configs.size();
  SplitCosts k{std::vector<double>(n), std::vector<double>(n), std::vector<std::string>(n)};
  for (size_t i = 0; i < n; ++i) {
    const SweepConfig& c = plan.configs[i];
    k.run[i] = shard_run_cost(c, reps, min_time);
    k.reference[i] =
        sweep_runnable(c) ? sweep_reference_work(c) / (kShardReferenceRate * config_threads(c)) : 0;
    if (c.embed == 0 && k.reference[i] > 0) k.problem[i] = problem_key(c);
  }
  // of the two, the split whose longest shard is shorter (the packed one on a tie)
  Assignment a = packed(k, count);
  if (Assignment b = longest_first(k, count); b.longest() < a.longest()) a = std::move(b);
  // number the shards by estimated cost, longest first (ties by the order they were filled)
  std::vector<size_t> rank(static_cast<size_t>(count));
  std::iota(rank.begin(), rank.end(), size_t(0));
  std::stable_sort(rank.begin(), rank.end(),
                   [&](size_t x, size_t y) { return a.costs[x] > a.costs[y]; });
  std::vector<int> number(static_cast<size_t>(count));
  for (size_t r = 0; r < rank.size(); ++r) number[rank[r]] = int(r);
  ShardSplit split;
  split.shard_of.resize(n);
  split.costs.assign(size_t(count), 0.0);
  split.counts.assign(size_t(count), 0);
  for (size_t i = 0; i < n; ++i) {
    const size_t s = size_t(number[size_t(a.shard_of[i])]);
    split.shard_of[i] = int(s);
    ++split.counts[s];
  }
  for (size_t s = 0; s < size_t(count); ++s) split.costs[size_t(number[s])] = a.costs[s];
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
