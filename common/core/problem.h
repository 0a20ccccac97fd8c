// One attention problem: what a variant computes (shapes, masking, seed).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/core/tensor.h"

namespace attnbench {

/// The scoring function a(q, k) whose softmax weights the values (docs/cli.md, "Scoring
/// functions"). dot and bilinear are a linear map of q followed by scaled_dot, so every
/// variant runs them through that map (Variant::compute); additive needs its own kernels and
/// a variant says it has them (Capabilities::additive).
enum class Score { scaled_dot, dot, bilinear, additive };

/// "scaled_dot", "dot", "bilinear" or "additive".
std::string_view score_name(Score s);
/// The score named `name`; throws UsageError naming it and the accepted names.
Score parse_score(std::string_view name);

/// The precision a variant computes in. f32: float32 throughout. bf16: q, k and v rounded to
/// bfloat16 (round to nearest even) and the products taken in bfloat16 with float32
/// accumulation, the softmax statistics (max, sum) in float32: the mixed precision models
/// train and generate with. The tensors a variant is given stay float32 arrays; under bf16
/// they hold bfloat16 values. A variant says it has a bf16 path (Capabilities::bf16).
enum class DType { f32, bf16 };
/// "f32" or "bf16".
std::string_view dtype_name(DType t);
/// The precision named `name`; throws UsageError naming it and the accepted names.
DType parse_dtype(std::string_view name);

/// The weights of the bilinear and additive scores, one set per head, row-major:
///   bilinear  qᵀ W k:             w_bilinear [H, d, d]
///   additive  wᵀ tanh(W_q q + W_k k): w_q, w_k [H, hidden, d], w_score [H, hidden]
/// (the arrays of an inputs file carry the same names and shapes). Only the score's own
/// arrays are filled.
struct ScoreWeights {
  int64_t heads = 0, dim = 0, hidden = 0;
  std::vector<float> w_bilinear, w_q, w_k, w_score;
};

/// An attention mask over [B or 1, H or 1, n, m] (a size of 1 broadcasts), stored additive:
/// 0 keeps a logit, -inf masks its key out, any other value is added to the logit. A boolean
/// mask (true = masked out, torch.nn.MultiheadAttention's convention) is stored as 0 / -inf.
struct AttnMask {
  int64_t batch = 1, heads = 1, n = 0, m = 0;
  std::vector<float> bias;  ///< [batch, heads, n, m]
  bool is_bool = false;     ///< read from a bool/uint8 mask: every entry 0 or -inf
  std::string name;         ///< where it came from (the file name), for results and names

  float at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return bias[size_t((((batch == 1 ? 0 : b) * heads + (heads == 1 ? 0 : h)) * n + i) * m + j)];
  }
};

/// A tensor given for one of a variant's inputs beyond q, k and v (VariantInfo::inputs: a gate,
/// a decay, a projection), float32, row-major, of the shape the variant declares for it.
struct ExtraInput {
  std::vector<int64_t> shape;
  std::vector<float> data;
};
/// The extra inputs of a problem, by name.
using ExtraInputs = std::map<std::string, ExtraInput, std::less<>>;

/// The key padding as results and names show it: the lengths joined by '+' ("700+1024"),
/// "" for none.
struct Problem;
std::string key_padding_text(const Problem& p);
/// ",key_padding=700+1024,attn_mask=NAME" with the parts that are set ("" for neither): what
/// Problem::str() and describe() append, so unmasked problems keep their names.
std::string mask_suffix(const Problem& p);

/// One attention problem. q is [B, H, n, d]; k and v are stored [B, G, m, d] with G =
/// kv_head_count() (grouped-query attention: G divides H, each key/value head serves the H / G
/// query heads h with h / (H / G) = its index; G = H is plain multi-head attention, G = 1
/// multi-query attention); out is [B, H, n, d]. Variants see k and v through grouped views
/// (View4::group, kv_view) of the logical shape kv_shape() = [B, H, m, d], so the head mapping
/// lives in one place.
struct Problem {
  /// Largest batch and head count: seeded inputs draw an independent random stream per
  /// (batch item, head), for up to 2^24 of each.
  static constexpr int64_t kMaxBatchOrHeads = int64_t(1) << 24;

  int64_t batch = 1;
  int64_t heads = 8;
  int64_t n = 1024;  ///< query length
  int64_t m = 0;     ///< key length; 0 means m = n
  int64_t dim = 64;  ///< head dimension d
  /// Key/value heads G (a divisor of heads); 0 means G = heads.
  int64_t kv_heads = 0;
  /// Bottom-right aligned causal mask: key j is visible to query i iff j <= i + (m - n).
  bool causal = false;
  /// The scoring function (default: today's q.k / sqrt(d)).
  Score score = Score::scaled_dot;
  /// Hidden size h of the additive score; 0 means h = d.
  int64_t score_hidden = 0;
  /// The bilinear or additive weights (shared, never changed once set); null for the other
  /// scores. Set by whoever makes the inputs (generated from the seed or read from a file).
  std::shared_ptr<const ScoreWeights> score_weights;
  /// Key padding: valid key lengths, one per batch element (keys j >= key_lengths[b] are
  /// invisible to batch element b); empty means none.
  std::vector<int64_t> key_lengths;
  /// An attention mask combined with causal and key padding; null for none.
  std::shared_ptr<const AttnMask> attn_mask;
  /// Tensors given for the variant's inputs beyond q, k and v (shared, never changed once
  /// set); an input the variant takes that is not here is stood in for (Variant::stand_ins).
  /// Null for none.
  std::shared_ptr<const ExtraInputs> extra_inputs;
  /// The precision of the computation (DType).
  DType dtype = DType::f32;
  // What attention computes grows here. Each addition comes with a flag in Capabilities (or,
  // like kv_heads, applies to every variant through one shared mechanism) and with its column
  // among the results' key columns.

  /// Seed of the variant's random choices (features, projections, hashes) and of generated
  /// inputs. How the inputs are drawn and how many threads run is the workload's
  /// (common/core/workload.h), which variants never see.
  uint64_t seed = 0;

  int64_t keys() const { return m > 0 ? m : n; }
  Shape4 q_shape() const { return {batch, heads, n, dim}; }
  /// Logical shape of k and v as variants see them: [B, H, m, d] (grouped views).
  Shape4 kv_shape() const { return {batch, heads, keys(), dim}; }
  /// Key/value heads G (kv_heads, or heads when 0).
  int64_t kv_head_count() const { return kv_heads > 0 ? kv_heads : heads; }
  /// Query heads per key/value head, H / G (1 without grouping).
  int64_t kv_group() const { return heads / kv_head_count(); }
  /// The key/value head query head h reads: h / (H / G).
  int64_t kv_head(int64_t h) const { return h / kv_group(); }
  /// Storage shape of k and v: [B, G, m, d].
  Shape4 kv_storage_shape() const { return {batch, kv_head_count(), keys(), dim}; }
  /// A zeroed k or v of this problem: storage [B, G, m, d], viewed grouped as [B, H, m, d].
  Tensor kv_tensor() const { return Tensor(kv_storage_shape(), kv_group()); }
  /// Number of keys visible to query i under the causal mask (keys 0 .. count-1 are the
  /// visible ones). Key padding and the attention mask are not in it: see visible(b, i).
  int64_t visible(int64_t i) const {
    if (!causal) return keys();
    int64_t last = i + (keys() - n);
    return last < 0 ? 0 : (last + 1 < keys() ? last + 1 : keys());
  }
  /// Number of keys visible to query i of batch element b under the causal mask and key
  /// padding (still a prefix 0 .. count-1; the attention mask may hide more of them).
  int64_t visible(int64_t b, int64_t i) const {
    const int64_t v = visible(i);
    if (key_lengths.empty()) return v;
    const int64_t len = key_lengths[size_t(b)];
    return len < v ? len : v;
  }
  /// Hidden size of the additive score (score_hidden, or d when 0).
  int64_t hidden() const { return score_hidden > 0 ? score_hidden : dim; }
  /// True when nothing but the causal mask restricts the keys.
  bool unmasked() const { return key_lengths.empty() && !attn_mask; }
  /// Number of query rows, over every batch element and head, that see no key at all
  /// (causal, key padding and the attention mask together): their output is 0.
  int64_t rows_without_keys() const;
  /// Number of (query, key) pairs visible, summed over one head.
  double visible_pairs() const;
  /// Softmax scale 1/sqrt(d).
  float softmax_scale() const;
  /// Checks sizes are positive and sane, and that key_lengths, the mask and the score
  /// weights fit the shape; throws UsageError naming the bad field and what is accepted.
  void validate() const;
  /// Canonical "B=1,H=8,n=1024,m=1024,d=64,causal=0,seed=0" (describe() in
  /// common/core/workload.h adds the workload).
  std::string str() const;
  /// ",score=NAME" (and ",h=H" for additive) after causal in str() and describe(); empty for
  /// scaled_dot, so the names of scaled_dot problems stay as they were.
  std::string score_str() const;
  /// ",dtype=bf16" at the end of str() and describe() for bf16; empty for f32, so float32
  /// problems keep their names.
  std::string dtype_str() const;
  /// ",G=2" (the key/value heads) after H in str() and describe() when they are fewer than the
  /// heads; empty otherwise, so ungrouped problems keep their names.
  std::string kv_str() const;
};

}  // namespace attnbench
