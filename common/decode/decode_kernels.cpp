#include "common/decode/decode_kernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/core/error.h"
#include "common/kernels/simd.h"
#include "common/kernels/softmax.h"

namespace attnbench::decode {

void check_step_group(int64_t k_group, int64_t group, int64_t kv_heads) {
  if (k_group != group)
    throw UsageError(
        fmt::format("decode step: k and v are grouped by {}, the state by {} ({} key/value heads)",
                    k_group, group, kv_heads));
}

namespace {

#ifdef __AVX512F__
// GCC 12 reports its own _mm512_undefined_ps() (the pass-through operand of unmasked
// intrinsics) as used uninitialized once inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"

/// sc[j] = q . k_j for `len` rows k_j = k + j d, with q held in NV registers (d <= 16 NV, the
/// last register masked); four keys at a time for independent FMA chains.
template <int NV>
void dots_avx512(const float* q, const float* k, int64_t len, int64_t d, float* sc) {
  const __mmask16 tail = simd::first_lanes(d - 16 * (NV - 1));
  __m512 qv[NV];
  for (int c = 0; c < NV; ++c)
    qv[c] = _mm512_maskz_loadu_ps(c == NV - 1 ? tail : __mmask16(0xFFFF), q + 16 * c);
  auto load = [&](const float* row, int c) {
    return c == NV - 1 ? _mm512_maskz_loadu_ps(tail, row + 16 * c) : _mm512_loadu_ps(row + 16 * c);
  };
  int64_t j = 0;
  for (; j + 4 <= len; j += 4) {
    const float* r = k + j * d;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < NV; ++c) {
      a0 = _mm512_fmadd_ps(load(r, c), qv[c], a0);
      a1 = _mm512_fmadd_ps(load(r + d, c), qv[c], a1);
      a2 = _mm512_fmadd_ps(load(r + 2 * d, c), qv[c], a2);
      a3 = _mm512_fmadd_ps(load(r + 3 * d, c), qv[c], a3);
    }
    sc[j] = _mm512_reduce_add_ps(a0);
    sc[j + 1] = _mm512_reduce_add_ps(a1);
    sc[j + 2] = _mm512_reduce_add_ps(a2);
    sc[j + 3] = _mm512_reduce_add_ps(a3);
  }
  for (; j < len; ++j) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < NV; ++c) a = _mm512_fmadd_ps(load(k + j * d, c), qv[c], a);
    sc[j] = _mm512_reduce_add_ps(a);
  }
}

/// acc += sum_j w_j v_j over `len` rows v_j = v + j d, acc held in NV registers.
template <int NV>
void accumulate_avx512(const float* w, const float* v, int64_t len, int64_t d, float* acc) {
  const __mmask16 tail = simd::first_lanes(d - 16 * (NV - 1));
  auto mask = [&](int c) { return c == NV - 1 ? tail : __mmask16(0xFFFF); };
  __m512 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm512_maskz_loadu_ps(mask(c), acc + 16 * c);
  for (int64_t j = 0; j < len; ++j) {
    const __m512 wj = _mm512_set1_ps(w[j]);
    const float* r = v + j * d;
    for (int c = 0; c < NV; ++c)
      a[c] = _mm512_fmadd_ps(wj, _mm512_maskz_loadu_ps(mask(c), r + 16 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_mask_storeu_ps(acc + 16 * c, mask(c), a[c]);
}

#pragma GCC diagnostic pop
#endif  // __AVX512F__

}  // namespace

void dots(const float* q, const float* k, int64_t len, int64_t d, float* sc) {
#ifdef __AVX512F__
  switch ((d + 15) / 16) {
    case 1:
      return dots_avx512<1>(q, k, len, d, sc);
    case 2:
      return dots_avx512<2>(q, k, len, d, sc);
    case 3:
      return dots_avx512<3>(q, k, len, d, sc);
    case 4:
      return dots_avx512<4>(q, k, len, d, sc);
    case 5:
      return dots_avx512<5>(q, k, len, d, sc);
    case 6:
      return dots_avx512<6>(q, k, len, d, sc);
    case 7:
      return dots_avx512<7>(q, k, len, d, sc);
    case 8:
      return dots_avx512<8>(q, k, len, d, sc);
    default:
      break;
  }
#endif
  for (int64_t j = 0; j < len; ++j) sc[j] = dot(q, k + j * d, d);
}

void accumulate(const float* w, const float* v, int64_t len, int64_t d, float* acc) {
#ifdef __AVX512F__
  switch ((d + 15) / 16) {
    case 1:
      return accumulate_avx512<1>(w, v, len, d, acc);
    case 2:
      return accumulate_avx512<2>(w, v, len, d, acc);
    case 3:
      return accumulate_avx512<3>(w, v, len, d, acc);
    case 4:
      return accumulate_avx512<4>(w, v, len, d, acc);
    case 5:
      return accumulate_avx512<5>(w, v, len, d, acc);
    case 6:
      return accumulate_avx512<6>(w, v, len, d, acc);
    case 7:
      return accumulate_avx512<7>(w, v, len, d, acc);
    case 8:
      return accumulate_avx512<8>(w, v, len, d, acc);
    default:
      break;
  }
#endif
  for (int64_t j = 0; j < len; ++j) {
    const float wj = w[j];
    const float* r = v + j * d;
    for (int64_t c = 0; c < d; ++c) acc[c] += wj * r[c];
  }
}

void runs_partial(const float* q, const float* kh, const float* vh, const Run* runs,
                  size_t run_count, int64_t d, float scale, float* sc, float* part) {
  int64_t len = 0;
  for (size_t r = 0; r < run_count; ++r) {
    dots(q, kh + runs[r].row * d, runs[r].count, d, sc + len);
    len += runs[r].count;
  }
  float* acc = part + 2;
  std::fill(acc, acc + d, 0.0f);
  if (len == 0) {
    part[0] = -INFINITY, part[1] = 0.0f;
    return;
  }
  const float mx = row_max(sc, len);
  part[0] = mx;
  part[1] = exp_sum(sc, len, scale, mx);
  len = 0;
  for (size_t r = 0; r < run_count; ++r) {
    accumulate(sc + len, vh + runs[r].row * d, runs[r].count, d, acc);
    len += runs[r].count;
  }
}

void merge_partials(const float* parts, int64_t chunks, int64_t d, float scale, float* out) {
  const int64_t part = d + 2;
  float top = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c)
    if (parts[c * part + 1] != 0.0f) top = std::max(top, parts[c * part]);
  float l = 0.0f;
  std::fill(out, out + d, 0.0f);
  for (int64_t c = 0; c < chunks; ++c) {
    const float* pc = parts + c * part;
    if (pc[1] == 0.0f) continue;  // no key (a NaN sum is kept: it reaches out)
    const float e = chunks == 1 ? 1.0f : std::exp((pc[0] - top) * scale);
    l += e * pc[1];
    const float* acc = pc + 2;
    for (int64_t i = 0; i < d; ++i) out[i] += e * acc[i];
  }
  if (l == 0.0f) return;
  const float inv = 1.0f / l;
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

void attend_rows(const float* q, const float* keys, const float* values, int64_t len, int64_t d,
                 float scale, float* sc, float* out) {
  std::fill(out, out + d, 0.0f);
  if (len <= 0) return;
  dots(q, keys, len, d, sc);
  const float l = exp_sum(sc, len, scale, row_max(sc, len));
  accumulate(sc, values, len, d, out);
  const float inv = 1.0f / l;
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

}  // namespace attnbench::decode
