// Linear attention with decay (retention, gated linear attention): one engine for the forward
// (chunkwise and recurrent forms), the backward and the decode state.
//
// Per (batch, state) with a per-key-dimension decay a_t in (0, 1]^d:
//   S_t = diag(a_t) S_{t-1} + k_t v_t^T   (S: d x d, [key dim, value dim], S_{-1} = 0)
//   o_t = s S_t^T q_t,                    s = 1 / sqrt(d)
// for every query head that reads the state. Retention: a_t = gamma on every dimension, one
// state per query head (gamma is per query head). Gated linear attention: log a_t comes from
// the key row through a Gate, one state per key/value head, shared by its group's query heads.
//
// Chunkwise form, per chunk of C rows with b_i = sum of log a over the chunk's rows 0 .. i
// (per dimension, relative to the chunk start, so every factor exp(b_i - b_j), j <= i, is at
// most 1):
//   1. inter-chunk: O_c = s (Q_c o exp(b)) S            (S: the state before the chunk)
//   2. intra-chunk: O_c += (s (Q_c K_c^T) masked by the decays) V_c, by sub-chunks of 16 rows:
//      sub-chunk I uses the reference row r = (its first row) - 1, Q_I o exp(b_I - b_r) <= 1 and
//      K_j o exp(b_r - b_j) (<= 1 for j <= r, bounded by the sub-chunk's own decay for j in I);
//      when that own decay exceeds e^60 on some dimension, I's diagonal block is formed element
//      by element with exp(b_i - b_j) instead (no overflow for any decay).
//   3. state: S = diag(exp(b_{C-1})) S + (K_c o exp(b_{C-1} - b_j))^T V_c.
// Retention's decay is a scalar, so its mask is the fixed matrix gamma^(i-j) and step 2 is one
// masked product per chunk.
// Recurrent form: the steps above one token at a time (the decode step), the row of S updated
// and read in one pass, S (16 KiB at d = 64) staying in L1.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/core/decode.h"
#include "common/core/problem.h"
#include "common/core/registry.h"
#include "common/core/tensor.h"

namespace attnbench::decay_attention {

/// The data-dependent decay of gated linear attention:
///   log a_t = log(sigmoid(k_t W1 W2 + bias)) / tau,   W1: d x rank, W2: rank x d,
/// W1 and W2 seeded (entries N(0, 1/d) and N(0, 1/rank)), one pair for every head: a key/value
/// head's decay is a function of its keys alone, so grouped heads equal their copies.
struct Gate {
  int64_t d = 0, rank = 0;
  double tau = 16, bias = 0;
  std::vector<float> w1, w2;  ///< row-major d x rank and rank x d

  Gate(const Problem& p, int64_t rank, double tau, double bias);
  /// log a of `rows` key rows (row stride `stride`): out[rows x d].
  void log_decay(const float* k, int64_t stride, int64_t rows, float* out) const;
  /// The same in double for one key row.
  std::vector<double> log_decay(const float* k) const;
  /// dk += (d log a / dk)^T dlog for one key row (dlog: d entries).
  void backward(const float* k, const float* dlog, float* dk) const;
  /// Floating-point operations of log_decay per row.
  double flops() const { return 4.0 * double(d * rank) + 20.0 * double(d); }
};

enum class Form { chunkwise, recurrent };

/// The decay of one variant instance: gamma per query head (retention), or gla's
/// data-dependent decay, given (the input g) or computed by the seeded gate (its stand-in).
struct Decay {
  std::vector<float> gamma;    ///< retention: per query head; empty for gla
  std::shared_ptr<Gate> gate;  ///< gla without g
  /// gla's g: log a [B, G, n, d] (Problem::extra_inputs); the gate is then null.
  const float* given = nullptr;
  int64_t given_rows = 0;  ///< rows per head of `given` (0: p.n; a decode prefill's may be more)
  bool shared() const { return gate != nullptr || given != nullptr; }  ///< a state per kv head
};

/// out = the decayed linear attention of q, k, v (p causal self-attention).
void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
             TensorView out, const Decay& decay, Form form, int64_t chunk);
double forward_flops(const Problem& p, const Decay& decay, Form form, int64_t chunk);
double forward_bytes(const Problem& p, const Decay& decay, Form form, int64_t chunk);

/// dq, dk, dv (per query head, dk and dv not grouped) of L = sum(dout o out): a reverse
/// recurrence per query head over the states at chunk boundaries (recomputed), the gate's
/// gradient taken into dk. With the log decays given (decay.given) and `dlog`, dL/d(log a)
/// per query head into dlog [B, H, n, d] (each query head's share of its key/value head's).
void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
              ConstTensorView dout, TensorView dq, TensorView dk, TensorView dv, const Decay& decay,
              int64_t chunk, float* dlog = nullptr);
double backward_flops(const Problem& p, const Decay& decay);
double backward_bytes(const Problem& p, const Decay& decay, int64_t chunk);

/// The decode state after rows 0 .. t0 - 1 (folded in chunkwise). With gla's log decays
/// given (decay.given, decay.given_rows rows per head), its steps take them (step_given).
std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                     int64_t t0, const Decay& decay, int64_t chunk);
double prefill_flops(const Problem& p, int64_t t0, const Decay& decay, int64_t chunk);

/// The float64 recurrence: the oracle of both variants.
std::vector<double> recurrence_oracle(const Problem& p, ConstTensorView q, ConstTensorView k,
                                      ConstTensorView v, const Decay& decay);

/// The variant class of retention and gla: parameters `form` and `chunk`, the decay from
/// decay(p) (VariantInfo::oracle and tolerance below serve both).
class DecayVariant : public Variant, public Backward, public Decoder {
 public:
  explicit DecayVariant(const ParamValues& pv);
  /// The decay of this instance on p (gamma per query head, or the seeded gate).
  virtual Decay decay(const Problem& p) const = 0;

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override;
  double flops(const Problem& p) const override;
  double memory_estimate(const Problem& p) const override;

  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override;
  using Variant::backward;  // the accessor stays visible beside the pass
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override;
  /// gla with g given: its gradient dL/dg beside dq, dk, dv.
  bool gives_input_grads() const override { return true; }
  void backward_inputs(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       ConstTensorView out, ConstTensorView dout, const SavedState& saved,
                       TensorView dq, TensorView dk, TensorView dv, InputGrads& dinputs) override;
  double backward_flops(const Problem& p) const override;
  double saved_estimate(const Problem&) const override { return 0; }
  double backward_memory_estimate(const Problem& p) const override;

  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override;
  double prefill_flops(const Problem& p, int64_t t0) const override;
  bool decodes_inputs() const override { return !info().inputs.empty(); }
  std::unique_ptr<DecodeState> prefill_given(const Problem& p, ConstTensorView k, ConstTensorView v,
                                             int64_t t0, const ExtraInputs& in) override;

 private:
  Form form_;
  int64_t chunk_;
};

/// The parameters both variants declare: form and chunk.
std::vector<ParamSpec> decay_params();
/// VariantInfo::oracle of both: the float64 recurrence with the variant's decay.
std::vector<double> decay_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                 ConstTensorView k, ConstTensorView v);
/// VariantInfo::tolerance of both (see the .cpp for the error model).
double decay_tolerance(const Variant& var, const Problem& p, const Workload& w);

}  // namespace attnbench::decay_attention
