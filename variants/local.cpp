// local: sliding-window ("truncated") attention. Query i attends the keys within `window`
// positions on EACH side of its aligned position a(i) = i + (m - n) (bottom-right aligned,
// like the causal mask, so m != n works):
//
//   P(i) = { j : |a(i) - j| <= window },   out_i = sum_{j in P(i)} softmax_j(q_i . k_j / sqrt(d))
//   v_j
//
// `window` counts ONE side (Longformer's attention_window counts both: its 512 is window=256
// here). Causal masking is applied by the engine, leaving a(i) - window <= j <= a(i).
// Attention sinks (`sinks` = S, default 0): every query also sees the first S keys,
//   P(i) = { j : |a(i) - j| <= window } u { j : j < S }
// (under the causal mask only those j <= a(i)). StreamingLLM's published setting is S = 4:
// the first tokens soak up attention mass a window alone would spread over its keys.
// Time O(B H n (2 window + 1 + S) d) (plus up to one block of padding on each side of the
// band and after the sinks);
// memory O(threads block (block + d)), the pattern itself holds nothing.
// Decode (generation): a ring of the last window + 1 keys and values per (batch, head)
// (common/decode/kv_decode.h), the causal band max(0, t - window) .. t of each step's query t, plus
// the sink rows 0 .. S - 1 kept apart (those left of the band).
// Paper: Beltagy, Peters, Cohan, "Longformer: The Long-Document Transformer" (2020), sliding
// window; also Child et al. 2019 and Parmar et al. 2018 (local attention). Sinks: Xiao, Tian,
// Chen, Han, Lewis, "Efficient Streaming Language Models with Attention Sinks" (2023).
#include <algorithm>
#include <cstdlib>
#include <memory>

#include "common/decode/kv_decode.h"
#include "common/engines/block_sparse.h"

namespace attnbench {
namespace {

class LocalPattern final : public AlignedBlockPattern {
 public:
  LocalPattern(int64_t n, int64_t m, int64_t window, int64_t sinks, int64_t block)
      : AlignedBlockPattern(n, m, block), w_(window), s_(std::min(sinks, m)) {}

  void aligned_key_blocks(int64_t a0, int64_t a1, std::vector<KeyBlock>& out) const override {
    // the band of the block: keys [a0 - w, a1 + w], clipped to the keys that exist; and the
    // sink keys [0, s), in increasing block order
    const int64_t lo = std::max<int64_t>(0, a0 - w_), hi = std::min(m_ - 1, a1 + w_);
    const int64_t sink_end = s_ > 0 ? (s_ - 1) / bs_ + 1 : 0;  // key blocks holding sinks
    const int64_t band0 = lo <= hi ? lo / bs_ : m_, band1 = lo <= hi ? hi / bs_ : -1;
    // sink blocks outside the band: full only if every key of the block is a sink
    auto sink_block = [&](int64_t kb) { out.push_back({kb, std::min(m_, (kb + 1) * bs_) > s_}); };
    const int64_t left = std::min(sink_end, band0);
    for (int64_t kb = 0; kb < left; ++kb) sink_block(kb);
    for (int64_t kb = band0; kb <= band1; ++kb) {
      const int64_t j0 = kb * bs_, j1 = std::min(m_, j0 + bs_) - 1;
      // the keys of the tile that are no sinks, [max(j0, s), j1], must all be in the band of
      // every row: max |a - j| over them is attained at a corner
      const int64_t b0 = std::max(j0, s_);
      const bool full = b0 > j1 || std::max(a1 - b0, j1 - a0) <= w_;
      out.push_back({kb, !full});
    }
    for (int64_t kb = std::max(band1 + 1, left); kb < sink_end; ++kb) sink_block(kb);
  }

  void block_mask(int64_t, int64_t, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = i0 + r + off_;
      for (int64_t c = 0; c < cols; ++c)
        mask[r * cols + c] = j0 + c < s_ || std::llabs(a - (j0 + c)) <= w_;
    }
  }

 private:
  int64_t w_, s_;
};

// `sinks` came after `window` and `block`: left out of the spec at 0, so local's specs and
// results from before keep their names.
ParamSpec sinks_param() {
  ParamSpec ps = ParamSpec::Int("sinks", 0, 0, int64_t(1) << 30,
                                "attention sinks: keys 0 .. sinks - 1 every query also sees "
                                "(StreamingLLM publishes 4; 0 = plain sliding window)");
  ps.omit_at_default = true;
  return ps;
}

class Local final : public PatternVariant, public KvCacheDecoder {
 public:
  Local(int64_t window, int64_t sinks, int64_t block)
      : window_(window), sinks_(sinks), block_(block) {}

  // Decode: under the causal mask with n = m, query t sees keys |t - j| <= window, j <= t,
  // that is max(0, t - window) .. t: a ring of window + 1 rows holds them all, and the sink
  // rows 0 .. sinks - 1 are kept apart. The prefill copies rows and computes nothing.
  KvDecodeOptions cache_options() const override { return {.window = window_, .sinks = sinks_}; }

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView,
                                              ConstTensorView) const override {
    return std::make_unique<LocalPattern>(p.n, p.keys(), window_, sinks_, block_);
  }

 private:
  int64_t window_, sinks_, block_;
};

ATTNBENCH_REGISTER_VARIANT(
    local,
    VariantInfo{
        .name = "local",
        .summary = "sliding window: query i sees keys with |a(i) - j| <= window (one side), "
                   "plus the first `sinks` keys (StreamingLLM attention sinks; 0 = none)",
        .complexity = "time O(n (2 window + 1) d), memory O(threads block (block + d))",
        .family = "pattern",
        .display = "Sliding window",
        .paper = "Beltagy et al. 2020 (arXiv:2004.05150); "
                 "sinks: Xiao et al. 2023 (arXiv:2309.17453)",
        .look = {.color = "#1f77b4", .marker = "^"},
        .sweep_specs = {"local:sinks=4"},
        .params = {ParamSpec::Int(
                       "window", 256, 0, int64_t(1) << 30,
                       "keys on EACH side of the query (one side; both sides = 2 window + 1)"),
                   sinks_param(), block_param()},
        .caps = {.causal = true,
                 .cross = true,
                 .additive = true,
                 .key_padding = true,
                 .attn_mask = true,
                 .bf16 = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<Local>(v.get_int("window"), v.get_int("sinks"),
                                         v.get_int("block"));
        }});

}  // namespace
}  // namespace attnbench
