// Pieces the feature-map engine's forward, backward and decode files share: not installed.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "common/engines/feature_map_attention.h"

namespace attnbench::feature_map::detail {

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/// A 64-byte aligned float block.
class Aligned {
 public:
  explicit Aligned(int64_t floats)
      : p_(static_cast<float*>(std::aligned_alloc(
            64, size_t(round_up(std::max<int64_t>(floats, 1) * int64_t(sizeof(float)), 64))))) {
    if (!p_) throw std::bad_alloc();
  }
  ~Aligned() { std::free(p_); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  float* get() const { return p_; }

 private:
  float* p_;
};

/// The prefix key state of a walk over the rows: S = sum phi(k_j) v_j^T (F x d) and
/// z = sum phi(k_j) over keys [0, kdone), kept at the current key scale exp(-shift). The
/// forward, the backward's first pass and the decode state build it the same way.
struct KeyState {
  const FeatureMap& fm;
  const float *k, *v;  // the rows map_keys and fold index (row j at k + j ldk, v + j ldv)
  int64_t ldk, ldv, f, d;
  float *s, *z;
  float shift = -INFINITY;
  int64_t kdone = 0;  // keys [0, kdone) are in S and z

  /// A walk from no key: S and z zeroed.
  KeyState(const FeatureMap& fm_, const float* k_, int64_t ldk_, const float* v_, int64_t ldv_,
           int64_t d_, float* s_, float* z_)
      : fm(fm_), k(k_), v(v_), ldk(ldk_), ldv(ldv_), f(fm_.features()), d(d_), s(s_), z(z_) {
    std::fill(s, s + f * d, 0.0f);
    std::fill(z, z + f, 0.0f);
  }
  /// A walk resumed on S and z that hold `kdone_` keys at key shift `shift_` (a decode step:
  /// k and v then point at the rows of the keys to come, whatever their positions).
  KeyState(const FeatureMap& fm_, const float* k_, int64_t ldk_, const float* v_, int64_t ldv_,
           int64_t d_, float* s_, float* z_, float shift_, int64_t kdone_)
      : fm(fm_),
        k(k_),
        v(v_),
        ldk(ldk_),
        ldv(ldv_),
        f(fm_.features()),
        d(d_),
        s(s_),
        z(z_),
        shift(shift_),
        kdone(kdone_) {}
  /// Maps keys [j0, j0 + cnt) into phk (rows of f floats), bringing S and z to the new key
  /// scale when the map raises it.
  void map_keys(int64_t j0, int64_t cnt, float* phk) {
    const float old = shift;
    fm.keys(k + j0 * ldk, ldk, cnt, phk, f, shift);
    if (shift > old && old > -INFINITY && kdone > 0) {
      const float c = std::exp(old - shift);
      for (int64_t i = 0; i < f * d; ++i) s[i] *= c;
      for (int64_t i = 0; i < f; ++i) z[i] *= c;
    }
  }
  /// S += phi(K)^T V and z += column sums of phi(K) for keys [j0, j0 + cnt), rows of pk.
  void fold(const float* pk, int64_t j0, int64_t cnt) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(f), int(d), int(cnt), 1.0f, pk, int(f),
                v + j0 * ldv, int(ldv), 1.0f, s, int(d));
    for (int64_t r = 0; r < cnt; ++r) {
      const float* row = pk + r * f;
      for (int64_t i = 0; i < f; ++i) z[i] += row[i];
    }
  }
};

}  // namespace attnbench::feature_map::detail
