// local: sliding-window ("truncated") attention. Query i attends the keys within `window`
// positions on EACH side of its aligned position a(i) = i + (m - n) (bottom-right aligned,
// like the causal mask, so m != n works):
//
//   P(i) = { j : |a(i) - j| <= window },   out_i = sum_{j in P(i)} softmax_j(q_i . k_j / sqrt(d))
//   v_j
//
// `window` counts ONE side (Longformer's attention_window counts both: its 512 is window=256
// here). Causal masking is applied by the engine, leaving a(i) - window <= j <= a(i).
// Time O(B H n (2 window + 1) d) (plus up to one block of padding on each side of the band);
// memory O(threads block (block + d)), the pattern itself holds nothing.
// Decode (generation): a ring of the last window + 1 keys and values per (batch, head)
// (common/kv_decode.h), the causal band max(0, t - window) .. t of each step's query t.
// Paper: Beltagy, Peters, Cohan, "Longformer: The Long-Document Transformer" (2020), sliding
// window; also Child et al. 2019 and Parmar et al. 2018 (local attention).
#include <algorithm>
#include <cstdlib>
#include <memory>

#include "common/block_sparse.h"
#include "common/kv_decode.h"

namespace attnbench {
namespace {

class LocalPattern final : public AlignedBlockPattern {
 public:
  LocalPattern(int64_t n, int64_t m, int64_t window, int64_t block)
      : AlignedBlockPattern(n, m, block), w_(window) {}

  void aligned_key_blocks(int64_t a0, int64_t a1, std::vector<KeyBlock>& out) const override {
    // the band of the block: keys [a0 - w, a1 + w], clipped to the keys that exist
    const int64_t lo = std::max<int64_t>(0, a0 - w_), hi = std::min(m_ - 1, a1 + w_);
    if (lo > hi) return;
    for (int64_t kb = lo / bs_; kb <= hi / bs_; ++kb) {
      const int64_t j0 = kb * bs_, j1 = std::min(m_, j0 + bs_) - 1;
      // max |a - j| over the tile is attained at a corner
      const bool full = std::max(a1 - j0, j1 - a0) <= w_;
      out.push_back({kb, !full});
    }
  }

  void block_mask(int64_t, int64_t, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = i0 + r + off_;
      for (int64_t c = 0; c < cols; ++c) mask[r * cols + c] = std::llabs(a - (j0 + c)) <= w_;
    }
  }

 private:
  int64_t w_;
};

class Local final : public PatternVariant, public Decoder {
 public:
  Local(int64_t window, int64_t block) : window_(window), block_(block) {}

  // Decode: under the causal mask with n = m, query t sees keys |t - j| <= window, j <= t,
  // that is max(0, t - window) .. t: a ring of window + 1 rows holds them all. The prefill
  // copies rows and computes nothing.
  Decoder* decoder() override { return this; }
  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override {
    return kv_decode_prefill(p, k, v, t0, {.window = window_});
  }
  double prefill_flops(const Problem&, int64_t) const override { return 0.0; }

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView,
                                              ConstTensorView) const override {
    return std::make_unique<LocalPattern>(p.n, p.keys(), window_, block_);
  }

 private:
  int64_t window_, block_;
};

ATTNBENCH_REGISTER_VARIANT(
    local,
    VariantInfo{
        .name = "local",
        .summary = "sliding window: query i sees keys with |a(i) - j| <= window (one side)",
        .complexity = "time O(n (2 window + 1) d), memory O(threads block (block + d))",
        .params = {ParamSpec::Int(
                       "window", 256, 0, int64_t(1) << 30,
                       "keys on EACH side of the query (one side; both sides = 2 window + 1)"),
                   block_param()},
        .caps = {.causal = true,
                 .cross = true,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<Local>(v.get_int("window"), v.get_int("block"));
        }});

}  // namespace
}  // namespace attnbench
