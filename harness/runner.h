// Runs one variant on one problem: support check, memory guard, error against the reference,
// and timing and peak memory through Google Benchmark.
#pragma once

#include <exception>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/core/problem.h"
#include "common/core/registry.h"
#include "common/core/workload.h"
#include "common/io/inputs.h"
#include "harness/machine.h"
#include "harness/metrics.h"
#include "harness/team.h"

namespace attnbench {

struct RunOptions {
  int reps = 3;           ///< Google Benchmark repetitions
  double min_time = 0.1;  ///< seconds per repetition (Google Benchmark's MinTime)
  double exact_limit = kExactPairsLimit;
  double memory_limit = 0;  ///< bytes a configuration may use; 0 = 80% of MemAvailable
  /// Told when run_one starts a stage ("checked", then "timed"): the progress of a long run.
  std::function<void(const std::string& stage)> stage = nullptr;
};

/// One result row: a variant on a problem.
struct Row {
  std::string spec, variant;
  Problem problem;
  Workload workload;          ///< threads resolved (never 0) once run_one has run
  std::string status = "ok";  ///< ok | skipped | unsupported | error
  std::string message;
  double time_median = NAN, time_min = NAN, time_max = NAN, time_stddev = NAN;  ///< seconds
  /// How far the timing can be trusted (see noise_reason): time_max / time_min; the 1-minute
  /// load average at the start of the timed passes; the processors other processes kept busy
  /// during them (NaN when shorter than kMinLoadInterval); and whether the row is noisy.
  double time_spread = NAN, load_avg = NAN, other_load = NAN;
  bool noisy = false;
  /// Wall seconds the error measurement took (not a results column: the sweep's ETA prices
  /// the float64 reference with it).
  double error_seconds = NAN;
  int reps = 0;
  int64_t iterations = 0;
  double flops = NAN, gflops = NAN, gemm_fraction = NAN;
  double peak_bytes = NAN, estimated_bytes = NAN;
  ErrorStats error{NAN, NAN, NAN, 0, 0, NAN, NAN};
  /// bf16 rows (Problem::dtype): the relative Frobenius error of the variant's float32 path
  /// on the same bf16-rounded inputs against the same float64 reference on the unrounded
  /// ones, i.e. what rounding the inputs costs alone (rel_fro_error less this is the bf16
  /// arithmetic's share); NaN for f32 rows.
  double rounded_input_error = NAN;
  std::string notes;  ///< the variant's notes() after the last timed pass
  /// The inputs beyond q, k and v the variant takes that the problem did not give (its
  /// stand-ins computed instead), joined by '+': the stand_ins column; "" for none.
  std::string stand_ins;
  /// Where the inputs came from (the input_source column): "generated", "file" or
  /// "trained@<first 12 hex of the checkpoint>"; set by run_one, "" = derived from the
  /// workload's input (trained inputs then show as "trained").
  std::string input_source;
  /// Seconds per timed pass in each phase the variant marks (common/core/phase.h), summed over
  /// the threads that ran it; the mean over every timed pass. Empty if it marks none.
  std::map<std::string, double> phases;
  /// A multi-head layer row (harness/layer.h): its embedding size E (d = E / H); 0 for a row
  /// of plain attention.
  int64_t embed = 0;
  /// A layer row: the attention core's share of the layer's time, measured around the core
  /// within the timed passes; NaN for plain attention.
  double attention_share = NAN;
  /// Wall seconds of the variant's prepare() (Variant::prepare: random draws made once per
  /// problem, outside the timed passes); NaN for a variant with nothing to prepare.
  double prepare_seconds = NAN;
  /// Training passes (workload pass bwd or fwdbwd; NaN for fwd rows): the bytes the forward
  /// kept for the backward (held after forward_train returned, beyond inputs and output), as
  /// measured by the counting allocator and as the variant estimates them; and the relative
  /// Frobenius error of dQ, dK and dV against exact softmax attention's gradient in float64 on
  /// the same inputs and dO, over grad_heads whole heads (see pick_gradient_heads).
  double saved_bytes = NAN, saved_estimate_bytes = NAN;
  double grad_err_q = NAN, grad_err_k = NAN, grad_err_v = NAN;
  int64_t grad_heads = 0;
  /// Decode rows (workload pass decode; NaN for the others): the wall seconds of the prefill
  /// that builds the state of n tokens (median over the repetitions, outside the timed steps);
  /// the time of one step (time_median) and the tokens the batch generates per second with it
  /// (B / time); the variant's state per sequence after the prefill; the bytes of state one
  /// step reads, and that traffic per step time as a fraction of the machine's memory
  /// bandwidth (MachineFigures::bandwidth_gbs; NaN when it was not measured).
  double prefill_seconds = NAN, time_per_token = NAN, tokens_per_s = NAN;
  double state_bytes = NAN, bytes_read_per_step = NAN, bandwidth_fraction = NAN;
  /// The machine that measured the row (its hostname; the sweep sets it): shards of one sweep
  /// may run on several. The last results.csv column.
  std::string host;
};

/// Generation steps each repetition of a decode row times, after a prefill of n tokens: the
/// steps run at contexts n .. n + steps - 1, n / 64 of them clamped to [8, 64] (so the context
/// grows by at most 1/64 beyond n once n >= 512).
int64_t decode_timed_steps(int64_t n);
/// Positions the checked decode pass generates (the last ones of the sequence; the prefill
/// holds the others): min(n, 8).
int64_t decode_checked_steps(int64_t n);
/// Token t of each input p gives (Problem::extra_inputs): its row t on the token axis, kept
/// with length 1, as a decode step takes it (DecodeState::step_given).
ExtraInputs token_inputs(const Variant& variant, const Problem& p, int64_t t);

/// A row's time is marked noisy (Row::noisy, a warning on stderr) when its repetitions
/// spread by more than kNoisySpread (time_max / time_min, with 2 or more repetitions), or when
/// other processes kept busy more than kNoisyLoadMargin processors beyond those the row left
/// free (other_load > max(0, processors - threads) + margin).
constexpr double kNoisySpread = 1.5;
constexpr double kNoisyLoadMargin = 0.5;
/// Why the timing of an ok row is noisy by that rule, "" when it is not; `processors` is the
/// number this process may use.
std::string noise_reason(const Row& row, int processors);
/// noise_reason with the processors of this process.
std::string noise_reason(const Row& row);

/// Bytes of memory the system can give (MemAvailable).
double available_memory();

/// Runs `variant` on `p` under `w`: every call into it with w.threads threads (0 = every core;
/// see ThreadTeam), inputs from `given` if set (w.input is then "file"), else generated from
/// w.input and w.scale.
/// The output of the checked forward pass is moved into *output if requested. The Google
/// Benchmark JSON of the runs is stored in *bench_json when given. Never throws for a
/// variant's failure: the row's status says what happened.
///
/// Training passes (w.pass bwd or fwdbwd; see common/core/backward.h): the checked pass is
/// Variant::run_train (its output measured as above, and the bytes its saved state holds),
/// then Variant::run_backward on dO (given->dout if the inputs carry one, else generate_dout),
/// whose gradients are compared with exact attention's (measure_grad_error) and moved into
/// *grads if requested. bwd times the backward alone on that saved state; fwdbwd times
/// run_train and the backward together, each pass building its own state.
/// Pass decode (causal self-attention, a variant with a Decoder): the checked pass prefills
/// n - decode_checked_steps(n) tokens and generates the rest one step at a time; those rows
/// are compared with exact attention (measure_error_on_rows). Each timed repetition prefills
/// the n tokens (timed apart: prefill_s) and times decode_timed_steps(n) steps fed with rows
/// of the inputs taken again from the start; time_median is the time of one step.
struct Gradients {
  Tensor dq, dk, dv;
  InputGrads inputs = {};  ///< of the inputs beyond q, k and v the problem gave, by name
};
Row run_one(Variant& variant, const Problem& p, const Workload& w, const Inputs* given,
            const MachineFigures& mf, const RunOptions& opt, Tensor* output = nullptr,
            nlohmann::json* bench_json = nullptr, Gradients* grads = nullptr);

/// Calls variant.prepare(p) (Variant::prepare: its draws from the seed and shapes, made once,
/// outside the timed passes) and, when it prepared anything, stores its wall time in
/// row.prepare_seconds. Returns whether it did. run_one and the layer call it before their
/// checked pass.
bool prepare_variant(Variant& variant, const Problem& p, Row& row);

/// Throws UsageError for repetitions below 1 or a min_time outside [0, 3600] s.
void check_run_options(const RunOptions& opt);

/// Why `need` bytes (of which `estimate` is the variant's) will not fit under opt's memory
/// limit, or "" if they do.
std::string too_large(double need, double estimate, const RunOptions& opt);

/// Times `pass` with Google Benchmark under `name`: opt.reps repetitions of at least
/// opt.min_time seconds each, with the heap peak and the phases marked inside it counted.
/// Fills row's time, reps, iterations, gflops (from row.flops), gemm_fraction, peak_bytes and
/// phases, and *bench_json if given. Returns false with row.status "error" when Google
/// Benchmark reports an error or no run.
/// With `before_run`, each repetition calls it first, outside the timed loop (the decode pass
/// builds its state there), and runs exactly `iterations` passes (> 0) instead of opt.min_time
/// seconds of them.
bool time_passes(const std::string& name, const RunOptions& opt, const MachineFigures& mf,
                 const std::function<void()>& pass, Row& row, nlohmann::json* bench_json,
                 const std::function<void()>& before_run = {}, int64_t iterations = 0);

/// Sets row.status and message for an exception that ended a run: "unsupported" for an
/// UnsupportedError, "error" otherwise ("out of memory" for std::bad_alloc).
void record_failure(Row& row, const std::exception& e);

/// Parses Google Benchmark's JSON text, reading the bare NaN and inf its reporter writes for
/// non-finite figures as null.
nlohmann::json parse_benchmark_json(const std::string& text);

/// The `phases` column: a JSON object of phase name to seconds, or "" when there are none.
std::string phases_text(const std::map<std::string, double>& phases);

/// The row as a JSON object (same fields as the CSV).
nlohmann::ordered_json to_json(const Row& r);

}  // namespace attnbench
