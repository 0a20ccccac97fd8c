// The text output of the commands.
#include "harness/commands/print.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
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

std::string human_duration(double s) {
  if (!std::isfinite(s)) return "?";
  return s < 90     ? fmt::format("{:.0f} s", s)
         : s < 5400 ? fmt::format("{:.0f} min", s / 60)
                    : fmt::format("{:.1f} h", s / 3600);
}

// "[i/N] elapsed 01:02, ETA 03:04 | WHAT", cut to kProgressColumns with "..." at the end.
constexpr size_t kProgressColumns = 100;
std::string progress_line(size_t i, size_t n, double elapsed, double eta, const std::string& what) {
  std::string line = fmt::format("[{}/{}] elapsed {}, ETA {} | {}", i, n, human_seconds(elapsed),
                                 human_seconds(eta), what);
  if (line.size() > kProgressColumns) line = line.substr(0, kProgressColumns - 3) + "...";
  return line;
}

// The capability columns of `list`, one line each: header and flag.
const std::vector<std::pair<std::string, bool Capabilities::*>> kCapabilityColumns = {
    {"causal", &Capabilities::causal},       {"m!=n", &Capabilities::cross},
    {"exact", &Capabilities::exact},         {"additive", &Capabilities::additive},
    {"padding", &Capabilities::key_padding}, {"mask", &Capabilities::attn_mask},
    {"bf16", &Capabilities::bf16},
};

std::vector<const VariantInfo*> listed_variants(const std::vector<std::string>& names) {
  const auto all = Registry::instance().all();
  if (names.empty()) return all;
  std::vector<const VariantInfo*> out;
  for (const std::string& name : names)
    out.push_back(&Registry::instance().get(name.substr(0, name.find(':'))));
  return out;
}

void print_brief_list(const std::vector<const VariantInfo*>& variants) {
  constexpr size_t kColumns = 100;
  size_t w = 7;
  for (const VariantInfo* v : variants) w = std::max(w, v->name.size());
  fmt::print("{:<{}} causal backward decode summary\n", "variant", w);
  for (const VariantInfo* v : variants) {
    std::string line = fmt::format("{:<{}} {:<6} {:<8} {:<6} ", v->name, w,
                                   v->caps.causal_only ? "only"
                                   : v->caps.causal    ? "yes"
                                                       : "no",
                                   has_backward(*v) ? "yes" : "no", has_decode(*v) ? "yes" : "no");
    std::string summary = v->summary;
    if (line.size() + summary.size() > kColumns) {
      // cut at a word boundary, marked
      summary.resize(kColumns > line.size() + 3 ? kColumns - line.size() - 3 : 0);
      const size_t space = summary.find_last_of(' ');
      if (space != std::string::npos && space > summary.size() / 2) summary.resize(space);
      summary += "...";
    }
    fmt::print("{}{}\n", line, summary);
  }
  fmt::print(
      "(`attnbench list NAME` shows a variant's parameters and inputs; `list` all of them)\n");
}

void print_list(const std::vector<std::string>& names, bool brief) {
  const auto variants = listed_variants(names);
  if (brief) {
    print_brief_list(variants);
    return;
  }
  size_t w = 7;
  for (const VariantInfo* v : variants) w = std::max(w, v->name.size());
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
  for (const VariantInfo* v : variants) {
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
    for (const InputSpec& in : v->inputs)
      fmt::print("{:<{}} input {} {}{}{}: {}; without it: {}\n", "", indent, in.name, in.shape(),
                 std::isinf(in.min) && std::isinf(in.max)
                     ? std::string()
                     : fmt::format(" in [{}, {}]", in.min, in.max),
                 in.when.empty() ? "" : " (with " + in.when + ")", in.help, in.stand_in);
  }
}

std::string progress_what(const std::string& spec, int64_t embed, const Problem& p,
                          const Workload& w) {
  return fmt::format("n={} {} {}: {}{} ({})", p.n, p.causal ? "causal" : "non-causal",
                     w.pass.empty() ? "fwd" : w.pass, spec,
                     embed > 0 ? fmt::format(" layer E={}", embed) : "", describe(p, w));
}

std::string plot_command(const std::string& out_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> candidates;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec)
    candidates.push_back(exe.parent_path().parent_path() / "share/attnbench/scripts/plot.py");
  candidates.push_back(fs::path(ATTNBENCH_SOURCE_DIR) / "scripts/plot.py");
  std::string script = "scripts/plot.py";
  for (const fs::path& c : candidates) {
    if (!fs::exists(c, ec)) continue;
    script = c.lexically_normal().string();
    const fs::path rel = fs::relative(c, fs::current_path(ec), ec);
    if (!ec && !rel.empty() && *rel.begin() != "..") script = rel.string();
    break;
  }
  const bool plain = out_dir.find_first_of(" '\"$`\\") == std::string::npos;
  return fmt::format("{} {}", script, plain ? out_dir : "'" + out_dir + "'");
}

std::string short_spec(const std::string& spec) {
  try {
    const auto [name, kv] = parse_spec(spec);
    const auto defaults = parse_spec(make_variant(name)->spec()).second;
    std::string out = name;
    for (const auto& item : kv) {
      if (std::find(defaults.begin(), defaults.end(), item) != defaults.end()) continue;
      out += fmt::format("{}{}={}", out == name ? ":" : ",", item.first, item.second);
    }
    return out;
  } catch (const std::exception&) {  // a spec this binary cannot build: as it is
    return spec;
  }
}

void print_sweep_table(const std::vector<Row>& rows, const std::string& out_dir, size_t max_lines) {
  // the largest n, causal when there are causal rows there, and the problem of the first
  // forward row of those (plan order: the first set's input and shape)
  int64_t n = 0;
  for (const Row& r : rows)
    if (r.status == "ok") n = std::max(n, r.problem.n);
  if (n == 0) {
    fmt::print(
        "\nNo row of this sweep is ok (the status and message columns of "
        "{}/results.csv say why).\n",
        out_dir);
    return;
  }
  std::vector<const Row*> at;
  bool causal = false;
  for (const Row& r : rows)
    if (r.status == "ok" && r.problem.n == n) at.push_back(&r), causal = causal || r.problem.causal;
  // a row's problem with the pass left out: the rows of one problem in every pass
  const auto key = [](const Row& r) {
    Workload w = r.workload;
    w.pass = "fwd";
    Problem p = r.problem;
    p.causal = true;  // decode rows are causal: compared with the causal forward's problem
    return describe(p, w) + fmt::format("|E={}|causal={}", r.embed, int(r.problem.causal));
  };
  const auto pass_of = [](const Row& r) {
    return r.workload.pass.empty() ? std::string("fwd") : r.workload.pass;
  };
  const Row* main = nullptr;
  for (const std::string want : {"fwd", "", "decode"})  // a forward row, else any, else decode
    for (const Row* r : at)
      if (!main && r->problem.causal == causal &&
          (want.empty() ? pass_of(*r) != "decode" : pass_of(*r) == want))
        main = r;
  const std::string main_key = key(*main);
  const auto same = [&](const Row& r) {
    if (pass_of(r) == "decode") {  // its problem: the forward's at that context, causal
      Row f = r;
      f.problem.causal = causal;
      return causal && key(f) == main_key;
    }
    return key(r) == main_key;
  };
  std::vector<std::string> passes, specs;
  std::map<std::string, std::map<std::string, const Row*>> by_spec;  // spec -> pass -> row
  std::map<std::string, double> flash;                               // pass -> flash's time
  std::map<std::string, std::vector<double>> trained_error;          // spec -> errors
  for (const Row* r : at) {
    const std::string pass = pass_of(*r);
    if (same(*r)) {
      if (std::find(passes.begin(), passes.end(), pass) == passes.end()) passes.push_back(pass);
      if (std::find(specs.begin(), specs.end(), r->spec) == specs.end()) specs.push_back(r->spec);
      by_spec[r->spec].emplace(pass, r);
      if (r->variant == "flash") flash.emplace(pass, r->time_median);
    } else if (pass == "fwd" && r->problem.causal == causal &&
               is_trained_input(r->workload.input) && std::isfinite(r->error.rel_fro)) {
      trained_error[r->spec].push_back(r->error.rel_fro);
    }
  }
  const bool trained = !trained_error.empty();
  const size_t shown = std::min(specs.size(), max_lines);
  std::vector<std::string> names;
  size_t w = 7;
  for (size_t i = 0; i < shown; ++i) {
    names.push_back(short_spec(specs[i]));
    w = std::max(w, names.back().size());
  }
  const auto time_text = [](double s) {
    return !std::isfinite(s) ? std::string("-")
           : s >= 1          ? fmt::format("{:.2f} s", s)
           : s >= 1e-3       ? fmt::format("{:.2f} ms", s * 1e3)
                             : fmt::format("{:.1f} us", s * 1e6);
  };
  const std::string first = passes.front();
  fmt::print(
      "\nAt n = {}, {}, input {}{}: {} time (median of the repetitions) and peak memory "
      "beyond the inputs; x flash: flash's time over the variant's on the same problem, "
      "per pass (above 1: faster); error: relative Frobenius error of the forward "
      "against exact attention{}. Variants named by their non-default parameters.\n",
      n, causal ? "causal" : "non-causal", main->workload.input,
      specs.size() > shown ? fmt::format(" ({} of {} variants)", shown, specs.size()) : "", first,
      trained ? ", on the trained inputs (mean over their layers)" : "");
  std::string head = fmt::format("{:<{}}  {:>10}", "variant", w, first + " time");
  for (const std::string& pass : passes) head += fmt::format("  {:>10}", pass + " x flash");
  fmt::print("{}  {:>8}  {:>10}\n", head, trained ? "error (trained)" : "error", "memory");
  for (size_t i = 0; i < shown; ++i) {
    const auto& mine = by_spec[specs[i]];
    const Row* lead = mine.count(first) ? mine.at(first) : nullptr;
    std::string line =
        fmt::format("{:<{}}  {:>10}", names[i], w, time_text(lead ? lead->time_median : NAN));
    for (const std::string& pass : passes) {
      auto r = mine.find(pass);
      auto f = flash.find(pass);
      line += fmt::format("  {:>{}}",
                          r == mine.end() || f == flash.end()
                              ? std::string("-")
                              : fmt::format("{:.2f}", f->second / r->second->time_median),
                          std::max<size_t>(10, pass.size() + 8));
    }
    double error = lead ? lead->error.rel_fro : NAN;
    if (trained) {
      auto t = trained_error.find(specs[i]);
      error = NAN;
      if (t != trained_error.end()) {
        error = 0;
        for (double e : t->second) error += e / double(t->second.size());
      }
    }
    fmt::print("{}  {:>{}}  {:>10}\n", line,
               std::isfinite(error) ? fmt::format("{:.2g}", error) : "-", trained ? 15 : 8,
               lead ? human_bytes(lead->peak_bytes) : "-");
  }
  if (specs.size() > shown)
    fmt::print("... and {} more variants; every row is in {}/results.csv\n", specs.size() - shown,
               out_dir);
  fmt::print("\nNext: {}   (the figures and {}/report.md)\n", plot_command(out_dir), out_dir);
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
      "noise        {}, load average {:.2f}, {}{}\n",
      r.reps < 2
          ? std::string("no spread (one repetition)")
          : fmt::format("spread {:.2f}x (max/min over {} repetitions)", r.time_spread, r.reps),
      r.load_avg,
      std::isnan(r.other_load) ? std::string("other processes not measured (run too short)")
                               : fmt::format("other processes on {:.1f} processors", r.other_load),
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
    fmt::print(
        stderr,
        "attnbench: warning: noisy timing: {}; see docs/methodology.md, \"Stable numbers\"\n",
        noise_reason(row));
  if (row.status == "ok") return true;
  fmt::print(stderr, "attnbench: {}: {}\n", row.status, row.message);
  return false;
}

}  // namespace attnbench::cli
