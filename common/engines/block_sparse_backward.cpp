#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/threads.h"
#include "common/engines/block_sparse.h"
#include "common/engines/block_sparse_internal.h"
#include "common/kernels/amx_kernels.h"
#include "common/kernels/attention_kernels.h"
#include "common/kernels/bf16.h"
#include "common/kernels/softmax.h"
#include "common/patterns/mask_bias.h"

namespace attnbench {
namespace {

using namespace block_sparse_detail;

// ----- the backward pass -----
//
// The forward keeps out and each row's log-sum-exp L_i; the backward recomputes, pair by pair
// of (query tile, key block) that the forward visits, with the same KeyWalk (causal skipping,
// key padding, the pattern's element masks, the attention mask's bias and -inf entries):
//   S = Q K^T (+ bias),  P = exp(s S - L) (0 where hidden),  dP = dO V^T,
//   dS = s P ∘ (dP - D),  D_i = sum_c dO_ic O_ic,
//   dV_blk += P^T dO,  dK_blk += dS^T Q,  dQ_tile += dS K.
// Tasks are (batch, head, key block): a task owns its key block's dK and dV rows, summed in
// the thread's tiles and written once. dQ rows are shared by the key blocks of a query tile,
// so each thread sums its dQ contributions into an accumulator of its own (thread 0 into dq
// itself), reduced at the end. Measured at B=1 H=8 n=4096 d=64 on 2 cores against a second
// pass over query tiles recomputing S, P and dS for dQ alone (7 tile products per pair
// instead of 5), the accumulators took 3.1 s against 5.9 s (causal: 1.6 s against 2.6 s, on
// a loaded machine), for (threads - 1) B H n d floats more.
// The five tile products per pair are OpenBLAS sgemm calls (single-threaded inside the
// parallel region), on every target: at B=1 H=8 n=4096 d=64 on 2 Zen 4 cores they took the
// flash backward from 598 ms (Eigen's products) to 497 ms, local (window 256) from 92 to 75 ms.
namespace bwd {

using kernels::portable::RowMat;

/// A query tile that lists a key block: the inverse of SparsePattern::key_blocks.
struct Visit {
  int32_t qb;
  int32_t partial;
};

/// For every head and key block, the query tiles whose key_blocks list it (in increasing
/// order), as one offset table and one array of visits per head.
class Visits {
 public:
  Visits(const Problem& p, const SparsePattern& pat)
      : kblocks_(max_key_blocks(p, pat.block())),
        offsets_(size_t(p.batch * p.heads * (kblocks_ + 1))),
        visits_(size_t(p.batch * p.heads)) {
    const int64_t bs = pat.block(), qblocks = (p.n + bs - 1) / bs, heads = p.batch * p.heads;
    OmpGuard guard;
#pragma omp parallel
    {
      std::vector<KeyBlock> list;
      std::vector<std::pair<int64_t, Visit>> all;  // (key block, visit) of one head
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < heads; ++bh)
        guard.run([&] {
          all.clear();
          for (int64_t qb = 0; qb < qblocks; ++qb) {
            pat.key_blocks(bh / p.heads, bh % p.heads, qb, list);
            for (const KeyBlock& kb : list)
              if (kb.index >= 0 && kb.index < kblocks_)
                all.push_back({kb.index, Visit{int32_t(qb), int32_t(kb.partial)}});
          }
          // counting sort by key block; stable, so each key block's query tiles stay in order
          int64_t* off = offsets_.data() + bh * (kblocks_ + 1);
          std::fill(off, off + kblocks_ + 1, int64_t(0));
          for (const auto& e : all) ++off[e.first + 1];
          for (int64_t i = 0; i < kblocks_; ++i) off[i + 1] += off[i];
          std::vector<Visit>& out = visits_[size_t(bh)];
          out.resize(all.size());
          std::vector<int64_t> next(off, off + kblocks_);
          for (const auto& e : all) out[size_t(next[size_t(e.first)]++)] = e.second;
        });
    }
    guard.rethrow();
  }

  /// The visits of key block kb of head bh (= b H + h).
  std::pair<const Visit*, const Visit*> of(int64_t bh, int64_t kb) const {
    const int64_t* off = offsets_.data() + bh * (kblocks_ + 1);
    const Visit* base = visits_[size_t(bh)].data();
    return {base + off[kb], base + off[kb + 1]};
  }

 private:
  int64_t kblocks_;
  std::vector<int64_t> offsets_;
  std::vector<std::vector<Visit>> visits_;
};

/// One thread's tiles: S then P and dP then dS (bq x bk), the key block's dK and dV sums
/// (bk x d), and the element-mask and bias tiles of KeyWalk.
struct Tiles {
  RowMat s, ds, dk, dv;
  std::vector<uint8_t> mask;
  std::vector<float> bias;
  Tiles(const Problem& p, int64_t bq, int64_t bk, bool masked)
      : s(bq, bk), ds(bq, bk), dk(bk, p.dim), dv(bk, p.dim) {
    if (masked || p.attn_mask) mask.resize(size_t(bq * bk));
    if (p.attn_mask) bias.resize(size_t(bq * bk));
  }
  static double bytes(const Problem& p, int64_t bq, int64_t bk, bool masked) {
    const bool am = p.attn_mask != nullptr;
    return double(2 * bq * bk + 2 * bk * p.dim) * sizeof(float) +
           double(masked || am ? bq * bk : 0) + double(am ? bq * bk * 4 : 0);
  }
};

/// The inputs of one head's rows and keys the pair products read.
struct PairArgs {
  const float *q0, *do0, *k0, *v0;  // first row of the tile (q, dO) and of the block (k, v)
  int64_t ldq, ldo, ldk, ldv;
  const float *lse, *dsum;  // the tile's rows' L_i and D_i
  float* dq0;               // the tile's dQ accumulator rows (null: no dQ), stride lddq
  int64_t lddq;
  const float* mx = nullptr;  // the rows' max if L_i is relative to it (LseView::max)
};

/// One (query tile, key block) pair: rows query rows, cols keys, d features. Row r sees the
/// keys c < causal_first + r of the block, and with a mask only those with
/// mask[r * cols + c] != 0; bias (raw score units, with a mask only) is added to the scores.
/// Adds P^T dO to w.dv, dS^T Q to w.dk (kv: both) and dS K to the dQ rows (a.dq0 not null).
inline void pair_grads(Tiles& w, const PairArgs& a, int64_t rows, int64_t cols, int64_t d,
                       float scale, int64_t causal_first, const uint8_t* mask, const float* bias,
                       bool kv) {
  const int64_t lds = w.s.cols(), ldg = w.ds.cols();
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), int(d), 1.0f, a.q0,
              int(a.ldq), a.k0, int(a.ldk), 0.0f, w.s.data(), int(lds));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), int(d), 1.0f, a.do0,
              int(a.ldo), a.v0, int(a.ldv), 0.0f, w.ds.data(), int(ldg));
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = w.s.data() + r * lds;
    float* gr = w.ds.data() + r * ldg;
    const float L = a.lse[r], D = a.dsum[r];
    // P = exp((s - M) scale - L): M = 0 when L is the whole log-sum-exp
    const float M = a.mx ? a.mx[r] : 0.0f;
    // a row that attended no key (L = -inf) contributes nothing
    const int64_t vis = L == -INFINITY ? 0 : std::clamp<int64_t>(causal_first + r, 0, cols);
    if (mask) {
      const uint8_t* mr = mask + r * cols;
      const float* br = bias ? bias + r * cols : nullptr;
      for (int64_t c = 0; c < vis; ++c) {
        const float x = (sr[c] + (br ? br[c] : 0.0f) - M) * scale - L;
        const float pr = mr[c] ? fast_exp(x) : 0.0f;
        sr[c] = pr;
        gr[c] = pr * (gr[c] - D) * scale;
      }
    } else {
      int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 sv = _mm256_set1_ps(scale), lv = _mm256_set1_ps(L), dv = _mm256_set1_ps(D),
                   mv = _mm256_set1_ps(M);
      for (; c + 8 <= vis; c += 8) {
        const __m256 pr =
            simd::avx2::exp_ps(_mm256_fmsub_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + c), mv), sv, lv));
        _mm256_storeu_ps(sr + c, pr);
        _mm256_storeu_ps(
            gr + c,
            _mm256_mul_ps(_mm256_mul_ps(pr, _mm256_sub_ps(_mm256_loadu_ps(gr + c), dv)), sv));
      }
#endif
      for (; c < vis; ++c) {
        const float pr = fast_exp((sr[c] - M) * scale - L);
        sr[c] = pr;
        gr[c] = pr * (gr[c] - D) * scale;
      }
    }
    std::fill(sr + vis, sr + cols, 0.0f);
    std::fill(gr + vis, gr + cols, 0.0f);
  }
  if (kv) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(d), int(rows), 1.0f,
                w.s.data(), int(lds), a.do0, int(a.ldo), 1.0f, w.dv.data(), int(d));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(d), int(rows), 1.0f,
                w.ds.data(), int(ldg), a.q0, int(a.ldq), 1.0f, w.dk.data(), int(d));
  }
  if (a.dq0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(cols), 1.0f,
                w.ds.data(), int(ldg), a.k0, int(a.ldk), 1.0f, a.dq0, int(a.lddq));
}

/// D_i = sum_c dO_ic O_ic of every row, [B, H, n] contiguous.
std::vector<float> row_dots(const Problem& p, ConstTensorView out, ConstTensorView dout) {
  std::vector<float> dsum(size_t(p.batch * p.heads * p.n));
  const int64_t rows = p.batch * p.heads * p.n, d = p.dim;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t bh = t / p.n, i = t % p.n, b = bh / p.heads, h = bh % p.heads;
    const float *o = out.row(b, h, i), *g = dout.row(b, h, i);
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += o[c] * g[c];
    dsum[size_t(t)] = acc;
  }
  return dsum;
}

template <bool kDense>
void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
         ConstTensorView out, ConstTensorView dout, const LseView& lse, TensorView dq,
         TensorView dk, TensorView dv, int64_t bq, int64_t bk, const SparsePattern* pat) {
  const int64_t n = p.n, m = p.keys(), d = p.dim;
  const int64_t qblocks = (n + bq - 1) / bq, kblocks = (m + bk - 1) / bk;
  const int64_t heads = p.batch * p.heads, tasks = heads * kblocks;
  const float scale = p.softmax_scale();
  // a tile's rows' log-sum-exps are read as consecutive floats
  if (lse.stride_row != 1)
    throw std::logic_error("the engine's backward needs consecutive log-sum-exps (stride_row 1)");
  const std::vector<float> dsum = row_dots(p, out, dout);
  std::optional<Visits> visits;
  if constexpr (!kDense) visits.emplace(p, *pat);
  // per-thread dQ accumulators [B, H, n, d] (thread 0 sums into dq)
  std::vector<std::unique_ptr<float[]>> acc(static_cast<size_t>(team_threads()));

  OmpGuard guard;
#pragma omp parallel
  {
    const int tid = omp_get_thread_num();
    std::optional<Tiles> w;
    std::optional<KeyWalk<kDense>> walk;
    TensorView dqt = dq;  // this thread's dQ accumulator
    guard.run([&] {
      w.emplace(p, std::min(bq, n), std::min(bk, m), !kDense);
      walk.emplace(p, bk, pat, w->mask.data(), w->bias.data());
      if (tid > 0) {
        acc[size_t(tid)] = std::make_unique_for_overwrite<float[]>(size_t(heads * n * d));
        dqt = TensorView(acc[size_t(tid)].get(), p.q_shape());
        std::fill(dqt.data, dqt.data + heads * n * d, 0.0f);
      }
    });
#pragma omp for schedule(static)
    for (int64_t t = 0; t < heads * n; ++t) {
      float* r = dq.row(t / n / p.heads, t / n % p.heads, t % n);
      std::fill(r, r + d, 0.0f);
    }

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t)
      guard.run([&] {
        Tiles& tl = *w;
        const int64_t bh = t / kblocks, kb = t % kblocks, j0 = kb * bk;
        const int64_t b = bh / p.heads, h = bh % p.heads, kcols = std::min(bk, m - j0);
        tl.dk.topRows(kcols).setZero();
        tl.dv.topRows(kcols).setZero();
        auto visit = [&](int64_t qb, bool partial) {
          const int64_t i0 = qb * bq, rows = std::min(bq, n - i0);
          const int64_t kend = p.visible(b, i0 + rows - 1);
          if (j0 >= kend) return;
          int64_t cols;
          const uint8_t* mk;
          const float* bias;
          if (!walk->pair(b, h, i0, rows, kend, j0, partial, cols, mk, bias)) return;
          PairArgs a{
              q.row(b, h, i0),   dout.row(b, h, i0),        k.row(b, h, j0),   v.row(b, h, j0),
              q.stride_row,      dout.stride_row,           k.stride_row,      v.stride_row,
              &lse.at(b, h, i0), dsum.data() + bh * n + i0, dqt.row(b, h, i0), dqt.stride_row};
          if (lse.max) a.mx = &lse.max_at(b, h, i0);
          pair_grads(tl, a, rows, cols, d, scale, kernels::causal_first(p, i0, j0), mk, bias, true);
        };
        if constexpr (kDense) {
          for (int64_t qb = 0; qb < qblocks; ++qb) visit(qb, false);
        } else {
          const auto [first, last] = visits->of(bh, kb);
          for (const Visit* e = first; e != last; ++e) visit(e->qb, e->partial != 0);
        }
        for (int64_t c = 0; c < kcols; ++c) {
          float* kr = dk.row(b, h, j0 + c);
          float* vr = dv.row(b, h, j0 + c);
          for (int64_t x = 0; x < d; ++x) kr[x] = tl.dk(c, x), vr[x] = tl.dv(c, x);
        }
      });

      // dq += every other thread's accumulator
#pragma omp for schedule(static)
    for (int64_t t = 0; t < heads * n; ++t) {
      float* r = dq.row(t / n / p.heads, t / n % p.heads, t % n);
      for (size_t u = 1; u < acc.size(); ++u) {
        if (!acc[u]) continue;
        const float* x = acc[u].get() + t * d;
        for (int64_t c = 0; c < d; ++c) r[c] += x[c];
      }
    }
  }
  guard.rethrow();
}

/// Bytes run() allocates: D, per thread its tiles and (but one) a dQ accumulator, and the
/// visit lists of `listed` (query tile, key block) pairs.
double memory(const Problem& p, int64_t bq, int64_t bk, bool dense, double listed) {
  const int threads = team_threads();
  const double heads = double(p.batch * p.heads), rows = heads * double(p.n);
  const double tiles = Tiles::bytes(p, std::min(bq, p.n), std::min(bk, p.keys()), !dense);
  const double lists =
      dense ? 0.0
            : listed * sizeof(Visit) + heads * double(max_key_blocks(p, bk) + 1) * sizeof(int64_t);
  return rows * sizeof(float) + threads * tiles +
         double(threads - 1) * rows * double(p.dim) * sizeof(float) + lists;
}

}  // namespace bwd

}  // namespace

void dense_attention_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                              ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                              const LseView& lse, TensorView dq, TensorView dk, TensorView dv,
                              int64_t block_q, int64_t block_k) {
  bwd::run<true>(p, q, k, v, out, dout, lse, dq, dk, dv, block_q, block_k, nullptr);
}

void block_sparse_attention_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                                     ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                                     const LseView& lse, const SparsePattern& pat, TensorView dq,
                                     TensorView dk, TensorView dv) {
  bwd::run<false>(p, q, k, v, out, dout, lse, dq, dk, dv, pat.block(), pat.block(), &pat);
}

double dense_attention_backward_memory(const Problem& p, int64_t block_q, int64_t block_k) {
  return bwd::memory(p, block_q, block_k, /*dense=*/true, 0.0);
}

double block_sparse_backward_memory(const Problem& p, int64_t block, double listed_blocks) {
  return bwd::memory(p, block, block, /*dense=*/false, listed_blocks);
}

}  // namespace attnbench
