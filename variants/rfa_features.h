// The random features of the rfa variant (variants/rfa.cpp): the draws of a head (the
// projection W and the gate) and the feature map phi(x) = D^-1/2 [sin(W x^), cos(W x^)] with
// its backward, shared by the plain and gated forms, their backward passes and the oracle.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common/engines/feature_map_attention.h"

namespace attnbench::rfa {

/// W (features x d, row-major) of head `head`: entries N(0, sigma^-2).
std::vector<float> rfa_projection(uint64_t seed, int64_t head, int64_t features, int64_t d,
                                  double sigma);

/// The gate of head `head`: w_g (d entries, N(0, 1/d)) followed by b_g (N(0, 1)).
std::vector<float> rfa_gate(uint64_t seed, int64_t head, int64_t d);

/// phi(x) = D^-1/2 [sin(W x^), cos(W x^)] over rows; 2 D features.
class RfaFeatureMap final : public feature_map::FeatureMap {
 public:
  RfaFeatureMap(std::vector<float> w, int64_t freqs, int64_t d, float floor)
      : w_(std::move(w)), freqs_(freqs), d_(d), floor_(floor) {}
  int64_t features() const override { return 2 * freqs_; }
  void queries(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo) const override {
    map(x, ldx, rows, out, ldo);
  }
  // |phi| = 1: no stabiliser, the shift is left alone
  void keys(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo,
            float&) const override {
    map(x, ldx, rows, out, ldo);
  }
  // projection GEMM, |x|^2, scaling, sin, cos and two scalings per frequency
  double query_flops() const override {
    return 2.0 * double(freqs_ * d_) + 2.0 * double(d_) + 5.0 * double(freqs_);
  }
  double key_flops() const override { return query_flops(); }
  float denominator_floor() const override { return floor_; }

  // a_f = (W x^)_f: da_f = D^-1/2 (dphi_f cos a_f - dphi_{D+f} sin a_f)
  //                      = dphi_f phi_{D+f} - dphi_{D+f} phi_f;
  // dx^ = W^T da, and through x^ = x / |x|: dx = (dx^ - x^ (x^ . dx^)) / |x| (0 for x = 0)
  void queries_backward(const float* x, int64_t ldx, int64_t rows, const float* phi, int64_t ldp,
                        float* dphi, int64_t ldd, float* dx, int64_t lddx) const override;
  void keys_backward(const float* x, int64_t ldx, int64_t rows, const float* phi, int64_t ldp,
                     float* dphi, int64_t ldd, float* dx, int64_t lddx) const override {
    queries_backward(x, ldx, rows, phi, ldp, dphi, ldd, dx, lddx);
  }
  // da (3 per frequency), the GEMM back through W, the normalisation (6 per entry)
  double query_backward_flops() const override {
    return 2.0 * double(freqs_ * d_) + 3.0 * double(freqs_) + 6.0 * double(d_);
  }
  double key_backward_flops() const override { return query_backward_flops(); }

 private:
  // phi of `rows` rows of x (ldx apart) into out (ldo apart)
  void map(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo) const;

  std::vector<float> w_;  // W, freqs x d
  int64_t freqs_, d_;
  float floor_;
};

}  // namespace attnbench::rfa
