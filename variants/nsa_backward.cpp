// nsa's backward pass (the Backward of variants/nsa.cpp): the gradient of its forward function
// with every position's selection blocks held fixed (a discrete top-n of the block scores,
// piecewise constant in q and k, as the paper's kernels train it).
//
// Per query head and position t, out_t = sum_c g_c o_c over the branches c (compression,
// selection, window), each o_c softmax attention of q_t over its keys with log-sum-exp lse_c.
// With dot_c = dout_t . o_c (from the saved branch outputs):
//   dL/dg_c = dot_c (the gradient of a given gate g_c), and for a stood-in gate
//   g_c = sigmoid(q_t . u_c): dq_t += g_c (1 - g_c) dot_c u_c;
//   per branch, softmax attention's backward with upstream gradient g_c dout_t: with
//   W = g_c P (P = exp(s q.k - lse_c), 0 off the branch's keys), dV += W^T dO, dP = dO V^T,
//   dS = W ∘ (dP - dot_c) (that is P ∘ (g_c dP - D_c) with D_c = g_c dot_c), dQ += s dS K,
//   dK += s dS^T Q;
//   the compression branch attends the pooled rows K~, V~ (means of l rows every s): their
//   gradients go back to every key and value row a pooled row covers, divided by l.
// The block scores (the compression probabilities summed per selection block) only choose
// the blocks: no gradient flows through them.
//
// Saved (forward_train, nsa::Saved): the chosen blocks [B, G, n, top], the three branch outputs
// [3][B, H, n, d] and the selection and window log-sum-exps [2][B, H, n]. Tasks are (batch,
// query head), each owning its head's dq, dk and dv (Variant::compute_backward sums dk and dv
// over a grouped-query group); per task, numbered steps:
//   1. gates: dot_c and g_c per position, the given gates' gradients, the stand-ins' share of dq;
//   2. compression: the pooled rows recomputed, tiles of kRows positions against the pooled
//      rows they see (dense Eigen products, masked per row), dK~ and dV~ spread back to k, v;
//   3. selection: the positions that chose each block gathered in tiles of kRows, each tile
//      one set of products with the block's keys, causally masked in the diagonal block; the
//      gathered dQ rows are added back;
//   4. window: tiles of kWinRows positions walking their band in blocks of kWinBlock keys.
// Time about 10 d per (row, key) of the three branches (2.5 times the forward's 4 d) plus the
// pooling; memory per thread O(nc d + kRows (nc + l' + d) + n top) for nc pooled rows.
#include <Eigen/Dense>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"
#include "common/core/threads.h"
#include "common/kernels/softmax.h"
#include "variants/nsa.h"

namespace attnbench::nsa {
namespace {

constexpr int64_t kRows = 128;     // positions per compression tile and per gathered selection tile
constexpr int64_t kWinRows = 64;   // positions per window tile
constexpr int64_t kWinBlock = 64;  // keys per window block

/// One task: query head h of batch element b over every position. Row t of q is q + t q_sr
/// (k, v, dout, dq, dk, dv likewise with their own strides).
struct HeadIo {
  const float *q, *k, *v, *dout;
  int64_t q_sr, k_sr, v_sr, do_sr;
  float *dq, *dk, *dv;
  int64_t dq_sr, dk_sr, dv_sr;
  std::array<const float*, 3> o;      // saved branch outputs, row t at o[c] + t d
  std::array<const float*, 2> lse;    // saved selection and window log-sum-exps, at [t]
  const int32_t* chosen;              // position t's blocks at chosen + t top, -1 padded
  const float* u;                     // the stand-in gate vectors [3][d] of head h
  std::array<const float*, 3> given;  // the given gates at [t], or null (stood in)
  std::array<float*, 3> dgate;        // their gradients at [t], or null
  int64_t n, d;
  float scale;
};

/// Per-thread buffers of one task.
struct Scratch {
  Scratch(const Config& c, int64_t n, int64_t d) : nc(c.pooled(n)) {
    const int64_t cols = std::max({nc, c.lsel, kWinBlock});
    for (auto* x : {&kc, &vc, &dkc, &dvc}) x->resize(size_t(std::max<int64_t>(nc, 1) * d));
    for (auto* x : {&w, &dp}) x->resize(size_t(kRows * cols));
    for (auto* x : {&qg, &dog, &dqg}) x->resize(size_t(kRows * d));
    for (auto* x : {&gate, &dot}) x->resize(size_t(3 * n));
    for (auto* x : {&gg, &dotg, &lseg}) x->resize(size_t(kRows));
    start.resize(size_t((n - 1) / c.lsel + 2));
    rows.resize(size_t(n * c.top));
  }
  static double bytes(const Config& c, int64_t n, int64_t d) {
    const int64_t nc = c.pooled(n), cols = std::max({nc, c.lsel, kWinBlock});
    return 4.0 * double(4 * std::max<int64_t>(nc, 1) * d + 2 * kRows * cols + 3 * kRows * d +
                        6 * n + 3 * kRows + (n - 1) / c.lsel + 2 + n * c.top);
  }
  int64_t nc;
  std::vector<float> kc, vc, dkc, dvc;  // pooled rows [nc, d] and their gradients
  std::vector<float> w, dp;             // a tile's W (then dS) and dP
  std::vector<float> qg, dog, dqg;      // gathered q, dout rows and their dq
  std::vector<float> gate, dot;         // [3][n]: g_c and dot_c per position
  std::vector<float> gg, dotg, lseg;    // a gathered tile's g, dot and lse
  std::vector<int32_t> start, rows;     // block j's positions: rows[start[j] .. start[j + 1])
};

/// Step 1: g_c and dot_c of every position into s, the given gates' gradients, and dq
/// initialised with the stood-in gates' share (0 where every gate is given).
void gates_step(const HeadIo& io, Scratch& s) {
  const int64_t n = io.n, d = io.d;
  for (int64_t t = 0; t < n; ++t) {
    const float* qt = io.q + t * io.q_sr;
    const float* dt = io.dout + t * io.do_sr;
    float* dqt = io.dq + t * io.dq_sr;
    std::fill(dqt, dqt + d, 0.0f);
    for (size_t c = 0; c < 3; ++c) {
      const float* oc = io.o[c] + t * d;
      float dot = 0.0f;
      for (int64_t e = 0; e < d; ++e) dot += dt[e] * oc[e];
      s.dot[c * size_t(n) + size_t(t)] = dot;
      float g;
      if (io.given[c]) {
        g = io.given[c][t];
        if (io.dgate[c]) io.dgate[c][t] = dot;
      } else {  // g = sigmoid(q . u_c), as the forward computes it
        const float* u = io.u + int64_t(c) * d;
        float z = 0.0f;
        for (int64_t e = 0; e < d; ++e) z += qt[e] * u[e];
        g = 1.0f / (1.0f + std::exp(-z));
        const float f = g * (1.0f - g) * dot;
        for (int64_t e = 0; e < d; ++e) dqt[e] += f * u[e];
      }
      s.gate[c * size_t(n) + size_t(t)] = g;
    }
  }
}

/// Row-major C (m x n, ldc) = alpha op(A) op(B) + beta C (beta 0: C's contents ignored),
/// op(A) m x k. Eigen's products: with -march=native they take the machine's widest vectors,
/// where OpenBLAS may have picked an older kernel for a CPU it does not recognise.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Const = Eigen::Map<const Mat, 0, Eigen::OuterStride<>>;
  Eigen::Map<Mat, 0, Eigen::OuterStride<>> C(c, m, n, Eigen::OuterStride<>(ldc));
  const Const A(a, ta ? k : m, ta ? m : k, Eigen::OuterStride<>(lda));
  const Const B(b, tb ? n : k, tb ? k : n, Eigen::OuterStride<>(ldb));
  if (beta == 0.0f)
    C.setZero();
  else if (beta != 1.0f)
    C *= beta;
  if (ta && tb)
    C.noalias() += alpha * A.transpose() * B.transpose();
  else if (ta)
    C.noalias() += alpha * A.transpose() * B;
  else if (tb)
    C.noalias() += alpha * A * B.transpose();
  else
    C.noalias() += alpha * A * B;
}

/// The products of one tile of R rows (Q, dO) against C keys (K, V), given W = g P (R x C at
/// w, 0 off the rows' keys) and each row's dot_c: dV += W^T dO, dP = dO V^T, dS = W ∘ (dP -
/// dot) (in w), dQ = beta dQ + s dS K, dK += s dS^T Q.
struct Tile {
  int64_t R, C, d;
  const float* Q;
  int64_t ldq;
  const float* dO;
  int64_t ldo;
  const float* K;
  int64_t ldk;
  const float* V;
  int64_t ldv;
};

void tile_grads(const Tile& t, float scale, const float* dot, float* w, float* dp, float* dQ,
                int64_t lddq, float beta_dq, float* dK, int64_t lddk, float* dV, int64_t lddv) {
  const int64_t R = t.R, C = t.C, d = t.d;
  gemm(true, false, C, d, R, 1.0f, w, C, t.dO, t.ldo, 1.0f, dV, lddv);
  gemm(false, true, R, C, d, 1.0f, t.dO, t.ldo, t.V, t.ldv, 0.0f, dp, C);
  for (int64_t r = 0; r < R; ++r) {
    float* wr = w + r * C;
    const float* pr = dp + r * C;
    const float dr = dot[r];
    for (int64_t x = 0; x < C; ++x) wr[x] *= pr[x] - dr;
  }
  gemm(false, false, R, d, C, scale, w, C, t.K, t.ldk, beta_dq, dQ, lddq);
  gemm(true, false, C, d, R, scale, w, C, t.Q, t.ldq, 1.0f, dK, lddk);
}

/// Step 2: the compression branch, against the pooled rows recomputed from k and v; the pooled
/// rows' gradients go back to the rows they average.
void compression_step(const Config& c, const HeadIo& io, Scratch& s) {
  const int64_t n = io.n, d = io.d, nc = s.nc;
  if (nc == 0) return;
  pool(c, io.k, io.k_sr, d, 0, nc, s.kc.data());
  pool(c, io.v, io.v_sr, d, 0, nc, s.vc.data());
  std::fill_n(s.dkc.begin(), nc * d, 0.0f);
  std::fill_n(s.dvc.begin(), nc * d, 0.0f);
  const float* gate = s.gate.data();
  for (int64_t t0 = 0; t0 < n; t0 += kRows) {
    const int64_t R = std::min(kRows, n - t0), C = std::min(nc, c.visible(t0 + R - 1));
    if (C == 0) continue;
    const Tile tile{R,        C,           d, io.q + t0 * io.q_sr, io.q_sr, io.dout + t0 * io.do_sr,
                    io.do_sr, s.kc.data(), d, s.vc.data(),         d};
    gemm(false, true, R, C, d, 1.0f, tile.Q, tile.ldq, s.kc.data(), d, 0.0f, s.w.data(), C);
    for (int64_t r = 0; r < R; ++r) {  // W = g P: the softmax over the row's visible blocks
      float* x = s.w.data() + r * C;
      const int64_t vis = std::min(C, c.visible(t0 + r));
      std::fill(x + vis, x + C, 0.0f);
      if (vis == 0) continue;
      const float f = gate[t0 + r] / exp_sum(x, vis, io.scale, row_max(x, vis));
      for (int64_t i = 0; i < vis; ++i) x[i] *= f;
    }
    tile_grads(tile, io.scale, s.dot.data() + t0, s.w.data(), s.dp.data(), io.dq + t0 * io.dq_sr,
               io.dq_sr, 1.0f, s.dkc.data(), d, s.dvc.data(), d);
  }
  const float inv = 1.0f / float(c.l);
  for (int64_t i = 0; i < nc; ++i)
    for (int64_t j = i * c.s; j < i * c.s + c.l; ++j) {
      float* dk = io.dk + j * io.dk_sr;
      float* dv = io.dv + j * io.dv_sr;
      const float* gk = s.dkc.data() + i * d;
      const float* gv = s.dvc.data() + i * d;
      for (int64_t e = 0; e < d; ++e) dk[e] += inv * gk[e], dv[e] += inv * gv[e];
    }
}

/// The positions that chose each block, in s.start / s.rows (ascending per block).
void list_block_rows(const Config& c, const HeadIo& io, Scratch& s) {
  const int64_t nb = (io.n - 1) / c.lsel + 1;
  int32_t* off = s.start.data();
  std::fill(off, off + nb + 1, 0);
  for (int64_t t = 0; t < io.n; ++t)
    for (int64_t e = 0; e < c.top && io.chosen[t * c.top + e] >= 0; ++e)
      ++off[io.chosen[t * c.top + e] + 1];
  for (int64_t j = 0; j < nb; ++j) off[j + 1] += off[j];
  for (int64_t t = 0; t < io.n; ++t)  // off[j] moves to the end of block j's list ...
    for (int64_t e = 0; e < c.top && io.chosen[t * c.top + e] >= 0; ++e)
      s.rows[size_t(off[io.chosen[t * c.top + e]]++)] = int32_t(t);
  for (int64_t j = nb; j > 0; --j) off[j] = off[j - 1];  // ... and back to its start
  off[0] = 0;
}

/// Step 3 for block j and its listed positions x0 .. x0 + R - 1 (at s.rows): gathered, one
/// tile against the block's keys, their dq added back.
void selection_tile(const Config& c, const HeadIo& io, Scratch& s, int64_t j, int64_t x0,
                    int64_t R) {
  const int64_t n = io.n, d = io.d, j0 = j * c.lsel, C = std::min(c.lsel, n - j0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = s.rows[size_t(x0 + r)];
    std::memcpy(s.qg.data() + r * d, io.q + t * io.q_sr, size_t(d) * sizeof(float));
    std::memcpy(s.dog.data() + r * d, io.dout + t * io.do_sr, size_t(d) * sizeof(float));
    s.gg[size_t(r)] = s.gate[size_t(n + t)];
    s.dotg[size_t(r)] = s.dot[size_t(n + t)];
    s.lseg[size_t(r)] = io.lse[0][t];
  }
  const Tile tile{R,       C,
                  d,       s.qg.data(),
                  d,       s.dog.data(),
                  d,       io.k + j0 * io.k_sr,
                  io.k_sr, io.v + j0 * io.v_sr,
                  io.v_sr};
  gemm(false, true, R, C, d, 1.0f, s.qg.data(), d, tile.K, io.k_sr, 0.0f, s.w.data(), C);
  for (int64_t r = 0; r < R; ++r) {  // W = g exp(s q.k - lse) over the keys up to t
    float* x = s.w.data() + r * C;
    const int64_t lim = std::min(C, s.rows[size_t(x0 + r)] - j0 + 1);
    const float g = s.gg[size_t(r)], l = s.lseg[size_t(r)];
    for (int64_t i = 0; i < lim; ++i) x[i] = g * fast_exp(x[i] * io.scale - l);
    std::fill(x + lim, x + C, 0.0f);
  }
  tile_grads(tile, io.scale, s.dotg.data(), s.w.data(), s.dp.data(), s.dqg.data(), d, 0.0f,
             io.dk + j0 * io.dk_sr, io.dk_sr, io.dv + j0 * io.dv_sr, io.dv_sr);
  for (int64_t r = 0; r < R; ++r) {
    float* dqt = io.dq + s.rows[size_t(x0 + r)] * io.dq_sr;
    const float* x = s.dqg.data() + r * d;
    for (int64_t e = 0; e < d; ++e) dqt[e] += x[e];
  }
}

/// Step 3: the selection branch, block by block over the positions that chose it.
void selection_step(const Config& c, const HeadIo& io, Scratch& s) {
  list_block_rows(c, io, s);
  const int64_t nb = (io.n - 1) / c.lsel + 1;
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t x0 = s.start[size_t(j)]; x0 < s.start[size_t(j + 1)]; x0 += kRows)
      selection_tile(c, io, s, j, x0, std::min<int64_t>(kRows, s.start[size_t(j + 1)] - x0));
}

/// Step 4: the window branch, keys max(0, t - w + 1) .. t, in tiles of kWinRows positions and
/// blocks of kWinBlock keys.
void window_step(const Config& c, const HeadIo& io, Scratch& s) {
  const int64_t n = io.n, d = io.d;
  if (c.w == 0) return;
  for (int64_t u0 = 0; u0 < n; u0 += kWinRows) {
    const int64_t R = std::min(kWinRows, n - u0), u1 = u0 + R - 1;
    for (int64_t j0 = std::max<int64_t>(0, u0 - c.w + 1); j0 <= u1; j0 += kWinBlock) {
      const int64_t C = std::min(kWinBlock, u1 + 1 - j0);
      const Tile tile{R,        C,
                      d,        io.q + u0 * io.q_sr,
                      io.q_sr,  io.dout + u0 * io.do_sr,
                      io.do_sr, io.k + j0 * io.k_sr,
                      io.k_sr,  io.v + j0 * io.v_sr,
                      io.v_sr};
      gemm(false, true, R, C, d, 1.0f, tile.Q, io.q_sr, tile.K, io.k_sr, 0.0f, s.w.data(), C);
      for (int64_t r = 0; r < R; ++r) {  // W = g exp(s q.k - lse) over t - w < j <= t
        const int64_t t = u0 + r;
        const float g = s.gate[size_t(2 * n + t)], l = io.lse[1][t];
        float* x = s.w.data() + r * C;
        for (int64_t i = 0; i < C; ++i) {
          const int64_t key = j0 + i;
          x[i] = key <= t && key > t - c.w ? g * fast_exp(x[i] * io.scale - l) : 0.0f;
        }
      }
      tile_grads(tile, io.scale, s.dot.data() + 2 * n + u0, s.w.data(), s.dp.data(),
                 io.dq + u0 * io.dq_sr, io.dq_sr, 1.0f, io.dk + j0 * io.dk_sr, io.dk_sr,
                 io.dv + j0 * io.dv_sr, io.dv_sr);
    }
  }
}

/// The task of query head h of batch element b.
HeadIo head_io(const Problem& p, const Config& c, int64_t b, int64_t h, ConstTensorView q,
               ConstTensorView k, ConstTensorView v, ConstTensorView dout, const Saved& saved,
               TensorView dq, TensorView dk, TensorView dv, const std::vector<float>& u,
               const std::array<const float*, 3>& given, const std::array<float*, 3>& dgates) {
  const int64_t n = p.n, d = p.dim, bh = b * p.heads + h, bhn = p.batch * p.heads * n;
  HeadIo io{};
  io.q = q.head(b, h), io.k = k.head(b, h), io.v = v.head(b, h), io.dout = dout.head(b, h);
  io.q_sr = q.stride_row, io.k_sr = k.stride_row, io.v_sr = v.stride_row;
  io.do_sr = dout.stride_row;
  io.dq = dq.head(b, h), io.dk = dk.head(b, h), io.dv = dv.head(b, h);
  io.dq_sr = dq.stride_row, io.dk_sr = dk.stride_row, io.dv_sr = dv.stride_row;
  io.u = u.data() + h * 3 * d;
  io.n = n, io.d = d, io.scale = float(1.0 / std::sqrt(double(d)));
  for (size_t x = 0; x < 3; ++x) {
    io.o[x] = saved.branch.data() + (int64_t(x) * bhn + bh * n) * d;
    io.given[x] = given[x] ? given[x] + bh * n : nullptr;
    io.dgate[x] = dgates[x] ? dgates[x] + bh * n : nullptr;
  }
  for (size_t x = 0; x < 2; ++x) io.lse[x] = saved.lse.data() + int64_t(x) * bhn + bh * n;
  io.chosen = saved.chosen.data() + (b * p.kv_head_count() + p.kv_head(h)) * n * c.top;
  return io;
}

}  // namespace

void backward(const Config& c, const Problem& p, ConstTensorView q, ConstTensorView k,
              ConstTensorView v, ConstTensorView dout, const Saved& saved, TensorView dq,
              TensorView dk, TensorView dv, std::array<const float*, 3> given,
              std::array<float*, 3> dgates) {
  if (dk.group != 1 || dv.group != 1)
    throw UsageError(
        "nsa: the backward writes one dk and dv head per query head (Variant::compute_backward "
        "sums them over a grouped-query group)");
  const std::vector<float> u = gate_vectors(p.seed, p.heads, p.dim);
  const SerialIfSmall small(backward_flops(c, p));
  parallel_for(
      p.batch * p.heads, [&] { return Scratch(c, p.n, p.dim); },
      [&](int64_t bh, Scratch& s) {
        const HeadIo io = head_io(p, c, bh / p.heads, bh % p.heads, q, k, v, dout, saved, dq, dk,
                                  dv, u, given, dgates);
        for (int64_t t = 0; t < p.n; ++t) {
          std::fill_n(io.dk + t * io.dk_sr, p.dim, 0.0f);
          std::fill_n(io.dv + t * io.dv_sr, p.dim, 0.0f);
        }
        gates_step(io, s);
        compression_step(c, io, s);
        selection_step(c, io, s);
        window_step(c, io, s);
      });
}

double backward_flops(const Config& c, const Problem& p) {
  // per (head, position t): 10 d per key of the three branches (five products), the gates and
  // dots 12 d; per head the pooling of k and v and the spreading of their gradients, 8 l d
  // per pooled row
  double keys = 0;
  for (int64_t t = 0; t < p.n; ++t) keys += double(c.row_keys(t));
  const double d = double(p.dim);
  return double(p.batch * p.heads) *
         (10.0 * d * keys + 12.0 * d * double(p.n) + 8.0 * double(c.l) * d * double(c.pooled(p.n)));
}

double backward_bytes(const Config& c, const Problem& p) {
  const int64_t threads = std::min<int64_t>(team_threads(), p.batch * p.heads);
  return double(threads) * Scratch::bytes(c, p.n, p.dim) + 4.0 * double(p.heads * 3 * p.dim);
}

}  // namespace attnbench::nsa
