// Fuzzes the readers of results.csv that take a file from disk: `sweep --resume` (ResultsDir,
// which keeps, upgrades or sets aside each line) and `merge` (a shard's rows, checked line by
// line). The input is written as a results directory's results.csv (beside a fixed meta.json),
// then resumed and merged. Either must succeed or throw attnbench::Error with a message; a
// resumed file must afterwards hold only whole rows of the current columns.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/core/error.h"
#include "harness/merge.h"
#include "harness/results.h"

namespace fs = std::filesystem;

namespace {

const fs::path& work_dir() {
  static const fs::path dir = [] {
    const fs::path base = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    return base / ("attnbench-fuzz-results-" + std::to_string(::getpid()));
  }();
  return dir;
}

void write(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const fs::path shard = work_dir() / "shard", out = work_dir() / "merged",
                 resumed = work_dir() / "resumed";
  fs::remove_all(work_dir());
  fs::create_directories(shard);
  fs::create_directories(resumed);
  write(shard / "results.csv", text);
  write(shard / "meta.json", R"({"git_commit": "c", "sweep_definition": "d"})");
  write(resumed / "results.csv", text);
  try {
    attnbench::MergeOptions opt;
    opt.dirs = {shard.string()};
    opt.out = out.string();
    opt.allow_missing = true;
    attnbench::merge_results(opt);
  } catch (const attnbench::Error&) {
  }
  try {
    attnbench::ResultsDir rd(resumed.string(), /*resume=*/true);
  } catch (const attnbench::Error&) {
    return 0;
  }
  // what resume kept: a header of the current columns and whole rows no sweep would refuse
  std::ifstream in(resumed / "results.csv", std::ios::binary);
  std::string line;
  if (!std::getline(in, line) || attnbench::split_csv_line(line) != attnbench::csv_columns())
    __builtin_trap();
  while (std::getline(in, line))
    if (!line.empty() &&
        !attnbench::malformed_reason(attnbench::csv_columns(), attnbench::split_csv_line(line))
             .empty())
      __builtin_trap();
  return 0;
}
