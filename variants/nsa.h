// What nsa's forward (variants/nsa.cpp) and its backward (variants/nsa_backward.cpp) share: the
// configuration, the gates' stand-in vectors, the mean pooling, and the state forward_train
// keeps for the backward.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/core/backward.h"
#include "common/core/error.h"
#include "common/core/problem.h"
#include "common/core/registry.h"
#include "common/core/tensor.h"

namespace attnbench::nsa {

struct Config {
  int64_t l, s, lsel, top, w;

  /// Compressed blocks whose keys all exist among `len` keys.
  int64_t pooled(int64_t len) const { return len >= l ? (len - l) / s + 1 : 0; }
  /// Compressed blocks visible to position t (their last key <= t).
  int64_t visible(int64_t t) const { return pooled(t + 1); }
  /// Keys (pooled and full) one head's position t attends.
  int64_t row_keys(int64_t t) const {
    const int64_t cur = t / lsel;
    return visible(t) + std::min(top, cur + 1) * lsel - ((cur + 1) * lsel - 1 - t) +
           std::min(w, t + 1);
  }
};

/// The configuration of nsa's parameters; SpecError for a combination it cannot run.
Config config_of(const ParamValues& pv);

/// The names of the gate inputs, in branch order (compression, selection, window).
constexpr std::array<const char*, 3> kGateInputs = {"g_cmp", "g_slc", "g_swa"};

/// The stand-in gate vectors u_{c,h}, [H][3][d] (c: 0 compression, 1 selection, 2 window).
std::vector<float> gate_vectors(uint64_t seed, int64_t heads, int64_t d);

/// The gate inputs p gives the variant, in branch order (null where stood in).
std::array<const float*, 3> given_gates(const Variant& var, const Problem& p);

/// Compressed rows i0 .. i1 - 1 of one head: out row i = mean of x rows i s .. i s + l - 1
/// (x row j at x + j sr).
void pool(const Config& c, const float* x, int64_t sr, int64_t d, int64_t i0, int64_t i1,
          float* out);

/// What forward_train keeps: every position's chosen selection blocks, the three branch
/// outputs of every query row before the gates, and the log-sum-exps of the selection and
/// window branches (natural log of sum exp(q . k / sqrt(d)) over the row's keys).
class Saved final : public SavedState {
 public:
  Saved(const Config& c, const Problem& p)
      : chosen(size_t(p.batch * p.kv_head_count() * p.n * c.top), -1),
        branch(size_t(3 * p.batch * p.heads * p.n * p.dim)),
        lse(size_t(2 * p.batch * p.heads * p.n)) {}
  std::vector<int32_t> chosen;  ///< [B, G, n, top], ascending, -1 padded
  std::vector<float> branch;    ///< [3][B, H, n, d]: o_cmp, o_sel, o_win
  std::vector<float> lse;       ///< [2][B, H, n]: selection, window (window: -inf if w = 0)

  static double bytes(const Config& c, const Problem& p) {
    return 4.0 * double(p.batch * p.n) *
           (double(p.kv_head_count() * c.top) + double(p.heads) * double(3 * p.dim + 2));
  }
  /// `saved` as the Saved of forward_train on p; UsageError if it is another state.
  static const Saved& of(const SavedState& saved, const Config& c, const Problem& p) {
    const auto* st = dynamic_cast<const Saved*>(&saved);
    if (!st || st->chosen.size() != size_t(p.batch * p.kv_head_count() * p.n * c.top) ||
        st->branch.size() != size_t(3 * p.batch * p.heads * p.n * p.dim))
      throw UsageError("nsa: the saved state is not from its forward_train on this problem");
    return *st;
  }
};

/// The float64 oracle (VariantInfo::oracle; variants/nsa_oracle.cpp): the definition in the
/// header of variants/nsa.cpp, row by row.
std::vector<double> float64_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                   ConstTensorView k, ConstTensorView v);
/// Its float32 tolerance (VariantInfo::tolerance).
double float32_tolerance(const Variant& var, const Problem& p, const Workload& wl);

/// dq, dk, dv (one head each per query head: dk.head(b, h) is the gradient of query head h's
/// view of k) of L = sum(dout ∘ out) for nsa's forward with the saved selection held fixed,
/// and, where `given[c]` is given, dL/dg_c into dgates[c] ([B, H, n], if not null). Gates
/// stood in for (sigmoid(q . u)) are differentiated into dq.
void backward(const Config& c, const Problem& p, ConstTensorView q, ConstTensorView k,
              ConstTensorView v, ConstTensorView dout, const Saved& saved, TensorView dq,
              TensorView dk, TensorView dv, std::array<const float*, 3> given,
              std::array<float*, 3> dgates);
/// Floating-point operations of backward() (multiply-add = 2).
double backward_flops(const Config& c, const Problem& p);
/// Bytes backward() allocates beyond inputs, saved state and gradients.
double backward_bytes(const Config& c, const Problem& p);

}  // namespace attnbench::nsa
