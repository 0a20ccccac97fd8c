// The attnbench plugin ABI version.
//
// A plugin (a shared library of variants loaded with --plugin) is compiled against the
// installed headers: it subclasses Variant, fills a VariantInfo and calls the registry through
// ATTNBENCH_REGISTER_VARIANT. Any change to those classes, to the types they hold (Problem,
// tensor views, ParamSpec, Capabilities, SparsePattern, ...) or to the registration entry
// point changes what a compiled plugin expects.
//
// BUMP ATTNBENCH_ABI_VERSION WITH EVERY SUCH CHANGE. It is also the SONAME version of
// libattnbench.so, the name of the registration entry point (register_variant_abiN, see
// common/core/registry.h) and the value a plugin carries in attnbench_plugin_abi_version, which
// the loader (common/io/plugin.h) reads from the file before it runs any of the plugin's code.
#pragma once

#define ATTNBENCH_ABI_VERSION 12

// The loader reads the ABI symbol as a 4-byte object; clang's AddressSanitizer would pad it
// with a redzone (a 32-byte symbol), so it is left out of that instrumentation.
#if defined(__clang__)
#define ATTNBENCH_PLUGIN_ABI_NO_ASAN __attribute__((no_sanitize("address")))
#else
#define ATTNBENCH_PLUGIN_ABI_NO_ASAN
#endif

/// Defines the symbol that tells the loader which ABI a plugin was built against. Exactly one
/// source file of a plugin expands it; attnbench_add_plugin (the CMake package) generates that
/// file, so plugin sources never need it.
#define ATTNBENCH_DEFINE_PLUGIN_ABI()                     \
  extern "C" __attribute__((visibility("default"), used)) \
  ATTNBENCH_PLUGIN_ABI_NO_ASAN const int attnbench_plugin_abi_version = ATTNBENCH_ABI_VERSION

/// Name of the symbol ATTNBENCH_DEFINE_PLUGIN_ABI defines.
#define ATTNBENCH_PLUGIN_ABI_SYMBOL "attnbench_plugin_abi_version"
