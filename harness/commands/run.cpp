// `attnbench run`: one variant on one problem.
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

struct RunCommand {
  ProblemOptions o;
  std::vector<std::string> specs;
  std::string inputs_path, output_path, key_padding, mask_path, pass = "fwd", grads_path;
  bool json = false;
  double max_time = 0;
  std::vector<CLI::Option*> shape_opts;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("run", "one variant on one problem");
    cmd->footer(
        "\nExamples:\n  attnbench run --variant flash --seq 4k --causal\n  attnbench run --variant "
        "local:window=128 --seq 4096 --causal on --input local\n  attnbench run --variant linear "
        "--seq 2k --pass fwdbwd --json");
    cmd->add_option("--variant", specs, "variant spec, name:key=value,...")
        ->required()
        ->type_name("SPEC")
        ->allow_extra_args(false);  // one SPEC per --variant
    shape_opts = {add_batch_option(cmd, o),
                  add_heads_option(cmd, o),
                  add_kv_heads_option(cmd, o),
                  add_seq_option(cmd, o, "query length n"),
                  add_seq_k_option(cmd, o, "key length m (default: n)"),
                  cmd->add_option("--dim", o.dim, "head dimension d")
                      ->capture_default_str()
                      ->check(int_in(1, kMaxExtent))};
    add_causal_option(cmd, o.causal, "bottom-right aligned causal mask");
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
                    "fwdbwd; dO is the inputs file's 'do' or drawn from the seed), and d<name> "
                    "of each learned input the inputs file gives (dg for gla's g)")
        ->check(output_file(".npz"));
    add_mask_options(cmd, key_padding, mask_path);
    cmd->add_flag("--json", json, "print the result row as JSON");
    cmd->add_option("--max-time", max_time,
                    "refuse a problem estimated to take longer than S seconds (0: no limit; "
                    "the estimate is printed whenever it exceeds 10 s)")
        ->type_name("S")
        ->capture_default_str()
        ->check(number_in(0.0, 1e9));
    return cmd;
  }

  // The run's estimated seconds: the checked pass, the timed repetitions (each at least
  // --min-time) and the float64 reference, the passes at half the machine's peak (a typical
  // kernel's share of it); NaN when the variant cannot estimate its work.
  double estimate(Variant& variant, const Problem& p, const Workload& w, const MachineFigures& mf,
                  double* pass_s) const {
    const double work = sweep_work(SweepConfig{&variant, p, w, 0});
    const double peak = peak_gflops(mf, p.dtype == DType::bf16) * 1e9;
    if (!(work > 0) || !(peak > 0)) return NAN;
    const double pass = work / (0.5 * peak);
    *pass_s = pass;
    return kShardFixedSeconds + pass + o.reps * std::max(o.min_time, pass) +
           sweep_reference_work(SweepConfig{&variant, p, w, 0}) /
               (kShardReferenceRate * std::max(1, w.threads));
  }

  int run() const {
    if (!grads_path.empty() && pass != "bwd" && pass != "fwdbwd")
      throw UsageError(
          "--save-grads needs a backward pass: add --pass bwd or --pass fwdbwd (the gradients "
          "are those of the checked backward)");
    if (specs.size() > 1)
      throw UsageError(fmt::format(
          "--variant is given {} times; run measures one variant (`attnbench sweep --variant {} "
          "...` measures several)",
          specs.size(), fmt::join(specs, " --variant ")));
    auto variant = make_one_variant(specs.front(), "run");
    Problem p = o.problem();
    Workload w = o.workload();
    w.pass = pass;
    std::optional<Inputs> given = load_given_inputs(inputs_path, shape_opts, &p);
    if (given) w.input = "file";
    // an input the variant does not take, or of another shape: a usage error, before any work
    variant->check_inputs(p);
    if (!key_padding.empty()) p.key_lengths = parse_key_lengths(key_padding, p.batch);
    if (!mask_path.empty()) p.attn_mask = load_attn_mask(mask_path, p);
    w.threads = apply_threads(o.threads);
    p.validate();
    w.validate(p);
    if (!p.score_weights) p.score_weights = make_score_weights(p);  // else from the file
    // trained inputs are read here, so one that does not fit is a usage error (status 2)
    if (is_trained_input(w.input)) given = generate_inputs(p, w);
    MachineFigures mf = kept_machine_figures(w.threads, /*quick=*/true, o.remeasure);
    RunOptions opt{.reps = o.reps, .min_time = o.min_time};
    double pass_s = NAN;
    const double expected = estimate(*variant, p, w, mf, &pass_s);
    if (max_time > 0 && expected > max_time)
      throw UsageError(fmt::format(
          "{} on {} is estimated at {} ({:.3g} s a pass at half the machine's {:.3g} GFLOP/s, "
          "{} repetitions and the float64 reference), above --max-time {:g}; a smaller "
          "problem (--seq, --heads, --batch) or a larger --max-time",
          variant->spec(), describe(p, w), human_duration(expected), pass_s,
          peak_gflops(mf, p.dtype == DType::bf16), o.reps, max_time));
    const auto t0 = std::chrono::steady_clock::now();
    if (expected > 10) {
      fmt::print(stderr,
                 "attnbench: estimated {} ({:.3g} s a pass at half the "
                 "machine's {:.3g} GFLOP/s, {} repetitions and the float64 reference); "
                 "--max-time S refuses such a problem\n",
                 human_duration(expected), pass_s, peak_gflops(mf, p.dtype == DType::bf16), o.reps);
      opt.stage = [this, t0, pass_s](const std::string& stage) {
        const double elapsed =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        fmt::print(stderr, "attnbench: [{}] {}\n", human_seconds(elapsed),
                   stage == "checked"
                       ? std::string("the checked pass and its error against the float64 "
                                     "reference")
                       : fmt::format("{} timed repetitions, each at least {:.3g} s", o.reps,
                                     std::max(o.min_time, pass_s)));
      };
    }
    Tensor out;
    Gradients grads;
    Row row = run_one(*variant, p, w, given ? &*given : nullptr, mf, opt, &out, nullptr,
                      grads_path.empty() ? nullptr : &grads);
    if (!print_result(row, json)) return 1;
    if (!output_path.empty()) write_npy(output_path, to_npy(out));
    if (!grads_path.empty()) {
      std::map<std::string, NpyArray> arrays = {
          {"dq", to_npy(grads.dq)}, {"dk", to_npy(grads.dk)}, {"dv", to_npy(grads.dv)}};
      // the given inputs' gradients as "d" + name, shaped as the input ("dg" for gla's g)
      for (const auto& [name, g] : grads.inputs) {
        NpyArray a{"<f4", p.extra_inputs->at(name).shape, {}};
        a.data.resize(g.size() * sizeof(float));
        std::memcpy(a.data.data(), g.data(), a.data.size());
        arrays.emplace("d" + name, std::move(a));
      }
      write_npz(grads_path, arrays);
    }
    return 0;
  }
};

}  // namespace

Command add_run_command(CLI::App& app) {
  auto command = std::make_shared<RunCommand>();
  return {command->add(app), [command] { return command->run(); }};
}

}  // namespace attnbench::cli
