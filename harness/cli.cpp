#include "harness/cli.h"

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
#include "harness/layer.h"
#include "harness/machine.h"
#include "harness/merge.h"
#include "harness/output_dir.h"
#include "harness/patterns.h"
#include "harness/results.h"
#include "harness/runner.h"
#include "harness/shard.h"
#include "harness/sweep_plan.h"

namespace attnbench {

namespace {

// At most this many values in one list option, ranges expanded: a range with a small step
// over a large span would otherwise plan millions of rows (or exhaust memory) by a typo.
constexpr size_t kMaxListValues = 10000;

// The list options' grammar: comma-separated items, each a positive integer N or a range
// A..B with an optional step rule. `same` (when `same_word` is set) stands for 0.
std::vector<int64_t> parse_list(const std::string& text, const std::string& what, bool same_word) {
  auto bad = [&](const std::string& why) {
    return UsageError(fmt::format(
        "{}: '{}' {}; accepted: a comma-separated list of positive integers{} and ranges "
        "A..B:xF (A, A*F, A*F^2, ... up to B; F an integer >= 2), A..B:+S (A, A+S, A+2S, ... "
        "up to B) and A..B (doubling from A, only when it reaches B exactly), e.g. 256,512 or "
        "256..16384 or 256..5000:+256",
        what, text, why,
        !same_word             ? ""
        : what == "--kv-heads" ? ", same (G = H)"
                               : ", same (m = n)"));
  };
  auto number = [&](const std::string& s, const char* role) -> int64_t {
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

}  // namespace

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what) {
  return parse_list(text, what, /*same_word=*/false);
}

std::vector<int64_t> parse_seq_k_list(const std::string& text) {
  return parse_list(text, "--seq-k", /*same_word=*/true);
}

namespace {

// The help of --file (machine) and --machine-file (sweep).
constexpr const char* kMachineFileHelp =
    "keep the machine figures in FILE: read back when it holds this host's figures at these "
    "threads, else measured and written there; processes sharing FILE measure once (the "
    "shards of a cluster sweep)";

std::string run_command(const std::string& cmd) {
  std::string out;
  if (FILE* f = popen(cmd.c_str(), "r")) {
    char buf[256];
    while (fgets(buf, sizeof buf, f)) out += buf;
    pclose(f);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// The source tree's state when the run was made: its commit, and every modified, added,
// deleted or untracked (not ignored) file, as `git status --porcelain` names them. Any of
// them makes the commit "-dirty": an untracked variant file is compiled in all the same.
struct GitState {
  std::string commit;
  std::vector<std::string> changes;
};

GitState git_state() {
  GitState g;
  g.commit =
      run_command(fmt::format("git -C '{}' rev-parse HEAD 2>/dev/null", ATTNBENCH_SOURCE_DIR));
  if (g.commit.empty()) {
    g.commit = ATTNBENCH_GIT_COMMIT;
    return g;
  }
  const std::string status = run_command(fmt::format(
      "git -C '{}' status --porcelain --untracked-files=all 2>/dev/null", ATTNBENCH_SOURCE_DIR));
  size_t start = 0;
  while (start < status.size()) {
    size_t end = status.find('\n', start);
    if (end == std::string::npos) end = status.size();
    if (end > start) g.changes.push_back(status.substr(start, end - start));
    start = end + 1;
  }
  if (!g.changes.empty()) g.commit += "-dirty";
  return g;
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789-_./:=,+@") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string command_line(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) s += (i ? " " : "") + shell_quote(argv[i]);
  return s;
}

std::string human_bytes(double b) {
  if (!std::isfinite(b)) return "n/a";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return fmt::format("{:.1f} {}", b, units[u]);
}

std::string human_seconds(double s) {
  if (!std::isfinite(s)) return "?";
  int64_t t = int64_t(std::llround(s));
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{:02}:{:02}", t / 60, t % 60);
}

// "[i/N] elapsed 01:02, ETA 03:04 | WHAT", cut to kProgressColumns with "..." at the end.
constexpr size_t kProgressColumns = 100;
std::string progress_line(size_t i, size_t n, double elapsed, double eta, const std::string& what) {
  std::string line = fmt::format("[{}/{}] elapsed {}, ETA {} | {}", i, n, human_seconds(elapsed),
                                 human_seconds(eta), what);
  if (line.size() > kProgressColumns) line = line.substr(0, kProgressColumns - 3) + "...";
  return line;
}

// ----- list -----

// The capability columns of `list`, one line each: header and flag.
const std::vector<std::pair<std::string, bool Capabilities::*>> kCapabilityColumns = {
    {"causal", &Capabilities::causal},       {"m!=n", &Capabilities::cross},
    {"exact", &Capabilities::exact},         {"additive", &Capabilities::additive},
    {"padding", &Capabilities::key_padding}, {"mask", &Capabilities::attn_mask},
    {"bf16", &Capabilities::bf16},
};

void print_list() {
  size_t w = 7;
  for (const VariantInfo* v : Registry::instance().all()) w = std::max(w, v->name.size());
  // each capability column as wide as its header and a space, at least 6
  auto width = [](const std::string& h) { return std::max<size_t>(h.size() + 1, 6); };
  size_t indent = w;
  std::string head = fmt::format("{:<{}}", "variant", w);
  for (const auto& [h, flag] : kCapabilityColumns) {
    head += fmt::format(" {:<{}}", h, width(h));
    indent += 1 + width(h);
  }
  // the backward and decode columns come from the variant itself (has_backward, has_decode),
  // not from a flag
  const std::string bwd = "backward", dec = "decode";
  for (const std::string& h : {bwd, dec}) {
    head += fmt::format(" {:<{}}", h, width(h));
    indent += 1 + width(h);
  }
  fmt::print("{} {}\n", head, "summary / parameters");
  for (const VariantInfo* v : Registry::instance().all()) {
    std::string line = fmt::format("{:<{}}", v->name, w);
    for (const auto& [h, flag] : kCapabilityColumns) {
      // a variant that refuses non-causal problems says "only" in the causal column
      const bool only = flag == &Capabilities::causal && v->caps.causal_only;
      line += fmt::format(" {:<{}}", only ? "only" : v->caps.*flag ? "yes" : "no", width(h));
    }
    line += fmt::format(" {:<{}}", has_backward(*v) ? "yes" : "no", width(bwd));
    line += fmt::format(" {:<{}}", has_decode(*v) ? "yes" : "no", width(dec));
    fmt::print("{} {}\n", line, v->summary);
    fmt::print("{:<{}} {}\n", "", indent, v->complexity);
    if (!v->plugin.empty()) fmt::print("{:<{}} from plugin {}\n", "", indent, v->plugin);
    for (const auto& p : v->params)
      fmt::print("{:<{}} {}={} ({}; {}): {}\n", "", indent, p.name, p.default_value,
                 to_string(p.type), p.accepted(), p.help);
  }
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
  return cmd->add_option("--seq", o.seq, help)->capture_default_str()->check(int_in(1, kMaxExtent));
}
CLI::Option* add_seq_k_option(CLI::App* cmd, ProblemOptions& o, const std::string& help) {
  return cmd->add_option("--seq-k", o.seq_k, help)->check(int_in(1, kMaxExtent));
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

nlohmann::json json_number(double x) { return std::isfinite(x) ? nlohmann::json(x) : nullptr; }

/// The bf16 kernels of the tiled attention engine on this machine (common/kernels/bf16.h): the
/// ATTNBENCH_BF16_KERNEL request, whether amx can run (and why not), whether the CPU has
/// AVX512-BF16, and the kernel bf16 rows take by default (each row's notes name the one that
/// ran: key blocks amx cannot start at take f32).
nlohmann::json bf16_kernels_json() {
  const std::string request = bf16_kernel_request();
  const bool amx = amx_usable();
  return {{"request", request},
          {"amx_usable", amx},
          {"amx_unusable_reason", amx_unusable_reason()},
          {"cpu_avx512_bf16", cpu_has_avx512_bf16()},
          {"default_kernel", amx && request != "f32" ? "amx" : "f32"}};
}

nlohmann::json meta_json(int argc, char** argv, const MachineFigures& mf, int threads) {
  const GitState git = git_state();
  return {{"date", utc_now()},
          {"attnbench_version", ATTNBENCH_VERSION},
          {"git_commit", git.commit},
          {"git_dirty", !git.changes.empty()},
          {"git_changes", git.changes},
          {"compiler", ATTNBENCH_COMPILER},
          {"cxx_flags", ATTNBENCH_CXX_FLAGS},
          {"build_type", ATTNBENCH_BUILD_TYPE},
          {"cpu_model", mf.cpu_model},
          {"host", host_name()},
          {"threads", threads},
          {"machine", to_json(mf)},
          {"command_line", command_line(argc, argv)},
          {"plugins", loaded_plugins()},
          // what `list --json` says: parameters with their defaults (plots label a spec by
          // the parameters that differ) and capabilities
          {"variants", nlohmann::json::parse(variants_json().dump())},
          {"exact_pairs_limit", kExactPairsLimit},
          {"bf16_kernels", bf16_kernels_json()}};
}

void print_row(const Row& r) {
  fmt::print("variant      {}\n", r.spec);
  fmt::print("problem      {}\n", describe(r.problem, r.workload));
  if (r.embed > 0)
    fmt::print("layer        E={}: {} heads of d={}, in- and out-projection around the variant\n",
               r.embed, r.problem.heads, r.problem.dim);
  fmt::print("status       {}{}\n", r.status, r.message.empty() ? "" : ": " + r.message);
  if (r.status != "ok") return;
  fmt::print(
      "time         {:.4f} ms median, {:.4f} ms min, {:.4f} ms max over {} reps of {} "
      "iterations\n",
      r.time_median * 1e3, r.time_min * 1e3, r.time_max * 1e3, r.reps, r.iterations);
  fmt::print("speed        {:.1f} GFLOP/s ({:.0f}% of the machine's {})\n", r.gflops,
             r.gemm_fraction * 100, r.problem.dtype == DType::bf16 ? "bf16 peak" : "GEMM rate");
  const std::string& pass = r.workload.pass;
  fmt::print("memory       {} peak {} (estimate {})\n", human_bytes(r.peak_bytes),
             pass == "bwd"      ? "of the backward beyond inputs, output, saved state and gradients"
             : pass == "fwdbwd" ? "beyond inputs, output and gradients (the saved state included)"
             : pass == "decode" ? "of a prefill and its timed steps (the state included)"
                                : "beyond inputs and output",
             human_bytes(r.estimated_bytes));
  fmt::print(
      "error        rel. Frobenius {:.3e}, max abs {:.3e}, mean cosine {:.6f} ({} of {} "
      "rows)\n",
      r.error.rel_fro, r.error.max_abs, r.error.mean_cos, r.error.rows_used, r.error.rows_total);
  if (!std::isnan(r.rounded_input_error))
    fmt::print(
        "rounding     rel. Frobenius {:.3e} of the float32 path on the same bf16-rounded "
        "inputs: the rounding of q, k, v alone\n",
        r.rounded_input_error);
  if (!std::isnan(r.error.uniform_rel_fro))
    fmt::print(
        "baselines    rel. Frobenius {:.3e} for the uniform average of the visible values, 1 "
        "for zeros\n",
        r.error.uniform_rel_fro);
  if (!std::isnan(r.error.mass_mean))
    fmt::print(
        "mass         {:.4f} mean, {:.4f} min: share of the exact softmax inside the "
        "variant's pattern\n",
        r.error.mass_mean, r.error.mass_min);
  if (pass == "decode") {
    fmt::print(
        "decode       {:.2f} us per step ({:.0f} tokens/s for the batch), prefill of n tokens "
        "{:.3f} ms\n",
        r.time_per_token * 1e6, r.tokens_per_s, r.prefill_seconds * 1e3);
    fmt::print("state        {} per sequence; a step reads {}{}\n", human_bytes(r.state_bytes),
               human_bytes(r.bytes_read_per_step),
               std::isnan(r.bandwidth_fraction)
                   ? std::string()
                   : fmt::format(" ({:.0f}% of the machine's memory bandwidth)",
                                 100 * r.bandwidth_fraction));
  }
  if (pass == "bwd" || pass == "fwdbwd") {
    fmt::print("saved        {} kept by the forward for the backward (estimate {})\n",
               human_bytes(r.saved_bytes), human_bytes(r.saved_estimate_bytes));
    if (r.grad_heads > 0)
      fmt::print(
          "grad error   rel. Frobenius dq {:.3e}, dk {:.3e}, dv {:.3e} against exact "
          "attention's gradient ({} of {} heads)\n",
          r.grad_err_q, r.grad_err_k, r.grad_err_v, r.grad_heads,
          r.problem.batch * r.problem.heads);
  }
  if (r.embed > 0)
    fmt::print("core share   {:.1f}% of the layer's time in the attention core (measured)\n",
               100 * r.attention_share);
  fmt::print(
      "noise        spread {:.2f}x (max/min), load average {:.2f}, other processes {} "
      "processors{}\n",
      r.time_spread, r.load_avg,
      std::isnan(r.other_load) ? std::string("not measured (run too short)")
                               : fmt::format("{:.1f}", r.other_load),
      r.noisy ? ": NOISY" : "");
  if (!std::isnan(r.prepare_seconds))
    fmt::print("prepare      {:.3f} ms once per problem, outside the timed passes\n",
               1e3 * r.prepare_seconds);
  if (!r.notes.empty()) fmt::print("notes        {}\n", r.notes);
  if (!r.phases.empty()) {
    double total = 0;
    for (const auto& [name, s] : r.phases) total += s;
    std::string text;
    for (const auto& [name, s] : r.phases)
      text += fmt::format("{}{} {:.4f} ms ({:.0f}%)", text.empty() ? "" : ", ", name, s * 1e3,
                          total > 0 ? 100.0 * s / total : 0.0);
    fmt::print("phases       {} per pass, summed over threads\n", text);
  }
}

// Prints the row of `run` or `layer` (as JSON or text); false, with its status on stderr, when
// it is not ok.
bool print_result(const Row& row, bool json) {
  if (json) {
    Row with_host = row;
    with_host.host = host_name();
    fmt::print("{}\n", to_json(with_host).dump(2));
  } else {
    print_row(row);
  }
  if (row.noisy)
    fmt::print(stderr, "attnbench: warning: noisy timing: {}; see the README, \"Stable numbers\"\n",
               noise_reason(row));
  if (row.status == "ok") return true;
  fmt::print(stderr, "attnbench: {}: {}\n", row.status, row.message);
  return false;
}

// ----- list -----

struct ListCommand {
  bool json = false;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("list", "variants with their parameters and capabilities");
    cmd->add_flag("--json", json, "print JSON");
    return cmd;
  }

  int run() const {
    if (json)
      fmt::print("{}\n", variants_json().dump(2));
    else
      print_list();
    return 0;
  }
};

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

// ----- run -----

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

struct RunCommand {
  ProblemOptions o;
  std::string spec, inputs_path, output_path, key_padding, mask_path, pass = "fwd", grads_path;
  bool json = false;
  std::vector<CLI::Option*> shape_opts;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("run", "one variant on one problem");
    cmd->add_option("--variant", spec, "variant spec, name:key=value,...")->required();
    shape_opts = {add_batch_option(cmd, o),
                  add_heads_option(cmd, o),
                  add_kv_heads_option(cmd, o),
                  add_seq_option(cmd, o, "query length n"),
                  add_seq_k_option(cmd, o, "key length m (default: n)"),
                  cmd->add_option("--dim", o.dim, "head dimension d")
                      ->capture_default_str()
                      ->check(int_in(1, kMaxExtent))};
    cmd->add_flag("--causal", o.causal, "bottom-right aligned causal mask");
    cmd->add_option("--score", o.score, "scoring function")
        ->capture_default_str()
        ->check(CLI::IsMember({"scaled_dot", "dot", "bilinear", "additive"}));
    add_score_hidden_option(cmd, o);
    auto* input_opt = cmd->add_option("--input", o.input, input_help("input distribution"))
                          ->capture_default_str()
                          ->check(input_name());
    auto* scale_opt = cmd->add_option("--scale", o.scale, "multiply q (and so the logits) by this")
                          ->capture_default_str()
                          ->check(CLI::PositiveNumber);
    add_timing_options(cmd, o);
    cmd->add_option("--inputs", inputs_path,
                    ".npz with float32 q [B, H, n, d] and k, v [B, G, m, d] (G = H, or a divisor "
                    "of H: grouped-query attention)")
        ->check(CLI::ExistingFile)
        ->excludes(input_opt)
        ->excludes(scale_opt);
    cmd->add_option("--output", output_path, "write the output [B, H, n, d] to this .npy")
        ->check(output_file(".npy"));
    cmd->add_option("--dtype", o.dtype,
                    "precision: f32, or bf16 (q, k, v rounded to bfloat16, products in bf16 with "
                    "float32 accumulation, softmax statistics in float32; the forward pass)")
        ->capture_default_str()
        ->check(CLI::IsMember({"f32", "bf16"}));
    cmd->add_option("--pass", pass,
                    "what is timed: fwd (the forward pass), bwd (the backward pass alone, from a "
                    "saved forward), fwdbwd (both) or decode (one generation step against the "
                    "state of n tokens; needs --causal)")
        ->capture_default_str()
        ->check(CLI::IsMember(pass_names()));
    cmd->add_option("--save-grads", grads_path,
                    "write dq, dk, dv of the checked backward pass to this .npz (--pass bwd or "
                    "fwdbwd; dO is the inputs file's 'do' or drawn from the seed)")
        ->check(output_file(".npz"));
    add_mask_options(cmd, key_padding, mask_path);
    cmd->add_flag("--json", json, "print the result row as JSON");
    return cmd;
  }

  int run() const {
    if (!grads_path.empty() && pass != "bwd" && pass != "fwdbwd")
      throw UsageError(
          "--save-grads needs a backward pass: add --pass bwd or --pass fwdbwd (the gradients "
          "are those of the checked backward)");
    auto variant = make_one_variant(spec, "run");
    Problem p = o.problem();
    Workload w = o.workload();
    w.pass = pass;
    std::optional<Inputs> given = load_given_inputs(inputs_path, shape_opts, &p);
    if (given) w.input = "file";
    if (!key_padding.empty()) p.key_lengths = parse_key_lengths(key_padding, p.batch);
    if (!mask_path.empty()) p.attn_mask = load_attn_mask(mask_path, p);
    w.threads = apply_threads(o.threads);
    p.validate();
    w.validate(p);
    if (!p.score_weights) p.score_weights = make_score_weights(p);  // else from the file
    // trained inputs are read here, so one that does not fit is a usage error (status 2)
    if (is_trained_input(w.input)) given = generate_inputs(p, w);
    MachineFigures mf = measure_machine(w.threads, /*quick=*/true);
    RunOptions opt{.reps = o.reps, .min_time = o.min_time};
    Tensor out;
    Gradients grads;
    Row row = run_one(*variant, p, w, given ? &*given : nullptr, mf, opt, &out, nullptr,
                      grads_path.empty() ? nullptr : &grads);
    if (!print_result(row, json)) return 1;
    if (!output_path.empty()) write_npy(output_path, to_npy(out));
    if (!grads_path.empty())
      write_npz(grads_path,
                {{"dq", to_npy(grads.dq)}, {"dk", to_npy(grads.dk)}, {"dv", to_npy(grads.dv)}});
    return 0;
  }
};

// ----- layer -----

struct LayerCommand {
  ProblemOptions o;
  int64_t embed = 0;
  std::string spec, inputs_path, output_path, key_padding, mask_path;
  bool json = false, need_weights = false;
  std::vector<CLI::Option*> size_opts;  // the sizes an --inputs file decides

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "layer", "a multi-head attention layer (torch.nn.MultiheadAttention) around a variant");
    cmd->add_option("--variant", spec, "variant spec of the attention core")->required();
    size_opts = {cmd->add_option("--embed", embed,
                                 "embedding size E (d = E / H); required "
                                 "without --inputs")
                     ->check(int_in(1, kMaxExtent)),
                 add_batch_option(cmd, o), add_seq_option(cmd, o, "query length L"),
                 add_seq_k_option(cmd, o,
                                  "key length S: cross-attention with its own key and value "
                                  "(default: self-attention, key = value = query)")};
    add_heads_option(cmd, o);
    cmd->add_flag("--causal", o.causal, "bottom-right aligned causal mask in the attention core");
    cmd->add_flag("--need-weights", need_weights,
                  "also give the attention probabilities averaged over heads [B, L, S] (exact "
                  "variants only)");
    add_timing_options(cmd, o);
    cmd->add_option("--inputs", inputs_path,
                    ".npz with PyTorch's names: query, key, value, in_proj_weight, "
                    "in_proj_bias, out_proj.weight, out_proj.bias")
        ->check(CLI::ExistingFile);
    cmd->add_option("--output", output_path,
                    "write output [B, L, E] (and attn_weights [B, L, S]) to this .npz")
        ->check(output_file(".npz"));
    add_mask_options(cmd, key_padding, mask_path);
    cmd->add_flag("--json", json, "print the result row as JSON");
    return cmd;
  }

  int run() const {
    auto variant = make_one_variant(spec, "layer");
    LayerProblem lp;
    lp.batch = o.batch, lp.embed = embed, lp.heads = o.heads, lp.n = o.seq, lp.m = o.seq_k;
    lp.causal = o.causal, lp.seed = o.seed;
    Workload w;
    std::optional<LayerData> given;
    if (!inputs_path.empty()) {
      given = load_layer_npz(inputs_path, &lp);
      w.input = "file";
      for (const CLI::Option* opt : size_opts) {
        if (opt->count() == 0) continue;
        const std::string name = opt->get_name();
        const int64_t value = opt->as<int64_t>(), file = name == "--embed"   ? lp.embed
                                                         : name == "--batch" ? lp.batch
                                                         : name == "--seq"   ? lp.n
                                                                             : lp.keys();
        if (value != file)
          throw UsageError(fmt::format(
              "{} {} disagrees with --inputs {}, whose query is [B, L, E] = [{}, {}, "
              "{}] and key [B, S, E] = [{}, {}, {}]; with --inputs leave the size "
              "options out or give the file's sizes",
              name, value, inputs_path, lp.batch, lp.n, lp.embed, lp.batch, lp.keys(), lp.embed));
      }
    } else if (embed == 0) {
      throw UsageError("layer: --embed E is required (or --inputs FILE, whose arrays give E)");
    }
    if (!key_padding.empty()) {
      if (!lp.key_lengths.empty() ||
          (lp.attn_mask && lp.attn_mask->name.find("key_padding_mask") != std::string::npos))
        throw UsageError(fmt::format(
            "--key-padding: --inputs {} holds a key_padding_mask already; give the padding in "
            "one place",
            inputs_path));
      lp.key_lengths = parse_key_lengths(key_padding, lp.batch);
    }
    if (!mask_path.empty()) {
      if (lp.attn_mask)
        throw UsageError(
            fmt::format("--attn-mask: --inputs {} holds an attention mask already (attn_mask, or a "
                        "key_padding_mask that is not an end padding); give the mask in one place",
                        inputs_path));
      lp.attn_mask = load_attn_mask(mask_path, lp.attention());
    }
    w.threads = apply_threads(o.threads);
    lp.validate();
    MachineFigures mf = measure_machine(w.threads, /*quick=*/true);
    RunOptions opt{.reps = o.reps, .min_time = o.min_time};
    Tensor out, weights;
    Row row = run_layer(*variant, lp, w, given ? &*given : nullptr, mf, opt, need_weights, &out,
                        &weights);
    if (!print_result(row, json)) return 1;
    if (!output_path.empty()) write_layer_npz(output_path, out, need_weights ? &weights : nullptr);
    return 0;
  }
};

// ----- sweep -----

struct SweepCommand {
  ProblemOptions o;
  std::vector<std::string> specs;
  std::string seq_list = "256..4096", seq_k_list = "same", batch_list = "1", heads_list = "8",
              kv_heads_list = "same", dim_list = "64", embed_list, causal_mode = "off",
              score_list = "scaled_dot", input_list = "gaussian", scale_list = "1", out_dir,
              key_padding_lists, padding_fractions, pass_list = "fwd", dtype_list = "f32";
  bool resume = false, force = false;
  int retry_noisy = 0, shard_plan = 0;
  std::string shard, machine_file;
  std::vector<std::string> also;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("sweep", "the cross product of variants and problems");
    cmd->add_option("--variant", specs,
                    "variant spec (repeatable; default: every variant); a|b is a grid of "
                    "specs: local:window=64|128");
    cmd->add_option("--seq", seq_list,
                    "query lengths n, a LIST: 256,512 or 256..8192 (doubling, ending exactly) "
                    "or 256..5000:x2 or 256..5000:+256 (up to the end)")
        ->capture_default_str();
    cmd->add_option("--seq-k", seq_k_list, "key lengths m, a LIST crossed with --seq; same: m = n")
        ->capture_default_str();
    cmd->add_option("--batch", batch_list, "batch sizes, a LIST")->capture_default_str();
    cmd->add_option("--heads", heads_list, "head counts, a LIST")->capture_default_str();
    cmd->add_option("--kv-heads", kv_heads_list,
                    "key/value head counts G, a LIST crossed with --heads (grouped-query "
                    "attention; `same` = H; a G that does not divide an H is left out for it)")
        ->capture_default_str();
    auto* dim_opt =
        cmd->add_option("--dim", dim_list, "head dimensions, a LIST")->capture_default_str();
    cmd->add_option("--embed", embed_list,
                    "embedding sizes E, a LIST: multi-head layer rows (torch.nn.MultiheadAttention "
                    "around each variant), d = E / H in place of --dim")
        ->excludes(dim_opt);
    cmd->add_option("--causal", causal_mode, "causal mask: off, on or both")
        ->capture_default_str()
        ->check(CLI::IsMember({"off", "on", "both"}));
    cmd->add_option("--score", score_list,
                    "scoring functions, comma-separated (scaled_dot, dot, bilinear, additive)")
        ->capture_default_str();
    add_score_hidden_option(cmd, o);
    cmd->add_option("--input", input_list,
                    fmt::format("input distributions, comma-separated ({}; see run --help)",
                                accepted_inputs()))
        ->capture_default_str();
    cmd->add_option("--scale", scale_list,
                    "logit sharpening factors: q multiplied by each, comma-separated (1,2,4)")
        ->capture_default_str();
    cmd->add_option("--pass", pass_list,
                    "what is timed, comma-separated: fwd (forward), bwd (backward alone, from a "
                    "saved forward), fwdbwd (both)")
        ->capture_default_str();
    cmd->add_option("--dtype", dtype_list,
                    "precisions, comma-separated: f32, bf16 (see run --help; bf16 rows measure "
                    "the forward pass of variants with a bf16 path)")
        ->capture_default_str();
    add_timing_options(cmd, o);
    cmd->add_option("--key-padding", key_padding_lists,
                    "key padding settings separated by ';', each a comma list of valid key "
                    "lengths (one per batch element or one for all) or none: 700,1024;none");
    cmd->add_option("--padding-fraction", padding_fractions,
                    "padding fractions in [0, 1), comma-separated: lengths drawn from the seed "
                    "so that the expected padded share of the keys is F");
    cmd->add_option("--out", out_dir, "results directory")->required();
    auto* resume_opt = cmd->add_flag(
        "--resume", resume,
        "keep rows already in DIR and run only the missing ones (a DIR holding rows is refused "
        "without --resume or --force)");
    cmd->add_flag("--force", force,
                  "if DIR holds results, move them aside into DIR/earlier-<time>/ and start anew")
        ->excludes(resume_opt);
    cmd->add_option("--also", also,
                    "another set of problems, as sweep options in one argument "
                    "(--also='--seq 256..2048 --input local'), planned after the first with "
                    "the same --threads, --seed and timing; repeatable");
    cmd->add_option("--retry-noisy", retry_noisy,
                    "measure a noisy row again up to N times, keeping the first quiet "
                    "measurement (else the one with the smallest spread)")
        ->capture_default_str()
        ->check(int_in(0, 100));
    cmd->add_option("--shard", shard,
                    "run shard i of N (i/N, 0 <= i < N): the configurations split into N parts "
                    "of about equal estimated cost, the same on every machine; each shard writes "
                    "its own --out DIR (attnbench merge joins them)");
    cmd->add_option("--shard-plan", shard_plan,
                    "print the split into N shards (configurations and estimated cost of each, "
                    "imbalance longest/mean) and exit without running")
        ->check(int_in(1, kMaxShards));
    cmd->add_option("--machine-file", machine_file, kMachineFileHelp);
    return cmd;
  }

  // The plan of the options; the variants are built first, so a bad spec fails before any
  // work. Applies the thread count.
  SweepPlan plan() const {
    auto variants = make_sweep_variants(specs);
    SweepAxes axes;
    axes.seqs = parse_int_list(seq_list, "--seq");
    axes.seq_ks = parse_seq_k_list(seq_k_list);
    axes.batches = parse_int_list(batch_list, "--batch");
    axes.heads = parse_int_list(heads_list, "--heads");
    axes.kv_heads = parse_list(kv_heads_list, "--kv-heads", /*same_word=*/true);
    axes.dims = parse_int_list(dim_list, "--dim");
    if (!embed_list.empty()) axes.embeds = parse_int_list(embed_list, "--embed");
    axes.inputs = parse_input_list(input_list);
    axes.scales = parse_scale_list(scale_list);
    axes.passes = parse_pass_list(pass_list);
    axes.dtypes = parse_dtype_list(dtype_list);
    axes.causals = parse_causal_mode(causal_mode);
    axes.scores = parse_score_list(score_list);
    axes.score_hidden = o.score_hidden;
    axes.paddings = parse_padding_settings(key_padding_lists, padding_fractions);
    axes.seed = o.seed;
    axes.threads = apply_threads(o.threads);
    return plan_sweep(std::move(variants), axes);
  }

  // The plan of one --also argument: sweep options parsed from their defaults, with this
  // sweep's threads and seed.
  SweepPlan also_plan(const std::string& args) const {
    CLI::App root("attnbench");
    SweepCommand extra;
    CLI::App* cmd = extra.add(root);
    try {
      root.parse("sweep " + args + " --out .", false);
    } catch (const CLI::ParseError& e) {
      throw UsageError(fmt::format("--also '{}': {}", args, e.what()));
    }
    for (const char* name :
         {"--threads", "--seed", "--reps", "--min-time", "--resume", "--force", "--retry-noisy",
          "--also", "--shard", "--shard-plan", "--machine-file"})
      if (cmd->get_option(name)->count() > 0)
        throw UsageError(fmt::format(
            "--also '{}': {} belongs to the whole sweep, outside --also; accepted inside: the "
            "problem and variant options (--variant, --seq, --seq-k, --batch, --heads, "
            "--kv-heads, --dim, "
            "--embed, --causal, --score, --score-hidden, --input, --scale, --pass, --dtype, "
            "--key-padding, --padding-fraction)",
            args, name));
    if (cmd->get_option("--out")->count() > 1)
      throw UsageError(fmt::format("--also '{}': --out belongs to the whole sweep", args));
    extra.o.threads = o.threads, extra.o.seed = o.seed;
    try {
      return extra.plan();
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("--also '{}': {}", args, e.what()));
    }
  }

  // --shard-plan N: the split of the plan into N shards, printed.
  int print_shard_plan(const SweepPlan& plan) const {
    const ShardSplit split = split_shards(plan, shard_plan, o.reps, o.min_time);
    fmt::print("shard  configs  estimated_s\n");
    for (int s = 0; s < shard_plan; ++s)
      fmt::print("{:>5}  {:>7}  {:>11.1f}\n", s, split.counts[size_t(s)], split.costs[size_t(s)]);
    double total = 0;
    for (double c : split.costs) total += c;
    fmt::print("total  {:>7}  {:>11.1f}\n", plan.configs.size(), total);
    fmt::print("imbalance (longest / mean shard): {:.3f}\n", split.imbalance());
    return 0;
  }

  int run(int argc, char** argv) const {
    // --shard is checked before any work, the plan's variants first
    std::optional<std::pair<int, int>> shard_of;
    if (!shard.empty()) shard_of = parse_shard(shard);
    SweepPlan plan = this->plan();
    for (const std::string& a : also) append_plan(plan, also_plan(a));
    const int threads = plan.axes.threads;
    if (!plan.duplicates.empty())
      fmt::print(stderr,
                 "attnbench: {} duplicate configuration{} left out (same canonical spec "
                 "and problem as an earlier one), e.g. {}\n",
                 plan.duplicates.size(), plan.duplicates.size() == 1 ? "" : "s",
                 plan.duplicates.front());
    if (shard_plan > 0) return print_shard_plan(plan);
    // The whole plan's identity and, with --shard, this shard's part of it: every shard of a
    // sweep computes the same split from the same plan.
    const std::vector<std::string> keys = plan_keys(plan);
    const std::string definition = sweep_definition(keys, o.reps, o.min_time, threads, o.seed);
    std::vector<bool> in_shard(plan.configs.size(), true);
    nlohmann::json shard_meta;
    size_t shard_size = plan.configs.size();
    if (shard_of) {
      const auto [index, count] = *shard_of;
      const ShardSplit split = split_shards(plan, count, o.reps, o.min_time);
      for (size_t i = 0; i < plan.configs.size(); ++i) in_shard[i] = split.shard_of[i] == index;
      shard_size = split.counts[size_t(index)];
      shard_meta = {{"index", index},
                    {"count", count},
                    {"configs", shard_size},
                    {"configs_total", plan.configs.size()},
                    {"estimated_cost", split.costs[size_t(index)]},
                    {"estimated_costs", split.costs},
                    {"estimated_imbalance", split.imbalance()}};
      fmt::print(
          stderr,
          "attnbench: shard {}/{}: {} of {} configurations, estimated {:.0f} s of {:.0f} "
          "s (imbalance {:.3f})\n",
          index, count, shard_size, plan.configs.size(), split.costs[size_t(index)],
          [&] {
            double t = 0;
            for (double c : split.costs) t += c;
            return t;
          }(),
          split.imbalance());
    }
    ResultsDir results(out_dir, resume, force);
    PatternStore patterns(out_dir, resume);
    // Patterns are those of plain attention rows: a layer's heads attend projected inputs.
    // Every configuration of the whole plan is declared, so a shard stores the pattern the
    // unsharded sweep would (if that configuration is in the shard).
    for (const auto& c : plan.configs)
      if (c.embed == 0) patterns.plan(c.variant->spec(), c.problem, c.workload);
    {
      const std::vector<std::string> names = plan_names(plan);
      nlohmann::json configs = nlohmann::json::array();
      for (size_t i = 0; i < keys.size(); ++i)
        configs.push_back({{"key", keys[i]}, {"name", names[i]}});
      write_json_file(
          (std::filesystem::path(out_dir) / "plan.json").string(),
          {{"sweep_definition", definition}, {"key_columns", key_columns()}, {"configs", configs}});
    }
    fmt::print(stderr, "attnbench: machine figures ({} threads{})...\n", threads,
               machine_file.empty() ? "" : ", through " + machine_file);
    MachineFigures mf = machine_figures(machine_file, threads);
    fmt::print(stderr, "attnbench: GEMM {:.1f} GFLOP/s, bandwidth {:.1f} GB/s ({})\n",
               mf.gemm_gflops, mf.bandwidth_gbs, mf.source);
    auto meta = meta_json(argc, argv, mf, threads);
    meta["rows_planned"] = shard_size;
    meta["sweep_definition"] = definition;
    meta["plan_configs"] = plan.configs.size();
    meta["plan_file"] = "plan.json";
    if (shard_of) meta["shard"] = shard_meta;
    meta["rows_kept_from_earlier_runs"] = results.rows_kept();
    meta["load_avg_start"] = json_number(load_average());
    meta["processors"] = omp_get_num_procs();
    if (auto trained = trained_inputs_meta(plan); !trained.is_null())
      meta["trained_inputs"] = trained;
    try {
      results.write_meta(meta);
    } catch (const WriteError& e) {
      throw stopped(e, results);
    }

    const RunOptions opt{.reps = o.reps, .min_time = o.min_time};
    // The ETA: the runnable configurations still to measure, their count and work, priced
    // by a cost model fitted to the rows measured so far (EtaModel).
    std::vector<double> work(plan.configs.size());
    std::vector<std::string> specs(plan.configs.size());
    std::vector<bool> runnable(plan.configs.size()), pending(plan.configs.size()),
        measured(plan.configs.size());
    for (size_t i = 0; i < plan.configs.size(); ++i) {
      const SweepConfig& c = plan.configs[i];
      runnable[i] = sweep_runnable(c);
      work[i] = sweep_work(c);
      specs[i] = c.variant->spec();
      pending[i] = in_shard[i] && !(resume && results.done(key_row(c)));
      measured[i] = runnable[i] && pending[i];
    }
    const std::vector<double> reference_work = plan_reference_work(plan, measured);
    EtaModel eta_model(opt.reps, opt.min_time);
    const auto t0 = std::chrono::steady_clock::now();
    std::map<std::string, int> counts;
    size_t position = 0;  // of the configuration in this shard (the whole plan unsharded)
    for (size_t i = 0; i < plan.configs.size(); ++i) {
      if (!in_shard[i]) continue;
      ++position;
      const SweepConfig& c = plan.configs[i];
      const Row probe = key_row(c);
      if (!pending[i]) {
        ++counts["kept"];
        if (c.embed == 0)
          patterns.row_done(*c.variant, c.problem, c.workload, results.status(probe));
        continue;
      }
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double eta = 0;
      for (size_t j = i; j < plan.configs.size(); ++j)
        if (pending[j] && runnable[j])
          eta += eta_model.predict(specs[j], work[j], reference_work[j]);
      fmt::print(stderr, "{}\n",
                 progress_line(position, shard_size, elapsed, eta,
                               fmt::format("{} {}{}", probe.spec,
                                           c.embed > 0 ? fmt::format("layer E={} ", c.embed) : "",
                                           describe(c.problem, c.workload))));
      const auto r0 = std::chrono::steady_clock::now();
      Row row;
      try {
        row = measure(c, mf, opt, retry_noisy, results);
        if (c.embed == 0) patterns.row_done(*c.variant, c.problem, c.workload, row.status);
      } catch (const WriteError& e) {
        throw stopped(e, results);
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - r0).count();
      if (runnable[i] && row.status == "ok")
        eta_model.add(specs[i], work[i], reference_work[i], seconds, row.time_median,
                      row.error_seconds);
      ++counts[row.status];
      if (row.noisy) ++counts["noisy"];
      if (row.status != "ok") fmt::print(stderr, "    {}: {}\n", row.status, row.message);
      if (row.noisy) fmt::print(stderr, "    warning: noisy timing: {}\n", noise_reason(row));
    }
    std::string summary;
    for (auto& [k, v] : counts)
      summary += fmt::format("{}{} {}", summary.empty() ? "" : ", ", v, k);
    fmt::print(stderr, "attnbench: {} rows in {}/results.csv ({})\n", shard_size, out_dir, summary);
    if (counts["noisy"] > 0)
      fmt::print(stderr,
                 "attnbench: warning: {} row(s) have noisy timings (the `noisy` column; "
                 "README, \"Stable numbers\"); --resume after removing them, or --retry-noisy "
                 "N, measures them again\n",
                 counts["noisy"]);
    meta["duration_s"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    meta["load_avg_end"] = json_number(load_average());
    meta["rows_noisy"] = counts["noisy"];
    try {
      results.update_meta(meta);
    } catch (const WriteError& e) {
      throw stopped(e, results);
    }
    return 0;
  }

  // A failed write (a full disk) as the sweep reports it: what failed, what is kept, and how to
  // go on.
  WriteError stopped(const WriteError& e, const ResultsDir& results) const {
    return WriteError(fmt::format(
        "{}\nthe sweep stopped; the {} row(s) in {}/results.csv are kept: free space (or fix the "
        "disk) and run the same command with --resume",
        e.what(), results.rows_kept(), out_dir));
  }

  // What meta.json records of the trained inputs a plan uses: their meta.json (checkpoint,
  // context, length, ...), the directory and the inputs used; null when it uses none.
  static nlohmann::json trained_inputs_meta(const SweepPlan& plan) {
    std::vector<std::string> used;
    for (const auto& c : plan.configs)
      if (is_trained_input(c.workload.input) &&
          std::find(used.begin(), used.end(), c.workload.input) == used.end())
        used.push_back(c.workload.input);
    if (used.empty()) return nullptr;
    const TrainedMeta tm = read_trained_meta();
    nlohmann::json j = nlohmann::json::parse(tm.json, nullptr, false);
    if (!j.is_object()) j = nlohmann::json::object();
    j["dir"] = tm.dir;
    j["inputs"] = used;
    return j;
  }

  // Runs one configuration of the plan, again up to `retries` times while its timing is
  // noisy, and appends the kept row to the results.
  static Row measure(const SweepConfig& c, const MachineFigures& mf, const RunOptions& opt,
                     int retries, ResultsDir& results) {
    auto once = [&](nlohmann::json* bench) {
      return c.embed > 0
                 ? run_layer(*c.variant, layer_problem(c), c.workload, nullptr, mf, opt,
                             /*need_weights=*/false, nullptr, nullptr, bench)
                 : run_one(*c.variant, c.problem, c.workload, nullptr, mf, opt, nullptr, bench);
    };
    nlohmann::json bench;
    Row row = once(&bench);
    static const std::string host = host_name();
    int tries = 0;
    for (; tries < retries && row.status == "ok" && row.noisy; ++tries) {
      fmt::print(stderr, "    noisy ({}), measuring again ({}/{})\n", noise_reason(row), tries + 1,
                 retries);
      nlohmann::json again_bench;
      Row again = once(&again_bench);
      if (again.status != "ok") continue;
      if (!again.noisy || again.time_spread < row.time_spread)
        row = std::move(again), bench = std::move(again_bench);
    }
    if (tries > 0)
      row.notes +=
          fmt::format("{}timed {} times for noise, kept the {}", row.notes.empty() ? "" : "; ",
                      tries + 1, row.noisy ? "smallest spread" : "first quiet one");
    row.host = host;
    results.append(row, bench);
    return row;
  }
};

// ----- merge -----

struct MergeCommand {
  MergeOptions opt;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "merge", "join the results directories of a sharded sweep (sweep --shard i/N) into one");
    cmd->add_option("dirs", opt.dirs, "the shards' results directories")
        ->required()
        ->type_name("DIR...");
    cmd->add_option("--out", opt.out, "the merged results directory (not one of the inputs)")
        ->required();
    cmd->add_flag("--strict", opt.strict,
                  "refuse shards measured on different CPU models (else a warning: their times "
                  "are not comparable)");
    cmd->add_flag("--allow-missing", opt.allow_missing,
                  "merge even when planned configurations have no row in any shard (they are "
                  "listed as a warning; else an error)");
    cmd->add_flag("--force", opt.force,
                  "if the --out directory holds results, move them aside into "
                  "DIR/earlier-<time>/ first (else it is refused)");
    return cmd;
  }

  int run() const {
    const size_t rows = merge_results(opt);
    fmt::print(stderr, "attnbench: {} rows of {} directories in {}/results.csv\n", rows,
               opt.dirs.size(), opt.out);
    return 0;
  }
};

// ----- pattern -----

// The registered variants that have an attention pattern at their defaults on this problem.
std::vector<std::string> variants_with_patterns(const Problem& p, const Workload& w, int64_t head,
                                                const Inputs* given) {
  std::vector<std::string> with;
  for (const VariantInfo* v : Registry::instance().all()) {
    auto probe = make_variant(v->name);
    try {
      if (head_pattern(*probe, p, w, head, given)) with.push_back(v->name);
    } catch (const std::exception&) {
    }
  }
  return with;
}

struct PatternCommand {
  ProblemOptions o;
  std::string spec, inputs_path, output_path;
  int64_t head = 0;
  std::vector<CLI::Option*> shape_opts;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("pattern", "export a variant's attention pattern for one head");
    cmd->add_option("--variant", spec, "variant spec, name:key=value,...")->required();
    shape_opts = {cmd->add_option("--seq", o.seq, "query length n")
                      ->capture_default_str()
                      ->check(int_in(1, kMaxExtent)),
                  cmd->add_option("--seq-k", o.seq_k, "key length m (default: n)")
                      ->check(int_in(1, kMaxExtent)),
                  cmd->add_option("--dim", o.dim, "head dimension d (for data-dependent patterns)")
                      ->capture_default_str()
                      ->check(int_in(1, kMaxExtent))};
    cmd->add_flag("--causal", o.causal, "bottom-right aligned causal mask");
    cmd->add_option("--head", head, "head index")
        ->capture_default_str()
        ->check(int_in(0, kMaxHeads - 1));
    cmd->add_option("--seed", o.seed, "seed of every random choice")
        ->capture_default_str()
        ->check(seed_value());
    auto* input_opt = cmd->add_option("--input", o.input,
                                      input_help("input distribution (data-dependent patterns)"))
                          ->capture_default_str()
                          ->check(input_name());
    cmd->add_option("--inputs", inputs_path,
                    ".npz with float32 q [B, H, n, d] and k, v [B, G, m, d] (G = H, or a divisor "
                    "of H: grouped-query attention)")
        ->check(CLI::ExistingFile)
        ->excludes(input_opt);
    cmd->add_option("--output", output_path, "uint8 [n, m] .npy, 1 = attended")
        ->required()
        ->check(output_file(".npy"));
    return cmd;
  }

  int run() const {
    auto variant = make_one_variant(spec, "pattern");
    Problem p = o.problem();
    p.batch = 1, p.heads = head + 1;
    std::optional<Inputs> given = load_given_inputs(inputs_path, shape_opts, &p);
    if (given && head >= p.heads)
      throw UsageError(
          fmt::format("--head {} is out of range: {} has {} heads", head, inputs_path, p.heads));
    Workload w = o.workload();
    if (given) w.input = "file";
    w.threads = apply_threads(0);
    p.validate();
    w.validate(p);
    variant->check_supported(p);
    const double bytes = double(p.n) * double(p.keys());
    if (bytes > 0.5 * available_memory())
      throw UsageError(
          fmt::format("a dense {} x {} pattern needs {:.1f} GiB, more than half the "
                      "available memory; use a smaller --seq",
                      p.n, p.keys(), bytes / double(1 << 30)));
    // Only head `head` is exported, so only its inputs are generated.
    const Inputs* from = given ? &*given : nullptr;
    auto pat = head_pattern(*variant, p, w, head, from);
    if (!pat) {
      const auto with = variants_with_patterns(p, w, head, from);
      // Any variant whose make_pattern gives one has a pattern, exact or not (reformer's
      // buckets, routing's clusters).
      throw UsageError(fmt::format(
          "variant '{}' has no attention pattern (it does not restrict "
          "softmax attention to a set of keys); variants with one at "
          "their defaults: {}",
          variant->spec(),
          with.empty() ? std::string("none") : fmt::format("{}", fmt::join(with, ", "))));
    }
    const NpyArray a = pattern_array(p, *pat, 0, head);
    write_npy(output_path, a);
    double attended = 0;
    for (char c : a.data) attended += c;
    fmt::print(
        stderr, "attnbench: {} pattern of head {}: {} x {}, {:.0f} pairs attended ({:.2f}%)\n",
        variant->spec(), head, p.n, p.keys(), attended, 100.0 * attended / std::max(1.0, bytes));
    return 0;
  }
};

// ----- machine -----

struct MachineCommand {
  int threads = 0;
  bool json = false, quick = false;
  std::string file;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("machine", "peak GEMM rate and memory bandwidth");
    cmd->add_option("--threads", threads,
                    fmt::format("threads (0 = every core; at most {})", max_threads()))
        ->check(int_in(0, max_threads()));
    cmd->add_flag("--json", json, "print JSON");
    cmd->add_flag("--quick", quick, "fewer and smaller products (about a second)");
    cmd->add_option("--file", file, kMachineFileHelp);
    return cmd;
  }

  int run() const {
    MachineFigures mf = machine_figures(file, apply_threads(threads), quick);
    if (json) {
      fmt::print("{}\n", to_json(mf).dump(2));
    } else {
      fmt::print("cpu        {}\nthreads    {}\nhost       {}\n", mf.cpu_model, mf.threads,
                 mf.host);
      fmt::print("GEMM       {:.1f} GFLOP/s best (OpenBLAS {:.1f}, Eigen {:.1f}; square n = {})\n",
                 mf.gemm_gflops, mf.blas_gflops, mf.eigen_gflops, mf.gemm_size);
      fmt::print(
          "bf16       {:.1f} GFLOP/s peak (AMX tiles {:.1f}, AVX512-BF16 {:.1f}; 0: none; in "
          "registers and L1)\n",
          mf.bf16_gflops, mf.amx_bf16_gflops, mf.avx512_bf16_gflops);
      fmt::print("bandwidth  {:.1f} GB/s (triad)\n", mf.bandwidth_gbs);
      fmt::print("figures    {} at {}\n", mf.source, mf.measured_at);
    }
    return 0;
  }
};

// ----- plugins, parse errors and command errors -----

// The plugins of ATTNBENCH_PLUGINS, then those of --plugin: their variants are then available
// to every command.
void load_plugins(const std::vector<std::string>& paths) {
  if (const char* env = std::getenv("ATTNBENCH_PLUGINS")) {
    for (const auto& path : split_plugin_list(env)) {
      try {
        load_plugin(path);
      } catch (const PluginError& e) {
        throw PluginError(fmt::format("{} (in ATTNBENCH_PLUGINS)", e.what()));
      }
    }
  }
  for (const auto& path : paths) load_plugin(path);
}

// A command line CLI11 refused: a first word that names no command is named with the list of
// commands; anything else is CLI11's own message (or help). Returns the exit code.
int report_parse_error(CLI::App& app, const CLI::ParseError& e, int argc, char** argv) {
  if (e.get_exit_code() != 0 && app.get_subcommands().empty()) {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--plugin") {
        ++i;
        continue;
      }
      if (a.empty() || a[0] == '-') continue;
      std::vector<std::string> names;
      for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
      fmt::print(stderr,
                 "attnbench: error: unknown command '{}'; accepted: {} (attnbench --help)\n", a,
                 fmt::join(names, ", "));
      return 2;
    }
  }
  if (e.get_exit_code() == 0) return app.exit(e);  // --help, --help-all
  // One format for every error, the parser's included.
  std::string command = "attnbench";
  for (const CLI::App* sub : app.get_subcommands()) command += " " + sub->get_name();
  fmt::print(stderr, "attnbench: error: {} (`{} --help` lists the options)\n", e.what(), command);
  return 2;
}

// What a command that ended with an exception prints and returns: 2 for bad input (usage,
// spec, input file, plugin), 1 for what failed while running.
int report_error(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e)) {
    fmt::print(stderr,
               "attnbench: error: out of memory: the problem (or the pattern of every "
               "head up to --head) needs more memory than this machine can give; use "
               "smaller sizes\n");
    return 1;
  }
  const bool plugin = dynamic_cast<const PluginError*>(&e) != nullptr;
  const bool unsupported = dynamic_cast<const UnsupportedError*>(&e) != nullptr;
  const bool bad_input = plugin || dynamic_cast<const UsageError*>(&e) ||
                         dynamic_cast<const SpecError*>(&e) || dynamic_cast<const InputError*>(&e);
  fmt::print(stderr, "attnbench: {}: {}\n",
             plugin        ? "plugin error"
             : unsupported ? "unsupported"
                           : "error",
             e.what());
  return bad_input ? 2 : 1;
}

}  // namespace

int cli_main(int argc, char** argv) {
  set_command_line(argc, argv);
  CLI::App app{
      "attnbench: speed, memory and error of attention variants against exact softmax "
      "attention"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help for every command");
  // --plugin belongs to the top level but may also follow the subcommand.
  app.fallthrough();
  std::vector<std::string> plugin_paths;
  app.add_option("--plugin", plugin_paths,
                 "load variants from this plugin (.so built with attnbench_add_plugin; "
                 "repeatable; also the colon-separated list in ATTNBENCH_PLUGINS)")
      ->type_name("FILE")
      ->allow_extra_args(false);  // one FILE per --plugin

  // The commands, in the order of the help.
  ListCommand list;
  RunCommand run;
  SweepCommand sweep;
  MergeCommand merge;
  LayerCommand layer;
  PatternCommand pattern;
  MachineCommand machine;
  std::vector<std::pair<const CLI::App*, std::function<int()>>> commands;
  commands.emplace_back(list.add(app), [&] { return list.run(); });
  commands.emplace_back(run.add(app), [&] { return run.run(); });
  commands.emplace_back(sweep.add(app), [&] { return sweep.run(argc, argv); });
  commands.emplace_back(merge.add(app), [&] { return merge.run(); });
  commands.emplace_back(layer.add(app), [&] { return layer.run(); });
  commands.emplace_back(pattern.add(app), [&] { return pattern.run(); });
  commands.emplace_back(machine.add(app), [&] { return machine.run(); });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return report_parse_error(app, e, argc, argv);
  }

  try {
    load_plugins(plugin_paths);
    for (const auto& [cmd, command] : commands)
      if (*cmd) return command();
  } catch (const std::exception& e) {
    return report_error(e);
  }
  return 0;
}

}  // namespace attnbench
