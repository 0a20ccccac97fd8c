// Helpers shared by the attnbench tests: temporary directories, file I/O, running the CLI and
// comparing outputs with the exact reference.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/core/backward.h"
#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/core/tensor.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/patterns/pattern.h"
#include "common/reference/oracle.h"
#include "common/reference/reference.h"
#include "harness/results.h"

// The sanitizer build (ATTNBENCH_SANITIZE=ON defines ATTNBENCH_SANITIZE for the tests) cannot
// run two kinds of test, which skip themselves there with this macro and say why:
// - tests of the allocation counts: the counting hook (harness/memory_hook.cpp) steps aside
//   for AddressSanitizer's allocator and counts nothing;
// - death tests that cap the address space (RLIMIT_AS): AddressSanitizer reserves terabytes
//   of shadow memory up front.
#ifdef ATTNBENCH_SANITIZE
#define ATTNBENCH_SKIP_UNDER_SANITIZER(why) GTEST_SKIP() << "sanitizer build: " << why
#else
#define ATTNBENCH_SKIP_UNDER_SANITIZER(why) static_cast<void>(0)
#endif
/// Reason of the allocation-count tests.
#define ATTNBENCH_NO_HEAP_COUNTS \
  "the allocation hook steps aside for AddressSanitizer's allocator and counts nothing"

namespace attnbench::test {

/// x rounded to multiples of 2^-12: central differences with steps of 2^-12 (or finer powers
/// of two) then move such inputs exactly.
inline float on_grid(double x) { return float(std::nearbyint(x * 4096.0) / 4096.0); }

/// Uniform values in [lo, hi] of the shape `v` declares for its input `name` on p, from
/// `seed` (rounded on_grid when `grid`).
inline ExtraInput uniform_input(const Variant& v, const Problem& p, const std::string& name,
                                double lo, double hi, uint64_t seed, bool grid = false) {
  const InputSpec* spec = nullptr;
  for (const InputSpec* in : v.inputs())
    if (in->name == name) spec = in;
  EXPECT_NE(spec, nullptr) << v.spec() << " takes no " << name;
  ExtraInput t;
  if (!spec) return t;
  t.shape = v.input_shape(*spec, p);
  int64_t count = 1;
  for (int64_t s : t.shape) count *= s;
  const RandomStream rs(seed, 0x91e5);
  for (int64_t i = 0; i < count; ++i) {
    const double x = lo + (hi - lo) * rs.uniform(uint64_t(i));
    t.data.push_back(grid ? on_grid(x) : float(x));
  }
  return t;
}

/// One training step's tensors: dO drawn N(0, 1) from rng, the output of run_train and the
/// gradients of run_backward (those of the inputs p gives in dinputs).
struct TrainStep {
  Tensor dout, out, dq, dk, dv;
  InputGrads dinputs;
};
inline TrainStep train_step(Variant& var, const Problem& p, const Inputs& in,
                            std::mt19937_64& rng) {
  TrainStep s{Tensor(p.q_shape()), Tensor(p.q_shape()), Tensor(p.q_shape()),
              p.kv_tensor(),       p.kv_tensor(),       {}};
  std::normal_distribution<double> nd;
  for (int64_t i = 0; i < s.dout.numel(); ++i) s.dout.data()[i] = float(nd(rng));
  const auto saved = var.run_train(p, in.q.view(), in.k.view(), in.v.view(), s.out.view());
  const bool given = p.extra_inputs && !p.extra_inputs->empty();
  var.run_backward(p, in.q.view(), in.k.view(), in.v.view(), s.out.view(), s.dout.view(), *saved,
                   s.dq.view(), s.dk.view(), s.dv.view(), given ? &s.dinputs : nullptr);
  return s;
}

/// Row t of every (batch, head) of a [B, H, len, d] view as a [B, H, 1, d] view (strides and
/// grouping kept): one token for a decode step.
template <class T>
View4<T> row_view(View4<T> full, int64_t t) {
  View4<T> r = full;
  r.data = full.row(0, 0, t);
  r.shape.len = 1;
  return r;
}

/// A problem of B = b, H = h, n queries, m keys (0: m = n), head dimension d.
inline Problem problem(int64_t b, int64_t h, int64_t n, int64_t m, int64_t d, bool causal,
                       uint64_t seed = 1) {
  Problem p;
  p.batch = b, p.heads = h, p.n = n, p.m = m, p.dim = d, p.causal = causal, p.seed = seed;
  return p;
}

/// A causal self-attention problem with g key/value heads for the h query heads.
inline Problem causal_problem(int64_t b, int64_t h, int64_t g, int64_t n, int64_t d,
                              uint64_t seed) {
  Problem p = problem(b, h, n, 0, d, /*causal=*/true, seed);
  p.kv_heads = g;
  return p;
}

/// p under the scoring function `score` (hidden size `hidden`, 0 = d), with its seeded weights.
/// Expects a float gradient g of a loss L to match central differences of L. central(u)
/// returns (L(x + h u) - L(x - h u)) / 2h along u (g.numel() values). Every entry of g must be
/// finite; <g, u> along `directions` random +-1 directions must match within tol ||g||_2, and
/// `entries` random single entries (u = e_i) g_i within tol max |g|. Returns ||g||_2.
inline double expect_matches_differences(
    const Tensor& g, std::mt19937_64& rng, int directions, int entries, double tol,
    const std::function<double(const std::vector<double>&)>& central) {
  const int64_t count = g.numel();
  double norm = 0, top = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double x = g.data()[i];
    if (!std::isfinite(x)) {
      ADD_FAILURE() << "entry " << i << " of the gradient is " << x;
      return NAN;
    }
    norm += x * x, top = std::max(top, std::abs(x));
  }
  norm = std::sqrt(norm);
  std::vector<double> u(static_cast<size_t>(count));
  for (int t = 0; t < directions; ++t) {
    double dot = 0;
    for (int64_t i = 0; i < count; ++i) {
      u[size_t(i)] = (rng() & 1) ? 1.0 : -1.0;
      dot += u[size_t(i)] * double(g.data()[i]);
    }
    EXPECT_NEAR(dot, central(u), tol * norm) << "direction " << t << ", |grad| " << norm;
  }
  for (int t = 0; t < entries; ++t) {
    const int64_t e = int64_t(rng() % uint64_t(count));
    std::fill(u.begin(), u.end(), 0.0);
    u[size_t(e)] = 1.0;
    EXPECT_NEAR(double(g.data()[e]), central(u), tol * top) << "entry " << e;
  }
  return norm;
}

inline Problem with_score(Problem p, Score score, int64_t hidden = 0) {
  p.score = score, p.score_hidden = hidden;
  p.score_weights = make_score_weights(p);
  return p;
}

/// A seeded attention mask of shape [mb, mh, p.n, m] for p: additive values in [-1, 1] with
/// about a quarter of the entries -inf (bool = true: every entry 0 or -inf, a third masked),
/// and query row `empty_row` (if in range) masked wholly.
inline std::shared_ptr<const AttnMask> random_mask(const Problem& p, int64_t mb, int64_t mh,
                                                   bool is_bool, int64_t empty_row = -1) {
  auto a = std::make_shared<AttnMask>();
  a->batch = mb, a->heads = mh, a->n = p.n, a->m = p.keys(), a->is_bool = is_bool;
  a->bias.resize(size_t(mb * mh * p.n * p.keys()));
  uint64_t x = p.seed * 0x9e3779b97f4a7c15ULL + 1;
  for (float& e : a->bias) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const double u = double(x >> 11) * 0x1.0p-53;
    if (is_bool)
      e = u < 1.0 / 3 ? -INFINITY : 0.0f;
    else
      e = u < 0.25 ? -INFINITY : float(8 * u - 5);
  }
  if (empty_row >= 0 && empty_row < p.n)
    for (int64_t bh = 0; bh < mb * mh; ++bh)
      for (int64_t j = 0; j < p.keys(); ++j)
        a->bias[size_t((bh * p.n + empty_row) * p.keys() + j)] = -INFINITY;
  return a;
}

/// A workload drawing inputs from the named distribution (common/io/inputs.h), q scaled by
/// `scale`.
inline Workload workload(const std::string& input, double scale = 1.0) {
  Workload w;
  w.input = input, w.scale = scale;
  return w;
}

/// Sets the OpenMP thread count for a scope. Many small problems run faster on one thread:
/// with other processes on the machine every parallel region can wait milliseconds for a
/// descheduled thread.
class ScopedThreads {
 public:
  explicit ScopedThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ScopedThreads() { omp_set_num_threads(saved_); }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int saved_;
};

/// Builds the variant named by `spec` and runs it on p with the given inputs.
// Sets an environment variable for the scope, restoring what was there after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

inline Tensor run(const std::string& spec, const Problem& p, const Inputs& in) {
  auto v = make_variant(spec);
  Tensor out(p.q_shape());
  v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  return out;
}

/// Changing the values of tokens cut.. must leave the outputs of rows < cut bit-identical
/// under a causal mask (values are the only input that reaches a row only through attention).
inline void expect_later_values_never_reach_earlier_rows(const std::string& spec, Problem p,
                                                         int64_t cut) {
  Inputs in = generate_inputs(p);
  const Tensor before = test::run(spec, p, in);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t j = cut; j < p.n; ++j)
        for (int64_t x = 0; x < p.dim; ++x) in.v.view().row(b, h, j)[x] += 100.0f;
  const Tensor after = test::run(spec, p, in);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < cut; ++i)
        for (int64_t x = 0; x < p.dim; ++x)
          ASSERT_EQ(before.view().row(b, h, i)[x], after.view().row(b, h, i)[x])
              << spec << ": row " << i << " changed with later values";
}

/// Element (b, h, i, c) of a [B, H, len, d] tensor.
inline double at(const Tensor& t, int64_t b, int64_t h, int64_t i, int64_t c) {
  return t.view().row(b, h, i)[c];
}

/// Keys and values after position `after` (of every head of batch item 0) replaced by large
/// random values.
inline void perturb_after(const Problem& p, int64_t after, Tensor& k, Tensor& v) {
  RandomStream rs(uint64_t(after) + 17, 5);
  uint64_t x = 0;
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t j = after + 1; j < p.keys(); ++j)
      for (int64_t c = 0; c < p.dim; ++c) {
        k.view().row(0, h, j)[c] = float(30 * rs.normal(x++));
        v.view().row(0, h, j)[c] = float(1000 * rs.normal(x++));
      }
}

/// A copy of t.
inline Tensor copy(const Tensor& t) {
  Tensor c(t.shape());
  std::copy(t.data(), t.data() + t.numel(), c.data());
  return c;
}

/// Largest |difference| in row i of any head of batch item 0.
inline double row_diff(const Problem& p, const Tensor& a, const Tensor& b, int64_t i) {
  double diff = 0;
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t c = 0; c < p.dim; ++c)
      diff = std::max(diff, std::fabs(at(a, 0, h, i, c) - at(b, 0, h, i, c)));
  return diff;
}
/// What a variant must give on these inputs and how close: its oracle (VariantInfo::oracle;
/// for an exact variant, softmax attention restricted to its pattern) and the tolerance of its
/// error model (VariantInfo::tolerance, or the default of common/reference/oracle.h).
struct Expected {
  std::vector<double> out;
  double tolerance = 0;
};
/// `w` is the workload the inputs came from (its scale sets the size of the logits).
inline Expected expected(const Variant& v, const Problem& p, const Inputs& in,
                         const Workload& w = Workload{}) {
  const VariantInfo& info = v.info();
  Expected e;
  if (info.oracle && (p.score == Score::dot || p.score == Score::bilinear)) {
    // the approximation's own function on the mapped q (Variant::compute), whose logits are
    // sqrt(d) times larger for dot
    const Problem scaled = linear_score_problem(p);
    const Tensor mapped = linear_score_query(p, in.q.view());
    Workload ws = w;
    if (p.score == Score::dot) ws.scale *= std::sqrt(double(p.dim));
    e.out = info.oracle(v, scaled, mapped.view(), in.k.view(), in.v.view());
    e.tolerance = info.tolerance ? info.tolerance(v, scaled, ws) : attention_tolerance(p, w);
    return e;
  }
  if (info.oracle) {
    e.out = info.oracle(v, p, in.q.view(), in.k.view(), in.v.view());
  } else {
    // a data-dependent pattern (sinkhorn) is made from the q the variant sees: the mapped one
    // under dot and bilinear (the reference forms those logits itself)
    const bool linear = p.score == Score::dot || p.score == Score::bilinear;
    const Tensor mapped = linear ? linear_score_query(p, in.q.view()) : Tensor();
    auto pattern = linear ? v.make_pattern(linear_score_problem(p), mapped.view(), in.k.view())
                          : v.make_pattern(p, in.q.view(), in.k.view());
    e.out = reference_attention(p, in.q.view(), in.k.view(), in.v.view(), pattern.get());
  }
  e.tolerance = info.tolerance ? info.tolerance(v, p, w) : attention_tolerance(p, w);
  return e;
}
inline Expected expected(const std::string& spec, const Problem& p, const Inputs& in,
                         const Workload& w = Workload{}) {
  return expected(*make_variant(spec), p, in, w);
}

/// Runs `spec` on p and expects its output within its tolerance of its oracle; returns the
/// relative Frobenius error. `w` is the workload the inputs came from.
inline double expect_matches_oracle(const std::string& spec, const Problem& p, const Inputs& in,
                                    const Workload& w = Workload{});

/// An approximation that supports m != n but refuses causal masking says so in its
/// capabilities, and run() throws UnsupportedError on a causal problem.
inline void expect_refuses_causal(const std::string& spec) {
  SCOPED_TRACE(spec);
  auto v = make_variant(spec);
  EXPECT_FALSE(v->info().caps.causal);
  EXPECT_FALSE(v->info().caps.exact);
  EXPECT_TRUE(v->info().caps.cross);
  Problem p = problem(1, 2, 16, 16, 8, true);
  Inputs in = generate_inputs(p);
  Tensor out(p.q_shape());
  EXPECT_THROW(v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()), UnsupportedError);
}

/// Message of the exception of type E thrown by f, or "" (and a test failure) if f throws
/// nothing or something else.
template <class E, class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than the expected error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

/// A fresh directory under the system temp directory, removed (with its contents) on
/// destruction.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    std::random_device rd;
    const auto base = std::filesystem::temp_directory_path();
    for (int attempt = 0; attempt < 100; ++attempt) {
      auto p = base / ("attnbench_test_" + std::to_string(::getpid()) + "_" +
                       std::to_string(counter++) + "_" + std::to_string(rd()));
      if (std::filesystem::create_directory(p)) {
        path_ = p;
        return;
      }
    }
    throw std::runtime_error("cannot create a temporary directory");
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  /// Path of a file inside the directory.
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

/// A float32 array of `shape` holding v.
inline NpyArray float_npy(std::vector<int64_t> shape, const std::vector<float>& v) {
  NpyArray a;
  a.dtype = "<f4";
  a.shape = std::move(shape);
  a.data.resize(v.size() * sizeof(float));
  std::memcpy(a.data.data(), v.data(), a.data.size());
  return a;
}

/// The CSV line (with its newline) of fields[i] for each i of `keep`, in that order: a line of
/// a results file as an older layout without the other columns wrote it.
inline std::string csv_line_of(const std::vector<std::string>& fields,
                               const std::vector<size_t>& keep) {
  std::string line;
  for (size_t c : keep) {
    if (!line.empty()) line += ',';
    line += csv_quote(fields[c]);
  }
  return line + "\n";
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f.write(text.data(), std::streamsize(text.size()));
}

inline std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(line);
  return lines;
}

/// ||out - ref||_F / ||ref||_F (the plain norm of the difference if ref is all zeros).
inline double rel_fro_error(const float* out, const std::vector<double>& ref) {
  double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(out[i]) - ref[i];
    diff2 += d * d;
    ref2 += ref[i] * ref[i];
  }
  if (std::isnan(diff2)) return NAN;
  return ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
}

/// Least-squares slope of log(y) against log(x): the exponent of a power law y ~ x^slope.
inline double loglog_slope(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = double(x.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double lx = std::log(x[i]), ly = std::log(y[i]);
    sx += lx, sy += ly, sxx += lx * lx, sxy += lx * ly;
  }
  return (n * sxy - sx * sy) / (n * sxx - sx * sx);
}

inline double expect_matches_oracle(const std::string& spec, const Problem& p, const Inputs& in,
                                    const Workload& w) {
  const Tensor out = run(spec, p, in);
  const Expected e = expected(spec, p, in, w);
  const double err = rel_fro_error(out.data(), e.out);
  EXPECT_LE(err, e.tolerance) << spec;
  return err;
}

/// Every spec against its registered oracle and tolerance on small ragged shapes (B = H = 2),
/// causal and not, and with m != n if `cross`; prints the worst error in units of the tolerance.
inline void expect_registered_oracle_holds(const std::vector<std::string>& specs, bool cross) {
  for (const std::string& spec : specs) {
    double worst = 0;
    for (int64_t n : {1, 7, 60, 113})
      for (int64_t m : {1, 7, 60, 113})
        for (int64_t d : {1, 17, 64})
          for (bool causal : {false, true}) {
            if (m != n && !cross) continue;
            const Problem p = problem(2, 2, n, m, d, causal, uint64_t(n + 3 * m + d));
            SCOPED_TRACE(spec + " " + p.str());
            const Inputs in = generate_inputs(p);
            const Expected e = expected(spec, p, in);
            const double err = rel_fro_error(run(spec, p, in).data(), e.out);
            EXPECT_LE(err, e.tolerance);
            worst = std::max(worst, err / e.tolerance);
          }
    std::printf("[ oracle ] %-45s worst error %.3f of its tolerance\n", spec.c_str(), worst);
  }
}

/// The oracle of `spec` differs from `other` (what a plausible wrong variant would give) by far
/// more than its tolerance, so a comparison with the oracle can fail.
inline void expect_oracle_far_from(const std::string& spec, const Problem& p, const Inputs& in,
                                   const std::vector<double>& other) {
  const Expected e = expected(spec, p, in);
  const std::vector<float> oracle(e.out.begin(), e.out.end());
  EXPECT_GT(rel_fro_error(oracle.data(), other), 100 * e.tolerance) << spec;
}

/// `spec` on p (inputs from the problem's seed) matches exact attention within the default
/// error model: for a variant's settings that reduce it to full attention.
inline void expect_full_attention(const std::string& spec, const Problem& p) {
  SCOPED_TRACE(spec + " " + p.str());
  const Inputs in = generate_inputs(p);
  const auto ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
  EXPECT_LE(rel_fro_error(run(spec, p, in).data(), ref), attention_tolerance(p, Workload{}));
}

/// Result of one run of the attnbench binary.
/// Names of the registered variants, sorted: those linked in and those of the plugins in
/// ATTNBENCH_PLUGINS, which main() (test_main.cpp) loads before the parameterised tests are
/// enumerated. The values of the tests that range over every variant.
inline std::vector<std::string> variant_names() {
  std::vector<std::string> names;
  for (const VariantInfo* v : Registry::instance().all()) names.push_back(v->name);
  return names;
}

/// A variant spec as a test name suffix (letters, digits and '_'), e.g. AllVariants/.../full,
/// so that `--gtest_filter='*/NAME'` selects a variant's cases.
inline std::string spec_test_name(const testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

struct CliResult {
  int code = -1;  ///< exit status, or -1 if it did not exit normally
  std::string out, err;
};

/// Runs ATTNBENCH_BIN with `args` (already shell-quoted), capturing stdout and stderr in files
/// of `dir`.
inline CliResult run_cli(const std::string& args, const TempDir& dir) {
  static std::atomic<int> counter{0};
  const int id = counter++;
  const std::string out = dir.file("cli_" + std::to_string(id) + ".out"),
                    err = dir.file("cli_" + std::to_string(id) + ".err");
  const std::string cmd =
      std::string("'") + ATTNBENCH_BIN + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

}  // namespace attnbench::test

namespace attnbench::test {

/// Predicate-formatter for EXPECT_CONTAINS: passes if `needle` occurs in `haystack`.
inline testing::AssertionResult contains_format(const char* hay_expr, const char* needle_expr,
                                                const std::string& haystack,
                                                const std::string& needle) {
  if (haystack.find(needle) != std::string::npos) return testing::AssertionSuccess();
  return testing::AssertionFailure() << hay_expr << " does not contain " << needle_expr
                                     << "\n  text:   " << haystack << "\n  wanted: " << needle;
}

}  // namespace attnbench::test

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_PRED_FORMAT2(::attnbench::test::contains_format, haystack, needle)
