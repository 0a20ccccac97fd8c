#include "harness/layer.h"

#include <cblas.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include "common/core/checked.h"
#include "common/core/error.h"
#include "common/core/random.h"
#include "common/patterns/pattern.h"
#include "common/reference/reference.h"

namespace attnbench {

namespace {

// Streams of the seeded layer, apart from those of generated attention inputs.
constexpr uint64_t kStreamInProj = 0x1a7e5001, kStreamOutProj = 0x1a7e5002,
                   kStreamQuery = 0x1a7e5003, kStreamKey = 0x1a7e5004, kStreamValue = 0x1a7e5005;

Tensor matrix(int64_t rows, int64_t cols) { return Tensor({1, 1, rows, cols}); }

void fill_uniform(Tensor& t, uint64_t seed, uint64_t stream, double bound) {
  const RandomStream rs(seed, stream);
  float* x = t.data();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = float((2 * rs.uniform(uint64_t(i)) - 1) * bound);
}

void fill_gaussian(Tensor& t, uint64_t seed, uint64_t stream) {
  const RandomStream rs(seed, stream);
  float* x = t.data();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = float(rs.normal(uint64_t(i)));
}

std::string shape_text(const std::vector<int64_t>& s) {
  return fmt::format("({})", fmt::join(s, ", "));
}

// The names of a layer file: the ones it must hold, and the ones of torch's state_dict the
// layer cannot honour yet (with why).
const std::vector<std::string> kLayerArrays = {
    "query", "key", "value", "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"};
const std::vector<std::string> kMaskArrays = {"key_padding_mask", "attn_mask"};

std::string unsupported_array(const std::string& key) {
  if (key == "q_proj_weight" || key == "k_proj_weight" || key == "v_proj_weight")
    return "separate q/k/v projection weights (kdim or vdim different from the embedding "
           "size) are not supported; the layer takes one in_proj_weight [3E, E]";
  if (key == "bias_k" || key == "bias_v") return "add_bias_kv is not supported";
  return "";
}

// y [rows, E] (double) = x [rows, E] W_blockᵀ + b_block, in float64.
std::vector<double> project_double(const float* x, int64_t rows, int64_t e, const float* w,
                                   const float* bias) {
  std::vector<double> xd(size_t(rows * e)), wd(size_t(e * e)), y(size_t(rows * e));
  std::copy(x, x + rows * e, xd.begin());
  std::copy(w, w + e * e, wd.begin());
  for (int64_t r = 0; r < rows; ++r) std::copy(bias, bias + e, y.begin() + r * e);
  if (rows > 0)
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(e), int(e), 1.0, xd.data(),
                int(e), wd.data(), int(e), 1.0, y.data(), int(e));
  return y;
}

// Rounds a projection [len, E] of one batch item to the float heads [1, H, len, d].
Tensor split_heads(const std::vector<double>& y, int64_t len, int64_t heads, int64_t d) {
  Tensor t({1, heads, len, d});
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < len; ++i)
      for (int64_t c = 0; c < d; ++c)
        t.data()[(h * len + i) * d + c] = float(y[size_t(i * heads * d + h * d + c)]);
  return t;
}

// A view of one batch item's heads [1, H, len, d] as batch item b of [B, H, len, d]: every b
// reads the same data (stride 0), so the reference can be asked for (b, h) directly.
ConstTensorView as_batch(const Tensor& t, int64_t batch) {
  ConstTensorView v = t.view();
  v.shape.batch = batch;
  v.stride_b = 0;
  return v;
}

// key_padding_mask [B, S] as an additive bias per (b, j) (bool/uint8: true = padded gives
// -inf; float32: added to the logits), and as valid lengths when every row is "valid keys,
// then padding" (empty otherwise).
struct KeyPadding {
  std::vector<float> bias;
  std::vector<int64_t> lengths;
};

KeyPadding read_key_padding(const NpyArray& a, const std::string& what, int64_t batch,
                            int64_t keys) {
  const std::string accepted = fmt::format(
      "accepted: key_padding_mask of shape [B, S] = ({}, {}), bool or uint8 (true = padded key, "
      "as torch.nn.MultiheadAttention) or float32 (added to the logits, -inf = padded)",
      batch, keys);
  const bool is_bool = a.dtype == "|b1" || a.dtype == "|u1";
  if (!is_bool && a.dtype != "<f4")
    throw InputError(
        fmt::format("{}: 'key_padding_mask' has dtype {}; {}", what, a.dtype, accepted));
  if (a.shape != std::vector<int64_t>{batch, keys})
    throw InputError(fmt::format("{}: 'key_padding_mask' has shape {}; {}", what,
                                 shape_text(a.shape), accepted));
  const int64_t count = batch * keys;
  if (uint64_t(count) * (is_bool ? 1 : sizeof(float)) != a.data.size())
    throw InputError(fmt::format("{}: 'key_padding_mask' has shape {} but {} bytes of data", what,
                                 shape_text(a.shape), a.data.size()));
  KeyPadding kp;
  kp.bias.resize(size_t(count));
  if (is_bool) {
    for (int64_t e = 0; e < count; ++e) kp.bias[size_t(e)] = a.data[size_t(e)] ? -INFINITY : 0.0f;
  } else {
    std::memcpy(kp.bias.data(), a.data.data(), size_t(count) * sizeof(float));
    for (int64_t e = 0; e < count; ++e)
      if (std::isnan(kp.bias[size_t(e)]) || kp.bias[size_t(e)] == INFINITY)
        throw InputError(fmt::format(
            "{}: 'key_padding_mask' holds {} at flat index {}; finite values and -inf only ({})",
            what, kp.bias[size_t(e)], e, accepted));
  }
  for (int64_t b = 0; b < batch; ++b) {
    const float* row = kp.bias.data() + b * keys;
    int64_t len = 0;
    while (len < keys && row[len] == 0.0f) ++len;
    for (int64_t j = len; j < keys; ++j)
      if (row[j] != -INFINITY) return {std::move(kp.bias), {}};  // not an end padding
    kp.lengths.push_back(len);
  }
  return kp;
}

// attn_mask [L, S] or [B H, L, S] (PyTorch's layout) as the core's mask [1 or B, 1 or H, L, S],
// with a key padding bias [B, S] folded in when there is one.
std::shared_ptr<const AttnMask> read_layer_mask(const NpyArray* a, const KeyPadding* kp,
                                                const std::string& what, const Problem& p) {
  const int64_t m = p.keys();
  std::shared_ptr<const AttnMask> mask;
  if (a) {
    const bool per_head = a->shape.size() == 3 && a->shape[0] == p.batch * p.heads &&
                          a->shape[1] == p.n && a->shape[2] == m;
    if (!(a->shape == std::vector<int64_t>{p.n, m}) && !per_head)
      throw InputError(fmt::format(
          "{}: 'attn_mask' has shape {}; accepted: [L, S] = ({}, {}) or [B H, L, S] = ({}, {}, "
          "{}) with H = --heads {} (torch.nn.MultiheadAttention's layouts), bool or uint8 "
          "(true = masked out) or float32 (added to the logits)",
          what, shape_text(a->shape), p.n, m, p.batch * p.heads, p.n, m, p.heads));
    NpyArray as4 = *a;
    as4.shape =
        per_head ? std::vector<int64_t>{p.batch, p.heads, p.n, m} : std::vector<int64_t>{p.n, m};
    mask = attn_mask_from_array(as4, fmt::format("{}: 'attn_mask'", what), p);
  }
  const std::string file = std::filesystem::path(what).filename().string();
  if (!kp || kp->bias.empty() || !kp->lengths.empty()) {
    if (!mask) return nullptr;
    auto named = std::make_shared<AttnMask>(*mask);
    named->name = file + ":attn_mask";
    return named;
  }
  // A key padding that is not an end padding: its bias joins every head's mask.
  auto folded = std::make_shared<AttnMask>();
  folded->batch = p.batch, folded->heads = mask ? mask->heads : 1;
  folded->n = p.n, folded->m = m;
  folded->bias.resize(size_t(folded->batch * folded->heads * p.n * m));
  folded->is_bool = !mask || mask->is_bool;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < folded->heads; ++h)
      for (int64_t i = 0; i < p.n; ++i)
        for (int64_t j = 0; j < m; ++j) {
          const float x = kp->bias[size_t(b * m + j)];
          folded->bias[size_t(((b * folded->heads + h) * p.n + i) * m + j)] =
              mask ? mask->at(b, h, i, j) + x : x;
          if (x != 0.0f && x != -INFINITY) folded->is_bool = false;
        }
  folded->name = file + (mask ? ":attn_mask+key_padding_mask" : ":key_padding_mask");
  return folded;
}

}  // namespace

// ----- problem -----

Problem LayerProblem::attention() const {
  Problem p;
  p.batch = batch, p.heads = heads, p.n = n, p.m = m, p.dim = head_dim();
  p.causal = causal, p.seed = seed;
  p.key_lengths = key_lengths, p.attn_mask = attn_mask;
  return p;
}

void LayerProblem::validate() const {
  if (embed <= 0)
    throw UsageError(fmt::format("embed (E) must be a positive integer, got {}", embed));
  if (heads <= 0) throw UsageError(fmt::format("heads must be a positive integer, got {}", heads));
  if (embed % heads != 0)
    throw UsageError(fmt::format(
        "embed {} is not divisible by heads {}; accepted: E a multiple of H (each head has "
        "d = E / H features)",
        embed, heads));
  // Every tensor the layer forms must fit in int64: B L E, B S E, 3E E.
  for (int64_t len : {n, keys()})
    if (checked_mul(checked_mul(batch, len), embed) < 0)
      throw UsageError(fmt::format("B={} x len={} x E={} overflows", batch, len, embed));
  if (checked_mul(3 * embed, embed) < 0)
    throw UsageError(fmt::format("embed {} is too large: 3E x E overflows", embed));
  attention().validate();
}

std::string LayerProblem::str() const { return fmt::format("E={},{}", embed, attention().str()); }

// ----- data -----

LayerParams init_layer_params(int64_t embed, uint64_t seed) {
  LayerParams p{matrix(3 * embed, embed), matrix(1, 3 * embed), matrix(embed, embed),
                matrix(1, embed)};
  // xavier_uniform_ on [3E, E]: fan_in E, fan_out 3E.
  fill_uniform(p.in_proj_weight, seed, kStreamInProj, std::sqrt(6.0 / double(4 * embed)));
  // nn.Linear: kaiming_uniform_(a = √5) gives the bound √(6 / ((1 + 5) E)) = 1 / √E.
  fill_uniform(p.out_proj_weight, seed, kStreamOutProj, 1.0 / std::sqrt(double(embed)));
  return p;  // biases stay zero
}

LayerData generate_layer_data(const LayerProblem& lp) {
  lp.validate();
  LayerData d;
  d.params = init_layer_params(lp.embed, lp.seed);
  d.in.query = Tensor({lp.batch, 1, lp.n, lp.embed});
  fill_gaussian(d.in.query, lp.seed, kStreamQuery);
  d.in.key = Tensor({lp.batch, 1, lp.keys(), lp.embed});
  d.in.value = Tensor({lp.batch, 1, lp.keys(), lp.embed});
  if (lp.m == 0) {  // self-attention: key = value = query
    std::memcpy(d.in.key.data(), d.in.query.data(), size_t(d.in.query.numel()) * sizeof(float));
    std::memcpy(d.in.value.data(), d.in.query.data(), size_t(d.in.query.numel()) * sizeof(float));
  } else {
    fill_gaussian(d.in.key, lp.seed, kStreamKey);
    fill_gaussian(d.in.value, lp.seed, kStreamValue);
  }
  return d;
}

LayerData load_layer_npz(const std::string& path, LayerProblem* lp) {
  return layer_from_arrays(read_npz(path), path, lp);
}

LayerData layer_from_arrays(const std::map<std::string, NpyArray>& arrays, const std::string& what,
                            LayerProblem* lp) {
  for (const auto& [key, a] : arrays) {
    if (std::find(kLayerArrays.begin(), kLayerArrays.end(), key) != kLayerArrays.end() ||
        std::find(kMaskArrays.begin(), kMaskArrays.end(), key) != kMaskArrays.end())
      continue;
    if (std::string why = unsupported_array(key); !why.empty())
      throw UnsupportedError(fmt::format("{}: holds '{}': {}", what, key, why));
    throw InputError(fmt::format("{}: unknown array '{}'; a layer file holds {} and optionally {}",
                                 what, key, fmt::join(kLayerArrays, ", "),
                                 fmt::join(kMaskArrays, ", ")));
  }
  // The array `key` with its dtype, data size and finiteness checked; its shape must have
  // `axes` axes (the values are checked by the caller against the others).
  auto take = [&](const std::string& key, size_t axes,
                  const std::string& layout) -> const NpyArray& {
    auto it = arrays.find(key);
    if (it == arrays.end()) {
      std::vector<std::string> keys;
      for (const auto& [k, a] : arrays) keys.push_back(k);
      throw InputError(fmt::format(
          "{}: no array '{}' {}; a layer file holds float32 {} (PyTorch's names); it holds: {}",
          what, key, layout, fmt::join(kLayerArrays, ", "),
          keys.empty() ? std::string("nothing") : fmt::format("{}", fmt::join(keys, ", "))));
    }
    const NpyArray& a = it->second;
    if (a.dtype != "<f4")
      throw InputError(fmt::format(
          "{}: '{}' has dtype {}, expected float32 ('<f4'); convert with .astype(np.float32)", what,
          key, a.dtype));
    if (a.shape.size() != axes)
      throw InputError(fmt::format("{}: '{}' has shape {}, expected {} axes {}", what, key,
                                   shape_text(a.shape), axes, layout));
    for (int64_t s : a.shape)
      if (s <= 0)
        throw InputError(
            fmt::format("{}: '{}' has an empty axis: shape {}", what, key, shape_text(a.shape)));
    if (uint64_t(a.numel()) * sizeof(float) != a.data.size())
      throw InputError(fmt::format("{}: '{}' has shape {} but {} bytes of data", what, key,
                                   shape_text(a.shape), a.data.size()));
    return a;
  };
  auto expect = [&](const std::string& key, const NpyArray& a, const std::vector<int64_t>& want,
                    const std::string& layout) {
    if (a.shape != want)
      throw InputError(fmt::format("{}: '{}' has shape {}; accepted: {} = {} (from query {})", what,
                                   key, shape_text(a.shape), layout, shape_text(want),
                                   shape_text(arrays.at("query").shape)));
  };
  const NpyArray& q = take("query", 3, "[B, L, E]");
  const int64_t b = q.shape[0], l = q.shape[1], e = q.shape[2];
  const NpyArray& k = take("key", 3, "[B, S, E]");
  const int64_t s = k.shape[1];
  expect("key", k, {b, s, e}, "[B, S, E]");
  expect("value", take("value", 3, "[B, S, E]"), {b, s, e}, "[B, S, E], the shape of key");
  expect("in_proj_weight", take("in_proj_weight", 2, "[3E, E]"), {3 * e, e}, "[3E, E]");
  expect("in_proj_bias", take("in_proj_bias", 1, "[3E]"), {3 * e}, "[3E]");
  expect("out_proj.weight", take("out_proj.weight", 2, "[E, E]"), {e, e}, "[E, E]");
  expect("out_proj.bias", take("out_proj.bias", 1, "[E]"), {e}, "[E]");
  lp->batch = b, lp->n = l, lp->m = s, lp->embed = e;
  lp->key_lengths.clear();
  lp->attn_mask = nullptr;
  std::optional<KeyPadding> kp;
  if (auto it = arrays.find("key_padding_mask"); it != arrays.end()) {
    kp = read_key_padding(it->second, what, b, s);
    lp->key_lengths = kp->lengths;
  }
  const auto mask_it = arrays.find("attn_mask");
  lp->attn_mask = read_layer_mask(mask_it == arrays.end() ? nullptr : &mask_it->second,
                                  kp ? &*kp : nullptr, what, lp->attention());

  auto copy = [&](const std::string& key, Shape4 shape) {
    const NpyArray& a = arrays.at(key);
    Tensor t(shape);
    std::memcpy(t.data(), a.data.data(), a.data.size());
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(t.data()[i]))
        throw InputError(fmt::format(
            "{}: '{}' holds a non-finite value ({}) at flat index {}; inputs must be finite", what,
            key, t.data()[i], i));
    return t;
  };
  LayerData d;
  d.in.query = copy("query", {b, 1, l, e});
  d.in.key = copy("key", {b, 1, s, e});
  d.in.value = copy("value", {b, 1, s, e});
  d.params.in_proj_weight = copy("in_proj_weight", {1, 1, 3 * e, e});
  d.params.in_proj_bias = copy("in_proj_bias", {1, 1, 1, 3 * e});
  d.params.out_proj_weight = copy("out_proj.weight", {1, 1, e, e});
  d.params.out_proj_bias = copy("out_proj.bias", {1, 1, 1, e});
  return d;
}

void write_layer_npz(const std::string& path, const Tensor& output, const Tensor* weights) {
  auto array = [](const Tensor& t) {
    NpyArray a = to_npy(t);
    a.shape = {t.shape().batch, t.shape().len, t.shape().dim};  // [B, 1, len, x] -> [B, len, x]
    return a;
  };
  std::map<std::string, NpyArray> arrays{{"output", array(output)}};
  if (weights) arrays.emplace("attn_weights", array(*weights));
  write_npz(path, arrays);
}

// ----- the layer -----

Layer::Layer(Variant& variant, const LayerProblem& lp)
    : variant_(variant), lp_(lp), core_(lp.attention()) {
  lp_.validate();
  variant_.check_supported(core_);
  q_ = Tensor(core_.q_shape());
  o_ = Tensor(core_.q_shape());
  k_ = Tensor(core_.kv_shape());
  v_ = Tensor(core_.kv_shape());
  rows_ = matrix(lp.batch * std::max(lp.n, lp.keys()), lp.embed);
}

namespace {

// heads [B, H, len, d] = x [B, 1, len, E] W_blockᵀ + b_block, through `rows` [B len, E].
void project(const Tensor& x, const LayerParams& params, int64_t block, Tensor& rows,
             Tensor& heads) {
  const Shape4 s = heads.shape();
  const int64_t e = s.heads * s.dim, n_rows = s.batch * s.len;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n_rows), int(e), int(e), 1.0f, x.data(),
              int(e), params.in_proj_weight.data() + block * e * e, int(e), 0.0f, rows.data(),
              int(e));
  const float* bias = params.in_proj_bias.data() + block * e;
  const float* y = rows.data();
  TensorView out = heads.view();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.len; ++i) {
      const float* yr = y + (b * s.len + i) * e;
      for (int64_t h = 0; h < s.heads; ++h) {
        float* dst = out.row(b, h, i);
        for (int64_t c = 0; c < s.dim; ++c) dst[c] = yr[h * s.dim + c] + bias[h * s.dim + c];
      }
    }
}

}  // namespace

void Layer::forward(const LayerInputs& in, const LayerParams& params, TensorView out) {
  const double t0 = omp_get_wtime();
  // pass 1: in-projection, split into heads
  project(in.query, params, 0, rows_, q_);
  project(in.key, params, 1, rows_, k_);
  project(in.value, params, 2, rows_, v_);
  // pass 2: the attention core
  const double c0 = omp_get_wtime();
  variant_.run(core_, q_.view(), k_.view(), v_.view(), o_.view());
  core_seconds_ += omp_get_wtime() - c0;
  // pass 3: concat the heads into rows [B L, E]
  const Shape4 s = o_.shape();
  const int64_t e = lp_.embed;
  float* rows = rows_.data();
  const ConstTensorView o = o_.view();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.len; ++i)
      for (int64_t h = 0; h < s.heads; ++h)
        std::memcpy(rows + (b * s.len + i) * e + h * s.dim, o.row(b, h, i),
                    size_t(s.dim) * sizeof(float));
  // pass 4: out-projection
  const int64_t n_rows = s.batch * s.len;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n_rows), int(e), int(e), 1.0f, rows,
              int(e), params.out_proj_weight.data(), int(e), 0.0f, out.data, int(e));
  const float* bias = params.out_proj_bias.data();
  float* y = out.data;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t c = 0; c < e; ++c) y[r * e + c] += bias[c];
  layer_seconds_ += omp_get_wtime() - t0;
}

void require_weights(const Variant& variant) {
  if (!variant.info().caps.exact)
    throw UnsupportedError(fmt::format(
        "need_weights: variant '{}' approximates attention and has no attention probabilities; "
        "variants that give them: the exact ones ('exact' in `attnbench list`)",
        variant.spec()));
}

Tensor Layer::attention_weights() const {
  require_weights(variant_);
  auto pattern = variant_.make_pattern(core_, q_.view(), k_.view());
  Tensor w({lp_.batch, 1, lp_.n, lp_.keys()});
  const int64_t m = lp_.keys();
  const double inv_h = 1.0 / double(lp_.heads);
#pragma omp parallel for collapse(2) schedule(dynamic, 16)
  for (int64_t b = 0; b < lp_.batch; ++b)
    for (int64_t i = 0; i < lp_.n; ++i) {
      std::vector<double> sum(size_t(m), 0.0);
      for (int64_t h = 0; h < lp_.heads; ++h) {
        const auto prob =
            reference_probabilities(core_, q_.view(), k_.view(), b, h, i, pattern.get());
        for (int64_t j = 0; j < m; ++j) sum[size_t(j)] += prob[size_t(j)];
      }
      float* dst = w.data() + (b * lp_.n + i) * m;
      for (int64_t j = 0; j < m; ++j) dst[j] = float(sum[size_t(j)] * inv_h);
    }
  return w;
}

// ----- float64 layer and error -----

std::vector<double> reference_layer_rows(const LayerProblem& lp, const LayerData& data, int64_t b,
                                         const std::vector<int64_t>& rows) {
  const int64_t e = lp.embed, h_count = lp.heads, d = lp.head_dim(), l = lp.n, s = lp.keys();
  const LayerParams& prm = data.params;
  const float* w = prm.in_proj_weight.data();
  const float* bias = prm.in_proj_bias.data();
  // pass 1: projections of batch item b in float64, rounded to float heads for the core
  const Tensor q =
      split_heads(project_double(data.in.query.data() + b * l * e, l, e, w, bias), l, h_count, d);
  const Tensor k = split_heads(
      project_double(data.in.key.data() + b * s * e, s, e, w + e * e, bias + e), s, h_count, d);
  const Tensor v = split_heads(
      project_double(data.in.value.data() + b * s * e, s, e, w + 2 * e * e, bias + 2 * e), s,
      h_count, d);
  // pass 2: the reference core per head, concatenated into rows x E
  const Problem p = lp.attention();
  const int64_t r_count = int64_t(rows.size());
  std::vector<double> concat(size_t(r_count * e)), head(size_t(r_count * d));
  for (int64_t h = 0; h < h_count; ++h) {
    reference_rows(p, as_batch(q, lp.batch), as_batch(k, lp.batch), as_batch(v, lp.batch), b, h,
                   rows, head.data());
    for (int64_t r = 0; r < r_count; ++r)
      std::copy(head.begin() + r * d, head.begin() + (r + 1) * d, concat.begin() + r * e + h * d);
  }
  // pass 3: out-projection in float64
  std::vector<double> wo(prm.out_proj_weight.data(), prm.out_proj_weight.data() + e * e);
  std::vector<double> out(size_t(r_count * e));
  for (int64_t r = 0; r < r_count; ++r)
    std::copy(prm.out_proj_bias.data(), prm.out_proj_bias.data() + e, out.begin() + r * e);
  if (r_count > 0)
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(r_count), int(e), int(e), 1.0,
                concat.data(), int(e), wo.data(), int(e), 1.0, out.data(), int(e));
  return out;
}

ErrorStats measure_layer_error(const LayerProblem& lp, const LayerData& data, ConstTensorView out,
                               double exact_limit) {
  const Problem p = lp.attention();
  const auto sample = pick_rows(p, exact_limit);
  const int64_t e = lp.embed;
  ErrorStats st;
  st.rows_total = lp.batch * lp.n;
  double diff2 = 0, ref2 = 0, cos_sum = 0;
  for (int64_t b = 0; b < lp.batch; ++b) {
    // The rows of head (b, 0): the layer's rows mix every head, so one list per batch item.
    const auto& rows = sample[size_t(b * lp.heads)];
    const auto ref = reference_layer_rows(lp, data, b, rows);
    for (size_t t = 0; t < rows.size(); ++t) {
      const float* o = out.row(b, 0, rows[t]);
      double dot = 0, nn = 0, nr = 0;
      for (int64_t c = 0; c < e; ++c) {
        const double a = o[c], x = ref[t * size_t(e) + size_t(c)];
        if (!std::isfinite(a) || !std::isfinite(x))
          throw Error(fmt::format(
              "the error cannot be measured: {} holds a non-finite value ({}) at batch {}, "
              "row {}, feature {}",
              std::isfinite(x) ? "the layer's output" : "the float64 layer",
              std::isfinite(x) ? a : x, b, rows[t], c));
        diff2 += (a - x) * (a - x);
        ref2 += x * x;
        dot += a * x, nn += a * a, nr += x * x;
        st.max_abs = std::max(st.max_abs, std::abs(a - x));
      }
      if (nn == 0 && nr == 0)
        cos_sum += 1;
      else if (nn > 0 && nr > 0)
        cos_sum += dot / (std::sqrt(nn) * std::sqrt(nr));
    }
    st.rows_used += int64_t(rows.size());
  }
  st.rel_fro = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  st.mean_cos = st.rows_used ? cos_sum / double(st.rows_used) : 0;
  if (!std::isfinite(st.rel_fro) || !std::isfinite(st.mean_cos))
    throw Error(
        fmt::format("the error against the float64 layer is not finite (rel_fro {})", st.rel_fro));
  return st;
}

// ----- cost -----

double layer_flops(const Variant& variant, const LayerProblem& lp) {
  const double e2 = double(lp.embed) * double(lp.embed), b = double(lp.batch);
  return 2 * b * e2 * (2 * double(lp.n) + 2 * double(lp.keys())) + variant.flops(lp.attention());
}

double layer_memory_estimate(const Variant& variant, const LayerProblem& lp) {
  const double b = double(lp.batch), e = double(lp.embed), l = double(lp.n), s = double(lp.keys());
  return 4 * b * e * (2 * l + 2 * s + std::max(l, s)) + variant.memory_estimate(lp.attention());
}

// ----- run -----

Row run_layer(Variant& variant, const LayerProblem& lp, const Workload& w, const LayerData* given,
              const MachineFigures& mf, const RunOptions& opt, bool need_weights, Tensor* output,
              Tensor* weights, nlohmann::json* bench_json) {
  Row row;
  row.embed = lp.embed;
  row.workload = w;
  std::optional<ThreadTeam> team;
  try {
    row.spec = variant.spec();
    row.variant = variant.info().name;
    check_run_options(opt);
    if (w.pass != "fwd")
      throw UsageError(fmt::format(
          "pass {}: the multi-head layer measures the forward pass only; accepted: fwd", w.pass));
    lp.validate();
    row.problem = lp.attention();
    row.workload.threads = resolve_threads(w.threads);
    team.emplace(row.workload.threads);
    if (!given && (w.input != "gaussian" || w.scale != 1.0))
      throw UsageError(fmt::format(
          "the layer draws gaussian inputs and parameters from the seed; input '{}' with scale "
          "{} applies to plain attention only (accepted for a layer: gaussian, scale 1)",
          w.input, w.scale));
    w.validate(row.problem);
    variant.check_supported(row.problem);
    if (need_weights) require_weights(variant);
    row.flops = layer_flops(variant, lp);
    row.estimated_bytes = layer_memory_estimate(variant, lp);
    const double b = double(lp.batch), e = double(lp.embed), l = double(lp.n),
                 s = double(lp.keys());
    const double data_bytes = 4 * (b * e * (l + 2 * s) + 4 * e * e + 4 * e);
    const double reference_bytes = 8 * 5 * std::max(l, s) * e;  // one batch item's float64 layer
    const double need = row.estimated_bytes + (given ? 0 : data_bytes) + 4 * b * l * e +
                        reference_bytes + (need_weights ? 4 * b * l * s : 0);
    if (std::string why = too_large(need, row.estimated_bytes, opt); !why.empty()) {
      row.status = "skipped";
      row.message = why;
      return row;
    }

    // the per-pass work of a prepared variant leaves its draws out
    if (prepare_variant(variant, row.problem, row)) row.flops = layer_flops(variant, lp);

    LayerData generated;
    if (!given) generated = generate_layer_data(lp);
    const LayerData& data = given ? *given : generated;
    Layer layer(variant, lp);
    Tensor out({lp.batch, 1, lp.n, lp.embed});
    // Checked pass: its output is what the error is measured on.
    layer.forward(data.in, data.params, out.view());
    for (int64_t i = 0; i < out.numel(); ++i)
      if (!std::isfinite(out.data()[i])) {
        row.status = "error";
        row.message = fmt::format(
            "the layer's output holds a non-finite value ({}) at flat index {}", out.data()[i], i);
        return row;
      }
    if (need_weights) {
      Tensor wts = layer.attention_weights();
      if (weights) *weights = std::move(wts);
    }
    const double e0 = omp_get_wtime();
    row.error = measure_layer_error(lp, data, out.view(), opt.exact_limit);
    row.error_seconds = omp_get_wtime() - e0;

    layer.reset_clock();
    if (!time_passes(
            fmt::format("layer:E={}/{}/{}", lp.embed, row.spec, describe(row.problem, w)), opt, mf,
            [&] { layer.forward(data.in, data.params, out.view()); }, row, bench_json))
      return row;
    row.notes = variant.notes();
    row.attention_share =
        layer.layer_seconds() > 0 ? layer.core_seconds() / layer.layer_seconds() : NAN;
    if (output) *output = std::move(out);
  } catch (const std::exception& e) {
    record_failure(row, e);
  }
  return row;
}

}  // namespace attnbench
