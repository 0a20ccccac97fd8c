#include "harness/sweep_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/io/inputs.h"
#include "common/io/trained.h"
#include "harness/results.h"

namespace attnbench {

std::vector<std::string> expand_spec_grids(const std::string& spec) {
  if (spec.find('|') == std::string::npos) return {spec};
  auto [name, kv] = parse_spec(spec);
  // each parameter's values, in the order written (one for a parameter without a grid)
  std::vector<std::vector<std::string>> values;
  for (const auto& [key, value] : kv) {
    auto bad = [&, &key = key, &value = value](const std::string& why) {
      return SpecError(fmt::format(
          "variant spec '{}': parameter '{}' has the grid '{}', {}; accepted: values separated "
          "by '|', each once, e.g. {}=64|128|256",
          spec, key, value, why, key));
    };
    std::vector<std::string> grid;
    size_t start = 0;
    while (true) {
      const size_t bar = value.find('|', start);
      std::string item = value.substr(start, bar == std::string::npos ? bar : bar - start);
      if (item.empty()) throw bad("which has an empty value");
      if (std::find(grid.begin(), grid.end(), item) != grid.end())
        throw bad(fmt::format("which lists '{}' twice", item));
      grid.push_back(std::move(item));
      if (bar == std::string::npos) break;
      start = bar + 1;
    }
    values.push_back(std::move(grid));
  }
  // the cross product, the last parameter varying fastest
  std::vector<std::string> specs;
  std::vector<size_t> at(kv.size(), 0);
  while (true) {
    std::string s = name;
    for (size_t i = 0; i < kv.size(); ++i)
      s += fmt::format("{}{}={}", i == 0 ? ":" : ",", kv[i].first, values[i][at[i]]);
    specs.push_back(std::move(s));
    size_t i = kv.size();
    while (i > 0 && ++at[i - 1] == values[i - 1].size()) at[--i] = 0;
    if (i == 0) break;
  }
  return specs;
}

std::vector<std::unique_ptr<Variant>> make_sweep_variants(const std::vector<std::string>& specs) {
  std::vector<std::unique_ptr<Variant>> variants;
  if (specs.empty())
    for (const VariantInfo* v : Registry::instance().all())
      variants.push_back(make_variant(v->name));
  for (const auto& spec : specs)
    for (const auto& s : expand_spec_grids(spec)) variants.push_back(make_variant(s));
  return variants;
}

namespace {

// Layer rows (--embed) draw gaussian, unscaled inputs and measure the forward pass of
// torch.nn.MultiheadAttention in float32: any other input, scale, score, pass or dtype is refused.
void check_layer_axes(const SweepAxes& axes) {
  for (const auto& in : axes.inputs)
    if (in != "gaussian")
      throw UsageError(fmt::format(
          "--input {}: layer rows (--embed) draw gaussian inputs and parameters; accepted "
          "with --embed: gaussian",
          in));
  for (double scale : axes.scales)
    if (scale != 1.0)
      throw UsageError(fmt::format(
          "--scale {}: layer rows (--embed) draw gaussian inputs and parameters unscaled; "
          "accepted with --embed: 1",
          scale));
  for (Score s : axes.scores)
    if (s != Score::scaled_dot)
      throw UsageError(
          fmt::format("--score {}: layer rows (--embed) score as torch.nn.MultiheadAttention does; "
                      "accepted with --embed: scaled_dot",
                      score_name(s)));
  for (const auto& ps : axes.passes)
    if (ps != "fwd")
      throw UsageError(fmt::format(
          "--pass {}: layer rows (--embed) measure the forward pass only; accepted with "
          "--embed: fwd",
          ps));
  for (DType t : axes.dtypes)
    if (t != DType::f32)
      throw UsageError(
          fmt::format("--dtype {}: layer rows (--embed) run in float32; accepted with --embed: f32",
                      dtype_name(t)));
}

// Each --kv-heads G: 0 (G = H) or a positive divisor of some head count; with layer rows, 0.
void check_kv_heads(const SweepAxes& axes, bool layer) {
  for (int64_t g : axes.kv_heads) {
    if (g < 0)
      throw UsageError(fmt::format(
          "--kv-heads {}: accepted: positive divisors of the heads, or 0 for G = H", g));
    if (g > 0 &&
        std::none_of(axes.heads.begin(), axes.heads.end(), [&](int64_t h) { return h % g == 0; }))
      throw UsageError(fmt::format(
          "--kv-heads {} divides none of the head counts ({}); accepted: divisors of the heads, "
          "or 0 for G = H",
          g, fmt::join(axes.heads, ",")));
    if (g > 0 && layer)
      throw UsageError(fmt::format(
          "--kv-heads {}: layer rows (--embed) have torch.nn.MultiheadAttention's projections, one "
          "key/value head per head; accepted with --embed: 0 (G = H)",
          g));
  }
}

}  // namespace

SweepPlan plan_sweep(std::vector<std::unique_ptr<Variant>> variants, const SweepAxes& axes) {
  SweepPlan plan;
  plan.axes = axes;
  plan.variants = std::move(variants);
  const std::vector<PaddingSetting> paddings =
      axes.paddings.empty() ? std::vector<PaddingSetting>(1) : axes.paddings;
  // Two specs that name the same canonical variant, or a value listed twice, would measure
  // one configuration twice: keep the first.
  std::set<std::string> seen;
  // Layer rows take the place of the head dimensions: d = E / H.
  const bool layer = !axes.embeds.empty();
  if (layer) check_layer_axes(axes);
  check_kv_heads(axes, layer);
  const std::vector<int64_t>& sizes = layer ? axes.embeds : axes.dims;
  // the weights depend on the score, H, d and h only: one set per such shape
  std::map<std::tuple<Score, int64_t, int64_t>, std::shared_ptr<const ScoreWeights>> weights;
  // One configuration per variant of the problem the outer loops chose.
  auto add = [&](const std::string& in, double scale, bool c, Score s, int64_t size, int64_t h,
                 int64_t g, int64_t b, const PaddingSetting& pad, int64_t n, int64_t seq_k,
                 const std::string& pass, DType dtype) {
    // m = n is written m = 0, as without --seq-k: the same row (and for a layer,
    // self-attention)
    const int64_t m = seq_k == n ? 0 : seq_k;
    Problem p;
    p.batch = b, p.heads = h, p.n = n, p.m = m, p.dim = size, p.causal = c;
    p.seed = axes.seed;
    const int64_t embed = layer ? size : 0;
    if (layer) {
      LayerProblem lp;
      lp.batch = b, lp.embed = size, lp.heads = h, lp.n = n, lp.m = m, lp.causal = c;
      lp.seed = axes.seed;
      lp.validate();
      p = lp.attention();
    }
    p.kv_heads = g == h ? 0 : g;  // G = H is written 0: the same row as without --kv-heads
    p.score = s, p.score_hidden = axes.score_hidden;
    p.dtype = dtype;
    if (!pad.lengths.empty()) p.key_lengths = parse_key_lengths(pad.lengths, b);
    if (pad.fraction >= 0) p.key_lengths = padding_lengths(p, pad.fraction);
    Workload w;
    w.input = in, w.scale = scale, w.threads = axes.threads, w.pass = pass;
    p.validate();
    w.validate(p);
    // trained inputs are checked against the problem (and their files read) before anything
    // runs: a sweep they do not fit fails at once, with the reason
    if (is_trained_input(in)) check_trained_fits(p, in);
    if (s == Score::bilinear || s == Score::additive) {
      auto& sw = weights[{s, h, p.dim}];
      if (!sw) sw = make_score_weights(p);
      p.score_weights = sw;
    }
    for (const auto& v : plan.variants) {
      Row key;
      key.spec = v->spec(), key.problem = p, key.workload = w, key.embed = embed;
      if (!seen.insert(row_key(key)).second) {
        plan.duplicates.push_back(fmt::format(
            "{} {}{}", key.spec, layer ? fmt::format("E={},", embed) : "", describe(p, w)));
        continue;
      }
      plan.configs.push_back({v.get(), p, w, embed});
    }
  };
  for (const auto& in : axes.inputs)
    for (double scale : axes.scales)
      for (bool c : axes.causals)
        for (Score s : axes.scores)
          for (auto size : sizes)
            for (auto h : axes.heads)
              for (auto g : axes.kv_heads)
                for (auto b : axes.batches)
                  for (const auto& pad : paddings)
                    for (auto n : axes.seqs)
                      for (auto m : axes.seq_ks)
                        for (const auto& ps : axes.passes)
                          for (DType t : axes.dtypes)
                            if (g == 0 || h % g == 0)
                              add(in, scale, c, s, size, h, g, b, pad, n, m, ps, t);
  return plan;
}

namespace {

// The comma-separated names of `text`, each parsed by `parse` (which throws UsageError naming
// an unknown one and the accepted names); the error is prefixed with the option.
template <class Parse>
auto parse_name_list(const std::string& text, const char* option, Parse parse) {
  std::vector<decltype(parse(std::string_view()))> out;
  for (auto& s : split_csv_line(text)) {
    try {
      out.push_back(parse(s));
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("{}: {}", option, e.what()));
    }
  }
  return out;
}

}  // namespace

std::vector<DType> parse_dtype_list(const std::string& text) {
  return parse_name_list(text, "--dtype", parse_dtype);
}

std::vector<Score> parse_score_list(const std::string& text) {
  return parse_name_list(text, "--score", parse_score);
}

std::vector<int64_t> parse_key_lengths(const std::string& text, int64_t batch) {
  std::vector<int64_t> lens;
  for (const auto& s : split_csv_line(text)) {
    int64_t v = -1;
    auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || ptr != s.data() + s.size() || s.empty() || v < 0)
      throw UsageError(fmt::format(
          "--key-padding: '{}' is not a length; accepted: non-negative integers, one per "
          "batch element or one for all, comma-separated (e.g. 700,1024)",
          s));
    lens.push_back(v);
  }
  if (lens.size() == 1) lens.assign(size_t(batch), lens[0]);
  if (int64_t(lens.size()) != batch)
    throw UsageError(fmt::format(
        "--key-padding: {} lengths for a batch of {}; accepted: one per batch element or one "
        "for all",
        lens.size(), batch));
  return lens;
}

std::vector<int64_t> padding_lengths(const Problem& p, double f) {
  RandomStream rs(p.seed, 0x9add1ULL);
  const double m = double(p.keys());
  std::vector<int64_t> lens;
  for (int64_t b = 0; b < p.batch; ++b) {
    const double u = rs.uniform(uint64_t(b));
    const double len =
        f <= 0.5 ? m - std::round(u * 2 * f * m) : std::round((1 - u) * 2 * (1 - f) * m);
    lens.push_back(std::clamp<int64_t>(int64_t(len), 0, p.keys()));
  }
  return lens;
}

std::vector<PaddingSetting> parse_padding_settings(const std::string& lists,
                                                   const std::string& fractions) {
  std::vector<PaddingSetting> out;
  if (!lists.empty()) {
    size_t start = 0;
    while (true) {
      const size_t end = lists.find(';', start);
      std::string item = lists.substr(start, end == std::string::npos ? end : end - start);
      PaddingSetting s;
      if (item != "none") {
        parse_key_lengths(item, int64_t(split_csv_line(item).size()));  // the syntax
        s.lengths = item;
      }
      out.push_back(s);
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  if (!fractions.empty())
    for (const auto& t : split_csv_line(fractions)) {
      char* end = nullptr;
      const double f = std::strtod(t.c_str(), &end);
      if (t.empty() || end != t.c_str() + t.size() || !(f >= 0 && f < 1))
        throw UsageError(
            fmt::format("--padding-fraction: '{}' is not a fraction; accepted: numbers in [0, 1), "
                        "comma-separated",
                        t));
      PaddingSetting s;
      s.fraction = f;
      out.push_back(s);
    }
  return out;
}

std::vector<bool> parse_causal_mode(const std::string& mode) {
  if (mode == "off") return {false};
  if (mode == "on") return {true};
  if (mode == "both") return {false, true};
  throw UsageError(fmt::format("--causal: unknown mode '{}'; accepted: off, on, both", mode));
}

std::vector<std::string> parse_pass_list(const std::string& text) {
  const auto& names = pass_names();
  std::vector<std::string> passes;
  for (auto& s : split_csv_line(text)) {
    if (std::find(names.begin(), names.end(), s) == names.end())
      throw UsageError(
          fmt::format("--pass: unknown pass '{}'; accepted: {}", s, fmt::join(names, ", ")));
    passes.push_back(s);
  }
  return passes;
}

std::vector<std::string> parse_input_list(const std::string& text) {
  std::vector<std::string> inputs;
  for (auto& s : split_csv_line(text)) {
    try {
      inputs.push_back(canonical_input(s));
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("--input: {}", e.what()));
    }
  }
  return inputs;
}

std::vector<double> parse_scale_list(const std::string& text) {
  std::vector<double> out;
  for (const auto& t : split_csv_line(text)) {
    double v = 0;
    const char* end = t.data() + t.size();
    auto [ptr, ec] = std::from_chars(t.data(), end, v);
    if (t.empty() || ec != std::errc() || ptr != end || !std::isfinite(v) || !(v > 0))
      throw UsageError(
          fmt::format("--scale: '{}' is not a positive number; accepted: positive numbers, "
                      "comma-separated (e.g. 1,2,4)",
                      t));
    out.push_back(v);
  }
  return out;
}

LayerProblem layer_problem(const SweepConfig& config) {
  const Problem& p = config.problem;
  LayerProblem lp;
  lp.batch = p.batch, lp.embed = config.embed, lp.heads = p.heads, lp.n = p.n, lp.m = p.m;
  lp.causal = p.causal, lp.seed = p.seed;
  lp.key_lengths = p.key_lengths, lp.attn_mask = p.attn_mask;
  return lp;
}

bool sweep_runnable(const SweepConfig& config) {
  try {
    config.variant->check_supported(config.problem);
    const std::string& pass = config.workload.pass;
    if (pass == "bwd" || pass == "fwdbwd") config.variant->check_backward(config.problem);
    if (pass == "decode") config.variant->check_decode(config.problem);
    return true;
  } catch (const UnsupportedError&) {
    return false;
  }
}

double sweep_work(const SweepConfig& config) {
  // An estimate that fails counts as none; run_one reports the failure in the row.
  if (!sweep_runnable(config)) return 0;
  double f = 0;
  try {
    const std::string& pass = config.workload.pass;
    if (config.embed > 0)
      f = layer_flops(*config.variant, layer_problem(config));
    else if (pass == "fwd")
      f = config.variant->flops(config.problem);
    else if (pass == "decode") {  // a repetition: the prefill and its steps (each about
                                  // one row of the forward)
      const Problem& p = config.problem;
      f = config.variant->decoder()->prefill_flops(p, p.n) +
          double(decode_timed_steps(p.n)) * config.variant->flops(p) / double(p.n);
    } else  // bwd, or the forward and the backward (sweep_runnable: it has one)
      f = (pass == "bwd" ? 0.0 : config.variant->flops(config.problem)) +
          config.variant->backward()->backward_flops(config.problem);
  } catch (const std::exception&) {
  }
  return std::isfinite(f) && f > 0 ? f : 0;
}

double sweep_reference_work(const SweepConfig& config) {
  const Problem& p = config.problem;
  // the pairs the causal mask leaves: row i sees min(m, max(0, i + m - n + 1)) keys
  const double n = double(p.n), m = double(p.keys());
  const double per_head =
      !p.causal ? n * m : (m >= n ? n * (m - n) + n * (n + 1) / 2 : m * (m + 1) / 2);
  const double pairs = double(p.batch) * double(p.heads) * per_head;
  double work = std::min(pairs, kExactPairsLimit) * double(p.dim);
  // the gradients of whole heads (measure_grad_error): about three times a forward row's work
  // per pair, on up to kExactPairsLimit pairs, none when one head holds more
  if ((config.workload.pass == "bwd" || config.workload.pass == "fwdbwd") &&
      n * m <= kExactPairsLimit)
    work += 3.0 * std::min(pairs, std::floor(kExactPairsLimit / (n * m)) * n * m) * double(p.dim);
  if (config.embed > 0)  // the float64 layer projects every input row of the batch items used
    work += 4.0 * double(p.batch) * (n + m) * double(config.embed) * double(config.embed);
  return work;
}

std::vector<double> plan_reference_work(const SweepPlan& plan, const std::vector<bool>& measured) {
  std::vector<double> work(plan.configs.size());
  std::string last;  // the problem whose reference rows are kept
  for (size_t i = 0; i < plan.configs.size(); ++i) {
    const SweepConfig& c = plan.configs[i];
    if (i < measured.size() && !measured[i]) continue;
    Row r;
    r.problem = c.problem, r.workload = c.workload, r.embed = c.embed;
    const std::string key = row_key(r);
    if (c.embed > 0 || key != last) work[i] = sweep_reference_work(c);
    if (c.embed == 0) last = key;
  }
  return work;
}

void append_plan(SweepPlan& plan, SweepPlan more) {
  std::set<std::string> seen;
  auto key = [](const SweepConfig& c) {
    Row r;
    r.spec = c.variant->spec(), r.problem = c.problem, r.workload = c.workload, r.embed = c.embed;
    return row_key(r);
  };
  for (const auto& c : plan.configs) seen.insert(key(c));
  for (auto& c : more.configs) {
    if (!seen.insert(key(c)).second) {
      plan.duplicates.push_back(fmt::format("{} {}{}", c.variant->spec(),
                                            c.embed > 0 ? fmt::format("E={},", c.embed) : "",
                                            describe(c.problem, c.workload)));
      continue;
    }
    plan.configs.push_back(c);
  }
  for (auto& d : more.duplicates) plan.duplicates.push_back(std::move(d));
  for (auto& v : more.variants) plan.variants.push_back(std::move(v));
}

double EtaModel::timed(double pass) const {
  return pass + double(std::max(1, reps_)) * std::max(min_time_, pass);
}

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}
}  // namespace

void EtaModel::add(const std::string& spec, double work, double reference_work, double wall,
                   double pass, double error) {
  if (!std::isfinite(wall) || !std::isfinite(pass) || !(pass > 0)) return;
  if (!std::isfinite(error)) error = 0;
  fixed_.push_back(std::max(0.0, wall - timed(pass) - error));
  fixed_median_ = median(fixed_);
  if (work > 0) {
    auto [it, fresh] = rate_.try_emplace(spec, work, work / pass);
    if (!fresh && work >= it->second.first) it->second = {work, work / pass};
    std::vector<double> rates;
    for (const auto& [s, wr] : rate_) rates.push_back(wr.second);
    rate_median_ = median(rates);
  }
  if (reference_work > 0 && error > 0 && reference_work >= reference_.first)
    reference_ = {reference_work, reference_work / error};
}

double EtaModel::predict(const std::string& spec, double work, double reference_work) const {
  if (fixed_.empty()) return NAN;
  const auto it = rate_.find(spec);
  const double rate = it != rate_.end() ? it->second.second : rate_median_;
  const double pass = work > 0 && rate > 0 ? work / rate : 0;
  const double error =
      reference_work > 0 && reference_.second > 0 ? reference_work / reference_.second : 0;
  return fixed_median_ + timed(pass) + error;
}

}  // namespace attnbench
