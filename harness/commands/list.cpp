// `attnbench list`: the variants with their parameters and capabilities.
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

}  // namespace

Command add_list_command(CLI::App& app) {
  auto command = std::make_shared<ListCommand>();
  return {command->add(app), [command] { return command->run(); }};
}

}  // namespace attnbench::cli
