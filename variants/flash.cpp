// flash: exact softmax attention, tiled with an online softmax; the n x m score matrix is
// never stored.
//
//   out_i = sum_j softmax_j(q_i . k_j / sqrt(d) + mask_ij) v_j
//
// Each task is one query tile (block_q rows of one batch item and head). It walks the key
// blocks (block_k keys) up to the last key visible to its last row, keeping per row a running
// max mx of the raw scores and a running sum l:
//   S = Q_blk K_blk^T;  mx' = max(mx, rowmax S);  P = exp((S - mx') / sqrt(d))
//   l = l exp((mx - mx') / sqrt(d)) + rowsum P;  acc = acc exp((mx - mx') / sqrt(d)) + P V_blk
// and finally out = acc / l (rows with no visible key give 0). The max is subtracted before
// scaling, so no exponential overflows at any logit size; a tile whose acc overflowed (v near
// FLT_MAX) is run again with scaled weights (see common/kernels/attention_kernels.h).
//
// Time O(B H n m d); memory O(threads block_q (block_k + d)).
// Dao et al. 2022, "FlashAttention"; Milakov & Gimelshein 2018 for the online softmax.
//
// flash is the dense case of the tiled attention engine (dense_attention in
// common/engines/block_sparse.h): the engine's task loop over every key block of every query tile,
// with no pattern, block list or element mask, scheduled dynamically with the heaviest causal
// tiles first. Key blocks wholly past the causal diagonal are never visited. The tile passes
// are those of common/kernels/attention_kernels.h: AVX-512 register-blocked kernels on transposed
// score tiles when the compiler targets it, Eigen tile products and a scalar exp otherwise.
// The additive score runs through the engine's score-tile hook (common/kernels/additive_score.h): h
// tanh evaluations per score instead of a d-term dot product, still tiled.
// The AVX-512 passes are meant to run at the rate of the machine's sgemm; the sweep's
// gemm_fraction column says how close they come (the Eigen passes are far slower).
//
// Backward (training): forward_train keeps each row's log-sum-exp L_i (B H n floats), and the
// backward is the engine's dense backward (dense_attention_backward), which recomputes
// P = exp(S - L) tile by tile: dV = P^T dO, dS = P ∘ (dO V^T - D), dQ = dS K / sqrt(d),
// dK = dS^T Q / sqrt(d), n x m never stored (Dao et al. 2022, algorithm 4).
//
// Decode (generation): a KV cache of every position (common/decode/kv_decode.h), each step one
// query against the cached rows, split over the threads by key chunks (flash-decoding).
#include <algorithm>
#include <memory>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/decode/kv_decode.h"
#include "common/engines/block_sparse.h"
#include "common/kernels/additive_score.h"

namespace attnbench {
namespace {

// Decode: the KV cache of every position (KvCacheDecoder); block_q and block_k do not apply (one
// query row; the keys are split by chunk).
class Flash final : public Variant, public Backward, public KvCacheDecoder {
 public:
  Flash(int64_t bq, int64_t bk) : bq_(bq), bk_(bk) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    note_ = bf16_engine_note(p, bk_);
    dense_attention(p, q, k, v, out, bq_, bk_);
  }

  std::string notes() const override { return note_; }

  double flops(const Problem& p) const override {
    // the logits and PV over the visible pairs (whole key blocks past the diagonal are skipped)
    return (logit_flops(p) + 2.0 * double(p.dim)) * double(p.batch * p.heads) * p.visible_pairs();
  }

  double memory_estimate(const Problem& p) const override {
    return dense_attention_memory(p, bq_, bk_);
  }

  // The backward: the forward with the rows' log-sum-exps, and the engine's dense backward,
  // which recomputes P tile by tile from them.

  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    // each row's log-sum-exp [B, H, n] (and max, with an attention mask)
    auto saved = std::make_unique<LseSaved>(p, /*split=*/true);
    const LseView lse = saved->view(p);
    dense_attention(p, q, k, v, out, bq_, bk_, &lse);
    return saved;
  }

  using Variant::backward;  // the accessor stays visible beside the pass
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    dense_attention_backward(p, q, k, v, out, dout, LseSaved::of(saved, p, "flash").view(p), dq, dk,
                             dv, bwd_q(), bwd_k());
  }

  double backward_flops(const Problem& p) const override {
    // per score S and dP (the forward's two products), then dV, dK and dQ
    return 2.5 * flops(p);
  }
  double saved_estimate(const Problem& p) const override { return LseSaved::bytes(p, true); }
  double backward_memory_estimate(const Problem& p) const override {
    return dense_attention_backward_memory(p, bwd_q(), bwd_k());
  }

 private:
  // The backward's tiles: the key block is at most kBwdKeys keys, so that a task's dK and dV
  // sums and the score tiles stay in L2 (the forward's default block_k = 256 is not).
  static constexpr int64_t kBwdKeys = 128;
  int64_t bwd_q() const { return bq_; }
  int64_t bwd_k() const { return std::min(bk_, kBwdKeys); }

  int64_t bq_, bk_;
  std::string note_;  // the last forward's bf16 kernel (empty for float32)
};

ATTNBENCH_REGISTER_VARIANT(
    flash,
    VariantInfo{
        .name = "flash",
        .summary = "exact softmax attention, tiled with an online softmax, n x m never stored",
        .complexity = "time O(n m d), memory O(threads block_q (block_k + d))",
        .family = "exact",
        .display = "FlashAttention",
        .paper = "Dao et al. 2022 (arXiv:2205.14135)",
        .look = {.color = "#7f7f7f", .marker = "s"},
        .params = {ParamSpec::Int("block_q", 64, 1, 4096,
                                  "query rows per tile (multiples of 64 use the full kernels)"),
                   ParamSpec::Int("block_k", 256, 1, 65536, "keys per tile")},
        .caps = {.causal = true,
                 .cross = true,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true,
                 .bf16 = true},
        .make = [](const ParamValues& pv) {
          return std::make_unique<Flash>(pv.get_int("block_q"), pv.get_int("block_k"));
        }});

}  // namespace
}  // namespace attnbench
