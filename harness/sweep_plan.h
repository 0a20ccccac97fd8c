// The configurations a sweep runs: the cross product of its variants and problem axes, in run
// order, with duplicates left out. Plain data, no I/O: the sweep command builds a plan, then
// runs its configurations one by one.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/core/problem.h"
#include "common/core/registry.h"
#include "common/core/workload.h"
#include "harness/layer.h"

namespace attnbench {

/// One key padding setting of a sweep: none, lengths (one per batch element, or one for
/// all), or a padding fraction F whose lengths are drawn from the seed (padding_lengths).
struct PaddingSetting {
  std::string lengths;   ///< comma list, "" = none
  double fraction = -1;  ///< >= 0: draw the lengths
};

/// The problem axes of a sweep, parsed from the command line (an empty list plans nothing).
struct SweepAxes {
  std::vector<int64_t> seqs;  ///< query lengths n
  /// Key lengths m, crossed with `seqs`; 0 stands for m = n (also the default).
  std::vector<int64_t> seq_ks = {0};
  std::vector<int64_t> batches, heads, dims;
  /// Key/value head counts G crossed with `heads` (grouped-query attention); 0 stands for
  /// G = H (the default). A G that does not divide an H is left out for that H.
  std::vector<int64_t> kv_heads = {0};
  /// Embedding sizes E of multi-head layer rows (harness/layer.h), with d = E / H in place of
  /// `dims`; empty: rows of plain attention.
  std::vector<int64_t> embeds;
  std::vector<bool> causals;
  std::vector<Score> scores = {Score::scaled_dot};  ///< scoring functions
  int64_t score_hidden = 0;                         ///< additive hidden size (0: d)
  std::vector<std::string> inputs;                  ///< input distributions
  std::vector<double> scales = {1.0};               ///< logit sharpening factors (Workload)
  std::vector<std::string> passes = {"fwd"};        ///< fwd, bwd, fwdbwd (Workload::pass)
  std::vector<DType> dtypes = {DType::f32};         ///< precisions (Problem::dtype)
  /// Key padding settings (parse_padding_settings); empty or {none}: no padding.
  std::vector<PaddingSetting> paddings;
  uint64_t seed = 0;
  int threads = 1;  ///< resolved thread count (never 0)
};

/// The valid key lengths of `text` (--key-padding: "700,1024", one per batch element, or one
/// value for every element) for a batch of `batch`. Throws UsageError naming what is wrong.
std::vector<int64_t> parse_key_lengths(const std::string& text, int64_t batch);

/// Lengths of padding fraction f in [0, 1) for p: per batch element b,
/// L_b = m - round(u_b 2 f m) for f <= 1/2 and L_b = round((1 - u_b) 2 (1 - f) m) above,
/// u_b uniform in [0, 1) from p's seed, so the expected padded share of the keys is f.
std::vector<int64_t> padding_lengths(const Problem& p, double f);

/// The sweep's --key-padding ("700,1024;1024;none": settings separated by ';', each a comma
/// list or `none`) and --padding-fraction ("0,0.5": comma list of fractions), in that order.
std::vector<PaddingSetting> parse_padding_settings(const std::string& lists,
                                                   const std::string& fractions);

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

/// The specs a spec with parameter grids stands for: a value `a|b|c` is a grid of three
/// values, and several grids give their cross product, the first parameter outermost
/// ("bigbird:block=32|64,random=1|2" gives block=32,random=1, block=32,random=2,
/// block=64,random=1, block=64,random=2). The other parameters keep their text as written; a
/// spec without a grid is returned as it is. Throws SpecError naming the parameter for a grid
/// with an empty value ("window=|64", "window=64||128") or a value listed twice.
std::vector<std::string> expand_spec_grids(const std::string& spec);

/// The variants of a sweep: one per spec, a spec with grids expanded (expand_spec_grids) into
/// one per combination, or every registered variant at its defaults when `specs` is empty.
/// Throws SpecError for a bad spec (before any work is planned).
std::vector<std::unique_ptr<Variant>> make_sweep_variants(const std::vector<std::string>& specs);

/// Expands variants x axes into the plan. Order, outermost first: inputs, scales, causal,
/// scores, dims (or embeds), heads, kv_heads, batches, paddings, seqs, seq_ks, passes, variants.
/// The bilinear and additive problems carry their seeded weights (make_score_weights, one set per
/// shape shared by the configurations). Throws UsageError for a problem that fails
/// Problem::validate (or a workload that fails Workload::validate), for trained inputs that do
/// not fit a problem or cannot be read (check_trained_fits), for a kv_heads value that
/// divides none of the heads, and for layer rows (embeds) with another input than gaussian, another
/// scale than 1, another score than scaled_dot or grouped key/value heads.
SweepPlan plan_sweep(std::vector<std::unique_ptr<Variant>> variants, const SweepAxes& axes);

/// --causal of the sweep: "off", "on" or "both" (off first). Throws UsageError otherwise.
std::vector<bool> parse_causal_mode(const std::string& mode);

/// --score of the sweep: comma-separated scoring function names, in the order given. Throws
/// UsageError naming an unknown one and the accepted names.
std::vector<Score> parse_score_list(const std::string& text);

/// --dtype of the sweep: comma-separated precisions (f32, bf16), in the order given. Throws
/// UsageError naming an unknown one and the accepted names.
std::vector<DType> parse_dtype_list(const std::string& text);

/// --pass of the sweep: comma-separated passes (fwd, bwd, fwdbwd), in the order given. Throws
/// UsageError naming an unknown one and the accepted names.
std::vector<std::string> parse_pass_list(const std::string& text);

/// --input of the sweep: comma-separated input names (canonical_input: `trained` is
/// `trained:layer=0`), in the order given. Throws UsageError naming an unknown one and the
/// accepted names.
std::vector<std::string> parse_input_list(const std::string& text);

/// --scale of the sweep: comma-separated positive numbers, in the order given. Throws
/// UsageError naming a value that is not one.
std::vector<double> parse_scale_list(const std::string& text);

/// The layer a configuration with embed > 0 runs (self-attention when its m = n, else
/// cross-attention with keys and values of their own).
LayerProblem layer_problem(const SweepConfig& config);

/// The work of a configuration, for the sweep's ETA: its FLOPs (0 if the variant cannot
/// estimate them); 0 for a configuration the variant refuses (its row costs nothing).
double sweep_work(const SweepConfig& config);
/// The work of the configuration's error measurement, for the ETA: the (query, key) pairs the
/// float64 reference computes (all of them up to kExactPairsLimit, a sample of about that many
/// above) times the head dimension, plus a layer's projections.
double sweep_reference_work(const SweepConfig& config);
/// sweep_reference_work of each configuration of the plan as the sweep pays it: the reference
/// rows of a problem are computed once and kept while its variants are measured (see
/// measure_error), so only the first configuration of each problem that will be measured
/// (`measured[i]`) carries them; layer rows (embed > 0) compute their float64 layer every time.
std::vector<double> plan_reference_work(const SweepPlan& plan, const std::vector<bool>& measured);
/// Whether the variant can run the configuration (its capabilities; the row of one it cannot
/// is "unsupported" and takes no time).
bool sweep_runnable(const SweepConfig& config);

/// Appends the configurations of `more` to `plan` (taking over its variants), leaving out
/// those with the same key as one already planned (listed in plan.duplicates).
void append_plan(SweepPlan& plan, SweepPlan more);

/// The sweep's estimate of its time left. A runnable configuration of variant spec v, work f
/// (sweep_work) and reference work r (sweep_reference_work) takes
///   fixed + pass + reps max(min_time, pass) + r / reference_rate,   pass = f / rate_v
/// seconds of wall time: the checked pass, the timed repetitions (each at least min_time), the
/// error measurement against the float64 reference, and a fixed part (inputs, patterns, the
/// harness). rate_v is the FLOP rate the spec's row of the largest work measured so far
/// achieved (its time_median), or, for a spec not measured yet, the median of the specs'
/// rates; reference_rate is that of the measured row with the largest reference work (its
/// error_seconds); the fixed part is the median of what measured rows took beyond those. A
/// configuration the variant refuses costs nothing (the caller leaves it out).
class EtaModel {
 public:
  EtaModel(int reps, double min_time) : reps_(reps), min_time_(min_time) {}
  /// A measured row: `wall` seconds in all, `pass` seconds per pass, `error` seconds in the
  /// error measurement.
  void add(const std::string& spec, double work, double reference_work, double wall, double pass,
           double error);
  /// Predicted seconds of a runnable configuration; NaN before the first row.
  double predict(const std::string& spec, double work, double reference_work) const;
  int rows() const { return int(fixed_.size()); }

 private:
  double timed(double pass) const;
  int reps_;
  double min_time_;
  std::vector<double> fixed_;  // what every row took beyond its passes and error measurement
  double fixed_median_ = NAN, rate_median_ = NAN;
  std::map<std::string, std::pair<double, double>> rate_;  // spec -> (work, rate)
  std::pair<double, double> reference_{0, NAN};            // (reference work, rate)
};

}  // namespace attnbench
