#include "harness/cli.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/core/error.h"
#include "common/io/plugin.h"
#include "common/io/trained.h"
#include "harness/commands/commands.h"
#include "harness/output_dir.h"
#include "harness/runner.h"

namespace attnbench {

namespace {

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
  const std::vector<cli::Command> commands = {cli::add_list_command(app),
                                              cli::add_run_command(app),
                                              cli::add_sweep_command(app, argc, argv),
                                              cli::add_merge_command(app),
                                              cli::add_layer_command(app),
                                              cli::add_pattern_command(app),
                                              cli::add_machine_command(app)};

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return report_parse_error(app, e, argc, argv);
  }

  try {
    load_plugins(plugin_paths);
    for (const cli::Command& command : commands)
      if (*command.app) return command.run();
  } catch (const std::exception& e) {
    return report_error(e);
  }
  return 0;
}

}  // namespace attnbench
