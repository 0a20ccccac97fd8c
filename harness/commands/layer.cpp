// `attnbench layer`: a multi-head attention layer around a variant.
#include "harness/layer.h"

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

struct LayerCommand {
  ProblemOptions o;
  int64_t embed = 0;
  std::string spec, inputs_path, output_path, key_padding, mask_path;
  bool json = false, need_weights = false;
  std::vector<CLI::Option*> size_opts;  // the sizes an --inputs file decides

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "layer", "a multi-head attention layer (torch.nn.MultiheadAttention) around a variant");
    cmd->footer(
        "\nExamples:\n  attnbench layer --variant flash --embed 512 --heads 8 --seq 1k\n"
        "  attnbench layer --variant local:window=64 --embed 256 --seq 2k --causal --json\n"
        "  attnbench layer --variant full --embed 64 --heads 4 --seq 256 --need-weights");
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
    add_causal_option(cmd, o.causal, "bottom-right aligned causal mask in the attention core");
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
    MachineFigures mf = kept_machine_figures(w.threads, /*quick=*/true, o.remeasure);
    RunOptions opt{.reps = o.reps, .min_time = o.min_time};
    Tensor out, weights;
    Row row = run_layer(*variant, lp, w, given ? &*given : nullptr, mf, opt, need_weights, &out,
                        &weights);
    if (!print_result(row, json)) return 1;
    if (!output_path.empty()) write_layer_npz(output_path, out, need_weights ? &weights : nullptr);
    return 0;
  }
};

}  // namespace

Command add_layer_command(CLI::App& app) {
  auto command = std::make_shared<LayerCommand>();
  return {command->add(app), [command] { return command->run(); }};
}

}  // namespace attnbench::cli
