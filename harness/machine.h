// Machine figures measured once per run: peak GEMM rate and memory bandwidth.
#pragma once

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

namespace attnbench {

struct MachineFigures {
  std::string cpu_model;
  int threads = 0;
  double gemm_gflops = 0;         ///< best single-precision GEMM rate seen (BLAS or Eigen)
  double blas_gflops = 0;         ///< OpenBLAS sgemm, square products
  double eigen_gflops = 0;        ///< Eigen's own GEMM, same sizes
  int gemm_size = 0;              ///< the square size that gave the best rate
  double amx_bf16_gflops = 0;     ///< AMX bf16 tile products, L1-resident (0: none usable)
  double avx512_bf16_gflops = 0;  ///< AVX512-BF16 VDPBF16PS in registers (0: none)
  /// The bf16 peak: the fastest of the two above and gemm_gflops (bf16 values multiply
  /// exactly in float32, so float32 GEMM is a bf16 product too). bf16 rows' gemm_fraction
  /// is their rate over it.
  double bf16_gflops = 0;
  double bandwidth_gbs = 0;         ///< STREAM-style triad a = b + s c, GB/s (3 arrays counted)
  std::string host;                 ///< the host that measured them (gethostname)
  std::string measured_at;          ///< when, UTC, ISO 8601
  std::string source = "measured";  ///< "measured", or "read from FILE" (machine_figures)
};

/// The peak a row of this precision is measured against: gemm_gflops for float32,
/// bf16_gflops for bf16 (gemm_gflops when the figures predate it).
double peak_gflops(const MachineFigures& m, bool bf16);

/// Measures GEMM (OpenBLAS and Eigen, square sizes 1024, 2048 and 4096 as time allows, best
/// of several), the bf16 instructions' peaks (common/kernels/bf16.h) and triad bandwidth with
/// `threads` threads, in a few seconds. `quick` uses fewer and smaller products (about a second in
/// all).
MachineFigures measure_machine(int threads, bool quick = false);

/// When figures kept in a file are read back: `max_age_s` > 0 measures again figures
/// measured longer ago than that (or at a time that cannot be read); `remeasure` always.
struct KeepPolicy {
  double max_age_s = 0;
  bool remeasure = false;
};

/// The figures of `threads` threads through a file shared by the processes of one sweep (the
/// shards of a cluster sweep): when `path` holds figures this host measured with this CPU
/// model and thread count, they are read back (source "read from PATH"); otherwise they are
/// measured and written there (a temporary file renamed into place). An exclusive lock on
/// PATH.lock (flock) is held meanwhile, so processes started together on one host measure
/// once, the first alone, while the others wait, then read. A file that cannot be read as
/// such figures is measured again and replaced, with a warning on stderr; one that cannot be
/// written leaves the measured figures in use, with a warning. An empty path measures. `quick`
/// as for measure_machine; `keep` says when figures that match are measured again anyway.
MachineFigures machine_figures(const std::string& path, int threads, bool quick = false,
                               const KeepPolicy& keep = {});

/// Seconds since `utc` (ISO 8601 as utc_now writes it), NaN when it cannot be read.
double age_seconds(const std::string& utc);

/// The environment variable naming the directory where run, layer and sweep keep the machine
/// figures they measure and read them back, instead of measuring the machine again in every
/// process; set and empty, nothing is kept (every process measures).
inline constexpr const char* kMachineDirVariable = "ATTNBENCH_MACHINE_DIR";
/// Kept figures older than this are measured again (a day).
inline constexpr double kMachineMaxAgeSeconds = 24 * 3600.0;

/// The directory of kept figures: kMachineDirVariable when set, else
/// $XDG_CACHE_HOME/attnbench/machine, else $HOME/.cache/attnbench/machine ("" when none).
std::string machine_cache_dir();
/// The file of kept figures for this host, thread count and kind (quick or full), in
/// machine_cache_dir(): machine-HOST-Nt[-quick][-sanitize|-debug].json (a sanitizer or debug
/// build measures its own); "" when figures are not kept.
std::string kept_machine_file(int threads, bool quick);

/// The figures a run, layer or sweep command measures its rows against: read from
/// kept_machine_file when it holds this host's figures of the last day (kMachineMaxAgeSeconds),
/// else measured and kept there (machine_figures); `remeasure` measures (and keeps) them anew.
/// Measured here when nothing is kept.
MachineFigures kept_machine_figures(int threads, bool quick = false, bool remeasure = false);

nlohmann::json to_json(const MachineFigures& m);
/// The figures to_json wrote; throws Error naming what is missing or malformed.
MachineFigures machine_from_json(const nlohmann::json& j);
/// This machine's host name (gethostname), or "unknown".
std::string host_name();
/// The time now, UTC, as ISO 8601 ("2026-01-31T12:00:00Z").
std::string utc_now();
/// "AMD EPYC ..." from /proc/cpuinfo, or "unknown".
std::string cpu_model();

}  // namespace attnbench

namespace attnbench {

/// The machine's 1-minute load average (getloadavg), NaN where it cannot be read.
double load_average();

/// CPU time the whole machine and this process have used, for the load of other processes
/// over an interval (Linux: /proc/stat and /proc/self/stat, in clock ticks).
struct CpuSample {
  double wall = 0;    ///< seconds (steady clock)
  double busy = NAN;  ///< CPU-seconds every processor spent outside idle and iowait
  double own = NAN;   ///< CPU-seconds of this process (user + system, every thread)
};
CpuSample sample_cpu();

/// Processors other processes kept busy between a and b: (busy - own) / wall. NaN when the
/// interval is shorter than kMinLoadInterval (the counters tick at 100 Hz, so a shorter one
/// cannot tell half a processor from none) or the counters cannot be read.
constexpr double kMinLoadInterval = 0.25;
double other_load(const CpuSample& a, const CpuSample& b);

}  // namespace attnbench
