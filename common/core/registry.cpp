#include "common/core/registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <set>
#include <utility>

#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/suggest.h"
#include "common/kernels/bf16.h"
#include "common/patterns/pattern.h"

namespace attnbench {

const char* to_string(ParamType t) {
  switch (t) {
    case ParamType::Int:
      return "int";
    case ParamType::Float:
      return "float";
    case ParamType::Bool:
      return "bool";
    case ParamType::Choice:
      return "choice";
    case ParamType::IntList:
      return "int list";
  }
  return "?";
}

ParamSpec ParamSpec::Int(std::string name, int64_t def, int64_t lo, int64_t hi, std::string help) {
  return {std::move(name), ParamType::Int, std::to_string(def), double(lo), double(hi), {},
          std::move(help)};
}
ParamSpec ParamSpec::Float(std::string name, double def, double lo, double hi, std::string help) {
  return {std::move(name), ParamType::Float, fmt::format("{}", def), lo, hi, {}, std::move(help)};
}
ParamSpec ParamSpec::Bool(std::string name, bool def, std::string help) {
  return {std::move(name), ParamType::Bool, def ? "true" : "false", 0, 1, {}, std::move(help)};
}
ParamSpec ParamSpec::Choice(std::string name, std::string def, std::vector<std::string> choices,
                            std::string help) {
  return {std::move(name),    ParamType::Choice, std::move(def), 0, 0,
          std::move(choices), std::move(help)};
}

ParamSpec ParamSpec::IntList(std::string name, std::string def, int64_t lo, int64_t hi,
                             std::string help) {
  return {std::move(name), ParamType::IntList, std::move(def), double(lo), double(hi), {},
          std::move(help)};
}

std::string ParamSpec::accepted() const {
  switch (type) {
    case ParamType::Int:
      return fmt::format("an integer in [{}, {}]", int64_t(min), int64_t(max));
    case ParamType::Float:
      return fmt::format("a number in [{}, {}]", min, max);
    case ParamType::Bool:
      return "true|false (also 1|0, on|off)";
    case ParamType::Choice:
      return fmt::format("one of {}", fmt::join(choices, "|"));
    case ParamType::IntList:
      return fmt::format("integers in [{}, {}] joined by '+' (e.g. 0+64+512), or none",
                         int64_t(min), int64_t(max));
  }
  return "";
}

namespace {

// The one parser of numbers in parameter values, used both when a spec is read and when a
// value is got, so a value accepted once can always be read back. Whole text only.
bool parse_number(std::string_view text, int64_t& v) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  return ec == std::errc() && end == text.data() + text.size() && !text.empty();
}
// Finite and normal (or zero): a subnormal or underflowing value (1e-310) is refused, since
// std::from_chars and strtod disagree on it and nothing in a variant means it.
bool parse_number(std::string_view text, double& v) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  return ec == std::errc() && end == text.data() + text.size() && !text.empty() &&
         std::isfinite(v) && (v == 0 || std::isnormal(v));
}
// "none" or integers joined by '+'.
bool parse_number_list(std::string_view text, std::vector<int64_t>& out) {
  out.clear();
  if (text == "none") return true;
  while (true) {
    const size_t plus = text.find('+');
    int64_t v = 0;
    if (!parse_number(text.substr(0, plus), v)) return false;
    out.push_back(v);
    if (plus == std::string_view::npos) return true;
    text.remove_prefix(plus + 1);
  }
}

// Parses and range-checks one value; returns its canonical text.
std::string canonical_value(const std::string& variant, const ParamSpec& ps,
                            const std::string& text) {
  auto bad = [&](const char* why) {
    return SpecError(fmt::format("{}: parameter '{}' = '{}' {}; accepted: {}", variant, ps.name,
                                 text, why, ps.accepted()));
  };
  switch (ps.type) {
    case ParamType::Int: {
      int64_t v = 0;
      if (!parse_number(text, v)) throw bad("is not an integer");
      if (double(v) < ps.min || double(v) > ps.max) throw bad("is out of range");
      return std::to_string(v);
    }
    case ParamType::Float: {
      double v = 0;
      if (!parse_number(text, v))
        throw bad(fmt::format("is not a finite number of magnitude 0 or at least {} (no "
                              "subnormal or underflowing values)",
                              std::numeric_limits<double>::min())
                      .c_str());
      if (v < ps.min || v > ps.max) throw bad("is out of range");
      return fmt::format("{}", v);
    }
    case ParamType::Bool: {
      if (text == "true" || text == "1" || text == "on" || text == "yes") return "true";
      if (text == "false" || text == "0" || text == "off" || text == "no") return "false";
      throw bad("is not a boolean");
    }
    case ParamType::Choice: {
      if (std::find(ps.choices.begin(), ps.choices.end(), text) == ps.choices.end())
        throw bad("is not an allowed choice");
      return text;
    }
    case ParamType::IntList: {
      if (text == "none") return text;
      std::vector<int64_t> items;
      if (!parse_number_list(text, items)) throw bad("is not a list of integers");
      for (int64_t v : items)
        if (double(v) < ps.min || double(v) > ps.max) throw bad("has a value out of range");
      std::sort(items.begin(), items.end());
      items.erase(std::unique(items.begin(), items.end()), items.end());
      return fmt::format("{}", fmt::join(items, "+"));
    }
  }
  return text;
}

// The names of the tensors p gives beyond q, k and v.
std::vector<std::string> given_input_names(const Problem& p) {
  std::vector<std::string> names;
  if (p.extra_inputs)
    for (const auto& entry : *p.extra_inputs) names.push_back(entry.first);
  return names;
}

}  // namespace

const std::string& ParamValues::text(const std::string& name) const {
  auto it = values.find(name);
  if (it == values.end()) throw SpecError(fmt::format("no parameter named '{}'", name));
  return it->second;
}
// The getters read the canonical text with the parser that accepted it.
static SpecError unreadable(const std::string& name, const std::string& text, const char* what) {
  return SpecError(fmt::format("parameter '{}' = '{}' is not {}", name, text, what));
}
int64_t ParamValues::get_int(const std::string& name) const {
  int64_t v = 0;
  if (!parse_number(text(name), v)) throw unreadable(name, text(name), "an integer");
  return v;
}
double ParamValues::get_float(const std::string& name) const {
  double v = 0;
  if (!parse_number(text(name), v)) throw unreadable(name, text(name), "a normal finite number");
  return v;
}
bool ParamValues::get_bool(const std::string& name) const { return text(name) == "true"; }
const std::string& ParamValues::get_choice(const std::string& name) const { return text(name); }
std::vector<int64_t> ParamValues::get_int_list(const std::string& name) const {
  std::vector<int64_t> out;
  if (!parse_number_list(text(name), out))
    throw unreadable(name, text(name), "a list of integers joined by '+' or none");
  return out;
}

std::unique_ptr<SparsePattern> Variant::make_pattern(const Problem&, ConstTensorView,
                                                     ConstTensorView) const {
  return nullptr;
}

std::string Variant::spec() const {
  std::string s = info_->name;
  char sep = ':';
  for (const auto& ps : info_->params) {
    if (ps.omit_at_default && params_.text(ps.name) == ps.default_value) continue;
    s += fmt::format("{}{}={}", sep, ps.name, params_.text(ps.name));
    sep = ',';
  }
  return s;
}

void Variant::check_supported(const Problem& p) const {
  if (p.causal && !info_->caps.causal)
    throw UnsupportedError(fmt::format("{} does not support causal masking", info_->name));
  if (!p.causal && info_->caps.causal_only)
    throw UnsupportedError(fmt::format(
        "{} is causal only (its function is defined under the causal mask): it needs --causal",
        info_->name));
  if (p.keys() != p.n && !info_->caps.cross)
    throw UnsupportedError(
        fmt::format("{} does not support m != n (got n = {}, m = {})", info_->name, p.n, p.keys()));
  const Capabilities& c = info_->caps;
  if ((p.score == Score::dot || p.score == Score::bilinear) && !c.linear_score)
    throw UnsupportedError(fmt::format("{} does not support the {} score (its keys are not k)",
                                       info_->name, score_name(p.score)));
  if (p.score == Score::additive && !c.additive)
    throw UnsupportedError(fmt::format(
        "{} does not support the additive score; variants that do: those whose `list` entry "
        "says additive",
        info_->name));
  if ((p.score == Score::bilinear || p.score == Score::additive) && !p.score_weights)
    throw UsageError(
        fmt::format("the {} score needs its weights (generated from the seed or "
                    "read from the inputs file); none were given",
                    score_name(p.score)));
  if (!p.key_lengths.empty() && !c.key_padding)
    throw UnsupportedError(fmt::format("{} does not support key padding", info_->name));
  if (p.attn_mask && !c.attn_mask)
    throw UnsupportedError(
        fmt::format("{} does not support an attention mask (--attn-mask)", info_->name));
  if (p.dtype == DType::bf16 && p.score == Score::additive)
    throw UnsupportedError(
        "the additive score runs in float32 only (--dtype f32); bf16 takes scaled_dot, dot and "
        "bilinear");
  if (p.dtype == DType::bf16 && !c.bf16)
    throw UnsupportedError(fmt::format(
        "{} has no bf16 path (--dtype bf16); variants that do: those whose `list` entry says "
        "bf16",
        info_->name));
  check_inputs(p);
}

std::vector<int64_t> Variant::input_shape(const InputSpec& in, const Problem& p) const {
  std::vector<int64_t> shape;
  for (const std::string& dim : in.dims)
    shape.push_back(dim == "B"   ? p.batch
                    : dim == "H" ? p.heads
                    : dim == "G" ? p.kv_head_count()
                    : dim == "n" ? p.n
                    : dim == "m" ? p.keys()
                    : dim == "d" ? p.dim
                                 : params_.get_int(dim));  // an Int parameter (check_inputs)
  return shape;
}

const float* Variant::input(const Problem& p, std::string_view name) const {
  if (!p.extra_inputs) return nullptr;
  auto it = p.extra_inputs->find(name);
  return it == p.extra_inputs->end() ? nullptr : it->second.data.data();
}

std::vector<std::string> Variant::stand_ins(const Problem& p) const {
  std::vector<std::string> out;
  for (const InputSpec* in : inputs())
    if (!input(p, in->name)) out.push_back(in->name);
  return out;
}

std::string Variant::accepted_inputs(const Problem& p) const {
  std::vector<std::string> parts;
  for (const InputSpec* in : inputs())
    parts.push_back(
        fmt::format("{} {} = [{}]", in->name, in->shape(), fmt::join(input_shape(*in, p), ", ")));
  return parts.empty() ? fmt::format("{} takes no input beyond q, k and v", spec())
                       : fmt::format("{} takes {}", spec(), fmt::join(parts, ", "));
}

namespace {

/// Throws UsageError when a value of the input t (named `name`, declared as `in`) is outside
/// its range.
void check_input_range(const Variant& var, const std::string& name, const InputSpec& in,
                       const ExtraInput& t) {
  for (size_t i = 0; i < t.data.size(); ++i)
    if (!(double(t.data[i]) >= in.min && double(t.data[i]) <= in.max))
      throw UsageError(fmt::format(
          "the input '{}' of {} holds {} at flat index {}; accepted: values in [{}, {}] ({})", name,
          var.spec(), t.data[i], i, in.min, in.max, in.help));
}

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t s : shape) count *= s;
  return count;
}

}  // namespace

const InputSpec* Variant::taken_input(const Problem& p, const std::string& name) const {
  for (const InputSpec* in : inputs())
    if (in->name == name) return in;
  throw UsageError(fmt::format("an input '{}' was given, which {} does not take; {}", name, spec(),
                               accepted_inputs(p)));
}

void Variant::check_inputs(const Problem& p) const {
  if (!p.extra_inputs) return;
  for (const auto& entry : *p.extra_inputs) {
    const std::string& name = entry.first;
    const ExtraInput& t = entry.second;
    const InputSpec& in = *taken_input(p, name);
    const std::vector<int64_t> want = input_shape(in, p);
    if (t.shape != want || int64_t(t.data.size()) != element_count(want))
      throw UsageError(fmt::format("the input '{}' has shape [{}]; {}", name,
                                   fmt::join(t.shape, ", "), accepted_inputs(p)));
    check_input_range(*this, name, in, t);
  }
}

void Variant::check_token_inputs(const Problem& p, const ExtraInputs& given, int64_t tokens,
                                 bool at_least) const {
  for (const auto& entry : given) {
    const std::string& name = entry.first;
    const ExtraInput& t = entry.second;
    const InputSpec& in = *taken_input(p, name);
    const auto axis = std::find_if(in.dims.begin(), in.dims.end(),
                                   [](const std::string& a) { return a == "n" || a == "m"; });
    if (axis == in.dims.end())
      throw UnsupportedError(
          fmt::format("the input '{}' of {} is not per token; a decode step takes per-token inputs",
                      name, spec()));
    const size_t at = size_t(axis - in.dims.begin());
    const int64_t len = t.shape.size() == in.dims.size() ? t.shape[at] : -1;
    Problem pt = p;
    pt.n = std::max<int64_t>(len, 0);
    pt.m = 0;
    const std::vector<int64_t> want = input_shape(in, pt);
    if (len < 0 || (at_least ? len < tokens : len != tokens) || t.shape != want ||
        int64_t(t.data.size()) != element_count(want))
      throw UsageError(fmt::format(
          "the input '{}' of a decode {} has shape [{}]; {} takes {} [{}] with {} {} on its "
          "token axis ({})",
          name, at_least ? "prefill" : "step", fmt::join(t.shape, ", "), spec(), name,
          fmt::join(in.dims, ", "), at_least ? "at least" : "exactly", tokens, *axis));
    check_input_range(*this, name, in, t);
  }
}

namespace {
// The flops of mapping q (or its gradient) for the dot and bilinear scores: a scaling per
// entry, or a d x d product per row.
double map_flops(const Problem& p) {
  const double entries = double(p.batch * p.heads) * double(p.n) * double(p.dim);
  return p.score == Score::bilinear ? 2.0 * entries * double(p.dim) : entries;
}
}  // namespace

Problem linear_score_problem(const Problem& p) {
  Problem scaled = p;
  scaled.score = Score::scaled_dot;
  scaled.score_weights = nullptr;
  return scaled;
}

Tensor linear_score_query(const Problem& p, ConstTensorView q) {
  // scaled_dot on q' = sqrt(d) q (dot) or q'_i = sqrt(d) W^T q_i per head (bilinear, with
  // q^T W k = (W^T q)^T k): one pass over q
  const int64_t d = p.dim, rows = p.n;
  const float root = float(std::sqrt(double(d)));
  Tensor mapped(p.q_shape());
  TensorView mv = mapped.view();
  const float* w = p.score == Score::bilinear ? p.score_weights->w_bilinear.data() : nullptr;
  const bool parallel = parallel_worth(map_flops(p), p.batch * p.heads);
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* wh = w ? w + h * d * d : nullptr;
      for (int64_t i = 0; i < rows; ++i) {
        const float* qi = q.row(b, h, i);
        float* oi = mv.row(b, h, i);
        if (!wh) {
          for (int64_t c = 0; c < d; ++c) oi[c] = root * qi[c];
          continue;
        }
        // (W^T q)_c = sum_r W[r, c] q_r
        for (int64_t c = 0; c < d; ++c) oi[c] = 0;
        for (int64_t r = 0; r < d; ++r) {
          const float qr = root * qi[r];
          const float* wr = wh + r * d;
          for (int64_t c = 0; c < d; ++c) oi[c] += qr * wr[c];
        }
      }
    }
  return mapped;
}

void Variant::compute(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                      TensorView out) {
  if (p.score != Score::dot && p.score != Score::bilinear) {
    forward(p, q, k, v, out);
    return;
  }
  Tensor mapped = linear_score_query(p, q);
  // bf16: the mapped query is an operand of the products like q
  if (p.dtype == DType::bf16) round_to_bf16(mapped.data(), mapped.numel());
  forward(linear_score_problem(p), mapped.view(), k, v, out);
}

namespace {

// A view of one head per stored head, of shape `want`.
void expect_shape(const char* what, ConstTensorView t, const Shape4& want) {
  if (!(t.shape == want) || t.group != 1)
    throw InputError(fmt::format("{} has shape {}{}, expected {}", what, t.shape.str(),
                                 t.group == 1 ? "" : fmt::format(" (grouped by {})", t.group),
                                 want.str()));
}

// k, v (or their gradients) of p: [B, G, m, d] viewed grouped as [B, H, m, d].
void expect_kv_shape(const char* what, ConstTensorView t, const Problem& p) {
  if (t.shape == p.kv_shape() && t.group == p.kv_group()) return;
  const Shape4 stored{t.shape.batch, t.shape.heads / std::max<int64_t>(t.group, 1), t.shape.len,
                      t.shape.dim};
  throw InputError(fmt::format(
      "{} holds {} key/value heads of shape {} for {} query heads; expected {} ({} key/value "
      "heads, each read by {} query heads)",
      what, stored.heads, stored.str(), t.shape.heads, p.kv_storage_shape().str(),
      p.kv_head_count(), p.kv_group()));
}

}  // namespace

void Variant::run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                  TensorView out) {
  check_supported(p);
  expect_shape("q", q, p.q_shape());
  expect_kv_shape("k", k, p);
  expect_kv_shape("v", v, p);
  expect_shape("out", out, p.q_shape());
  compute(p, q, k, v, out);
}

void Backward::backward_inputs(const Problem& p, ConstTensorView, ConstTensorView, ConstTensorView,
                               ConstTensorView, ConstTensorView, const SavedState&, TensorView,
                               TensorView, TensorView, InputGrads&) {
  throw UnsupportedError(fmt::format(
      "this backward pass gives no gradient of a given input ({}); without it the stand-in runs",
      fmt::join(given_input_names(p), ", ")));
}

void Backward::check_backward(const Problem& p) const {
  if (p.dtype != DType::f32)
    throw UnsupportedError(
        "the backward pass runs in float32 only: --dtype bf16 measures the forward pass "
        "(--pass fwd)");
  if (p.score == Score::additive)
    throw UnsupportedError(
        "the backward pass does not support the additive score (its weights are not "
        "differentiated); scaled_dot, dot and bilinear are supported");
}

void Variant::check_backward(const Problem& p) const {
  check_supported(p);
  Backward* bw = const_cast<Variant*>(this)->backward();
  if (!bw)
    throw UnsupportedError(fmt::format(
        "{} has no backward pass; variants that do: those whose `list` entry says backward",
        info_->name));
  if (p.extra_inputs && !p.extra_inputs->empty() && !bw->gives_input_grads())
    throw UnsupportedError(
        fmt::format("{}: the backward pass gives no gradient of a given input ({}); without it the "
                    "stand-in runs",
                    spec(), fmt::join(given_input_names(p), ", ")));
  bw->check_backward(p);
}

void DecodeState::step_given(ConstTensorView, ConstTensorView, ConstTensorView,
                             const ExtraInputs& in, TensorView) {
  throw UnsupportedError(
      fmt::format("this decode state takes no given input ({})", input_names(in)));
}

std::unique_ptr<DecodeState> Decoder::prefill_given(const Problem&, ConstTensorView,
                                                    ConstTensorView, int64_t,
                                                    const ExtraInputs& in) {
  throw UnsupportedError(
      fmt::format("this decode step takes no given input ({})", input_names(in)));
}

std::string input_names(const ExtraInputs& in) {
  std::string out;
  for (const auto& entry : in) out += (out.empty() ? "" : "+") + entry.first;
  return out;
}

void check_step_inputs(const std::string& names, const ExtraInputs* in) {
  const std::string got = in ? input_names(*in) : std::string();
  if (got == names) return;
  if (names.empty())
    throw UsageError(
        fmt::format("a decode step given inputs ({}) on a state prefilled without "
                    "them (their stand-ins): give them to the prefill as well",
                    got));
  throw UsageError(
      fmt::format("a decode step given {} on a state prefilled with the inputs {}: "
                  "every step takes the inputs its prefill took",
                  got.empty() ? "no input" : "the inputs " + got, names));
}

void Decoder::check_decode(const Problem& p) const {
  if (p.dtype != DType::f32)
    throw UnsupportedError(
        "decoding runs in float32 only: --dtype bf16 measures the forward pass (--pass fwd)");
  if (!p.causal || p.keys() != p.n)
    throw UnsupportedError(fmt::format(
        "decoding is causal self-attention: it needs --causal and m = n (no --seq-k; k and v "
        "of an inputs file as long as q); here {}causal, n = {}, m = {}",
        p.causal ? "" : "not ", p.n, p.keys()));
  if (p.score != Score::scaled_dot)
    throw UnsupportedError(
        fmt::format("decoding supports the scaled_dot score only, not {}", score_name(p.score)));
  if (p.attn_mask || !p.key_lengths.empty())
    throw UnsupportedError(
        "decoding supports neither --attn-mask nor --key-padding (every cached key is visible "
        "to the causal pattern)");
}

void check_prefill(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t t0) {
  if (t0 < 0 || t0 > p.n)
    throw UsageError(fmt::format("decode prefill: t0 = {} is outside [0, n = {}]", t0, p.n));
  for (const auto& [name, t] : {std::pair{"k", k}, {"v", v}}) {
    const Shape4& s = t.shape;
    if (s.batch != p.batch || s.heads != p.heads || s.dim != p.dim || s.len < t0 ||
        t.group != p.kv_group())
      throw UsageError(fmt::format(
          "decode prefill: {} is {} grouped by {}, expected [{}, {}, >= t0 = {}, {}] grouped by "
          "{} ({} key/value heads)",
          name, s.str(), t.group, p.batch, p.heads, t0, p.dim, p.kv_group(), p.kv_head_count()));
  }
}

void check_step(int64_t length, int64_t capacity, const Shape4& want, ConstTensorView q,
                ConstTensorView k, ConstTensorView v, ConstTensorView out) {
  if (length >= capacity)
    throw UsageError(fmt::format(
        "decode step: the state is full (it holds all n = {} tokens of its problem); prefill a "
        "longer problem",
        capacity));
  for (const auto& [name, shape] :
       {std::pair{"q", q.shape}, {"k", k.shape}, {"v", v.shape}, {"out", out.shape}})
    if (!(shape == want))
      throw UsageError(
          fmt::format("decode step: {} is {}, expected {}", name, shape.str(), want.str()));
  // q and out have a head each; k and v may be grouped (one key/value head per group)
  if (q.group != 1 || out.group != 1 || k.group != v.group)
    throw UsageError(fmt::format(
        "decode step: q, out grouped by {}, {} and k, v by {}, {}; expected q and out with one "
        "head each and k and v grouped alike",
        q.group, out.group, k.group, v.group));
}

void Variant::check_decode(const Problem& p) const {
  check_supported(p);
  Decoder* dec = const_cast<Variant*>(this)->decoder();
  if (!dec)
    throw UnsupportedError(
        fmt::format("{} has no decode step; variants that do: those whose `list` entry says decode",
                    info_->name));
  if (p.extra_inputs && !p.extra_inputs->empty() && !dec->decodes_inputs())
    throw UnsupportedError(
        fmt::format("{}: the decode step takes no given input ({}); without it the stand-in runs",
                    spec(), fmt::join(given_input_names(p), ", ")));
  dec->check_decode(p);
}

namespace {

/// The saved state of a forward_train under the dot or bilinear score: the mapped q' the
/// variant saw, and the variant's own state.
class MappedQuerySaved final : public SavedState {
 public:
  MappedQuerySaved(Tensor mapped, std::unique_ptr<SavedState> inner)
      : mapped(std::move(mapped)), inner(std::move(inner)) {}
  Tensor mapped;
  std::unique_ptr<SavedState> inner;
};

Backward& backward_of(Variant& v) {
  Backward* bw = v.backward();
  if (!bw) throw UnsupportedError(fmt::format("{} has no backward pass", v.info().name));
  return *bw;
}

}  // namespace

std::unique_ptr<SavedState> Variant::compute_train(const Problem& p, ConstTensorView q,
                                                   ConstTensorView k, ConstTensorView v,
                                                   TensorView out) {
  Backward& bw = backward_of(*this);
  if (p.score != Score::dot && p.score != Score::bilinear) return bw.forward_train(p, q, k, v, out);
  Tensor mapped = linear_score_query(p, q);
  std::unique_ptr<SavedState> inner =
      bw.forward_train(linear_score_problem(p), mapped.view(), k, v, out);
  return std::make_unique<MappedQuerySaved>(std::move(mapped), std::move(inner));
}

namespace {

// out (a grouped view) = the sum of the heads of each group of per_head (one storage head per
// head, the same logical shape).
void sum_groups(ConstTensorView per_head, TensorView out) {
  const int64_t group = out.group, stored = out.shape.heads / group;
  const int64_t len = out.shape.len, d = out.shape.dim;
  const bool parallel = parallel_worth(double(out.shape.batch * out.shape.heads) * double(len * d),
                                       out.shape.batch * stored);
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
  for (int64_t b = 0; b < out.shape.batch; ++b)
    for (int64_t g = 0; g < stored; ++g) {
      float* o = out.head(b, g * group);
      for (int64_t i = 0; i < len; ++i) {
        float* orow = o + i * out.stride_row;
        const float* first = per_head.row(b, g * group, i);
        for (int64_t c = 0; c < d; ++c) orow[c] = first[c];
        for (int64_t r = 1; r < group; ++r) {
          const float* x = per_head.row(b, g * group + r, i);
          for (int64_t c = 0; c < d; ++c) orow[c] += x[c];
        }
      }
    }
}

}  // namespace

void Variant::compute_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                               ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                               const SavedState& saved, TensorView dq, TensorView dk, TensorView dv,
                               InputGrads* dinputs) {
  if (dk.group > 1 || dv.group > 1) {
    // Grouped-query attention: the variant writes the gradients of every query head's view of
    // k and v into per-head buffers, and a key/value head's gradient is the sum over the query
    // heads that read it.
    Tensor dk_heads(p.kv_shape()), dv_heads(p.kv_shape());
    compute_backward(p, q, k, v, out, dout, saved, dq, dk_heads.view(), dv_heads.view(), dinputs);
    sum_groups(dk_heads.view(), dk);
    sum_groups(dv_heads.view(), dv);
    return;
  }
  Backward& bw = backward_of(*this);
  const bool given = p.extra_inputs && !p.extra_inputs->empty();
  if (given && !dinputs)
    throw UsageError(spec() +
                     ": the problem gives inputs beyond q, k and v; the backward pass "
                     "needs somewhere to write their gradients");
  // the variant's pass, with the given inputs' gradients when there are any
  auto pass = [&](const Problem& pp, ConstTensorView qq, const SavedState& st, TensorView dqq) {
    if (given)
      bw.backward_inputs(pp, qq, k, v, out, dout, st, dqq, dk, dv, *dinputs);
    else
      bw.backward(pp, qq, k, v, out, dout, st, dqq, dk, dv);
  };
  if (p.score != Score::dot && p.score != Score::bilinear) {
    pass(p, q, saved, dq);
    return;
  }
  const auto* ms = dynamic_cast<const MappedQuerySaved*>(&saved);
  if (!ms || !ms->inner)
    throw UsageError("compute_backward: the saved state is not from compute_train on this score");
  // dL/dq' first, then back through q' = sqrt(d) q or q'_i = sqrt(d) W^T q_i
  Tensor dmapped(p.q_shape());
  pass(linear_score_problem(p), ms->mapped.view(), *ms->inner, dmapped.view());
  const int64_t d = p.dim;
  const float root = float(std::sqrt(double(d)));
  const float* w = p.score == Score::bilinear ? p.score_weights->w_bilinear.data() : nullptr;
  const ConstTensorView dm = dmapped.view();
  const bool parallel = parallel_worth(map_flops(p), p.batch * p.heads);
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* wh = w ? w + h * d * d : nullptr;
      for (int64_t i = 0; i < p.n; ++i) {
        const float* g = dm.row(b, h, i);
        float* o = dq.row(b, h, i);
        if (!wh) {
          for (int64_t c = 0; c < d; ++c) o[c] = root * g[c];
          continue;
        }
        // (W dq')_r = sum_c W[r, c] dq'_c
        for (int64_t r = 0; r < d; ++r) {
          const float* wr = wh + r * d;
          float acc = 0;
          for (int64_t c = 0; c < d; ++c) acc += wr[c] * g[c];
          o[r] = root * acc;
        }
      }
    }
}

std::unique_ptr<SavedState> Variant::run_train(const Problem& p, ConstTensorView q,
                                               ConstTensorView k, ConstTensorView v,
                                               TensorView out) {
  check_backward(p);
  expect_shape("q", q, p.q_shape());
  expect_kv_shape("k", k, p);
  expect_kv_shape("v", v, p);
  expect_shape("out", out, p.q_shape());
  return compute_train(p, q, k, v, out);
}

void Variant::run_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                           ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                           const SavedState& saved, TensorView dq, TensorView dk, TensorView dv,
                           InputGrads* dinputs) {
  check_backward(p);
  expect_shape("q", q, p.q_shape());
  expect_kv_shape("k", k, p);
  expect_kv_shape("v", v, p);
  expect_shape("out", out, p.q_shape());
  expect_shape("dout", dout, p.q_shape());
  expect_shape("dq", dq, p.q_shape());
  expect_kv_shape("dk", dk, p);
  expect_kv_shape("dv", dv, p);
  compute_backward(p, q, k, v, out, dout, saved, dq, dk, dv, dinputs);
}

Registry& Registry::instance() {
  static Registry r;
  return r;
}

void Registry::check(const VariantInfo& info, const std::map<std::string, ParamType>& types) const {
  if (info.name.empty() || info.name.find_first_of(":,= ") != std::string::npos)
    throw SpecError(fmt::format("invalid variant name '{}'", info.name));
  if (const VariantInfo* have = find(info.name))
    throw SpecError(fmt::format(
        "variant '{}' is already registered ({})", info.name,
        have->plugin.empty() ? std::string("built in") : "from plugin " + have->plugin));
  std::set<std::string> seen;
  for (const auto& ps : info.params) {
    if (!seen.insert(ps.name).second)
      throw SpecError(
          fmt::format("variant '{}' declares parameter '{}' twice", info.name, ps.name));
    auto it = types.find(ps.name);
    if (it != types.end() && it->second != ps.type)
      throw SpecError(fmt::format(
          "variant '{}' declares parameter '{}' as {}, but it is {} in another variant; a "
          "parameter name has one type across all variants",
          info.name, ps.name, to_string(ps.type), to_string(it->second)));
    canonical_value(info.name, ps, ps.default_value);  // the default must itself be valid
  }
  check_inputs(info);
  check_presentation(info);
}

namespace {

const ParamSpec* find_param(const VariantInfo& info, const std::string& name) {
  auto it = std::find_if(info.params.begin(), info.params.end(),
                         [&](const ParamSpec& ps) { return ps.name == name; });
  return it == info.params.end() ? nullptr : &*it;
}

}  // namespace

std::vector<const InputSpec*> Variant::inputs() const {
  std::vector<const InputSpec*> out;
  for (const InputSpec& in : info().inputs) {
    bool active = in.when.empty();
    if (!active) {
      // checked at registration: "param=value" with a declared parameter and a valid value
      const size_t eq = in.when.find('=');
      const std::string key = in.when.substr(0, eq);
      active = params_.text(key) ==
               canonical_value(info().name, *find_param(info(), key), in.when.substr(eq + 1));
    }
    if (active) out.push_back(&in);
  }
  return out;
}

std::string InputSpec::shape() const { return fmt::format("[{}]", fmt::join(dims, ", ")); }

void Registry::check_inputs(const VariantInfo& info) {
  static const std::set<std::string> letters = {"B", "H", "G", "n", "m", "d"};
  static const std::set<std::string> taken = {"q",          "k",   "v",   "do",     "attn_mask",
                                              "w_bilinear", "w_q", "w_k", "w_score"};
  auto param = [&](const std::string& name) { return find_param(info, name); };
  std::set<std::string> seen;
  for (const InputSpec& in : info.inputs) {
    if (in.name.empty() ||
        in.name.find_first_not_of(
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") !=
            std::string::npos ||
        taken.count(in.name))
      throw SpecError(fmt::format(
          "variant '{}' declares the input '{}'; accepted: a name of letters, digits and '_' "
          "other than {}",
          info.name, in.name, fmt::join(taken, ", ")));
    if (!seen.insert(in.name).second)
      throw SpecError(
          fmt::format("variant '{}' declares the input '{}' twice", info.name, in.name));
    if (!(in.min <= in.max))
      throw SpecError(fmt::format("variant '{}' declares the input '{}' with the range [{}, {}]",
                                  info.name, in.name, in.min, in.max));
    if (in.dims.empty())
      throw SpecError(
          fmt::format("variant '{}' declares the input '{}' without axes", info.name, in.name));
    for (const std::string& dim : in.dims) {
      const ParamSpec* ps = param(dim);
      if (!letters.count(dim) && !(ps && ps->type == ParamType::Int))
        throw SpecError(fmt::format(
            "variant '{}' declares the input '{}' with the axis '{}'; accepted: {} or an "
            "integer parameter of the variant",
            info.name, in.name, dim, fmt::join(letters, ", ")));
    }
    if (!in.when.empty()) {
      const size_t eq = in.when.find('=');
      const ParamSpec* ps = eq == std::string::npos ? nullptr : param(in.when.substr(0, eq));
      if (!ps)
        throw SpecError(fmt::format(
            "variant '{}' declares the input '{}' when '{}'; accepted: 'param=value' with a "
            "parameter of the variant, or empty",
            info.name, in.name, in.when));
      canonical_value(info.name, *ps, in.when.substr(eq + 1));
    }
  }
}

void Registry::check_presentation(const VariantInfo& info) {
  if (std::find_if(std::begin(kFamilies), std::end(kFamilies),
                   [&](const char* f) { return info.family == f; }) == std::end(kFamilies))
    throw SpecError(fmt::format("variant '{}' has family '{}'; accepted: {}", info.name,
                                info.family, fmt::join(kFamilies, ", ")));
  const std::string& c = info.look.color;
  if (!c.empty() && (c.size() != 7 || c[0] != '#' ||
                     c.find_first_not_of("0123456789abcdefABCDEF", 1) != std::string::npos))
    throw SpecError(
        fmt::format("variant '{}' has colour '{}'; accepted: \"#rrggbb\" or empty", info.name, c));
  static const std::set<std::string> markers = {"o", "s", "^", "v", "D", "P", "X", "<", ">", "h"};
  if (!info.look.marker.empty() && !markers.count(info.look.marker))
    throw SpecError(fmt::format("variant '{}' has marker '{}'; accepted: {} or empty", info.name,
                                info.look.marker, fmt::join(markers, " ")));
  for (const std::string& spec : info.sweep_specs) {
    // "name:key=value,...": this variant, with parameters it declares and values they accept
    auto [name, kv] = parse_spec(spec);
    if (name != info.name || kv.empty())
      throw SpecError(
          fmt::format("variant '{}' lists the sweep setting '{}'; accepted: '{}:' "
                      "followed by parameters of '{}'",
                      info.name, spec, info.name, info.name));
    for (const auto& setting : kv) {
      const std::string& key = setting.first;
      const std::string& value = setting.second;
      auto it = std::find_if(info.params.begin(), info.params.end(),
                             [&](const ParamSpec& ps) { return ps.name == key; });
      if (it == info.params.end())
        throw SpecError(
            fmt::format("variant '{}' lists the sweep setting '{}', whose parameter "
                        "'{}' it does not declare",
                        info.name, spec, key));
      canonical_value(info.name, *it, value);
    }
  }
}

bool Registry::add(VariantInfo info) {
  // Check everything first, so a rejected variant leaves no trace in the registry.
  check(info, param_types_);
  for (const auto& ps : info.params) param_types_.emplace(ps.name, ps.type);
  auto name = info.name;
  variants_.emplace(name, std::make_unique<VariantInfo>(std::move(info)));
  return true;
}

void Registry::add_all(std::vector<VariantInfo> infos) {
  // Check the whole batch against the registry and against itself before adding any.
  auto types = param_types_;
  std::set<std::string> names;
  for (const auto& info : infos) {
    check(info, types);
    if (!names.insert(info.name).second)
      throw SpecError(fmt::format("variant '{}' is registered twice", info.name));
    for (const auto& ps : info.params) types.emplace(ps.name, ps.type);
  }
  for (auto& info : infos) add(std::move(info));
}

void Registry::open_stage() {
  staging_ = true;
  staged_.clear();
}

std::vector<VariantInfo> Registry::close_stage() {
  staging_ = false;
  return std::exchange(staged_, {});
}

bool Registry::register_static(VariantInfo info) {
  // While a plugin loads, its static initialisers run inside dlopen: nothing may throw
  // there, and nothing may be added before the loader has checked the whole plugin.
  if (staging_) {
    staged_.push_back(std::move(info));
    return true;
  }
  return add(std::move(info));
}

bool ATTNBENCH_REGISTER_ENTRY(VariantInfo info) {
  return Registry::instance().register_static(std::move(info));
}

const VariantInfo* Registry::find(std::string_view name) const {
  auto it = variants_.find(name);
  return it == variants_.end() ? nullptr : it->second.get();
}

std::vector<const VariantInfo*> Registry::all() const {
  std::vector<const VariantInfo*> out;
  for (const auto& [name, info] : variants_) out.push_back(info.get());
  return out;
}

std::string Registry::names() const {
  std::vector<std::string> n;
  for (const auto& [name, info] : variants_) n.push_back(name);
  return fmt::format("{}", fmt::join(n, ", "));
}

std::pair<std::string, std::vector<std::pair<std::string, std::string>>> parse_spec(
    std::string_view spec) {
  auto malformed = [&](const std::string& why) {
    return SpecError(
        fmt::format("malformed variant spec '{}': {}; expected name or "
                    "name:key=value,key=value",
                    spec, why));
  };
  auto colon = spec.find(':');
  std::string name(spec.substr(0, colon));
  if (name.empty()) throw malformed("the variant name is empty");
  if (name.find_first_of(",= ") != std::string::npos)
    throw malformed(fmt::format("'{}' is not a variant name", name));
  std::vector<std::pair<std::string, std::string>> kv;
  if (colon == std::string_view::npos) return {name, kv};
  std::string_view rest = spec.substr(colon + 1);
  if (rest.empty()) throw malformed("nothing after ':'");
  std::set<std::string> seen;
  while (true) {
    auto comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    auto eq = item.find('=');
    if (eq == std::string_view::npos) throw malformed(fmt::format("'{}' has no '='", item));
    std::string key(item.substr(0, eq)), value(item.substr(eq + 1));
    if (key.empty()) throw malformed(fmt::format("'{}' has an empty key", item));
    if (value.empty()) throw malformed(fmt::format("'{}' has an empty value", item));
    if (!seen.insert(key).second) throw malformed(fmt::format("'{}' is given twice", key));
    kv.emplace_back(std::move(key), std::move(value));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return {name, kv};
}

const VariantInfo& Registry::get(std::string_view name) const {
  if (const VariantInfo* info = find(name)) return *info;
  std::vector<std::string> known;
  for (const auto& entry : variants_) known.push_back(entry.first);
  throw SpecError(fmt::format("unknown variant '{}'{}; registered variants: {}", name,
                              did_you_mean(name, known), names()));
}

std::unique_ptr<Variant> Registry::make(std::string_view spec) const {
  auto [name, kv] = parse_spec(spec);
  const VariantInfo* info = &get(name);
  ParamValues values;
  for (const auto& ps : info->params)
    values.values[ps.name] = canonical_value(name, ps, ps.default_value);
  for (const auto& [key, value] : kv) {
    auto it = std::find_if(info->params.begin(), info->params.end(),
                           [&key = key](const ParamSpec& ps) { return ps.name == key; });
    if (it == info->params.end()) {
      std::vector<std::string> valid;
      for (const auto& ps : info->params) valid.push_back(ps.name);
      throw SpecError(fmt::format(
          "variant '{}' has no parameter '{}'{}; its parameters: {}", name, key,
          did_you_mean(key, valid),
          valid.empty() ? std::string("(none)") : fmt::format("{}", fmt::join(valid, ", "))));
    }
    values.values[key] = canonical_value(name, *it, value);
  }
  auto variant = info->make(values);
  variant->info_ = info;
  variant->params_ = std::move(values);
  return variant;
}

std::unique_ptr<Variant> make_variant(std::string_view spec) {
  return Registry::instance().make(spec);
}

}  // namespace attnbench
