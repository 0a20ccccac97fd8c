// linear: linear attention with the elu + 1 feature map (Katharopoulos, Vyas, Pappas &
// Fleuret 2020, "Transformers are RNNs: Fast Autoregressive Transformers with Linear
// Attention").
//
//   phi(x) = elu(x) + 1   (elementwise, d features, no 1/sqrt(d))
//   out_i  = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps)
//
// the sums running over the keys query i sees (all of them, or keys 0 .. i + (m - n) under
// the bottom-right aligned causal mask); rows with no visible key give exactly 0. A different
// kernel from softmax, not an approximation of it: its oracle is the O(n m d) evaluation of
// this same formula in double (linear_oracle below), and its distance to softmax attention is
// a measurement. Its float32 chain (an exp per feature, reductions over the m keys and the d
// features, one division) is the default error model's, without the logits.
//
// Computed by the chunked engine of common/engines/feature_map_attention.h with F = d features: the
// state S = sum phi(k_j) v_j^T (d x d) and z = sum phi(k_j) are built by GEMMs over key blocks;
// causal rows use the state of the keys before their 16-row chunk plus a masked 16 x 16
// product inside it.
// Time O((n + m) d^2 + n C d) (C = 16, causal only); memory O(threads (R d + d^2 + C^2))
// beyond inputs and output (R = 1024 rows per block for d <= 64), independent of n and m.
// Backward (common/engines/feature_map_attention.h, attend_backward): forward_train keeps each
// row's denominator; a forward walk for dq (prefix state) and a backward walk for dk, dv (suffix
// state), about 2.5 times the forward's FLOPs.
// Decode (feature_map::prefill_state): per (batch, head) S (d x d) and z (d), so
// H (d^2 + d + 2) 4 bytes per sequence whatever its length; a step is O(d^2) per head.
#include <cmath>
#include <memory>
#include <vector>

#include "common/core/registry.h"
#include "common/engines/feature_map_attention.h"
#include "common/reference/oracle.h"

namespace attnbench {
namespace {

namespace fmap = feature_map;

class Linear final : public Variant, public Backward, public Decoder {
 public:
  explicit Linear(const ParamValues& pv) : eps_(float(pv.get_float("eps"))) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const fmap::EluFeatureMap fm(p.dim);
    fmap::attend(p, q, k, v, out, eps_, p.dim,
                 [&](int64_t) -> const fmap::FeatureMap& { return fm; });
  }

  // Saved: each row's denominator (4 B H n bytes); the backward maps phi(Q), phi(K) again.
  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    auto saved = std::make_unique<fmap::RowDenominators>(p);
    const fmap::EluFeatureMap fm(p.dim);
    fmap::attend(
        p, q, k, v, out, eps_, p.dim, [&](int64_t) -> const fmap::FeatureMap& { return fm; },
        saved->den.data());
    return saved;
  }

  using Variant::backward;  // the accessor stays visible beside the pass
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    const fmap::EluFeatureMap fm(p.dim);
    fmap::attend_backward(p, q, k, v, out, dout, fmap::RowDenominators::of(saved, p).den.data(), dq,
                          dk, dv, p.dim, [&](int64_t) -> const fmap::FeatureMap& { return fm; });
  }

  double backward_flops(const Problem& p) const override {
    const fmap::EluFeatureMap fm(p.dim);
    return fmap::attend_backward_flops(p, p.dim, fm.query_flops(), fm.key_flops(),
                                       fm.query_backward_flops(), fm.key_backward_flops());
  }
  double saved_estimate(const Problem& p) const override { return fmap::RowDenominators::bytes(p); }
  double backward_memory_estimate(const Problem& p) const override {
    return fmap::attend_backward_bytes(p, p.dim);
  }

  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override {
    return fmap::prefill_state(p, k, v, t0, eps_,
                               {std::make_shared<const fmap::EluFeatureMap>(p.dim)});
  }

  double prefill_flops(const Problem& p, int64_t t0) const override {
    return fmap::prefill_flops(p, t0, p.dim, fmap::EluFeatureMap(p.dim).key_flops());
  }

  double flops(const Problem& p) const override {
    const fmap::EluFeatureMap fm(p.dim);
    return fmap::attend_flops(p, p.dim, fm.query_flops(), fm.key_flops());
  }

  double memory_estimate(const Problem& p) const override { return fmap::attend_bytes(p, p.dim); }

 private:
  float eps_;
};

// The formula in double: phi of every query and key row, then kernelised attention over the
// keys each query sees.
std::vector<double> linear_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                  ConstTensorView k, ConstTensorView v) {
  const double eps = var.params().get_float("eps");
  auto phi = [](oracle::Matrix x) {
    for (double& e : x.a) e = e > 0 ? e + 1.0 : std::exp(e);
    return x;
  };
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    return oracle::feature_map_attention(phi(oracle::head(q, b, h)), phi(oracle::head(k, b, h)),
                                         oracle::head(v, b, h), eps,
                                         [&](int64_t i) { return p.visible(b, i); });
  });
}

ATTNBENCH_REGISTER_VARIANT(
    linear,
    VariantInfo{
        .name = "linear",
        .summary = "linear attention, phi(x) = elu(x) + 1 (Katharopoulos et al. 2020); not softmax",
        .complexity =
            "time O((n + m) d^2), memory O(threads d (d + 2 R)), R = min(1024, 65536 / d)",
        .family = "lowrank",
        .display = "Linear attention",
        .paper = "Katharopoulos et al. 2020 (arXiv:2006.16236)",
        .look = {.color = "#8c564b", .marker = "^"},
        .params = {ParamSpec::Float("eps", 1e-6, 0.0, 1.0,
                                    "added to the denominator phi(q)^T sum phi(k)")},
        .caps = {.causal = true, .cross = true, .exact = false, .key_padding = true},
        .make = [](const ParamValues& pv) { return std::make_unique<Linear>(pv); },
        .oracle = linear_oracle});

}  // namespace
}  // namespace attnbench
