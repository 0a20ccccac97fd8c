// The commands of the attnbench command line, each in its own file (harness/commands/<name>.cpp):
// each adds its subcommand and options to the app and gives the function that runs it.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace attnbench::cli {

// A command added to the app: its subcommand, and what runs it once the command line is parsed
// (the exit code).
struct Command {
  const CLI::App* app = nullptr;
  std::function<int()> run;
};

Command add_list_command(CLI::App& app);
Command add_run_command(CLI::App& app);
// The sweep's meta.json records the command line.
Command add_sweep_command(CLI::App& app, int argc, char** argv);
Command add_merge_command(CLI::App& app);
Command add_layer_command(CLI::App& app);
Command add_pattern_command(CLI::App& app);
Command add_machine_command(CLI::App& app);

}  // namespace attnbench::cli
