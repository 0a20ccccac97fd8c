// The decode state of a fixed attention pattern (common/core/decode.h): a KV cache that keeps only
// the key blocks some later query still reads. Internal to libattnbench (not installed): the
// pattern variants whose pattern depends on the problem alone (longformer, global, strided,
// sparse_transformer, bigbird) decode through FixedPatternVariant.
//
// The pattern is the variant's own for the whole problem (make_pattern(p, {}, {}), n = m =
// the capacity), so a step's output is row t of the variant's causal forward on the length-n
// sequence: query t attends the keys its pattern row lists among 0 .. t, exact softmax with
// the max subtracted before scaling (common/decode/decode_kernels.h).
//
// Cache. One per (batch, key/value head g) of grouped-query attention, shared by the H / G
// query heads of the group (Problem::kv_head). At prefill, every key block kb gets its last
// reader: the last query block qb >= kb whose key_blocks list kb, in any head of the group
// (O(B H nb listed) for nb = ceil(n / block) blocks). A block lives from its own query block
// to its last reader's; blocks are given slots of `block` rows in that order, a slot reused
// once its block's last reader has passed, so the cache holds at most the largest number of
// blocks live at once (a block no later query reads is never stored). The prefill copies the
// rows of the blocks live at position t0.
//
// Step at t (query block qt): the new key and value go to their block's slot; each query head
// walks key_blocks(qt) up to t (listed once per query block), a full block one run of its
// slot, a partial one the runs of block_mask's row t; the runs' scores, max, exponentials and
// weighted values are one decode::runs_partial. The work is the keys read (plus the mask of
// partial blocks), independent of n. OpenMP over (batch, head) once the keys read are many.
// state_bytes counts the rows of the blocks kept (the caches are allocated for the most blocks
// live at once); the pattern and the block tables, shared by the batch, are not counted.
#pragma once

#include <cstdint>
#include <memory>

#include "common/core/decode.h"
#include "common/core/parallel.h"
#include "common/core/problem.h"
#include "common/core/tensor.h"
#include "common/engines/block_sparse.h"
#include "common/patterns/pattern.h"

namespace attnbench {

/// How a pattern decode state runs its steps.
struct PatternDecodeOptions {
  /// A step reading fewer key floats (keys read x d over every (batch, head)) runs on the
  /// calling thread alone: by default the shared threshold of common/core/threads.h (4 flops per
  /// key float: kParallelMinFlops / 4); the tests set 0 to exercise the parallel path.
  int64_t parallel_floats = int64_t(kParallelMinFlops) / 4;
};

/// The pattern decode state of p (causal self-attention, n = m, the scaled_dot score) with
/// `pattern` (built for p) after rows 0 .. t0 - 1 of k and v [B, H, >= t0, d] (grouped views
/// when p.kv_heads < p.heads: the rows of key/value head g are read through query head
/// g H / G). Throws UsageError for shapes that do not fit p or t0 outside [0, p.n].
std::unique_ptr<DecodeState> pattern_decode_prefill(const Problem& p,
                                                    std::unique_ptr<SparsePattern> pattern,
                                                    ConstTensorView k, ConstTensorView v,
                                                    int64_t t0,
                                                    const PatternDecodeOptions& opt = {});

/// Base of the pattern variants whose pattern depends on the problem alone (make_pattern
/// reads neither q nor k): they decode with their pattern (pattern_decode_prefill). The
/// prefill computes nothing (it copies rows and reads the pattern's block lists).
class FixedPatternVariant : public PatternVariant, public Decoder {
 public:
  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override;
  double prefill_flops(const Problem&, int64_t) const override { return 0.0; }
};

}  // namespace attnbench
