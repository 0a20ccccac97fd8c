// performer: FAVOR+ random-feature attention (Choromanski et al. 2021, "Rethinking Attention
// with Performers", ICLR; positive orthogonal random features).
//
//   x~ = x d^-1/4,  W: F x d random (F = features)
//   softmax kernel: phi(x) = F^-1/2 exp(W x~ - |x~|^2/2 - shift)
//                   E_W[phi(q)^T phi(k)] = exp(q.k / sqrt(d)) (shifts undone), variance ~ 1/F
//   relu kernel:    phi(x) = F^-1/2 relu(W x~) + 1e-3 (the 1e-3 is the numerical_stabilizer of
//                   the Performer code's relu_kernel_transformation; that code applies relu to
//                   W x, unscaled, where this follows the x~ = x d^-1/4 of the softmax kernel)
//   out_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j)   (visible j only)
//
// W per head from the problem seed (common/engines/feature_map_attention.h, performer_projection):
// with `orthogonal`, blocks of d orthonormal rows (QR of d x d Gaussian matrices) rescaled to chi_d
// norms, so each row is still N(0, I) but rows within a block are orthogonal (lower variance);
// otherwise iid Gaussian rows. The same W serves every batch item of a head. W depends on (seed,
// head, F, d) alone: prepare() draws every head's W once per problem and forward() reuses it (the
// harness reports that time as prepare_s and the notes say so; the draws, about 2 F d normals and
// ceil(F / d) QRs per head, cost more than the attention itself at short lengths); a forward()
// without prepare() draws W on every call.
//
// Stabiliser (softmax kernel): a query subtracts its own max over features of the exponent;
// keys subtract the max of W k~ - |k~|^2/2 over every key and feature of the head. The
// shifts cancel between numerator and denominator. The engine keeps the key state at a
// running max and rescales it when the max grows: without a mask every key is folded before
// any query, so this is exactly the global max of the head. Under a causal mask a query
// block sees the state at the max over the keys mapped so far (up to the last key any row of
// the block sees): equal in exact arithmetic, and a key past the block cannot make earlier
// keys underflow, which a global max over keys the row must not see could (later keys of
// the row's own block move its output by rounding only; tests/common/feature_map_attention_test.cpp
// checks 1e-6). The softmax kernel adds no eps to the denominator (it would bias the estimate); a
// denominator that underflows to 0 gives a 0 row.
//
// Oracle: the formula above in double with the same W (performer_projection), each query's
// features shifted by its own max exponent and every key's by the head's max (the shifts
// cancel in the ratio; without them exp would overflow for sharp queries).
// Tolerance (the float32 error model of common/reference/oracle.h, with the chain of the features):
// an exponent is a reduction over d (W x~) of size up to E = d^1/4 S sqrt(2 ln F) (the largest of
// F Gaussian projections of |x~| = d^1/4 S) plus |k~|^2 / 2 = sqrt(d) / 2 for keys; then
// reductions over the F features and the m keys, and a few roundings (exp, shifts, scaling,
// division). The relu kernel has no exp and the same reductions, so the bound covers it.
//
// Causal via prefix states in 16-row chunks (see common/engines/feature_map_attention.h).
// Decode (feature_map::prefill_state, with the forward's W): per (batch, head) S (F x d),
// z (F) and the key shift, H (F d + F + 2) 4 bytes per sequence whatever its length.
// Backward: attend_backward with the map's derivative (W and the shifts constant); saved
// state: each row's denominator.
// Time O((n + m) F d + n 16 (F + d)) plus O(H ceil(F/d) d^3) for the QRs; memory
// O(H F d) for the projections plus O(threads (2 R F + F d + 16^2)) per-thread state, R =
// min(1024, 65536 / F) rows per block (256 at the default F).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/prepared.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/engines/feature_map_attention.h"
#include "common/reference/oracle.h"

namespace attnbench {
namespace {

namespace fmap = feature_map;

class Performer final : public Variant, public Backward, public Decoder {
 public:
  explicit Performer(const ParamValues& pv)
      : features_(pv.get_int("features")),
        orthogonal_(pv.get_bool("orthogonal")),
        kernel_(pv.get_choice("kernel") == "relu" ? fmap::PerformerKernel::Relu
                                                  : fmap::PerformerKernel::Softmax) {}

  bool prepare(const Problem& p) override {
    maps_.prepare(p, [&](int64_t h) { return make_map(p, h); });
    return true;
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    Maps::Heads fresh;
    const Maps::Heads& maps = maps_.get(
        p, [&](int64_t h) { return make_map(p, h); }, fresh);
    fmap::attend(p, q, k, v, out, 0.0f, features_,
                 [&](int64_t h) -> const fmap::FeatureMap& { return *maps[size_t(h)]; });
  }

  std::string notes() const override { return maps_.note(); }

  // Saved: each row's denominator (4 B H n bytes); the backward maps phi(Q), phi(K) again with
  // the same W (prepared, or drawn again).
  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    auto saved = std::make_unique<fmap::RowDenominators>(p);
    Maps::Heads fresh;
    const Maps::Heads& maps = maps_.get(
        p, [&](int64_t h) { return make_map(p, h); }, fresh);
    fmap::attend(
        p, q, k, v, out, 0.0f, features_,
        [&](int64_t h) -> const fmap::FeatureMap& { return *maps[size_t(h)]; }, saved->den.data());
    return saved;
  }

  using Variant::backward;  // the accessor stays visible beside the pass
  // The shifts (a query's own max, the keys' running max) are constants: they cancel in the
  // ratio, so the gradient through them is zero.
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    const float* den = fmap::RowDenominators::of(saved, p).den.data();
    Maps::Heads fresh;
    const Maps::Heads& maps = maps_.get(
        p, [&](int64_t h) { return make_map(p, h); }, fresh);
    fmap::attend_backward(p, q, k, v, out, dout, den, dq, dk, dv, features_,
                          [&](int64_t h) -> const fmap::FeatureMap& { return *maps[size_t(h)]; });
  }

  double backward_flops(const Problem& p) const override {
    const fmap::PerformerFeatureMap fm({}, features_, p.dim, kernel_);
    return fmap::attend_backward_flops(p, features_, fm.query_flops(), fm.key_flops(),
                                       fm.query_backward_flops(), fm.key_backward_flops());
  }
  double saved_estimate(const Problem& p) const override { return fmap::RowDenominators::bytes(p); }
  // the projections only when they are drawn for this call (not prepared)
  double backward_memory_estimate(const Problem& p) const override {
    return (maps_.ready(p) ? 0.0 : double(p.heads) * double(features_) * double(p.dim) * 4.0) +
           fmap::attend_backward_bytes(p, features_);
  }

  // The state shares the forward's maps: prepared ones, or drawn now.
  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override {
    Maps::Heads fresh;
    const Maps::Heads& maps = maps_.get(
        p, [&](int64_t h) { return make_map(p, h); }, fresh);
    return fmap::prefill_state(
        p, k, v, t0, 0.0f,
        std::vector<std::shared_ptr<const fmap::FeatureMap>>(maps.begin(), maps.end()),
        double(features_ * p.dim) * 4.0);
  }

  double prefill_flops(const Problem& p, int64_t t0) const override {
    const fmap::PerformerFeatureMap fm({}, features_, p.dim, kernel_);
    return fmap::prefill_flops(p, t0, features_, fm.key_flops()) + draw_flops(p);
  }

  double flops(const Problem& p) const override {
    const fmap::PerformerFeatureMap fm({}, features_, p.dim, kernel_);
    return fmap::attend_flops(p, features_, fm.query_flops(), fm.key_flops()) + draw_flops(p);
  }

  double memory_estimate(const Problem& p) const override {
    const double d = double(p.dim);
    // the projections of every head, plus either what drawing them takes (per thread, for
    // orthogonal blocks: the Gaussian block, its QR and Q, d x d doubles each; freed before
    // the attention starts) or the attention's per-thread workspaces
    const int threads = team_threads();
    const double gen =
        orthogonal_ ? double(std::min<int64_t>(threads, p.heads)) * 3.0 * d * d * 8.0 : 0.0;
    return double(p.heads) * double(features_) * d * 4.0 +
           std::max(gen, fmap::attend_bytes(p, features_));
  }

 private:
  using Maps = PreparedHeads<fmap::PerformerFeatureMap>;
  // Drawing every head's W unless prepared for p: chi norms (2 F d) and the d^-1/4 scaling
  // (F d); orthogonal adds per block of d rows a Householder QR (4/3 d^3) and forming Q
  // (4/3 d^3).
  double draw_flops(const Problem& p) const {
    if (maps_.ready(p)) return 0.0;
    const double f = double(features_), d = double(p.dim);
    const double blocks = std::ceil(f / d);
    return double(p.heads) * (3.0 * f * d + (orthogonal_ ? blocks * (8.0 / 3.0) * d * d * d : 0.0));
  }
  std::unique_ptr<fmap::PerformerFeatureMap> make_map(const Problem& p, int64_t h) const {
    return std::make_unique<fmap::PerformerFeatureMap>(
        fmap::performer_projection(p.seed, h, features_, p.dim, orthogonal_), features_, p.dim,
        kernel_);
  }

  int64_t features_;
  bool orthogonal_;
  fmap::PerformerKernel kernel_;
  Maps maps_;  // W d^-1/4 of every head, once prepare() has drawn them
};

std::vector<double> performer_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                     ConstTensorView k, ConstTensorView v) {
  const int64_t f = var.params().get_int("features"), d = p.dim;
  const bool orthogonal = var.params().get_bool("orthogonal");
  const bool relu = var.params().get_choice("kernel") == "relu";
  const double xscale = std::pow(double(d), -0.25), ratio = 1.0 / std::sqrt(double(f));
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    const std::vector<float> w32 = fmap::performer_projection(p.seed, h, f, d, orthogonal);
    oracle::Matrix w(f, d);
    for (int64_t e = 0; e < f * d; ++e) w.a[size_t(e)] = double(w32[size_t(e)]);
    // x~ = x d^-1/4, its projection W x~ (len x F) and |x~|^2 / 2 per row
    auto project = [&](ConstTensorView x, std::vector<double>& half_norm) {
      oracle::Matrix xt = oracle::head(x, b, h);
      for (double& e : xt.a) e *= xscale;
      half_norm.assign(size_t(xt.rows), 0.0);
      for (int64_t i = 0; i < xt.rows; ++i)
        for (int64_t c = 0; c < d; ++c) half_norm[size_t(i)] += 0.5 * xt(i, c) * xt(i, c);
      return oracle::product_t(xt, w);
    };
    std::vector<double> qn, kn;
    oracle::Matrix fq = project(q, qn), fk = project(k, kn);
    if (relu) {
      for (oracle::Matrix* x : {&fq, &fk})
        for (double& e : x->a) e = ratio * std::max(e, 0.0) + double(fmap::kReluFeatureEps);
    } else {
      // exp(W x~ - |x~|^2 / 2): a query's own max shift takes its norm term with it; keys
      // share the head's largest exponent
      for (int64_t i = 0; i < fq.rows; ++i) {
        double* r = fq.row(i);
        const double top = *std::max_element(r, r + f);
        for (int64_t c = 0; c < f; ++c) r[c] = ratio * std::exp(r[c] - top);
      }
      double top = -INFINITY;
      for (int64_t j = 0; j < fk.rows; ++j)
        for (int64_t c = 0; c < f; ++c) top = std::max(top, fk(j, c) - kn[size_t(j)]);
      for (int64_t j = 0; j < fk.rows; ++j)
        for (int64_t c = 0; c < f; ++c) fk(j, c) = ratio * std::exp(fk(j, c) - kn[size_t(j)] - top);
    }
    return oracle::feature_map_attention(fq, fk, oracle::head(v, b, h), 0.0,
                                         [&](int64_t i) { return p.visible(b, i); });
  });
}

double performer_tolerance(const Variant& var, const Problem& p, const Workload& wl) {
  const double f = double(var.params().get_int("features")), d = double(p.dim);
  const double exponent =
      std::pow(d, 0.25) * logit_size(wl) * std::sqrt(2.0 * std::log(std::max(f, 2.0))) +
      std::sqrt(d) / 2;
  return kErrorMargin * float32_error(d, exponent, double(p.keys()) + f, 6.0);
}

ATTNBENCH_REGISTER_VARIANT(
    performer,
    VariantInfo{
        .name = "performer",
        .summary = "FAVOR+ positive random features approximating softmax (Choromanski et al.)",
        .complexity =
            "time O((n + m) F d), memory O(H F d + threads F (2 R + d)), R = min(1024, 65536 / F)",
        .family = "lowrank",
        .display = "Performer (FAVOR+)",
        .paper = "Choromanski et al. 2020 (arXiv:2009.14794)",
        .look = {.color = "#e377c2", .marker = "v"},
        .params =
            {ParamSpec::Int("features", 256, 1, int64_t(1) << 16, "random features F (rows of W)"),
             ParamSpec::Bool("orthogonal", true,
                             "orthogonal Gaussian blocks (QR) with chi norms; false: iid rows"),
             ParamSpec::Choice("kernel", "softmax", {"softmax", "relu"},
                               "softmax: positive exp features (FAVOR+); relu: relu(W x~) + 1e-3")},
        .caps = {.causal = true, .cross = true, .exact = false, .key_padding = true},
        .make = [](const ParamValues& pv) { return std::make_unique<Performer>(pv); },
        .oracle = performer_oracle,
        .tolerance = performer_tolerance});

}  // namespace
}  // namespace attnbench
