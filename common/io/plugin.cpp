#include "common/io/plugin.h"

#include <dlfcn.h>
#include <elf.h>
#include <fmt/format.h>

#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "common/core/abi.h"
#include "common/core/registry.h"

namespace attnbench {

namespace {

// Handles of the loaded plugins, never closed: their variants' code must outlive the registry.
struct Loaded {
  std::vector<std::string> paths;
  std::vector<void*> handles;
};
Loaded& loaded() {
  static Loaded l;
  return l;
}

[[noreturn]] void fail(const std::string& path, const std::string& why) {
  throw PluginError(fmt::format("{}: {}", path, why));
}

// Copies a T from bytes[offset, offset + sizeof(T)), or fails naming the file.
template <class T>
T read_at(const std::string& bytes, uint64_t offset, const std::string& path) {
  if (offset > bytes.size() || bytes.size() - offset < sizeof(T))
    fail(path, "not a shared library (truncated ELF file)");
  T t;
  std::memcpy(&t, bytes.data() + offset, sizeof(T));
  return t;
}

}  // namespace

int read_plugin_abi(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path, fmt::format("cannot open: {}", std::strerror(errno)));
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::string expected = "a shared library built with attnbench_add_plugin";
  if (bytes.size() < EI_NIDENT || std::memcmp(bytes.data(), ELFMAG, SELFMAG) != 0)
    fail(path, fmt::format("not a shared library (no ELF header); expected {}", expected));
  if (bytes[EI_CLASS] != ELFCLASS64)
    fail(path, "not a 64-bit ELF file; this attnbench is a 64-bit program");
  if (bytes[EI_DATA] != (std::endian::native == std::endian::little ? ELFDATA2LSB : ELFDATA2MSB))
    fail(path, "an ELF file of the other byte order than this machine's");
  const auto eh = read_at<Elf64_Ehdr>(bytes, 0, path);
  if (eh.e_type != ET_DYN)
    fail(path, fmt::format("an ELF {} file, not a shared library; expected {}",
                           eh.e_type == ET_EXEC  ? "executable"
                           : eh.e_type == ET_REL ? "object"
                                                 : "other",
                           expected));
  if (eh.e_shentsize != sizeof(Elf64_Shdr))
    fail(path, "not a shared library (malformed section header table)");
  auto section = [&](uint64_t index) {
    if (index >= eh.e_shnum) fail(path, "not a shared library (malformed section index)");
    return read_at<Elf64_Shdr>(bytes, eh.e_shoff + index * sizeof(Elf64_Shdr), path);
  };
  for (uint64_t s = 0; s < eh.e_shnum; ++s) {
    const Elf64_Shdr symtab = section(s);
    if (symtab.sh_type != SHT_DYNSYM || symtab.sh_entsize != sizeof(Elf64_Sym)) continue;
    const Elf64_Shdr strtab = section(symtab.sh_link);
    for (uint64_t i = 0; i < symtab.sh_size / sizeof(Elf64_Sym); ++i) {
      const auto sym = read_at<Elf64_Sym>(bytes, symtab.sh_offset + i * sizeof(Elf64_Sym), path);
      if (sym.st_shndx == SHN_UNDEF || sym.st_shndx >= SHN_LORESERVE) continue;
      const uint64_t name = strtab.sh_offset + sym.st_name;
      if (sym.st_name >= strtab.sh_size || name >= bytes.size()) continue;
      if (std::strncmp(bytes.data() + name, ATTNBENCH_PLUGIN_ABI_SYMBOL,
                       std::min<size_t>(bytes.size() - name, sizeof ATTNBENCH_PLUGIN_ABI_SYMBOL)) !=
          0)
        continue;
      // The value lives in the section that holds the symbol's address.
      const Elf64_Shdr holder = section(sym.st_shndx);
      if (holder.sh_type == SHT_NOBITS || sym.st_size != sizeof(int32_t) ||
          sym.st_value < holder.sh_addr || sym.st_value - holder.sh_addr + 4 > holder.sh_size)
        fail(path,
             fmt::format("{} is not a 4-byte initialised constant", ATTNBENCH_PLUGIN_ABI_SYMBOL));
      return read_at<int32_t>(bytes, holder.sh_offset + (sym.st_value - holder.sh_addr), path);
    }
  }
  fail(path, fmt::format("not an attnbench plugin: it does not define {} (build plugins with "
                         "attnbench_add_plugin from attnbench's CMake package)",
                         ATTNBENCH_PLUGIN_ABI_SYMBOL));
}

void load_plugin(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) throw PluginError("an empty plugin path");
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) fail(path, "no such file");
  if (fs::is_directory(status)) fail(path, "a directory, not a shared library");
  const std::string real = fs::canonical(path, ec).string();
  if (ec) fail(path, fmt::format("cannot resolve the path: {}", ec.message()));
  for (const auto& p : loaded().paths)
    if (p == real) return;  // the same file given twice: loaded once

  const int abi = read_plugin_abi(path);
  if (abi != ATTNBENCH_ABI_VERSION)
    fail(path, fmt::format("built against attnbench ABI {}, this attnbench is ABI {}; rebuild the "
                           "plugin against this attnbench",
                           abi, ATTNBENCH_ABI_VERSION));

  Registry& reg = Registry::instance();
  reg.open_stage();
  void* handle = dlopen(real.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::vector<VariantInfo> staged = reg.close_stage();
  if (!handle) {
    const char* err = dlerror();
    fail(path, fmt::format("cannot load: {}", err ? err : "unknown dlopen error"));
  }
  std::string error;
  if (staged.empty()) {
    error =
        "registers no variant (a plugin registers its variants with ATTNBENCH_REGISTER_VARIANT)";
  } else {
    for (auto& info : staged) info.plugin = real;
    try {
      reg.add_all(std::move(staged));
    } catch (const SpecError& e) {
      error = e.what();
    }
  }
  if (!error.empty()) {
    // The staged VariantInfos hold code of the plugin (their factories): drop them first.
    staged.clear();
    dlclose(handle);
    fail(path, error);
  }
  loaded().paths.push_back(real);
  loaded().handles.push_back(handle);
}

void load_env_plugins() {
  const char* env = std::getenv("ATTNBENCH_PLUGINS");
  if (!env) return;
  for (const auto& path : split_plugin_list(env)) {
    try {
      load_plugin(path);
    } catch (const PluginError& e) {
      throw PluginError(fmt::format("{} (in ATTNBENCH_PLUGINS)", e.what()));
    }
  }
}

const std::vector<std::string>& loaded_plugins() { return loaded().paths; }

std::vector<std::string> split_plugin_list(std::string_view list) {
  std::vector<std::string> out;
  while (!list.empty()) {
    const size_t colon = list.find(':');
    if (colon != 0) out.emplace_back(list.substr(0, colon));
    if (colon == std::string_view::npos) break;
    list.remove_prefix(colon + 1);
  }
  return out;
}

}  // namespace attnbench
