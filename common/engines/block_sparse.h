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
// (kernels::ScoreHook, common/kernels/additive_score.h) instead of Q K^T, with softmax scale 1;
// every case of the engine, dense or block-sparse, so gets the additive score.
//
// Masks (Problem::key_lengths, Problem::attn_mask): key padding shortens each task's key range
// (blocks past batch element b's length are never visited); an attention mask gives every key
// block an element mask (its -inf entries, with the pattern's) and a bias tile added to the
// scores (divided by the softmax scale), and a block it hides wholly is skipped.
//
// The tiles run the passes of common/kernels/attention_kernels.h (AVX-512 register-blocked kernels
// on transposed score tiles, or the portable Eigen passes), so per computed score the sparse case
// runs at close to the dense rate.
//
// Backward (dense_attention_backward, block_sparse_attention_backward): the forward keeps only
// out and every row's log-sum-exp (LseView); the backward recomputes P tile by tile for the
// same (query tile, key block) pairs, with the same masks, in one loop for both cases. Its
// tasks are (batch, head, key block), each summing its block's dK and dV; dQ is summed per
// thread and reduced. Its tile products are OpenBLAS sgemm calls on every target.
//
// Time O(B H n (keys per row) d); memory O(threads block_q (block_k + d)), plus the pattern
// (backward: plus a dQ accumulator [B, H, n, d] per thread but one).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/core/backward.h"
#include "common/core/registry.h"
#include "common/patterns/pattern.h"

namespace attnbench {

/// Where the engine writes each query row's log-sum-exp of its logits, log sum_j exp(s_ij)
/// over the keys it attended (s_ij = q_i . k_j / sqrt(d) plus the mask's bias, or the
/// additive score): row i of head (b, h) at data + b stride_b + h stride_h + i stride_row.
/// A row that attended no key gets -inf, a row with a non-finite logit NaN. Two results over
/// disjoint key sets merge into the result over their union through it (merge_attention).
struct LseView {
  float* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_row = 1;
  /// If not null, every row's max in raw score units (the same strides), and data holds the
  /// log-sum-exp relative to it: lse = max * scale + data. A float lse cannot hold both when
  /// the max is huge (a row masked wholly by -FLT_MAX sits at -FLT_MAX / 4 raw: its log of
  /// the sum, log m, is far below one ulp); the engine's backward then recomputes P from
  /// the two. Only the engine's forward (which writes it) and backward read this form.
  float* max = nullptr;
  float& at(int64_t b, int64_t h, int64_t i) const {
    return data[b * stride_b + h * stride_h + i * stride_row];
  }
  float& max_at(int64_t b, int64_t h, int64_t i) const {
    return max[b * stride_b + h * stride_h + i * stride_row];
  }
};

/// A saved state of every row's log-sum-exp [B, H, n] (with out, what the engine's backward
/// needs), for variants whose training forward keeps nothing else.
class LseSaved final : public SavedState {
 public:
  /// `split`: with an attention mask, also the rows' max (LseView::max), for a forward and
  /// backward that are the engine's own (flash); the variants that merge log-sum-exps of
  /// their parts keep the plain form.
  explicit LseSaved(const Problem& p, bool split = false)
      : lse(size_t(p.batch * p.heads * p.n)),
        max(split && p.attn_mask ? size_t(p.batch * p.heads * p.n) : 0) {}
  std::vector<float> lse;
  std::vector<float> max;  ///< the rows' max (raw score units), or empty
  LseView view(const Problem& p) const {
    return LseView{const_cast<float*>(lse.data()), p.heads * p.n, p.n, 1,
                   max.empty() ? nullptr : const_cast<float*>(max.data())};
  }
  /// The LseSaved `saved` is for p; UsageError naming `variant` if it is another state.
  static const LseSaved& of(const SavedState& saved, const Problem& p, const std::string& variant) {
    const auto* st = dynamic_cast<const LseSaved*>(&saved);
    if (!st || st->lse.size() != size_t(p.batch * p.heads * p.n))
      throw UsageError(variant + ": the saved state is not from its forward_train on this problem");
    return *st;
  }
  static double bytes(const Problem& p, bool split = false) {
    return double(p.batch * p.heads * p.n) * sizeof(float) * (split && p.attn_mask ? 2 : 1);
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

/// The engine's backward pass, dense case (the forward: dense_attention with the same tiles):
/// dq [B, H, n, d], dk and dv [B, H, m, d] (overwritten) of L = sum(dout ∘ out) for exact
/// attention under the causal mask, key padding and attention mask, from the forward's out and
/// its rows' log-sum-exps lse (what dense_attention wrote; each row's next to the previous
/// one, stride_row 1, else std::logic_error). Scores scaled_dot only (the caller
/// maps dot and bilinear). Recomputes every (query tile, key block) pair the forward visits:
///   S = Q K^T / sqrt(d) + bias, P = exp(S - L), dV += P^T dO, dP = dO V^T,
///   dS = P ∘ (dP - D) with D_i = sum_c dO_ic O_ic, dQ += dS K / sqrt(d), dK += dS^T Q / sqrt(d);
/// n x m is never held. OpenMP over (batch, head, key block); rows with no key get dq = 0 and
/// give nothing to dk and dv.
void dense_attention_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                              ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                              const LseView& lse, TensorView dq, TensorView dk, TensorView dv,
                              int64_t block_q, int64_t block_k);

/// The engine's backward pass, block-sparse case: dense_attention_backward restricted to the
/// pattern `pat` the forward (block_sparse_attention, with lse) ran.
void block_sparse_attention_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                                     ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                                     const LseView& lse, const SparsePattern& pat, TensorView dq,
                                     TensorView dk, TensorView dv);

/// Bytes dense_attention_backward allocates beyond inputs, out, lse and gradients: the rows'
/// D, per thread the tiles, and a dQ accumulator [B, H, n, d] per thread but one.
double dense_attention_backward_memory(const Problem& p, int64_t block_q, int64_t block_k);
/// The same for block_sparse_attention_backward with a pattern of this block size listing
/// `listed_blocks` (query block, key block) pairs over all heads, plus its inverse lists.
double block_sparse_backward_memory(const Problem& p, int64_t block, double listed_blocks);
/// The (query block, key block) pairs `pat` lists over all heads of p.
double listed_blocks(const Problem& p, const SparsePattern& pat);

/// out (holding the attention of its rows over one set of keys, with log-sum-exps lse_out)
/// becomes the attention over that set and a disjoint one whose result is other (with
/// lse_other): each row is the two rows weighted by exp(lse) over their sum, 0 where neither
/// attended a key (lse_out then -inf), NaN where either log-sum-exp is NaN. OpenMP over (batch,
/// head).
void merge_attention(const Problem& p, TensorView out, const LseView& lse_out,
                     ConstTensorView other, const LseView& lse_other);

/// Bytes dense_attention allocates beyond inputs and output: per thread, the kernels' tiles.
double dense_attention_memory(const Problem& p, int64_t block_q, int64_t block_k);
/// What a row's notes say of the engine's bf16 kernel for p with key blocks of block_k keys
/// (empty for float32 problems): "bf16 kernel: amx (...)" or "bf16 kernel: f32 (...; amx not
/// used: why)" (see Bf16Kernel, common/kernels/bf16.h). Throws as the engine would for a bad
/// ATTNBENCH_BF16_KERNEL or an amx request that cannot run.
std::string bf16_engine_note(const Problem& p, int64_t block_k);

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
/// The backward (common/core/backward.h): forward_train runs the engine keeping the pattern and the
/// rows' log-sum-exps, backward the engine's block-sparse backward with that pattern (its
/// discrete choices, for data-dependent patterns, constants). A subclass whose function is not
/// softmax attention restricted to make_pattern must override backward() to return nullptr.
class PatternVariant : public Variant, public Backward {
 public:
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
  double backward_flops(const Problem& p) const override;
  double saved_estimate(const Problem& p) const override;
  double backward_memory_estimate(const Problem& p) const override;
  /// For a bf16 forward, the engine's bf16 kernel (bf16_engine_note); empty otherwise.
  std::string notes() const override { return bf16_note_; }

 protected:
  /// The last forward's bf16 kernel, as notes() says it (empty for float32).
  std::string bf16_note_;
  /// Sizes of the pattern on p for the estimates: the scores the engine computes over all
  /// heads, the (query block, key block) pairs listed, the pattern's bytes, its block size.
  struct Counts {
    double scores = 0, listed = 0, bytes = 0;
    int64_t block = 1;
  };
  /// The default builds make_pattern(p, {}, {}) and counts; a data-dependent pattern (which
  /// needs q and k) overrides it with bounds.
  virtual Counts pattern_counts(const Problem& p) const;
};

}  // namespace attnbench
