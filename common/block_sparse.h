// The tiled attention engine: exact softmax attention over query tiles and key blocks with an
// online softmax (running max and sum per row), the n x m score matrix never stored. One task
// loop serves two cases:
//
//   dense         every key (flash):  out_i = sum_{j visible} softmax_j(q_i . k_j / sqrt(d)) v_j
//   block-sparse  a pattern P (the pattern variants, compressed):
//                 out_i = sum_{j in P(i), j visible} softmax_j(q_i . k_j / sqrt(d)) v_j
//
// Each task is one (batch, head, query tile), scheduled dynamically, the last query tiles of a
// head (under a causal mask, the heaviest) first. A query tile has block_q rows and walks key
// blocks of block_k keys. Dense: every key block up to the last key the tile's last row sees,
// none masked, with no pattern, block list or mask tile to pay for; the two tile sizes are
// free. Block-sparse: both are the pattern's block size, and the task visits only the key
// blocks the pattern lists; a partial block takes its element mask from
// SparsePattern::block_mask (disallowed scores -> -inf before the max and the exponentials).
// In both, key blocks wholly past the causal diagonal are skipped, keys past the last one the
// tile's last row sees are not computed, and a block crossing the diagonal is masked element
// by element. Rows that attend no key are 0.
//
// Under the additive score (Problem::score) the engine projects q' = W_q q and k' = W_k k once
// per call and pass 1 of every tile takes its logits from the score-tile hook
// (kernels::ScoreHook, common/additive_score.h) instead of Q K^T, with softmax scale 1; every
// case of the engine, dense or block-sparse, so gets the additive score.
//
// Masks (Problem::key_lengths, Problem::attn_mask): key padding shortens each task's key range
// (blocks past batch element b's length are never visited); an attention mask gives every key
// block an element mask (its -inf entries, with the pattern's) and a bias tile added to the
// scores (divided by the softmax scale), and a block it hides wholly is skipped.
//
// The tiles run the passes of common/attention_kernels.h (AVX-512 register-blocked kernels on
// transposed score tiles, or the portable Eigen passes), so per computed score the sparse case
// runs at close to the dense rate.
//
// Time O(B H n (keys per row) d); memory O(threads block_q (block_k + d)), plus the pattern.
#pragma once

#include <memory>

#include "common/pattern.h"
#include "common/registry.h"

namespace attnbench {

/// Where the engine writes each query row's log-sum-exp of its logits, log sum_j exp(s_ij)
/// over the keys it attended (s_ij = q_i . k_j / sqrt(d) plus the mask's bias, or the
/// additive score): row i of head (b, h) at data + b stride_b + h stride_h + i stride_row.
/// A row that attended no key gets -inf, a row with a non-finite logit NaN. Two results over
/// disjoint key sets merge into the result over their union through it (merge_attention).
struct LseView {
  float* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_row = 1;
  float& at(int64_t b, int64_t h, int64_t i) const {
    return data[b * stride_b + h * stride_h + i * stride_row];
  }
};

/// out = attention of q over k, v restricted to `pat` and the causal mask. Rows that attend
/// no key are 0. OpenMP over (batch, head, query block), dynamically scheduled. With `lse`,
/// also every row's log-sum-exp.
void block_sparse_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, TensorView out, const SparsePattern& pat,
                            const LseView* lse = nullptr);

/// out = exact attention of q over k, v (the causal mask applied), in tiles of block_q query rows
/// and block_k keys: the engine's dense case, every key block of every query tile, with no
/// pattern, block list or element mask. OpenMP over (batch, head, query tile), dynamically
/// scheduled. With `lse`, also every row's log-sum-exp.
void dense_attention(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     TensorView out, int64_t block_q, int64_t block_k,
                     const LseView* lse = nullptr);

/// out (holding the attention of its rows over one set of keys, with log-sum-exps lse_out)
/// becomes the attention over that set and a disjoint one whose result is other (with
/// lse_other): each row is the two rows weighted by exp(lse) over their sum, 0 where neither
/// attended a key (lse_out then -inf), NaN where either log-sum-exp is NaN. OpenMP over (batch,
/// head).
void merge_attention(const Problem& p, TensorView out, const LseView& lse_out,
                     ConstTensorView other, const LseView& lse_other);

/// Bytes dense_attention allocates beyond inputs and output: per thread, the kernels' tiles.
double dense_attention_memory(const Problem& p, int64_t block_q, int64_t block_k);

/// Bytes block_sparse_attention allocates beyond inputs, output and the pattern: per thread,
/// the tiles of the kernels, the element-mask tile and the key-block list (reserved for every
/// key block, so it never grows if the pattern clears and refills it).
double block_sparse_memory(const Problem& p, int64_t block);

/// The `block` parameter every pattern variant declares: the layout block size of the engine's
/// block-sparse case (its query tile and key block).
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
