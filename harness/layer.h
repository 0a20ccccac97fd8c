// The multi-head attention layer of torch.nn.MultiheadAttention (batch_first=True), wrapped
// around any variant: a composition, not a variant.
//
//   [q | k | v] = [x_q W_qᵀ + b_q | x_k W_kᵀ + b_k | x_v W_vᵀ + b_v]   (W_in = [W_q; W_k; W_v])
//   split q, k, v into H heads of d = E / H        -> [B, H, L, d] and [B, H, S, d]
//   o = variant(q, k, v)  (softmax(q kᵀ / √d) v for the exact variants)
//   out = concat_heads(o) W_outᵀ + b_out                              -> [B, L, E]
//
// Layouts (row-major, PyTorch's names): query [B, L, E], key and value [B, S, E],
// in_proj_weight [3E, E] (rows 0..E-1 project q, E..2E-1 k, 2E..3E-1 v), in_proj_bias [3E],
// out_proj.weight [E, E], out_proj.bias [E]. The tensors are held as Tensor [B, 1, len, E]
// (and [1, 1, rows, cols] for the parameters). need_weights gives the attention probabilities
// averaged over the heads, [B, L, S]: exact variants only.
//
// Cost: 2 B (2 L + 2 S) E² FLOPs in the projections plus the variant's on [B, H, L/S, E/H];
// memory: the projected q, k, v and the heads' output, 2 B (L + S) E floats, plus the
// variant's working memory.
//
// Seeded parameters follow PyTorch's initialisation: in_proj_weight Xavier-uniform
// (U(±√(6 / (E + 3E)))), out_proj.weight nn.Linear's kaiming_uniform(a=√5), i.e.
// U(±1/√E), both biases zero. Seeded inputs are standard gaussian. Without a key length the
// layer is self-attention (key = value = query, as PyTorch's layer called with one tensor);
// with one, key and value are drawn on their own (cross-attention, even when S = L).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/core/problem.h"
#include "common/core/registry.h"
#include "common/core/tensor.h"
#include "common/core/workload.h"
#include "common/io/npy.h"
#include "harness/metrics.h"
#include "harness/runner.h"

namespace attnbench {

/// One multi-head layer run: sizes, causal mask and seed.
struct LayerProblem {
  int64_t batch = 1;
  int64_t embed = 512;  ///< E
  int64_t heads = 8;    ///< H; E % H == 0
  int64_t n = 1024;     ///< query length L
  int64_t m = 0;        ///< key length S; 0 = self-attention (S = L, key = value = query)
  /// Bottom-right aligned causal mask of the attention core (common/core/problem.h).
  bool causal = false;
  uint64_t seed = 0;
  /// Key padding of the core (Problem::key_lengths): keys j >= key_lengths[b] of batch item b
  /// are invisible; empty = none. PyTorch's key_padding_mask [B, S] with true = padded, when
  /// each row is padding at the end only.
  std::vector<int64_t> key_lengths;
  /// Attention mask of the core (Problem::attn_mask): bias [1 or B, 1 or H, L, S] added to
  /// every head's logits, -inf = masked out. PyTorch's attn_mask [L, S] or [B H, L, S] (bool:
  /// true = masked out, as nn.MultiheadAttention), with any key_padding_mask that is not an
  /// end padding folded in.
  std::shared_ptr<const AttnMask> attn_mask;

  int64_t keys() const { return m > 0 ? m : n; }
  int64_t head_dim() const { return heads > 0 ? embed / heads : 0; }
  /// The attention problem of the core: [B, H, L, d] queries, [B, H, S, d] keys, d = E / H.
  Problem attention() const;
  /// Throws UsageError naming a bad size (E not divisible by H among them).
  void validate() const;
  /// Canonical "E=512,B=1,H=8,n=1024,m=1024,d=64,causal=0,seed=0".
  std::string str() const;
};

/// The layer's parameters, PyTorch's names in the comments.
struct LayerParams {
  Tensor in_proj_weight;   ///< in_proj_weight [1, 1, 3E, E]
  Tensor in_proj_bias;     ///< in_proj_bias [1, 1, 1, 3E]
  Tensor out_proj_weight;  ///< out_proj.weight [1, 1, E, E]
  Tensor out_proj_bias;    ///< out_proj.bias [1, 1, 1, E]
};

/// The layer's inputs: query [B, 1, L, E], key and value [B, 1, S, E].
struct LayerInputs {
  Tensor query, key, value;
};

/// A whole layer's data, generated or read from a file.
struct LayerData {
  LayerInputs in;
  LayerParams params;
};

/// Parameters drawn from `seed` with PyTorch's initialisation scheme (see the top).
LayerParams init_layer_params(int64_t embed, uint64_t seed);
/// Gaussian inputs and seeded parameters of `lp` (key = value = query when lp.m == 0).
LayerData generate_layer_data(const LayerProblem& lp);

/// Reads a layer from an .npz with PyTorch's names: query [B, L, E], key and value [B, S, E],
/// in_proj_weight [3E, E], in_proj_bias [3E], out_proj.weight [E, E], out_proj.bias [E],
/// float32 and finite; optionally key_padding_mask [B, S] and attn_mask [L, S] or [B H, L, S]
/// (bool or uint8 with true = masked out, or float32 added to the logits; PyTorch's layer
/// conventions). Sets batch, embed, n, m, key_lengths and attn_mask of *lp (heads is the
/// caller's and must be set: a [B H, L, S] mask is checked against it). A key_padding_mask
/// whose rows are all "valid keys, then padding" becomes key_lengths; any other one is folded
/// into the attention mask. Throws InputError naming a missing, unknown or mis-shaped array,
/// the shape found and the one accepted, and UnsupportedError for what the layer cannot
/// honour (separate q/k/v projection weights, bias_k/bias_v).
LayerData load_layer_npz(const std::string& path, LayerProblem* lp);
/// load_layer_npz on arrays already read; `what` names their source.
LayerData layer_from_arrays(const std::map<std::string, NpyArray>& arrays, const std::string& what,
                            LayerProblem* lp);
/// Writes `output` [B, L, E] and, if weights is given, `attn_weights` [B, L, S] to an .npz.
void write_layer_npz(const std::string& path, const Tensor& output, const Tensor* weights);

/// Throws UnsupportedError if `variant` cannot give attention weights (it is not exact).
void require_weights(const Variant& variant);

/// The layer around one variant, with its working buffers.
class Layer {
 public:
  /// Throws UsageError for a bad lp and UnsupportedError if the variant cannot run its core.
  Layer(Variant& variant, const LayerProblem& lp);

  /// out [B, 1, L, E] = the layer on `in` with `params`. The projected q, k and the heads'
  /// output stay in the layer's buffers until the next call.
  void forward(const LayerInputs& in, const LayerParams& params, TensorView out);
  /// The attention probabilities of the last forward pass averaged over the heads,
  /// [B, 1, L, S], from its projected q and k in float64 (restricted to the variant's
  /// pattern, if it has one). Throws UnsupportedError for a variant that is not exact.
  Tensor attention_weights() const;

  /// Seconds in the attention core and in whole forward passes since reset_clock(), measured
  /// around each (wall time).
  double core_seconds() const { return core_seconds_; }
  double layer_seconds() const { return layer_seconds_; }
  void reset_clock() { core_seconds_ = layer_seconds_ = 0; }

  const LayerProblem& problem() const { return lp_; }
  /// Projected heads of the last forward pass: q [B, H, L, d], k and v [B, H, S, d].
  const Tensor& q_heads() const { return q_; }
  const Tensor& k_heads() const { return k_; }
  const Tensor& v_heads() const { return v_; }

 private:
  Variant& variant_;
  LayerProblem lp_;
  Problem core_;
  Tensor q_, k_, v_, o_;  // heads
  Tensor rows_;           // [1, 1, B max(L, S), E]: a projection before its split into heads
  double core_seconds_ = 0, layer_seconds_ = 0;
};

/// The layer in float64 on the given query rows of batch item b: rows.size() x E, row-major.
/// Projections and out-projection in float64; the core is the float64 reference
/// (common/reference/reference.h) on the projected q, k, v rounded once to float (its inputs: a
/// relative change of at most 2^-24 each, far below any tolerance here). Exact attention over every
/// key, as measure_error's reference.
std::vector<double> reference_layer_rows(const LayerProblem& lp, const LayerData& data, int64_t b,
                                         const std::vector<int64_t>& rows);
/// Error of `out` [B, 1, L, E] against reference_layer_rows on every row, or a seeded sample
/// of them above exact_limit (query, key) pairs in the core (as measure_error).
ErrorStats measure_layer_error(const LayerProblem& lp, const LayerData& data, ConstTensorView out,
                               double exact_limit = kExactPairsLimit);

/// FLOPs of one layer pass: projections plus the variant's.
double layer_flops(const Variant& variant, const LayerProblem& lp);
/// Working bytes of one pass beyond inputs, parameters and output.
double layer_memory_estimate(const Variant& variant, const LayerProblem& lp);

/// Runs the layer around `variant` like run_one runs a variant: one checked pass and its
/// error against the float64 layer, then Google Benchmark's timed passes, the attention
/// core timed within them (Row::attention_share). Data from `given`, else generated. The
/// checked pass's output [B, 1, L, E] goes to *output and, with need_weights, its averaged
/// attention probabilities [B, 1, L, S] to *weights. Never throws: the row's status says
/// what happened.
Row run_layer(Variant& variant, const LayerProblem& lp, const Workload& w, const LayerData* given,
              const MachineFigures& mf, const RunOptions& opt, bool need_weights,
              Tensor* output = nullptr, Tensor* weights = nullptr,
              nlohmann::json* bench_json = nullptr);

}  // namespace attnbench
