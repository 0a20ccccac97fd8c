// The options the commands share, their validators and the sweep's list grammar.
#include "harness/commands/options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "build_info.h"
#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/io/plugin.h"
#include "common/io/trained.h"
#include "common/kernels/bf16.h"
#include "common/patterns/pattern.h"
#include "harness/catalog.h"
#include "harness/cli.h"
#include "harness/commands/commands.h"
#include "harness/commands/meta.h"
#include "harness/commands/options.h"
#include "harness/commands/print.h"
#include "harness/layer.h"
#include "harness/machine.h"
#include "harness/merge.h"
#include "harness/output_dir.h"
#include "harness/patterns.h"
#include "harness/results.h"
#include "harness/runner.h"
#include "harness/shard.h"
#include "harness/sweep_plan.h"

namespace attnbench::cli {

namespace {

// At most this many values in one list option, ranges expanded: a range with a small step
// over a large span would otherwise plan millions of rows (or exhaust memory) by a typo.
constexpr size_t kMaxListValues = 10000;

}  // namespace

std::string expand_k(const std::string& text) {
  if (text.size() < 2 || (text.back() != 'k' && text.back() != 'K')) return text;
  const std::string digits = text.substr(0, text.size() - 1);
  if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 12)
    return text;
  return std::to_string(std::stoll(digits) * 1024);
}

// The list options' grammar: comma-separated items, each a positive integer N or a range
// A..B with an optional step rule. `same` (when `same_word` is set) stands for 0.
std::vector<int64_t> parse_list(const std::string& text, const std::string& what, bool same_word) {
  auto bad = [&](const std::string& why) {
    return UsageError(fmt::format(
        "{}: '{}' {}; accepted: a comma-separated list of positive integers (1k = 1024){} and "
        "ranges "
        "A..B:xF (A, A*F, A*F^2, ... up to B; F an integer >= 2), A..B:+S (A, A+S, A+2S, ... "
        "up to B) and A..B (doubling from A, only when it reaches B exactly), e.g. 256,512 or "
        "256..16384 or 256..5000:+256",
        what, text, why,
        !same_word             ? ""
        : what == "--kv-heads" ? ", same (G = H)"
                               : ", same (m = n)"));
  };
  auto number = [&](const std::string& word, const char* role) -> int64_t {
    const std::string s = expand_k(word);
    if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos)
      throw bad(fmt::format("has '{}' as {}, which is not a positive integer", s, role));
    int64_t v = 0;
    try {
      v = std::stoll(s);
    } catch (const std::exception&) {
      throw bad(fmt::format("has '{}', which is too large", s));
    }
    if (v <= 0) throw bad(fmt::format("has {} as {}, which is not positive", s, role));
    if (v > std::numeric_limits<int32_t>::max())
      throw bad(
          fmt::format("has {}, which is larger than {}", v, std::numeric_limits<int32_t>::max()));
    return v;
  };
  std::vector<int64_t> out;
  auto push = [&](int64_t v) {
    if (out.size() >= kMaxListValues)
      throw bad(fmt::format("has more than {} values", kMaxListValues));
    out.push_back(v);
  };
  // A..B[:RULE]: the values from A while they do not pass B, each the one before times the
  // factor (2 without a rule) or plus the step; without a rule the last must be B.
  auto range = [&](const std::string& item, size_t dots) {
    const size_t colon = item.find(':', dots);
    const int64_t lo = number(item.substr(0, dots), "a range's start");
    const int64_t hi =
        number(item.substr(dots + 2, colon == std::string::npos ? colon : colon - dots - 2),
               "a range's end");
    if (hi < lo) throw bad(fmt::format("has the empty range {}", item));
    int64_t factor = 2, step = 0;
    if (colon != std::string::npos) {
      const std::string rule = item.substr(colon + 1);
      if (rule.size() < 2 || (rule[0] != 'x' && rule[0] != '+'))
        throw bad(fmt::format("has the step rule '{}' in {}; a step rule is xF or +S", rule, item));
      const bool geometric = rule[0] == 'x';
      const int64_t k = number(rule.substr(1), geometric ? "a factor" : "a step");
      if (geometric && k < 2)
        throw bad(fmt::format("has the factor {} in {}; a factor is an integer >= 2", k, item));
      factor = geometric ? k : 0;
      step = geometric ? 0 : k;
    }
    std::vector<int64_t> values;
    for (int64_t v = lo;;) {
      values.push_back(v);
      if (values.size() > kMaxListValues)
        throw bad(fmt::format("has more than {} values", kMaxListValues));
      // the next value, unless it would pass hi (checked before it is formed: no overflow)
      if (factor > 0 ? v > hi / factor : v > hi - step) break;
      v = factor > 0 ? v * factor : v + step;
    }
    if (colon == std::string::npos && values.back() != hi)
      throw bad(fmt::format(
          "{}does not reach {} by doubling from {}; write {}..{}:x2 to stop at {}, or "
          "{}..{}:+{} (a step rule lists the values up to the end, the end itself when it is "
          "reached)",
          item == text ? "" : fmt::format("has {}, which ", item), hi, lo, lo, hi, values.back(),
          lo, hi, lo));
    for (int64_t v : values) push(v);
  };
  if (text.empty()) throw bad("is empty");
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t dots = item.find("..");
    if (same_word && item == "same")
      push(0);
    else if (dots == std::string::npos)
      push(number(item, "a value"));
    else
      range(item, dots);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// ----- option validators -----

// An integer option in [lo, hi], parsed exactly: no clamping, no wrap-around, no fraction.
CLI::Validator int_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        int64_t v = 0;
        const char* end = text.data() + text.size();
        auto [ptr, ec] = std::from_chars(text.data(), end, v);
        if (ec == std::errc::result_out_of_range ||
            (ec == std::errc() && ptr == end && (v < lo || v > hi)))
          return fmt::format("{} is out of range; accepted: an integer in [{}, {}]", text, lo, hi);
        if (ec != std::errc() || ptr != end || text.empty())
          return fmt::format("'{}' is not an integer; accepted: an integer in [{}, {}]", text, lo,
                             hi);
        return "";
      },
      fmt::format("INT in [{}, {}]", lo, hi));
}

CLI::Validator length_in(int64_t lo, int64_t hi, const std::string& command) {
  const CLI::Validator exact = int_in(lo, hi);
  return CLI::Validator(
      [exact, lo, hi, command](std::string& text) -> std::string {
        if (text.find(',') != std::string::npos || text.find("..") != std::string::npos)
          return fmt::format(
              "'{}' is a list; {} measures one length, an integer in [{}, {}] "
              "(1k = 1024): `attnbench sweep --seq {}` runs every length of a "
              "list",
              text, command, lo, hi, text);
        text = expand_k(text);
        return exact(text);
      },
      fmt::format("INT in [{}, {}] (1k = 1024)", lo, hi));
}

// A seed: any integer in [0, 2^64 - 1], written in decimal.
CLI::Validator seed_value() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t v = 0;
        const char* end = text.data() + text.size();
        auto [ptr, ec] = std::from_chars(text.data(), end, v);
        if (ec != std::errc() || ptr != end || text.empty())
          return fmt::format("'{}' is not a seed; accepted: an integer in [0, {}]", text,
                             std::numeric_limits<uint64_t>::max());
        return "";
      },
      "INT in [0, 2^64-1]");
}

// A file an option writes (--output, --save-grads), checked before any work so a bad path never
// costs a measurement: not empty, not a directory or device, in a directory that exists and is
// writable. `kind` names what is written (".npy", ".npz").
CLI::Validator output_file(const char* kind) {
  return CLI::Validator(
      [kind](std::string& text) -> std::string {
        namespace fs = std::filesystem;
        if (text.empty()) return fmt::format("is empty; accepted: the path of a {} file", kind);
        std::error_code ec;
        const auto st = fs::status(text, ec);
        if (fs::is_directory(st))
          return fmt::format("'{}' is a directory; accepted: the path of a {} file", text, kind);
        if (fs::exists(st) && !fs::is_regular_file(st))
          return fmt::format(
              "'{}' is not a regular file (a device or pipe); accepted: the path "
              "of a {} file",
              text, kind);
        fs::path parent = fs::path(text).parent_path();
        if (parent.empty()) parent = ".";
        if (!fs::is_directory(parent, ec))
          return fmt::format("'{}': the directory '{}' does not exist", text, parent.string());
        if (::access(parent.c_str(), W_OK) != 0)
          return fmt::format("'{}': the directory '{}' is not writable ({})", text, parent.string(),
                             std::strerror(errno));
        return "";
      },
      fmt::format("FILE ({})", kind));
}

// A finite number in [lo, hi] (NaN and infinities refused).
CLI::Validator number_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double v = 0;
        const char* end = text.data() + text.size();
        auto [ptr, ec] = std::from_chars(text.data(), end, v);
        if (ec != std::errc() || ptr != end || text.empty() || !std::isfinite(v) || v < lo ||
            v > hi)
          return fmt::format("'{}' is not accepted; accepted: a number in [{}, {}]", text, lo, hi);
        return "";
      },
      fmt::format("NUMBER in [{}, {}]", lo, hi));
}

// An input distribution (--input of run and pattern), rewritten to its canonical name
// (trained: trained:layer=0).
CLI::Validator input_name() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          text = canonical_input(text);
        } catch (const UsageError& e) {
          return e.what();
        }
        return "";
      },
      fmt::format("one of {}", accepted_inputs()));
}

// The --input help of run and pattern: one line per input.
std::string input_help(const std::string& what) {
  std::string help = what + ":";
  for (const auto& name : input_distributions())
    help += fmt::format("\n  {}: {}", name, describe_distribution(name));
  return help + fmt::format("\n  trained[:layer=L]: {}", describe_distribution("trained"));
}

// --causal of run, layer and pattern: bare, on or off (sweep takes on|off|both).
CLI::Option* add_causal_option(CLI::App* cmd, bool& causal, const std::string& help) {
  return cmd
      ->add_option_function<std::string>(
          "--causal", [&causal](const std::string& v) { causal = v != "off"; },
          help + ": --causal (or --causal on) to apply it, --causal off (the default) not")
      ->expected(0, 1)
      ->type_name("[on|off]")
      ->check(CLI::Validator(
          [name = cmd->get_name()](std::string& v) -> std::string {
            if (v.empty() || v == "on" || v == "off") return std::string();
            return fmt::format("'{}' is not on or off{}", v,
                               v == "both" ? fmt::format(" ({} measures one problem; `attnbench "
                                                         "sweep --causal both` runs both)",
                                                         name)
                                           : std::string());
          },
          "on|off", "causal"));
}

// --score-hidden, on run and sweep.
void add_score_hidden_option(CLI::App* app, ProblemOptions& o) {
  app->add_option("--score-hidden", o.score_hidden, "hidden size h of the additive score (0 = d)")
      ->capture_default_str()
      ->check(int_in(0, kMaxExtent));
}

void add_timing_options(CLI::App* app, ProblemOptions& o) {
  app->add_option("--seed", o.seed, "seed of every random choice")
      ->capture_default_str()
      ->check(seed_value());
  app->add_option("--threads", o.threads,
                  fmt::format("threads (0 = every core; at most {} = {} x the cores)",
                              max_threads(), kMaxThreadsPerCore))
      ->capture_default_str()
      ->check(int_in(0, max_threads()));
  app->add_option("--reps", o.reps, "Google Benchmark repetitions")
      ->capture_default_str()
      ->check(int_in(1, 1000));
  app->add_option("--min-time", o.min_time,
                  "minimum seconds per repetition (0 = one forward pass per repetition)")
      ->capture_default_str()
      ->check(number_in(0.0, 3600.0));
  app->add_flag("--remeasure", o.remeasure,
                "measure the machine figures (GEMM rate, bandwidth) again and keep them, rather "
                "than read those kept from the last day (ATTNBENCH_MACHINE_DIR or "
                "~/.cache/attnbench/machine)");
}

// The size options of run and layer.
CLI::Option* add_batch_option(CLI::App* cmd, ProblemOptions& o) {
  return cmd->add_option("--batch", o.batch, "batch size B")
      ->capture_default_str()
      ->check(int_in(1, kMaxHeads));
}
CLI::Option* add_heads_option(CLI::App* cmd, ProblemOptions& o) {
  return cmd->add_option("--heads", o.heads, "heads H")
      ->capture_default_str()
      ->check(int_in(1, kMaxHeads));
}
CLI::Option* add_kv_heads_option(CLI::App* cmd, ProblemOptions& o) {
  return cmd
      ->add_option("--kv-heads", o.kv_heads,
                   "key/value heads G, a divisor of H (grouped-query attention: k and v [B, G, m, "
                   "d], each read by H / G query heads; 1 = multi-query; 0 = H)")
      ->capture_default_str()
      ->check(int_in(0, kMaxHeads));
}
CLI::Option* add_seq_option(CLI::App* cmd, ProblemOptions& o, const std::string& help) {
  return cmd->add_option("--seq", o.seq, help)
      ->capture_default_str()
      ->transform(length_in(1, kMaxExtent, cmd->get_name()));
}
CLI::Option* add_seq_k_option(CLI::App* cmd, ProblemOptions& o, const std::string& help) {
  return cmd->add_option("--seq-k", o.seq_k, help)
      ->transform(length_in(1, kMaxExtent, cmd->get_name()));
}

// With --inputs the file decides the sizes: a size option given beside it must agree.
void check_sizes_agree(const std::vector<CLI::Option*>& opts, const Problem& p,
                       const std::string& path) {
  for (const CLI::Option* o : opts) {
    if (o->count() == 0) continue;
    const std::string name = o->get_name();
    const int64_t given = o->as<int64_t>();
    const int64_t file = name == "--batch"      ? p.batch
                         : name == "--heads"    ? p.heads
                         : name == "--kv-heads" ? p.kv_head_count()
                         : name == "--seq"      ? p.n
                         : name == "--seq-k"    ? p.keys()
                                                : p.dim;
    if (given != file && !(name == "--kv-heads" && given == 0 && file == p.heads))
      throw UsageError(fmt::format(
          "{} {} disagrees with --inputs {}, whose tensors have {} = {} "
          "(q [B, H, n, d] = {}, k and v [B, G, m, d] = {}); with --inputs "
          "leave the size options out or give the file's sizes",
          name, given, path, name.substr(2), file, p.q_shape().str(), p.kv_storage_shape().str()));
  }
}

// The inputs of --inputs FILE, if given: they set *p's sizes, and the size options given
// beside the file must agree with them.
std::optional<Inputs> load_given_inputs(const std::string& path,
                                        const std::vector<CLI::Option*>& size_opts, Problem* p) {
  if (path.empty()) return std::nullopt;
  std::optional<Inputs> given = load_inputs_npz(path, p);
  check_sizes_agree(size_opts, *p, path);
  return given;
}

// The variant of a command that runs one spec (run, layer, pattern). A parameter grid
// (a|b) is a sweep feature: refused here, naming the sweep that runs it.
std::unique_ptr<Variant> make_one_variant(const std::string& spec, const std::string& command) {
  // a malformed grid is named as such
  if (const auto specs = expand_spec_grids(spec); specs.size() > 1)
    throw UsageError(fmt::format(
        "--variant '{}': a parameter grid (values separated by '|') is a sweep feature; {} "
        "takes one spec, e.g. --variant '{}' (attnbench sweep --variant '{}' runs all {})",
        spec, command, specs.front(), spec, specs.size()));
  return make_variant(spec);
}

// --key-padding and --attn-mask of run and layer.
void add_mask_options(CLI::App* cmd, std::string& key_padding, std::string& mask_path) {
  cmd->add_option("--key-padding", key_padding,
                  "valid key lengths, one per batch element or one for all "
                  "(700,1024): keys j >= len_b are invisible to batch element b");
  cmd->add_option("--attn-mask", mask_path,
                  ".npy (or .npz array attn_mask) of [n, m] or [B|1, H|1, n, m]: "
                  "float32 added to the logits, or bool/uint8 with true = masked out")
      ->check(CLI::ExistingFile);
}

}  // namespace attnbench::cli

namespace attnbench {

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what) {
  return cli::parse_list(text, what, /*same_word=*/false);
}

std::vector<int64_t> parse_seq_k_list(const std::string& text) {
  return cli::parse_list(text, "--seq-k", /*same_word=*/true);
}

}  // namespace attnbench
