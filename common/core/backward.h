// The training pass: an optional capability a variant opts into by returning a Backward from
// Variant::backward(). `list` derives its `backward` column from that pointer, so no flag can
// claim a backward pass a variant lacks.
//
// For a variant computing O = f(Q, K, V) and an upstream gradient dO, the backward pass writes
// the gradients of L = sum(dO ∘ O):
//   dQ = dL/dQ [B, H, n, d],  dK = dL/dK [B, H, m, d],  dV = dL/dV [B, H, m, d].
// Exact softmax attention, P = softmax(s Q Kᵀ + mask), O = P V (docs/passes.md, "Training:
// the backward pass"):
//   dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − D) with D_i = Σ_c dO_ic O_ic,
//   dQ = s dS K,  dK = s dSᵀ Q.
// A pattern variant: the same restricted to its pattern. An approximation differentiates its
// own function; the random draws and discrete choices of forward_train (features, hashes,
// random blocks, buckets) are constants of the backward.
//
// The pass is split as frameworks split it: forward_train runs the forward and returns what
// the backward needs (the saved state: P for `full`, the rows' log-sum-exps for `flash`, ...);
// backward takes dO and that state. The harness times them apart (--pass bwd) or together
// (--pass fwdbwd), and measures the saved state's bytes (allocated by forward_train and still
// held when it returns) and the backward's own working peak with the counting allocator.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/problem.h"
#include "common/core/tensor.h"

namespace attnbench {

/// What a forward_train keeps for its backward, beyond the inputs and the output (which the
/// backward receives again). A variant derives its own.
class SavedState {
 public:
  virtual ~SavedState() = default;
};

/// The saved state of a backward that recomputes what it needs from q, k and v: nothing.
class NothingSaved final : public SavedState {
 public:
  /// UsageError naming `variant` unless `saved` is a NothingSaved (another variant's state).
  static void expect(const SavedState& saved, const char* variant) {
    if (!dynamic_cast<const NothingSaved*>(&saved))
      throw UsageError(std::string(variant) +
                       ": the saved state is not from its forward_train (it keeps nothing)");
  }
};

/// Gradients of the inputs beyond q, k and v that a problem gives (Problem::extra_inputs), by
/// name, each with its input's shape and layout.
using InputGrads = std::map<std::string, std::vector<float>, std::less<>>;

/// The backward pass of a variant (Variant::backward()).
class Backward {
 public:
  virtual ~Backward() = default;

  /// Whether backward_inputs() gives the gradients of the inputs beyond q, k and v a problem
  /// gives (the default: no; Variant::check_backward then refuses a problem that gives any).
  virtual bool gives_input_grads() const { return false; }
  /// backward() that also writes dL/dx of every input x the problem gives into dinputs[name]
  /// (resized to x's size, overwritten). Called instead of backward() when p gives inputs.
  virtual void backward_inputs(const Problem& p, ConstTensorView q, ConstTensorView k,
                               ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                               const SavedState& saved, TensorView dq, TensorView dk, TensorView dv,
                               InputGrads& dinputs);

  /// The forward pass, writing out exactly as Variant::forward would, and returning what
  /// backward() needs. Shapes are checked and the problem is one the variant supports (and
  /// one check_backward accepted).
  virtual std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q,
                                                    ConstTensorView k, ConstTensorView v,
                                                    TensorView out) = 0;

  /// dq [B, H, n, d], dk and dv [B, H, m, d] (overwritten) of L = sum(dout ∘ out), where out
  /// and saved come from forward_train on the same problem and inputs.
  virtual void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                        ConstTensorView out, ConstTensorView dout, const SavedState& saved,
                        TensorView dq, TensorView dk, TensorView dv) = 0;

  /// Floating-point operations of one backward() (multiply-add = 2).
  virtual double backward_flops(const Problem& p) const = 0;
  /// Bytes forward_train keeps in its saved state.
  virtual double saved_estimate(const Problem& p) const = 0;
  /// Working bytes backward() allocates beyond inputs, output, saved state and gradients.
  virtual double backward_memory_estimate(const Problem& p) const = 0;

  /// Throws UnsupportedError for a problem the forward supports but this backward does not
  /// (the default: the additive score, whose weights the backward does not differentiate).
  virtual void check_backward(const Problem& p) const;
};

/// A backward that keeps nothing, for a variant to derive from: forward_train is the variant's
/// forward, and backward recomputes what it needs from q, k and v. `Self` is the variant (it
/// derives from Variant and from RecomputeBackward<Self>) and defines, public,
///   void recompute_backward(const Problem&, ConstTensorView q, ConstTensorView k,
///                           ConstTensorView v, ConstTensorView out, ConstTensorView dout,
///                           TensorView dq, TensorView dk, TensorView dv);
/// with backward()'s contract.
template <class Self>
class RecomputeBackward : public Backward {
 public:
  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) final {
    self().forward(p, q, k, v, out);
    return std::make_unique<NothingSaved>();
  }
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) final {
    NothingSaved::expect(saved, self().info().name.c_str());
    self().recompute_backward(p, q, k, v, out, dout, dq, dk, dv);
  }
  double saved_estimate(const Problem&) const final { return double(sizeof(NothingSaved)); }

 private:
  Self& self() { return static_cast<Self&>(*this); }
};

}  // namespace attnbench
