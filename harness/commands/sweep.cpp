// `attnbench sweep`: the cross product of variants and problems.
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

struct SweepCommand {
  ProblemOptions o;
  std::vector<std::string> specs;
  std::string seq_list = "256..4096", seq_k_list = "same", batch_list = "1", heads_list = "8",
              kv_heads_list = "same", dim_list = "64", embed_list, causal_mode = "off",
              score_list = "scaled_dot", input_list = "gaussian", scale_list = "1", out_dir,
              key_padding_lists, padding_fractions, pass_list = "fwd", dtype_list = "f32";
  bool resume = false, force = false;
  int retry_noisy = 0, shard_plan = 0;
  std::string shard, machine_file, profile;
  std::vector<std::string> also;
  CLI::App* cmd_ = nullptr;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("sweep", "the cross product of variants and problems");
    cmd->footer(
        "\nExamples:\n  attnbench sweep --variant flash --variant local --seq 1k..8k --causal both "
        "--out results/try\n  attnbench sweep --variant flash --variant performer --seq 1k,4k "
        "--pass fwd,fwdbwd --out results/try --resume\n  scripts/plot.py results/try        "
        "(figures and report.md of the sweep)");
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
    cmd->add_option("--profile", profile,
                    "a predefined sweep: quick = the headline answers in minutes (every variant "
                    "or those of --variant, n = 512..4096, causal both, fwd and fwdbwd, one "
                    "decode context, trained inputs when cached, else structured ones; 2 "
                    "repetitions of at least 0.05 s unless --reps or --min-time say otherwise); "
                    "it sets the problems, so problem options are refused beside it")
        ->check(CLI::IsMember({"quick"}));
    cmd_ = cmd;
    return cmd;
  }

  // --profile: the problem options and --also sets it stands for (the variants of --variant,
  // if given, in every set). Problem options given beside it are refused.
  void apply_profile() {
    if (profile.empty()) return;
    for (const char* name :
         {"--seq", "--seq-k", "--batch", "--heads", "--kv-heads", "--dim", "--embed", "--causal",
          "--score", "--score-hidden", "--input", "--scale", "--pass", "--dtype", "--key-padding",
          "--padding-fraction", "--also"})
      if (cmd_ != nullptr && cmd_->get_option(name)->count() > 0)
        throw UsageError(fmt::format(
            "{} with --profile {}: the profile sets the problems; accepted beside it: "
            "--variant, --out, --resume, --force, --threads, --seed, --reps, --min-time, "
            "--retry-noisy, --shard, --shard-plan, --machine-file, --remeasure (without "
            "--profile every problem option is yours)",
            name, profile));
    std::string variants;
    for (const std::string& s : specs) variants += " --variant " + s;
    // trained inputs when the cache holds them at n = 4096, else structured ones at a sharper
    // scale (where patterns and approximations separate)
    bool trained = false;
    try {
      trained = read_trained_meta().length >= 4096;
    } catch (const std::exception&) {  // no cache (or a broken one): structured inputs
    }
    seq_list = "512..4096";
    causal_mode = "both";
    pass_list = "fwd,fwdbwd";
    // shorter timing unless given: 2 repetitions of at least 0.05 s (a third of the default's
    // timed seconds on the small rows, still a spread to judge the noise by)
    if (cmd_ != nullptr && cmd_->get_option("--reps")->count() == 0) o.reps = 2;
    if (cmd_ != nullptr && cmd_->get_option("--min-time")->count() == 0) o.min_time = 0.05;
    also = {"--seq 4096 --causal on --pass decode" + variants,
            trained
                ? "--seq 512..4096 --causal on --input trained:layer=0,trained:layer=1" + variants
                : "--seq 512..4096 --causal off --input local,clustered --scale 2" + variants};
    fmt::print(
        stderr,
        "attnbench: --profile {}: --seq {} --causal {} --pass {} --reps {} --min-time {:g}{}\n",
        profile, seq_list, causal_mode, pass_list, o.reps, o.min_time, [&] {
          std::string t;
          for (const std::string& a : also) t += " --also='" + a + "'";
          return t;
        }());
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
          "--also", "--shard", "--shard-plan", "--machine-file", "--profile", "--remeasure"})
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

  // This shard's part of the plan: which configurations are in it, how many, and what
  // meta.json records of it (null without --shard).
  struct ShardPart {
    std::vector<bool> in_shard;
    size_t size = 0;
    nlohmann::json meta;
  };

  ShardPart shard_part(const SweepPlan& plan,
                       const std::optional<std::pair<int, int>>& shard_of) const {
    ShardPart part{std::vector<bool>(plan.configs.size(), true), plan.configs.size(), {}};
    if (!shard_of) return part;
    const auto [index, count] = *shard_of;
    const ShardSplit split = split_shards(plan, count, o.reps, o.min_time);
    for (size_t i = 0; i < plan.configs.size(); ++i) part.in_shard[i] = split.shard_of[i] == index;
    part.size = split.counts[size_t(index)];
    part.meta = {{"index", index},
                 {"count", count},
                 {"configs", part.size},
                 {"configs_total", plan.configs.size()},
                 {"estimated_cost", split.costs[size_t(index)]},
                 {"estimated_costs", split.costs},
                 {"estimated_imbalance", split.imbalance()}};
    fmt::print(
        stderr,
        "attnbench: shard {}/{}: {} of {} configurations, estimated {:.0f} s of {:.0f} "
        "s (imbalance {:.3f})\n",
        index, count, part.size, plan.configs.size(), split.costs[size_t(index)],
        [&] {
          double t = 0;
          for (double c : split.costs) t += c;
          return t;
        }(),
        split.imbalance());
    return part;
  }

  // plan.json: the sweep definition, the key columns and every configuration's key and name.
  void write_plan_file(const SweepPlan& plan, const std::vector<std::string>& keys,
                       const std::string& definition) const {
    const std::vector<std::string> names = plan_names(plan);
    nlohmann::json configs = nlohmann::json::array();
    for (size_t i = 0; i < keys.size(); ++i)
      configs.push_back({{"key", keys[i]}, {"name", names[i]}});
    write_json_file(
        (std::filesystem::path(out_dir) / "plan.json").string(),
        {{"sweep_definition", definition}, {"key_columns", key_columns()}, {"configs", configs}});
  }

  // The sweep's meta.json as it starts: the run's meta, the plan and shard, the rows kept, the
  // load and the processors.
  nlohmann::json start_meta(int argc, char** argv, const SweepPlan& plan, const MachineFigures& mf,
                            const std::string& definition, const ShardPart& part,
                            const ResultsDir& results) const {
    auto meta = meta_json(argc, argv, mf, plan.axes.threads);
    meta["rows_planned"] = part.size;
    meta["sweep_definition"] = definition;
    meta["plan_configs"] = plan.configs.size();
    meta["plan_file"] = "plan.json";
    if (!part.meta.is_null()) meta["shard"] = part.meta;
    meta["rows_kept_from_earlier_runs"] = results.rows_kept();
    meta["load_avg_start"] = json_number(load_average());
    meta["processors"] = omp_get_num_procs();
    if (auto trained = trained_inputs_meta(plan); !trained.is_null())
      meta["trained_inputs"] = trained;
    return meta;
  }

  // Measures the configurations of this shard still to measure, in plan order, with a progress
  // line each; counts the rows by status (and kept, noisy).
  std::map<std::string, int> run_plan(const SweepPlan& plan, const ShardPart& part,
                                      const MachineFigures& mf, ResultsDir& results,
                                      PatternStore& patterns,
                                      std::chrono::steady_clock::time_point t0,
                                      std::vector<Row>& measured_rows) const {
    const RunOptions opt{.reps = o.reps, .min_time = o.min_time};
    const std::vector<bool>& in_shard = part.in_shard;
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
    // The estimate before the first row: the fixed cost model of --shard-plan (rates fitted on
    // one machine, the same everywhere), so rough; the progress line's ETA then learns this
    // machine's rates from the rows measured.
    double estimate = 0;
    size_t to_measure = 0;
    for (size_t i = 0; i < plan.configs.size(); ++i) {
      if (!measured[i]) continue;
      ++to_measure;
      const double t = std::max(1, plan.configs[i].workload.threads);
      estimate += shard_run_cost(plan.configs[i], opt.reps, opt.min_time) +
                  reference_work[i] / (kShardReferenceRate * t);
    }
    if (to_measure > 0)
      fmt::print(stderr,
                 "attnbench: {} configuration{} to measure, estimated {} (a rough model, within "
                 "about 2x on most machines; the ETA below learns this one's rates)\n",
                 to_measure, to_measure == 1 ? "" : "s", human_duration(estimate));
    EtaModel eta_model(opt.reps, opt.min_time);
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
                 progress_line(position, part.size, elapsed, eta,
                               progress_what(probe.spec, c.embed, c.problem, c.workload)));
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
      measured_rows.push_back(row);
      if (row.status != "ok") fmt::print(stderr, "    {}: {}\n", row.status, row.message);
      if (row.noisy) fmt::print(stderr, "    warning: noisy timing: {}\n", noise_reason(row));
    }
    return counts;
  }

  int run(int argc, char** argv) {
    apply_profile();
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
    const ShardPart part = shard_part(plan, shard_of);
    ResultsDir results(out_dir, resume, force);
    PatternStore patterns(out_dir, resume);
    // Patterns are those of plain attention rows: a layer's heads attend projected inputs.
    // Every configuration of the whole plan is declared, so a shard stores the pattern the
    // unsharded sweep would (if that configuration is in the shard).
    for (const auto& c : plan.configs)
      if (c.embed == 0) patterns.plan(c.variant->spec(), c.problem, c.workload);
    write_plan_file(plan, keys, definition);
    fmt::print(stderr, "attnbench: machine figures ({} threads{})...\n", threads,
               machine_file.empty() ? "" : ", through " + machine_file);
    MachineFigures mf =
        machine_file.empty()
            ? kept_machine_figures(threads, /*quick=*/false, o.remeasure)
            : machine_figures(machine_file, threads, /*quick=*/false, {.remeasure = o.remeasure});
    fmt::print(stderr, "attnbench: GEMM {:.1f} GFLOP/s, bandwidth {:.1f} GB/s ({})\n",
               mf.gemm_gflops, mf.bandwidth_gbs, mf.source);
    auto meta = start_meta(argc, argv, plan, mf, definition, part, results);
    try {
      results.write_meta(meta);
    } catch (const WriteError& e) {
      throw stopped(e, results);
    }

    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Row> measured_rows;
    std::map<std::string, int> counts =
        run_plan(plan, part, mf, results, patterns, t0, measured_rows);
    std::string summary;
    for (auto& [k, v] : counts)
      summary += fmt::format("{}{} {}", summary.empty() ? "" : ", ", v, k);
    fmt::print(stderr, "attnbench: {} rows in {}/results.csv ({})\n", part.size, out_dir, summary);
    if (counts["noisy"] > 0)
      fmt::print(stderr,
                 "attnbench: warning: {} row(s) have noisy timings (the `noisy` column; "
                 "docs/methodology.md, \"Stable numbers\"); --resume after removing them, or "
                 "--retry-noisy "
                 "N, measures them again\n",
                 counts["noisy"]);
    print_sweep_table(measured_rows, out_dir);
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

}  // namespace

Command add_sweep_command(CLI::App& app, int argc, char** argv) {
  auto command = std::make_shared<SweepCommand>();
  return {command->add(app), [command, argc, argv] { return command->run(argc, argv); }};
}

}  // namespace attnbench::cli
