// linformer: softmax attention over k projected keys and values (Wang et al. 2020,
// "Linformer: Self-Attention with Linear Complexity", arXiv:2006.04768).
//
//   out = softmax(s Q (E K)^T) (F V),   s = 1/sqrt(d),   E, F in R^{k x m}
//
// E and F are untrained random projections (JL style), entries N(0, 1/k), drawn per head
// from the problem seed (the same E, F for every batch item of a head, as learned weights
// would be); share_kv sets F = E. They do not approximate softmax attention in expectation:
// the error against exact attention is a measurement, not a bound (it falls as k grows).
//
// A forward pass without prepare() generates the projections as it goes, 256 columns at a
// time, so they never occupy k x m memory; their cost (k m normals per head, or 2 k m without
// share_kv, about a third of the pass on 2 Zen 4 cores at every n) is part of its time but
// not of flops(). E and F depend on (seed, head, k, column) alone, so prepare() generates
// them once per problem when they fit in kPrepareBudget (H m k floats, twice without
// share_kv): forward() then reads them, the harness reports that time as prepare_s, and the
// notes say so and how many bytes are held. Above the budget (m > 4096 at the defaults,
// H = 8) every pass generates them. The recipe (see projection_columns):
//   stream   RandomStream(seed, projection_stream(h, f)), id from the head index only
//   column j the splitmix64 sequence seeded by key_j = stream.bits(j): pair t (rows 2t and
//            2t + 1) takes the 64 bits b = mix64(key_j + t 0x9e3779b97f4a7c15)
//   entry    Box-Muller on b: u1 = ((b >> 40) + 1) 2^-24 in (0, 1], u2 = (b & 0xffffff) 2^-24,
//            z = sqrt(-2 ln u1) (cos, sin)(2 pi u2) for rows (2t, 2t + 1), E[r][j] = z / sqrt(k)
//            in float with polynomial ln/sin/cos; AVX-512, AVX2 and scalar code give the same
//            bits.
//
// Steps, per head h:
//   1. EK = E K and FV = F V (k x d each, every batch item), as GEMMs over chunks of the m key
//      columns, each chunk of E (and F) generated just before its GEMM;
//   2. per block of query rows: S = Q_blk EK^T (rows x k), row softmax with scale s,
//      out_blk = S FV.
// Key padding (Problem::key_lengths): padded keys are absent. Batch element b projects only
// its L_b valid keys and values, as if m were L_b: EK = E[:, :L_b] K[:L_b], FV = F[:, :L_b]
// V[:L_b], with E and F the same entries as without padding (column j is drawn from key
// position j alone), so a padded element computes exactly what the unpadded problem of its
// valid keys does (columns past the longest L_b are not drawn). L_b = 0 leaves nothing to
// attend: its rows output 0.
// Oracle: the formula in double with the same E and F (projection_columns).
// Tolerance (the float32 error model of common/reference/oracle.h): E K and F V are reductions over
// the m keys, and their rows have norm sqrt(m / k) times a key's, so the logits q.(EK)_r / sqrt(d)
// are sqrt(m / k) times larger than softmax attention's and carry the rounding of both the
// projection (m terms) and the dot product (d terms); then the softmax over k and the reduction
// over k rows of F V.
// Time O(B H (n + m) k d) (+ O(H k m) random normals); memory O(B H k d + threads k (chunk +
// block)).
// Backward: forward_train keeps EK and FV (B H 2 k d floats); the backward recomputes each
// query block's P = softmax(s Q EK^T) from them and runs softmax attention's backward over
// the k projected rows (dQ, dEK, dFV), then dK = E^T dEK and dV = F^T dFV over the valid keys,
// E and F generated again (or read from prepare()). E and F are constants of the backward,
// unless given: then dE_h = sum_b dEK_{b,h} K_{b,h}^T and dF_h = sum_b dFV_{b,h} V_{b,h}^T
// (backward_inputs; with share_kv E gets both). Not causal: the projection mixes all keys, so no
// causal form exists without changing the method.
#include "variants/linformer.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel_for.h"
#include "common/core/prepared.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/kernels/softmax.h"
#include "common/reference/oracle.h"

namespace attnbench {
namespace linformer {

uint64_t projection_stream(int64_t head, bool f) {
  // "LINE" / "LINF" in the high bits keeps these apart from the input generators' streams
  return (uint64_t(f ? 0x4c494e46 : 0x4c494e45) << 32) + uint64_t(head);
}

namespace {

// Box-Muller on 64 random bits, written twice with the same IEEE operations in the same order
// (explicit fma where there is one, correctly rounded sqrt), so the scalar, AVX-512 and AVX2
// paths give bit-identical numbers:
//   u1 = ((b >> 40) + 1) 2^-24 in (0, 1],  u2 = (b & 0xffffff) 2^-24 in [0, 1)
//   radius = sqrt(-2 ln u1), ln by Cephes' logf (frexp, one conditional halving, degree 9
//   polynomial; about 1 ulp); the angle 2 pi u2 = x + q pi/2 with x in [-pi/4, pi/4] and
//   Cephes' sinf/cosf polynomials on x; (zc, zs) = radius (cos, sin)(2 pi u2).
constexpr float kLogP[9] = {7.0376836292e-2f,  -1.1514610310e-1f, 1.1676998740e-1f,
                            -1.2420140846e-1f, 1.4249322787e-1f,  -1.6668057665e-1f,
                            2.0000714765e-1f,  -2.4999993993e-1f, 3.3333331174e-1f};
constexpr float kSinP[3] = {-1.9515295891e-4f, 8.3321608736e-3f, -1.6666654611e-1f};
constexpr float kCosP[3] = {2.443315711809948e-5f, -1.388731625493765e-3f, 4.166664568298827e-2f};
constexpr float kSqrtHalf = 0.707106781186547524f, kTwoPi = 6.28318530717958648f;

inline void normal_pair(uint64_t b, float& zc, float& zs) {
  const float u1 = float(int32_t(b >> 40) + 1) * 0x1.0p-24f;
  const float u2 = float(int32_t(b & 0xffffff)) * 0x1.0p-24f;
  // ln u1
  const int32_t bits = std::bit_cast<int32_t>(u1);
  float e = float((bits >> 23) - 126);                                  // u1 = mant 2^e
  float mant = std::bit_cast<float>((bits & 0x007fffff) | 0x3f000000);  // [0.5, 1)
  const bool low = mant < kSqrtHalf;
  e = low ? e - 1.0f : e;
  mant = low ? (mant + mant) - 1.0f : mant - 1.0f;
  const float z = mant * mant;
  float y = kLogP[0];
  for (int i = 1; i < 9; ++i) y = std::fma(y, mant, kLogP[i]);
  y = (y * mant) * z;
  y = std::fma(-2.12194440e-4f, e, y);
  y = std::fma(-0.5f, z, y);
  const float ln = std::fma(0.693359375f, e, mant + y);
  const float radius = std::sqrt(-2.0f * ln);
  // sin and cos of 2 pi u2
  const int32_t q = int32_t(4.0f * u2 + 0.5f);
  const float x = (u2 - 0.25f * float(q)) * kTwoPi;
  const float x2 = x * x;
  float ps = std::fma(x2, kSinP[0], kSinP[1]);
  ps = std::fma(x2, ps, kSinP[2]);
  const float sn = std::fma(x * x2, ps, x);
  float pc = std::fma(x2, kCosP[0], kCosP[1]);
  pc = std::fma(x2, pc, kCosP[2]);
  const float cs = std::fma(x2 * x2, pc, std::fma(-0.5f, x2, 1.0f));
  const bool odd = q & 1;
  const float c0 = odd ? sn : cs, s0 = odd ? cs : sn;
  const int32_t qm = q & 3;
  zc = radius * ((qm == 1 || qm == 2) ? -c0 : c0);
  zs = radius * (qm >= 2 ? -s0 : s0);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
constexpr int64_t kLanes = 16;

// mix64 (common/core/random.h) on 8 lanes.
inline __m512i mix64_x8(__m512i x) {
  x = _mm512_add_epi64(x, _mm512_set1_epi64(int64_t(0x9e3779b97f4a7c15ULL)));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 30)),
                         _mm512_set1_epi64(int64_t(0xbf58476d1ce4e5b9ULL)));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 27)),
                         _mm512_set1_epi64(int64_t(0x94d049bb133111ebULL)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
}

// normal_pair for the 16 bit patterns in lo (pairs 0-7) and hi (pairs 8-15).
inline void normal_pairs_x16(__m512i lo, __m512i hi, __m512& zc, __m512& zs) {
  auto join = [](__m512i a, __m512i b) {  // 2 x 8 int64 (values < 2^24) -> 16 int32
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(a)),
                              _mm512_cvtepi64_epi32(b), 1);
  };
  const __m512i mask24 = _mm512_set1_epi64(0xffffff);
  const __m512i hi24 = join(_mm512_srli_epi64(lo, 40), _mm512_srli_epi64(hi, 40));
  const __m512i lo24 = join(_mm512_and_si512(lo, mask24), _mm512_and_si512(hi, mask24));
  const __m512 scale24 = _mm512_set1_ps(0x1.0p-24f);
  const __m512 u1 =
      _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(hi24, _mm512_set1_epi32(1))), scale24);
  const __m512 u2 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo24), scale24);
  // ln u1
  const __m512i bits = _mm512_castps_si512(u1);
  __m512 e =
      _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srai_epi32(bits, 23), _mm512_set1_epi32(126)));
  __m512 mant = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x007fffff)), _mm512_set1_epi32(0x3f000000)));
  const __mmask16 low = _mm512_cmp_ps_mask(mant, _mm512_set1_ps(kSqrtHalf), _CMP_LT_OQ);
  const __m512 one = _mm512_set1_ps(1.0f);
  e = _mm512_mask_sub_ps(e, low, e, one);
  mant = _mm512_mask_blend_ps(low, _mm512_sub_ps(mant, one),
                              _mm512_sub_ps(_mm512_add_ps(mant, mant), one));
  const __m512 z = _mm512_mul_ps(mant, mant);
  __m512 y = _mm512_set1_ps(kLogP[0]);
  for (int i = 1; i < 9; ++i) y = _mm512_fmadd_ps(y, mant, _mm512_set1_ps(kLogP[i]));
  y = _mm512_mul_ps(_mm512_mul_ps(y, mant), z);
  y = _mm512_fmadd_ps(_mm512_set1_ps(-2.12194440e-4f), e, y);
  y = _mm512_fmadd_ps(_mm512_set1_ps(-0.5f), z, y);
  const __m512 ln = _mm512_fmadd_ps(_mm512_set1_ps(0.693359375f), e, _mm512_add_ps(mant, y));
  const __m512 radius = _mm512_sqrt_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), ln));
  // sin and cos of 2 pi u2
  const __m512i q = _mm512_cvttps_epi32(
      _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(4.0f), u2), _mm512_set1_ps(0.5f)));
  const __m512 x =
      _mm512_mul_ps(_mm512_sub_ps(u2, _mm512_mul_ps(_mm512_set1_ps(0.25f), _mm512_cvtepi32_ps(q))),
                    _mm512_set1_ps(kTwoPi));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 ps = _mm512_fmadd_ps(x2, _mm512_set1_ps(kSinP[0]), _mm512_set1_ps(kSinP[1]));
  ps = _mm512_fmadd_ps(x2, ps, _mm512_set1_ps(kSinP[2]));
  const __m512 sn = _mm512_fmadd_ps(_mm512_mul_ps(x, x2), ps, x);
  __m512 pc = _mm512_fmadd_ps(x2, _mm512_set1_ps(kCosP[0]), _mm512_set1_ps(kCosP[1]));
  pc = _mm512_fmadd_ps(x2, pc, _mm512_set1_ps(kCosP[2]));
  const __m512 cs =
      _mm512_fmadd_ps(_mm512_mul_ps(x2, x2), pc, _mm512_fmadd_ps(_mm512_set1_ps(-0.5f), x2, one));
  const __mmask16 odd = _mm512_test_epi32_mask(q, _mm512_set1_epi32(1));
  const __m512 c0 = _mm512_mask_blend_ps(odd, cs, sn), s0 = _mm512_mask_blend_ps(odd, sn, cs);
  const __m512i qm = _mm512_and_si512(q, _mm512_set1_epi32(3));
  const __mmask16 neg_c = _mm512_cmpeq_epi32_mask(qm, _mm512_set1_epi32(1)) |
                          _mm512_cmpeq_epi32_mask(qm, _mm512_set1_epi32(2));
  const __mmask16 neg_s = _mm512_cmpge_epi32_mask(qm, _mm512_set1_epi32(2));
  const __m512 sign = _mm512_set1_ps(-0.0f);
  zc = _mm512_mul_ps(radius, _mm512_mask_xor_ps(c0, neg_c, c0, sign));
  zs = _mm512_mul_ps(radius, _mm512_mask_xor_ps(s0, neg_s, s0, sign));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;

// The low 64 bits of a b on 4 lanes, b = (b_hi << 32) + low 32 bits.
inline __m256i mullo64_x4(__m256i a, __m256i b, __m256i b_hi) {
  const __m256i a_hi = _mm256_srli_epi64(a, 32);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(a, b_hi), _mm256_mul_epu32(a_hi, b));
  return _mm256_add_epi64(_mm256_mul_epu32(a, b), _mm256_slli_epi64(cross, 32));
}

// mix64 (common/core/random.h) on 4 lanes.
inline __m256i mix64_x4(__m256i x) {
  constexpr uint64_t kM1 = 0xbf58476d1ce4e5b9ULL, kM2 = 0x94d049bb133111ebULL;
  x = _mm256_add_epi64(x, _mm256_set1_epi64x(int64_t(0x9e3779b97f4a7c15ULL)));
  x = mullo64_x4(_mm256_xor_si256(x, _mm256_srli_epi64(x, 30)), _mm256_set1_epi64x(int64_t(kM1)),
                 _mm256_set1_epi64x(int64_t(kM1 >> 32)));
  x = mullo64_x4(_mm256_xor_si256(x, _mm256_srli_epi64(x, 27)), _mm256_set1_epi64x(int64_t(kM2)),
                 _mm256_set1_epi64x(int64_t(kM2 >> 32)));
  return _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
}

// normal_pair for the 8 bit patterns in lo (pairs 0-3) and hi (pairs 4-7).
inline void normal_pairs_x8(__m256i lo, __m256i hi, __m256& zc, __m256& zs) {
  auto join = [](__m256i a, __m256i b) {  // 2 x 4 int64 (values < 2^24) -> 8 int32
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    return _mm256_blend_epi32(_mm256_permutevar8x32_epi32(a, even),
                              _mm256_permutevar8x32_epi32(b, even), 0xf0);
  };
  const __m256i mask24 = _mm256_set1_epi64x(0xffffff);
  const __m256i hi24 = join(_mm256_srli_epi64(lo, 40), _mm256_srli_epi64(hi, 40));
  const __m256i lo24 = join(_mm256_and_si256(lo, mask24), _mm256_and_si256(hi, mask24));
  const __m256 scale24 = _mm256_set1_ps(0x1.0p-24f);
  const __m256 u1 =
      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(hi24, _mm256_set1_epi32(1))), scale24);
  const __m256 u2 = _mm256_mul_ps(_mm256_cvtepi32_ps(lo24), scale24);
  // ln u1
  const __m256i bits = _mm256_castps_si256(u1);
  __m256 e =
      _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srai_epi32(bits, 23), _mm256_set1_epi32(126)));
  __m256 mant = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f000000)));
  const __m256 low = _mm256_cmp_ps(mant, _mm256_set1_ps(kSqrtHalf), _CMP_LT_OQ);
  const __m256 one = _mm256_set1_ps(1.0f);
  e = _mm256_blendv_ps(e, _mm256_sub_ps(e, one), low);
  mant = _mm256_blendv_ps(_mm256_sub_ps(mant, one), _mm256_sub_ps(_mm256_add_ps(mant, mant), one),
                          low);
  const __m256 z = _mm256_mul_ps(mant, mant);
  __m256 y = _mm256_set1_ps(kLogP[0]);
  for (int i = 1; i < 9; ++i) y = _mm256_fmadd_ps(y, mant, _mm256_set1_ps(kLogP[i]));
  y = _mm256_mul_ps(_mm256_mul_ps(y, mant), z);
  y = _mm256_fmadd_ps(_mm256_set1_ps(-2.12194440e-4f), e, y);
  y = _mm256_fmadd_ps(_mm256_set1_ps(-0.5f), z, y);
  const __m256 ln = _mm256_fmadd_ps(_mm256_set1_ps(0.693359375f), e, _mm256_add_ps(mant, y));
  const __m256 radius = _mm256_sqrt_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f), ln));
  // sin and cos of 2 pi u2
  const __m256i q = _mm256_cvttps_epi32(
      _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(4.0f), u2), _mm256_set1_ps(0.5f)));
  const __m256 x =
      _mm256_mul_ps(_mm256_sub_ps(u2, _mm256_mul_ps(_mm256_set1_ps(0.25f), _mm256_cvtepi32_ps(q))),
                    _mm256_set1_ps(kTwoPi));
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 ps = _mm256_fmadd_ps(x2, _mm256_set1_ps(kSinP[0]), _mm256_set1_ps(kSinP[1]));
  ps = _mm256_fmadd_ps(x2, ps, _mm256_set1_ps(kSinP[2]));
  const __m256 sn = _mm256_fmadd_ps(_mm256_mul_ps(x, x2), ps, x);
  __m256 pc = _mm256_fmadd_ps(x2, _mm256_set1_ps(kCosP[0]), _mm256_set1_ps(kCosP[1]));
  pc = _mm256_fmadd_ps(x2, pc, _mm256_set1_ps(kCosP[2]));
  const __m256 cs =
      _mm256_fmadd_ps(_mm256_mul_ps(x2, x2), pc, _mm256_fmadd_ps(_mm256_set1_ps(-0.5f), x2, one));
  const __m256i one_i = _mm256_set1_epi32(1), two_i = _mm256_set1_epi32(2);
  const __m256 odd = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(q, one_i), one_i));
  const __m256 c0 = _mm256_blendv_ps(cs, sn, odd), s0 = _mm256_blendv_ps(sn, cs, odd);
  const __m256i qm = _mm256_and_si256(q, _mm256_set1_epi32(3));
  const __m256 neg_c = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_cmpeq_epi32(qm, one_i), _mm256_cmpeq_epi32(qm, two_i)));
  const __m256 neg_s = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(qm, two_i), two_i));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  zc = _mm256_mul_ps(radius, _mm256_xor_ps(c0, _mm256_and_ps(neg_c, sign)));
  zs = _mm256_mul_ps(radius, _mm256_xor_ps(s0, _mm256_and_ps(neg_s, sign)));
}
#endif

}  // namespace

void projection_columns(uint64_t seed, int64_t head, bool f, int64_t k, int64_t j0, int64_t count,
                        float* out) {
  constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ULL;
  const RandomStream rs(seed, projection_stream(head, f));
  const float scale = 1.0f / std::sqrt(float(k));
  const int64_t pairs = (k + 1) / 2;
  for (int64_t jj = 0; jj < count; ++jj) {
    // column j: the splitmix64 sequence seeded by stream.bits(j); pair t = rows 2t, 2t + 1
    const uint64_t key = rs.bits(uint64_t(j0 + jj));
    float* col = out + jj * k;
    int64_t t = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i ilo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ihi =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (; t + kLanes <= k / 2; t += kLanes) {
      const __m512i ctr = _mm512_add_epi64(_mm512_set1_epi64(int64_t(t)), lanes);
      const __m512i g = _mm512_set1_epi64(int64_t(kGamma));
      const __m512i base = _mm512_set1_epi64(int64_t(key));
      const __m512i lo = mix64_x8(_mm512_add_epi64(base, _mm512_mullo_epi64(ctr, g)));
      const __m512i hi = mix64_x8(_mm512_add_epi64(
          base, _mm512_mullo_epi64(_mm512_add_epi64(ctr, _mm512_set1_epi64(8)), g)));
      __m512 zc, zs;
      normal_pairs_x16(lo, hi, zc, zs);
      zc = _mm512_mul_ps(zc, vscale);
      zs = _mm512_mul_ps(zs, vscale);
      _mm512_storeu_ps(col + 2 * t, _mm512_permutex2var_ps(zc, ilo, zs));
      _mm512_storeu_ps(col + 2 * t + kLanes, _mm512_permutex2var_ps(zc, ihi, zs));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vscale = _mm256_set1_ps(scale);
    // lane l of a group of 4 pairs adds l gamma to the group's first counter (mod 2^64)
    const __m256i steps =
        _mm256_setr_epi64x(0, int64_t(kGamma), int64_t(2 * kGamma), int64_t(3 * kGamma));
    const __m256i four = _mm256_set1_epi64x(int64_t(4 * kGamma));
    for (; t + kLanes <= k / 2; t += kLanes) {
      const __m256i lo =
          _mm256_add_epi64(_mm256_set1_epi64x(int64_t(key + uint64_t(t) * kGamma)), steps);
      __m256 zc, zs;
      normal_pairs_x8(mix64_x4(lo), mix64_x4(_mm256_add_epi64(lo, four)), zc, zs);
      zc = _mm256_mul_ps(zc, vscale);
      zs = _mm256_mul_ps(zs, vscale);
      // interleave (zc_i, zs_i): unpack within 128-bit halves, then put the halves in order
      const __m256 a = _mm256_unpacklo_ps(zc, zs), b = _mm256_unpackhi_ps(zc, zs);
      _mm256_storeu_ps(col + 2 * t, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(col + 2 * t + kLanes, _mm256_permute2f128_ps(a, b, 0x31));
    }
#endif
    for (; t < pairs; ++t) {
      float zc, zs;
      normal_pair(mix64(key + uint64_t(t) * kGamma), zc, zs);
      col[2 * t] = zc * scale;
      if (2 * t + 1 < k) col[2 * t + 1] = zs * scale;
    }
  }
}

}  // namespace linformer

namespace {

constexpr int64_t kChunk = 256;   // key columns of E (and F) generated per GEMM
constexpr int64_t kBlockQ = 256;  // query rows per task in step 2
// The most bytes of projections prepare() keeps.
constexpr double kPrepareBudget = 64.0 * 1024 * 1024;

/// What forward_train keeps: EK and FV of every (batch, head), [B, H, 2, k, d].
class LinformerSaved final : public SavedState {
 public:
  std::vector<float> proj;
};

class Linformer final : public Variant, public Backward {
 public:
  Linformer(int64_t proj, bool share_kv) : k_(proj), share_(share_kv) {}

  // Work split of step 1: tasks are (head, key range); with fewer heads than threads the key
  // columns of a head are split into `splits` ranges whose partial sums are added in order.
  struct Plan {
    int64_t splits, chunks, tasks, threads;
  };
  Plan plan(const Problem& p) const {
    Plan pl;
    pl.threads = team_threads();
    pl.chunks = (p.keys() + kChunk - 1) / kChunk;
    pl.splits = std::min(pl.chunks, std::max<int64_t>(1, (pl.threads + p.heads - 1) / p.heads));
    pl.tasks = p.heads * pl.splits;
    return pl;
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    std::unique_ptr<float[]> proj(new float[size_t(p.batch * p.heads * 2 * k_ * p.dim)]);
    project(p, k, v, proj.get());
    attend(p, q, proj.get(), out);
  }

  // The backward: the saved EK and FV, and per query block the softmax recomputed from them.

  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    auto saved = std::make_unique<LinformerSaved>();
    saved->proj.resize(size_t(p.batch * p.heads * 2 * k_ * p.dim));
    project(p, k, v, saved->proj.data());
    attend(p, q, saved->proj.data(), out);
    return saved;
  }

  using Variant::backward;  // the accessor stays visible beside the pass
  // With P = softmax(s Q EK^T) (rows recomputed from EK), D_i = dO_i . O_i,
  // dS = P o (dO FV^T - D):  dQ = s dS EK,  dEK = s dS^T Q,  dFV = P^T dO,
  // then dK = E^T dEK and dV = F^T dFV (E = F with share_kv: both through E), over the valid
  // keys of each batch element (the rest 0). E and F are constants.
  void backward(const Problem& p, ConstTensorView q, ConstTensorView /*k*/, ConstTensorView /*v*/,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    backward_pass(p, q, out, dout, saved, dq, dk, dv, nullptr);
  }

  // Given E and F: dE_h = sum_b dEK_{b,h} K_{b,h}^T and dF_h = sum_b dFV_{b,h} V_{b,h}^T over
  // each batch element's valid keys (with share_kv E serves both: the sum of the two). The
  // backward keeps every (batch, head)'s dEK and dFV for them (B H 2 k d floats).
  bool gives_input_grads() const override { return true; }
  void backward_inputs(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       ConstTensorView out, ConstTensorView dout, const SavedState& saved,
                       TensorView dq, TensorView dk, TensorView dv, InputGrads& dinputs) override {
    const bool e = input(p, "E") != nullptr, f = !share_ && input(p, "F");
    if (!e && !f) throw UsageError("linformer: backward_inputs without a given E or F");
    std::vector<float> dproj(size_t(p.batch * p.heads * 2 * k_ * p.dim));
    backward_pass(p, q, out, dout, saved, dq, dk, dv, dproj.data());
    const size_t count = size_t(p.heads * k_ * p.keys());
    float* de = e ? (dinputs["E"].assign(count, 0.0f), dinputs["E"].data()) : nullptr;
    float* df = f ? (dinputs["F"].assign(count, 0.0f), dinputs["F"].data()) : nullptr;
    projection_grads(p, k, v, dproj.data(), de, df);
  }

  /// dE and dF ([H, k, m], zeroed; null: not given) from dproj, every (batch, head)'s dEK and
  /// dFV ([B, H, 2, k, d]): head h sums its batch elements' products with their valid keys
  /// and values (k and v as head h reads them).
  void projection_grads(const Problem& p, ConstTensorView k, ConstTensorView v, const float* dproj,
                        float* de, float* df) const {
    const int64_t m = p.keys(), d = p.dim, H = p.heads, kp = k_, per_bh = 2 * kp * d;
    parallel_for(H, [&](int64_t h) {
      for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t len = p.key_lengths.empty() ? m : p.key_lengths[size_t(b)];
        if (len == 0) continue;
        const float* dek = dproj + (b * H + h) * per_bh;
        const float* dfv = dek + kp * d;
        // dE_h[:, :len] += dEK K^T, dF_h[:, :len] += dFV V^T (into dE_h with share_kv)
        float* dfh = share_ ? (de ? de + h * kp * m : nullptr) : (df ? df + h * kp * m : nullptr);
        if (de)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(kp), int(len), int(d), 1.0f, dek,
                      int(d), k.row(b, h, 0), int(k.stride_row), 1.0f, de + h * kp * m, int(m));
        if (dfh)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(kp), int(len), int(d), 1.0f, dfv,
                      int(d), v.row(b, h, 0), int(v.stride_row), 1.0f, dfh, int(m));
      }
    });
  }

  /// The backward of every (batch, head); dproj (or null) receives their dEK and dFV
  /// ([B, H, 2, k, d]) for projection_grads.
  void backward_pass(const Problem& p, ConstTensorView q, ConstTensorView out, ConstTensorView dout,
                     const SavedState& saved, TensorView dq, TensorView dk, TensorView dv,
                     float* dproj) {
    const auto* st = dynamic_cast<const LinformerSaved*>(&saved);
    const int64_t n = p.n, m = p.keys(), d = p.dim, H = p.heads, kp = k_;
    const int64_t per_bh = 2 * kp * d;
    if (!st || st->proj.size() != size_t(p.batch * H * per_bh))
      throw UsageError("linformer: the saved state is not from its forward_train on this problem");
    resolve(p);
    const float scale = p.softmax_scale();
    const int64_t rows_max = std::min(kBlockQ, n), cols_max = std::min(kChunk, m);
    OmpGuard guard;
#pragma omp parallel
    {
      std::vector<float> ps, dps, grad, gen;
      guard.run([&] {
        ps.resize(size_t(rows_max * kp)), dps.resize(size_t(rows_max * kp));
        if (!dproj) grad.resize(size_t(per_bh));
        if (!src_ && !all_given(p)) gen.resize(size_t((share_ ? 1 : 2) * cols_max * kp));
      });
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < p.batch * H; ++bh)
        guard.run([&] {
          const int64_t b = bh / H, h = bh % H;
          const int64_t len = p.key_lengths.empty() ? m : p.key_lengths[size_t(b)];
          for (int64_t i = 0; i < n; ++i) std::fill_n(dq.row(b, h, i), d, 0.0f);
          for (int64_t j = 0; j < m; ++j) {
            std::fill_n(dk.row(b, h, j), d, 0.0f);
            std::fill_n(dv.row(b, h, j), d, 0.0f);
          }
          float *dek = dproj ? dproj + bh * per_bh : grad.data(), *dfv = dek + kp * d;
          std::fill_n(dek, per_bh, 0.0f);
          if (len == 0) return;  // every row is 0 whatever the inputs
          const float* ek = st->proj.data() + bh * per_bh;
          const float* fv = ek + kp * d;
          for (int64_t i0 = 0; i0 < n; i0 += kBlockQ) {
            const int64_t rows = std::min(kBlockQ, n - i0);
            float *pm = ps.data(), *g = dps.data();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(kp), int(d), 1.0f,
                        q.row(b, h, i0), int(q.stride_row), ek, int(d), 0.0f, pm, int(kp));
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(kp), int(d), 1.0f,
                        dout.row(b, h, i0), int(dout.stride_row), fv, int(d), 0.0f, g, int(kp));
            for (int64_t r = 0; r < rows; ++r) {
              float* pr = pm + r * kp;
              float* gr = g + r * kp;
              softmax_row(pr, kp, scale);
              softmax_backward_row(pr, gr, kp,
                                   dot(out.row(b, h, i0 + r), dout.row(b, h, i0 + r), d), scale);
            }
            // dQ = dS EK, dEK += dS^T Q, dFV += P^T dO (dS carries the scale)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(kp), 1.0f,
                        g, int(kp), ek, int(d), 0.0f, dq.row(b, h, i0), int(dq.stride_row));
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(kp), int(d), int(rows), 1.0f,
                        g, int(kp), q.row(b, h, i0), int(q.stride_row), 1.0f, dek, int(d));
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(kp), int(d), int(rows), 1.0f,
                        pm, int(kp), dout.row(b, h, i0), int(dout.stride_row), 1.0f, dfv, int(d));
          }
          // dK = E^T dEK, dV = F^T dFV over the valid keys, a chunk of columns at a time
          for (int64_t j0 = 0; j0 < len; j0 += kChunk) {
            const int64_t cols = std::min(kChunk, len - j0);
            // the drawn columns' scratch (none when every projection is given or kept)
            float* ge = gen.empty() ? nullptr : gen.data();
            float* gf = gen.empty() || share_ ? nullptr : gen.data() + cols_max * kp;
            const Operand eo = operand(p, h, false, j0, cols, ge);
            const Operand fo = share_ ? eo : operand(p, h, true, j0, cols, gf);
            spread_chunk(eo, kp, d, cols, dek, dk.row(b, h, j0), dk.stride_row);
            spread_chunk(fo, kp, d, cols, dfv, dv.row(b, h, j0), dv.stride_row);
          }
        });
    }
    guard.rethrow();
  }

  double backward_flops(const Problem& p) const override {
    const double bh = double(p.batch * p.heads), k = double(k_), d = double(p.dim);
    const double n = double(p.n), m = double(p.keys());
    // S and dP again, dQ, dEK, dFV (2 n k d each), the softmax and dS (7 per score), dK and dV
    // (2 m k d each); the projections drawn again (when not prepared) are not counted
    return bh * (10.0 * n * k * d + 7.0 * n * k + 4.0 * m * k * d + 2.0 * n * d);
  }
  double saved_estimate(const Problem& p) const override {
    return double(p.batch * p.heads * 2 * k_ * p.dim) * sizeof(float) +
           double(sizeof(LinformerSaved));
  }
  // Given E or F (backward_inputs): every (batch, head)'s dEK and dFV in place of the threads'
  // own, and no columns drawn (resolve gives them; the forward_train before already held as
  // many).
  double backward_memory_estimate(const Problem& p) const override {
    const double f = sizeof(float);
    const int64_t threads = team_threads();
    const bool given = input(p, "E") || (!share_ && input(p, "F"));
    const double per_thread =
        double(2 * std::min(kBlockQ, p.n) * k_ + (given ? 0 : 2 * k_ * p.dim)) * f +
        (all_given(p) || ready(p) ? 0.0
                                  : double((share_ ? 1 : 2) * std::min(kChunk, p.keys()) * k_) * f);
    const double kept = given ? double(p.batch * p.heads * 2 * k_ * p.dim) * f : 0.0;
    return double(threads) * per_thread + kept;
  }

  /// proj[(b H + h) 2 k d ...]: EK (k x d) followed by FV (k x d) of every (batch, head).
  void project(const Problem& p, ConstTensorView k, ConstTensorView v, float* proj_out) {
    const int64_t m = p.keys(), d = p.dim, B = p.batch, H = p.heads, kp = k_;
    const Plan pl = plan(p);
    const int64_t per_bh = 2 * kp * d;  // EK then FV
    // the longest valid key length of any batch element: no column of E or F past it is drawn
    const int64_t longest =
        p.key_lengths.empty() ? m : *std::max_element(p.key_lengths.begin(), p.key_lengths.end());
    float* proj = proj_out;
    resolve(p);  // E and F given, from prepare(), or drawn chunk by chunk below

    {
      // partial sums when a head is split over key ranges (none otherwise)
      std::unique_ptr<float[]> partial(pl.splits > 1 ? new float[size_t(pl.tasks * B * per_bh)]
                                                     : nullptr);
      OmpGuard guard;
#pragma omp parallel
      {
        const int64_t gen_cols = std::min(kChunk, m);
        std::unique_ptr<float[]> gen;
        if (!src_ && !all_given(p))
          guard.run([&] { gen.reset(new float[size_t((share_ ? 1 : 2) * gen_cols * kp)]); });
        float* et = gen.get();
        float* ft = share_ || !et ? et : et + gen_cols * kp;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < pl.tasks; ++t)
          guard.run([&] {
            const int64_t h = t / pl.splits, s = t % pl.splits;
            const int64_t c0 = s * pl.chunks / pl.splits, c1 = (s + 1) * pl.chunks / pl.splits;
            for (int64_t c = c0; c < c1; ++c) {
              const int64_t j0 = c * kChunk, cols = std::min(kChunk, m - j0);
              // the columns some batch element has valid keys for (all without key padding)
              const int64_t gen = std::clamp<int64_t>(longest - j0, 0, cols);
              const Operand eo = operand(p, h, false, j0, gen, et);
              const Operand fo = share_ ? eo : operand(p, h, true, j0, gen, ft);
              const float beta = c == c0 ? 0.0f : 1.0f;
              for (int64_t b = 0; b < B; ++b) {
                float* dst = pl.splits > 1 ? partial.get() + (t * B + b) * per_bh
                                           : proj + (b * H + h) * per_bh;
                // under key padding, only the chunk's valid keys of batch element b
                const int64_t use =
                    p.key_lengths.empty()
                        ? cols
                        : std::clamp<int64_t>(p.key_lengths[size_t(b)] - j0, 0, cols);
                if (use == 0) {
                  if (c == c0) std::fill(dst, dst + per_bh, 0.0f);
                  continue;
                }
                // EK += E[:, chunk] K[chunk, :], FV += F[:, chunk] V[chunk, :]
                project_chunk(eo, kp, d, use, k.row(b, h, j0), k.stride_row, beta, dst);
                project_chunk(fo, kp, d, use, v.row(b, h, j0), v.stride_row, beta, dst + kp * d);
              }
            }
          });
        if (pl.splits > 1) {
          // add the partial sums of each head in split order (deterministic)
#pragma omp for schedule(static)
          for (int64_t bh = 0; bh < B * H; ++bh) {
            if (guard.failed()) continue;  // a partial sum is missing
            const int64_t b = bh / H, h = bh % H;
            float* dst = proj + bh * per_bh;
            std::memcpy(dst, partial.get() + ((h * pl.splits) * B + b) * per_bh,
                        size_t(per_bh) * sizeof(float));
            for (int64_t s = 1; s < pl.splits; ++s) {
              const float* src = partial.get() + ((h * pl.splits + s) * B + b) * per_bh;
              for (int64_t i = 0; i < per_bh; ++i) dst[i] += src[i];
            }
          }
        }
      }
      guard.rethrow();
    }
  }

  /// Step 2: attention of every query block over the k projected keys and values.
  void attend(const Problem& p, ConstTensorView q, const float* proj, TensorView out) const {
    const int64_t n = p.n, d = p.dim, B = p.batch, H = p.heads, kp = k_;
    const int64_t per_bh = 2 * kp * d;
    const float scale = p.softmax_scale();
    const int64_t qblocks = (n + kBlockQ - 1) / kBlockQ, tasks = B * H * qblocks;
    parallel_for(
        tasks,
        [&] { return std::make_unique_for_overwrite<float[]>(size_t(std::min(kBlockQ, n) * kp)); },
        [&](int64_t t, std::unique_ptr<float[]>& scores) {
          const int64_t bh = t / qblocks, i0 = (t % qblocks) * kBlockQ;
          const int64_t b = bh / H, h = bh % H, rows = std::min(kBlockQ, n - i0);
          if (!p.key_lengths.empty() && p.key_lengths[size_t(b)] == 0) {
            for (int64_t r = 0; r < rows; ++r) std::fill_n(out.row(b, h, i0 + r), d, 0.0f);
            return;  // no valid key
          }
          const float* ek = proj + bh * per_bh;
          const float* fv = ek + kp * d;
          float* s = scores.get();
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(kp), int(d), 1.0f,
                      q.row(b, h, i0), int(q.stride_row), ek, int(d), 0.0f, s, int(kp));
          for (int64_t r = 0; r < rows; ++r) softmax_row(s + r * kp, kp, scale);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(kp), 1.0f,
                      s, int(kp), fv, int(d), 0.0f, out.row(b, h, i0), int(out.stride_row));
        });
  }

  // E and F of every head (columns 0 .. m - 1), when they fit in kPrepareBudget.
  bool prepare(const Problem& p) override {
    kept_.clear();
    kept_cols_ = 0;
    if (prepared_bytes(p) > kPrepareBudget) return false;
    const int64_t m = p.keys(), kp = k_;
    std::vector<Projections> kept(size_t(p.heads));
    parallel_for(p.heads, [&](int64_t h) {
      Projections& pr = kept[size_t(h)];
      pr.e.resize(size_t(m * kp));
      linformer::projection_columns(p.seed, h, false, kp, 0, m, pr.e.data());
      if (!share_) {
        pr.f.resize(size_t(m * kp));
        linformer::projection_columns(p.seed, h, true, kp, 0, m, pr.f.data());
      }
    });
    kept_ = std::move(kept);
    kept_seed_ = p.seed, kept_cols_ = m;
    return true;
  }

  std::string notes() const override {
    if (src_ != &kept_) return {};
    return fmt::format("{}; {:.1f} MiB of projections held", kPreparedNote,
                       double(kept_.size()) * double(kept_cols_ * k_) * (share_ ? 1 : 2) * 4.0 /
                           (1024.0 * 1024.0));
  }

  double flops(const Problem& p) const override {
    const double bh = double(p.batch * p.heads), k = double(k_), d = double(p.dim);
    // GEMMs: E K and F V (2 k m d each), Q (EK)^T and S (FV) (2 n k d each); softmax: about
    // 4 operations per score (max, scale and subtract, exp, normalise). The random normals
    // (H k m, twice without share_kv) are not counted.
    return bh *
           (4.0 * k * double(p.keys()) * d + 4.0 * double(p.n) * k * d + 4.0 * double(p.n) * k);
  }

  double memory_estimate(const Problem& p) const override {
    const Plan pl = plan(p);
    const double f = sizeof(float), per_bh = 2.0 * double(k_ * p.dim);
    // given E and F are read in place; one stood in for is kept by prepare() or drawn
    const bool given = all_given(p);
    const double proj = double(p.batch * p.heads) * per_bh * f;
    // every thread of a parallel region allocates its buffers, whether it gets a task or not
    const double step1 = (pl.splits > 1 ? double(pl.tasks * p.batch) * per_bh * f : 0.0) +
                         (given || ready(p) ? 0.0
                                            : double(pl.threads) * (share_ ? 1 : 2) *
                                                  double(std::min(kChunk, p.keys()) * k_) * f);
    const double step2 = double(pl.threads) * double(std::min(kBlockQ, p.n) * k_) * f;
    return proj + std::max(step1, step2);
  }

 private:
  // E and F of one head, column j (k entries) at j k: the layout projection_columns writes.
  struct Projections {
    std::vector<float> e, f;  // f empty with share_kv
  };
  double prepared_bytes(const Problem& p) const {
    return double(p.heads) * double(p.keys()) * double(k_) * (share_ ? 1 : 2) * sizeof(float);
  }
  // Whether the kept projections serve p: the same seed and heads, and every column p reads
  // (a column does not depend on m, so a shorter m is served too).
  bool ready(const Problem& p) const {
    return !kept_.empty() && int64_t(kept_.size()) == p.heads && kept_seed_ == p.seed &&
           kept_cols_ >= p.keys();
  }

  int64_t k_;
  bool share_;
  std::vector<Projections> kept_;
  uint64_t kept_seed_ = 0;
  int64_t kept_cols_ = 0;
  // What the last pass read for the projections it was not given: &kept_ (prepared) or null
  // (drawn chunk by chunk).
  std::vector<Projections>* src_ = nullptr;

  // The projections a pass on p reads that it is not given (src_): the prepared ones when
  // they serve p and some projection is stood in for, else none (drawn chunk by chunk).
  void resolve(const Problem& p) { src_ = !all_given(p) && ready(p) ? &kept_ : nullptr; }
  /// Whether p gives every projection this instance reads (E, and F without share_kv).
  bool all_given(const Problem& p) const { return input(p, "E") && (share_ || input(p, "F")); }

  /// Columns j0 .. j0 + cols of E (f = false) or F of head h as a GEMM operand: the given
  /// input read in place (rows of its [proj, m], leading dimension m), or columns ([cols,
  /// proj], leading dimension proj) kept by prepare() or drawn into `scratch`.
  struct Operand {
    const float* a;
    int ld;
    bool rows;  // true: proj x cols (the given layout); false: cols x proj
  };
  Operand operand(const Problem& p, int64_t h, bool f, int64_t j0, int64_t cols,
                  float* scratch) const {
    const int64_t kp = k_, m = p.keys();
    if (const float* x = input(p, f && !share_ ? "F" : "E"))
      return {x + h * kp * m + j0, int(m), true};
    if (src_) {
      const Projections& pr = (*src_)[size_t(h)];
      return {(f && !share_ ? pr.f : pr.e).data() + j0 * kp, int(kp), false};
    }
    linformer::projection_columns(p.seed, h, f && !share_, kp, j0, cols, scratch);
    return {scratch, int(kp), false};
  }

  /// dst (proj x d) = X[:, chunk] x (use x d, leading dimension ldx) + beta dst, X = E or F.
  static void project_chunk(const Operand& o, int64_t kp, int64_t d, int64_t use, const float* x,
                            int64_t ldx, float beta, float* dst) {
    cblas_sgemm(CblasRowMajor, o.rows ? CblasNoTrans : CblasTrans, CblasNoTrans, int(kp), int(d),
                int(use), 1.0f, o.a, o.ld, x, int(ldx), beta, dst, int(d));
  }

  /// dx (cols x d, leading dimension ldx) = X[:, chunk]^T g (proj x d): dK or dV of a chunk.
  static void spread_chunk(const Operand& o, int64_t kp, int64_t d, int64_t cols, const float* g,
                           float* dx, int64_t ldx) {
    cblas_sgemm(CblasRowMajor, o.rows ? CblasTrans : CblasNoTrans, CblasNoTrans, int(cols), int(d),
                int(kp), 1.0f, o.a, o.ld, g, int(d), 0.0f, dx, int(ldx));
  }
};

std::vector<double> linformer_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                     ConstTensorView k, ConstTensorView v) {
  const int64_t kp = var.params().get_int("proj");
  const bool share = var.params().get_bool("share_kv");
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    // the m valid keys of batch element b (every key without key padding)
    const int64_t m = p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)];
    if (m == 0) return oracle::Matrix(p.n, p.dim);
    auto valid = [&](ConstTensorView x) { return oracle::head(x, b, h, m); };
    // E (or F) of head h, k x m
    auto projection = [&](bool f) {
      oracle::Matrix e(kp, m);
      if (const float* x = var.input(p, f ? "F" : "E")) {  // given: [H, proj, keys]
        for (int64_t r = 0; r < kp; ++r)
          for (int64_t j = 0; j < m; ++j) e(r, j) = double(x[(h * kp + r) * p.keys() + j]);
        return e;
      }
      std::vector<float> t(size_t(kp * m));
      linformer::projection_columns(p.seed, h, f, kp, 0, m, t.data());
      for (int64_t j = 0; j < m; ++j)
        for (int64_t r = 0; r < kp; ++r) e(r, j) = double(t[size_t(j * kp + r)]);
      return e;
    };
    const oracle::Matrix e = projection(false), f = share ? e : projection(true);
    return oracle::softmax_attention(oracle::head(q, b, h), oracle::product(e, valid(k)),
                                     oracle::product(f, valid(v)), 1.0 / std::sqrt(double(p.dim)));
  });
}

double linformer_tolerance(const Variant& var, const Problem& p, const Workload& wl) {
  const double kp = double(var.params().get_int("proj")), m = double(p.keys());
  const double logit = logit_size(wl) * std::sqrt(std::max(1.0, m / kp));
  return kErrorMargin * float32_error(double(p.dim) + m, logit, m + kp, 4.0);
}

ATTNBENCH_REGISTER_VARIANT(
    linformer,
    VariantInfo{
        .name = "linformer",
        .summary = "softmax(s Q (EK)^T) (FV) with random k x m projections E, F (Linformer)",
        .complexity = "time O((n + m) k d), memory O(B H k d + threads k 256)",
        .family = "lowrank",
        .display = "Linformer",
        .paper = "Wang et al. 2020 (arXiv:2006.04768)",
        .look = {.color = "#d62728", .marker = "o"},
        .params = {ParamSpec::Int("proj", 256, 1, int64_t(1) << 20,
                                  "projection size k: keys and values are projected to k rows"),
                   ParamSpec::Bool("share_kv", false,
                                   "use one projection for keys and values (F = E)")},
        .inputs = {{.name = "E",
                    .dims = {"H", "proj", "m"},
                    .help = "projection of the keys per head: E K is proj x d",
                    .stand_in = "entries N(0, 1/proj), seeded per head"},
                   {.name = "F",
                    .dims = {"H", "proj", "m"},
                    .help = "projection of the values per head: F V is proj x d",
                    .stand_in = "entries N(0, 1/proj), seeded per head",
                    .when = "share_kv=false"}},
        .caps = {.causal = false, .cross = true, .exact = false, .key_padding = true},
        .make =
            [](const ParamValues& pv) {
              return std::make_unique<Linformer>(pv.get_int("proj"), pv.get_bool("share_kv"));
            },
        .oracle = linformer_oracle,
        .tolerance = linformer_tolerance});

}  // namespace
}  // namespace attnbench
