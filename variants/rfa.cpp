// rfa: Random Feature Attention (Peng, Pappas, Yogatama, Schwartz, Smith & Kong 2021, "Random
// Feature Attention", ICLR): random Fourier features of L2-normalised queries and keys.
//
//   x^ = x / |x|  (x^ = 0 for x = 0),   W: D x d with entries N(0, sigma^-2)   (D = features)
//   phi(x) = D^-1/2 [sin(W x^), cos(W x^)]   (2 D features; |phi(x)| = 1 exactly)
//   E_W[phi(x)^T phi(y)] = exp(-|x^ - y^|^2 / (2 sigma^2)) = exp(-1/sigma^2) exp(x^.y^ / sigma^2)
//
// so the ratio below estimates softmax(q^.k^ / sigma^2) attention (the constant cancels):
//   plain:  out_i = phi(q_i)^T S_i / den_i,   S_i = sum_j phi(k_j) v_j^T,  z_i = sum_j phi(k_j)
//   gated (gate=true, causal only): key j carries the gate g_j = sigmoid(w_g . k_j + b_g),
//           S_j = g_j S_{j-1} + (1 - g_j) phi(k_j) v_j^T,   z_j = g_j z_{j-1} + (1 - g_j) phi(k_j),
//           out_i = phi(q_i)^T S_a / den_i   with a = a(i) = i + (m - n), the last key row i sees
// the sums running over the keys query i sees (bottom-right aligned causal mask; m != n works,
// rows with no visible key give exactly 0). The gated form is a recurrence over positions: the
// paper defines it for causal (decoder) attention only, and a non-causal gated problem is
// refused with UnsupportedError.
//
// Key padding (Problem::key_lengths): the keys j >= L_b of batch element b are absent, as if
// that element had only its L_b valid keys. Plain: every sum (S, z, the key count M_i of the
// floor) runs over the keys row i sees, p.visible(b, i), the intersection of the causal prefix
// (bottom-right aligned on the full m) and the valid keys. Gated: the recurrence runs over the
// valid keys only, and a row whose last causally visible key a(i) is padding reads the state
// after the last valid key, L_b - 1. W and the gate depend on the head alone, so a valid key's
// features are those it has without padding. A row that sees no key (L_b = 0) is exactly 0.
//
// Denominator floor. Sines and cosines make phi(q)^T z an estimate that can be small or
// negative (a known weakness of these features). Each key of weight omega (1 plain; the
// product of the later gates times 1 - g_j gated) has a true kernel of at least
// exp(-2 / sigma^2) (unit vectors are at most 2 apart), so
//   den_i = max(phi(q_i)^T z_i, tau exp(-2 / sigma^2) M_i),   tau = 1/4,
// M_i the sum of the weights row i sees (its visible key count plain; 1 - prod g gated): a
// denominator below a quarter of the smallest possible expectation is noise, and dividing by
// it would blow the row up. notes() counts the rows raised to the floor. Never NaN or inf: a
// floor that underflows (large sigma^-2 with huge gates) leaves a 0 row, as a zero denominator.
//
// Parameters: features = D = 128 (attnbench's default, not a figure taken from the paper: phi
// then has 2 D = 256 entries, as many as performer's default F, so the two compare at equal
// state size), sigma = 1 (the paper treats sigma as a parameter of the model; with nothing
// trained here it is fixed, 1 giving logits q^.k^ in [-1, 1]; the kernel identity needs the
// entries of W to have variance sigma^-2, where the paper writes sigma^2), gate = false.
// Random draws: W per head from RandomStream(seed, mix64(kRfaStream + 2 h)) (value f d + c is
// W[f][c] sigma, so W for D rows is the first rows of W for more); the gate per head from
// RandomStream(seed, mix64(kRfaStream + 2 h + 1)): w_g[c] = N(0, 1/d) (so w_g . k is of order 1
// for unit-variance keys) and b_g = N(0, 1). The same draws serve every batch item of a head.
// They depend on (seed, head, D, d, sigma) alone: prepare() draws them once per problem and
// forward() reuses them (reported as prepare_s and in the notes); a forward() without
// prepare() draws them on every call.
//
// Oracle: the formulas above in double (rfa_oracle): the same W and gates (rfa_projection,
// rfa_gate), explicit sums over the visible keys with each key's weight written out as a
// product of gates (not the recurrence), and the same floor.
// Tolerance (rfa_tolerance): the float32 error model of common/reference/oracle.h for this chain, a
// norm and a projection over d whose results, of size up to A = sqrt(2 ln 2D) / sigma (the
// largest of D Gaussians of deviation 1 / sigma) enter sin and cos as logits enter exp;
// reductions over the 2 D features and the m keys; a few roundings (norm, sin/cos, scaling,
// division; gated also the gate and the two products of each step). Every term of phi(q)^T z
// is at most M_i in size (|phi| = 1), so an error relative to M_i is amplified by at most
// M_i / den_i <= exp(2 / sigma^2) / tau, which multiplies the model (about 30 at sigma = 1).
//
// Plain: the chunked engine of common/engines/feature_map_attention.h with 2 D features (its
// denominator floor hook). Time O((n + m) D d + n 16 (D + d)), memory O(H D d + threads D (4 R + 2
// d)), R = min(1024, 32768 / D). Gated: a recurrence over the keys of each (batch, head), features
// mapped in blocks of 256 rows. Time O((n + m) D d), memory O(H D d + threads D (1024 + 2 d)).
// Backward, plain: attend_backward with the derivative of the map through sin, cos and the
// normalisation x / |x|; rows raised to the floor divide by a constant (their key count).
// Gated (gated_head_backward): reverse-mode through the recurrence, its state rebuilt chunk by
// chunk from checkpoints every 64 keys (never one state per position kept); the gates are
// differentiated (through w_g . k_j; a given g gets dL/dg_j instead, backward_inputs), and a
// row raised to the floor through its weight sum M_i = 1 - prod g, which depends on the gates.
// W, w_g and b_g are constants.
// Decode: plain, the engine's state (feature_map::prefill_state); gated, the recurrence's
// S, z and weight sum, one key per step (GatedDecodeState); either H (2 D d + 2 D + 2) 4 bytes
// per sequence whatever its length.
#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"
#include "common/core/prepared.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/engines/feature_map_attention.h"
#include "common/kernels/softmax.h"
#include "common/reference/oracle.h"
#include "variants/rfa_features.h"

namespace attnbench {
namespace {

namespace fmap = feature_map;

using rfa::rfa_gate;
using rfa::rfa_projection;
using rfa::RfaFeatureMap;

// The floor is this fraction of the smallest expected kernel, exp(-2 / sigma^2), per unit of
// key weight.
constexpr double kFloorFraction = 0.25;
// Rows per block of mapped features in the gated recurrence.
constexpr int64_t kGatedBlock = 256;

/// The denominator floor per unit of key weight: tau exp(-2 / sigma^2).
double floor_per_weight(double sigma) { return kFloorFraction * std::exp(-2.0 / (sigma * sigma)); }

/// The gates of one (batch, head): given (the input g, one entry per key) or the seeded
/// stand-in g_j = sigmoid(w_g . k_j + b_g).
struct KeyGate {
  const std::vector<float>& w;   ///< w_g (d entries) then b_g
  const float* given = nullptr;  ///< the head's m given gates, or null
  /// With given gates, where the backward writes their gradients dL/dg_j (m entries; the
  /// backward_inputs of a given g), or null.
  float* grad = nullptr;
};

/// The gate of key j (row kj): g and h = 1 - g; the stand-in's each as a sigmoid (no
/// cancellation in 1 - g).
inline void key_gate(const KeyGate& gate, const float* kj, int64_t j, int64_t d, float& g,
                     float& h) {
  if (gate.given) {
    g = gate.given[j];
    h = 1.0f - g;
    return;
  }
  float x = gate.w[size_t(d)];
  for (int64_t c = 0; c < d; ++c) x += gate.w[size_t(c)] * kj[c];
  g = 1.0f / (1.0f + std::exp(-x));
  h = 1.0f / (1.0f + std::exp(x));
}

/// One key of the gated recurrence: S = g S + h phi(k) v^T, z = g z + h phi(k) and the weight
/// sum mass = g mass + h (pk: phi(k), f floats; vj: v, d floats).
inline void gated_fold(float* s, float* z, float& mass, const float* pk, const float* vj, float g,
                       float h, int64_t f, int64_t d) {
  for (int64_t e = 0; e < f; ++e) {
    float* srow = s + e * d;
    const float c = h * pk[e];
    for (int64_t x = 0; x < d; ++x) srow[x] = g * srow[x] + c * vj[x];
    z[e] = g * z[e] + c;
  }
  mass = g * mass + h;
}

/// A query read from the gated state: o = phi(q)^T S / phi(q)^T z (pq: phi(q)) by the engine's
/// row rule (feature_map::finish_row) with the key weight `mass`, so the floor is
/// floor * mass. Returns whether the denominator was raised to the floor.
inline bool gated_read(const float* pq, const float* s, const float* z, float mass, float floor,
                       float* o, int64_t f, int64_t d) {
  std::fill(o, o + d, 0.0f);
  float den = 0.0f;
  for (int64_t e = 0; e < f; ++e) {
    const float a = pq[e];
    const float* srow = s + e * d;
    for (int64_t x = 0; x < d; ++x) o[x] += a * srow[x];
    den += a * z[e];
  }
  return fmap::finish_row(o, d, den, floor, mass) < 0;
}

int64_t gated_workspace_floats(int64_t features, int64_t d) {
  return 2 * kGatedBlock * features + features * d + features;
}

/// Gated RFA on one (batch, head) of batch element b (causal): the recurrence over the valid
/// keys j < L_b, and each query i read right after its last visible key, a(i) = i + (m - n),
/// or after the last valid key L_b - 1 when a(i) is past it. Returns the rows raised to the
/// floor.
int64_t gated_head(const RfaFeatureMap& fm, const KeyGate& gate, const Problem& p, int64_t b,
                   const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                   int64_t ldv, float* out, int64_t ldo, float* work) {
  const int64_t f = fm.features(), d = p.dim, n = p.n, m = p.keys(), off = m - n;
  const int64_t len = p.key_lengths.empty() ? m : p.key_lengths[size_t(b)];
  const float floor = fm.denominator_floor();
  float *phk = work, *phq = phk + kGatedBlock * f, *s = phq + kGatedBlock * f, *z = s + f * d;
  std::fill(s, s + f * d, 0.0f);
  std::fill(z, z + f, 0.0f);
  float mass = 0.0f;  // sum of the key weights in S and z
  int64_t clamped = 0;
  // rows before the first key (a(i) < 0), or every row when no key is valid
  const int64_t empty = len == 0 ? n : std::min(n, std::max<int64_t>(0, -off));
  for (int64_t i = 0; i < empty; ++i) std::fill(out + i * ldo, out + i * ldo + d, 0.0f);
  // out_i = phi(q_i)^T S / den from the current state
  auto read = [&](const float* pq, float* o) {
    if (gated_read(pq, s, z, mass, floor, o, f, d)) ++clamped;
  };
  float shift = 0.0f;
  for (int64_t j0 = 0; j0 < len; j0 += kGatedBlock) {
    const int64_t cnt = std::min(kGatedBlock, len - j0);
    // 1. features of the block's keys and of the queries read after them
    fm.keys(k + j0 * ldk, ldk, cnt, phk, f, shift);
    const int64_t i0 = std::max<int64_t>(0, j0 - off), i1 = std::min(n, j0 + cnt - off);
    if (i1 > i0) fm.queries(q + i0 * ldq, ldq, i1 - i0, phq, f);
    for (int64_t t = 0; t < cnt; ++t) {
      const int64_t j = j0 + t;
      // 2. the gate of key j
      float g, h;
      key_gate(gate, k + j * ldk, j, d, g, h);
      // 3. S = g S + h phi(k_j) v_j^T, z = g z + h phi(k_j)
      gated_fold(s, z, mass, phk + t * f, v + j * ldv, g, h, f, d);
      // 4. the query that reads the state after key j
      const int64_t i = j - off;
      if (i >= 0 && i < n) read(phq + (i - i0) * f, out + i * ldo);
    }
  }
  // 5. rows whose last visible key is the last valid one (a(i) >= L_b: key padding) read the
  // final state
  for (int64_t i0 = std::max(empty, len - off); i0 < n; i0 += kGatedBlock) {
    const int64_t rows = std::min(kGatedBlock, n - i0);
    fm.queries(q + i0 * ldq, ldq, rows, phq, f);
    for (int64_t r = 0; r < rows; ++r) read(phq + r * f, out + (i0 + r) * ldo);
  }
  return clamped;
}

// Keys per chunk of the gated backward: the recurrence's state is checkpointed at the start
// of every chunk, and the states inside one chunk are recomputed and kept.
constexpr int64_t kGatedChunk = 64;

/// Floats of one thread's workspace for gated_head_backward on m keys: the checkpoints, the
/// C + 1 states of one chunk, the adjoint state, the chunk's key features, their gradients and
/// gate gradients, and one query row's features, gradients and d-vectors.
int64_t gated_backward_floats(int64_t features, int64_t d, int64_t m) {
  const int64_t state = features * d + features + 1;
  const int64_t chunks = std::max<int64_t>(1, (m + kGatedChunk - 1) / kGatedChunk);
  return (chunks + kGatedChunk + 2) * state + 2 * kGatedChunk * features + 3 * kGatedChunk +
         3 * features + d;
}

/// Back through one key's update S_j = g S_{j-1} + h phi_j v_j^T (z and mass alike, h =
/// 1 - g; `before`: the state S_{j-1}, z_{j-1}, mass_{j-1}). adj holds the adjoint (dS, dz,
/// dmass) of the state after the key on entry and of the state before it on return. Writes
/// dphi_j = h (dS v_j + dz) (f floats) and dv_j = h dS^T phi_j (d floats), and returns
/// dL/dg_j = dg - dh, the gate's gradient with h = 1 - g taken through it. w: f floats of
/// scratch.
float key_step_backward(const float* before, float* adj, const float* pk, const float* vj, float g,
                        float h, int64_t f, int64_t d, float* w, float* dphk, float* dvj) {
  const int64_t st = f * d + f + 1;
  const float* dS = adj;
  // dg = <(dS, dz, dmass), state before key j> (one dot over the contiguous layout)
  const float dg = cblas_sdot(int(st), adj, 1, before, 1);
  // w = dS v_j + dz, dh = phi_j . w + dmass, dphi_j = h w, dv_j = h dS^T phi_j
  std::copy_n(adj + f * d, f, w);
  cblas_sgemv(CblasRowMajor, CblasNoTrans, int(f), int(d), 1.0f, dS, int(d), vj, 1, 1.0f, w, 1);
  const float dh = cblas_sdot(int(f), pk, 1, w, 1) + adj[st - 1];
  for (int64_t e = 0; e < f; ++e) dphk[e] = h * w[e];
  cblas_sgemv(CblasRowMajor, CblasTrans, int(f), int(d), h, dS, int(d), pk, 1, 0.0f, dvj, 1);
  cblas_sscal(int(st), g, adj, 1);
  return dg - dh;
}

/// The gradients of gated RFA on one (batch, head) of batch element b (causal), of the
/// function gated_head computes. The state (S, z, mass) after each key is rebuilt, never
/// stored whole: a first pass over the valid keys keeps the state at the start of every chunk
/// of kGatedChunk keys; then, chunk by chunk from the last, the chunk's states are recomputed
/// from its checkpoint and the adjoints (dS, dz, dmass) run backwards through its keys:
///   a read out_i = phi_i^T S / den, den = phi_i^T z (or floor mass when raised to the floor):
///     dS += phi_i (dO_i / den)^T,  dz += phi_i dden (floor: dmass += floor dden),
///     dphi_i = S dO_i / den + z dden,  dden = -(dO_i . out_i) / den;
///   a key j, S_j = g S_{j-1} + h phi_j v_j^T (z and mass alike, h = 1 - g):
///     dg = <dS, S_{j-1}> + dz . z_{j-1} + dmass mass_{j-1},
///     dh = phi_j . (dS v_j + dz) + dmass,  dphi_j = h (dS v_j + dz),  dv_j = h dS^T phi_j,
///     g = sigmoid(x_j), x_j = w_g . k_j + b_g:  dx_j = g h (dg - dh),  dk_j gets dx_j w_g
///     (a given gate instead: dL/dg_j = dg - dh into gate.grad, nothing into dk_j),
///     then dS, dz, dmass are multiplied by g.
/// The maps' backward (x / |x|, sin, cos) turns dphi into dq and dk. Keys past L_b and rows
/// that see no key get 0. Time about three times the forward's; memory
/// gated_backward_floats.
void gated_head_backward(const RfaFeatureMap& fm, const KeyGate& gate, const Problem& p, int64_t b,
                         const fmap::HeadGrads& io, float* work) {
  const int64_t f = fm.features(), d = p.dim, n = p.n, m = p.keys(), off = m - n;
  const int64_t len = p.key_lengths.empty() ? m : p.key_lengths[size_t(b)];
  const float floor = fm.denominator_floor();
  const int64_t st = f * d + f + 1, C = kGatedChunk;
  const int64_t chunks = (len + C - 1) / C;
  float* ckpt = work;                                        // the checkpoints
  float* states = ckpt + std::max<int64_t>(1, chunks) * st;  // C + 1 states of a chunk
  float* adj = states + (C + 1) * st;                        // dS, dz, dmass
  float *phk = adj + st, *dphk = phk + C * f;                // C x f each
  float *gk = dphk + C * f, *hk = gk + C, *dx = hk + C;      // C each
  float *phq = dx + C, *dphq = phq + f, *w = dphq + f, *gu = w + f;
  for (int64_t i = 0; i < n; ++i) std::fill_n(io.dq + i * io.lddq, d, 0.0f);
  for (int64_t j = 0; j < m; ++j) {
    std::fill_n(io.dk + j * io.lddk, d, 0.0f);
    std::fill_n(io.dv + j * io.lddv, d, 0.0f);
  }
  if (gate.grad) std::fill_n(gate.grad, m, 0.0f);  // keys past L_b: 0
  if (len == 0) return;

  // features and gates of the keys [j0, j0 + cnt)
  auto key_chunk = [&](int64_t j0, int64_t cnt) {
    float shift = 0.0f;
    fm.keys(io.k + j0 * io.ldk, io.ldk, cnt, phk, f, shift);
    for (int64_t t = 0; t < cnt; ++t)
      key_gate(gate, io.k + (j0 + t) * io.ldk, j0 + t, d, gk[t], hk[t]);
  };
  // the state after key j0 + t from the state before it (the forward's update)
  auto step = [&](const float* from, float* to, int64_t t, int64_t j) {
    const float g = gk[t], h = hk[t];
    const float* pk = phk + t * f;
    const float* vj = io.v + j * io.ldv;
    for (int64_t e = 0; e < f; ++e) {
      const float c = h * pk[e];
      const float* a = from + e * d;
      float* o = to + e * d;
      for (int64_t x = 0; x < d; ++x) o[x] = g * a[x] + c * vj[x];
      to[f * d + e] = g * from[f * d + e] + c;
    }
    to[st - 1] = g * from[st - 1] + h;
  };
  // the gradient of the read of row i from the state `after`
  auto read_backward = [&](int64_t i, const float* after) {
    const float *S = after, *z = after + f * d;
    const float mass = after[st - 1];
    const float* qi = io.q + i * io.ldq;
    fm.queries(qi, io.ldq, 1, phq, f);
    // u = S^T phi (into gu), den = z . phi
    cblas_sgemv(CblasRowMajor, CblasTrans, int(f), int(d), 1.0f, S, int(d), phq, 1, 0.0f, gu, 1);
    float den = cblas_sdot(int(f), z, 1, phq, 1);
    const bool floored = !(den >= floor * mass);
    if (floored) den = floor * mass;
    if (!(den > 0.0f)) return;  // the row is 0 whatever its inputs: no gradient
    const float* go = io.dout + i * io.lddo;
    float dot = 0.0f;
    for (int64_t x = 0; x < d; ++x) dot += go[x] * gu[x];
    const float dden = -dot / (den * den);
    for (int64_t x = 0; x < d; ++x) gu[x] = go[x] / den;
    float *dS = adj, *dz = adj + f * d;
    // dS += phi gu^T, dphi = S gu
    cblas_sger(CblasRowMajor, int(f), int(d), 1.0f, phq, 1, gu, 1, dS, int(d));
    cblas_sgemv(CblasRowMajor, CblasNoTrans, int(f), int(d), 1.0f, S, int(d), gu, 1, 0.0f, dphq, 1);
    if (floored) {
      adj[st - 1] += floor * dden;
    } else {
      for (int64_t e = 0; e < f; ++e) dz[e] += phq[e] * dden, dphq[e] += z[e] * dden;
    }
    fm.queries_backward(qi, io.ldq, 1, phq, f, dphq, f, io.dq + i * io.lddq, io.lddq);
  };

  // 1. the checkpoints
  float* run = states;
  std::fill_n(run, st, 0.0f);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j0 = c * C, cnt = std::min(C, len - j0);
    std::copy_n(run, st, ckpt + c * st);
    key_chunk(j0, cnt);
    for (int64_t t = 0; t < cnt; ++t) step(run, run, t, j0 + t);
  }
  // 2. the chunks from the last, their keys from the last
  std::fill_n(adj, st, 0.0f);
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t j0 = c * C, cnt = std::min(C, len - j0);
    key_chunk(j0, cnt);
    std::copy_n(ckpt + c * st, st, states);
    for (int64_t t = 0; t < cnt; ++t) step(states + t * st, states + (t + 1) * st, t, j0 + t);
    for (int64_t t = cnt - 1; t >= 0; --t) {
      const int64_t j = j0 + t;
      // the rows that read the state after key j: i = j - off, and after the last valid key
      // every row whose last visible key is at or past it
      const int64_t r0 = std::max<int64_t>(0, j - off);
      const int64_t r1 = j == len - 1 ? n : std::min(n, j - off + 1);
      for (int64_t i = r0; i < r1; ++i) read_backward(i, states + (t + 1) * st);
      // back through S_j = g S_{j-1} + h phi_j v_j^T (and z, mass)
      const float dgate =
          key_step_backward(states + t * st, adj, phk + t * f, io.v + j * io.ldv, gk[t], hk[t], f,
                            d, w, dphk + t * f, io.dv + j * io.lddv);
      if (gate.grad)
        gate.grad[j] = dgate;
      else
        dx[t] = gk[t] * hk[t] * dgate;
    }
    // dk of the chunk's keys: through their maps, and through the stand-in gates
    fm.keys_backward(io.k + j0 * io.ldk, io.ldk, cnt, phk, f, dphk, f, io.dk + j0 * io.lddk,
                     io.lddk);
    if (gate.given) continue;
    for (int64_t t = 0; t < cnt; ++t) {
      float* dkj = io.dk + (j0 + t) * io.lddk;
      for (int64_t x = 0; x < d; ++x) dkj[x] += dx[t] * gate.w[size_t(x)];
    }
  }
}

/// The draws of one head: its feature map (W) and, gated, its gate (w_g, b_g).
struct RfaHead {
  RfaFeatureMap map;
  std::vector<float> gate;
};

/// The decode state of gated RFA (common/core/decode.h): per (batch, head) the recurrence's S
/// (F x d), z (F) and weight sum after every key so far, advanced one key per step with
/// gated_head's own update (gated_fold) and read (gated_read), so a step gives the gated
/// causal forward's row. The heads' draws are shared with the variant.
class GatedDecodeState final : public DecodeState {
 public:
  GatedDecodeState(const Problem& p, std::vector<std::shared_ptr<const RfaHead>> heads)
      : batch_(p.batch),
        heads_(p.heads),
        capacity_(p.n),
        d_(p.dim),
        heads_draws_(std::move(heads)) {
    f_ = heads_draws_.at(0)->map.features();
    stride_ = f_ * d_ + f_;
    state_.assign(size_t(batch_ * heads_ * stride_), 0.0f);
    mass_.assign(size_t(batch_ * heads_), 0.0f);
  }

  // The recurrence over keys 0 .. t0 - 1, their features mapped in blocks as gated_head does.
  void prefill(ConstTensorView k, ConstTensorView v, int64_t t0) {
    // the features of one key block per thread, freed when the prefill ends
    std::vector<float> work(size_t(kGatedBlock * f_ * threads()));
    for_each_head(work.data(), kGatedBlock * f_, [&](int64_t bh, float* phk) {
      const int64_t b = bh / heads_, h = bh % heads_;
      const RfaHead& hd = *heads_draws_[size_t(h)];
      const float *kh = k.head(b, h), *vh = v.head(b, h);
      float shift = 0.0f;  // RFA's features have no key scale
      for (int64_t j0 = 0; j0 < t0; j0 += kGatedBlock) {
        const int64_t cnt = std::min(kGatedBlock, t0 - j0);
        hd.map.keys(kh + j0 * k.stride_row, k.stride_row, cnt, phk, f_, shift);
        for (int64_t t = 0; t < cnt; ++t) {
          float g, gh;
          key_gate(KeyGate{hd.gate}, kh + (j0 + t) * k.stride_row, j0 + t, d_, g, gh);
          gated_fold(s(bh), z(bh), mass_[size_t(bh)], phk + t * f_, vh + (j0 + t) * v.stride_row, g,
                     gh, f_, d_);
        }
      }
    });
    length_ = t0;
  }

  int64_t length() const override { return length_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(length_, capacity_, Shape4{batch_, heads_, 1, d_}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const SerialIfSmall small(step_flops());
    const size_t need = size_t(2 * f_ * threads());
    if (work_.size() < need) work_.resize(need);
    for_each_head(work_.data(), 2 * f_, [&](int64_t bh, float* w) {
      const int64_t b = bh / heads_, h = bh % heads_;
      const RfaHead& hd = *heads_draws_[size_t(h)];
      float *phk = w, *phq = w + f_;
      float shift = 0.0f, g, gh;
      hd.map.keys(k.head(b, h), k.stride_row, 1, phk, f_, shift);
      key_gate(KeyGate{hd.gate}, k.head(b, h), length_, d_, g, gh);
      gated_fold(s(bh), z(bh), mass_[size_t(bh)], phk, v.head(b, h), g, gh, f_, d_);
      hd.map.queries(q.head(b, h), q.stride_row, 1, phq, f_);
      gated_read(phq, s(bh), z(bh), mass_[size_t(bh)], hd.map.denominator_floor(), out.head(b, h),
                 f_, d_);
    });
    ++length_;
  }

  // S, z, the weight sum and the key count per head
  double state_bytes() const override { return double(heads_ * (f_ * d_ + f_ + 2)) * 4.0; }
  // S, z and the weight sums; W (D x d) and the gate (d + 1) of every head; q, k, v
  double step_bytes_read() const override {
    const double bh = double(batch_ * heads_);
    return bh * double(f_ * d_ + f_ + 1) * 4.0 +
           double(heads_) * double((f_ / 2) * d_ + d_ + 1) * 4.0 + bh * 3.0 * double(d_) * 4.0;
  }
  double step_flops() const override {
    return double(batch_ * heads_) * (key_flops() + query_flops());
  }

 private:
  /// Per key: its map, the gate (2 d + 8), the update (3 per element of S and z).
  double key_flops() const {
    return heads_draws_[0]->map.key_flops() + 2.0 * double(d_) + 8.0 +
           3.0 * double(f_) * double(d_ + 1);
  }
  /// Per read: the query's map, phi(q)^T S and phi(q)^T z, the division.
  double query_flops() const {
    return heads_draws_[0]->map.query_flops() + 2.0 * double(f_) * double(d_ + 1) + double(d_);
  }

  float* s(int64_t bh) { return state_.data() + bh * stride_; }
  float* z(int64_t bh) { return s(bh) + f_ * d_; }
  // Threads of a loop over the (batch, head) pairs: the team when there are at least as many
  // pairs, else 1.
  int threads() const { return batch_ * heads_ >= team_threads() ? team_threads() : 1; }
  // body(bh, work) over every (batch, head), OpenMP over them on threads() threads; work:
  // the running thread's `floats` floats of pool (threads() floats floats)
  template <class Body>
  void for_each_head(float* pool, int64_t floats, const Body& body) const {
    const int64_t heads = batch_ * heads_;
    parallel_for(heads,
                 [&](int64_t bh) { body(bh, pool + int64_t(omp_get_thread_num()) * floats); },
                 {.parallel = threads() > 1});
  }

  int64_t batch_, heads_, capacity_, d_, f_ = 0, stride_ = 0, length_ = 0;
  std::vector<std::shared_ptr<const RfaHead>> heads_draws_;
  std::vector<float> state_;  // per (batch, head): S (F x d), then z (F)
  std::vector<float> mass_;   // the weight sum of each (batch, head)
  std::vector<float> work_;   // a step's per-thread phi(k), phi(q), kept between steps
};

class Rfa final : public Variant, public Backward, public Decoder {
 public:
  explicit Rfa(const ParamValues& pv)
      : freqs_(pv.get_int("features")), sigma_(pv.get_float("sigma")), gate_(pv.get_bool("gate")) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    check_gated(p);
    Heads::Heads fresh;
    const Heads::Heads& drawn = heads_.get(
        p, [&](int64_t h) { return make_head(p, h); }, fresh);
    rows_ = p.batch * p.heads * p.n;
    if (!gate_) {
      clamped_ =
          fmap::attend(p, q, k, v, out, 0.0f, 2 * freqs_,
                       [&](int64_t h) -> const fmap::FeatureMap& { return drawn[size_t(h)]->map; });
      return;
    }
    const int64_t heads = p.batch * p.heads, f = 2 * freqs_;
    const float* given = input(p, "g");  // [B, H, m]; null: the seeded gates stand in
    std::atomic<int64_t> clamped{0};
    parallel_for(
        heads, [&] { return std::vector<float>(size_t(gated_workspace_floats(f, p.dim))); },
        [&](int64_t bh, std::vector<float>& work) {
          const int64_t b = bh / p.heads, h = bh % p.heads;
          const KeyGate gate{drawn[size_t(h)]->gate, given ? given + bh * p.keys() : nullptr};
          clamped += gated_head(drawn[size_t(h)]->map, gate, p, b, q.head(b, h), q.stride_row,
                                k.head(b, h), k.stride_row, v.head(b, h), v.stride_row,
                                out.head(b, h), out.stride_row, work.data());
        });
    clamped_ = clamped.load();
  }

  bool prepare(const Problem& p) override {
    heads_.prepare(p, [&](int64_t h) { return make_head(p, h); });
    return true;
  }

  void check_backward(const Problem& p) const override {
    Backward::check_backward(p);
    check_gated(p);
  }

  // Saved, plain: each row's denominator (4 B H n bytes; the floor marked by its sign).
  // Gated: nothing; the backward runs the recurrence again (gated_head_backward).
  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    if (gate_) {
      forward(p, q, k, v, out);
      return std::make_unique<NothingSaved>();
    }
    auto saved = std::make_unique<fmap::RowDenominators>(p);
    Heads::Heads fresh;
    const Heads::Heads& drawn = heads_.get(
        p, [&](int64_t h) { return make_head(p, h); }, fresh);
    rows_ = p.batch * p.heads * p.n;
    clamped_ = fmap::attend(
        p, q, k, v, out, 0.0f, 2 * freqs_,
        [&](int64_t h) -> const fmap::FeatureMap& { return drawn[size_t(h)]->map; },
        saved->den.data());
    return saved;
  }

  using Variant::backward;  // the accessor stays visible beside the pass
  // A row raised to the floor divides by a constant (the floor): no gradient through its
  // denominator.
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    if (gate_) {
      NothingSaved::expect(saved, "rfa:gate=true");
      gated_backward(p, q, k, v, out, dout, dq, dk, dv, nullptr);
      return;
    }
    Heads::Heads fresh;
    const float* den = fmap::RowDenominators::of(saved, p).den.data();
    const Heads::Heads& drawn = heads_.get(
        p, [&](int64_t h) { return make_head(p, h); }, fresh);
    fmap::attend_backward(
        p, q, k, v, out, dout, den, dq, dk, dv, 2 * freqs_,
        [&](int64_t h) -> const fmap::FeatureMap& { return drawn[size_t(h)]->map; });
  }

  // A given g (gate=true): dL/dg_j, which the backward forms for every key anyway (for the
  // stand-in it takes it on through the sigmoid into dk).
  bool gives_input_grads() const override { return true; }
  void backward_inputs(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       ConstTensorView out, ConstTensorView dout, const SavedState& saved,
                       TensorView dq, TensorView dk, TensorView dv, InputGrads& dinputs) override {
    if (!gate_ || !input(p, "g"))
      throw UsageError(fmt::format("{}: backward_inputs without a given g", spec()));
    NothingSaved::expect(saved, "rfa:gate=true");
    std::vector<float>& dg = dinputs["g"];
    dg.assign(size_t(p.batch * p.heads * p.keys()), 0.0f);
    gated_backward(p, q, k, v, out, dout, dq, dk, dv, dg.data());
  }

  double backward_flops(const Problem& p) const override {
    const RfaFeatureMap fm({}, freqs_, p.dim, 0.0f);
    if (gate_) {
      const double f = double(fm.features()), d = double(p.dim);
      // per key: its map and gate and the update, twice (checkpoints, then the chunk's
      // states); the map's backward; the adjoints (dg, dS v, dv: 6 f d; the decay: f d)
      const double step = fm.key_flops() + 2.0 * d + 8.0 + 3.0 * f * (d + 1.0);
      const double per_key = 2.0 * step + fm.key_backward_flops() + 7.0 * f * (d + 1.0) + 2.0 * d;
      // per read: its map, u and den, dS += phi gu and S gu (4 f d), dz, the map's backward
      const double per_read = fm.query_flops() + 2.0 * f * (d + 1.0) + 4.0 * f * d + 4.0 * f +
                              4.0 * d + fm.query_backward_flops();
      const double reads = double(std::min(p.n, p.keys()));
      return double(p.batch * p.heads) * (double(p.keys()) * per_key + reads * per_read);
    }
    return fmap::attend_backward_flops(p, fm.features(), fm.query_flops(), fm.key_flops(),
                                       fm.query_backward_flops(), fm.key_backward_flops());
  }
  double saved_estimate(const Problem& p) const override {
    return gate_ ? double(sizeof(NothingSaved)) : fmap::RowDenominators::bytes(p);
  }
  // the projections (and gates) only when they are drawn for this call (not prepared)
  double backward_memory_estimate(const Problem& p) const override {
    const double drawn = heads_.ready(p) ? 0.0
                                         : double(p.heads) * double(freqs_ * p.dim) * 4.0 +
                                               (gate_ ? double(p.heads * (p.dim + 1)) * 4.0 : 0.0);
    if (!gate_) return drawn + fmap::attend_backward_bytes(p, 2 * freqs_);
    const int threads = std::min<int64_t>(team_threads(), p.batch * p.heads);
    return drawn +
           double(threads) * double(gated_backward_floats(2 * freqs_, p.dim, p.keys())) * 4.0;
  }

  // Plain: the engine's state with the forward's maps; gated: the recurrence's
  // (GatedDecodeState). Either way with the prepared draws, or drawn now.
  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override {
    Heads::Heads fresh;
    const Heads::Heads& drawn = heads_.get(
        p, [&](int64_t h) { return make_head(p, h); }, fresh);
    if (gate_) {
      check_prefill(p, k, v, t0);
      auto state = std::make_unique<GatedDecodeState>(
          p, std::vector<std::shared_ptr<const RfaHead>>(drawn.begin(), drawn.end()));
      state->prefill(k, v, t0);
      return state;
    }
    std::vector<std::shared_ptr<const fmap::FeatureMap>> maps;
    for (const std::shared_ptr<Head>& hd : drawn)
      maps.emplace_back(hd, &hd->map);  // shares the head's ownership
    return fmap::prefill_state(p, k, v, t0, 0.0f, std::move(maps), double(freqs_ * p.dim) * 4.0);
  }

  double prefill_flops(const Problem& p, int64_t t0) const override {
    const RfaFeatureMap fm({}, freqs_, p.dim, 0.0f);
    const double f = double(fm.features()), d = double(p.dim);
    if (!gate_) return fmap::prefill_flops(p, t0, fm.features(), fm.key_flops());
    // per key as flops() counts it: its map, the gate, the state update
    return double(p.batch * p.heads) * double(t0) *
           (fm.key_flops() + 2.0 * d + 8.0 + 3.0 * f * (d + 1.0));
  }

  std::string notes() const override {
    std::string text = heads_.note();
    if (clamped_ > 0)
      text += fmt::format(
          "{}{} of {} query rows ({:.2f}%) had a denominator phi(q)^T z below the floor "
          "(1/4 exp(-2/sigma^2) per unit of key weight) and were divided by the floor",
          text.empty() ? "" : "; ", clamped_, rows_, 100.0 * double(clamped_) / double(rows_));
    return text;
  }

  double flops(const Problem& p) const override {
    const RfaFeatureMap fm({}, freqs_, p.dim, 0.0f);
    const double f = double(fm.features()), d = double(p.dim);
    if (!gate_) return fmap::attend_flops(p, fm.features(), fm.query_flops(), fm.key_flops());
    // per key: its map, the gate (2 d + 8), the state update (3 per element of S and z);
    // per query read: its map, phi(q)^T S and phi(q)^T z, the division
    const double per_key = fm.key_flops() + 2.0 * d + 8.0 + 3.0 * f * (d + 1.0);
    const double per_query = fm.query_flops() + 2.0 * f * (d + 1.0) + d;
    const double reads = double(std::min(p.n, p.keys()));
    return double(p.batch * p.heads) * (double(p.keys()) * per_key + reads * per_query);
  }

  double memory_estimate(const Problem& p) const override {
    const double proj = double(p.heads) * double(freqs_ * p.dim) * 4.0;
    if (!gate_) return proj + fmap::attend_bytes(p, 2 * freqs_);
    const int threads = std::min<int64_t>(team_threads(), p.batch * p.heads);
    return proj + double(p.heads) * double(p.dim + 1) * 4.0 +
           double(threads) * double(gated_workspace_floats(2 * freqs_, p.dim)) * 4.0;
  }

 private:
  using Head = RfaHead;
  using Heads = PreparedHeads<Head>;
  // The gated backward of every (batch, head), with the given gates when p gives g (their
  // gradients into dg, [B, H, m]) and the seeded ones otherwise.
  void gated_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                      ConstTensorView out, ConstTensorView dout, TensorView dq, TensorView dk,
                      TensorView dv, float* dg) {
    Heads::Heads fresh;
    const Heads::Heads& drawn = heads_.get(
        p, [&](int64_t h) { return make_head(p, h); }, fresh);
    const float* given = input(p, "g");  // [B, H, m]; null: the seeded gates stand in
    parallel_for(
        p.batch * p.heads,
        [&] {
          return std::vector<float>(size_t(gated_backward_floats(2 * freqs_, p.dim, p.keys())));
        },
        [&](int64_t bh, std::vector<float>& work) {
          const int64_t b = bh / p.heads, h = bh % p.heads;
          const fmap::HeadGrads io{q.head(b, h),    k.head(b, h),   v.head(b, h),    out.head(b, h),
                                   dout.head(b, h), nullptr,        q.stride_row,    k.stride_row,
                                   v.stride_row,    out.stride_row, dout.stride_row, dq.head(b, h),
                                   dk.head(b, h),   dv.head(b, h),  dq.stride_row,   dk.stride_row,
                                   dv.stride_row};
          const KeyGate gate{drawn[size_t(h)]->gate, given ? given + bh * p.keys() : nullptr,
                             given && dg ? dg + bh * p.keys() : nullptr};
          gated_head_backward(drawn[size_t(h)]->map, gate, p, b, io, work.data());
        });
  }
  void check_gated(const Problem& p) const {
    if (gate_ && !p.causal)
      throw UnsupportedError(
          "rfa: gate=true is a recurrence over positions (S_j = g_j S_{j-1} + (1 - g_j) "
          "phi(k_j) v_j^T), defined for causal attention only; use causal masking, or gate=false");
  }
  std::unique_ptr<Head> make_head(const Problem& p, int64_t h) const {
    return std::make_unique<Head>(
        Head{RfaFeatureMap(rfa_projection(p.seed, h, freqs_, p.dim, sigma_), freqs_, p.dim,
                           float(floor_per_weight(sigma_))),
             gate_ ? rfa_gate(p.seed, h, p.dim) : std::vector<float>()});
  }

  int64_t freqs_;
  double sigma_;
  bool gate_;
  int64_t clamped_ = 0, rows_ = 0;
  Heads heads_;  // every head's draws, once prepare() has drawn them
};

// The formulas in double: phi of every row with the same W, then per query the explicit sum
// over its visible keys, each weighted by 1 (plain) or (1 - g_j) prod_{j < l <= a(i)} g_l
// (gated), and the floor.
std::vector<double> rfa_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                               ConstTensorView k, ConstTensorView v) {
  const int64_t D = var.params().get_int("features"), d = p.dim, f = 2 * D;
  const double sigma = var.params().get_float("sigma");
  const bool gated = var.params().get_bool("gate");
  const double floor = floor_per_weight(sigma), ratio = 1.0 / std::sqrt(double(D));
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    const std::vector<float> w32 = rfa_projection(p.seed, h, D, d, sigma);
    auto phi = [&](const oracle::Matrix& x) {
      oracle::Matrix out(x.rows, f);
      for (int64_t i = 0; i < x.rows; ++i) {
        double ss = 0;
        for (int64_t c = 0; c < d; ++c) ss += x(i, c) * x(i, c);
        const double inv = ss > 0 ? 1.0 / std::sqrt(ss) : 0.0;
        for (int64_t e = 0; e < D; ++e) {
          double a = 0;
          for (int64_t c = 0; c < d; ++c) a += double(w32[size_t(e * d + c)]) * x(i, c) * inv;
          out(i, e) = ratio * std::sin(a);
          out(i, D + e) = ratio * std::cos(a);
        }
      }
      return out;
    };
    const oracle::Matrix kx = oracle::head(k, b, h), vx = oracle::head(v, b, h);
    const oracle::Matrix fq = phi(oracle::head(q, b, h)), fk = phi(kx);
    // the gate of every key: g_j and 1 - g_j
    std::vector<double> g(size_t(kx.rows), 1.0), keep(size_t(kx.rows), 1.0);
    if (const float* given = gated ? var.input(p, "g") : nullptr) {
      for (int64_t j = 0; j < kx.rows; ++j) {
        g[size_t(j)] = double(given[(b * p.heads + h) * p.keys() + j]);
        keep[size_t(j)] = 1.0 - g[size_t(j)];
      }
    } else if (gated) {
      const std::vector<float> gw = rfa_gate(p.seed, h, d);
      for (int64_t j = 0; j < kx.rows; ++j) {
        double x = gw[size_t(d)];
        for (int64_t c = 0; c < d; ++c) x += double(gw[size_t(c)]) * kx(j, c);
        g[size_t(j)] = 1.0 / (1.0 + std::exp(-x));
        keep[size_t(j)] = 1.0 / (1.0 + std::exp(x));
      }
    }
    oracle::Matrix out(p.n, d);
    for (int64_t i = 0; i < p.n; ++i) {
      const int64_t seen = p.visible(b, i);
      if (seen == 0) continue;
      double den = 0, mass = 0, later = 1;  // later: product of the gates after key j
      std::vector<double> num(size_t(d), 0.0);
      for (int64_t j = seen - 1; j >= 0; --j) {
        const double weight = gated ? keep[size_t(j)] * later : 1.0;
        if (gated) later *= g[size_t(j)];
        double a = 0;
        for (int64_t e = 0; e < f; ++e) a += fq(i, e) * fk(j, e);
        den += weight * a, mass += weight;
        for (int64_t c = 0; c < d; ++c) num[size_t(c)] += weight * a * vx(j, c);
      }
      den = std::max(den, floor * mass);
      if (den > 0)
        for (int64_t c = 0; c < d; ++c) out(i, c) = num[size_t(c)] / den;
    }
    return out;
  });
}

double rfa_tolerance(const Variant& var, const Problem& p, const Workload&) {
  const double D = double(var.params().get_int("features")), d = double(p.dim);
  const double sigma = var.params().get_float("sigma");
  const bool gated = var.params().get_bool("gate");
  // the largest projection of a unit vector, and for the gate an argument of order 1
  const double logit = std::sqrt(2.0 * std::log(2.0 * D)) / sigma + (gated ? 1.0 : 0.0);
  const double steps = gated ? 10.0 : 6.0;
  const double amplification = 1.0 / floor_per_weight(sigma);
  return kErrorMargin * float32_error(d, logit, double(p.keys()) + 2.0 * D, steps) * amplification;
}

ATTNBENCH_REGISTER_VARIANT(
    rfa,
    VariantInfo{
        .name = "rfa",
        .summary = "random Fourier features of unit q, k approximating softmax(q^.k^/sigma^2) "
                   "(RFA, Peng et al. 2021); gate=true: gated recurrence, causal only",
        .complexity = "time O((n + m) D d), memory O(H D d + threads D (4 R + 2 d)), "
                      "R = min(1024, 32768 / D)",
        .family = "lowrank",
        .display = "Random feature attention",
        .paper = "Peng et al. 2021 (arXiv:2103.02143)",
        .look = {.color = "#843c39", .marker = "P"},
        .params = {ParamSpec::Int("features", 128, 1, int64_t(1) << 15,
                                  "random frequencies D (rows of W); phi has 2 D entries, sin "
                                  "and cos"),
                   ParamSpec::Float("sigma", 1.0, 0.25, 1000.0,
                                    "kernel width: W ~ N(0, sigma^-2 I), approximates "
                                    "softmax(q^.k^ / sigma^2) of unit vectors"),
                   ParamSpec::Bool("gate", false,
                                   "gated RFA: S_j = g_j S_{j-1} + (1 - g_j) phi(k_j) v_j^T with "
                                   "g_j = sigmoid(w_g.k_j + b_g) (seeded); causal only")},
        .inputs = {{.name = "g",
                    .dims = {"B", "H", "m"},
                    .help = "gate g_j per key and query head, in (0, 1): the state decays by "
                            "g_j and takes key j with weight 1 - g_j",
                    .stand_in = "sigmoid(k_j . w_g + b_g), w_g and b_g seeded per head",
                    .min = 0,
                    .max = 1,
                    .when = "gate=true"}},
        .caps = {.causal = true, .cross = true, .exact = false, .key_padding = true},
        .make = [](const ParamValues& pv) { return std::make_unique<Rfa>(pv); },
        .oracle = rfa_oracle,
        .tolerance = rfa_tolerance});

}  // namespace
}  // namespace attnbench
