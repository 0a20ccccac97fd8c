// nystrom: Nyström approximation of the softmax matrix through L landmarks (Xiong et al. 2021,
// "Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention",
// arXiv:2102.03902).
//
//   Q~, K~ = means of L consecutive segments of the rows of Q and of K (landmarks, L x d)
//   out = softmax(s Q K~^T) . pinv(softmax(s Q~ K~^T)) . softmax(s Q~ K^T) V,   s = 1/sqrt(d)
//
// (the paper scales Q and K by d^-1/4 each; landmarks are means, so that is the same as one
// factor s = d^-1/2 on every logit, which is how it is applied here.)
//
// Segments: segment r of the n query rows covers rows floor(r n / L) .. floor((r + 1) n / L) - 1,
// so when L does not divide n the segments differ in size by at most one row (the same for
// the m keys). L = min(landmarks, n, m): more landmarks than rows would leave empty segments.
// With L = n = m every segment is one token, the three softmax matrices are the same n x n
// matrix A, and out = A pinv(A) A V = A V: exact attention (given enough pinv iterations).
//
// pinv by the paper's iteration (Razavi et al. 2014):
//   Z0 = A^T / (max_i sum_j |A_ij| . max_j sum_i |A_ij|),
//   Z <- 1/4 Z (13 I - A Z (15 I - A Z (7 I - A Z)))        (pinv_iterations times)
// per head, in the precision pinv_dtype names (float32, the default, or float64). Z0 here
// uses each head's own maxima; the authors' code ("original" init, also in HF transformers)
// divides by the largest column sum over the whole batch and all heads (rows of a softmax sum
// to 1), and lucidrains' nystrom-attention by both global maxima; a smaller Z0 only delays
// convergence. Every iterate is Z = A^T g(A A^T): the singular values sigma of A Z start at
// sigma_A^2 / (row max . col max) and move as x <- x (13 - 15x + 7x^2 - x^3) / 4 (about
// x 13/4 while small, converging to 1), so directions with small singular values of A stay
// unconverged after few iterations (6 in the paper): a built-in regulariser.
// Precision (pinv_dtype): float32 by default, as the authors' code runs it. The landmark
// matrix is badly conditioned (cond 1e3 to 2e4 in the tests, up to the float limit on
// clustered inputs; landmarks that are means of many tokens give nearly uniform rows), and the
// iteration's own roundings reach the output amplified by the condition number of the
// directions it has converged in, min(cond(A), (13/4)^(t/2)) after t iterations: at the
// default 6 (at most 34) float32 and float64 land equally close to the float64 formula
// (within 2.4e-6 relative Frobenius on every input distribution of the tests, 1e-6 from each
// other), but with many iterations a float32 iteration also converges on directions that are
// rounding noise: with landmarks = n = m and 50 iterations it stays 1e-4 from exact attention
// where float64 reaches 4e-7; at 20 iterations it lands up to 2e-3 from the formula, and at
// 50 it diverges on nearly singular landmark matrices (clustered or low-rank inputs, L = n).
// float64 is for such uses (the exactness tests take it). The L^3 work does not grow with n;
// at B=1 H=8 n=256 L=64 (2 threads) the 6 iterations take about 0.5 ms in float32 and 1.2 ms
// in float64, next to 0.7 ms for everything else.
//
// Steps:
//   1. landmarks Q~, K~ (segment means, accumulated in double) for every (batch, head);
//   2. B = softmax(s Q~ K^T) V (L x d) with an online softmax over chunks of 512 keys
//      (S = Q~ K_chunk^T, running row max and sum, acc = acc corr + P V_chunk), so the L x m
//      matrix is never stored; with fewer heads than threads the keys of a head are split into
//      ranges merged afterwards;
//   3. A = softmax(s Q~ K~^T) (L x L), Z = pinv(A) by the iteration, W = Z B (L x d), the
//      iteration, B and W in pinv_dtype;
//   4. per block of 256 query rows: out_blk = softmax(s Q_blk K~^T) W.
// With at least as many heads as threads, one parallel region runs steps 1-3 of a head on one
// thread (and its step 4 when n <= 256; otherwise the blocks of step 4 are shared out after
// one barrier); with fewer, the steps run one after the other over all heads (step 3 one
// head at a time, BLAS using the threads).
// Key padding (Problem::key_lengths): padded keys are absent. Batch element b runs the method
// as if m were its valid length L_b: L_b' = min(landmarks, n, L_b) landmarks, the key
// landmarks segment means of the L_b valid keys (segment r covers keys floor(r L_b / L_b') ..
// floor((r + 1) L_b / L_b') - 1), the query landmarks segment means of the n queries into L_b'
// segments, and softmax(s Q~ K^T) V over the valid keys only; no padded key or value enters a
// landmark, a softmax or B. L_b = 0 leaves nothing to attend: its rows output 0. A padded
// element computes exactly what the unpadded problem of its valid keys does.
// Oracle: the formula in double with the same segments and the same number of iterations
// (nystrom_oracle below).
// Tolerance (the float32 error model of common/reference/oracle.h, then the iteration): the three
// softmax matrices and B carry softmax attention's float32 error (logits over d, reductions
// over m, landmark means over up to ceil(max(n, m) / L) rows). The iteration passes a
// relative perturbation of A on to Z by at most the condition number of the directions it
// has converged in: a singular value sigma of A converges once
// sigma^2 (13/4)^t / (row max . col max) reaches about 1, and sigma_max^2 <= row max . col max,
// so after t iterations that condition number is at most (13/4)^(t/2) (34 at the default 6).
// A float32 iteration's roundings (per iteration 4 products with reductions over L and 4
// roundings in series) are perturbations of the same kind: a rounding of Z_s grows by at most
// 13/4 per later iteration in a direction not yet converged, against iterates of norm at most
// (13/4)^(s/2) / sqrt(row max . col max), so relative to Z_t it too is amplified by at most
// (13/4)^(t/2); they lengthen the chain. Many iterations make the bound loose: the converged
// pseudo-inverse amplifies by cond(A), which only the data decide.
// Time O(B H ((n + m) L d + iterations L^3)); memory O(B H L d + threads L (512 + 5 L + 3 d)).
// Backward: the forward keeps nothing. Per head the backward recomputes Q~, K~, B (two passes
// over the keys: row maxima, then sums and P V), A, Z (keeping its iterates; the iteration in
// pinv_dtype, as the forward runs it) and W, then differentiates each step in reverse
// (backward_head): F's softmax per query block, W = Z B, the pinv iteration step by step with
// its starting scale 1 / (R C) (iterative_pinv_backward, in double: with float32 the
// derivative of each exact step is taken at the float iterates), A's softmax, B's softmax per
// key chunk, and the landmark means. forward_train is forward.
// Not causal: the landmarks mix all positions.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel_for.h"
#include "common/core/registry.h"
#include "common/kernels/softmax.h"
#include "common/patterns/key_split.h"
#include "common/reference/oracle.h"
#include "variants/nystrom_pinv.h"

namespace attnbench {
namespace {

constexpr int64_t kChunkK = 512;  // keys per online-softmax step in step 2
constexpr int64_t kBlockQ = 256;  // query rows per task in step 4

using nystrom::gemm_rect;
using nystrom::iterative_pinv;
using nystrom::iterative_pinv_backward;
using nystrom::segment_means;

class Nystrom final : public Variant, public RecomputeBackward<Nystrom> {
 public:
  Nystrom(int64_t landmarks, int64_t iters, bool pinv_double)
      : landmarks_(landmarks), iters_(iters), pinv_double_(pinv_double) {}

  /// Landmarks used, and the split of the keys of step 2 over the threads.
  struct Plan : KeySplit {
    int64_t L = 0;
  };
  Plan plan(const Problem& p) const {
    Plan pl;
    static_cast<KeySplit&>(pl) = KeySplit(p, kChunkK);
    pl.L = std::min({landmarks_, p.n, p.keys()});
    return pl;
  }
  /// Valid keys of batch element b (every key without key padding).
  static int64_t valid_keys(const Problem& p, int64_t b) {
    return p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)];
  }
  /// Landmarks of batch element b: pl.L, or fewer when its valid keys are fewer.
  int64_t landmarks(const Problem& p, const Plan& pl, int64_t b) const {
    return p.key_lengths.empty() ? pl.L : std::min(pl.L, valid_keys(p, b));
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const int64_t BH = p.batch * p.heads;
    const Plan pl = plan(p);
    // L: the most landmarks of any batch element, which sizes every buffer; Lb (<= L): those
    // of batch element b, stored as an Lb x d (or Lb x Lb) matrix at the start of its slot
    const int64_t Ld = pl.L * p.dim;
    // qt, kt: landmarks (L x d per head); w: Z B (L x d per head)
    std::unique_ptr<float[]> qt(new float[size_t(BH * Ld)]), kt(new float[size_t(BH * Ld)]),
        w(new float[size_t(BH * Ld)]);
    const Pass pass{*this, p, pl, q, k, v, out, qt.get(), kt.get(), w.get()};
    if (by_heads(pl, BH)) {
      if (pinv_double_)
        forward_by_heads<double>(pass);
      else
        forward_by_heads<float>(pass);
    } else {
      if (pinv_double_)
        forward_split<double>(pass);
      else
        forward_split<float>(pass);
    }
  }

  // The backward recomputes the method per head and differentiates every step the forward
  // runs (backward_head); the forward keeps nothing (RecomputeBackward).
  void recompute_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          ConstTensorView, ConstTensorView dout, TensorView dq, TensorView dk,
                          TensorView dv) {
    const Plan pl = plan(p);
    using Buffers = std::pair<std::vector<float>, std::vector<double>>;
    parallel_for(
        p.batch * p.heads,
        [&] {
          return Buffers(size_t(backward_floats(p, pl.L)), size_t(backward_doubles(pl.L, p.dim)));
        },
        [&](int64_t bh, Buffers& buf) {
          backward_head(p, pl, bh / p.heads, bh % p.heads, q, k, v, dout, dq, dk, dv,
                        buf.first.data(), buf.second.data());
        });
  }

  double backward_flops(const Problem& p) const override {
    const Plan pl = plan(p);
    const double bh = double(p.batch * p.heads), L = double(pl.L), d = double(p.dim);
    const double n = double(p.n), m = double(p.keys()), it = double(iters_);
    // Q~ K^T three times and P V, dP, dQ~, dK (2 L m d each); Q K~^T, dF, dW, dQ, dK~ (2 n L d
    // each); the pinv forward (8 L^3 per iteration) and backward (the step again, 6 L^3, and 8
    // L^3); W = Z B, dZ, dB, A and its backward (about 10 L^2 d); softmaxes and landmarks
    return bh * (12.0 * L * m * d + 10.0 * n * L * d + 22.0 * it * L * L * L + 10.0 * L * L * d +
                 10.0 * (n * L + L * m + L * L) + 2.0 * (n + m) * d);
  }
  double backward_memory_estimate(const Problem& p) const override {
    const Plan pl = plan(p);
    const double threads = double(std::min<int64_t>(team_threads(), p.batch * p.heads));
    return threads * (double(backward_floats(p, pl.L)) * sizeof(float) +
                      double(backward_doubles(pl.L, p.dim)) * sizeof(double));
  }

  double flops(const Problem& p) const override {
    const Plan pl = plan(p);
    const double bh = double(p.batch * p.heads), L = double(pl.L), d = double(p.dim);
    const double n = double(p.n), m = double(p.keys());
    // GEMMs: Q~ K^T and P V (2 L m d each), Q~ K~^T (2 L^2 d), Q K~^T and S W (2 n L d each),
    // Z B (2 L^2 d), 4 L x L products per pinv iteration (8 L^3); softmax: about 4 operations
    // per score (n L + L m + L^2 scores) plus the online rescaling (L d per key chunk);
    // landmark means: (n + m) d additions.
    return bh *
           (4.0 * L * m * d + 4.0 * n * L * d + 4.0 * L * L * d + 8.0 * double(iters_) * L * L * L +
            4.0 * (n * L + L * m + L * L) + double(pl.chunks) * L * d + (n + m) * d);
  }

  double memory_estimate(const Problem& p) const override {
    const Plan pl = plan(p);
    const int64_t BH = p.batch * p.heads;
    const double f = sizeof(float), T = double(pl.threads);
    const Pass ps{*this, p, pl, {}, {}, {}, {}, nullptr, nullptr, nullptr};
    // step 3's buffers
    const double solve =
        double(ps.solve_reals()) * (pinv_double_ ? sizeof(double) : sizeof(float)) +
        double(ps.solve_floats(pinv_double_)) * f;
    // qt, kt, w
    const double shared = 3.0 * double(BH * ps.Ld()) * f;
    if (by_heads(pl, BH)) {
      // every thread's buffers, live through the whole pass
      const double scores = double(std::max(ps.step2_floats(), ps.step4_floats()));
      return shared +
             T * (double(p.dim) * sizeof(double) + (scores + double(ps.part())) * f + solve);
    }
    // the partial results of step 2, and the largest of the buffers of steps 1-4 (each step
    // frees its own); step 3 runs on the calling thread
    const double step1 = T * double(p.dim) * sizeof(double);
    const double step2 = T * double(ps.step2_floats()) * f;
    const double step4 = T * double(ps.step4_floats()) * f;
    return shared + double(pl.tasks * ps.part()) * f + std::max({step1, step2, solve, step4});
  }

 private:
  /// One forward pass: the problem, its inputs and output, and the landmarks and W of every
  /// head (shared by the threads); its steps, each for one head or one task.
  struct Pass {
    const Nystrom& self;
    const Problem& p;
    const Plan& pl;
    ConstTensorView q, k, v;
    TensorView out;
    float *qt, *kt, *w;

    int64_t d() const { return p.dim; }
    int64_t Ld() const { return pl.L * p.dim; }
    /// Floats of a partial result of step 2: acc (L x d), row max (L), row sum (L).
    int64_t part() const { return Ld() + 2 * pl.L; }
    int64_t qblocks() const { return (p.n + kBlockQ - 1) / kBlockQ; }
    /// Floats of the score buffer of step 2 and of step 4.
    int64_t step2_floats() const { return pl.L * std::min(kChunkK, p.keys()); }
    int64_t step4_floats() const { return std::min(kBlockQ, p.n) * pl.L; }

    // step 1: the landmarks of head bh; acc holds d doubles
    void landmarks(int64_t bh, double* acc) const {
      const int64_t b = bh / p.heads, h = bh % p.heads, Lb = self.landmarks(p, pl, b);
      segment_means(q.head(b, h), q.stride_row, p.n, d(), Lb, qt + bh * Ld(), acc);
      segment_means(k.head(b, h), k.stride_row, valid_keys(p, b), d(), Lb, kt + bh * Ld(), acc);
    }

    // step 2: softmax(s Q~ K^T) V over the key range of task t, online, into its partial
    // result; s holds step2_floats()
    void keys(int64_t t, float* partial, float* s) const {
      const int64_t bh = t / pl.splits, sp = t % pl.splits, L = pl.L, d = p.dim, Ld = L * d;
      const int64_t b = bh / p.heads, h = bh % p.heads, Lb = self.landmarks(p, pl, b);
      const int64_t len = valid_keys(p, b);
      const float scale = p.softmax_scale();
      // the task's chunks that hold valid keys (all of them without key padding)
      const int64_t c0 = pl.first_chunk(sp);
      const int64_t c1 = std::min(pl.first_chunk(sp + 1), (len + kChunkK - 1) / kChunkK);
      float* acc = partial;
      float* mx = acc + Ld;
      float* l = mx + L;
      if (c0 >= c1) {  // no valid key: an empty partial result (sum 0), skipped by step 3
        std::fill_n(l, Lb, 0.0f);
        return;
      }
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t j0 = c * kChunkK, cols = std::min(kChunkK, len - j0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(Lb), int(cols), int(d), 1.0f,
                    qt + bh * Ld, int(d), k.row(b, h, j0), int(k.stride_row), 0.0f, s, int(cols));
        for (int64_t r = 0; r < Lb; ++r) {
          float* row = s + r * cols;
          const float bm = row_max(row, cols);
          const float mnew = c == c0 || bm > mx[r] ? bm : mx[r];
          const float sum = exp_sum(row, cols, scale, mnew);
          if (c == c0) {
            l[r] = sum;
          } else {
            const float corr = fast_exp((mx[r] - mnew) * scale);
            l[r] = l[r] * corr + sum;
            for (int64_t x = 0; x < d; ++x) acc[r * d + x] *= corr;
          }
          mx[r] = mnew;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(Lb), int(d), int(cols), 1.0f, s,
                    int(cols), v.row(b, h, j0), int(v.stride_row), c == c0 ? 0.0f : 1.0f, acc,
                    int(d));
      }
    }

    /// Values of solve()'s buffer in its Real (A, Z, the iteration's work, B, W), and the
    /// floats of A's scores when Real is double (a float A is formed in place).
    int64_t solve_reals() const { return 5 * pl.L * pl.L + 2 * Ld(); }
    int64_t solve_floats(bool real_is_double) const { return real_is_double ? pl.L * pl.L : 0; }

    // step 3 for head bh: merges its key ranges (the pl.splits partial results from `first`)
    // into B, then W = pinv(A) B with A = softmax(s Q~ K~^T) and the iteration in Real
    // (pinv_dtype). rbuf holds solve_reals(), fbuf solve_floats().
    template <class Real>
    void solve(int64_t bh, const float* first, Real* rbuf, float* fbuf) const {
      constexpr bool is_float = std::is_same_v<Real, float>;
      const int64_t L = pl.L, d = p.dim, Ld = L * d, part = this->part();
      const int64_t Lb = self.landmarks(p, pl, bh / p.heads);
      const float scale = p.softmax_scale();
      if (Lb == 0) return;  // no valid key: step 4 writes 0
      Real *a = rbuf, *z = a + L * L, *work = z + L * L, *bb = work + 3 * L * L;
      // B = acc / l, the key ranges combined with their running maxima (a range without a
      // valid key has sum 0 and no maximum: it is left out)
      auto empty = [&](int64_t sp, int64_t r) { return first[sp * part + Ld + L + r] == 0.0f; };
      for (int64_t r = 0; r < Lb; ++r) {
        float top = -INFINITY;
        for (int64_t sp = 0; sp < pl.splits; ++sp)
          if (!empty(sp, r)) top = std::max(top, first[sp * part + Ld + r]);
        double sum = 0;
        std::fill(bb + r * d, bb + (r + 1) * d, Real(0));
        for (int64_t sp = 0; sp < pl.splits; ++sp) {
          if (empty(sp, r)) continue;
          const float* acc = first + sp * part;
          const double f = fast_exp((acc[Ld + r] - top) * scale);
          sum += f * acc[Ld + L + r];
          for (int64_t x = 0; x < d; ++x) bb[r * d + x] += Real(f * acc[r * d + x]);
        }
        for (int64_t x = 0; x < d; ++x) bb[r * d + x] = Real(bb[r * d + x] / sum);
      }
      // A = softmax(s Q~ K~^T) in float, then in Real
      float* af;
      if constexpr (is_float)
        af = a;
      else
        af = fbuf;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(Lb), int(Lb), int(d), 1.0f,
                  qt + bh * Ld, int(d), kt + bh * Ld, int(d), 0.0f, af, int(Lb));
      for (int64_t r = 0; r < Lb; ++r) softmax_row(af + r * Lb, Lb, scale);
      if constexpr (!is_float)
        for (int64_t i = 0; i < Lb * Lb; ++i) a[i] = Real(af[i]);
      iterative_pinv(Lb, a, self.iters_, z, work);
      // W = Z B (in Real, rounded once)
      Real* wr = bb + Ld;
      gemm_rect(Lb, d, z, bb, wr);
      for (int64_t i = 0; i < Lb * d; ++i) w[bh * Ld + i] = float(wr[i]);
    }

    // step 4: out = softmax(s Q K~^T) W for task t (query block t % qblocks() of head
    // t / qblocks()); s holds step4_floats()
    void rows(int64_t t, float* s) const {
      const int64_t d = p.dim, Ld = this->Ld(), qb = qblocks();
      const int64_t bh = t / qb, i0 = (t % qb) * kBlockQ;
      const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(kBlockQ, p.n - i0);
      const int64_t Lb = self.landmarks(p, pl, b);
      if (Lb == 0) {  // no valid key
        for (int64_t r = 0; r < rows; ++r) std::fill_n(out.row(b, h, i0 + r), d, 0.0f);
        return;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(Lb), int(d), 1.0f,
                  q.row(b, h, i0), int(q.stride_row), kt + bh * Ld, int(d), 0.0f, s, int(Lb));
      for (int64_t r = 0; r < rows; ++r) softmax_row(s + r * Lb, Lb, p.softmax_scale());
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(Lb), 1.0f, s,
                  int(Lb), w + bh * Ld, int(d), 0.0f, out.row(b, h, i0), int(out.stride_row));
    }
  };

  /// Whether forward runs head by head (forward_by_heads): at least as many heads as threads,
  /// so step 2 does not split the keys of a head.
  static bool by_heads(const Plan& pl, int64_t BH) { return BH >= pl.threads; }

  /// At least as many heads as threads: one parallel region, each head's steps 1-3 on one
  /// thread with thread-local buffers (and its step 4 too when n fits one block of query
  /// rows); otherwise step 4 per block of query rows after them. No barrier between the
  /// steps of a head.
  template <class Real>
  void forward_by_heads(const Pass& ps) const {
    const int64_t BH = ps.p.batch * ps.p.heads, qb = ps.qblocks();
    OmpGuard guard;
#pragma omp parallel
    {
      std::unique_ptr<double[]> acc;
      std::unique_ptr<float[]> fbuf;
      std::unique_ptr<Real[]> rbuf;
      float *s = nullptr, *partial = nullptr, *af = nullptr;
      guard.run([&] {
        acc.reset(new double[size_t(ps.d())]);
        const int64_t scores = std::max(ps.step2_floats(), ps.step4_floats());
        fbuf.reset(
            new float[size_t(scores + ps.part() + ps.solve_floats(std::is_same_v<Real, double>))]);
        s = fbuf.get(), partial = s + scores, af = partial + ps.part();
        rbuf.reset(new Real[size_t(ps.solve_reals())]);
      });
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < BH; ++bh)
        guard.run([&] {
          ps.landmarks(bh, acc.get());
          ps.keys(bh, partial, s);  // one task per head (pl.splits = 1)
          ps.solve(bh, partial, rbuf.get(), af);
          if (qb == 1) ps.rows(bh, s);
        });
      if (qb > 1) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < BH * qb; ++t) guard.run([&] { ps.rows(t, s); });
      }
    }
    guard.rethrow();
  }

  /// Fewer heads than threads: step 2 splits the keys of each head into ranges (partial
  /// results in a shared buffer), step 3 runs one head at a time with BLAS using the threads
  /// (the L^3 iteration is the largest piece of work here when L is large), step 4 per block
  /// of query rows.
  template <class Real>
  void forward_split(const Pass& ps) const {
    const int64_t BH = ps.p.batch * ps.p.heads, part = ps.part();
    const Plan& pl = ps.pl;
    std::unique_ptr<float[]> partial(new float[size_t(pl.tasks * part)]);
    OmpGuard guard;
#pragma omp parallel
    {
      // step 1: landmarks
      {
        std::unique_ptr<double[]> acc;
        guard.run([&] { acc.reset(new double[size_t(ps.d())]); });
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < BH; ++bh) guard.run([&] { ps.landmarks(bh, acc.get()); });
      }
      // step 2: softmax(s Q~ K^T) V over each task's key range, online
      {
        std::unique_ptr<float[]> sbuf;
        guard.run([&] { sbuf.reset(new float[size_t(ps.step2_floats())]); });
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < pl.tasks; ++t)
          guard.run([&] { ps.keys(t, partial.get() + t * part, sbuf.get()); });
      }
    }
    guard.rethrow();
    // step 3: merge the key ranges into B, then W = pinv(A) B, head by head
    {
      std::unique_ptr<Real[]> rbuf(new Real[size_t(ps.solve_reals())]);
      std::unique_ptr<float[]> fbuf(
          new float[size_t(ps.solve_floats(std::is_same_v<Real, double>))]);
      for (int64_t bh = 0; bh < BH; ++bh)
        ps.solve(bh, partial.get() + bh * pl.splits * part, rbuf.get(), fbuf.get());
    }
#pragma omp parallel
    {
      // step 4: out = softmax(s Q K~^T) W, per block of query rows
      std::unique_ptr<float[]> sbuf;
      guard.run([&] { sbuf.reset(new float[size_t(ps.step4_floats())]); });
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < BH * ps.qblocks(); ++t) guard.run([&] { ps.rows(t, sbuf.get()); });
    }
    guard.rethrow();
  }

  // Float buffers of backward_head: Q~, K~, their gradients, W, dW (L x d each), row maxima
  // and sums (L), a score tile and its gradient (max(block, chunk) x L each); with
  // pinv_dtype = float32 also the float iteration's Z, work and iterates ((4 + iters) L^2).
  int64_t backward_floats(const Problem& p, int64_t L) const {
    const int64_t tile = std::max({std::min(kBlockQ, p.n), std::min(kChunkK, p.keys()), L});
    return 6 * L * p.dim + 2 * L + 2 * tile * L + (pinv_double_ ? 0 : (4 + iters_) * L * L);
  }
  // Double buffers: A, Z, dA, dZ and the pinv backward's work (10 L^2), the iterates
  // (iters L^2), B, dB (L x d each), the iteration's work (3 L^2).
  int64_t backward_doubles(int64_t L, int64_t d) const { return (13 + iters_) * L * L + 2 * L * d; }

  /// The backward of head (b, h), which has Lb >= 1 landmarks: its inputs, the forward's
  /// quantities it recomputes and their gradients in buffers carved from backward_floats()
  /// floats (fb) and backward_doubles() doubles (db), and the steps of backward_head.
  struct HeadBackward {
    const Nystrom& self;
    const Problem& p;
    const int64_t b, h, n, m, d, L, len, Lb;
    const float scale;
    ConstTensorView q, k, v, dout;
    float *qt, *kt, *dqt, *dkt, *w, *dw, *mx, *sum, *st, *gt;
    float *zf, *workf, *iteratesf;  // float32 iteration
    double *a, *z, *da, *dz, *work, *iterates, *bb, *dbb, *pwork;

    HeadBackward(const Nystrom& self, const Problem& p, const Plan& pl, int64_t b, int64_t h,
                 ConstTensorView q, ConstTensorView k, ConstTensorView v, ConstTensorView dout,
                 float* fb, double* db)
        : self(self),
          p(p),
          b(b),
          h(h),
          n(p.n),
          m(p.keys()),
          d(p.dim),
          L(pl.L),
          len(valid_keys(p, b)),
          Lb(self.landmarks(p, pl, b)),
          scale(p.softmax_scale()),
          q(q),
          k(k),
          v(v),
          dout(dout) {
      qt = fb, kt = qt + L * d, dqt = kt + L * d, dkt = dqt + L * d, w = dkt + L * d;
      dw = w + L * d, mx = dw + L * d, sum = mx + L, st = sum + L;
      const int64_t tile = std::max({std::min(kBlockQ, n), std::min(kChunkK, m), L});
      gt = st + tile * L;
      zf = gt + tile * L, workf = zf + L * L, iteratesf = workf + 3 * L * L;
      a = db, z = a + L * L, da = z + L * L, dz = da + L * L, work = dz + L * L;
      iterates = work + 6 * L * L, bb = iterates + self.iters_ * L * L, dbb = bb + L * d;
      pwork = dbb + L * d;  // 3 L^2
    }

    // Q~, K~ (the landmarks) and zero dQ~, dK~
    void landmarks() {
      std::vector<double> acc(static_cast<size_t>(d));
      segment_means(q.head(b, h), q.stride_row, n, d, Lb, qt, acc.data());
      segment_means(k.head(b, h), k.stride_row, len, d, Lb, kt, acc.data());
      std::fill(dqt, dqt + Lb * d, 0.0f);
      std::fill(dkt, dkt + Lb * d, 0.0f);
    }

    // Pb's scores of the keys [j0, j0 + cols) into st (Lb x cols)
    void pb_scores(int64_t j0, int64_t cols) const {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(Lb), int(cols), int(d), 1.0f, qt,
                  int(d), k.row(b, h, j0), int(k.stride_row), 0.0f, st, int(cols));
    }

    // 1. B = Pb V: the row maxima, then the sums and P V
    void values() {
      std::fill(mx, mx + Lb, -INFINITY);
      for (int64_t j0 = 0; j0 < len; j0 += kChunkK) {
        const int64_t cols = std::min(kChunkK, len - j0);
        pb_scores(j0, cols);
        for (int64_t r = 0; r < Lb; ++r) mx[r] = std::max(mx[r], row_max(st + r * cols, cols));
      }
      std::fill(sum, sum + Lb, 0.0f);
      std::fill(w, w + Lb * d, 0.0f);  // w holds P V until B is formed
      for (int64_t j0 = 0; j0 < len; j0 += kChunkK) {
        const int64_t cols = std::min(kChunkK, len - j0);
        pb_scores(j0, cols);
        for (int64_t r = 0; r < Lb; ++r) sum[r] += exp_sum(st + r * cols, cols, scale, mx[r]);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(Lb), int(d), int(cols), 1.0f, st,
                    int(cols), v.row(b, h, j0), int(v.stride_row), 1.0f, w, int(d));
      }
      for (int64_t r = 0; r < Lb; ++r)
        for (int64_t x = 0; x < d; ++x) bb[r * d + x] = double(w[r * d + x]) / double(sum[r]);
    }

    // 2. A, Z (keeping the iterates), W = Z B
    void solve() {
      const int64_t iters = self.iters_;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(Lb), int(Lb), int(d), 1.0f, qt,
                  int(d), kt, int(d), 0.0f, st, int(Lb));
      for (int64_t r = 0; r < Lb; ++r) softmax_row(st + r * Lb, Lb, scale);
      for (int64_t i = 0; i < Lb * Lb; ++i) a[i] = double(st[i]);
      if (self.pinv_double_) {
        iterative_pinv(Lb, a, iters, z, pwork, iterates);
      } else {
        // the forward's float iteration; its iterates and result, in double, are where the
        // iteration is differentiated
        iterative_pinv(Lb, st, iters, zf, workf, iteratesf);
        std::copy(zf, zf + Lb * Lb, z);
        std::copy(iteratesf, iteratesf + iters * Lb * Lb, iterates);
      }
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(Lb), int(d), int(Lb), 1.0, z,
                  int(Lb), bb, int(d), 0.0, dbb, int(d));
      for (int64_t i = 0; i < Lb * d; ++i) w[i] = float(dbb[i]);
    }

    // 3. out = F W per block of query rows: dQ (through F's scores), dK~, dW
    void rows(TensorView dq) {
      std::fill(dw, dw + Lb * d, 0.0f);
      for (int64_t i0 = 0; i0 < n; i0 += kBlockQ) {
        const int64_t rows = std::min(kBlockQ, n - i0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(Lb), int(d), 1.0f,
                    q.row(b, h, i0), int(q.stride_row), kt, int(d), 0.0f, st, int(Lb));
        for (int64_t r = 0; r < rows; ++r) softmax_row(st + r * Lb, Lb, scale);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(Lb), int(d), 1.0f,
                    dout.row(b, h, i0), int(dout.stride_row), w, int(d), 0.0f, gt, int(Lb));
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(Lb), int(d), int(rows), 1.0f, st,
                    int(Lb), dout.row(b, h, i0), int(dout.stride_row), 1.0f, dw, int(d));
        softmax_backward_rows(st, gt, rows, Lb, scale);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(Lb), 1.0f, gt,
                    int(Lb), kt, int(d), 0.0f, dq.row(b, h, i0), int(dq.stride_row));
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(Lb), int(d), int(rows), 1.0f, gt,
                    int(Lb), q.row(b, h, i0), int(q.stride_row), 1.0f, dkt, int(d));
      }
    }

    // 4. W = Z B: dZ = dW B^T, dB = Z^T dW; then dA through the iteration
    // 5. A = softmax(s Q~ K~^T): dQ~ += dS K~, dK~ += dS^T Q~
    void solve_backward() {
      std::vector<double> dwd(size_t(Lb * d));
      for (int64_t i = 0; i < Lb * d; ++i) dwd[size_t(i)] = double(dw[i]);
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(Lb), int(Lb), int(d), 1.0,
                  dwd.data(), int(d), bb, int(d), 0.0, dz, int(Lb));
      cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(Lb), int(d), int(Lb), 1.0, z,
                  int(Lb), dwd.data(), int(d), 0.0, dbb, int(d));
      iterative_pinv_backward(Lb, a, self.iters_, iterates, dz, da, work);
      for (int64_t i = 0; i < Lb * Lb; ++i) st[i] = float(a[i]), gt[i] = float(da[i]);
      softmax_backward_rows(st, gt, Lb, Lb, scale);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(Lb), int(d), int(Lb), 1.0f, gt,
                  int(Lb), kt, int(d), 1.0f, dqt, int(d));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(Lb), int(d), int(Lb), 1.0f, gt,
                  int(Lb), qt, int(d), 1.0f, dkt, int(d));
    }

    // 6. B = Pb V over chunks of keys: dV = Pb^T dB, dS = Pb o (dB V^T - rowsum(dB o B)) s,
    // dQ~ += dS K, dK = dS^T Q~ (dw holds dB in float, the rows' D in sum)
    void values_backward(TensorView dk, TensorView dv) {
      for (int64_t r = 0; r < Lb; ++r) {
        double D = 0;
        for (int64_t x = 0; x < d; ++x) {
          dw[r * d + x] = float(dbb[r * d + x]);
          D += dbb[r * d + x] * bb[r * d + x];
        }
        gt[r] = float(D);
      }
      std::vector<float> dsum(gt, gt + Lb);
      for (int64_t j0 = 0; j0 < len; j0 += kChunkK) {
        const int64_t cols = std::min(kChunkK, len - j0);
        pb_scores(j0, cols);
        for (int64_t r = 0; r < Lb; ++r) {
          exp_sum(st + r * cols, cols, scale, mx[r]);
          const float inv = 1.0f / sum[r];
          for (int64_t c = 0; c < cols; ++c) st[r * cols + c] *= inv;
        }
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(d), int(Lb), 1.0f, st,
                    int(cols), dw, int(d), 0.0f, dv.row(b, h, j0), int(dv.stride_row));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(Lb), int(cols), int(d), 1.0f, dw,
                    int(d), v.row(b, h, j0), int(v.stride_row), 0.0f, gt, int(cols));
        for (int64_t r = 0; r < Lb; ++r)
          softmax_backward_row(st + r * cols, gt + r * cols, cols, dsum[size_t(r)], scale);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(Lb), int(d), int(cols), 1.0f, gt,
                    int(cols), k.row(b, h, j0), int(k.stride_row), 1.0f, dqt, int(d));
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(d), int(Lb), 1.0f, gt,
                    int(cols), qt, int(d), 0.0f, dk.row(b, h, j0), int(dk.stride_row));
      }
    }

    // 7. the landmark means: each of the `rows` rows of a segment gets its landmark's gradient
    // g / its size
    void spread(const float* g, int64_t rows, TensorView dx) const {
      for (int64_t r = 0; r < Lb; ++r) {
        const int64_t lo = r * rows / Lb, hi = (r + 1) * rows / Lb;
        const float inv = 1.0f / float(hi - lo);
        for (int64_t i = lo; i < hi; ++i) {
          float* o = dx.row(b, h, i);
          for (int64_t x = 0; x < d; ++x) o[x] += g[r * d + x] * inv;
        }
      }
    }
  };

  /// The gradients of head (b, h), every step of the forward differentiated in reverse:
  ///   out = F W, F = softmax(s Q K~^T), W = Z B, Z = pinv(A), A = softmax(s Q~ K~^T),
  ///   B = Pb V, Pb = softmax(s Q~ K^T) over the valid keys, Q~, K~ segment means;
  /// dF = dO W^T, dW = F^T dO; dZ = dW B^T, dB = Z^T dW; dA from the iteration
  /// (iterative_pinv_backward); each softmax's dS = P o (dP - rowsum(dP o P)) s; then the
  /// landmark means spread dQ~ and dK~ over their segments. Padded keys get 0.
  void backward_head(const Problem& p, const Plan& pl, int64_t b, int64_t h, ConstTensorView q,
                     ConstTensorView k, ConstTensorView v, ConstTensorView dout, TensorView dq,
                     TensorView dk, TensorView dv, float* fb, double* db) const {
    const int64_t n = p.n, m = p.keys(), d = p.dim;
    for (int64_t j = 0; j < m; ++j) {
      std::fill_n(dk.row(b, h, j), d, 0.0f);
      std::fill_n(dv.row(b, h, j), d, 0.0f);
    }
    if (landmarks(p, pl, b) == 0) {  // no valid key: the rows are 0
      for (int64_t i = 0; i < n; ++i) std::fill_n(dq.row(b, h, i), d, 0.0f);
      return;
    }
    HeadBackward hb(*this, p, pl, b, h, q, k, v, dout, fb, db);
    hb.landmarks();
    hb.values();
    hb.solve();
    hb.rows(dq);
    hb.solve_backward();
    hb.values_backward(dk, dv);
    hb.spread(hb.dqt, n, dq);
    hb.spread(hb.dkt, hb.len, dk);
  }

  int64_t landmarks_, iters_;
  bool pinv_double_;  // pinv_dtype = float64
};

// Segment means of the rows of x (as segment_means), in double.
oracle::Matrix landmark_means(const oracle::Matrix& x, int64_t L) {
  oracle::Matrix y(L, x.cols);
  for (int64_t r = 0; r < L; ++r) {
    const int64_t lo = r * x.rows / L, hi = (r + 1) * x.rows / L;
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t c = 0; c < x.cols; ++c) y(r, c) += x(i, c);
    for (int64_t c = 0; c < x.cols; ++c) y(r, c) /= double(hi - lo);
  }
  return y;
}

// The iteration of the header comment in double, written out on matrices.
oracle::Matrix pinv_by_iteration(const oracle::Matrix& a, int64_t iters) {
  const int64_t L = a.rows;
  double max_row = 0, max_col = 0;
  for (int64_t i = 0; i < L; ++i) {
    double row = 0, col = 0;
    for (int64_t j = 0; j < L; ++j) row += std::abs(a(i, j)), col += std::abs(a(j, i));
    max_row = std::max(max_row, row), max_col = std::max(max_col, col);
  }
  oracle::Matrix z = oracle::transpose(a);
  for (double& e : z.a) e /= max_row * max_col;
  // c I - x
  auto shifted = [L](double c, oracle::Matrix x) {
    for (double& e : x.a) e = -e;
    for (int64_t i = 0; i < L; ++i) x(i, i) += c;
    return x;
  };
  for (int64_t t = 0; t < iters; ++t) {
    const oracle::Matrix az = oracle::product(a, z);
    const oracle::Matrix inner = shifted(7, az);
    const oracle::Matrix mid = shifted(15, oracle::product(az, inner));
    z = oracle::product(z, shifted(13, oracle::product(az, mid)));
    for (double& e : z.a) e *= 0.25;
  }
  return z;
}

std::vector<double> nystrom_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                   ConstTensorView k, ConstTensorView v) {
  const int64_t iters = var.params().get_int("pinv_iterations");
  const double s = 1.0 / std::sqrt(double(p.dim));
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    // the method on the valid keys of batch element b only: m of them (every key without key
    // padding), L landmarks
    const int64_t m = p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)];
    const int64_t L = std::min({var.params().get_int("landmarks"), p.n, m});
    if (L == 0) return oracle::Matrix(p.n, p.dim);
    auto valid = [&](ConstTensorView x) { return oracle::head(x, b, h, m); };
    const oracle::Matrix qh = oracle::head(q, b, h), kh = valid(k);
    const oracle::Matrix qt = landmark_means(qh, L), kt = landmark_means(kh, L);
    oracle::Matrix a1 = oracle::product_t(qh, kt), a2 = oracle::product_t(qt, kt);
    oracle::softmax_rows(a1, s);
    oracle::softmax_rows(a2, s);
    const oracle::Matrix bv = oracle::softmax_attention(qt, kh, valid(v), s);
    return oracle::product(a1, oracle::product(pinv_by_iteration(a2, iters), bv));
  });
}

double nystrom_tolerance(const Variant& var, const Problem& p, const Workload& wl) {
  // the fewest landmarks of any batch element with a valid key (the longest segments)
  int64_t fewest = std::min({var.params().get_int("landmarks"), p.n, p.keys()});
  for (int64_t len : p.key_lengths)
    if (len > 0) fewest = std::min(fewest, len);
  const double L = double(fewest);
  const double t = double(var.params().get_int("pinv_iterations"));
  const double segment = std::ceil(double(std::max(p.n, p.keys())) / L);
  // a float32 iteration adds its own roundings to the chain: per iteration 4 products with
  // reductions over (at most) the most landmarks, and 4 roundings in series
  const bool f32 = var.params().get_choice("pinv_dtype") == "float32";
  const double most = double(std::min({var.params().get_int("landmarks"), p.n, p.keys()}));
  const double reduction = double(p.keys()) + segment + (f32 ? 4.0 * t * most : 0.0);
  const double steps = 6.0 + (f32 ? 4.0 * t : 0.0);
  return kErrorMargin * std::pow(13.0 / 4.0, t / 2) *
         float32_error(double(p.dim), logit_size(wl), reduction, steps);
}

ATTNBENCH_REGISTER_VARIANT(
    nystrom,
    VariantInfo{
        .name = "nystrom",
        .summary = "Nystrom approximation of softmax through L segment-mean landmarks and an "
                   "iterative pseudo-inverse (Nystromformer)",
        .complexity = "time O((n + m) L d + L^3 iterations), memory O(B H L d + threads L^2)",
        .family = "lowrank",
        .display = "Nyströmformer",
        .paper = "Xiong et al. 2021 (arXiv:2102.03902)",
        .look = {.color = "#ff7f0e", .marker = "s"},
        .params = {ParamSpec::Int("landmarks", 64, 1, int64_t(1) << 16,
                                  "number of landmarks L (segment means; capped at n and m)"),
                   ParamSpec::Int("pinv_iterations", 6, 0, 100,
                                  "iterations of the iterative pseudo-inverse of the L x L matrix"),
                   ParamSpec::Choice("pinv_dtype", "float32", {"float32", "float64"},
                                     "precision of the pseudo-inverse iteration (float32 as the "
                                     "published code; float64 for badly conditioned landmarks "
                                     "or many iterations)")},
        .caps = {.causal = false, .cross = true, .exact = false, .key_padding = true},
        .make =
            [](const ParamValues& pv) {
              return std::make_unique<Nystrom>(pv.get_int("landmarks"),
                                               pv.get_int("pinv_iterations"),
                                               pv.get_choice("pinv_dtype") == "float64");
            },
        .oracle = nystrom_oracle,
        .tolerance = nystrom_tolerance});

}  // namespace
}  // namespace attnbench
