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
  bool json = false, brief = false;
  std::vector<std::string> names;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("list", "variants with their parameters and capabilities");
    cmd->footer(
        "\nExamples:\n  attnbench list --brief\n  attnbench list local flash\n  attnbench list "
        "--json");
    cmd->add_option("NAME", names, "list only these variants (all when none is given)");
    cmd->add_flag("--json", json, "print JSON");
    auto* brief_flag =
        cmd->add_flag("--brief", brief, "one line per variant: its capabilities and summary");
    brief_flag->excludes(cmd->get_option("--json"));
    return cmd;
  }

  int run() const {
    if (json) {
      const auto all = variants_json();
      if (names.empty()) {
        fmt::print("{}\n", all.dump(2));
        return 0;
      }
      nlohmann::ordered_json some = nlohmann::ordered_json::array();
      for (const VariantInfo* v : listed_variants(names))
        for (const auto& entry : all)
          if (entry.at("name") == v->name) some.push_back(entry);
      fmt::print("{}\n", some.dump(2));
    } else {
      print_list(names, brief);
    }
    return 0;
  }
};

}  // namespace

Command add_list_command(CLI::App& app) {
  auto command = std::make_shared<ListCommand>();
  return {command->add(app), [command] { return command->run(); }};
}

}  // namespace attnbench::cli
