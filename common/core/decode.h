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
  /// Throws UnsupportedError for a problem this decoder cannot generate for. The default
  /// accepts causal self-attention (n = m) with the scaled_dot score, no attention mask and
  /// no key padding.
  virtual void check_decode(const Problem& p) const;
};

}  // namespace attnbench
