#include "harness/machine.h"

#include <cblas.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <omp.h>
#include <sys/file.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <type_traits>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/tensor.h"
#include "common/kernels/bf16.h"

namespace attnbench {

namespace {

// Whether this build runs under AddressSanitizer's instrumentation.
bool instrumented_build() {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

}  // namespace

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
  mf.host = host_name();
  mf.measured_at = utc_now();
  // Under the sanitizers the products and loops are instrumented: the figures describe the
  // instrumentation, not the machine, so they are taken on the smallest sizes.
  const bool instrumented = instrumented_build();
  omp_set_num_threads(threads);
  // Square products of growing size, each library repeated until 0.3 s (0.1 s when quick),
  // at least twice: the peak is the best rate seen. A size is taken only while one product of
  // the faster library is projected to take at most 2 s, and a library far behind the other
  // at one size (below 0.6 of its rate) is not measured at the larger ones, so the whole takes
  // a few seconds on any machine (both libraries at every size would take 20-25 s).
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const std::vector<int> sizes = instrumented ? std::vector<int>{256}
                                 : quick      ? std::vector<int>{1024, 1536}
                                              : std::vector<int>{1024, 2048, 4096};
  const double min_spent = quick ? 0.1 : 0.3;  // seconds per library and size
  bool blas_on = true;
  for (int n : sizes) {
    Tensor a({1, 1, n, n}), b({1, 1, n, n}), c({1, 1, n, n});
    fill(a.data(), a.numel(), 1);
    fill(b.data(), b.numel(), 2);
    const double flop = 2.0 * n * double(n) * n;
    Eigen::Map<RowMat> ea(a.data(), n, n), eb(b.data(), n, n), ec(c.data(), n, n);
    // best rate of `product` at this size; `fastest` is its shortest repetition in seconds
    auto best = [&](auto&& product, double& fastest) {
      double rate = 0, spent = 0;
      fastest = INFINITY;
      for (int r = 0; r < 8 && (r < 2 || spent < min_spent); ++r) {
        auto t0 = std::chrono::steady_clock::now();
        product();
        const double s = seconds_since(t0);
        spent += s;
        fastest = std::min(fastest, s);
        rate = std::max(rate, flop / s / 1e9);
      }
      return rate;
    };
    auto eigen_product = [&] { ec.noalias() = ea * eb; };
    auto blas_product = [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(),
                  n, 0.0f, c.data(), n);
    };
    double eigen_rep = INFINITY, blas_rep = INFINITY;
    const double eigen = best(eigen_product, eigen_rep);
    const double blas = blas_on ? best(blas_product, blas_rep) : 0.0;
    mf.eigen_gflops = std::max(mf.eigen_gflops, eigen);
    mf.blas_gflops = std::max(mf.blas_gflops, blas);
    for (double g : {eigen, blas})
      if (g > mf.gemm_gflops) mf.gemm_gflops = g, mf.gemm_size = n;
    if (blas < 0.6 * eigen) blas_on = false;
    if (8 * std::min(eigen_rep, blas_rep) > 2.0) break;
  }
  // the bf16 product instructions, in registers and L1
  const double bf16_seconds = instrumented ? 0.01 : quick ? 0.05 : 0.2;
  mf.amx_bf16_gflops = amx_bf16_peak_gflops(threads, bf16_seconds);
  mf.avx512_bf16_gflops = avx512_bf16_peak_gflops(threads, bf16_seconds);
  mf.bf16_gflops = std::max({mf.gemm_gflops, mf.amx_bf16_gflops, mf.avx512_bf16_gflops});
  // triad over three arrays well beyond the last-level cache
  const int64_t count = instrumented ? 1 << 20 : (quick ? 16 : 32) << 20;
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

double peak_gflops(const MachineFigures& m, bool bf16) {
  return bf16 && m.bf16_gflops > 0 ? m.bf16_gflops : m.gemm_gflops;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

nlohmann::json to_json(const MachineFigures& m) {
  return {{"cpu_model", m.cpu_model},
          {"threads", m.threads},
          {"gemm_gflops", m.gemm_gflops},
          {"blas_gflops", m.blas_gflops},
          {"eigen_gflops", m.eigen_gflops},
          {"gemm_size", m.gemm_size},
          {"bf16_gflops", m.bf16_gflops},
          {"amx_bf16_gflops", m.amx_bf16_gflops},
          {"avx512_bf16_gflops", m.avx512_bf16_gflops},
          {"bandwidth_gbs", m.bandwidth_gbs},
          {"host", m.host},
          {"measured_at", m.measured_at},
          {"source", m.source}};
}

MachineFigures machine_from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw Error("not a JSON object");
  auto get = [&](const char* key, auto& out, bool positive) {
    auto it = j.find(key);
    if (it == j.end()) throw Error(fmt::format("no '{}'", key));
    using T = std::decay_t<decltype(out)>;
    if constexpr (std::is_same_v<T, std::string>) {
      if (!it->is_string()) throw Error(fmt::format("'{}' is not a string", key));
      out = it->template get<std::string>();
    } else {
      if (!it->is_number()) throw Error(fmt::format("'{}' is not a number", key));
      out = it->template get<T>();
      if (positive && !(std::isfinite(double(out)) && out > 0))
        throw Error(fmt::format("'{}' is {}, not a positive number", key, double(out)));
    }
  };
  MachineFigures m;
  get("cpu_model", m.cpu_model, false);
  get("threads", m.threads, true);
  get("gemm_gflops", m.gemm_gflops, true);
  get("blas_gflops", m.blas_gflops, true);
  get("eigen_gflops", m.eigen_gflops, true);
  get("gemm_size", m.gemm_size, true);
  get("bandwidth_gbs", m.bandwidth_gbs, true);
  // the bf16 figures are newer: files without them read as none measured
  if (j.contains("bf16_gflops")) {
    get("bf16_gflops", m.bf16_gflops, true);
    get("amx_bf16_gflops", m.amx_bf16_gflops, false);
    get("avx512_bf16_gflops", m.avx512_bf16_gflops, false);
    if (!(m.amx_bf16_gflops >= 0) || !(m.avx512_bf16_gflops >= 0))
      throw Error("'amx_bf16_gflops' and 'avx512_bf16_gflops' must be 0 or more");
  }
  get("host", m.host, false);
  get("measured_at", m.measured_at, false);
  return m;
}

namespace {

// Holds an exclusive flock on a file for its lifetime (none when the file cannot be opened).
class FileLock {
 public:
  explicit FileLock(const std::string& path) : fd_(::open(path.c_str(), O_RDWR | O_CREAT, 0644)) {
    if (fd_ >= 0)
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // closing releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_;
};

}  // namespace

double age_seconds(const std::string& utc) {
  std::tm tm{};
  const char* end = strptime(utc.c_str(), "%Y-%m-%dT%H:%M:%SZ", &tm);
  if (end == nullptr || *end != '\0') return NAN;
  return std::difftime(std::time(nullptr), timegm(&tm));
}

MachineFigures machine_figures(const std::string& path, int threads, bool quick,
                               const KeepPolicy& keep) {
  if (path.empty()) return measure_machine(threads, quick);
  FileLock lock(path + ".lock");
  if (!lock.held())
    fmt::print(stderr, "attnbench: warning: cannot lock '{}.lock' ({}); measuring without it\n",
               path, std::strerror(errno));
  const std::string host = host_name(), model = cpu_model();
  std::error_code ec;
  if (!keep.remeasure && std::filesystem::exists(path, ec)) {
    std::ifstream f(path);
    nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
    try {
      MachineFigures m = machine_from_json(j);
      const double age = age_seconds(m.measured_at);
      if (m.host != host || m.cpu_model != model || m.threads != threads) {
        fmt::print(stderr,
                   "attnbench: '{}' holds figures of {} ({}, {} threads), not of {} ({}, {} "
                   "threads): measuring this machine and replacing them\n",
                   path, m.host, m.cpu_model, m.threads, host, model, threads);
      } else if (keep.max_age_s > 0 && !(age <= keep.max_age_s)) {
        fmt::print(stderr,
                   "attnbench: the machine figures in '{}' were measured {}: measuring again "
                   "and replacing them\n",
                   path,
                   std::isnan(age) ? fmt::format("at an unreadable time ('{}')", m.measured_at)
                                   : fmt::format("at {}, more than {:.0f} hours ago", m.measured_at,
                                                 keep.max_age_s / 3600));
      } else {
        m.source = fmt::format("read from {}", path);
        return m;
      }
    } catch (const Error& e) {
      fmt::print(stderr,
                 "attnbench: warning: '{}' is not a machine figures file ({}): measuring again "
                 "and replacing it\n",
                 path, e.what());
    }
  }
  MachineFigures m = measure_machine(threads, quick);
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  {
    std::ofstream out(tmp);
    out << to_json(m).dump(2) << "\n";
    out.close();
    if (!out) {
      fmt::print(stderr, "attnbench: warning: cannot write '{}'; the figures are not kept\n", tmp);
      std::filesystem::remove(tmp, ec);
      return m;
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    fmt::print(stderr, "attnbench: warning: cannot rename '{}' to '{}' ({}); not kept\n", tmp, path,
               ec.message());
    std::filesystem::remove(tmp, ec);
  } else {
    m.source = fmt::format("measured, kept in {}", path);
  }
  return m;
}

std::string machine_cache_dir() {
  if (const char* dir = std::getenv(kMachineDirVariable)) return dir;  // "" keeps none
  namespace fs = std::filesystem;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg == '/')
    return (fs::path(xdg) / "attnbench" / "machine").string();
  if (const char* home = std::getenv("HOME"); home && *home)
    return (fs::path(home) / ".cache" / "attnbench" / "machine").string();
  return "";
}

std::string kept_machine_file(int threads, bool quick) {
  const std::string dir = machine_cache_dir();
  if (dir.empty()) return "";
  // a sanitizer or debug build measures its own (slower) figures: kept apart
  const char* build = instrumented_build() ? "-sanitize" :
#ifdef NDEBUG
                                           "";
#else
                                           "-debug";
#endif
  return (std::filesystem::path(dir) / fmt::format("machine-{}-{}t{}{}.json", host_name(), threads,
                                                   quick ? "-quick" : "", build))
      .string();
}

MachineFigures kept_machine_figures(int threads, bool quick, bool remeasure) {
  const std::string path = kept_machine_file(threads, quick);
  if (path.empty()) return measure_machine(threads, quick);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  // (a failure to create it shows when the file is written)
  return machine_figures(path, threads, quick,
                         KeepPolicy{.max_age_s = kMachineMaxAgeSeconds, .remeasure = remeasure});
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
