// strided: dilated attention. Query i attends every stride-th key counted from its aligned
// position a(i) = i + (m - n) (bottom-right aligned, like the causal mask), before and after
// it, optionally only within `span` positions:
//
//   P(i) = { j : (a(i) - j) mod stride == 0  and  (span == 0 or |a(i) - j| <= span) }
//
// with the mathematical mod (negative differences work: j after a(i) too). Causal masking
// keeps j <= a(i). stride = 1 with span = 0 is full attention.
// It runs as a reshape (common/engines/strided_attention.h): the queries and keys of each residue
// class mod stride, read through strided views, form a dense problem (causal: lower
// triangular; with a span: a band of span / stride keys each side) of about n / stride x
// m / stride on the tiled engine, so the work is the pattern's own, about n m / stride
// scores (2 span / stride + 1 per row with a span), at the dense kernel's rate. Scoring the
// pattern tile by tile on the block-sparse engine instead would cost O(n m d) whenever
// stride < 2 block, as every tile then holds an allowed pair. The exported pattern
// (StridedPattern, common/patterns/strided_pattern.h) is the same set of pairs. The backward runs
// the same way: the engine's backward per class, from the rows' log-sum-exps the training forward
// keeps.
// Memory O(threads block (block + d)), plus with an attention mask one class's share of it
// per thread.
// Decode (generation): the pattern cache of common/decode/pattern_decode.h over the same pairs
// (with a span, blocks behind it are freed). Paper: Child, Gray, Radford, Sutskever, "Generating
// Long Sequences with Sparse Transformers" (2019), the stride head; dilated windows in Beltagy et
// al. 2020.
#include <memory>

#include "common/decode/pattern_decode.h"
#include "common/engines/block_sparse.h"
#include "common/engines/strided_attention.h"
#include "common/kernels/additive_score.h"
#include "common/patterns/strided_pattern.h"

namespace attnbench {
namespace {

class Strided final : public FixedPatternVariant {
 public:
  Strided(int64_t stride, int64_t span, int64_t block)
      : stride_(stride), span_(span), block_(block) {}

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView,
                                              ConstTensorView) const override {
    return std::make_unique<StridedPattern>(p.n, p.keys(), stride_, limit(), 0, block_);
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    bf16_note_ = bf16_engine_note(p, block_);  // the classes run on the engine
    strided_attention(p, q, k, v, out, stride_, limit(), block_);
  }

  double flops(const Problem& p) const override {
    return (logit_flops(p) + 2.0 * double(p.dim)) *
           strided_attention_scores(p, stride_, limit(), block_);
  }

  double memory_estimate(const Problem& p) const override {
    return strided_attention_memory(p, stride_, block_);
  }

  // The backward as the forward, class by class: the training forward keeps the rows'
  // log-sum-exps, and each class runs the engine's backward on its strided views.
  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    auto saved = std::make_unique<LseSaved>(p, /*split=*/true);  // max apart under a mask
    const LseView lse = saved->view(p);
    strided_attention(p, q, k, v, out, stride_, limit(), block_, &lse);
    return saved;
  }
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    strided_attention_backward(p, q, k, v, out, dout, LseSaved::of(saved, p, "strided").view(p), dq,
                               dk, dv, stride_, limit(), block_);
  }
  double backward_flops(const Problem& p) const override { return 2.5 * flops(p); }
  double saved_estimate(const Problem& p) const override { return LseSaved::bytes(p, true); }
  double backward_memory_estimate(const Problem& p) const override {
    return strided_attention_backward_memory(p, stride_, limit(), block_);
  }

 private:
  int64_t limit() const { return span_ > 0 ? span_ : -1; }  // span 0: no limit

  int64_t stride_, span_, block_;
};

ATTNBENCH_REGISTER_VARIANT(
    strided,
    VariantInfo{
        .name = "strided",
        .summary = "dilated: query i sees keys with (a(i) - j) mod stride == 0, optionally |a(i) - "
                   "j| <= span",
        .complexity = "time O(n (m / stride) d) (O(n (2 span / stride + 1) d) with a span), as "
                      "a dense problem per residue class; memory O(threads block (block + d))",
        .family = "pattern",
        .display = "Strided",
        .paper = "Child et al. 2019 (arXiv:1904.10509)",
        .look = {.color = "#17becf", .marker = "v"},
        .params = {ParamSpec::Int("stride", 128, 1, int64_t(1) << 30,
                                  "distance between attended keys (Sparse Transformer's l)"),
                   ParamSpec::Int("span", 0, 0, int64_t(1) << 30,
                                  "only keys with |a(i) - j| <= span (one side); 0 = unlimited"),
                   block_param()},
        .caps = {.causal = true,
                 .cross = true,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true,
                 .bf16 = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<Strided>(v.get_int("stride"), v.get_int("span"),
                                           v.get_int("block"));
        }});

}  // namespace
}  // namespace attnbench
