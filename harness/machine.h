// Machine figures measured once per run: peak GEMM rate and memory bandwidth.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace attnbench {

struct MachineFigures {
  std::string cpu_model;
  int threads = 0;
  double gemm_gflops = 0;    ///< best single-precision GEMM rate seen (BLAS or Eigen)
  double blas_gflops = 0;    ///< OpenBLAS sgemm, large square products
  double eigen_gflops = 0;   ///< Eigen's own GEMM, same sizes
  int gemm_size = 0;         ///< the square size that gave the best rate
  double bandwidth_gbs = 0;  ///< STREAM-style triad a = b + s c, GB/s (3 arrays counted)
};

/// Measures GEMM (square sizes 2048 and 4096, best of several) and triad bandwidth with
/// `threads` threads. `quick` uses fewer and smaller products (about a second in all).
MachineFigures measure_machine(int threads, bool quick = false);

nlohmann::json to_json(const MachineFigures& m);
/// "AMD EPYC ..." from /proc/cpuinfo, or "unknown".
std::string cpu_model();

}  // namespace attnbench
