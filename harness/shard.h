// Sharded sweeps: a sweep's plan split into N parts of about equal estimated cost, each run on
// its own (`sweep --shard i/N`, one Slurm array task each) into its own results directory, and
// the identity of a sweep's definition that `merge` checks the parts against.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "harness/results.h"
#include "harness/sweep_plan.h"

namespace attnbench {

/// A row holding only a configuration's key columns (what --resume and merge look for).
Row key_row(const SweepConfig& c);

/// 64-bit FNV-1a of `text`: a hash that is the same on every machine and build (pattern file
/// names, sweep definitions).
uint64_t stable_hash(const std::string& text);

/// The key columns' values of a row joined as one CSV line (how plan.json and merge name a
/// configuration).
std::string csv_key(const std::vector<std::string>& fields);

/// The largest shard count --shard and --shard-plan accept (a plan is split into at most this
/// many parts; beyond it the split's own bookkeeping, not the work, dominates).
constexpr int kMaxShards = 100000;

/// --shard i/N: the shard index i and count N (0 <= i < N <= kMaxShards). Throws UsageError
/// naming the text and the accepted form.
std::pair<int, int> parse_shard(const std::string& text);

/// Rates of the shard split's cost estimate, per thread (a pass and the float64 reference
/// run on the sweep's threads; the fixed part and min_time do not shrink with them). They are
/// fixed, not measured, so every machine computes the same split, and fitted to a one-thread
/// sweep of the default variants (n = 256..2048, causal both) on an AVX-512 Xeon so that the
/// ratio of measured to estimated time varies least between its problems. Single variants
/// differ: flash ran at 80-130 GFLOP/s there, the feature-map variants at 11-26.
constexpr double kShardFlopRate = 1e10;        ///< FLOP/s of a variant's pass
constexpr double kShardBandwidth = 5e9;        ///< bytes/s moved by a pass
constexpr double kShardReferenceRate = 4e8;    ///< reference work (sweep_reference_work) per s
constexpr double kShardFixedSeconds = 0.2;     ///< inputs, patterns, harness: per runnable row
constexpr double kShardRefusedSeconds = 1e-4;  ///< a row the variant refuses

/// The estimated seconds of one configuration without its error measurement:
///   fixed + pass + reps max(min_time, pass),   pass = max(work / (kShardFlopRate t),
///                                                         memory / (kShardBandwidth t))
/// with work = sweep_work, memory the variant's memory_estimate and t the configuration's
/// threads (its workload's; 0 counts as 1); kShardRefusedSeconds for a configuration the
/// variant refuses.
double shard_run_cost(const SweepConfig& config, int reps, double min_time);

/// A plan split into shards.
struct ShardSplit {
  std::vector<int> shard_of;   ///< per configuration of the plan, its shard
  std::vector<double> costs;   ///< per shard, its estimated seconds
  std::vector<size_t> counts;  ///< per shard, its configurations
  /// The configurations of shard `s`, as plan indices in plan order.
  std::vector<size_t> members(int s) const;
  /// Longest shard cost over the mean (1 = perfectly balanced).
  double imbalance() const;
};

/// Splits `plan` into `count` shards. A configuration costs shard_run_cost, and a shard pays
/// the reference work of each problem it holds once, at kShardReferenceRate per thread (a
/// shard computes the float64 reference once per problem, as the sweep does; a layer row pays
/// its own). Two splits are made and the one whose longest shard is shorter is kept (the
/// first on a tie):
///  - packed: problems by cost descending (ties by first plan index), each with its
///    configurations by cost descending (ties by plan index), fill shard 0 up to a capacity,
///    then shard 1, ...; a problem cut at a shard's end pays its reference in both. The
///    capacity is the smallest (bisection) at which `count` shards take the whole plan, so at
///    most count - 1 problems are cut;
///  - longest processing time first: configurations by cost descending (ties by plan index),
///    each to the shard where it ends earliest (ties to the lowest index).
/// The shards are then numbered by estimated cost, longest first: a scheduler that starts
/// array tasks in index order starts the longest first. Depends on the plan alone.
ShardSplit split_shards(const SweepPlan& plan, int count, int reps, double min_time);

/// The results.csv key (key_columns(), as a CSV line) of each configuration of the plan, in
/// plan order.
std::vector<std::string> plan_keys(const SweepPlan& plan);
/// "spec problem" of each configuration of the plan (the progress line's description).
std::vector<std::string> plan_names(const SweepPlan& plan);

/// The sweep definition: 16 hex digits of stable_hash over the plan keys, in order, and the
/// timing options (reps, min_time, threads, seed). Equal for every shard of one sweep.
std::string sweep_definition(const std::vector<std::string>& keys, int reps, double min_time,
                             int threads, uint64_t seed);

}  // namespace attnbench
