#include "harness/machine.h"

#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "common/random.h"
#include "common/tensor.h"

namespace attnbench {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void fill(float* x, int64_t count, uint64_t stream) {
  RandomStream rs(12345, stream);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) x[i] = float(rs.uniform(uint64_t(i)) - 0.5);
}

}  // namespace

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      auto pos = line.find(':');
      if (pos != std::string::npos) return line.substr(line.find_first_not_of(' ', pos + 1));
    }
  return "unknown";
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "unknown";
  return name;
}

MachineFigures measure_machine(int threads, bool quick) {
  MachineFigures mf;
  mf.cpu_model = cpu_model();
  mf.threads = threads;
#ifdef __SANITIZE_ADDRESS__
  // Under the sanitizers Eigen's GEMM is instrumented: square products of 4096 take minutes
  // and the figure describes the instrumentation, not the machine.
  quick = true;
#endif
  omp_set_num_threads(threads);
  const std::vector<int> sizes = quick ? std::vector<int>{1536} : std::vector<int>{2048, 4096};
  for (int n : sizes) {
    Tensor a({1, 1, n, n}), b({1, 1, n, n}), c({1, 1, n, n});
    fill(a.data(), a.numel(), 1);
    fill(b.data(), b.numel(), 2);
    const double flop = 2.0 * n * double(n) * n;
    const int reps = quick ? 3 : (n <= 2048 ? 5 : 3);
    for (int r = 0; r < reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(),
                  n, 0.0f, c.data(), n);
      const double g = flop / seconds_since(t0) / 1e9;
      if (g > mf.blas_gflops) mf.blas_gflops = g;
      if (g > mf.gemm_gflops) mf.gemm_gflops = g, mf.gemm_size = n;
    }
    using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::Map<RowMat> ea(a.data(), n, n), eb(b.data(), n, n), ec(c.data(), n, n);
    for (int r = 0; r < (quick ? 2 : 3); ++r) {
      auto t0 = std::chrono::steady_clock::now();
      ec.noalias() = ea * eb;
      const double g = flop / seconds_since(t0) / 1e9;
      if (g > mf.eigen_gflops) mf.eigen_gflops = g;
      if (g > mf.gemm_gflops) mf.gemm_gflops = g, mf.gemm_size = n;
    }
  }
  // triad over three arrays well beyond the last-level cache
  const int64_t count = (quick ? 16 : 32) << 20;
  Tensor a({1, 1, 1, count}), b({1, 1, 1, count}), c({1, 1, 1, count});
  fill(b.data(), count, 3);
  fill(c.data(), count, 4);
  float *pa = a.data(), *pb = b.data(), *pc = c.data();
  for (int r = 0; r < (quick ? 3 : 6); ++r) {
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) pa[i] = pb[i] + 1.5f * pc[i];
    const double gbs = 3.0 * double(count) * sizeof(float) / seconds_since(t0) / 1e9;
    mf.bandwidth_gbs = std::max(mf.bandwidth_gbs, gbs);
  }
  return mf;
}

nlohmann::json to_json(const MachineFigures& m) {
  return {{"cpu_model", m.cpu_model},        {"threads", m.threads},
          {"gemm_gflops", m.gemm_gflops},    {"blas_gflops", m.blas_gflops},
          {"eigen_gflops", m.eigen_gflops},  {"gemm_size", m.gemm_size},
          {"bandwidth_gbs", m.bandwidth_gbs}};
}

}  // namespace attnbench

namespace attnbench {

double load_average() {
  double l[1];
  return getloadavg(l, 1) == 1 ? l[0] : NAN;
}

CpuSample sample_cpu() {
  CpuSample s;
  s.wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const double tick = double(sysconf(_SC_CLK_TCK));
  if (!(tick > 0)) return s;
  {
    // "cpu  user nice system idle iowait irq softirq steal ...": busy = all but idle, iowait
    std::ifstream f("/proc/stat");
    std::string cpu;
    double v[8] = {};
    if (f >> cpu >> v[0] >> v[1] >> v[2] >> v[3] >> v[4] >> v[5] >> v[6] >> v[7] && cpu == "cpu")
      s.busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / tick;
  }
  {
    // /proc/self/stat: fields 14 and 15 (utime, stime) after the "(comm)" field, which may
    // hold spaces: count from its closing parenthesis.
    std::ifstream f("/proc/self/stat");
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t close = text.rfind(')');
    if (close != std::string::npos) {
      std::istringstream rest(text.substr(close + 1));
      std::string field;
      double utime = 0, stime = 0;
      // after ")": field 3 (state) .. 13 are 11 fields, then utime (14) and stime (15)
      int i = 3;
      for (; i <= 13 && rest >> field; ++i) {
      }
      if (i == 14 && rest >> utime >> stime) s.own = (utime + stime) / tick;
    }
  }
  return s;
}

double other_load(const CpuSample& a, const CpuSample& b) {
  const double wall = b.wall - a.wall;
  if (!(wall >= kMinLoadInterval)) return NAN;
  const double other = ((b.busy - a.busy) - (b.own - a.own)) / wall;
  return std::isfinite(other) ? std::max(0.0, other) : NAN;
}

}  // namespace attnbench
