// The decode state of exact softmax attention (common/core/decode.h): a KV cache, optionally a
// sliding window of it. Internal to libattnbench (not installed): full and flash decode with
// the whole cache, local with its window.
//
// Storage. Per (batch, head), `slots` rows of d floats for the keys and as many for the values,
// allocated once at prefill: slots = p.n (the capacity) without a window; with a window w the
// cache is a ring of slots = min(p.n, w + 1) rows, position t living in slot t mod slots. The
// prefill copies rows 0 .. t0 - 1 of k and v (with a window only the last `slots` of them).
//
// Attention sinks (with a window, `sinks` = S > 0): rows 0 .. S - 1 are also kept in a cache
// of S rows of their own, written at prefill or when their step comes.
//
// Step at position t = length(): k and v are written to t's slot, then query t attends
// positions lo .. t, lo = 0 without a window and max(0, t - w) with one (local's causal band
// |i - j| <= w, j <= i), and the sinks 0 .. min(S, lo) - 1 left of them, by
//   s_j = q . k_j,  out = sum_j exp((s_j - max s) / sqrt(d)) v_j / sum_j exp((s_j - max s) /
//   sqrt(d))
// with the max subtracted before scaling, as the tiled engine does (flash's arithmetic).
//
// Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"): one query
// has too little work for one task per (batch, head) when there are fewer heads than threads,
// so the visible keys of each (batch, head) are cut into chunks of `min_chunk` .. `max_chunk`
// keys, and every (batch, head, chunk) is a task. A task computes its chunk's scores into a
// per-thread buffer, their max mx, P = exp((s - mx) / sqrt(d)), l = sum P and the unnormalised
// acc = P V (d floats); the chunks of one (batch, head) are then merged by their
// log-sum-exps: M = max mx_c, out = sum_c e_c acc_c / sum_c e_c l_c with
// e_c = exp((mx_c - M) / sqrt(d)). A ring's visible slots wrap at most once, so a chunk is at
// most two contiguous runs of slots. Each cached row is read once per step: the step is
// bound by memory bandwidth once the cache outgrows the caches.
#pragma once

#include <cstdint>
#include <memory>

#include "common/core/decode.h"
#include "common/core/parallel.h"
#include "common/core/problem.h"
#include "common/core/tensor.h"

namespace attnbench {

/// How a KV-cache state is built.
struct KvDecodeOptions {
  /// No window: every earlier position is visible.
  static constexpr int64_t kNoWindow = -1;
  /// Keys on the query's left it sees (local's `window`; kNoWindow for all of them).
  int64_t window = kNoWindow;
  /// With a window: positions 0 .. sinks - 1 stay visible to every step (local's attention
  /// sinks), kept in rows of their own beside the ring. Ignored without a window.
  int64_t sinks = 0;
  /// Bounds on the keys per chunk of one (batch, head) (1 <= min_chunk <= max_chunk): a step
  /// cuts its visible keys into about 4 tasks per thread, chunks no shorter than min_chunk
  /// (below that the merge outweighs the split) and no longer than max_chunk (the per-thread
  /// score buffer); on one thread the chunks are max_chunk keys. The tests shrink them to
  /// exercise the merge on short sequences.
  int64_t min_chunk = 256, max_chunk = 2048;
  /// A step whose cached key floats (visible keys x d over every (batch, head)) are fewer runs
  /// on the calling thread alone: a few microseconds of work would otherwise wait for the
  /// team (and, on a loaded machine, for a descheduled thread). The default is the shared
  /// threshold of common/core/threads.h (4 flops per key float: kParallelMinFlops / 4); the tests
  /// set 0 to exercise the parallel path on short sequences.
  int64_t parallel_floats = int64_t(kParallelMinFlops) / 4;
};

/// The KV-cache state of p (causal self-attention, n = m, the scaled_dot score) after rows
/// 0 .. t0 - 1 of k and v [B, H, >= t0, d], with room for p.n positions. Throws UsageError
/// for shapes that do not fit p, t0 outside [0, p.n] or bad options.
std::unique_ptr<DecodeState> kv_decode_prefill(const Problem& p, ConstTensorView k,
                                               ConstTensorView v, int64_t t0,
                                               const KvDecodeOptions& opt = {});

/// The decoder of exact softmax attention over a KV cache, for a variant to derive from: the
/// prefill copies rows of k and v into the cache and computes nothing.
class KvCacheDecoder : public Decoder {
 public:
  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override {
    return kv_decode_prefill(p, k, v, t0, cache_options());
  }
  double prefill_flops(const Problem&, int64_t) const override { return 0.0; }

 protected:
  /// The cache's window and sinks: the whole cache unless the variant sees less.
  virtual KvDecodeOptions cache_options() const { return {}; }
};

}  // namespace attnbench
