// Generation: an optional capability a variant opts into by returning a Decoder from
// Variant::decoder(). `list` derives its `decode` column from that pointer, so no flag can
// claim a decode step a variant lacks.
//
// Autoregressive generation is causal self-attention one token at a time
// (docs/passes.md, "Generation: the decode pass"). A prefill builds, for every (batch, head), the
// state the variant keeps of the first t0 tokens' keys and values (a KV cache, a window, a pooled
// cache, recurrent matrices); each step then appends one key and value per (batch, head) at
// position t = length() and attends one query at that position:
//
//   prefill(p, k, v, t0)          state after keys and values 0 .. t0 - 1
//   step(q, k, v, out)            append k, v as position t, then out = attention of q at t
//
// Prefill t0 tokens, then step through positions t0 .. n - 1 with rows t0 .. n - 1 of q, k
// and v: the step outputs equal rows t0 .. n - 1 of the variant's causal forward pass on the
// whole sequence (exact variants to float rounding, approximations to their own causal
// forward's rounding).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/core/problem.h"
#include "common/core/tensor.h"

namespace attnbench {

/// What a sequence keeps between generation steps (one object for every batch element and
/// head of the problem it was built for).
class DecodeState {
 public:
  virtual ~DecodeState() = default;
  /// Tokens appended so far (prefill and steps): the position of the next step.
  virtual int64_t length() const = 0;
  /// Appends k, v [B, H, 1, d] as position t = length() and writes out [B, H, 1, d], the
  /// output of query q [B, H, 1, d] at position t over the keys its causal pattern gives it
  /// among 0 .. t. Throws UsageError when the state is full (t = p.n of the prefill).
  virtual void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) = 0;
  /// step() with the token's values of the variant's given inputs (gla's g, deltanet's beta:
  /// each shaped as in Problem::extra_inputs with 1 on its token axis), for a state that
  /// Decoder::prefill_given built with the same inputs. The default throws UnsupportedError.
  virtual void step_given(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          const ExtraInputs& in, TensorView out);
  /// Bytes the state holds per sequence (batch element) now.
  virtual double state_bytes() const = 0;
  /// Bytes of state the next step reads (every batch element and head), its own key and
  /// value included.
  virtual double step_bytes_read() const = 0;
  /// Floating-point operations of the next step (multiply-add = 2).
  virtual double step_flops() const = 0;
};

/// Throws UsageError unless k and v fit a prefill of t0 tokens of p ([B, H, >= t0, d]) and t0
/// is in [0, p.n]. Decoders call it first.
void check_prefill(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t t0);
/// The data of the input `name` of `in`, or nullptr when `in` does not hold it.
inline const float* given_data(const ExtraInputs& in, std::string_view name) {
  const auto it = in.find(name);
  return it == in.end() ? nullptr : it->second.data.data();
}
/// The names of `in`, joined with '+' ("beta+g"): what a decode state records and checks.
std::string input_names(const ExtraInputs& in);
/// Throws UsageError unless a state prefilled with the inputs `names` (input_names; empty:
/// stood in for) is stepped with the same ones (`in`, null for step()).
void check_step_inputs(const std::string& names, const ExtraInputs* in);

/// Throws UsageError when a state holding `length` of its `capacity` tokens is full or when q,
/// k, v or out is not of the shape `token` ([B, H, 1, d]). DecodeState::step calls it first.
void check_step(int64_t length, int64_t capacity, const Shape4& token, ConstTensorView q,
                ConstTensorView k, ConstTensorView v, ConstTensorView out);

/// The generation pass of a variant (Variant::decoder()).
class Decoder {
 public:
  virtual ~Decoder() = default;
  /// The state after the first t0 tokens: rows 0 .. t0 - 1 of k and v [B, H, >= t0, d] (t0
  /// may be 0), with room for p.n tokens in all. p is causal self-attention (n = m) that
  /// check_decode accepted.
  virtual std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k,
                                               ConstTensorView v, int64_t t0) = 0;
  /// Floating-point operations of prefill(p, ..., t0).
  virtual double prefill_flops(const Problem& p, int64_t t0) const = 0;
  /// Whether the recurrence takes the variant's given inputs token by token (prefill_given,
  /// DecodeState::step_given): gla's g, deltanet's beta and g.
  virtual bool decodes_inputs() const { return false; }
  /// prefill() with the given inputs of the first t0 tokens (each shaped as in
  /// Problem::extra_inputs with at least t0 on its token axis, as k and v have at least t0
  /// rows; Variant::check_token_inputs accepted them). The state's steps then take the same
  /// inputs (step_given). The default throws UnsupportedError.
  virtual std::unique_ptr<DecodeState> prefill_given(const Problem& p, ConstTensorView k,
                                                     ConstTensorView v, int64_t t0,
                                                     const ExtraInputs& in);
  /// Throws UnsupportedError for a problem this decoder cannot generate for. The default
  /// accepts causal self-attention (n = m) with the scaled_dot score, no attention mask and
  /// no key padding.
  virtual void check_decode(const Problem& p) const;
};

}  // namespace attnbench
