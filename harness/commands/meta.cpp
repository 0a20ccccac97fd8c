// The meta.json of a sweep.
#include "harness/commands/meta.h"

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

std::string run_command(const std::string& cmd) {
  std::string out;
  if (FILE* f = popen(cmd.c_str(), "r")) {
    char buf[256];
    while (fgets(buf, sizeof buf, f)) out += buf;
    pclose(f);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// The source tree's state when the run was made: its commit, and every modified, added,
// deleted or untracked (not ignored) file, as `git status --porcelain` names them. Any of
// them makes the commit "-dirty": an untracked variant file is compiled in all the same.
struct GitState {
  std::string commit;
  std::vector<std::string> changes;
};

GitState git_state() {
  GitState g;
  g.commit =
      run_command(fmt::format("git -C '{}' rev-parse HEAD 2>/dev/null", ATTNBENCH_SOURCE_DIR));
  if (g.commit.empty()) {
    g.commit = ATTNBENCH_GIT_COMMIT;
    return g;
  }
  const std::string status = run_command(fmt::format(
      "git -C '{}' status --porcelain --untracked-files=all 2>/dev/null", ATTNBENCH_SOURCE_DIR));
  size_t start = 0;
  while (start < status.size()) {
    size_t end = status.find('\n', start);
    if (end == std::string::npos) end = status.size();
    if (end > start) g.changes.push_back(status.substr(start, end - start));
    start = end + 1;
  }
  if (!g.changes.empty()) g.commit += "-dirty";
  return g;
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789-_./:=,+@") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string command_line(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) s += (i ? " " : "") + shell_quote(argv[i]);
  return s;
}

/// The bf16 kernels of the tiled attention engine on this machine (common/kernels/bf16.h): the
/// ATTNBENCH_BF16_KERNEL request, whether amx can run (and why not), whether the CPU has
/// AVX512-BF16, and the kernel bf16 rows take by default (each row's notes name the one that
/// ran: key blocks amx cannot start at take f32).
nlohmann::json bf16_kernels_json() {
  const std::string request = bf16_kernel_request();
  const bool amx = amx_usable();
  return {{"request", request},
          {"amx_usable", amx},
          {"amx_unusable_reason", amx_unusable_reason()},
          {"cpu_avx512_bf16", cpu_has_avx512_bf16()},
          {"default_kernel", amx && request != "f32" ? "amx" : "f32"}};
}

}  // namespace

nlohmann::json json_number(double x) { return std::isfinite(x) ? nlohmann::json(x) : nullptr; }

nlohmann::json meta_json(int argc, char** argv, const MachineFigures& mf, int threads) {
  const GitState git = git_state();
  return {{"date", utc_now()},
          {"attnbench_version", ATTNBENCH_VERSION},
          {"git_commit", git.commit},
          {"git_dirty", !git.changes.empty()},
          {"git_changes", git.changes},
          {"compiler", ATTNBENCH_COMPILER},
          {"cxx_flags", ATTNBENCH_CXX_FLAGS},
          {"build_type", ATTNBENCH_BUILD_TYPE},
          {"cpu_model", mf.cpu_model},
          {"host", host_name()},
          {"threads", threads},
          {"machine", to_json(mf)},
          {"command_line", command_line(argc, argv)},
          {"plugins", loaded_plugins()},
          // what `list --json` says: parameters with their defaults (plots label a spec by
          // the parameters that differ) and capabilities
          {"variants", nlohmann::json::parse(variants_json().dump())},
          {"exact_pairs_limit", kExactPairsLimit},
          {"bf16_kernels", bf16_kernels_json()}};
}

}  // namespace attnbench::cli
