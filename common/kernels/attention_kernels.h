// Tile kernels of the tiled attention engine (common/engines/block_sparse.cpp: its dense case is
// flash, its block-sparse case the pattern variants) and of TileAttention
// (common/kernels/tile_attention.h, for variants that gather their own key blocks). Each caller
// walks, for one query tile, a sequence of key blocks with an online softmax; they differ only in
// which key blocks they visit and how they mask them.
//
// One query tile of `rows` query rows of one (batch, head) goes through
//   begin_tile     pack Q^T, acc = 0, mx = -inf, l = 0;
//   attend_block   for each key block (cols keys), passes 1-4 below;
//   finish_tile    pass 5: out = acc / l (rows that attended no key give exactly 0).
//
// AVX-512 (when the compiler targets it): register-blocked kernels on transposed score tiles.
// The scores are kept transposed, S^T (keys x query rows), so that one 16-float register holds
// one key's scores for 16 consecutive query rows: the row max, the exponentials and the row
// sums are all lane-wise, with no horizontal reductions, and the P V product broadcasts p
// values straight from S^T. Q^T is packed once per tile (d x rows, reused by every key block);
// K and V are read as stored. The running max mx is kept in raw score units and subtracted
// before scaling: P = 2^((S - mx) log2(e)/sqrt(d)) is a subtraction, a product and a
// polynomial exp2 per 16 scores. S - mx <= 0, so no exponential can overflow at any logit
// size (the scale is not folded into Q: rounding q log2(e)/sqrt(d) would add an error to every
// logit; nor into mx: at |S| ~ 1e9 the rounding of mx log2(e)/sqrt(d) alone is past exp2's
// range).
// Per key block:
//   pass 1  S^T = K Q^T: register tile of 6 keys x 64 rows (24 accumulators), k values
//           broadcast from K, block row max on the way out;
//   pass 2  only blocks crossing the causal diagonal or with an element mask: scores the row
//           must not see -> -inf, and the block row max again over what is left;
//   pass 3  mx', correction c = 2^((mx - mx') s), P = 2^((S - mx') s) in place of S, l;
//   pass 4  acc = acc c + P V: register tile of up to 6 rows x 64 features
//           (24 accumulators) summing the block's P V from 0, then one FMA into acc.
//
// Portable (any other target): the same passes with Eigen tile products, and the row max
// and exponentials of common/kernels/softmax.h (8-lane AVX2 loops when the compiler targets AVX2
// with FMA, scalar fast_exp otherwise).
//
// Overflow. With P <= 1, acc can still overflow when v holds values near FLT_MAX (sum_j p_j v_j
// over several keys), although the output, a convex combination of v rows, is finite. That
// shows as a non-finite output (inf never turns finite again), so finish_tile reports it and
// the caller runs the tile again with every p multiplied by safe_pscale(keys) = 2^-e,
// 2^e >= 2 keys: then sum_j p_j <= 1/2 and acc stays within max |v|. The common case pays
// only the check of the output tile. A visible logit that overflows float (q . k = +-inf or
// NaN) cannot be computed in float: it makes its row NaN (an error for the harness), never a
// finite wrong value.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>

#include "common/core/problem.h"
#include "common/kernels/additive_score.h"
#include "common/kernels/bf16.h"
#include "common/kernels/simd.h"
#include "common/kernels/softmax.h"

namespace attnbench::kernels {

constexpr int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/// Causal offset of key block j0 for the query tile starting at row i0: row r of the tile sees
/// the keys c < causal_first(p, i0, j0) + r of the block (bottom-right aligned mask). Without a
/// causal mask, a value past any block.
inline int64_t causal_first(const Problem& p, int64_t i0, int64_t j0) {
  constexpr int64_t kEveryKey = int64_t(1) << 60;
  return p.causal ? i0 + (p.keys() - p.n) + 1 - j0 : kEveryKey;
}

/// The factor every p of a tile is multiplied by when its plain run overflowed (see the note
/// at the top): 2^-e with 2^e >= 2 keys, so that the weights of `keys` keys sum to at most 1/2.
inline float safe_pscale(int64_t keys) {
  return std::ldexp(1.0f, -(int(std::bit_width(uint64_t(std::max<int64_t>(keys, 1)))) + 1));
}

/// The score-tile hook: when a caller passes one, pass 1 takes the tile's raw scores from it
/// instead of Q K^T (the additive score of head (b, h), query rows from i0, keys from j0), and
/// the other passes run unchanged on them; the caller's scale is then the logits' own (1).
struct ScoreHook {
  const AdditiveProjections* additive;
  int64_t b, h, i0, j0;
  /// Row r, key c of the tile at s[r rs + c cs].
  void fill(int64_t rows, int64_t cols, float* s, int64_t rs, int64_t cs) const {
    additive_tile(*additive, b, h, i0, rows, j0, cols, s, rs, cs);
  }
};

/// One 64-byte aligned heap block (its size rounded up to whole 64-byte lines).
class AlignedBuffer {
 public:
  explicit AlignedBuffer(int64_t bytes)
      : p_(std::aligned_alloc(64, size_t(round_up(std::max<int64_t>(bytes, 1), 64)))) {
    if (!p_) throw std::bad_alloc();
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  float* floats() const { return static_cast<float*>(p_); }
  unsigned char* bytes() const { return static_cast<unsigned char*>(p_); }

 private:
  void* p_;
};

/// Bytes of an element-mask tile of rows x cols (row-major, one byte per pair), with the
/// padding the AVX-512 mask pass may read past the last element.
constexpr int64_t mask_tile_bytes(int64_t rows, int64_t cols) {
  return round_up(rows * cols + 4, 64);
}

#ifdef __AVX512F__
// GCC 12 reports its own _mm512_undefined_ps() (the pass-through operand of unmasked
// intrinsics such as _mm512_max_ps) as used uninitialized once inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"

using simd::kLanes;
constexpr int kKeys = 6;         // keys per pass-1 register tile
constexpr int kRowVecs = 4;      // row vectors (16 rows each) per pass-1 register tile
constexpr int64_t kPvCols = 64;  // features per pass-4 register tile (4 vectors)
constexpr float kLog2e = 1.44269504088896341f;

/// Shapes of one thread's working tiles. Every array starts on a 64-byte boundary because
/// bqp and dp are whole vectors.
struct Tiles {
  int64_t bq, bk;  // query rows per tile, keys per block (at most)
  int64_t bqp;     // bq rounded up to whole vectors: leading dimension of Q^T and S^T
  int64_t bkp;     // bk rounded up to whole pass-1 key groups: rows of S^T
  int64_t d, dp;   // head dimension, and d rounded up to whole vectors (row stride of acc)

  Tiles(int64_t bq_, int64_t bk_, int64_t d_)
      : bq(bq_),
        bk(bk_),
        bqp(round_up(bq_, kLanes)),
        bkp(round_up(bk_, kKeys)),
        d(d_),
        dp(round_up(d_, kLanes)) {}
  // Q^T (d x bqp), S^T (bkp x bqp), acc (bqp x dp), and per row mx, l, corr, block max.
  int64_t floats() const { return d * bqp + bkp * bqp + bqp * dp + 4 * bqp; }
  int64_t bytes() const { return round_up(floats() * int64_t(sizeof(float)), 64); }
};

/// One thread's tiles, carved out of a block of Tiles::bytes() (64-byte aligned).
struct Workspace {
  float *qt, *st, *acc, *mx, *l, *corr, *bmax;

  Workspace(const Tiles& tl, float* buf)
      : qt(buf),                    // Q^T, d x bqp
        st(qt + tl.d * tl.bqp),     // S^T then P^T, bkp x bqp
        acc(st + tl.bkp * tl.bqp),  // bqp x dp
        mx(acc + tl.bqp * tl.dp),   // running max (raw scores)
        l(mx + tl.bqp),             // running sum
        corr(l + tl.bqp),           // correction of the last block
        bmax(corr + tl.bqp) {}      // block row max (raw scores)
};

/// Transposes the 16 x 16 block held in r (r[i] = row i) in place: afterwards r[j] holds
/// column j. Three rounds of in-lane and cross-lane shuffles.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved within 128-bit lanes
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4g + e] holds, in 128-bit lane L, element 4L + e of rows 4g .. 4g + 3
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    const __m512 *a = t + 4 * g, *b = t + 4 * g + 2;
    u[4 * g + 0] = _mm512_shuffle_ps(a[0], b[0], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(a[0], b[0], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(a[1], b[1], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(a[1], b[1], 0xEE);
  }
  // column 4L + e gathers lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
  for (int e = 0; e < 4; ++e) {
    const __m512 even_lo = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88);  // lanes 0, 2
    const __m512 odd_lo = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);   // lanes 1, 3
    const __m512 even_hi = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 odd_hi = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xDD);
    r[4 + e] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xDD);
  }
}

/// Starts a query tile of `rows` <= bq query rows (row r at q0 + r ldq): packs Q^T, with the
/// padding rows up to a whole vector 0, and clears acc, mx and l. Q^T is packed by 16 x 16
/// blocks transposed in registers (rows past `rows` and features past d are never read).
inline void begin_tile(const Tiles& tl, const Workspace& w, const float* q0, int64_t ldq,
                       int64_t rows) {
  const int64_t nrv = (rows + kLanes - 1) / kLanes, ld = tl.bqp, d = tl.d;
  for (int64_t rv = 0; rv < nrv; ++rv) {
    const int64_t real = std::min<int64_t>(kLanes, rows - rv * kLanes);
    const float* src = q0 + rv * kLanes * ldq;
    float* dst = w.qt + rv * kLanes;
    for (int64_t x0 = 0; x0 < d; x0 += kLanes) {
      const int64_t width = std::min<int64_t>(kLanes, d - x0);
      const __mmask16 cols = simd::first_lanes(width);
      __m512 blk[kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        blk[i] = i < real ? _mm512_maskz_loadu_ps(cols, src + i * ldq + x0) : _mm512_setzero_ps();
      transpose16(blk);
      for (int64_t j = 0; j < width; ++j) _mm512_storeu_ps(dst + (x0 + j) * ld, blk[j]);
    }
  }
  std::fill(w.acc, w.acc + rows * tl.dp, 0.0f);
  std::fill(w.mx, w.mx + nrv * kLanes, -INFINITY);
  std::fill(w.l, w.l + nrv * kLanes, 0.0f);
}

/// Prefetches `rows` rows of d floats (row r at p + r ld) into L2, for reading or writing.
inline void prefetch_rows(const float* p, int64_t rows, int64_t ld, int64_t d, bool write) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * ld);
    for (int64_t o = 0; o < d * int64_t(sizeof(float)); o += 64) {
      if (write)
        __builtin_prefetch(row + o, 1, 2);
      else
        _mm_prefetch(row + o, _MM_HINT_T1);
    }
  }
}

// Pass 1: S^T[c][r] = k_c . q^T_r for kKeys keys (rows kr[c] of K) and NRV * 16 query rows
// (columns of Q^T, leading dimension ldq), over the whole head dimension. The accumulators
// never leave registers; each step loads NRV vectors of Q^T and broadcasts kKeys k values.
// The block row max bmax is raised over the new scores.
template <int NRV>
inline void scores_tile(const float* qt, int64_t ldq, const float* const* kr, int64_t d, float* st,
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

// Pass 1 over one key block of cols keys (key c at kb + c ldk) and nrv row vectors. Key groups
// past `cols` repeat the block's last key (their scores are computed, never read; the last key
// of a block needing no mask is one every row sees, so the block max stays right, and the mask
// pass recomputes it otherwise). Under a causal mask crossing the block (row r sees the keys
// c < causal_first + r; pass causal_first >= cols otherwise), a key group skips the row vectors
// whose rows see none of its keys: their scores are left as they were, and the mask pass,
// which every such block takes, sets them to -inf.
inline void scores_block(const Tiles& tl, const Workspace& w, int64_t nrv, const float* kb,
                         int64_t ldk, int64_t cols, int64_t causal_first) {
  const int64_t ld = tl.bqp;
  std::fill(w.bmax, w.bmax + nrv * kLanes, -INFINITY);
  for (int64_t g = 0; g < cols; g += kKeys) {
    const float* kr[kKeys];
    for (int c = 0; c < kKeys; ++c) kr[c] = kb + std::min<int64_t>(g + c, cols - 1) * ldk;
    // the first row seeing key g is g - causal_first + 1; the vectors before its own see none
    const int64_t first_rv = std::min(nrv, std::max<int64_t>(0, g - causal_first + 1) / kLanes);
    for (int64_t rv = first_rv; rv < nrv; rv += kRowVecs) {
      const float* qs = w.qt + rv * kLanes;
      float* ss = w.st + g * ld + rv * kLanes;
      float* bm = w.bmax + rv * kLanes;
      switch (std::min<int64_t>(kRowVecs, nrv - rv)) {
        case 1:
          scores_tile<1>(qs, ld, kr, tl.d, ss, ld, bm);
          break;
        case 2:
          scores_tile<2>(qs, ld, kr, tl.d, ss, ld, bm);
          break;
        case 3:
          scores_tile<3>(qs, ld, kr, tl.d, ss, ld, bm);
          break;
        default:
          scores_tile<4>(qs, ld, kr, tl.d, ss, ld, bm);
          break;
      }
    }
  }
}

// Pass 2, for a block that crosses the causal diagonal (kCausal) and/or has an element mask
// (kMask): row r of the tile keeps key c iff c < first + r (kCausal) and
// mask[r * cols + c] != 0 (kMask; mask is rows x cols, readable 3 bytes past its end). The
// other scores become -inf, and the block row max is taken again over what is left (the
// pass-1 max included keys the row must not see). A row left with no key gets max -inf; a row
// whose visible scores are all -inf (overflowed logits) gets NaN.
// The element mask is read by one gather of 4 bytes (4 keys) per 16 rows.
template <bool kCausal, bool kMask>
inline void mask_block(float* st, int64_t lds, int64_t rows, int64_t nrv, int64_t cols,
                       int64_t first, const uint8_t* mask, float* bmax) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t rv = 0; rv < nrv; ++rv) {
    // clamped so that the per-lane counts fit in 32 bits whatever the sizes
    const int64_t base = std::clamp<int64_t>(first + rv * kLanes, -kLanes, cols);
    const __m512i vis = _mm512_add_epi32(_mm512_set1_epi32(int32_t(base)), iota);
    __m512 mx = neg_inf;
    __mmask16 seen = 0;  // rows that keep some key
    if constexpr (!kMask) {
      for (int64_t c = 0; c < cols; ++c) {
        float* s = st + c * lds + rv * kLanes;
        const __mmask16 keep = _mm512_cmpgt_epi32_mask(vis, _mm512_set1_epi32(int32_t(c)));
        const __m512 x = _mm512_mask_mov_ps(neg_inf, keep, _mm512_loadu_ps(s));
        _mm512_storeu_ps(s, x);
        mx = _mm512_max_ps(mx, x);
        seen |= keep;
      }
    } else {
      // lane r of the gather reads bytes c0 .. c0 + 3 of row rv * 16 + r
      const __mmask16 real = simd::first_lanes(rows - rv * kLanes);
      const uint8_t* mrow = mask + rv * kLanes * cols;
      __m512i idx = _mm512_mullo_epi32(iota, _mm512_set1_epi32(int32_t(cols)));
      const __m512i four = _mm512_set1_epi32(4);
      for (int64_t c0 = 0; c0 < cols; c0 += 4) {
        const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, idx, mrow, 1);
        idx = _mm512_add_epi32(idx, four);
        const int64_t n4 = std::min<int64_t>(4, cols - c0);
        for (int64_t u = 0; u < n4; ++u) {
          const int64_t c = c0 + u;
          float* s = st + c * lds + rv * kLanes;
          __mmask16 keep = _mm512_test_epi32_mask(g, _mm512_set1_epi32(int32_t(0xFFu << (8 * u))));
          if constexpr (kCausal)
            keep &= _mm512_cmpgt_epi32_mask(vis, _mm512_set1_epi32(int32_t(c)));
          const __m512 x = _mm512_mask_mov_ps(neg_inf, keep, _mm512_loadu_ps(s));
          _mm512_storeu_ps(s, x);
          mx = _mm512_max_ps(mx, x);
          seen |= keep;
        }
      }
    }
    const __mmask16 lost = seen & _mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ);
    _mm512_storeu_ps(bmax + rv * kLanes, _mm512_mask_mov_ps(mx, lost, _mm512_set1_ps(NAN)));
  }
}

/// Where pass 3 writes the weights: back into S^T, in place (the float32 passes). A sink has
/// pair(c, o, p0, p1) for keys c and c + 1 and last(c, o, p0) for a last odd key, row vector
/// at offset o.
struct InPlaceWeights {
  float* st;
  int64_t lds;
  void pair(int64_t c, int64_t o, __m512 p0, __m512 p1) const {
    _mm512_storeu_ps(st + c * lds + o, p0);
    _mm512_storeu_ps(st + (c + 1) * lds + o, p1);
  }
  void last(int64_t c, int64_t o, __m512 p0) const { _mm512_storeu_ps(st + c * lds + o, p0); }
};

// Pass 3: online-softmax update of 16 rows at a time, in raw score units: the new max
// mx' = max(mx, block max); corr = 2^((mx - mx') s) rescales what was accumulated
// (s = scale = log2(e)/sqrt(d)); the weights P = 2^((x - mx') s) pscale of the scores x of
// S^T go to `sink` (InPlaceWeights: S^T becomes P in place); l = l corr + rowsum P.
// x - mx' <= 0, so P <= pscale whatever the size of the scores, and a row whose max is NaN
// (see mask_block) gets NaN. A row that has seen no visible key yet keeps mx = -inf and is
// shifted by 0 instead, so that its exponentials are 2^-inf = 0 and never NaN. kScaleP:
// multiply P by pscale (a power of two, see safe_pscale), else pscale = 1.
template <bool kScaleP, class Sink>
inline void softmax_update(const float* st, int64_t lds, int64_t nrv, int64_t cols, float scale,
                           float pscale, float* mx, float* l, float* corr, const float* bmax,
                           const Sink& sink) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale),
               ps = _mm512_set1_ps(pscale);
  // 2^((x - shift) s) for 16 scores
  auto weight = [&](__m512 x, __m512 shift) {
    const __m512 p = simd::exp2_nonpos_ps(_mm512_mul_ps(_mm512_sub_ps(x, shift), sc));
    if constexpr (kScaleP)
      return _mm512_mul_ps(p, ps);
    else
      return p;
  };
  for (int64_t rv = 0; rv < nrv; ++rv) {
    const int64_t o = rv * kLanes;
    const __m512 old_mx = _mm512_loadu_ps(mx + o);
    // block max second: a NaN there is kept
    const __m512 new_mx = _mm512_max_ps(old_mx, _mm512_loadu_ps(bmax + o));
    const __m512 shift = _mm512_mask_mov_ps(new_mx, _mm512_cmp_ps_mask(new_mx, neg_inf, _CMP_EQ_OQ),
                                            _mm512_setzero_ps());
    const __m512 cr = simd::exp2_nonpos_ps(_mm512_mul_ps(_mm512_sub_ps(old_mx, shift), sc));
    // two partial sums, so that consecutive keys do not wait on one add chain
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 1 < cols; c += 2) {
      const __m512 p0 = weight(_mm512_loadu_ps(st + c * lds + o), shift);
      const __m512 p1 = weight(_mm512_loadu_ps(st + (c + 1) * lds + o), shift);
      sink.pair(c, o, p0, p1);
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
    }
    if (c < cols) {
      const __m512 p0 = weight(_mm512_loadu_ps(st + c * lds + o), shift);
      sink.last(c, o, p0);
      sum0 = _mm512_add_ps(sum0, p0);
    }
    const __m512 sum = _mm512_add_ps(sum0, sum1);
    _mm512_storeu_ps(l + o, _mm512_fmadd_ps(_mm512_loadu_ps(l + o), cr, sum));
    _mm512_storeu_ps(mx + o, new_mx);
    _mm512_storeu_ps(corr + o, cr);
  }
}

// Between passes 3 and 4 under bf16: the cols x (nrv 16) weights of P^T rounded to
// bfloat16, to nearest even (P is finite and non-negative: no NaN case).
inline void round_tile_bf16(float* pt, int64_t ldp, int64_t nrv, int64_t cols) {
  const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1),
                high = _mm512_set1_epi32(int(0xffff0000u));
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t rv = 0; rv < nrv; ++rv) {
      float* x = pt + c * ldp + rv * kLanes;
      const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x));
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(half, odd)), high);
      _mm512_storeu_ps(x, _mm512_castsi512_ps(r));
    }
}

// Pass 4: acc = acc corr + P V for R rows and NV vectors (16 features each) of acc. P is
// read from S^T (column r of row c is p[r][c], leading dimension ldp), V row by row as
// stored (leading dimension ldv); `tail` masks the features of the last vector, so nothing
// past the end of a V row is read. The R x NV accumulators stay in registers over all keys
// of the block and start from 0: the block's P V is summed on its own and then added to the
// rescaled acc, which keeps the rounding error growing with the block size, not with m.
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
inline PvKernel pv_kernel(int64_t nv, int64_t rows) {
  static constexpr auto k1 = pv_kernels<1>(std::make_integer_sequence<int, kPvRows[1]>{});
  static constexpr auto k2 = pv_kernels<2>(std::make_integer_sequence<int, kPvRows[2]>{});
  static constexpr auto k3 = pv_kernels<3>(std::make_integer_sequence<int, kPvRows[3]>{});
  static constexpr auto k4 = pv_kernels<4>(std::make_integer_sequence<int, kPvRows[4]>{});
  switch (nv) {
    case 1:
      return k1[size_t(rows - 1)];
    case 2:
      return k2[size_t(rows - 1)];
    case 3:
      return k3[size_t(rows - 1)];
    default:
      return k4[size_t(rows - 1)];
  }
}

// Pass 4 over the whole tile: acc = acc corr + P V_blk for `rows` rows, 64 features at a time
// (key c of the block at vb + c ldv). Under a causal mask crossing the block (row r sees the
// keys c < causal_first + r; pass causal_first >= cols otherwise), each register tile of rows
// stops after the last key its last row sees: the p of the keys after it are 0 on all its rows.
inline void pv_block(const Tiles& tl, const Workspace& w, int64_t rows, const float* vb,
                     int64_t ldv, int64_t cols, int64_t causal_first) {
  const int64_t d = tl.d;
  for (int64_t c0 = 0; c0 < d; c0 += kPvCols) {
    const int64_t wd = std::min(kPvCols, d - c0), nv = (wd + kLanes - 1) / kLanes;
    const __mmask16 tail = simd::first_lanes(wd - (nv - 1) * kLanes);
    for (int64_t r0 = 0; r0 < rows; r0 += kPvRows[nv]) {
      const int64_t r = std::min<int64_t>(kPvRows[nv], rows - r0);
      // the keys c < causal_first + r0 + r - 1; with none, the kernel still rescales acc
      const int64_t seen = std::clamp<int64_t>(causal_first + r0 + r - 1, 0, cols);
      pv_kernel(nv, r)(w.st + r0, tl.bqp, vb + c0, ldv, seen, w.acc + r0 * tl.dp + c0, tl.dp,
                       w.corr + r0, tail);
    }
  }
}

// Pass 1 from a score-tile hook: S^T of the tile's rows and cols keys (rows past `rows`, up to
// whole vectors, get 0, as the zero rows of Q^T give in scores_block), and the block row max.
inline void hook_scores(const Tiles& tl, const Workspace& w, int64_t rows, int64_t nrv,
                        int64_t cols, const ScoreHook& hook) {
  const int64_t ld = tl.bqp;
  hook.fill(rows, cols, w.st, 1, ld);
  std::fill(w.bmax, w.bmax + nrv * kLanes, -INFINITY);
  for (int64_t c = 0; c < cols; ++c) {
    float* s = w.st + c * ld;
    std::fill(s + rows, s + nrv * kLanes, 0.0f);
    for (int64_t rv = 0; rv < nrv; ++rv)
      _mm512_storeu_ps(w.bmax + rv * kLanes, _mm512_max_ps(_mm512_loadu_ps(w.bmax + rv * kLanes),
                                                           _mm512_loadu_ps(s + rv * kLanes)));
  }
}

/// Pass 2 of a block every row sees whole (no mask, no causal crossing): a block row max of
/// -inf can only come from overflowed logits (see mask_block), and becomes NaN.
inline void flag_overflowed_max(float* bmax, int64_t nrv) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), nan = _mm512_set1_ps(NAN);
  for (int64_t rv = 0; rv < nrv; ++rv) {
    const __m512 bm = _mm512_loadu_ps(bmax + rv * kLanes);
    _mm512_storeu_ps(bmax + rv * kLanes,
                     _mm512_mask_mov_ps(bm, _mm512_cmp_ps_mask(bm, neg_inf, _CMP_EQ_OQ), nan));
  }
}

/// Between passes 1 and 3 of a block of S^T (leading dimension ld, nrv row vectors, rows
/// real rows, cols keys; bmax the block row max of pass 1): the attention mask's finite bias
/// (rows x cols, raw score units, or null) added, then pass 2 where the block needs it (a
/// causal crossing, causal_first < cols, or an element mask; the mask, never null with a
/// bias, recomputes the block max), else the overflow check. Returns whether the block
/// crosses the causal diagonal.
inline bool bias_and_mask(float* st, int64_t ld, float* bmax, int64_t rows, int64_t nrv,
                          int64_t cols, int64_t causal_first, const uint8_t* mask,
                          const float* bias) {
  if (bias)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) st[c * ld + r] += bias[r * cols + c];
  const bool causal = causal_first < cols;
  if (mask) {
    if (causal)
      mask_block<true, true>(st, ld, rows, nrv, cols, causal_first, mask, bmax);
    else
      mask_block<false, true>(st, ld, rows, nrv, cols, causal_first, mask, bmax);
  } else if (causal) {
    mask_block<true, false>(st, ld, rows, nrv, cols, causal_first, nullptr, bmax);
  } else {
    flag_overflowed_max(bmax, nrv);
  }
  return causal;
}

/// Passes 1-4 for one key block: cols <= bk keys, key c at kb + c ldk and vb + c ldv, for
/// the tile's `rows` query rows. Row r sees the keys c < causal_first + r of the block
/// (causal_first >= cols: every key), and, if mask is not null, only those with
/// mask[r * cols + c] != 0 (mask: rows x cols bytes, mask_tile_bytes(rows, cols) readable).
/// scale = log2(e) / sqrt(d); every p is multiplied by pscale (1, or safe_pscale). bias, if
/// not null (then mask is not null either), is rows x cols finite values in raw score units
/// added to the scores (an attention mask's bias times sqrt(d)).
inline void attend_block(const Tiles& tl, const Workspace& w, int64_t rows, const float* kb,
                         int64_t ldk, const float* vb, int64_t ldv, int64_t cols, float scale,
                         int64_t causal_first, const uint8_t* mask, float pscale = 1.0f,
                         const ScoreHook* hook = nullptr, const float* bias = nullptr,
                         bool round_p = false) {
  const int64_t nrv = (rows + kLanes - 1) / kLanes, ld = tl.bqp;
  // pass 1: S^T = K Q^T, or the hook's scores
  if (hook)
    hook_scores(tl, w, rows, nrv, cols, *hook);
  else
    scores_block(tl, w, nrv, kb, ldk, cols, std::min(causal_first, cols));
  // the attention mask's bias, and pass 2 where the block needs it
  const bool causal = bias_and_mask(w.st, ld, w.bmax, rows, nrv, cols, causal_first, mask, bias);
  // pass 3: new max, correction, P, l
  if (pscale == 1.0f)
    softmax_update<false>(w.st, ld, nrv, cols, scale, 1.0f, w.mx, w.l, w.corr, w.bmax,
                          InPlaceWeights{w.st, ld});
  else
    softmax_update<true>(w.st, ld, nrv, cols, scale, pscale, w.mx, w.l, w.corr, w.bmax,
                         InPlaceWeights{w.st, ld});
  // bf16 (round_p): P rounded to bfloat16 for the product with V, l summed before rounding
  if (round_p) round_tile_bf16(w.st, ld, nrv, cols);
  // pass 4: acc = acc corr + P V
  pv_block(tl, w, rows, vb, ldv, cols, causal ? causal_first : cols);
}

/// Pass 5: out row r (at out0 + r ldo) = acc / l; rows with l = 0 (no key attended) have
/// acc = 0 and give exactly 0. Returns whether every output is finite (if not, see the
/// overflow note at the top).
inline bool finish_tile(const Tiles& tl, const Workspace& w, int64_t rows, float* out0,
                        int64_t ldo) {
  // y - y is 0 for a finite y and NaN for an infinite or NaN one
  __mmask16 bad = 0;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out0 + r * ldo;
    const __m512 inv = _mm512_set1_ps(w.l[r] > 0 ? 1.0f / w.l[r] : 0.0f);
    for (int64_t x = 0; x < tl.d; x += kLanes) {
      const __mmask16 m = simd::first_lanes(tl.d - x);
      const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w.acc + r * tl.dp + x), inv);
      _mm512_mask_storeu_ps(o + x, m, y);
      bad |= _mm512_mask_cmp_ps_mask(m, _mm512_sub_ps(y, y), zero, _CMP_NEQ_UQ);
    }
  }
  return bad == 0;
}

#pragma GCC diagnostic pop
#endif  // __AVX512F__

// ----- the portable passes (Eigen tile products, softmax.h row helpers, natural-base max) -----
namespace portable {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMat, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Working floats of one thread: the score tile, the accumulator, and per row mx and l.
constexpr int64_t floats(int64_t bq, int64_t bk, int64_t d) { return bq * bk + bq * d + 2 * bq; }

/// One thread's tiles (allocated once per call).
struct Workspace {
  RowMat s, acc;
  Eigen::VectorXf mx, l;
  Workspace(int64_t bq, int64_t bk, int64_t d) : s(bq, bk), acc(bq, d), mx(bq), l(bq) {}
};

/// Starts a tile of `rows` query rows: acc = 0, mx = -inf, l = 0.
inline void begin_tile(Workspace& w, int64_t rows) {
  w.acc.topRows(rows).setZero();
  w.mx.head(rows).setConstant(-INFINITY);
  w.l.head(rows).setZero();
}

/// Passes 1-4 for one key block (cols keys at kb / vb with row strides ldk / ldv) and the
/// tile's `rows` query rows (at q0, stride ldq): row r sees the keys c < causal_first + r,
/// and if mask is not null only those with mask[r * cols + c] != 0. scale = 1/sqrt(d); every
/// p is multiplied by pscale (1, or safe_pscale), and bias (rows x cols, raw score units; not
/// null only with a mask) is added to the scores. The max is kept in raw score units and
/// subtracted before scaling, as in the AVX-512 passes.
inline void attend_block(Workspace& w, const float* q0, int64_t ldq, int64_t rows, int64_t d,
                         const float* kb, int64_t ldk, const float* vb, int64_t ldv, int64_t cols,
                         float scale, int64_t causal_first, const uint8_t* mask,
                         float pscale = 1.0f, const ScoreHook* hook = nullptr,
                         const float* bias = nullptr, bool round_p = false) {
  ConstMap qm(q0, rows, d, Eigen::OuterStride<>(ldq));
  ConstMap km(kb, cols, d, Eigen::OuterStride<>(ldk));
  ConstMap vm(vb, cols, d, Eigen::OuterStride<>(ldv));
  auto sb = w.s.topLeftCorner(rows, cols);
  // pass 1: raw scores, or the hook's, plus the attention mask's bias (raw score units)
  if (hook)
    hook->fill(rows, cols, w.s.data(), w.s.cols(), 1);
  else
    sb.noalias() = qm * km.transpose();
  if (bias)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) sb(r, c) += bias[r * cols + c];
  // pass 2-3: per row, mask, new max, exponentials, rescale the running state. The max and
  // the exponentials run through row_max and exp_sum (common/kernels/softmax.h), whose lane-wise
  // loops the compiler vectorises.
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = w.s.row(r).data();
    const int64_t vis = std::clamp<int64_t>(causal_first + r, 0, cols);
    bool seen = vis > 0;  // the row keeps some visible key
    if (const uint8_t* mr = mask ? mask + r * cols : nullptr) {
      uint8_t any = 0;
      for (int64_t c = 0; c < vis; ++c) {
        sr[c] = mr[c] ? sr[c] : -INFINITY;
        any |= mr[c];
      }
      seen = any != 0;
    }
    // the max over the visible keys; NaN if they are all -inf (overflowed logits). row_max
    // passes a NaN score over, but its exponential below is NaN and makes l (and so the
    // row's output) NaN all the same.
    float bm = row_max(sr, vis);
    if (seen && bm == -INFINITY) bm = NAN;
    const float new_mx = std::isnan(bm) ? bm : std::max(w.mx[r], bm);
    if (new_mx == -INFINITY) {  // nothing seen yet in this row
      std::fill(sr, sr + cols, 0.0f);
      continue;
    }
    const float corr = fast_exp((w.mx[r] - new_mx) * scale);
    float sum = exp_sum(sr, vis, scale, new_mx);
    if (pscale != 1.0f) {  // a power of two: the scaled sum is the sum of the scaled terms
      for (int64_t c = 0; c < vis; ++c) sr[c] *= pscale;
      sum *= pscale;
    }
    std::fill(sr + vis, sr + cols, 0.0f);
    w.l[r] = w.l[r] * corr + sum;
    w.mx[r] = new_mx;
    if (corr != 1.0f) w.acc.row(r) *= corr;
  }
  // bf16 (round_p): P rounded to bfloat16 for the product with V, l summed before rounding
  if (round_p)
    for (int64_t r = 0; r < rows; ++r) round_to_bf16(w.s.row(r).data(), cols);
  // pass 4: acc += P V
  w.acc.topRows(rows).noalias() += sb * vm;
}

/// Pass 5: out = acc / l; rows with no key attended stay 0. Returns whether every output is
/// finite.
inline bool finish_tile(const Workspace& w, int64_t rows, int64_t d, float* out0, int64_t ldo) {
  bool finite = true;
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out0 + r * ldo;
    const float inv = w.l[r] > 0 ? 1.0f / w.l[r] : 0.0f;
    for (int64_t c = 0; c < d; ++c) {
      const float y = w.acc(r, c) * inv;
      o[c] = y;
      finite &= std::isfinite(y);
    }
  }
  return finite;
}

}  // namespace portable
}  // namespace attnbench::kernels
