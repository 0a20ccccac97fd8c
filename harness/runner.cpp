#include "harness/runner.h"

#include <benchmark/benchmark.h>
#include <cblas.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "common/core/checked.h"
#include "common/core/error.h"
#include "common/core/phase.h"
#include "common/io/inputs.h"
#include "common/io/trained.h"
#include "common/kernels/bf16.h"
#include "common/patterns/pattern.h"
#include "harness/memory.h"

namespace attnbench {

namespace {

// Forwards everything to a JSONReporter writing into a string, and keeps the per-repetition
// runs for the row's statistics.
class CaptureReporter : public benchmark::BenchmarkReporter {
 public:
  CaptureReporter() {
    json_.SetOutputStream(&json_text_);
    json_.SetErrorStream(&json_text_);
  }
  bool ReportContext(const Context& c) override { return json_.ReportContext(c); }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      if (r.error_occurred) error_ = r.error_message;
      if (r.run_type != Run::RT_Iteration || r.error_occurred) continue;
      times_.push_back(r.real_accumulated_time / double(r.iterations));
      iterations_ = r.iterations;
    }
    json_.ReportRuns(runs);
  }
  void Finalize() override { json_.Finalize(); }

  std::vector<double> times_;
  int64_t iterations_ = 0;
  std::string error_;
  std::ostringstream json_text_;

 private:
  benchmark::JSONReporter json_;
};

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// Index of the first non-finite value, or -1.
int64_t first_non_finite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(t.data()[i])) return i;
  return -1;
}

// Sums the wall time of each phase the variant marks, over every thread that runs one. It
// never allocates (the timed passes' heap peak is measured around it): up to kSlots names.
class PhaseTimes final : public PhaseSink {
 public:
  static constexpr size_t kSlots = 16;

  double begin(const char*) override { return omp_get_wtime(); }
  void end(const char* name, double mark) override {
    const double seconds = omp_get_wtime() - mark;
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < kSlots; ++i) {
      if (names_[i] == nullptr) names_[i] = name;
      if (std::strcmp(names_[i], name) == 0) {
        seconds_[i] += seconds;
        return;
      }
    }
    overflow_ = name;
  }
  /// Throws std::runtime_error if the variant marked more than kSlots phase names.
  void check() const {
    if (overflow_)
      throw std::runtime_error(fmt::format(
          "the variant marks more than {} phase names (the last: '{}'); at most {} are accepted",
          kSlots, overflow_, kSlots));
  }
  /// The sums, each divided by `passes`.
  std::map<std::string, double> per_pass(int64_t passes) const {
    std::map<std::string, double> out;
    for (size_t i = 0; i < kSlots && names_[i]; ++i)
      out[names_[i]] = passes > 0 ? seconds_[i] / double(passes) : 0.0;
    return out;
  }

 private:
  std::mutex mutex_;
  const char* names_[kSlots] = {};
  double seconds_[kSlots] = {};
  const char* overflow_ = nullptr;
};

// Installs a phase sink for a scope and restores the previous one.
class InstallPhaseSink {
 public:
  explicit InstallPhaseSink(PhaseSink* sink) : previous_(set_phase_sink(sink)) {}
  ~InstallPhaseSink() { set_phase_sink(previous_); }
  InstallPhaseSink(const InstallPhaseSink&) = delete;
  InstallPhaseSink& operator=(const InstallPhaseSink&) = delete;

 private:
  PhaseSink* previous_;
};

std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / double(1 << 30)); }

}  // namespace

// Google Benchmark's JSON, with the non-finite numbers its reporter writes as bare NaN or
// inf (e.g. the coefficient of variation of a counter that is 0 in every repetition) turned
// into null: JSON has no such literals, and a results file holds no figure that is not one.
nlohmann::json parse_benchmark_json(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size())
        out += text[++i];
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '-' || c == 'N' || c == 'n' || c == 'i' || c == 'I') {
      bool replaced = false;
      for (const char* word :
           {"-Infinity", "Infinity", "-NaN", "NaN", "-nan", "nan", "-inf", "inf"})
        if (text.compare(i, std::strlen(word), word) == 0) {
          out += "null";
          i += std::strlen(word) - 1;
          replaced = true;
          break;
        }
      if (replaced) continue;
    }
    out += c;
  }
  return nlohmann::json::parse(out);
}

double available_memory() { return double(available_memory_bytes()); }

bool time_passes(const std::string& name, const RunOptions& opt, const MachineFigures& mf,
                 const std::function<void()>& pass, Row& row, nlohmann::json* bench_json,
                 const std::function<void()>& before_run, int64_t iterations) {
  // Timed passes by Google Benchmark. The peak heap above the level at the start of each
  // run is measured here (no MemoryManager: see PeakScope) and reported as the run's
  // `peak_bytes` counter; the row keeps the largest.
  double peak = 0;
  PhaseTimes phase_times;  // of every timed pass
  int64_t passes = 0;
  row.load_avg = load_average();
  const CpuSample cpu_start = sample_cpu();
  auto* bm = benchmark::RegisterBenchmark(name.c_str(), [&](benchmark::State& st) {
    PeakScope scope;
    if (before_run) before_run();
    {
      InstallPhaseSink sink(&phase_times);
      for (auto _ : st) {
        pass();
        benchmark::ClobberMemory();
      }
    }
    passes += int64_t(st.iterations());
    const double run_peak = double(scope.peak_bytes());
    peak = std::max(peak, run_peak);
    st.counters["FLOPS"] =
        benchmark::Counter(row.flops, benchmark::Counter::kIsIterationInvariantRate);
    if (heap_counting()) st.counters["peak_bytes"] = benchmark::Counter(run_peak);
  });
  bm->Repetitions(std::max(1, opt.reps));
  // Google Benchmark requires a positive MinTime; 0 means one pass per repetition.
  if (iterations > 0)
    bm->Iterations(iterations);
  else if (opt.min_time > 0)
    bm->MinTime(opt.min_time);
  else
    bm->Iterations(1);
  bm->UseRealTime()->Unit(benchmark::kMillisecond)->Threads(1);
  CaptureReporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  benchmark::ClearRegisteredBenchmarks();
  row.other_load = other_load(cpu_start, sample_cpu());
  if (!rep.error_.empty() || rep.times_.empty()) {
    row.status = "error";
    row.message = rep.error_.empty() ? "benchmark produced no runs" : rep.error_;
    return false;
  }
  if (bench_json) *bench_json = parse_benchmark_json(rep.json_text_.str());
  auto& t = rep.times_;
  row.reps = int(t.size());
  row.iterations = rep.iterations_;
  row.time_median = median(t);
  row.time_min = *std::min_element(t.begin(), t.end());
  row.time_max = *std::max_element(t.begin(), t.end());
  double mean = 0, var = 0;
  for (double x : t) mean += x / double(t.size());
  for (double x : t) var += (x - mean) * (x - mean);
  row.time_stddev = t.size() > 1 ? std::sqrt(var / double(t.size() - 1)) : 0.0;
  row.time_spread = row.time_min > 0 ? row.time_max / row.time_min : NAN;
  row.noisy = !noise_reason(row).empty();
  row.gflops = row.flops / row.time_median / 1e9;
  // the share of the peak of the row's precision
  const double rate = peak_gflops(mf, row.problem.dtype == DType::bf16);
  row.gemm_fraction = rate > 0 ? row.gflops / rate : NAN;
  row.peak_bytes = heap_counting() ? peak : NAN;  // never a figure that was not measured
  phase_times.check();
  row.phases = phase_times.per_pass(passes);
  return true;
}

std::string noise_reason(const Row& row, int processors) {
  if (row.status != "ok") return "";
  std::string why;
  if (row.reps >= 2 && row.time_spread > kNoisySpread)
    why = fmt::format("its {} repetitions spread {:.2f}x (max/min; threshold {})", row.reps,
                      row.time_spread, kNoisySpread);
  const double free = std::max(0, processors - row.workload.threads);
  if (row.other_load > free + kNoisyLoadMargin)
    why += fmt::format(
        "{}other processes kept {:.1f} processors busy while it ran ({} threads on {} "
        "processors leave {} free; threshold {} above that; load average {:.2f})",
        why.empty() ? "" : "; ", row.other_load, row.workload.threads, processors, free,
        kNoisyLoadMargin, row.load_avg);
  return why;
}

std::string noise_reason(const Row& row) { return noise_reason(row, omp_get_num_procs()); }

void check_run_options(const RunOptions& opt) {
  if (!(opt.min_time >= 0 && opt.min_time <= 3600) || opt.reps < 1)
    throw UsageError(
        fmt::format("run options: reps {} and min_time {} s; accepted: reps >= 1 "
                    "and min_time in [0, 3600]",
                    opt.reps, opt.min_time));
}

std::string too_large(double need, double estimate, const RunOptions& opt) {
  const double limit = opt.memory_limit > 0 ? opt.memory_limit : 0.8 * available_memory();
  if (need <= limit) return "";
  return fmt::format(
      "needs about {} (inputs, output and the variant's estimate of {}), "
      "more than the {} allowed",
      gib(need), gib(estimate), gib(limit));
}

void record_failure(Row& row, const std::exception& e) {
  const bool unsupported = dynamic_cast<const UnsupportedError*>(&e) != nullptr;
  row.status = unsupported ? "unsupported" : "error";
  row.message = dynamic_cast<const std::bad_alloc*>(&e) ? "out of memory" : e.what();
}

bool prepare_variant(Variant& variant, const Problem& p, Row& row) {
  const double t0 = omp_get_wtime();
  if (!variant.prepare(p)) return false;
  row.prepare_seconds = omp_get_wtime() - t0;
  return true;
}

int64_t decode_timed_steps(int64_t n) { return std::clamp<int64_t>(n / 64, 8, 64); }
int64_t decode_checked_steps(int64_t n) { return std::min<int64_t>(n, 8); }

namespace {

/// Row t of x as a [B, H, 1, d] view (x's strides kept).
template <class T>
View4<T> token(View4<T> x, int64_t t) {
  x.data = x.row(0, 0, t);
  x.shape.len = 1;
  return x;
}

}  // namespace

ExtraInputs token_inputs(const Variant& variant, const Problem& p, int64_t t) {
  ExtraInputs out;
  if (!p.extra_inputs) return out;
  for (const auto& entry : *p.extra_inputs) {
    const InputSpec& in = *variant.taken_input(p, entry.first);
    const ExtraInput& x = entry.second;
    const size_t axis =
        size_t(std::find_if(in.dims.begin(), in.dims.end(),
                            [](const std::string& a) { return a == "n" || a == "m"; }) -
               in.dims.begin());
    int64_t outer = 1, inner = 1;  // elements before and after the token axis
    for (size_t i = 0; i < axis; ++i) outer *= x.shape[i];
    for (size_t i = axis + 1; i < x.shape.size(); ++i) inner *= x.shape[i];
    const int64_t len = x.shape[axis];
    ExtraInput row{x.shape, std::vector<float>(size_t(outer * inner))};
    row.shape[axis] = 1;
    for (int64_t o = 0; o < outer; ++o)
      std::copy_n(x.data.data() + (o * len + t) * inner, inner, row.data.data() + o * inner);
    out.emplace(entry.first, std::move(row));
  }
  return out;
}

namespace {

/// The decode pass of run_one (see runner.h). Returns false when the row ended in an error.
bool decode_row(Variant& variant, const Problem& p, const Inputs& in, const MachineFigures& mf,
                const RunOptions& opt, const std::string& name, Tensor& out, Row& row,
                nlohmann::json* bench_json) {
  Decoder& dec = *variant.decoder();
  const ConstTensorView q = in.q.view(), k = in.k.view(), v = in.v.view();
  const int64_t n = p.n, t0 = n - decode_checked_steps(n);
  // Checked pass: prefill t0 tokens, generate the rest; the rows before t0 stay 0 and are not
  // compared.
  std::fill(out.data(), out.data() + out.numel(), 0.0f);
  // the given inputs (if any) reach the prefill through p and each step as its token's row
  const bool given = p.extra_inputs && !p.extra_inputs->empty();
  {
    std::unique_ptr<DecodeState> st = dec.prefill(p, k, v, t0);
    for (int64_t t = t0; t < n; ++t)
      if (given)
        st->step_given(token(q, t), token(k, t), token(v, t), token_inputs(variant, p, t),
                       token(out.view(), t));
      else
        st->step(token(q, t), token(k, t), token(v, t), token(out.view(), t));
  }
  if (int64_t bad = first_non_finite(out); bad >= 0) {
    row.status = "error";
    row.message =
        fmt::format("a decode step's output holds a non-finite value ({}) at flat index {}",
                    out.data()[bad], bad);
    return false;
  }
  std::vector<std::vector<int64_t>> rows(size_t(p.batch * p.heads));
  for (auto& r : rows)
    for (int64_t t = t0; t < n; ++t) r.push_back(t);
  auto pattern = variant.make_pattern(p, q, k);
  const double e0 = omp_get_wtime();
  row.error = measure_error_on_rows(p, q, k, v, out.view(), rows, opt.exact_limit, pattern.get());
  row.error_seconds = omp_get_wtime() - e0;
  pattern.reset();

  // Timed steps: each repetition prefills n tokens into a state with room for the steps, then
  // runs them at contexts n, n + 1, ..., fed with rows 0, 1, ... of the inputs again. Those
  // rows are gathered first into tensors of `steps` positions, as a model hands a step the
  // fresh q, k and v of one token: read from [B, H, n, d] inputs, the rows of a step sit
  // n d floats apart from head to head, and their TLB and cache misses would grow with n.
  const int64_t steps = decode_timed_steps(n);
  Tensor sq(Shape4{p.batch, p.heads, steps, p.dim});
  Tensor sk(Shape4{p.batch, p.kv_head_count(), steps, p.dim}, p.kv_group());
  Tensor sv(Shape4{p.batch, p.kv_head_count(), steps, p.dim}, p.kv_group());
  for (auto [from, to] : {std::pair{q, &sq}, {k, &sk}, {v, &sv}}) {
    const TensorView dst = to->view();
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; h += from.group)
        for (int64_t s = 0; s < steps; ++s)
          std::copy(from.row(b, h, s % n), from.row(b, h, s % n) + p.dim, dst.row(b, h, s));
  }
  std::vector<ExtraInputs> step_inputs;
  if (given)
    for (int64_t s = 0; s < steps; ++s) step_inputs.push_back(token_inputs(variant, p, s % n));
  Problem pt = p;
  pt.n = n + steps;
  pt.m = 0;
  std::unique_ptr<DecodeState> st;
  std::vector<double> prefill_times;
  int64_t next = 0;
  Tensor step_out(Shape4{p.batch, p.heads, 1, p.dim});
  auto prefill = [&] {
    st.reset();
    const double a = omp_get_wtime();
    st = dec.prefill(pt, k, v, n);
    prefill_times.push_back(omp_get_wtime() - a);
    next = 0;
  };
  prefill();  // the figures of the state at context n; then released, so that each timed
              // repetition's heap peak holds its own state
  row.state_bytes = st->state_bytes();
  row.bytes_read_per_step = st->step_bytes_read();
  row.flops = st->step_flops();
  st.reset();
  prefill_times.clear();
  auto step = [&] {
    const int64_t s = next++ % steps;
    if (given)
      st->step_given(token(sq.view(), s), token(sk.view(), s), token(sv.view(), s),
                     step_inputs[size_t(s)], step_out.view());
    else
      st->step(token(sq.view(), s), token(sk.view(), s), token(sv.view(), s), step_out.view());
  };
  if (!time_passes(name, opt, mf, step, row, bench_json, prefill, steps)) return false;
  st.reset();
  row.prefill_seconds = median(prefill_times);
  row.time_per_token = row.time_median;
  row.tokens_per_s = double(p.batch) / row.time_median;
  if (mf.bandwidth_gbs > 0)
    row.bandwidth_fraction = row.bytes_read_per_step / row.time_median / (mf.bandwidth_gbs * 1e9);
  return true;
}

/// What a workload's pass asks of the variant and the harness.
struct PassKind {
  bool decode;  // --pass decode
  bool train;   // --pass bwd or fwdbwd
  bool bf16;    // --dtype bf16
};

/// FLOPs of what is timed: the forward, the backward alone, or both.
double pass_flops(Variant& variant, const Problem& p, const Workload& w, Backward* bw,
                  const PassKind& kind) {
  if (!kind.train) return variant.flops(p);
  return (w.pass == "bwd" ? 0.0 : variant.flops(p)) + bw->backward_flops(p);
}

/// The row's FLOPs and memory estimates of what is timed (the backward's peak excludes the
/// saved state, allocated before its timed passes; both together hold it throughout).
void fill_estimates(Variant& variant, const Problem& p, const Workload& w, Backward* bw,
                    const PassKind& kind, Row& row) {
  // decode: the state's figure, once built
  row.flops = kind.decode ? NAN : pass_flops(variant, p, w, bw, kind);
  row.saved_estimate_bytes = kind.train ? bw->saved_estimate(p) : NAN;
  if (kind.decode)  // no estimate of a state's working memory; the memory check bounds the state
    row.estimated_bytes = NAN;
  else if (!kind.train)
    row.estimated_bytes = variant.memory_estimate(p);
  else if (w.pass == "bwd")
    row.estimated_bytes = bw->backward_memory_estimate(p);
  else
    row.estimated_bytes = row.saved_estimate_bytes +
                          std::max(variant.memory_estimate(p), bw->backward_memory_estimate(p));
}

/// Bytes the row needs: the variant's estimate (or a decode state's bound), the inputs and
/// output unless given, the training buffers, the bf16 copies and the error measure's.
double memory_need(const Problem& p, const Row& row, bool given, const PassKind& kind,
                   const RunOptions& opt) {
  const double io_bytes = double(p.q_shape().numel() * 2 + p.kv_storage_shape().numel() * 2) * 4;
  // training: dO, dQ, dK, dV, the saved state, and the float64 gradients of one head
  const double train_bytes =
      kind.train
          ? double(p.q_shape().numel() * 2 + p.kv_storage_shape().numel() * 2) * 4 +
                // grouped key/value heads: the per-head gradients of k and v, summed by group
                (p.kv_group() > 1 ? double(p.kv_shape().numel() * 2) * 4 : 0.0) +
                row.saved_estimate_bytes + grad_error_memory_estimate(p)
          : 0.0;
  // decode: a state as large as a KV cache of every timed position, at most
  const double decode_bytes =
      kind.decode
          ? 8.0 * double(p.batch * p.heads) * double(p.n + decode_timed_steps(p.n)) * double(p.dim)
          : 0.0;
  // bf16: the rounded copies of q, k and v, and the float32 path's output on them
  const double bf16_bytes =
      kind.bf16 ? double(p.q_shape().numel() * 2 + p.kv_storage_shape().numel() * 2) * 4 : 0.0;
  return (kind.decode ? decode_bytes : row.estimated_bytes) + (given ? 0 : io_bytes) + train_bytes +
         bf16_bytes + error_memory_estimate(p, opt.exact_limit);
}

/// A row's inputs: `exact` the given or generated ones, `in` what the variant computes on.
/// bf16: `in` holds q, k and v rounded to bfloat16; the error is measured against the float64
/// reference on the unrounded inputs (`exact`), the float32 problem.
struct RowInputs {
  RowInputs(const Inputs* given, const Problem& p, const Workload& w, bool bf16) {
    if (!given) generated = generate_inputs(p, w);
    exact = given ? given : &generated;
    if (bf16) {
      rounded.q = rounded_bf16(exact->q);
      rounded.k = rounded_bf16(exact->k);
      rounded.v = rounded_bf16(exact->v);
    }
    in = bf16 ? &rounded : exact;
  }
  RowInputs(const RowInputs&) = delete;
  RowInputs& operator=(const RowInputs&) = delete;

  Inputs generated, rounded;
  const Inputs* exact = nullptr;
  const Inputs* in = nullptr;
};

/// The checked forward pass of a fwd, bwd or fwdbwd row: its output (out) is what the error
/// is measured on; a training row's forward keeps its state in `saved`. Returns false when the
/// row ended in an error.
bool checked_forward(Variant& variant, const Problem& p, const RowInputs& inputs,
                     const RunOptions& opt, const PassKind& kind, Tensor& out,
                     std::unique_ptr<SavedState>& saved, Row& row) {
  const Inputs& exact_in = *inputs.exact;
  const Inputs& in = *inputs.in;
  Problem p32 = p;
  p32.dtype = DType::f32;
  if (!kind.train) {
    variant.run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
  } else {
    // twice: the first call may leave allocations of its own behind (thread teams, BLAS
    // buffers); what the second holds after it returns is the saved state
    variant.run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view()).reset();
    const int64_t before = heap_current_bytes();
    saved = variant.run_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
    if (heap_counting()) row.saved_bytes = double(heap_current_bytes() - before);
  }
  if (int64_t bad = first_non_finite(out); bad >= 0) {
    row.status = "error";
    row.message =
        fmt::format("output holds a non-finite value ({}) at flat index {}", out.data()[bad], bad);
    return false;
  }
  auto pattern = variant.make_pattern(p, in.q.view(), in.k.view());
  const double e0 = omp_get_wtime();
  row.error = measure_error(p32, exact_in.q.view(), exact_in.k.view(), exact_in.v.view(),
                            out.view(), opt.exact_limit, pattern.get());
  row.error_seconds = omp_get_wtime() - e0;
  pattern.reset();
  if (kind.bf16) {
    // the variant's float32 path on the same rounded inputs: the error of the rounding
    // alone (checked before the bf16 row's timed passes, so they run after it)
    Tensor out32(p.q_shape());
    variant.run(p32, in.q.view(), in.k.view(), in.v.view(), out32.view());
    row.rounded_input_error = measure_error(p32, exact_in.q.view(), exact_in.k.view(),
                                            exact_in.v.view(), out32.view(), opt.exact_limit)
                                  .rel_fro;
  }
  return true;
}

/// The timed passes of a bwd or fwdbwd row after its checked forward: the checked backward
/// (non-finite check, gradient error), then the timed passes. grad_note: why the gradient error
/// was not measured, if it was not; grads, if given, receives dq, dk, dv. Returns false when
/// the row ended in an error.
bool train_row(Variant& variant, const Problem& p, const Workload& w, const Inputs& in,
               const MachineFigures& mf, const RunOptions& opt, const std::string& name,
               Tensor& out, std::unique_ptr<SavedState>& saved, Row& row,
               nlohmann::json* bench_json, Gradients* grads, std::string& grad_note) {
  Tensor generated_dout;
  if (in.dout.numel() == 0) generated_dout = generate_dout(p);
  const ConstTensorView dout =
      in.dout.numel() ? in.dout.view() : ConstTensorView(generated_dout.view());
  Tensor dq(p.q_shape()), dk = p.kv_tensor(), dv = p.kv_tensor();
  // the gradients of the inputs beyond q, k and v the problem gives, if any
  InputGrads dinputs;
  InputGrads* di = p.extra_inputs && !p.extra_inputs->empty() ? &dinputs : nullptr;
  variant.run_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout, *saved,
                       dq.view(), dk.view(), dv.view(), di);
  for (const auto* t : {&dq, &dk, &dv})
    if (int64_t bad = first_non_finite(*t); bad >= 0) {
      row.status = "error";
      row.message = fmt::format("{} holds a non-finite value ({}) at flat index {}",
                                t == &dq ? "dq" : (t == &dk ? "dk" : "dv"), t->data()[bad], bad);
      return false;
    }
  for (const auto& [name, g] : dinputs)
    for (size_t i = 0; i < g.size(); ++i)
      if (!std::isfinite(g[i])) {
        row.status = "error";
        row.message = fmt::format(
            "the gradient of the input {} holds a non-finite value ({}) at "
            "flat index {}",
            name, g[i], i);
        return false;
      }
  const double g0 = omp_get_wtime();
  const GradErrorStats ge = measure_grad_error(p, in.q.view(), in.k.view(), in.v.view(), dout,
                                               dq.view(), dk.view(), dv.view(), opt.exact_limit);
  row.error_seconds += omp_get_wtime() - g0;
  row.grad_err_q = ge.q, row.grad_err_k = ge.k, row.grad_err_v = ge.v;
  row.grad_heads = ge.heads;
  std::function<void()> pass;
  if (w.pass == "bwd")
    pass = [&] {
      variant.compute_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout, *saved,
                               dq.view(), dk.view(), dv.view(), di);
    };
  else
    pass = [&] {
      saved.reset();  // each pass builds its own state
      saved = variant.compute_train(p, in.q.view(), in.k.view(), in.v.view(), out.view());
      variant.compute_backward(p, in.q.view(), in.k.view(), in.v.view(), out.view(), dout, *saved,
                               dq.view(), dk.view(), dv.view(), di);
    };
  if (w.pass == "fwdbwd") saved.reset();
  if (!time_passes(name, opt, mf, pass, row, bench_json)) return false;
  if (ge.heads == 0)
    grad_note = fmt::format(
        "gradient error not measured: one head holds {} query-key pairs, above the {} "
        "compared in float64",
        double(p.n) * double(p.keys()), opt.exact_limit);
  if (grads) *grads = Gradients{std::move(dq), std::move(dk), std::move(dv), std::move(dinputs)};
  return true;
}

/// The row's notes: the variant's (of the last timed pass), masked rows without keys, the
/// gradient note and the trained inputs' context.
void add_notes(Row& row, const Variant& variant, const Problem& p, const Workload& w,
               const std::string& grad_note) {
  row.notes = variant.notes();
  if (!p.unmasked())
    if (const int64_t empty = p.rows_without_keys(); empty > 0)
      row.notes += fmt::format("{}{} masked rows without keys (output 0)",
                               row.notes.empty() ? "" : "; ", empty);
  if (!grad_note.empty()) row.notes += (row.notes.empty() ? "" : "; ") + grad_note;
  if (const std::string beyond = trained_context_note(p, w.input); !beyond.empty())
    row.notes += (row.notes.empty() ? "" : "; ") + beyond;
  if (!row.stand_ins.empty())
    row.notes += (row.notes.empty() ? "" : "; ") +
                 fmt::format("stand-ins for its learned inputs: {}", row.stand_ins);
}

}  // namespace

Row run_one(Variant& variant, const Problem& p, const Workload& w, const Inputs* given,
            const MachineFigures& mf, const RunOptions& opt, Tensor* output,
            nlohmann::json* bench_json, Gradients* grads) {
  Row row;
  row.problem = p;
  row.workload = w;
  // Every call into the variant below runs on this team; the count is decided here only.
  std::optional<ThreadTeam> team;
  // One try around everything a variant or the problem can throw from, estimates and the
  // memory guard included: a failure is the row's status, never an exception.
  try {
    row.spec = variant.spec();
    row.variant = variant.info().name;
    row.input_source = input_source(w.input);  // refused and skipped rows name it too
    row.stand_ins = fmt::format("{}", fmt::join(variant.stand_ins(p), "+"));
    check_run_options(opt);
    row.workload.threads = resolve_threads(w.threads);
    team.emplace(row.workload.threads);
    p.validate();
    w.validate(p);
    variant.check_supported(p);
    const PassKind kind{w.pass == "decode", w.pass == "bwd" || w.pass == "fwdbwd",
                        p.dtype == DType::bf16};
    if (kind.train) variant.check_backward(p);
    if (kind.decode) variant.check_decode(p);
    Backward* bw = kind.train ? variant.backward() : nullptr;
    fill_estimates(variant, p, w, bw, kind, row);
    // Refuse what cannot fit rather than meet the OOM killer.
    const double need = memory_need(p, row, given != nullptr, kind, opt);
    if (std::string why = too_large(need, row.estimated_bytes, opt); !why.empty()) {
      row.status = "skipped";
      row.message = why;
      return row;
    }

    // the per-pass work of a prepared variant leaves its draws out
    if (prepare_variant(variant, p, row) && !kind.decode)
      row.flops = pass_flops(variant, p, w, bw, kind);

    const RowInputs inputs(given, p, w, kind.bf16);
    const Inputs& in = *inputs.in;
    Tensor out(p.q_shape());
    const std::string name = fmt::format("{}/{}", row.spec, describe(p, w));
    std::string grad_note;
    if (opt.stage) opt.stage("checked");
    if (kind.decode) {
      if (!decode_row(variant, p, in, mf, opt, name, out, row, bench_json)) return row;
    } else {
      std::unique_ptr<SavedState> saved;
      if (!checked_forward(variant, p, inputs, opt, kind, out, saved, row)) return row;
      if (opt.stage) opt.stage("timed");
      if (!kind.train) {
        if (!time_passes(
                name, opt, mf,
                [&] { variant.compute(p, in.q.view(), in.k.view(), in.v.view(), out.view()); }, row,
                bench_json))
          return row;
      } else if (!train_row(variant, p, w, in, mf, opt, name, out, saved, row, bench_json, grads,
                            grad_note)) {
        return row;
      }
    }
    add_notes(row, variant, p, w, grad_note);
    if (output) *output = std::move(out);
  } catch (const std::exception& e) {
    record_failure(row, e);
  }
  return row;
}

std::string phases_text(const std::map<std::string, double>& phases) {
  if (phases.empty()) return "";
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [name, seconds] : phases) j[name] = seconds;
  return j.dump();
}

nlohmann::ordered_json to_json(const Row& r) {
  using J = nlohmann::ordered_json;
  auto num = [](double x) -> J { return std::isfinite(x) ? J(x) : J(); };
  const Problem& p = r.problem;
  const Workload& w = r.workload;
  const std::optional<int64_t> layer = trained_layer(w.input);
  const std::string source = !r.input_source.empty() ? r.input_source
                             : w.input == "file"     ? "file"
                             : layer                 ? "trained"
                                                     : "generated";
  return J{{"spec", r.spec},
           {"variant", r.variant},
           {"batch", p.batch},
           {"heads", p.heads},
           {"kv_heads", p.kv_head_count()},
           {"n", p.n},
           {"m", p.keys()},
           {"dim", p.dim},
           {"embed", r.embed},
           {"causal", p.causal},
           {"score", std::string(score_name(p.score))},
           {"score_hidden", p.score == Score::additive ? p.hidden() : 0},
           {"input", w.input},
           {"input_layer", layer ? J(*layer) : J()},
           {"input_source", source},
           {"scale", w.scale},
           {"seed", p.seed},
           {"threads", w.threads},
           {"key_padding", key_padding_text(p)},
           {"attn_mask", p.attn_mask ? p.attn_mask->name : std::string()},
           {"pass", w.pass},
           {"dtype", std::string(dtype_name(p.dtype))},
           {"status", r.status},
           {"message", r.message},
           {"time_median_s", num(r.time_median)},
           {"time_min_s", num(r.time_min)},
           {"time_max_s", num(r.time_max)},
           {"time_stddev_s", num(r.time_stddev)},
           {"time_spread", num(r.time_spread)},
           {"load_avg", num(r.load_avg)},
           {"other_load", num(r.other_load)},
           {"noisy", r.noisy},
           {"reps", r.reps},
           {"iterations", r.iterations},
           {"flops", num(r.flops)},
           {"gflops", num(r.gflops)},
           {"gemm_fraction", num(r.gemm_fraction)},
           {"peak_bytes", num(r.peak_bytes)},
           {"estimated_bytes", num(r.estimated_bytes)},
           {"rel_fro_error", num(r.error.rel_fro)},
           {"max_abs_error", num(r.error.max_abs)},
           {"mean_cosine", num(r.error.mean_cos)},
           {"error_rows", r.error.rows_used},
           {"error_rows_total", r.error.rows_total},
           {"mass_mean", num(r.error.mass_mean)},
           {"mass_min", num(r.error.mass_min)},
           {"uniform_error", num(r.error.uniform_rel_fro)},
           {"rounded_input_error", num(r.rounded_input_error)},
           {"notes", r.notes},
           {"stand_ins", r.stand_ins},
           {"phases", phases_text(r.phases)},
           {"attention_share", num(r.attention_share)},
           {"prepare_s", num(r.prepare_seconds)},
           {"saved_bytes", num(r.saved_bytes)},
           {"saved_estimate_bytes", num(r.saved_estimate_bytes)},
           {"grad_rel_err_q", num(r.grad_err_q)},
           {"grad_rel_err_k", num(r.grad_err_k)},
           {"grad_rel_err_v", num(r.grad_err_v)},
           {"grad_heads", r.grad_heads},
           {"prefill_s", num(r.prefill_seconds)},
           {"time_per_token_s", num(r.time_per_token)},
           {"tokens_per_s", num(r.tokens_per_s)},
           {"state_bytes", num(r.state_bytes)},
           {"bytes_read_per_step", num(r.bytes_read_per_step)},
           {"bandwidth_fraction", num(r.bandwidth_fraction)},
           {"host", r.host}};
}

}  // namespace attnbench
