// flash: exact softmax attention, tiled with an online softmax; the n x m score matrix is
// never stored.
//
//   out_i = sum_j softmax_j(q_i . k_j / sqrt(d) + mask_ij) v_j
//
// Each task is one query tile (block_q rows of one batch item and head). It walks the key
// blocks (block_k keys) up to the last key visible to its last row, keeping per row a running
// max mx and a running sum l:
//   S = Q_blk K_blk^T / sqrt(d);  mx' = max(mx, rowmax S);  P = exp(S - mx')
//   l = l exp(mx - mx') + rowsum P;  acc = acc exp(mx - mx') + P V_blk
// and finally out = acc / l (rows with no visible key give 0).
//
// Time O(B H n m d); memory O(threads block_q (block_k + d)).
// Dao et al. 2022, "FlashAttention"; Milakov & Gimelshein 2018 for the online softmax.
//
// Two implementations of the same recurrence:
//
// * AVX-512 (when the compiler targets it): hand-written register-blocked kernels. The scores
//   are kept transposed, S^T (keys x query rows), so that one 16-float register holds one
//   key's scores for 16 consecutive query rows: the row max, the exponentials and the row
//   sums are all lane-wise, with no horizontal reductions, and the P V product broadcasts
//   p values straight from S^T. Q^T is packed once per task (d x block_q, reused by every
//   key block); K and V are read as stored. The running max is kept in base 2, so that
//   P = 2^(S log2(e)/sqrt(d) - mx) is one FMA and a polynomial exp2 per 16 scores (the scale
//   is not folded into Q: rounding q log2(e)/sqrt(d) would add an error to every logit).
//   Per key block:
//     pass 1  S^T = K Q^T: register tile of 6 keys x 64 rows (24 accumulators), k values
//             broadcast from K, block row max on the way out;
//     pass 2  blocks crossing the causal diagonal only: keys past the diagonal -> -inf,
//             and the block row max again over the visible keys;
//     pass 3  mx', correction 2^(mx - mx'), P = 2^(S - mx') in place of S, l;
//     pass 4  acc = acc 2^(mx - mx') + P V: register tile of up to 6 rows x 64 features
//             (24 accumulators) summing the block's P V from 0, then one FMA into acc;
//   and after the last block, pass 5: out = acc / l. Key blocks wholly past the diagonal
//   are never visited; tasks are scheduled dynamically, heaviest causal tiles first.
//   At B=1 H=8 n=4096 d=64 on 2 Zen 4 cores this runs at about 205 GFLOP/s, as fast as
//   OpenBLAS sgemm on the same cores (the Eigen version of the same passes: about 75).
// * Portable: the same passes with Eigen tile products and the scalar fast_exp.
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <new>
#include <utility>
#include <vector>

#include "common/registry.h"
#include "common/simd.h"
#include "common/softmax.h"

namespace attnbench {
namespace {

#ifdef __AVX512F__
// GCC 12 reports its own _mm512_undefined_ps() (the pass-through operand of unmasked
// intrinsics such as _mm512_max_ps) as used uninitialized once inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace fast {

using simd::kLanes;
constexpr int kKeys = 6;         // keys per pass-1 register tile
constexpr int kRowVecs = 4;      // row vectors (16 rows each) per pass-1 register tile
constexpr int64_t kPvCols = 64;  // features per pass-4 register tile (4 vectors)
constexpr float kLog2e = 1.44269504088896341f;

constexpr int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/// Shapes of one thread's working tiles. Every array starts on a 64-byte boundary because
/// bqp and dp are whole vectors.
struct Tiles {
  int64_t bq, bk;  // query rows per tile, keys per block (the parameters)
  int64_t bqp;     // bq rounded up to whole vectors: leading dimension of Q^T and S^T
  int64_t bkp;     // bk rounded up to whole pass-1 key groups: rows of S^T
  int64_t d, dp;   // head dimension, and d rounded up to whole vectors (row stride of acc)

  Tiles(int64_t bq_, int64_t bk_, int64_t d_)
      : bq(bq_), bk(bk_), bqp(round_up(bq_, kLanes)), bkp(round_up(bk_, kKeys)), d(d_),
        dp(round_up(d_, kLanes)) {}
  // Q^T (d x bqp), S^T (bkp x bqp), acc (bqp x dp), and per row mx, l, corr, block max.
  int64_t floats() const { return d * bqp + bkp * bqp + bqp * dp + 4 * bqp; }
  int64_t bytes() const { return round_up(floats() * int64_t(sizeof(float)), 64); }
};

/// One 64-byte aligned block of floats.
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t bytes)
      : p_(static_cast<float*>(std::aligned_alloc(64, size_t(bytes)))) {
    if (!p_) throw std::bad_alloc();
  }
  ~AlignedFloats() { std::free(p_); }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  float* data() const { return p_; }

 private:
  float* p_;
};

// Pass 1: S^T[c][r] = k_c . q^T_r for kKeys keys (rows kr[c] of K) and NRV * 16 query rows
// (columns of Q^T, leading dimension ldq), over the whole head dimension. The accumulators
// never leave registers; each step loads NRV vectors of Q^T and broadcasts kKeys k values.
// The block row max bmax is raised over the new scores.
template <int NRV>
void scores_tile(const float* qt, int64_t ldq, const float* const* kr, int64_t d, float* st,
                 int64_t lds, float* bmax) {
  __m512 acc[kKeys][NRV];
#pragma GCC unroll 8
  for (int c = 0; c < kKeys; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < NRV; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t t = 0; t < d; ++t) {
    __m512 qv[NRV];
#pragma GCC unroll 4
    for (int r = 0; r < NRV; ++r) qv[r] = _mm512_loadu_ps(qt + t * ldq + r * kLanes);
#pragma GCC unroll 8
    for (int c = 0; c < kKeys; ++c) {
      const __m512 kc = _mm512_set1_ps(kr[c][t]);
#pragma GCC unroll 4
      for (int r = 0; r < NRV; ++r) acc[c][r] = _mm512_fmadd_ps(qv[r], kc, acc[c][r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NRV; ++r) {
    __m512 mx = _mm512_loadu_ps(bmax + r * kLanes);
#pragma GCC unroll 8
    for (int c = 0; c < kKeys; ++c) {
      _mm512_storeu_ps(st + c * lds + r * kLanes, acc[c][r]);
      mx = _mm512_max_ps(mx, acc[c][r]);
    }
    _mm512_storeu_ps(bmax + r * kLanes, mx);
  }
}

// Pass 2, for a block that crosses the causal diagonal: row r of the tile sees the keys
// c < first + r of this block; the others become -inf, and the block row max is taken again
// over what is left (the pass-1 max included keys the row must not see).
void mask_block(float* st, int64_t lds, int64_t nrv, int64_t cols, int64_t first, float* bmax) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t rv = 0; rv < nrv; ++rv) {
    // clamped so that the per-lane counts fit in 32 bits whatever the sizes
    const int64_t base = std::clamp<int64_t>(first + rv * kLanes, -kLanes, cols);
    const __m512i vis = _mm512_add_epi32(_mm512_set1_epi32(int32_t(base)), iota);
    __m512 mx = neg_inf;
    for (int64_t c = 0; c < cols; ++c) {
      float* s = st + c * lds + rv * kLanes;
      const __mmask16 keep = _mm512_cmpgt_epi32_mask(vis, _mm512_set1_epi32(int32_t(c)));
      const __m512 x = _mm512_mask_mov_ps(neg_inf, keep, _mm512_loadu_ps(s));
      _mm512_storeu_ps(s, x);
      mx = _mm512_max_ps(mx, x);
    }
    _mm512_storeu_ps(bmax + rv * kLanes, mx);
  }
}

// Pass 3: online-softmax update of 16 rows at a time, in base 2: with x = S scale
// (scale = log2(e)/sqrt(d)), the new max mx' = max(mx, block max scale); corr = 2^(mx - mx')
// rescales what was accumulated; S^T becomes P = 2^(x - mx') in place (one FMA computes
// x - mx' with a single rounding); l = l corr + rowsum P. A row that has seen no visible key
// yet keeps mx = -inf and is shifted by 0 instead, so that its exponentials are 2^-inf = 0
// and never NaN. scale > 0, so the max of the raw scores gives the max of x.
void softmax_update(float* st, int64_t lds, int64_t nrv, int64_t cols, float scale, float* mx,
                    float* l, float* corr, const float* bmax) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
  for (int64_t rv = 0; rv < nrv; ++rv) {
    const int64_t o = rv * kLanes;
    const __m512 old_mx = _mm512_loadu_ps(mx + o);
    const __m512 new_mx = _mm512_max_ps(old_mx, _mm512_mul_ps(_mm512_loadu_ps(bmax + o), sc));
    const __m512 shift = _mm512_mask_mov_ps(
        new_mx, _mm512_cmp_ps_mask(new_mx, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
    const __m512 cr = simd::exp2_ps(_mm512_sub_ps(old_mx, shift));
    // two partial sums, so that consecutive keys do not wait on one add chain
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 1 < cols; c += 2) {
      float* s0 = st + c * lds + o;
      float* s1 = s0 + lds;
      const __m512 p0 = simd::exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s0), sc, shift));
      const __m512 p1 = simd::exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s1), sc, shift));
      _mm512_storeu_ps(s0, p0);
      _mm512_storeu_ps(s1, p1);
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
    }
    if (c < cols) {
      float* s0 = st + c * lds + o;
      const __m512 p0 = simd::exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s0), sc, shift));
      _mm512_storeu_ps(s0, p0);
      sum0 = _mm512_add_ps(sum0, p0);
    }
    const __m512 sum = _mm512_add_ps(sum0, sum1);
    _mm512_storeu_ps(l + o, _mm512_fmadd_ps(_mm512_loadu_ps(l + o), cr, sum));
    _mm512_storeu_ps(mx + o, new_mx);
    _mm512_storeu_ps(corr + o, cr);
  }
}

// Pass 4: acc = acc corr + P V for R rows and NV vectors (16 features each) of acc. P is
// read from S^T (column r of row c is p[r][c], leading dimension ldp), V row by row as
// stored (leading dimension ldv); `tail` masks the features of the last vector, so nothing
// past the end of a V row is read. The R x NV accumulators stay in registers over all keys
// of the block and start from 0: the block's P V is summed on its own and then added to the
// rescaled acc, which keeps the rounding error growing with block_k, not with m.
template <int R, int NV>
void pv_tile(const float* pt, int64_t ldp, const float* v, int64_t ldv, int64_t cols,
             float* acc_mem, int64_t lda, const float* corr, __mmask16 tail) {
  __m512 acc[R][NV];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; ++c) {
    const float* vr = v + c * ldv;
    __m512 vv[NV];
#pragma GCC unroll 4
    for (int j = 0; j + 1 < NV; ++j) vv[j] = _mm512_loadu_ps(vr + j * kLanes);
    vv[NV - 1] = _mm512_maskz_loadu_ps(tail, vr + (NV - 1) * kLanes);
    const float* pr = pt + c * ldp;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 pb = _mm512_set1_ps(pr[r]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(pb, vv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      float* a = acc_mem + r * lda + j * kLanes;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), cr, acc[r][j]));
    }
  }
}

using PvKernel = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                          const float*, __mmask16);
// Rows per pass-4 register tile by vectors per row: at most 24 accumulators, leaving
// registers for the v vectors and the broadcast.
constexpr int kPvRows[5] = {0, 12, 12, 8, 6};

template <int NV, int... R>
constexpr std::array<PvKernel, sizeof...(R)> pv_kernels(std::integer_sequence<int, R...>) {
  return {&pv_tile<R + 1, NV>...};
}

/// The pass-4 kernel for `nv` vectors per row and `rows` <= kPvRows[nv] rows.
PvKernel pv_kernel(int64_t nv, int64_t rows) {
  static constexpr auto k1 = pv_kernels<1>(std::make_integer_sequence<int, kPvRows[1]>{});
  static constexpr auto k2 = pv_kernels<2>(std::make_integer_sequence<int, kPvRows[2]>{});
  static constexpr auto k3 = pv_kernels<3>(std::make_integer_sequence<int, kPvRows[3]>{});
  static constexpr auto k4 = pv_kernels<4>(std::make_integer_sequence<int, kPvRows[4]>{});
  switch (nv) {
    case 1: return k1[size_t(rows - 1)];
    case 2: return k2[size_t(rows - 1)];
    case 3: return k3[size_t(rows - 1)];
    default: return k4[size_t(rows - 1)];
  }
}

void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
             TensorView out, int64_t block_q, int64_t block_k) {
  const Tiles tl(block_q, block_k, p.dim);
  const int64_t n = p.n, m = p.keys(), d = p.dim, bq = tl.bq, bk = tl.bk, ld = tl.bqp;
  const int64_t qblocks = (n + bq - 1) / bq, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale() * kLog2e;  // applied in pass 3: base-2 logits

#pragma omp parallel
  {
    // per-thread tiles, allocated once per forward pass
    AlignedFloats buf(tl.bytes());
    float* const qt = buf.data();          // Q^T, d x ld
    float* const st = qt + d * ld;         // S^T then P^T, bkp x ld
    float* const acc = st + tl.bkp * ld;   // bqp x dp
    float* const mx = acc + tl.bqp * tl.dp;
    float* const l = mx + ld;
    float* const corr = l + ld;
    float* const bmax = corr + ld;

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      // within a head, the last query tiles first: under a causal mask they see the most keys
      const int64_t bh = t / qblocks, i0 = (qblocks - 1 - t % qblocks) * bq;
      const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
      const int64_t nrv = (rows + kLanes - 1) / kLanes;  // row vectors holding real rows
      // keys visible to some row of the tile (the last row sees the most), and to all rows
      const int64_t kend = p.visible(i0 + rows - 1), kfull = p.visible(i0);

      // pack Q^T; the padding rows up to a whole vector are 0
      for (int64_t r = 0; r < nrv * kLanes; ++r) {
        const float* src = r < rows ? q.row(b, h, i0 + r) : nullptr;
        for (int64_t x = 0; x < d; ++x) qt[x * ld + r] = src ? src[x] : 0.0f;
      }
      std::fill(acc, acc + rows * tl.dp, 0.0f);
      std::fill(mx, mx + nrv * kLanes, -INFINITY);
      std::fill(l, l + nrv * kLanes, 0.0f);

      for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        const int64_t cols = std::min(bk, kend - j0);
        // pass 1: S^T = K Q^T, key groups past `cols` repeat the block's last key (its
        // scores are computed, never read; a full block's last key is one every row sees,
        // so the block max stays right)
        std::fill(bmax, bmax + nrv * kLanes, -INFINITY);
        for (int64_t g = 0; g < cols; g += kKeys) {
          const float* kr[kKeys];
          for (int c = 0; c < kKeys; ++c) kr[c] = k.row(b, h, j0 + std::min(g + c, cols - 1));
          for (int64_t rv = 0; rv < nrv; rv += kRowVecs) {
            const float* qs = qt + rv * kLanes;
            float* ss = st + g * ld + rv * kLanes;
            float* bm = bmax + rv * kLanes;
            switch (std::min<int64_t>(kRowVecs, nrv - rv)) {
              case 1: scores_tile<1>(qs, ld, kr, d, ss, ld, bm); break;
              case 2: scores_tile<2>(qs, ld, kr, d, ss, ld, bm); break;
              case 3: scores_tile<3>(qs, ld, kr, d, ss, ld, bm); break;
              default: scores_tile<4>(qs, ld, kr, d, ss, ld, bm); break;
            }
          }
        }
        // pass 2: only blocks reaching past the keys every row sees need a mask
        if (j0 + cols > kfull) mask_block(st, ld, nrv, cols, i0 + (m - n) + 1 - j0, bmax);
        // pass 3: new max, correction, P, l
        softmax_update(st, ld, nrv, cols, scale, mx, l, corr, bmax);
        // pass 4: acc = acc corr + P V, 64 features at a time
        const float* vb = v.row(b, h, j0);
        for (int64_t c0 = 0; c0 < d; c0 += kPvCols) {
          const int64_t w = std::min(kPvCols, d - c0), nv = (w + kLanes - 1) / kLanes;
          const __mmask16 tail = simd::first_lanes(w - (nv - 1) * kLanes);
          for (int64_t r0 = 0; r0 < rows; r0 += kPvRows[nv]) {
            const int64_t r = std::min<int64_t>(kPvRows[nv], rows - r0);
            pv_kernel(nv, r)(st + r0, ld, vb + c0, v.stride_row, cols, acc + r0 * tl.dp + c0,
                             tl.dp, corr + r0, tail);
          }
        }
      }
      // pass 5: normalise; rows with no visible key have l = 0 and acc = 0, and give 0
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out.row(b, h, i0 + r);
        const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
        for (int64_t x = 0; x < d; ++x) o[x] = acc[r * tl.dp + x] * inv;
      }
    }
  }
}

}  // namespace fast
#pragma GCC diagnostic pop
#endif  // __AVX512F__

namespace portable {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMat, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Working floats of one thread: the score tile, the accumulator, and per row mx and l.
[[maybe_unused]] int64_t floats(int64_t bq, int64_t bk, int64_t d) { return bq * bk + bq * d + 2 * bq; }

[[maybe_unused]] void forward(const Problem& p, ConstTensorView q, ConstTensorView k,
                              ConstTensorView v, TensorView out, int64_t bq, int64_t bk) {
  const int64_t n = p.n, d = p.dim;
  const int64_t qblocks = (n + bq - 1) / bq, tasks = p.batch * p.heads * qblocks;
  const float scale = p.softmax_scale();

#pragma omp parallel
  {
    // per-thread tiles, allocated once per forward pass
    RowMat s(bq, bk), acc(bq, d);
    std::vector<float> mx(static_cast<size_t>(bq)), l(static_cast<size_t>(bq));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t bh = t / qblocks, i0 = (qblocks - 1 - t % qblocks) * bq;
      const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
      // keys visible to some row of this block: the last row sees the most
      const int64_t kend = p.visible(i0 + rows - 1);
      ConstMap qb(q.row(b, h, i0), rows, d, Eigen::OuterStride<>(q.stride_row));
      acc.topRows(rows).setZero();
      std::fill(mx.begin(), mx.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        const int64_t cols = std::min(bk, kend - j0);
        ConstMap kb(k.row(b, h, j0), cols, d, Eigen::OuterStride<>(k.stride_row));
        ConstMap vb(v.row(b, h, j0), cols, d, Eigen::OuterStride<>(v.stride_row));
        auto sb = s.topLeftCorner(rows, cols);
        // pass 1: raw scores
        sb.noalias() = qb * kb.transpose();
        // pass 2-3: per row, mask, new max, exponentials, rescale the running state
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s.row(r).data();
          const int64_t vis = std::clamp<int64_t>(p.visible(i0 + r) - j0, 0, cols);
          float bm = -INFINITY;
          for (int64_t c = 0; c < vis; ++c) bm = std::fmax(bm, sr[c]);
          const float new_mx = std::fmax(mx[size_t(r)], bm * scale);
          if (new_mx == -INFINITY) {  // nothing visible yet in this row
            std::fill(sr, sr + cols, 0.0f);
            continue;
          }
          const float corr = fast_exp(mx[size_t(r)] - new_mx);
          float sum = 0.0f;
          for (int64_t c = 0; c < vis; ++c) {
            sr[c] = fast_exp(sr[c] * scale - new_mx);
            sum += sr[c];
          }
          std::fill(sr + vis, sr + cols, 0.0f);
          l[size_t(r)] = l[size_t(r)] * corr + sum;
          mx[size_t(r)] = new_mx;
          if (corr != 1.0f) acc.row(r) *= corr;
        }
        // pass 4: acc += P V
        acc.topRows(rows).noalias() += sb * vb;
      }
      // pass 5: normalise; rows with no visible key stay 0
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out.row(b, h, i0 + r);
        const float inv = l[size_t(r)] > 0 ? 1.0f / l[size_t(r)] : 0.0f;
        for (int64_t c = 0; c < d; ++c) o[c] = acc(r, c) * inv;
      }
    }
  }
}

}  // namespace portable

class Flash final : public Variant {
 public:
  Flash(int64_t bq, int64_t bk) : bq_(bq), bk_(bk) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
#ifdef __AVX512F__
    fast::forward(p, q, k, v, out, bq_, bk_);
#else
    portable::forward(p, q, k, v, out, bq_, bk_);
#endif
  }

  double flops(const Problem& p) const override {
    // QK^T and PV over the visible pairs (whole key blocks past the diagonal are skipped)
    return 4.0 * double(p.batch * p.heads) * p.visible_pairs() * double(p.dim);
  }

  double memory_estimate(const Problem& p) const override {
#ifdef __AVX512F__
    const double per_thread = double(fast::Tiles(bq_, bk_, p.dim).bytes());
#else
    const double per_thread = double(portable::floats(bq_, bk_, p.dim)) * sizeof(float);
#endif
    const int threads = p.threads > 0 ? p.threads : omp_get_max_threads();
    return per_thread * threads;
  }

 private:
  int64_t bq_, bk_;
};

ATTNBENCH_REGISTER_VARIANT(
    flash,
    VariantInfo{
        .name = "flash",
        .summary = "exact softmax attention, tiled with an online softmax, n x m never stored",
        .complexity = "time O(n m d), memory O(threads block_q (block_k + d))",
        .params = {ParamSpec::Int("block_q", 64, 1, 4096,
                                  "query rows per tile (multiples of 64 use the full kernels)"),
                   ParamSpec::Int("block_k", 256, 1, 65536, "keys per tile")},
        .caps = {.causal = true, .cross = true},
        .make = [](const ParamValues& pv) {
          return std::make_unique<Flash>(pv.get_int("block_q"), pv.get_int("block_k"));
        }});

}  // namespace
}  // namespace attnbench
