// `attnbench merge`: the results directories of a sharded sweep joined into one.
#include "harness/merge.h"

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
#include "harness/output_dir.h"
#include "harness/patterns.h"
#include "harness/results.h"
#include "harness/runner.h"
#include "harness/shard.h"
#include "harness/sweep_plan.h"

namespace attnbench::cli {

namespace {

struct MergeCommand {
  MergeOptions opt;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "merge", "join the results directories of a sharded sweep (sweep --shard i/N) into one");
    cmd->footer(
        "\nExamples:\n  attnbench merge results/shard-0 results/shard-1 --out results/all\n"
        "  attnbench merge results/shard-* --out results/all --strict");
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

}  // namespace

Command add_merge_command(CLI::App& app) {
  auto command = std::make_shared<MergeCommand>();
  return {command->add(app), [command] { return command->run(); }};
}

}  // namespace attnbench::cli
