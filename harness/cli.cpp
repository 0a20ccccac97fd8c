#include "harness/cli.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/core/suggest.h"
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
  load_env_plugins();
  for (const auto& path : paths) load_plugin(path);
}

// The values given to --variant on the command line (--variant X or --variant=X).
std::vector<std::string> variant_words(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--variant" && i + 1 < argc) out.emplace_back(argv[++i]);
    if (a.rfind("--variant=", 0) == 0) out.push_back(a.substr(10));
  }
  return out;
}

// The words of a command line CLI11 did not expect, in their order on the line, each with a
// hint where one helps: a variant parameter written as an option (--variant local --window 64
// is --variant local:window=64) or an option of the command a letter or two away (--causl is
// --causal).
std::string unexpected_words(const CLI::App& command, std::string message, int argc, char** argv) {
  auto colon = message.find(": ");
  if (colon == std::string::npos) return message;
  std::vector<std::string> words;
  std::string rest = message.substr(colon + 2);
  for (size_t at = 0; at <= rest.size();) {
    size_t space = rest.find(' ', at);
    if (space == std::string::npos) space = rest.size();
    if (space > at) words.push_back(rest.substr(at, space - at));
    at = space + 1;
  }
  auto position = [&](const std::string& w) {
    for (int i = 1; i < argc; ++i)
      if (w == argv[i]) return i;
    return argc;
  };
  std::stable_sort(words.begin(), words.end(), [&](const std::string& a, const std::string& b) {
    return position(a) < position(b);
  });
  std::vector<std::string> options;
  for (const CLI::Option* o : command.get_options())
    for (const std::string& name : o->get_lnames()) options.push_back(name);
  std::vector<std::string> hints;
  for (const std::string& w : words) {
    if (w.rfind("--", 0) != 0 || w.size() < 3) continue;
    const std::string key =
        w.substr(2, w.find('=') == std::string::npos ? std::string::npos : w.find('=') - 2);
    std::string value = w.find('=') == std::string::npos ? "" : w.substr(w.find('=') + 1);
    const int i = position(w);
    if (value.empty() && i + 1 < argc && argv[i + 1][0] != '-') value = argv[i + 1];
    bool parameter = false;
    for (const std::string& spec : variant_words(argc, argv)) {
      const std::string name = spec.substr(0, spec.find(':'));
      const VariantInfo* info = Registry::instance().find(name);
      if (!info) continue;
      for (const ParamSpec& ps : info->params) {
        if (ps.name != key) continue;
        hints.push_back(fmt::format(
            "{} is a parameter of {}: write it in the spec, --variant {}{}{}={}", w, name, spec,
            spec.find(':') == std::string::npos ? ":" : ",", key, value.empty() ? "VALUE" : value));
        parameter = true;
      }
    }
    if (parameter) continue;
    if (auto match = closest_match(key, options))
      hints.push_back(fmt::format("did you mean --{} for {}?", *match, w));
  }
  std::string text = message.substr(0, colon + 2) + fmt::format("{}", fmt::join(words, " "));
  if (!hints.empty()) text += fmt::format("; {}", fmt::join(hints, "; "));
  return text;
}

// A command line CLI11 refused: a first word that names no command is named with the list of
// commands (and the nearest of them); unexpected words get their hints; anything else is
// CLI11's own message (or help). Returns the exit code.
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
                 "attnbench: error: unknown command '{}'{}; accepted: {} (attnbench --help)\n", a,
                 did_you_mean(a, names), fmt::join(names, ", "));
      return 2;
    }
  }
  if (e.get_exit_code() == 0) return app.exit(e);  // --help, --help-all
  // One format for every error, the parser's included.
  std::string command = "attnbench";
  const CLI::App* innermost = &app;
  for (const CLI::App* sub : app.get_subcommands()) {
    command += " " + sub->get_name();
    innermost = sub;
  }
  const std::string what = dynamic_cast<const CLI::ExtrasError*>(&e)
                               ? unexpected_words(*innermost, e.what(), argc, argv)
                               : std::string(e.what());
  fmt::print(stderr, "attnbench: error: {} (`{} --help` lists the options)\n", what, command);
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
