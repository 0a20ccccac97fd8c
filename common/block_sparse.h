// The block-sparse engine: exact softmax attention restricted to a pattern.
//
// For each (batch, head, query block) it visits only the key blocks the pattern lists,
// masks partial blocks element by element (and blocks crossing the causal diagonal), and
// keeps an online softmax (running max and sum per row) over them:
//
//   out_i = sum_{j in P(i), j visible} softmax_j(q_i . k_j / sqrt(d)) v_j
//
// Each task is one (batch, head, query block): the pattern's block size is both the query
// tile (rows) and the key block (cols). It runs the tile passes of flash
// (common/attention_kernels.h: AVX-512 register-blocked kernels on transposed score tiles, or
// the portable Eigen passes), so per computed score it runs at close to flash's rate. Key
// blocks wholly past the causal diagonal are skipped, and keys past the last one the block's
// last row sees are not computed; a partial block takes its element mask from
// SparsePattern::block_mask (disallowed scores -> -inf before the max and the exponentials),
// a block crossing the causal diagonal is masked as in flash. Rows that attend no key are 0.
//
// Time O(B H n (keys per row) d); memory O(threads block (block + d)) plus the pattern.
#pragma once

#include <memory>

#include "common/pattern.h"
#include "common/registry.h"

namespace attnbench {

/// out = attention of q over k, v restricted to `pat` and the causal mask. Rows that attend
/// no key are 0. OpenMP over (batch, head, query block), dynamically scheduled.
void block_sparse_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, TensorView out, const SparsePattern& pat);

/// Bytes block_sparse_attention allocates beyond inputs, output and the pattern: per thread,
/// the tiles of the kernels, the element-mask tile and the key-block list (reserved for every
/// key block, so it never grows if the pattern clears and refills it).
double block_sparse_memory(const Problem& p, int64_t block);

/// The `block` parameter every pattern variant declares: the layout block size (query and key
/// tile) of the engine.
inline ParamSpec block_param() {
  return ParamSpec::Int("block", 64, 1, 4096,
                        "layout block size of the block-sparse engine (query and key tile)");
}

/// Base of the pattern variants: a subclass only describes its pattern (make_pattern);
/// forward runs the engine, flops count the scores the engine computes (4 d per score).
class PatternVariant : public Variant {
 public:
  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override;
  double flops(const Problem& p) const override;
  double memory_estimate(const Problem& p) const override;
};

}  // namespace attnbench
