// efficient: "efficient attention" (Shen et al. 2018, "Efficient Attention: Attention with
// Linear Complexities", arXiv:1812.01243; WACV 2021).
//
//   out = softmax_row(Q) . (softmax_col(K)^T V)
//
// softmax_row(Q): each query row softmaxed over its d features; softmax_col(K): each of the d
// key channels softmaxed over the m positions. No 1/sqrt(d). softmax_col(K)^T V is a d x d
// "global context" matrix G, so the cost is linear in n and m. This is not softmax attention
// (no query-key logits at all): its oracle is the explicit formula, and its error against
// exact attention is a measurement.
//
// Steps:
//   1. per (batch, head) and key range: column max of K over the range, then per chunk of 512
//      keys P = exp(K_chunk - max) (chunk x d), column sums, G += P^T V_chunk (a GEMM); the key
//      ranges (one per head, or several when there are fewer heads than threads) are merged
//      with their maxima and G is divided by the column sums;
//   2. per block of 512 query rows: out_blk = softmax_row(Q_blk) G (a GEMM).
// Time O(B H (n + m) d^2); memory O(B H d^2 + threads 512 d).
// Oracle: the formula in double (efficient_oracle below). Its float32 chain (exps of input
// entries less their max, reductions over the m keys and the d features) is the default error
// model's.
// Key padding (Problem::key_lengths): the keys j >= L_b of batch element b are absent, as if
// that element had only its L_b valid keys: the column softmax of K and the sum G run over the
// valid keys only (each channel normalised over L_b positions), so padded keys and values
// change nothing. A key range of step 1 that holds no valid key is left out of the merge;
// with L_b = 0 there is no G, and every row of b is exactly 0.
// Backward: the chain rule through the two softmaxes and the product (Efficient::backward);
// nothing saved, the key statistics and G recomputed. Time O(B H (n + m) d^2).
// Not causal: a causal form would need a d x d prefix state per position; causal problems are
// refused with UnsupportedError.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "common/core/omp_guard.h"
#include "common/core/parallel_for.h"
#include "common/core/registry.h"
#include "common/kernels/softmax.h"
#include "common/patterns/key_split.h"
#include "common/reference/oracle.h"

namespace attnbench {
namespace {

constexpr int64_t kChunkK = 512;  // keys per G update
constexpr int64_t kBlockQ = 512;  // query rows per task in step 2

class Efficient final : public Variant, public RecomputeBackward<Efficient> {
 public:
  static KeySplit plan(const Problem& p) { return KeySplit(p, kChunkK); }

  /// The keys [j0, j1) of split sp of batch element b: its run of chunks, cut at b's valid
  /// length (empty when the run lies in the padding).
  static std::pair<int64_t, int64_t> keys(const Problem& p, const KeySplit& pl, int64_t b,
                                          int64_t sp) {
    const int64_t len = p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)];
    const int64_t j0 = pl.first_chunk(sp) * kChunkK;
    const int64_t j1 = std::min(len, pl.first_chunk(sp + 1) * kChunkK);
    return {j0, std::max(j0, j1)};
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const int64_t n = p.n, m = p.keys(), d = p.dim, H = p.heads, BH = p.batch * p.heads;
    const int64_t dd = d * d, part = dd + 2 * d;
    const KeySplit pl = plan(p);
    std::unique_ptr<float[]> g(new float[size_t(BH * dd)]);
    // per task of step 1: unnormalised G (d x d), column max (d), column sum (d)
    std::unique_ptr<float[]> partial(new float[size_t(pl.tasks * part)]);

    OmpGuard guard;
#pragma omp parallel
    {
      {
        std::unique_ptr<float[]> pbuf;
        guard.run([&] { pbuf.reset(new float[size_t(std::min(kChunkK, m) * d)]); });
        float* pc = pbuf.get();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < pl.tasks; ++t)
          guard.run([&] {
            const int64_t bh = t / pl.splits, sp = t % pl.splits;
            const int64_t b = bh / H, h = bh % H;
            const auto [j0, j1] = keys(p, pl, b, sp);
            float* gp = partial.get() + t * part;
            float* mx = gp + dd;
            float* sum = mx + d;
            std::fill(mx, mx + d, -INFINITY);
            std::fill(sum, sum + d, 0.0f);
            for (int64_t j = j0; j < j1; ++j) {
              const float* kr = k.row(b, h, j);
              for (int64_t c = 0; c < d; ++c) mx[c] = kr[c] > mx[c] ? kr[c] : mx[c];
            }
            for (int64_t c0 = j0; c0 < j1; c0 += kChunkK) {
              const int64_t rows = std::min(kChunkK, j1 - c0);
              for (int64_t j = 0; j < rows; ++j) {
                const float* kr = k.row(b, h, c0 + j);
                float* pr = pc + j * d;
                for (int64_t c = 0; c < d; ++c) {
                  pr[c] = fast_exp(kr[c] - mx[c]);
                  sum[c] += pr[c];
                }
              }
              // G += P^T V_chunk
              cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(d), int(d), int(rows), 1.0f,
                          pc, int(d), v.row(b, h, c0), int(v.stride_row), c0 == j0 ? 0.0f : 1.0f,
                          gp, int(d));
            }
          });
      }
      // merge the key ranges of each head: G[c, :] = sum_s e^(mx_s - top) G_s[c, :] / total
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < BH; ++bh) {
        if (guard.failed()) continue;  // a key range is missing
        const float* first = partial.get() + bh * pl.splits * part;
        float* gd = g.get() + bh * dd;
        // the splits holding valid keys: a prefix of them (none when L_b = 0, then G is unused)
        int64_t used = 0;
        while (used < pl.splits) {
          const auto [j0, j1] = keys(p, pl, bh / H, used);
          if (j0 == j1) break;
          ++used;
        }
        for (int64_t c = 0; c < d; ++c) {
          float top = -INFINITY;
          for (int64_t sp = 0; sp < used; ++sp) top = std::max(top, first[sp * part + dd + c]);
          float total = 0.0f;
          std::fill(gd + c * d, gd + (c + 1) * d, 0.0f);
          for (int64_t sp = 0; sp < used; ++sp) {
            const float* gp = first + sp * part;
            const float f = fast_exp(gp[dd + c] - top);
            total += f * gp[dd + d + c];
            for (int64_t x = 0; x < d; ++x) gd[c * d + x] += f * gp[c * d + x];
          }
          const float inv = 1.0f / total;
          for (int64_t x = 0; x < d; ++x) gd[c * d + x] *= inv;
        }
      }
      // step 2: out = softmax_row(Q) G
      {
        const int64_t qblocks = (n + kBlockQ - 1) / kBlockQ, tasks = BH * qblocks;
        std::unique_ptr<float[]> sbuf;
        guard.run([&] { sbuf.reset(new float[size_t(std::min(kBlockQ, n) * d)]); });
        float* s = sbuf.get();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t)
          guard.run([&] {
            const int64_t bh = t / qblocks, i0 = (t % qblocks) * kBlockQ;
            const int64_t b = bh / H, h = bh % H, rows = std::min(kBlockQ, n - i0);
            if (!p.key_lengths.empty() && p.key_lengths[size_t(b)] == 0) {
              for (int64_t r = 0; r < rows; ++r) std::fill_n(out.row(b, h, i0 + r), d, 0.0f);
              return;
            }
            for (int64_t r = 0; r < rows; ++r) {
              std::copy_n(q.row(b, h, i0 + r), d, s + r * d);
              softmax_row(s + r * d, d, 1.0f);
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(d), 1.0f,
                        s, int(d), g.get() + bh * dd, int(d), 0.0f, out.row(b, h, i0),
                        int(out.stride_row));
          });
      }
    }
    guard.rethrow();
  }

  // Nothing saved (RecomputeBackward): the backward recomputes the column statistics of K and G
  // (one m d^2 GEMM more than keeping G, d^2 + 2 d floats per head, would cost). With Sq =
  // softmax_row(Q), Pk = softmax_col(K) over the L_b valid keys, G = Pk^T V, out = Sq G:
  //   dSq = dO G^T,  dq_i = Sq_i o (dSq_i - Sq_i . dSq_i),  dG = Sq^T dO,
  //   dV = Pk dG,    dPk = V dG^T,  dK[:, c] = Pk[:, c] o (dPk[:, c] - s_c)
  // with s_c = sum_j Pk[j, c] dPk[j, c] = G[c, :] . dG[c, :]. Padded keys get 0.
  // Per (batch, head): the keys (max, sums, G), the queries in blocks (dq, dG), the keys
  // again (dk, dv).
  void recompute_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          ConstTensorView, ConstTensorView dout, TensorView dq, TensorView dk,
                          TensorView dv) {
    const int64_t n = p.n, m = p.keys(), d = p.dim, H = p.heads, BH = p.batch * p.heads;
    const int64_t dd = d * d, rows_max = std::max(std::min(kChunkK, m), std::min(kBlockQ, n));
    parallel_for(
        BH,
        [&] {
          return std::make_unique_for_overwrite<float[]>(size_t(2 * rows_max * d + 2 * dd + 3 * d));
        },
        [&](int64_t bh, std::unique_ptr<float[]>& buf) {
          const int64_t b = bh / H, h = bh % H;
          const int64_t len = p.key_lengths.empty() ? m : p.key_lengths[size_t(b)];
          float *x = buf.get(), *y = x + rows_max * d, *g = y + rows_max * d, *dg = g + dd,
                *mx = dg + dd, *sum = mx + d, *sc = sum + d;
          for (int64_t j = len; j < m; ++j) {
            std::fill_n(dk.row(b, h, j), d, 0.0f);
            std::fill_n(dv.row(b, h, j), d, 0.0f);
          }
          if (len == 0) {
            for (int64_t i = 0; i < n; ++i) std::fill_n(dq.row(b, h, i), d, 0.0f);
            return;
          }
          // Pk of keys [c0, c0 + rows) into x
          auto column_softmax = [&](int64_t c0, int64_t rows) {
            for (int64_t j = 0; j < rows; ++j) {
              const float* kr = k.row(b, h, c0 + j);
              float* pr = x + j * d;
              for (int64_t c = 0; c < d; ++c) pr[c] = fast_exp(kr[c] - mx[c]) * sum[c];
            }
          };
          // 1. column max and sums over the valid keys, G = Pk^T V
          std::fill(mx, mx + d, -INFINITY);
          std::fill(sum, sum + d, 0.0f);
          for (int64_t j = 0; j < len; ++j) {
            const float* kr = k.row(b, h, j);
            for (int64_t c = 0; c < d; ++c) mx[c] = std::max(mx[c], kr[c]);
          }
          for (int64_t j = 0; j < len; ++j) {
            const float* kr = k.row(b, h, j);
            for (int64_t c = 0; c < d; ++c) sum[c] += fast_exp(kr[c] - mx[c]);
          }
          for (int64_t c = 0; c < d; ++c) sum[c] = 1.0f / sum[c];  // from here on: 1 / sum
          for (int64_t c0 = 0; c0 < len; c0 += kChunkK) {
            const int64_t rows = std::min(kChunkK, len - c0);
            column_softmax(c0, rows);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(d), int(d), int(rows), 1.0f, x,
                        int(d), v.row(b, h, c0), int(v.stride_row), c0 == 0 ? 0.0f : 1.0f, g,
                        int(d));
          }
          // 2. queries: Sq (x), dSq = dO G^T (y), dq, dG += Sq^T dO
          std::fill(dg, dg + dd, 0.0f);
          for (int64_t i0 = 0; i0 < n; i0 += kBlockQ) {
            const int64_t rows = std::min(kBlockQ, n - i0);
            for (int64_t r = 0; r < rows; ++r) {
              std::copy_n(q.row(b, h, i0 + r), d, x + r * d);
              softmax_row(x + r * d, d, 1.0f);
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(d), int(d), 1.0f,
                        dout.row(b, h, i0), int(dout.stride_row), g, int(d), 0.0f, y, int(d));
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(d), int(d), int(rows), 1.0f, x,
                        int(d), dout.row(b, h, i0), int(dout.stride_row), 1.0f, dg, int(d));
            for (int64_t r = 0; r < rows; ++r) {
              const float *sr = x + r * d, *yr = y + r * d;
              float dot = 0.0f;
              for (int64_t c = 0; c < d; ++c) dot += sr[c] * yr[c];
              float* o = dq.row(b, h, i0 + r);
              for (int64_t c = 0; c < d; ++c) o[c] = sr[c] * (yr[c] - dot);
            }
          }
          // 3. s_c = G[c, :] . dG[c, :]
          for (int64_t c = 0; c < d; ++c) {
            float acc = 0.0f;
            for (int64_t e = 0; e < d; ++e) acc += g[c * d + e] * dg[c * d + e];
            sc[c] = acc;
          }
          // 4. keys: dV = Pk dG, dPk = V dG^T (y), dK = Pk o (dPk - s)
          for (int64_t c0 = 0; c0 < len; c0 += kChunkK) {
            const int64_t rows = std::min(kChunkK, len - c0);
            column_softmax(c0, rows);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(d), 1.0f,
                        x, int(d), dg, int(d), 0.0f, dv.row(b, h, c0), int(dv.stride_row));
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(d), int(d), 1.0f,
                        v.row(b, h, c0), int(v.stride_row), dg, int(d), 0.0f, y, int(d));
            for (int64_t j = 0; j < rows; ++j) {
              const float *pr = x + j * d, *yr = y + j * d;
              float* o = dk.row(b, h, c0 + j);
              for (int64_t c = 0; c < d; ++c) o[c] = pr[c] * (yr[c] - sc[c]);
            }
          }
        });
  }

  double backward_flops(const Problem& p) const override {
    const double bh = double(p.batch * p.heads), d = double(p.dim);
    const double n = double(p.n), m = double(p.keys());
    // keys: G (2 m d^2) and Pk twice (about 5 per entry each, with max and sums); queries:
    // softmax (4 per entry), dO G^T and Sq^T dO (4 n d^2), dq (4 per entry); s (2 d^2); keys
    // again: Pk dG and V dG^T (4 m d^2), dk (2 per entry)
    return bh * (6.0 * m * d * d + 12.0 * m * d + 4.0 * n * d * d + 8.0 * n * d + 2.0 * d * d);
  }
  double backward_memory_estimate(const Problem& p) const override {
    const double d = double(p.dim), f = sizeof(float);
    const double rows = double(std::max(std::min(kChunkK, p.keys()), std::min(kBlockQ, p.n)));
    const int64_t threads = std::min<int64_t>(team_threads(), p.batch * p.heads);
    return double(std::max<int64_t>(threads, 1)) * (2.0 * rows * d + 2.0 * d * d + 3.0 * d) * f;
  }

  double flops(const Problem& p) const override {
    const double bh = double(p.batch * p.heads), d = double(p.dim);
    const double n = double(p.n), m = double(p.keys());
    // GEMMs: P^T V (2 m d^2) and softmax_row(Q) G (2 n d^2); softmaxes: about 4 operations per
    // element of Q and of K (max, subtract, exp, sum or normalise).
    return bh * (2.0 * (n + m) * d * d + 4.0 * (n + m) * d);
  }

  double memory_estimate(const Problem& p) const override {
    const KeySplit pl = plan(p);
    const double d = double(p.dim), f = sizeof(float);
    const double shared =
        double(p.batch * p.heads) * d * d * f + double(pl.tasks) * (d * d + 2 * d) * f;
    const double per_thread =
        double(std::max(std::min(kChunkK, p.keys()), std::min(kBlockQ, p.n))) * d * f;
    return shared + double(pl.threads) * per_thread;
  }
};

// softmax_row(Q) (softmax_col(K)^T V) in double, K and V cut to the L_b valid keys.
std::vector<double> efficient_oracle(const Variant&, const Problem& p, ConstTensorView q,
                                     ConstTensorView k, ConstTensorView v) {
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    const int64_t len = p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)];
    if (len == 0) return oracle::Matrix(p.n, p.dim);
    // the first len rows of a key-side head (row-major: a prefix of its entries)
    auto valid = [&](ConstTensorView t) {
      oracle::Matrix x = oracle::head(t, b, h);
      x.rows = len;
      x.a.resize(size_t(len * x.cols));
      return x;
    };
    oracle::Matrix qs = oracle::head(q, b, h), kc = oracle::transpose(valid(k));
    oracle::softmax_rows(qs, 1.0);
    oracle::softmax_rows(kc, 1.0);  // d x L_b: each channel over the valid positions
    return oracle::product(qs, oracle::product(kc, valid(v)));
  });
}

ATTNBENCH_REGISTER_VARIANT(
    efficient,
    VariantInfo{.name = "efficient",
                .summary = "softmax_row(Q) (softmax_col(K)^T V), no query-key logits "
                           "(Shen et al. efficient attention)",
                .complexity = "time O((n + m) d^2), memory O(B H d^2 + threads 512 d)",
                .family = "lowrank",
                .display = "Efficient attention",
                .paper = "Shen et al. 2018 (arXiv:1812.01243)",
                .look = {.color = "#bcbd22", .marker = "D"},
                .params = {},
                .caps = {.causal = false, .cross = true, .exact = false, .key_padding = true},
                .make = [](const ParamValues&) { return std::make_unique<Efficient>(); },
                .oracle = efficient_oracle});

}  // namespace
}  // namespace attnbench
