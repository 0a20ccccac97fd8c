// The multi-head layer (harness/layer.h): PyTorch's initialisation, the float32 layer against a
// plain float64 one written here, the float64 layer of the harness against the same, averaged
// attention weights, the layer file's checks, run_layer's row and the CLI's refusals.
// tests/python/layer_torch.py checks the same layer against torch.nn.MultiheadAttention.
#include "harness/layer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "harness/results.h"
#include "harness/sweep_plan.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::error_message;

LayerProblem layer_problem(int64_t b, int64_t e, int64_t h, int64_t l, int64_t s, bool causal) {
  LayerProblem lp;
  lp.batch = b, lp.embed = e, lp.heads = h, lp.n = l, lp.m = s, lp.causal = causal, lp.seed = 7;
  return lp;
}

// Seeded data with non-zero biases (PyTorch's initialisation zeroes them), so they are checked.
LayerData data_with_biases(const LayerProblem& lp) {
  LayerData d = generate_layer_data(lp);
  RandomStream rs(lp.seed, 99);
  for (int64_t i = 0; i < d.params.in_proj_bias.numel(); ++i)
    d.params.in_proj_bias.data()[i] = float(rs.normal(uint64_t(i)));
  for (int64_t i = 0; i < d.params.out_proj_bias.numel(); ++i)
    d.params.out_proj_bias.data()[i] = float(rs.normal(uint64_t(1000000 + i)));
  return d;
}

struct Naive {
  std::vector<double> out;      // [B, L, E]
  std::vector<double> weights;  // [B, L, S], averaged over heads
};

// torch.nn.MultiheadAttention written out with loops in float64, straight from its definition
// (key padding and the attention mask's bias included; a row with no visible key gives 0).
Naive naive_layer(const LayerProblem& lp, const LayerData& d) {
  const int64_t B = lp.batch, E = lp.embed, H = lp.heads, L = lp.n, S = lp.keys(), D = E / H;
  const float* w = d.params.in_proj_weight.data();
  const float* bias = d.params.in_proj_bias.data();
  auto proj = [&](const Tensor& x, int64_t len, int64_t block) {
    std::vector<double> y(size_t(B * len * E));
    for (int64_t r = 0; r < B * len; ++r)
      for (int64_t o = 0; o < E; ++o) {
        double acc = bias[block * E + o];
        for (int64_t c = 0; c < E; ++c)
          acc += double(x.data()[r * E + c]) * double(w[(block * E + o) * E + c]);
        y[size_t(r * E + o)] = acc;
      }
    return y;
  };
  const auto q = proj(d.in.query, L, 0), k = proj(d.in.key, S, 1), v = proj(d.in.value, S, 2);
  std::vector<double> concat(size_t(B * L * E), 0.0);
  Naive res;
  res.weights.assign(size_t(B * L * S), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> logit(size_t(S), -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          if (lp.causal && j > i + (S - L)) continue;
          if (!lp.key_lengths.empty() && j >= lp.key_lengths[size_t(b)]) continue;
          double dot = 0;
          for (int64_t c = 0; c < D; ++c)
            dot += q[size_t((b * L + i) * E + h * D + c)] * k[size_t((b * S + j) * E + h * D + c)];
          logit[size_t(j)] =
              dot / std::sqrt(double(D)) + (lp.attn_mask ? lp.attn_mask->at(b, h, i, j) : 0.0);
          mx = std::max(mx, logit[size_t(j)]);
        }
        double z = 0;
        for (int64_t j = 0; j < S; ++j)
          z += std::isinf(logit[size_t(j)]) ? 0 : std::exp(logit[size_t(j)] - mx);
        for (int64_t j = 0; j < S; ++j) {
          const double p = std::isinf(logit[size_t(j)]) ? 0 : std::exp(logit[size_t(j)] - mx) / z;
          res.weights[size_t((b * L + i) * S + j)] += p / double(H);
          for (int64_t c = 0; c < D; ++c)
            concat[size_t((b * L + i) * E + h * D + c)] +=
                p * v[size_t((b * S + j) * E + h * D + c)];
        }
      }
  res.out.assign(size_t(B * L * E), 0.0);
  for (int64_t r = 0; r < B * L; ++r)
    for (int64_t o = 0; o < E; ++o) {
      double acc = d.params.out_proj_bias.data()[o];
      for (int64_t c = 0; c < E; ++c)
        acc += concat[size_t(r * E + c)] * double(d.params.out_proj_weight.data()[o * E + c]);
      res.out[size_t(r * E + o)] = acc;
    }
  return res;
}

double rel_error(const float* got, const std::vector<double>& want) {
  return test::rel_fro_error(got, want);
}

TEST(Layer, EmbedNotDivisibleByHeadsIsAUsageError) {
  const std::string msg =
      error_message<UsageError>([] { layer_problem(1, 50, 3, 8, 0, false).validate(); });
  EXPECT_NE(msg.find("embed 50 is not divisible by heads 3"), std::string::npos) << msg;
  auto v = make_variant("full");
  EXPECT_THROW(Layer(*v, layer_problem(1, 50, 3, 8, 0, false)), UsageError);
}

TEST(Layer, SeededParametersFollowPyTorchsInitialisation) {
  const int64_t e = 96;
  const LayerParams p = init_layer_params(e, 3);
  ASSERT_EQ(p.in_proj_weight.shape(), (Shape4{1, 1, 3 * e, e}));
  ASSERT_EQ(p.out_proj_weight.shape(), (Shape4{1, 1, e, e}));
  // U(-a, a) has variance a² / 3: check the bound and the spread.
  auto check_uniform = [](const Tensor& t, double bound) {
    double sum2 = 0, largest = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      sum2 += double(t.data()[i]) * t.data()[i];
      largest = std::max(largest, std::abs(double(t.data()[i])));
    }
    EXPECT_LE(largest, bound);
    EXPECT_GT(largest, 0.99 * bound);
    EXPECT_NEAR(sum2 / double(t.numel()), bound * bound / 3, 0.05 * bound * bound / 3);
  };
  check_uniform(p.in_proj_weight, std::sqrt(6.0 / (4.0 * double(e))));  // xavier_uniform_
  check_uniform(p.out_proj_weight, 1.0 / std::sqrt(double(e)));         // nn.Linear's default
  for (const Tensor* bias : {&p.in_proj_bias, &p.out_proj_bias})
    for (int64_t i = 0; i < bias->numel(); ++i) ASSERT_EQ(bias->data()[i], 0.0f);
  const LayerParams same = init_layer_params(e, 3), other = init_layer_params(e, 4);
  EXPECT_EQ(std::memcmp(p.in_proj_weight.data(), same.in_proj_weight.data(),
                        size_t(p.in_proj_weight.numel()) * sizeof(float)),
            0);
  EXPECT_NE(p.in_proj_weight.data()[0], other.in_proj_weight.data()[0]);
}

TEST(Layer, SelfAttentionByDefaultCrossWithAKeyLength) {
  const LayerData self = generate_layer_data(layer_problem(2, 16, 2, 9, 0, false));
  ASSERT_EQ(self.in.key.shape(), self.in.query.shape());
  for (int64_t i = 0; i < self.in.query.numel(); ++i) {
    ASSERT_EQ(self.in.key.data()[i], self.in.query.data()[i]);
    ASSERT_EQ(self.in.value.data()[i], self.in.query.data()[i]);
  }
  const LayerData cross = generate_layer_data(layer_problem(2, 16, 2, 9, 9, false));
  EXPECT_EQ(cross.in.key.shape(), (Shape4{2, 1, 9, 16}));
  EXPECT_NE(cross.in.key.data()[0], cross.in.query.data()[0]);
  EXPECT_NE(cross.in.key.data()[0], cross.in.value.data()[0]);
}

struct Case {
  int64_t b, e, h, l, s;
  bool causal;
};
const Case kCases[] = {{2, 33, 3, 17, 0, false},  // self, d = 11
                       {1, 32, 4, 7, 13, false},  // cross, L < S
                       {2, 24, 2, 19, 5, false},  // cross, L > S
                       {1, 20, 5, 13, 0, true},   // causal self, d = 4
                       {2, 16, 1, 6, 11, true}};  // causal cross, L < S

TEST(Layer, Float32LayerMatchesAPlainFloat64Layer) {
  for (const char* spec : {"full", "flash", "flash:block_q=16,block_k=16"})
    for (const Case& c : kCases) {
      const LayerProblem lp = layer_problem(c.b, c.e, c.h, c.l, c.s, c.causal);
      SCOPED_TRACE(std::string(spec) + " " + lp.str());
      const LayerData d = data_with_biases(lp);
      const Naive want = naive_layer(lp, d);
      auto v = make_variant(spec);
      Layer layer(*v, lp);
      Tensor out({lp.batch, 1, lp.n, lp.embed});
      layer.forward(d.in, d.params, out.view());
      EXPECT_LT(rel_error(out.data(), want.out), 1e-5);
      // The second pass reuses the buffers and gives the same output.
      Tensor again({lp.batch, 1, lp.n, lp.embed});
      layer.forward(d.in, d.params, again.view());
      EXPECT_EQ(std::memcmp(out.data(), again.data(), size_t(out.numel()) * sizeof(float)), 0);
    }
}

TEST(Layer, HarnessFloat64LayerMatchesThePlainOne) {
  for (const Case& c : kCases) {
    const LayerProblem lp = layer_problem(c.b, c.e, c.h, c.l, c.s, c.causal);
    SCOPED_TRACE(lp.str());
    const LayerData d = data_with_biases(lp);
    const Naive want = naive_layer(lp, d);
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < lp.n; i += 2) rows.push_back(i);
    for (int64_t b = 0; b < lp.batch; ++b) {
      const auto got = reference_layer_rows(lp, d, b, rows);
      double diff2 = 0, ref2 = 0;
      for (size_t t = 0; t < rows.size(); ++t)
        for (int64_t o = 0; o < lp.embed; ++o) {
          const double x = want.out[size_t((b * lp.n + rows[t]) * lp.embed + o)];
          diff2 += std::pow(got[t * size_t(lp.embed) + size_t(o)] - x, 2);
          ref2 += x * x;
        }
      EXPECT_LT(std::sqrt(diff2 / ref2), 1e-6);  // q, k, v rounded to float once
    }
  }
}

TEST(Layer, NeedWeightsAreTheHeadAveragedProbabilities) {
  for (const Case& c : kCases) {
    const LayerProblem lp = layer_problem(c.b, c.e, c.h, c.l, c.s, c.causal);
    SCOPED_TRACE(lp.str());
    const LayerData d = data_with_biases(lp);
    auto v = make_variant("flash");
    Layer layer(*v, lp);
    Tensor out({lp.batch, 1, lp.n, lp.embed});
    layer.forward(d.in, d.params, out.view());
    const Tensor w = layer.attention_weights();
    ASSERT_EQ(w.shape(), (Shape4{lp.batch, 1, lp.n, lp.keys()}));
    for (int64_t r = 0; r < lp.batch * lp.n; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < lp.keys(); ++j) sum += w.data()[r * lp.keys() + j];
      const int64_t i = r % lp.n;
      // A causal row with no visible key (L > S) is all zeros; every other row sums to 1.
      const bool empty = lp.causal && i + (lp.keys() - lp.n) < 0;
      EXPECT_NEAR(sum, empty ? 0.0 : 1.0, 1e-5) << "row " << r;
    }
    EXPECT_LT(rel_error(w.data(), naive_layer(lp, d).weights), 1e-5);
  }
}

// The cases with key padding (one batch item with a single key, or none) and float or bool
// attention masks, per head or shared.
std::vector<LayerProblem> masked_cases() {
  std::vector<LayerProblem> out;
  for (const Case& c : kCases) {
    const LayerProblem base = layer_problem(c.b, c.e, c.h, c.l, c.s, c.causal);
    const int64_t s = base.keys();
    LayerProblem padded = base;
    padded.key_lengths =
        base.batch == 1 ? std::vector<int64_t>{s / 2 + 1} : std::vector<int64_t>{1, s - 2};
    out.push_back(padded);
    LayerProblem masked = base;
    masked.attn_mask = test::random_mask(base.attention(), 1, 1, false, 3);
    out.push_back(masked);
    LayerProblem both = padded;
    both.attn_mask = test::random_mask(base.attention(), base.batch, base.heads, true, 4);
    out.push_back(both);
  }
  return out;
}

TEST(Layer, MasksMatchAPlainFloat64Layer) {
  for (const char* spec : {"full", "flash", "local:window=4"})
    for (const LayerProblem& lp : masked_cases()) {
      SCOPED_TRACE(std::string(spec) + " " + lp.attention().str());
      const LayerData d = data_with_biases(lp);
      auto v = make_variant(spec);
      Layer layer(*v, lp);
      Tensor out({lp.batch, 1, lp.n, lp.embed});
      layer.forward(d.in, d.params, out.view());
      if (std::string(spec).starts_with("local")) {  // its own pattern: against the harness
        const ErrorStats e = measure_layer_error(lp, d, out.view());
        EXPECT_GT(e.rel_fro, 1e-3);  // the window drops keys the float64 layer keeps
        continue;
      }
      const Naive want = naive_layer(lp, d);
      EXPECT_LT(rel_error(out.data(), want.out), 1e-5);
      EXPECT_LT(rel_error(layer.attention_weights().data(), want.weights), 1e-5);
      const ErrorStats e = measure_layer_error(lp, d, out.view());
      EXPECT_LT(e.rel_fro, 1e-5);
    }
}

TEST(Layer, NeedWeightsAreRefusedByApproximations) {
  const LayerProblem lp = layer_problem(1, 16, 2, 8, 0, false);
  auto v = make_variant("performer");
  Layer layer(*v, lp);
  const std::string msg = error_message<UnsupportedError>([&] { layer.attention_weights(); });
  EXPECT_NE(msg.find("performer"), std::string::npos) << msg;
  const Row row = run_layer(*v, lp, Workload{}, nullptr, MachineFigures{},
                            RunOptions{.reps = 1, .min_time = 0}, /*need_weights=*/true);
  EXPECT_EQ(row.status, "unsupported") << row.message;
}

// The arrays np.savez writes for a layer, from generated data.
std::map<std::string, NpyArray> layer_arrays(const LayerProblem& lp) {
  const LayerData d = generate_layer_data(lp);
  auto arr = [](const Tensor& t, std::vector<int64_t> shape) {
    NpyArray a = to_npy(t);
    a.shape = std::move(shape);
    return a;
  };
  const int64_t b = lp.batch, e = lp.embed, l = lp.n, s = lp.keys();
  return {{"query", arr(d.in.query, {b, l, e})},
          {"key", arr(d.in.key, {b, s, e})},
          {"value", arr(d.in.value, {b, s, e})},
          {"in_proj_weight", arr(d.params.in_proj_weight, {3 * e, e})},
          {"in_proj_bias", arr(d.params.in_proj_bias, {3 * e})},
          {"out_proj.weight", arr(d.params.out_proj_weight, {e, e})},
          {"out_proj.bias", arr(d.params.out_proj_bias, {e})}};
}

TEST(Layer, FileGivesTheSizes) {
  const auto arrays = layer_arrays(layer_problem(2, 12, 3, 5, 7, false));
  LayerProblem lp;
  lp.heads = 3;
  const LayerData d = layer_from_arrays(arrays, "f.npz", &lp);
  EXPECT_EQ(lp.batch, 2);
  EXPECT_EQ(lp.embed, 12);
  EXPECT_EQ(lp.n, 5);
  EXPECT_EQ(lp.keys(), 7);
  EXPECT_EQ(d.params.in_proj_weight.shape(), (Shape4{1, 1, 36, 12}));
}

TEST(Layer, BadFilesNameTheArrayAndTheAcceptedShape) {
  const auto good = layer_arrays(layer_problem(2, 12, 3, 5, 7, false));
  auto expect_error = [&](auto edit, const std::vector<std::string>& words) {
    auto arrays = good;
    edit(arrays);
    LayerProblem lp;
    const std::string msg =
        error_message<InputError>([&] { layer_from_arrays(arrays, "f.npz", &lp); });
    for (const auto& w : words) EXPECT_NE(msg.find(w), std::string::npos) << msg;
  };
  expect_error([](auto& a) { a.erase("out_proj.bias"); }, {"no array 'out_proj.bias'", "[E]"});
  expect_error(
      [](auto& a) {
        a["key"].shape = {2, 14, 6};
      },
      {"'key' has shape (2, 14, 6)", "[B, S, E] = (2, 14, 12)"});
  expect_error(
      [](auto& a) {
        a["in_proj_weight"].shape = {12, 36};
      },
      {"'in_proj_weight' has shape (12, 36)", "[3E, E] = (36, 12)"});
  expect_error(
      [](auto& a) {
        a["query"].shape = {10, 12};
      },
      {"'query' has shape (10, 12)", "expected 3 axes [B, L, E]"});
  expect_error([](auto& a) { a["value"].dtype = "<f8"; }, {"'value' has dtype <f8", "float32"});
  expect_error([](auto& a) { a["extra"] = a["query"]; }, {"unknown array 'extra'"});
  expect_error(
      [](auto& a) {
        const float inf = INFINITY;
        std::memcpy(a["in_proj_bias"].data.data() + 4, &inf, sizeof inf);
      },
      {"'in_proj_bias' holds a non-finite value"});
  // What the layer cannot honour is refused, never ignored.
  for (const char* key : {"q_proj_weight", "bias_k"}) {
    auto arrays = good;
    arrays[key] = good.at("query");
    LayerProblem lp;
    const std::string msg =
        error_message<UnsupportedError>([&] { layer_from_arrays(arrays, "f.npz", &lp); });
    EXPECT_NE(msg.find(key), std::string::npos) << msg;
  }
}

TEST(Layer, FileMasksFollowPyTorchsConventions) {
  const LayerProblem base = layer_problem(2, 12, 3, 5, 7, false);
  const auto good = layer_arrays(base);
  auto bools = [](std::vector<int64_t> shape, const std::vector<uint8_t>& v) {
    NpyArray a;
    a.dtype = "|b1";
    a.shape = std::move(shape);
    a.data.assign(v.begin(), v.end());
    return a;
  };
  const auto floats = test::float_npy;
  auto load = [&](const std::map<std::string, NpyArray>& arrays) {
    LayerProblem lp;
    lp.heads = 3;
    layer_from_arrays(arrays, "dir/f.npz", &lp);
    return lp;
  };
  // An end padding (true = padded) becomes key lengths.
  auto arrays = good;
  arrays["key_padding_mask"] = bools({2, 7}, {0, 0, 0, 0, 1, 1, 1, /**/ 0, 0, 0, 0, 0, 0, 0});
  LayerProblem lp = load(arrays);
  EXPECT_EQ(lp.key_lengths, (std::vector<int64_t>{4, 7}));
  EXPECT_EQ(lp.attn_mask, nullptr);
  // A hole in the middle is folded into the attention mask of every row and head.
  arrays["key_padding_mask"] = bools({2, 7}, {0, 1, 0, 0, 0, 0, 0, /**/ 0, 0, 0, 0, 0, 0, 0});
  lp = load(arrays);
  EXPECT_TRUE(lp.key_lengths.empty());
  ASSERT_NE(lp.attn_mask, nullptr);
  EXPECT_TRUE(lp.attn_mask->is_bool);
  EXPECT_EQ(lp.attn_mask->name, "f.npz:key_padding_mask");
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(lp.attn_mask->at(0, 2, i, 1), -INFINITY);
    EXPECT_EQ(lp.attn_mask->at(0, 2, i, 0), 0.0f);
    EXPECT_EQ(lp.attn_mask->at(1, 0, i, 1), 0.0f);
  }
  // attn_mask [B H, L, S]: entry (b H + h) is head h of batch item b; a float key padding
  // adds to it.
  std::vector<float> per_head(size_t(6 * 5 * 7));
  for (size_t e = 0; e < per_head.size(); ++e) per_head[e] = float(e % 11) * 0.25f;
  arrays["attn_mask"] = floats({6, 5, 7}, per_head);
  std::vector<float> kp(14, 0.0f);
  kp[3] = -1.5f;
  arrays["key_padding_mask"] = floats({2, 7}, kp);
  lp = load(arrays);
  ASSERT_NE(lp.attn_mask, nullptr);
  EXPECT_FALSE(lp.attn_mask->is_bool);
  EXPECT_EQ(lp.attn_mask->at(1, 2, 4, 6), per_head[size_t(((1 * 3 + 2) * 5 + 4) * 7 + 6)]);
  EXPECT_EQ(lp.attn_mask->at(0, 1, 2, 3), per_head[size_t(((0 * 3 + 1) * 5 + 2) * 7 + 3)] - 1.5f);
  EXPECT_EQ(lp.attn_mask->name, "f.npz:attn_mask+key_padding_mask");
  // [L, S] uint8, shared by every batch item and head.
  arrays = good;
  NpyArray shared = bools({5, 7}, std::vector<uint8_t>(35, 0));
  shared.dtype = "|u1";
  shared.data[size_t(2 * 7 + 5)] = 1;
  arrays["attn_mask"] = shared;
  lp = load(arrays);
  ASSERT_NE(lp.attn_mask, nullptr);
  EXPECT_EQ(lp.attn_mask->at(1, 2, 2, 5), -INFINITY);
  EXPECT_EQ(lp.attn_mask->at(1, 2, 2, 4), 0.0f);
  EXPECT_EQ(lp.attn_mask->name, "f.npz:attn_mask");

  auto expect_error = [&](const char* key, NpyArray a, const std::vector<std::string>& words) {
    auto bad = good;
    bad[key] = std::move(a);
    const std::string msg = error_message<InputError>([&] { load(bad); });
    for (const auto& w : words) EXPECT_NE(msg.find(w), std::string::npos) << msg;
  };
  expect_error("key_padding_mask", bools({7, 2}, std::vector<uint8_t>(14, 0)),
               {"'key_padding_mask' has shape (7, 2)", "[B, S] = (2, 7)", "true = padded"});
  expect_error("key_padding_mask", floats({2, 7}, std::vector<float>(14, NAN)),
               {"'key_padding_mask' holds nan"});
  NpyArray f8 = floats({2, 7}, std::vector<float>(14, 0.0f));
  f8.dtype = "<f8";
  expect_error("key_padding_mask", f8, {"dtype <f8"});
  expect_error("attn_mask", bools({2, 5, 7}, std::vector<uint8_t>(70, 0)),
               {"'attn_mask' has shape (2, 5, 7)", "[L, S] = (5, 7)", "[B H, L, S] = (6, 5, 7)"});
  expect_error("attn_mask", floats({5, 7}, std::vector<float>(35, INFINITY)), {"inf"});
}

TEST(Layer, RunLayerRowMeasuresTheLayerAndTheCoreShare) {
  const LayerProblem lp = layer_problem(1, 32, 4, 40, 0, true);
  auto v = make_variant("flash");
  Tensor out, weights;
  const Row row = run_layer(*v, lp, Workload{.threads = 1}, nullptr, MachineFigures{},
                            RunOptions{.reps = 2, .min_time = 0}, true, &out, &weights);
  ASSERT_EQ(row.status, "ok") << row.message;
  EXPECT_EQ(row.embed, 32);
  EXPECT_EQ(row.problem.dim, 8);
  EXPECT_TRUE(row.problem.causal);
  EXPECT_GT(row.attention_share, 0.0);
  EXPECT_LT(row.attention_share, 1.0);
  EXPECT_LT(row.error.rel_fro, 1e-5);
  EXPECT_EQ(row.error.rows_used, 40);
  EXPECT_EQ(out.shape(), (Shape4{1, 1, 40, 32}));
  EXPECT_EQ(weights.shape(), (Shape4{1, 1, 40, 40}));
  EXPECT_GT(row.time_median, 0.0);
  EXPECT_EQ(to_json(row)["embed"], 32);
  // A plain attention row has embed 0 and no share.
  EXPECT_EQ(to_json(Row{})["embed"], 0);
  EXPECT_TRUE(to_json(Row{})["attention_share"].is_null());
}

TEST(Layer, RunLayerRefusesWhatTheCoreCannotDo) {
  // linformer projects a fixed key length: no causal mask.
  auto v = make_variant("linformer");
  const Row row = run_layer(*v, layer_problem(1, 16, 2, 32, 0, true), Workload{}, nullptr,
                            MachineFigures{}, RunOptions{.reps = 1, .min_time = 0}, false);
  EXPECT_EQ(row.status, "unsupported") << row.message;
}

TEST(LayerCli, RefusesBadSizesWithAClearMessage) {
  test::TempDir dir;
  auto r = test::run_cli("layer --variant full --seq 8", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--embed E is required"), std::string::npos) << r.err;
  r = test::run_cli("layer --variant full --embed 10 --heads 4 --seq 8", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("embed 10 is not divisible by heads 4"), std::string::npos) << r.err;
  const std::string file = dir.file("layer.npz");
  write_npz(file, layer_arrays(layer_problem(1, 12, 3, 5, 0, false)));
  r = test::run_cli("layer --variant full --heads 3 --embed 16 --inputs " + file, dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--embed 16 disagrees with --inputs"), std::string::npos) << r.err;
  const std::string out = dir.file("out.npz");
  r = test::run_cli(
      "layer --variant flash --heads 3 --need-weights --min-time 0 --reps 1 "
      "--inputs " +
          file + " --output " + out,
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto written = read_npz(out);
  EXPECT_EQ(written.at("output").shape, (std::vector<int64_t>{1, 5, 12}));
  EXPECT_EQ(written.at("attn_weights").shape, (std::vector<int64_t>{1, 5, 5}));
}

TEST(LayerCli, TakesKeyPaddingAndMasksFromOptionsOrTheFileButNotBoth) {
  test::TempDir dir;
  const LayerProblem lp = layer_problem(2, 12, 3, 5, 0, false);
  const std::string file = dir.file("layer.npz");
  auto arrays = layer_arrays(lp);
  write_npz(file, arrays);
  auto r = test::run_cli(
      "layer --variant flash --heads 3 --min-time 0 --reps 1 --json --key-padding 3,5 "
      "--inputs " +
          file,
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"key_padding\": \"3+5\""), std::string::npos) << r.out;
  // seeded layer with a mask file [L, S]
  const std::string mask = dir.file("mask.npy");
  NpyArray m;
  m.dtype = "|b1";
  m.shape = {5, 5};
  m.data.assign(25, 0);
  m.data[3] = 1;
  write_npy(mask, m);
  r = test::run_cli(
      "layer --variant full --embed 12 --heads 3 --seq 5 --min-time 0 --reps 1 --json "
      "--attn-mask " +
          mask,
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"attn_mask\": \"mask.npy\""), std::string::npos) << r.out;
  // a file with a key_padding_mask and --key-padding: refused, naming both
  NpyArray kp;
  kp.dtype = "|b1";
  kp.shape = {2, 5};
  kp.data.assign(10, 0);
  kp.data[4] = 1;
  arrays["key_padding_mask"] = kp;
  write_npz(file, arrays);
  r = test::run_cli("layer --variant flash --heads 3 --key-padding 3 --inputs " + file, dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("holds a key_padding_mask already"), std::string::npos) << r.err;
  // an approximation without mask support refuses the mask by name
  r = test::run_cli(
      "layer --variant performer --embed 12 --heads 3 --seq 5 --min-time 0 --reps 1 "
      "--attn-mask " +
          mask,
      dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("unsupported"), std::string::npos) << r.out << r.err;
}

TEST(LayerSweep, EmbedRowsReplaceTheHeadDimensions) {
  SweepAxes a;
  a.seqs = {32};
  a.batches = {1};
  a.heads = {4};
  a.dims = {16};  // not used by layer rows
  a.embeds = {64, 96};
  a.causals = {false};
  a.inputs = {"gaussian"};
  a.threads = 1;
  std::vector<std::unique_ptr<Variant>> vs;
  vs.push_back(make_variant("flash"));
  const SweepPlan plan = plan_sweep(std::move(vs), a);
  ASSERT_EQ(plan.configs.size(), 2u);
  EXPECT_EQ(plan.configs[0].embed, 64);
  EXPECT_EQ(plan.configs[0].problem.dim, 16);
  EXPECT_EQ(plan.configs[1].embed, 96);
  EXPECT_EQ(plan.configs[1].problem.dim, 24);
  EXPECT_EQ(layer_problem(plan.configs[1]).keys(), 32);  // self-attention
  EXPECT_GT(sweep_work(plan.configs[1]), sweep_work(plan.configs[0]));

  a.embeds = {66};
  std::vector<std::unique_ptr<Variant>> more;
  more.push_back(make_variant("flash"));
  EXPECT_THROW(plan_sweep(std::move(more), a), UsageError);
  a.embeds = {64};
  a.inputs = {"lowrank"};
  std::vector<std::unique_ptr<Variant>> again;
  again.push_back(make_variant("flash"));
  const std::string msg = error_message<UsageError>([&] { plan_sweep(std::move(again), a); });
  EXPECT_NE(msg.find("gaussian"), std::string::npos) << msg;

  // Key padding reaches the layer's core.
  a.inputs = {"gaussian"};
  a.paddings = {PaddingSetting{.lengths = "20"}};
  std::vector<std::unique_ptr<Variant>> padded;
  padded.push_back(make_variant("flash"));
  const SweepPlan pp = plan_sweep(std::move(padded), a);
  ASSERT_EQ(pp.configs.size(), 1u);
  EXPECT_EQ(layer_problem(pp.configs[0]).key_lengths, (std::vector<int64_t>{20}));
  EXPECT_EQ(layer_problem(pp.configs[0]).attention().key_lengths, (std::vector<int64_t>{20}));
}

TEST(LayerSweep, EmbedIsAKeyColumnAndAttentionShareAColumn) {
  const auto& keys = key_columns();
  EXPECT_NE(std::find(keys.begin(), keys.end(), "embed"), keys.end());
  const auto& cols = csv_columns();
  EXPECT_NE(std::find(cols.begin(), cols.end(), "attention_share"), cols.end());
  Row plain, layer;
  plain.spec = layer.spec = "flash";
  layer.embed = 64;
  EXPECT_NE(row_key(plain), row_key(layer));
}

TEST(LayerSweep, ResumeKeepsTheRowsOfAResultsFileWithoutTheLayerColumns) {
  test::TempDir dir;
  Row row;
  row.spec = "full";
  row.variant = "full";
  row.status = "unsupported";
  {
    ResultsDir results(dir.path().string(), false);
    results.append(row, nlohmann::json());
  }
  // The file as attnbench wrote it before the layer: without embed and attention_share.
  const std::string path = dir.file("results.csv");
  const auto lines = test::read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  const auto header = split_csv_line(lines[0]);
  std::string old;
  for (const auto& line : lines) {
    const auto f = split_csv_line(line);
    std::string out;
    for (size_t i = 0; i < f.size(); ++i)
      if (header[i] != "embed" && header[i] != "attention_share") {
        if (!out.empty()) out += ',';
        out += csv_quote(f[i]);
      }
    old += out + "\n";
  }
  test::write_text(path, old);
  ResultsDir resumed(dir.path().string(), true);
  EXPECT_EQ(resumed.rows_kept(), 1u);
  EXPECT_TRUE(resumed.done(row));
  EXPECT_EQ(split_csv_line(test::read_lines(path)[0]), csv_columns());
  EXPECT_EQ(test::read_lines(path)[1], csv_line(row));
}

}  // namespace
}  // namespace attnbench
