// The bf16 tile kernels of the tiled attention engine on AMX (Intel Advanced Matrix Extensions:
// eight tile registers of 16 rows x 64 bytes, TDPBF16PS C += A B with A 16 x 32 bfloat16,
// B 32 x 16 bfloat16 in pairs, C 16 x 16 float32): the two products of a tile, S = Q K^T and
// P V, take bfloat16 operands with float32 accumulation, and the softmax stays float32.
//
// The layouts keep the score tile transposed as in the AVX-512 passes (attention_kernels.h),
// S^T (keys x query rows), so that the float32 passes 2 and 3 (mask_block, the online
// softmax) run unchanged on it, 16 query rows per vector:
//   pass 1  S^T = K Q^T: A = 16 keys x 32 features of K (packed bf16, row-major, once per
//           call), B = Q^T in pairs of features (packed per query tile by begin_tile), C a
//           16 x 16 block of S^T stored straight into the score tile;
//   pass 3  the online softmax, writing P^T as bf16 pairs of consecutive keys per query row
//           (the B layout of pass 4) and summing l over the unrounded weights;
//   pass 4  acc^T = acc^T corr + V^T P^T: A = 16 features x 32 keys of V^T (packed bf16 per
//           32-key chunk, once per call), B = the packed P^T, C a 16 x 16 block of acc^T
//           (features x rows), rescaled by corr only when a row's max moved;
//   pass 5  out = acc / l, acc^T transposed back by 16 x 16 blocks.
// Every tile is full (16 x 64 bytes): the query rows of a tile are padded to a multiple of 32
// with zero rows of Q, the features to a multiple of 32 with zeros, and the keys of a block
// to a multiple of 32, whose P pairs are 0 (key blocks must start at a multiple of 32: the
// engine takes this path only for block sizes that are).
//
// A thread must call configure() before its first tile instruction and release() after its
// last; the process must have been granted the tile state (amx_usable, common/kernels/bf16.h).
#pragma once

// (GCC spells the AMX macros __AMX_TILE__ and __AMX_BF16__, clang 14 __AMXTILE__, __AMXBF16__)
#if (defined(__AMX_TILE__) || defined(__AMXTILE__)) &&                            \
    (defined(__AMX_BF16__) || defined(__AMXBF16__)) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__AVX512BW__)
#define ATTNBENCH_AMX_KERNELS 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common/kernels/attention_kernels.h"

namespace attnbench::kernels::amx {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"

constexpr int64_t kTileRows = 16;  // rows of every tile; a C row holds 16 floats
constexpr int64_t kDepth = 32;     // bf16 products per TDPBF16PS row: K depth of one step
constexpr int64_t kPairWords = kTileRows * kTileRows;  // 32-bit words of one B tile

/// Every tile register 16 rows x 64 bytes (palette 1).
inline void configure() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}
inline void release() { _tile_release(); }

/// Shapes of one thread's AMX tiles (every array on a 64-byte boundary).
struct Tiles {
  int64_t bq, bk;  // query rows per tile, keys per block (at most)
  int64_t ld;      // bq rounded up to 32: leading dimension of S^T, P^T pairs and acc^T
  int64_t bkp;     // bk rounded up to 32: rows of S^T
  int64_t d;       // head dimension
  int64_t dk;      // d rounded up to 32: depth of pass 1 (packed K row length)
  int64_t dv;      // d rounded up to 32: rows of acc^T (features of packed V^T)
  Tiles(int64_t bq_, int64_t bk_, int64_t d_)
      : bq(bq_),
        bk(bk_),
        ld(round_up(bq_, 2 * kTileRows)),
        bkp(round_up(bk_, kDepth)),
        d(d_),
        dk(round_up(d_, kDepth)),
        dv(round_up(d_, kDepth)) {}
  // Q^T pairs (dk/2 x ld words), S^T (bkp x ld), P^T pairs (bkp/2 x ld words), acc^T (dv x
  // ld), and per row mx, l, corr, block max
  int64_t floats() const { return dk / 2 * ld + bkp * ld + bkp / 2 * ld + dv * ld + 4 * ld; }
  int64_t bytes() const { return round_up(floats() * int64_t(sizeof(float)), 64); }
};

/// One thread's tiles, carved out of a block of Tiles::bytes() (64-byte aligned). The pass-3
/// and pass-2 members have the names of kernels::Workspace (write_lse reads mx and l).
struct Workspace {
  uint32_t* qv;  // Q^T as feature pairs: [dk/32][ld/16] B tiles of 16 pair rows x 16 rows
  float* st;     // S^T, bkp x ld
  uint32_t* pv;  // P^T as key pairs, bkp/2 x ld words
  float *acc, *mx, *l, *corr, *bmax;
  Workspace(const Tiles& tl, float* buf)
      : qv(reinterpret_cast<uint32_t*>(buf)),
        st(buf + tl.dk / 2 * tl.ld),
        pv(reinterpret_cast<uint32_t*>(st + tl.bkp * tl.ld)),
        acc(st + tl.bkp * tl.ld + tl.bkp / 2 * tl.ld),
        mx(acc + tl.dv * tl.ld),
        l(mx + tl.ld),
        corr(l + tl.ld),
        bmax(corr + tl.ld) {}
};

/// 32 floats (a at index 0..15, b at 16..31) as 32 bf16, rounded to nearest even, in order.
inline __m512i bf16_32(__m512 a, __m512 b) { return __m512i(_mm512_cvtne2ps_pbh(b, a)); }

/// 16 pairs (bf16(a_i), bf16(b_i)) as 32-bit words, a_i in the low half: the pair layout of B.
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, bf16_32(a, b));
}

/// Packs K of one head for pass 1: keys x dk bf16, row j the bf16 of key j (rows from m up to
/// `keys`, and features past d, 0). k0: key 0, row stride ldk.
inline void pack_keys(const float* k0, int64_t ldk, int64_t m, int64_t d, int64_t dk, int64_t keys,
                      uint16_t* dst) {
  for (int64_t j = 0; j < keys; ++j) {
    uint16_t* row = dst + j * dk;
    for (int64_t x = 0; x < dk; x += kDepth) {
      __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
      if (j < m) {
        a = _mm512_maskz_loadu_ps(simd::first_lanes(d - x), k0 + j * ldk + x);
        b = _mm512_maskz_loadu_ps(simd::first_lanes(d - x - kLanes), k0 + j * ldk + x + kLanes);
      }
      _mm512_storeu_si512(row + x, bf16_32(a, b));
    }
  }
}

/// Packs V of one head for pass 4: per chunk of 32 keys, dv rows (features) of 32 bf16 keys,
/// element (key j, feature f) at ((j / 32) dv + f) 32 + j % 32 (keys from m up to `keys`, and
/// features past d, 0). v0: key 0, row stride ldv; keys a multiple of 32.
inline void pack_values(const float* v0, int64_t ldv, int64_t m, int64_t d, int64_t dv,
                        int64_t keys, uint16_t* dst) {
  for (int64_t j0 = 0; j0 < keys; j0 += kDepth) {
    uint16_t* chunk = dst + j0 * dv;
    for (int64_t f0 = 0; f0 < dv; f0 += kLanes) {
      const __mmask16 cols = simd::first_lanes(d - f0);
      __m512 lo[kLanes], hi[kLanes];  // keys j0 .. j0 + 15 and j0 + 16 .. j0 + 31
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t a = j0 + i, b = j0 + kLanes + i;
        lo[i] = a < m ? _mm512_maskz_loadu_ps(cols, v0 + a * ldv + f0) : _mm512_setzero_ps();
        hi[i] = b < m ? _mm512_maskz_loadu_ps(cols, v0 + b * ldv + f0) : _mm512_setzero_ps();
      }
      transpose16(lo);  // lo[f]: feature f0 + f of keys j0 .. j0 + 15
      transpose16(hi);
      for (int64_t f = 0; f < kLanes; ++f)
        _mm512_storeu_si512(chunk + (f0 + f) * kDepth, bf16_32(lo[f], hi[f]));
    }
  }
}

/// Starts a query tile of `rows` <= bq query rows (row r at q0 + r ldq): packs Q^T as bf16
/// feature pairs (rows up to ld and features up to dk zero), clears acc^T, mx and l.
inline void begin_tile(const Tiles& tl, const Workspace& w, const float* q0, int64_t ldq,
                       int64_t rows) {
  const int64_t groups = tl.ld / kTileRows;
  for (int64_t rg = 0; rg < groups; ++rg) {
    const int64_t real = std::clamp<int64_t>(rows - rg * kTileRows, 0, kTileRows);
    for (int64_t x = 0; x < tl.dk; x += kDepth) {
      const __mmask16 lo = simd::first_lanes(tl.d - x), hi = simd::first_lanes(tl.d - x - kLanes);
      __m512 blk[kLanes];  // row i: its 16 feature pairs x .. x + 31
      for (int64_t i = 0; i < kLanes; ++i) {
        const float* src = q0 + (rg * kTileRows + i) * ldq + x;
        blk[i] = i < real ? _mm512_castsi512_ps(bf16_32(_mm512_maskz_loadu_ps(lo, src),
                                                        _mm512_maskz_loadu_ps(hi, src + kLanes)))
                          : _mm512_setzero_ps();
      }
      transpose16(blk);  // blk[t]: pair t of rows 0 .. 15
      uint32_t* dst = w.qv + (x / kDepth * groups + rg) * kPairWords;
      for (int64_t t = 0; t < kLanes; ++t)
        _mm512_storeu_ps(reinterpret_cast<float*>(dst + t * kTileRows), blk[t]);
    }
  }
  std::fill(w.acc, w.acc + tl.dv * tl.ld, 0.0f);
  std::fill(w.mx, w.mx + tl.ld, -INFINITY);
  std::fill(w.l, w.l + tl.ld, 0.0f);
}

/// Pass 1: S^T (keys 0 .. keys32 - 1 of the block, keys32 a multiple of 32) for row groups
/// 0 .. groups - 1 (groups even) from packed K (key 0 of the block at kb, row length dk), and
/// the block row max over the first `cols` keys.
inline void scores_block(const Tiles& tl, const Workspace& w, int64_t groups, const uint16_t* kb,
                         int64_t keys32, int64_t cols) {
  const int64_t ld = tl.ld, all = tl.ld / kTileRows, kstride = tl.dk * 2;
  const int64_t ldb = ld * int64_t(sizeof(float));
  for (int64_t g = 0; g < keys32; g += 2 * kTileRows) {
    for (int64_t rg = 0; rg < groups; rg += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t x = 0; x < tl.dk; x += kDepth) {
        const uint16_t* a = kb + g * tl.dk + x;
        const uint32_t* b = w.qv + (x / kDepth * all + rg) * kPairWords;
        _tile_loadd(4, a, kstride);
        _tile_loadd(5, a + kTileRows * tl.dk, kstride);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + kPairWords, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* s = w.st + g * ld + rg * kTileRows;
      _tile_stored(0, s, ldb);
      _tile_stored(1, s + kTileRows, ldb);
      _tile_stored(2, s + kTileRows * ld, ldb);
      _tile_stored(3, s + kTileRows * ld + kTileRows, ldb);
    }
  }
  // four independent maxima per row vector: one chain would wait on each max's latency
  for (int64_t rv = 0; rv < groups; ++rv) {
    const float* col = w.st + rv * kLanes;
    __m512 mx[4];
    for (__m512& x : mx) x = _mm512_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + 4 <= cols; c += 4)
      for (int u = 0; u < 4; ++u) mx[u] = _mm512_max_ps(mx[u], _mm512_loadu_ps(col + (c + u) * ld));
    for (; c < cols; ++c) mx[0] = _mm512_max_ps(mx[0], _mm512_loadu_ps(col + c * ld));
    _mm512_storeu_ps(w.bmax + rv * kLanes,
                     _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3])));
  }
}

/// Where pass 3 writes the weights on AMX: P^T as bf16 pairs of keys (c, c + 1) per row
/// (the B layout of pass 4), word row c / 2 of pv (leading dimension ld); a last odd key
/// pairs with 0.
struct PairedWeights {
  uint32_t* pv;
  int64_t ld;
  void pair(int64_t c, int64_t o, __m512 p0, __m512 p1) const {
    _mm512_storeu_si512(pv + c / 2 * ld + o, bf16_pairs(p0, p1));
  }
  void last(int64_t c, int64_t o, __m512 p0) const {
    _mm512_storeu_si512(pv + c / 2 * ld + o, bf16_pairs(p0, _mm512_setzero_ps()));
  }
};

/// Pass 3: kernels::softmax_update into PairedWeights, then the key pairs past cols, up to
/// keys32 / 2, set to 0. Returns whether some row's max moved (corr != 1).
template <bool kScaleP>
inline bool softmax_pack(const float* st, int64_t ld, int64_t groups, int64_t cols, int64_t keys32,
                         float scale, float pscale, float* mx, float* l, float* corr,
                         const float* bmax, uint32_t* pv) {
  softmax_update<kScaleP>(st, ld, groups, cols, scale, pscale, mx, l, corr, bmax,
                          PairedWeights{pv, ld});
  const __m512 one = _mm512_set1_ps(1.0f);
  __mmask16 moved = 0;
  for (int64_t rv = 0; rv < groups; ++rv) {
    const int64_t o = rv * kLanes;
    for (int64_t c = round_up(cols, 2); c < keys32; c += 2)
      _mm512_storeu_si512(pv + c / 2 * ld + o, _mm512_setzero_si512());
    moved |= _mm512_cmp_ps_mask(_mm512_loadu_ps(corr + o), one, _CMP_NEQ_UQ);
  }
  return moved != 0;
}

/// Pass 4: acc^T = acc^T corr + V^T P^T over keys32 keys (packed V^T of the block at vb) for
/// row groups 0 .. groups - 1; the rescaling is skipped when no row's max moved.
inline void pv_block(const Tiles& tl, const Workspace& w, int64_t groups, const uint16_t* vb,
                     int64_t keys32, bool rescale) {
  const int64_t ld = tl.ld, ldb = ld * int64_t(sizeof(float));
  if (rescale)
    for (int64_t f = 0; f < tl.dv; ++f)
      for (int64_t rv = 0; rv < groups; ++rv) {
        float* a = w.acc + f * ld + rv * kLanes;
        _mm512_storeu_ps(a,
                         _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(w.corr + rv * kLanes)));
      }
  for (int64_t f0 = 0; f0 < tl.dv; f0 += 2 * kTileRows)
    for (int64_t rg = 0; rg < groups; rg += 2) {
      float* c = w.acc + f0 * ld + rg * kTileRows;
      _tile_loadd(0, c, ldb);
      _tile_loadd(1, c + kTileRows, ldb);
      _tile_loadd(2, c + kTileRows * ld, ldb);
      _tile_loadd(3, c + kTileRows * ld + kTileRows, ldb);
      for (int64_t k0 = 0; k0 < keys32; k0 += kDepth) {
        const uint16_t* a = vb + (k0 * tl.dv + f0 * kDepth);
        const uint32_t* b = w.pv + k0 / 2 * ld + rg * kTileRows;
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + kTileRows * kDepth, 64);
        _tile_loadd(6, b, ldb);
        _tile_loadd(7, b + kTileRows, ldb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, ldb);
      _tile_stored(1, c + kTileRows, ldb);
      _tile_stored(2, c + kTileRows * ld, ldb);
      _tile_stored(3, c + kTileRows * ld + kTileRows, ldb);
    }
}

/// Passes 1-4 for one key block: cols <= bk keys from packed K (kb: the block's first key)
/// and packed V^T (vb: the block's first 32-key chunk); the rest as kernels::attend_block
/// (causal_first, mask, pscale, bias; no score hook).
inline void attend_block(const Tiles& tl, const Workspace& w, int64_t rows, const uint16_t* kb,
                         const uint16_t* vb, int64_t cols, float scale, int64_t causal_first,
                         const uint8_t* mask, float pscale, const float* bias) {
  const int64_t ld = tl.ld, keys32 = round_up(cols, kDepth);
  const int64_t groups = round_up(rows, 2 * kTileRows) / kTileRows;
  scores_block(tl, w, groups, kb, keys32, cols);
  bias_and_mask(w.st, ld, w.bmax, rows, groups, cols, causal_first, mask, bias);
  const bool moved = pscale == 1.0f ? softmax_pack<false>(w.st, ld, groups, cols, keys32, scale,
                                                          1.0f, w.mx, w.l, w.corr, w.bmax, w.pv)
                                    : softmax_pack<true>(w.st, ld, groups, cols, keys32, scale,
                                                         pscale, w.mx, w.l, w.corr, w.bmax, w.pv);
  pv_block(tl, w, groups, vb, keys32, moved);
}

/// Pass 5: out row r (at out0 + r ldo) = acc^T column r / l_r, 0 for rows with l = 0.
/// Returns whether every output is finite (as kernels::finish_tile).
inline bool finish_tile(const Tiles& tl, const Workspace& w, int64_t rows, float* out0,
                        int64_t ldo) {
  __mmask16 bad = 0;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t rv = 0; rv * kLanes < rows; ++rv) {
    const int64_t real = std::min<int64_t>(kLanes, rows - rv * kLanes);
    const __m512 lv = _mm512_loadu_ps(w.l + rv * kLanes);
    const __m512 inv =
        _mm512_maskz_div_ps(_mm512_cmp_ps_mask(lv, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f), lv);
    for (int64_t f0 = 0; f0 < tl.d; f0 += kLanes) {
      __m512 blk[kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        blk[i] = _mm512_mul_ps(_mm512_loadu_ps(w.acc + (f0 + i) * tl.ld + rv * kLanes), inv);
      transpose16(blk);  // blk[r]: row r's features f0 .. f0 + 15
      const __mmask16 m = simd::first_lanes(tl.d - f0);
      for (int64_t r = 0; r < real; ++r) {
        _mm512_mask_storeu_ps(out0 + (rv * kLanes + r) * ldo + f0, m, blk[r]);
        bad |= _mm512_mask_cmp_ps_mask(m, _mm512_sub_ps(blk[r], blk[r]), zero, _CMP_NEQ_UQ);
      }
    }
  }
  return bad == 0;
}

#pragma GCC diagnostic pop

}  // namespace attnbench::kernels::amx

#endif
