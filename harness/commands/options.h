// The options the commands share and their validators: list parsing, integer, seed, number,
// output file and input checks, the problem options of run, layer, pattern and sweep, and their
// help texts.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/core/problem.h"
#include "common/core/registry.h"
#include "common/core/workload.h"
#include "common/io/inputs.h"

namespace attnbench::cli {

// The help of --file (machine) and --machine-file (sweep).
constexpr const char* kMachineFileHelp =
    "keep the machine figures in FILE: read back when it holds this host's figures at these "
    "threads, else measured and written there; processes sharing FILE measure once (the "
    "shards of a cluster sweep)";

/// The list options' grammar: comma-separated items, each a positive integer N or a range
/// A..B with an optional step rule. `same` (when `same_word` is set) stands for 0.
std::vector<int64_t> parse_list(const std::string& text, const std::string& what, bool same_word);

// ----- option validators -----

// An integer option in [lo, hi], parsed exactly: no clamping, no wrap-around, no fraction.
CLI::Validator int_in(int64_t lo, int64_t hi);
// "1k" -> "1024", "4K" -> "4096": a size with the suffix k (x 1024); any other text unchanged.
std::string expand_k(const std::string& text);
// A length (--seq, --seq-k) of a command that measures one problem: int_in, with k suffixes;
// a list or range is refused with a pointer to `attnbench sweep`.
CLI::Validator length_in(int64_t lo, int64_t hi, const std::string& command);
// A seed: any integer in [0, 2^64 - 1], written in decimal.
CLI::Validator seed_value();
// A file an option writes (--output, --save-grads), checked before any work so a bad path never
// costs a measurement. `kind` names what is written (".npy", ".npz").
CLI::Validator output_file(const char* kind);
// A finite number in [lo, hi] (NaN and infinities refused).
CLI::Validator number_in(double lo, double hi);
// An input distribution (--input of run and pattern), rewritten to its canonical name.
CLI::Validator input_name();
// The --input help of run and pattern: one line per input.
std::string input_help(const std::string& what);

constexpr int64_t kMaxExtent = std::numeric_limits<int32_t>::max();  // n, m and d each
constexpr int64_t kMaxHeads = Problem::kMaxBatchOrHeads;             // B and H each

// ----- shared problem options -----

struct ProblemOptions {
  int64_t batch = 1, heads = 8, kv_heads = 0, seq = 1024, seq_k = 0, dim = 64;
  bool causal = false;
  std::string score = "scaled_dot";
  int64_t score_hidden = 0;
  std::string dtype = "f32";
  std::string input = "gaussian";
  double scale = 1.0;
  uint64_t seed = 0;
  int threads = 0, reps = 3;
  double min_time = 0.1;
  bool remeasure = false;  ///< --remeasure: the machine figures measured anew, not read back

  /// The problem these options state.
  Problem problem() const {
    Problem p;
    p.batch = batch, p.heads = heads, p.kv_heads = kv_heads, p.n = seq, p.m = seq_k, p.dim = dim;
    p.causal = causal, p.seed = seed;
    p.score = parse_score(score), p.score_hidden = score_hidden;
    p.dtype = parse_dtype(dtype);
    return p;
  }
  /// The workload these options state (threads still unresolved).
  Workload workload() const {
    Workload w;
    w.input = canonical_input(input), w.scale = scale, w.threads = threads;
    return w;
  }
};

// --causal of run, layer and pattern: bare (on), on or off; sets `causal`.
CLI::Option* add_causal_option(CLI::App* cmd, bool& causal, const std::string& help);
// --score-hidden, on run and sweep.
void add_score_hidden_option(CLI::App* app, ProblemOptions& o);
// --seed, --threads, --reps and --min-time.
void add_timing_options(CLI::App* app, ProblemOptions& o);

// The size options of run and layer.
CLI::Option* add_batch_option(CLI::App* cmd, ProblemOptions& o);
CLI::Option* add_heads_option(CLI::App* cmd, ProblemOptions& o);
CLI::Option* add_kv_heads_option(CLI::App* cmd, ProblemOptions& o);
CLI::Option* add_seq_option(CLI::App* cmd, ProblemOptions& o, const std::string& help);
CLI::Option* add_seq_k_option(CLI::App* cmd, ProblemOptions& o, const std::string& help);

// The inputs of --inputs FILE, if given: they set *p's sizes, and the size options given
// beside the file must agree with them.
std::optional<Inputs> load_given_inputs(const std::string& path,
                                        const std::vector<CLI::Option*>& size_opts, Problem* p);

// --key-padding and --attn-mask of run and layer.
void add_mask_options(CLI::App* cmd, std::string& key_padding, std::string& mask_path);

// The variant of a command that runs one spec (run, layer, pattern); a parameter grid is
// refused.
std::unique_ptr<Variant> make_one_variant(const std::string& spec, const std::string& command);

}  // namespace attnbench::cli
