// full: exact softmax attention with the score matrix materialised, the way a PyTorch user
// writes it: S = Q K^T / sqrt(d) for every (batch, head) at once, masked, softmaxed in place,
// then O = S V.
//
//   out = softmax(Q K^T / sqrt(d) + mask) V
//
// The additive score (common/kernels/additive_score.h) fills the same n x m matrix with its logits.
//
// Backward (training): forward_train keeps P [B, H, n, m], as autograd does, and backward runs
// four GEMMs per head (dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q) around the
// elementwise dS = P ∘ (dP - D) / sqrt(d), with an n x m buffer for dS.
//
// Decode (generation): a KV cache of every position (common/decode/kv_decode.h), each step one
// query against the cached rows, split over the threads by key chunks (flash-decoding).
//
// Time O(B H n m d) through BLAS GEMM; memory O(B H n m) for the scores.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "common/core/error.h"
#include "common/core/parallel_for.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/decode/kv_decode.h"
#include "common/kernels/additive_score.h"
#include "common/kernels/softmax.h"
#include "common/patterns/mask_bias.h"

namespace attnbench {
namespace {

/// What forward_train keeps: the probabilities P [B, H, n, m] (0 for hidden keys).
class FullSaved final : public SavedState {
 public:
  std::unique_ptr<float[]> probs;
  size_t size = 0;
};

// Decode: the KV cache of every position (KvCacheDecoder).
class Full final : public Variant, public Backward, public KvCacheDecoder {
 public:
  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    // scores is [B, H, n, m], like the tensor q @ k.transpose(-2, -1) in PyTorch.
    // Left uninitialised (as torch.empty would be): every element is written by pass 1.
    std::unique_ptr<float[]> scores(new float[size_t(p.batch * p.heads * p.n * p.keys())]);
    attend(p, q, k, v, out, scores.get());
  }

  double flops(const Problem& p) const override {
    // the logits and one GEMM over the whole score matrix; the mask does not save work here
    return (logit_flops(p) + 2.0 * double(p.dim)) * double(p.batch * p.heads) * double(p.n) *
           double(p.keys());
  }

  double memory_estimate(const Problem& p) const override {
    return double(p.batch * p.heads) * double(p.n) * double(p.keys()) * sizeof(float) +
           (p.score == Score::additive ? AdditiveProjections::bytes(p) : 0.0);
  }

  // The backward, the way autograd runs it: forward_train keeps P, and backward computes
  //   dV = P^T dO,  dP = dO V^T,  dS = P ∘ (dP - D) / sqrt(d) with D_i = sum_c dO_ic O_ic,
  //   dQ = dS K,  dK = dS^T Q
  // with four GEMMs per head over an n x m buffer for dS. Hidden keys have P = 0, so dS = 0.

  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    auto saved = std::make_unique<FullSaved>();
    saved->size = size_t(p.batch * p.heads * p.n * p.keys());
    saved->probs.reset(new float[saved->size]);
    attend(p, q, k, v, out, saved->probs.get());
    return saved;
  }

  using Variant::backward;  // the accessor stays visible beside the pass
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    const auto* st = dynamic_cast<const FullSaved*>(&saved);
    const int64_t n = p.n, m = p.keys(), d = p.dim, heads = p.batch * p.heads;
    if (!st || st->size != size_t(heads * n * m))
      throw UsageError("full: the saved state is not from its forward_train on this problem");
    const float scale = p.softmax_scale();
    const bool per_head = heads >= team_threads();
    // one head's gradients; ds is an n x m buffer. `inner`: parallelise the row pass (BLAS
    // runs on the threads itself), else the caller runs heads in parallel.
    auto head = [&](int64_t bh, float* ds, bool inner) {
      const int64_t b = bh / p.heads, h = bh % p.heads;
      const float* prob = st->probs.get() + bh * n * m;
      // dV = P^T dO
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(m), int(d), int(n), 1.0f, prob,
                  int(m), dout.head(b, h), int(dout.stride_row), 0.0f, dv.head(b, h),
                  int(dv.stride_row));
      // dP = dO V^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(m), int(d), 1.0f,
                  dout.head(b, h), int(dout.stride_row), v.head(b, h), int(v.stride_row), 0.0f, ds,
                  int(m));
      // dS = P ∘ (dP - D) times the softmax scale (the factor of Q K^T in the logits)
#pragma omp parallel for schedule(static) if (inner)
      for (int64_t i = 0; i < n; ++i) {
        const float *o = out.row(b, h, i), *g = dout.row(b, h, i);
        float dsum = 0.0f;
        for (int64_t c = 0; c < d; ++c) dsum += o[c] * g[c];
        const float* pr = prob + i * m;
        float* sr = ds + i * m;
        for (int64_t j = 0; j < m; ++j) sr[j] = pr[j] * (sr[j] - dsum) * scale;
      }
      // dQ = dS K, dK = dS^T Q
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(d), int(m), 1.0f, ds,
                  int(m), k.head(b, h), int(k.stride_row), 0.0f, dq.head(b, h), int(dq.stride_row));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(m), int(d), int(n), 1.0f, ds, int(m),
                  q.head(b, h), int(q.stride_row), 0.0f, dk.head(b, h), int(dk.stride_row));
    };
    if (!per_head) {
      std::unique_ptr<float[]> ds(new float[size_t(n * m)]);
      for (int64_t bh = 0; bh < heads; ++bh) head(bh, ds.get(), true);
      return;
    }
    parallel_for(
        heads, [&] { return std::make_unique_for_overwrite<float[]>(size_t(n * m)); },
        [&](int64_t bh, std::unique_ptr<float[]>& ds) { head(bh, ds.get(), false); });
  }

  double backward_flops(const Problem& p) const override {
    // four GEMMs of n m d multiply-adds per head (dV, dP, dQ, dK)
    return 8.0 * double(p.dim) * double(p.batch * p.heads) * double(p.n) * double(p.keys());
  }
  double saved_estimate(const Problem& p) const override {
    return double(p.batch * p.heads) * double(p.n) * double(p.keys()) * sizeof(float);
  }
  double backward_memory_estimate(const Problem& p) const override {
    // the dS buffer: one per thread when heads run in parallel, else one
    const double copies = p.batch * p.heads >= team_threads() ? team_threads() : 1;
    return copies * double(p.n) * double(p.keys()) * sizeof(float);
  }

 private:
  /// The forward into `scores` [B, H, n, m], which ends holding the probabilities P.
  static void attend(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     TensorView out, float* scores_buf) {
    const int64_t n = p.n, m = p.keys(), d = p.dim, heads = p.batch * p.heads;
    const float scale = p.score == Score::additive ? 1.0f : p.softmax_scale();
    float* scores = scores_buf;
    // With fewer heads than threads, let BLAS use the threads; otherwise one head per thread.
    const bool per_head = heads >= team_threads();

    // pass 1: S = Q K^T (scaling is folded into the softmax), or the additive scores
    if (p.score == Score::additive) {
      const AdditiveProjections add(p, q, k);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < heads * n; ++r)
        additive_tile(add, r / n / p.heads, r / n % p.heads, r % n, 1, 0, m, scores + r * m, m, 1);
    } else {
#pragma omp parallel for schedule(dynamic) if (per_head)
      for (int64_t bh = 0; bh < heads; ++bh) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(m), int(d), 1.0f,
                    q.head(b, h), int(q.stride_row), k.head(b, h), int(k.stride_row), 0.0f,
                    scores + bh * n * m, int(m));
      }
    }
    // pass 2: causal mask, key padding, the attention mask's bias (in raw score units, as
    // the scale is applied in the softmax) and row softmax in place; hidden keys get
    // probability 0, and a row left with no key is 0
    const AttnMask* mask = p.attn_mask.get();
    const float root = 1.0f / scale;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < heads * n; ++r) {
      float* row = scores + r * m;
      const int64_t i = r % n, b = r / n / p.heads, h = r / n % p.heads;
      int64_t visible = p.visible(b, i);
      if (mask) {
        bool kept = false;
        for (int64_t j = 0; j < visible; ++j) {
          const float bias = mask->at(b, h, i, j);
          row[j] = bias == -INFINITY ? -INFINITY : row[j] + mask_bias_raw(bias, root);
          kept |= bias != -INFINITY;
        }
        if (!kept) visible = 0;
      }
      softmax_row(row, visible, scale);
      std::fill(row + visible, row + m, 0.0f);
    }
    // pass 3: O = P V
#pragma omp parallel for schedule(dynamic) if (per_head)
    for (int64_t bh = 0; bh < heads; ++bh) {
      const int64_t b = bh / p.heads, h = bh % p.heads;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(d), int(m), 1.0f,
                  scores + bh * n * m, int(m), v.head(b, h), int(v.stride_row), 0.0f,
                  out.head(b, h), int(out.stride_row));
    }
  }
};

ATTNBENCH_REGISTER_VARIANT(
    full,
    VariantInfo{.name = "full",
                .summary = "exact softmax attention, n x m scores materialised (PyTorch style)",
                .complexity = "time O(n m d), memory O(B H n m)",
                .family = "exact",
                .display = "Softmax attention",
                .paper = "Vaswani et al. 2017 (arXiv:1706.03762)",
                .look = {.color = "#000000", .marker = "o"},
                .params = {},
                .caps = {.causal = true,
                         .cross = true,
                         .additive = true,
                         .key_padding = true,
                         .attn_mask = true},
                .make = [](const ParamValues&) { return std::make_unique<Full>(); }});

}  // namespace
}  // namespace attnbench
