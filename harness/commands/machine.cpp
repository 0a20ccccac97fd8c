// `attnbench machine`: peak GEMM rate and memory bandwidth.
#include "harness/machine.h"

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
#include "harness/merge.h"
#include "harness/output_dir.h"
#include "harness/patterns.h"
#include "harness/results.h"
#include "harness/runner.h"
#include "harness/shard.h"
#include "harness/sweep_plan.h"

namespace attnbench::cli {

namespace {

struct MachineCommand {
  int threads = 0;
  bool json = false, quick = false;
  std::string file;

  CLI::App* add(CLI::App& app) {
    auto* cmd = app.add_subcommand("machine", "peak GEMM rate and memory bandwidth");
    cmd->footer("\nExamples:\n  attnbench machine\n  attnbench machine --threads 1 --json");
    cmd->add_option("--threads", threads,
                    fmt::format("threads (0 = every core; at most {})", max_threads()))
        ->check(int_in(0, max_threads()));
    cmd->add_flag("--json", json, "print JSON");
    cmd->add_flag("--quick", quick, "fewer and smaller products (about a second)");
    cmd->add_option("--file", file, kMachineFileHelp);
    return cmd;
  }

  int run() const {
    MachineFigures mf = machine_figures(file, apply_threads(threads), quick);
    if (json) {
      fmt::print("{}\n", to_json(mf).dump(2));
    } else {
      fmt::print("cpu        {}\nthreads    {}\nhost       {}\n", mf.cpu_model, mf.threads,
                 mf.host);
      fmt::print("GEMM       {:.1f} GFLOP/s best (OpenBLAS {:.1f}, Eigen {:.1f}; square n = {})\n",
                 mf.gemm_gflops, mf.blas_gflops, mf.eigen_gflops, mf.gemm_size);
      fmt::print(
          "bf16       {:.1f} GFLOP/s peak (AMX tiles {:.1f}, AVX512-BF16 {:.1f}; 0: none; in "
          "registers and L1)\n",
          mf.bf16_gflops, mf.amx_bf16_gflops, mf.avx512_bf16_gflops);
      fmt::print("bandwidth  {:.1f} GB/s (triad)\n", mf.bandwidth_gbs);
      fmt::print("figures    {} at {}\n", mf.source, mf.measured_at);
    }
    return 0;
  }
};

}  // namespace

Command add_machine_command(CLI::App& app) {
  auto command = std::make_shared<MachineCommand>();
  return {command->add(app), [command] { return command->run(); }};
}

}  // namespace attnbench::cli
