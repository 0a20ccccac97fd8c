// The configurations a sweep runs: the cross product of its variants and problem axes, in run
// order, with duplicates left out. Plain data, no I/O: the sweep command builds a plan, then
// runs its configurations one by one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/problem.h"
#include "common/registry.h"
#include "common/workload.h"
#include "harness/layer.h"

namespace attnbench {

/// The problem axes of a sweep, parsed from the command line (an empty list plans nothing).
struct SweepAxes {
  std::vector<int64_t> seqs;  ///< query lengths n (m = n)
  std::vector<int64_t> batches, heads, dims;
  /// Embedding sizes E of multi-head layer rows (harness/layer.h), with d = E / H in place of
  /// `dims`; empty: rows of plain attention.
  std::vector<int64_t> embeds;
  std::vector<bool> causals;
  std::vector<Score> scores = {Score::scaled_dot};  ///< scoring functions
  int64_t score_hidden = 0;                         ///< additive hidden size (0: d)
  std::vector<std::string> inputs;                  ///< input distributions
  uint64_t seed = 0;
  int threads = 1;  ///< resolved thread count (never 0)
};

/// One configuration of a sweep: a variant on a problem under a workload.
struct SweepConfig {
  Variant* variant = nullptr;  ///< owned by the plan
  Problem problem;
  Workload workload;  ///< threads resolved (never 0)
  int64_t embed = 0;  ///< a multi-head layer row of this E around the variant; 0: plain
};

/// The configurations of a sweep in run order.
struct SweepPlan {
  SweepAxes axes;                                  ///< what the plan was built from
  std::vector<std::unique_ptr<Variant>> variants;  ///< as given, each owned here
  std::vector<SweepConfig> configs;                ///< what the sweep runs, in order
  /// "spec problem" of each configuration left out because an earlier one has the same
  /// canonical spec and problem (flash and flash:block_q=64, or a length listed twice).
  std::vector<std::string> duplicates;
};

/// The variants of a sweep: one per spec, or every registered variant at its defaults when
/// `specs` is empty. Throws SpecError for a bad spec (before any work is planned).
std::vector<std::unique_ptr<Variant>> make_sweep_variants(const std::vector<std::string>& specs);

/// Expands variants x axes into the plan. Order, outermost first: inputs, causal, scores, dims
/// (or embeds), heads, batches, seqs, variants. The bilinear and additive problems carry their
/// seeded weights (make_score_weights, one set per shape shared by the configurations). Throws
/// UsageError for a problem that fails Problem::validate (or a workload that fails
/// Workload::validate), and for layer rows (embeds) with another input than gaussian or
/// another score than scaled_dot.
SweepPlan plan_sweep(std::vector<std::unique_ptr<Variant>> variants, const SweepAxes& axes);

/// --causal of the sweep: "off", "on" or "both" (off first). Throws UsageError otherwise.
std::vector<bool> parse_causal_mode(const std::string& mode);

/// --score of the sweep: comma-separated scoring function names, in the order given. Throws
/// UsageError naming an unknown one and the accepted names.
std::vector<Score> parse_score_list(const std::string& text);

/// --input of the sweep: comma-separated input distribution names, in the order given.
/// Throws UsageError naming an unknown one and the accepted names.
std::vector<std::string> parse_input_list(const std::string& text);

/// The layer a configuration with embed > 0 runs (self-attention, as the sweep's m = n).
LayerProblem layer_problem(const SweepConfig& config);

/// The work of a configuration, for the sweep's ETA: its FLOPs (0 if the variant cannot
/// estimate them) plus a fixed cost per row.
double sweep_work(const SweepConfig& config);

}  // namespace attnbench
