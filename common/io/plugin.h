// Loading variants from plugins: shared libraries built against an installed attnbench (with
// attnbench_add_plugin from its CMake package) whose variants register themselves exactly as
// built-in ones do (ATTNBENCH_REGISTER_VARIANT).
//
// load_plugin(path), in order:
//   1. the file must exist and be an ELF shared library;
//   2. its ABI version (the symbol attnbench_plugin_abi_version, read from the file, so no code
//      of the plugin runs yet) must equal ATTNBENCH_ABI_VERSION;
//   3. dlopen(RTLD_NOW | RTLD_LOCAL) with the registry's stage open: every symbol must resolve
//      now, and the static initialisers' registrations are held back;
//   4. the plugin must register at least one variant, and all of them must be acceptable
//      (no name already registered, one type per parameter name); then they are added
//      together. On any failure nothing is added and the plugin is unloaded.
// A file given twice (same real path) is loaded once.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/core/error.h"

namespace attnbench {

/// A plugin could not be loaded. The message starts with the file as given.
struct PluginError : Error {
  using Error::Error;
};

/// Loads one plugin (see above). Throws PluginError naming the file.
void load_plugin(const std::string& path);

/// Loads every plugin of the ATTNBENCH_PLUGINS variable (colon-separated), in order; a
/// failing one throws PluginError naming the file and the variable.
void load_env_plugins();

/// Real paths of the plugins loaded so far, in load order.
const std::vector<std::string>& loaded_plugins();

/// Splits a colon-separated list (the ATTNBENCH_PLUGINS variable); empty items are dropped.
std::vector<std::string> split_plugin_list(std::string_view list);

/// The ABI version a plugin file carries, read from its ELF dynamic symbol table without
/// loading it. Throws PluginError if the file is not an ELF shared library or lacks the
/// symbol.
int read_plugin_abi(const std::string& path);

}  // namespace attnbench
