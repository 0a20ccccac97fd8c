// full: exact softmax attention with the score matrix materialised, the way a PyTorch user
// writes it: S = Q K^T / sqrt(d) for every (batch, head) at once, masked, softmaxed in place,
// then O = S V.
//
//   out = softmax(Q K^T / sqrt(d) + mask) V
//
// The additive score (common/additive_score.h) fills the same n x m matrix with its logits.
//
// Time O(B H n m d) through BLAS GEMM; memory O(B H n m) for the scores.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "common/additive_score.h"
#include "common/registry.h"
#include "common/softmax.h"
#include "common/threads.h"

namespace attnbench {
namespace {

class Full final : public Variant {
 public:
  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const int64_t n = p.n, m = p.keys(), d = p.dim, heads = p.batch * p.heads;
    const float scale = p.score == Score::additive ? 1.0f : p.softmax_scale();
    // scores is [B, H, n, m], like the tensor q @ k.transpose(-2, -1) in PyTorch.
    // Left uninitialised (as torch.empty would be): every element is written by pass 1.
    std::unique_ptr<float[]> scores(new float[size_t(heads * n * m)]);
    // With fewer heads than threads, let BLAS use the threads; otherwise one head per thread.
    const bool per_head = heads >= team_threads();

    // pass 1: S = Q K^T (scaling is folded into the softmax), or the additive scores
    if (p.score == Score::additive) {
      const AdditiveProjections add(p, q, k);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < heads * n; ++r)
        additive_tile(add, r / n / p.heads, r / n % p.heads, r % n, 1, 0, m, scores.get() + r * m,
                      m, 1);
    } else {
#pragma omp parallel for schedule(dynamic) if (per_head)
      for (int64_t bh = 0; bh < heads; ++bh) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(m), int(d), 1.0f,
                    q.head(b, h), int(q.stride_row), k.head(b, h), int(k.stride_row), 0.0f,
                    scores.get() + bh * n * m, int(m));
      }
    }
    // pass 2: causal mask, key padding, the attention mask's bias (in raw score units, as
    // the scale is applied in the softmax) and row softmax in place; hidden keys get
    // probability 0, and a row left with no key is 0
    const AttnMask* mask = p.attn_mask.get();
    const float root = 1.0f / scale;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < heads * n; ++r) {
      float* row = scores.get() + r * m;
      const int64_t i = r % n, b = r / n / p.heads, h = r / n % p.heads;
      int64_t visible = p.visible(b, i);
      if (mask) {
        bool kept = false;
        for (int64_t j = 0; j < visible; ++j) {
          const float bias = mask->at(b, h, i, j);
          row[j] = bias == -INFINITY ? -INFINITY : row[j] + bias * root;
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
                  scores.get() + bh * n * m, int(m), v.head(b, h), int(v.stride_row), 0.0f,
                  out.head(b, h), int(out.stride_row));
    }
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
};

ATTNBENCH_REGISTER_VARIANT(
    full,
    VariantInfo{.name = "full",
                .summary = "exact softmax attention, n x m scores materialised (PyTorch style)",
                .complexity = "time O(n m d), memory O(B H n m)",
                .params = {},
                .caps = {.causal = true,
                         .cross = true,
                         .additive = true,
                         .key_padding = true,
                         .attn_mask = true},
                .make = [](const ParamValues&) { return std::make_unique<Full>(); }});

}  // namespace
}  // namespace attnbench
