// `attnbench pattern`: a variant's attention pattern for one head.
#include "common/patterns/pattern.h"

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

namespace {

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
    cmd->footer(
        "\nExamples:\n  attnbench pattern --variant bigbird --seq 1k --causal --output "
        "bigbird.npy");
    cmd->add_option("--variant", spec, "variant spec, name:key=value,...")->required();
    shape_opts = {cmd->add_option("--seq", o.seq, "query length n")
                      ->capture_default_str()
                      ->transform(length_in(1, kMaxExtent, "pattern")),
                  cmd->add_option("--seq-k", o.seq_k, "key length m (default: n)")
                      ->transform(length_in(1, kMaxExtent, "pattern")),
                  cmd->add_option("--dim", o.dim, "head dimension d (for data-dependent patterns)")
                      ->capture_default_str()
                      ->check(int_in(1, kMaxExtent))};
    add_causal_option(cmd, o.causal, "bottom-right aligned causal mask");
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

}  // namespace

Command add_pattern_command(CLI::App& app) {
  auto command = std::make_shared<PatternCommand>();
  return {command->add(app), [command] { return command->run(); }};
}

}  // namespace attnbench::cli
