#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <optional>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel.h"
#include "common/core/random.h"
#include "common/core/threads.h"
#include "common/engines/feature_map_attention.h"
#include "common/engines/feature_map_internal.h"
#include "common/kernels/simd.h"
#include "common/kernels/softmax.h"

namespace attnbench::feature_map {

using detail::Aligned;
using detail::KeyState;
using detail::round_up;

namespace {

// Workspace layout of the backward (every part starts on a 16-float boundary): phi(Q) and
// dphi(Q) of a row block, phi(K) and dphi(K) of a key block, G and dden of a row block, the
// masked C x C products A and B, the state (S, z in pass 1; U, u in pass 2).
struct BackwardLayout {
  int64_t phq, dphq, phk, dphk, g, dd, a, bm, s, z, total;
  BackwardLayout(const Schedule& sc, int64_t f, int64_t d) {
    const int64_t rf = round_up(sc.block * f, 16), cc = round_up(sc.chunk * sc.chunk, 16);
    phq = 0;
    dphq = phq + rf;
    phk = dphq + rf;
    dphk = phk + rf;
    g = dphk + rf;
    dd = g + round_up(sc.block * d, 16);
    a = dd + round_up(sc.block, 16);
    bm = a + cc;
    s = bm + cc;
    z = s + round_up(f * d, 16);
    total = z + round_up(f, 16);
  }
};

}  // namespace

const RowDenominators& RowDenominators::of(const SavedState& saved, const Problem& p) {
  const auto* s = dynamic_cast<const RowDenominators*>(&saved);
  if (!s || s->den.size() != size_t(p.batch * p.heads * p.n))
    throw UsageError(
        "kernel attention backward: the saved state is not from forward_train on this problem");
  return *s;
}

double RowDenominators::bytes(const Problem& p) {
  return 4.0 * double(p.batch * p.heads * p.n) + double(sizeof(RowDenominators));
}

int64_t backward_workspace_floats(const Schedule& s, int64_t features, int64_t d) {
  return BackwardLayout(s, features, d).total;
}

namespace {

/// The backward of one (batch b, head) of attend_backward_head: the workspace parts, the
/// head's operands and the state its two passes share.
struct HeadBackward {
  HeadBackward(const FeatureMap& fm_, const Problem& p_, int64_t b_, const Schedule& sc,
               const HeadGrads& io_, float* work)
      : fm(fm_),
        p(p_),
        io(io_),
        b(b_),
        f(fm_.features()),
        d(p_.dim),
        n(p_.n),
        m(p_.keys()),
        R(sc.block),
        C(sc.chunk),
        blocks((n + R - 1) / R),
        shifts(size_t(blocks), -INFINITY) {
    const BackwardLayout L(sc, f, d);
    phq = work + L.phq, dphq = work + L.dphq, phk = work + L.phk, dphk = work + L.dphk;
    g = work + L.g, dd = work + L.dd, a = work + L.a, bm = work + L.bm, s = work + L.s;
    z = work + L.z;
    q = io.q, k = io.k, v = io.v, den = io.den;
    ldq = io.ldq, ldk = io.ldk, ldv = io.ldv;
  }

  /// g = dO / |den| and dden = -(dO . out) / den of rows [i0, i0 + rows) into g and dd; rows
  /// that are 0 get 0, rows raised to the floor (den < 0) get dden = 0
  void grads(int64_t i0, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      const float dn = den[i0 + r];
      float* gr = g + r * d;
      if (dn == 0.0f) {
        std::fill(gr, gr + d, 0.0f);
        dd[r] = 0.0f;
        continue;
      }
      const float inv = 1.0f / std::fabs(dn);
      const float *dor = io.dout + (i0 + r) * io.lddo, *orow = io.out + (i0 + r) * io.ldo;
      float dot = 0.0f;
      for (int64_t x = 0; x < d; ++x) {
        gr[x] = dor[x] * inv;
        dot += dor[x] * orow[x];
      }
      dd[r] = dn > 0 ? -dot * inv : 0.0f;
    }
  }

  /// writes 0 into `cnt` rows of a gradient
  void zero_rows(float* x, int64_t ld, int64_t cnt) const {
    for (int64_t r = 0; r < cnt; ++r) std::fill(x + r * ld, x + r * ld + d, 0.0f);
  }

  /// B = G_c V_w^T + dden (c x w) and, if `with_a`, A = phi(Q_c) phi(K_w)^T, both with the
  /// keys row i0 + r does not see set to 0
  void diagonal(int64_t i, int64_t c, const float* pq, const float* gc, const float* ddc,
                int64_t j0, int64_t w, const float* pk, bool with_a) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(w), int(d), 1.0f, gc, int(d),
                v + j0 * ldv, int(ldv), 0.0f, bm, int(w));
    if (with_a)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(w), int(f), 1.0f, pq, int(f),
                  pk, int(f), 0.0f, a, int(w));
    for (int64_t r = 0; r < c; ++r) {
      const int64_t vis = std::clamp<int64_t>(p.visible(b, i + r) - j0, 0, w);
      float* br = bm + r * w;
      for (int64_t t = 0; t < vis; ++t) br[t] += ddc[r];
      std::fill(br + vis, br + w, 0.0f);
      if (with_a) std::fill(a + r * w + vis, a + r * w + w, 0.0f);
    }
  }

  /// Pass 1: rows forwards with the prefix state S, z (as attend_head), dphi(Q), dq; records
  /// each row block's key shift in `shifts`.
  void forward_rows() {
    KeyState st(fm, k, ldk, v, ldv, d, s, z);
    const float& shift = st.shift;
    int64_t& kdone = st.kdone;
    auto map_keys = [&](int64_t j0, int64_t cnt) { st.map_keys(j0, cnt, phk); };
    auto fold = [&](const float* pk, int64_t j0, int64_t cnt) { st.fold(pk, j0, cnt); };
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const int64_t i0 = bi * R, rows = std::min(R, n - i0);
      const int64_t kv = p.visible(b, i0), ke = p.visible(b, i0 + rows - 1);
      while (kdone < kv) {
        const int64_t cnt = std::min(R, kv - kdone);
        map_keys(kdone, cnt);
        fold(phk, kdone, cnt);
        kdone += cnt;
      }
      if (ke == 0) {
        zero_rows(io.dq + i0 * io.lddq, io.lddq, rows);
        continue;
      }
      fm.queries(q + i0 * ldq, ldq, rows, phq, f);
      const int64_t kb = kdone;
      if (ke > kdone) map_keys(kdone, ke - kdone);
      shifts[size_t(bi)] = shift;
      grads(i0, rows);
      const int64_t step = ke > kdone ? C : rows;
      for (int64_t a0 = 0; a0 < rows; a0 += step) {
        const int64_t c = std::min(step, rows - a0), i = i0 + a0;
        float* dpq = dphq + a0 * f;
        const float *gc = g + a0 * d, *ddc = dd + a0;
        // dphi(q) = G S^T + dden z^T
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(f), int(d), 1.0f, gc,
                    int(d), s, int(d), 0.0f, dpq, int(f));
        for (int64_t r = 0; r < c; ++r)
          for (int64_t e = 0; e < f; ++e) dpq[r * f + e] += ddc[r] * z[e];
        const int64_t je = p.visible(b, i + c - 1);
        if (je > kdone) {  // + B phi(K_w) over the chunk's diagonal keys, then fold them
          const int64_t w = je - kdone;
          const float* pk = phk + (kdone - kb) * f;
          diagonal(i, c, nullptr, gc, ddc, kdone, w, pk, false);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(c), int(f), int(w), 1.0f, bm,
                      int(w), pk, int(f), 1.0f, dpq, int(f));
          fold(pk, kdone, w);
          kdone = je;
        }
      }
      fm.queries_backward(q + i0 * ldq, ldq, rows, phq, f, dphq, f, io.dq + i0 * io.lddq, io.lddq);
    }
  }

  /// dphi(K) = V U^T + 1 u^T and dV = phi(K) U of keys [j0, j0 + cnt) (features pk), added to
  /// what dpk and the dv rows hold (beta = 1) or overwriting them (beta = 0); then dk
  void finish_keys(const float* pk, float* dpk, int64_t j0, int64_t cnt, float beta) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(cnt), int(f), int(d), 1.0f,
                v + j0 * ldv, int(ldv), u_mat, int(d), beta, dpk, int(f));
    for (int64_t r = 0; r < cnt; ++r)
      for (int64_t e = 0; e < f; ++e) dpk[r * f + e] += u_vec[e];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(cnt), int(d), int(f), 1.0f, pk,
                int(f), u_mat, int(d), beta, io.dv + j0 * io.lddv, int(io.lddv));
    fm.keys_backward(k + j0 * ldk, ldk, cnt, pk, f, dpk, f, io.dk + j0 * io.lddk, io.lddk);
  }

  /// keys [x, kdone), seen only by rows already in U: final now, in blocks of R
  void finish_upto(int64_t x) {
    while (kdone > x) {
      const int64_t cnt = std::min(R, kdone - x), j0 = kdone - cnt;
      float sh = tau;  // at U's scale (every key here was mapped by then, so none raises it)
      fm.keys(k + j0 * ldk, ldk, cnt, phk, f, sh);
      finish_keys(phk, dphk, j0, cnt, 0.0f);
      kdone = j0;
    }
  }

  /// Pass 2: rows backwards with the suffix state U, u (in s, z), dphi(K), dk, dv.
  void backward_rows() {
    u_mat = s;
    u_vec = z;
    std::fill(u_mat, u_mat + f * d, 0.0f);
    std::fill(u_vec, u_vec + f, 0.0f);
    tau = -INFINITY;
    kdone = n > 0 ? p.visible(b, n - 1) : 0;
    zero_rows(io.dk + kdone * io.lddk, io.lddk, m - kdone);
    zero_rows(io.dv + kdone * io.lddv, io.lddv, m - kdone);
    for (int64_t bi = blocks - 1; bi >= 0; --bi) {
      const int64_t i0 = bi * R, rows = std::min(R, n - i0);
      const int64_t kv = p.visible(b, i0), ke = p.visible(b, i0 + rows - 1);
      finish_upto(ke);
      if (ke == 0) continue;
      // U and u to this block's key scale (shifts only grow along the rows)
      const float tb = shifts[size_t(bi)];
      if (tau > -INFINITY && tb < tau) {
        const float c = std::exp(tb - tau);
        for (int64_t i = 0; i < f * d; ++i) u_mat[i] *= c;
        for (int64_t i = 0; i < f; ++i) u_vec[i] *= c;
      }
      tau = tb;
      fm.queries(q + i0 * ldq, ldq, rows, phq, f);
      grads(i0, rows);
      if (ke > kv) {  // the block's diagonal keys, at its scale
        float sh = tau;
        fm.keys(k + kv * ldk, ldk, ke - kv, phk, f, sh);
      }
      // sub-chunks backwards; chunk [i, i + c) owns the keys [jlo, je) the rows before it do
      // not see (its diagonal), and every key past je is final already
      const int64_t step = ke > kv ? C : rows;
      for (int64_t a0 = (rows - 1) / step * step; a0 >= 0; a0 -= step) {
        const int64_t c = std::min(step, rows - a0), i = i0 + a0;
        const float *pq = phq + a0 * f, *gc = g + a0 * d, *ddc = dd + a0;
        const int64_t je = p.visible(b, i + c - 1), jlo = a0 == 0 ? kv : p.visible(b, i - 1);
        if (je > jlo) {
          const int64_t w = je - jlo;
          const float* pk = phk + (jlo - kv) * f;
          float* dpk = dphk + (jlo - kv) * f;
          diagonal(i, c, pq, gc, ddc, jlo, w, pk, true);
          // the chunk's rows: dphi(K_w) = B^T phi(Q_c), dV_w = A^T G_c; then the later rows
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(w), int(f), int(c), 1.0f, bm,
                      int(w), pq, int(f), 0.0f, dpk, int(f));
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(w), int(d), int(c), 1.0f, a,
                      int(w), gc, int(d), 0.0f, io.dv + jlo * io.lddv, int(io.lddv));
          finish_keys(pk, dpk, jlo, w, 1.0f);
          kdone = jlo;
        }
        // the chunk's rows join U and u
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(f), int(d), int(c), 1.0f, pq,
                    int(f), gc, int(d), 1.0f, u_mat, int(d));
        cblas_sgemv(CblasRowMajor, CblasTrans, int(c), int(f), 1.0f, pq, int(f), ddc, 1, 1.0f,
                    u_vec, 1);
      }
    }
    finish_upto(0);
  }

  const FeatureMap& fm;
  const Problem& p;
  const HeadGrads& io;
  const int64_t b, f, d, n, m, R, C, blocks;
  std::vector<float> shifts;  // the key shift of each row block
  float *phq, *dphq, *phk, *dphk, *g, *dd, *a, *bm, *s, *z;
  const float *q, *k, *v, *den;
  int64_t ldq, ldk, ldv;
  // pass 2's suffix state: U and u (in s and z), the key shift they are at, and the keys
  // [kdone, m) already final
  float* u_mat = nullptr;
  float* u_vec = nullptr;
  float tau = -INFINITY;
  int64_t kdone = 0;
};

}  // namespace

void attend_backward_head(const FeatureMap& fm, const Problem& p, int64_t b, const Schedule& sc,
                          const HeadGrads& io, float* work) {
  HeadBackward hb(fm, p, b, sc, io, work);
  hb.forward_rows();
  hb.backward_rows();
}

void attend_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     ConstTensorView out, ConstTensorView dout, const float* den, TensorView dq,
                     TensorView dk, TensorView dv, int64_t features,
                     const std::function<const FeatureMap&(int64_t head)>& map_for_head) {
  const Schedule sc = Schedule::for_features(features);
  const int64_t heads = p.batch * p.heads, floats = backward_workspace_floats(sc, features, p.dim);
  const bool per_head = heads >= team_threads();
  OmpGuard guard;
#pragma omp parallel if (per_head)
  {
    std::optional<Aligned> work;
    guard.run([&] { work.emplace(floats); });
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < heads; ++bh)
      guard.run([&] {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        const HeadGrads io{q.head(b, h),    k.head(b, h),   v.head(b, h),    out.head(b, h),
                           dout.head(b, h), den + bh * p.n, q.stride_row,    k.stride_row,
                           v.stride_row,    out.stride_row, dout.stride_row, dq.head(b, h),
                           dk.head(b, h),   dv.head(b, h),  dq.stride_row,   dk.stride_row,
                           dv.stride_row};
        attend_backward_head(map_for_head(h), p, b, sc, io, work->get());
      });
  }
  guard.rethrow();
}

double attend_backward_flops(const Problem& p, int64_t features, double query_map_flops,
                             double key_map_flops, double query_back_flops, double key_back_flops) {
  const Schedule sc = Schedule::for_features(features);
  const double f = double(features), d = double(p.dim);
  const int64_t n = p.n, R = sc.block, C = sc.chunk;
  double total = 0;
  int64_t kdone = 0;
  // per key: pass 1 maps and folds it (S and z), pass 2 maps it again, forms dphi(k) (V U^T,
  // + u) and dv (phi(K) U), and goes back through the map
  auto key = [&](int64_t cnt) {
    total +=
        double(cnt) * (2.0 * key_map_flops + 2.0 * f * d + f + 4.0 * f * d + f + key_back_flops);
  };
  for (int64_t i0 = 0; i0 < n; i0 += R) {
    const int64_t rows = std::min(R, n - i0);
    const int64_t kv = p.visible(i0), ke = p.visible(i0 + rows - 1);
    if (kv > kdone) key(kv - kdone), kdone = kv;
    if (ke == 0) continue;
    // per row: phi(q) twice, g and dden (3 d), G S^T and dden z (2 F d + 2 F), U and u
    // (2 F d + 2 F), the map's backward
    total +=
        double(rows) * (2.0 * query_map_flops + 3.0 * d + 4.0 * f * d + 4.0 * f + query_back_flops);
    const int64_t step = ke > kdone ? C : rows;
    for (int64_t a0 = 0; a0 < rows; a0 += step) {
      const int64_t c = std::min(step, rows - a0);
      const int64_t je = p.visible(i0 + a0 + c - 1);
      if (je > kdone) {
        // B twice (2 d + 1), B phi(K) (2 F), A (2 F), B^T phi(Q) (2 F), A^T G (2 d)
        total += double(c) * double(je - kdone) * (6.0 * d + 2.0 + 6.0 * f);
        key(je - kdone);
        kdone = je;
      }
    }
  }
  return total * double(p.batch * p.heads);
}

double attend_backward_bytes(const Problem& p, int64_t features) {
  const Schedule sc = Schedule::for_features(features);
  const double per_thread =
      double(
          round_up(backward_workspace_floats(sc, features, p.dim) * int64_t(sizeof(float)), 64)) +
      double((p.n + sc.block - 1) / sc.block) * sizeof(float);
  const int threads = team_threads();
  double bytes = per_thread * attend_threads(p);
  if (p.batch * p.heads < threads && threads > 1) bytes += 524296.0;  // as attend_bytes
  return bytes;
}

}  // namespace attnbench::feature_map
