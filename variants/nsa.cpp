// nsa: Native Sparse Attention (Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned
// and Natively Trainable Sparse Attention"). Causal self-attention only. Each query t attends
// three branches of softmax attention and mixes them with gates:
//
//   out_t = g_cmp(t) o_cmp(t) + g_sel(t) o_sel(t) + g_win(t) o_win(t)
//
// compression (l = cmp_block, s = cmp_stride): compressed block i covers keys [i s, i s + l);
//   its key and value are the MEAN of the block's k and v rows (the paper's learned MLP with
//   intra-block position encoding; mean pooling is the documented stand-in). Block i is
//   visible to t iff i s + l - 1 <= t. o_cmp = softmax_i(q_t . k~_i / sqrt(d)) v~_i over the
//   visible blocks; p_cmp(t) are those probabilities.
// selection (l' = sel_block, n = sel_top): keys in blocks j of l' keys, [j l', (j+1) l').
//   Block score (the paper's Eq. 9 overlap rule): compressed block i counts for selection
//   block j with weight |[i s, i s + l) ∩ [j l', (j+1) l')| / s, the number of stride-s
//   pieces of block i inside block j:
//     score_t(j) = sum_{h in group} sum_i w(i, j) p_cmp,h(t)[i]
//   (at the defaults l = 32, s = 16, l' = 64: blocks i = 4j-1 .. 4j+3 with weights 1,2,2,2,1;
//   the paper prints the index as 4j - m - n, which points one selection block early under
//   its own 0-based block numbering, so this follows the stated intent, the overlap). Scores
//   are summed over the query heads sharing a key/value head (GQA; G = H: each head alone),
//   so the whole group attends the same blocks. Candidates are the blocks 0 .. c, c = t / l'
//   (the block holding t). If c + 1 <= n every candidate is taken; otherwise the initial block
//   0 and the two local blocks c - 1, c are always taken (as in the paper's 27B run: 1
//   initial + 2 local among the n = 16) and the other n - 3 are the highest scores among
//   blocks 1 .. c - 2 (ties: the lower block index). o_sel = exact softmax attention over the
//   keys of the chosen blocks that are <= t.
// sliding window (w = window): o_win = softmax attention over keys max(0, t - w + 1) .. t.
// gates: g_c(t) = sigmoid(q_t . u_{c,h}), c in {cmp, sel, win}; u_{c,h} in R^d has entries
//   N(0, 1/d) drawn from the problem seed (RandomStream(seed, kGateStream + h), value
//   c d + e): a seeded stand-in for the paper's learned gate MLP on the input.
// A branch with no key for row t (no complete compressed block yet; window = 0) gives 0.
//
// Defaults are the paper's: l = 32, s = 16, l' = 64, n = 16, w = 512. Requires l and
// l' multiples of s, n >= 3.
//
// Kernel. K~, V~ are pooled once per (batch, key/value head). Tasks are (batch, kv head,
// tile of T = task_rows() query positions, about 512 / (H/G)), heaviest tiles first; per
// task, numbered passes:
//   1. compression, in sub-tiles of 256 positions: S = Q K~^T for every head of the group as
//      a dense product (OpenBLAS sgemm) against the K~ rows the sub-tile's last position sees,
//      masked row by row, softmax, O = P V~ (sgemm); the probabilities are summed over the
//      group (256 x n/s floats, never the whole n x n/s matrix);
//   2. block scores (piece sums) and the top-n per position;
//   3. selection: the chosen (position, head) rows are gathered per block, so a block chosen
//      by many rows is one tile of the flash tile kernels (common/kernels/tile_attention.h); each
//      row's per-block results are merged by log-sum-exp;
//   4. window: tiles of 64 positions walking their band of keys through the same tile
//      kernels, masked at its edges;
//   5. gates and the sum.
// Time per row about 4 d (t / s + n l' + w) (plus pooling, 2 m d per kv head); memory
// O(B G m d / s) for K~, V~ plus per thread O(256 n/s + T (n + H/G d)).
// make_pattern (the `pattern` export and the mass measure): the keys attended at full
// resolution, the union of the selection and window branches; the compression branch (which
// attends pooled keys) is not in it.
// Decode: the KV cache of every position per kv head plus the pooled K~, V~, a new row when a
// block completes (t - l + 1 a multiple of s); a step runs the passes above for one position.
// Backward (variants/nsa_backward.cpp): forward_train keeps the chosen blocks, the three branch
// outputs and the selection and window log-sum-exps; the backward differentiates the function
// with the selection held fixed, the gates' gradients included. Overflowing accumulators (v
// near FLT_MAX) are not rescaled as in flash.
#include "variants/nsa.h"

#include <cblas.h>
#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/kernels/tile_attention.h"
#include "common/patterns/row_pattern.h"
#include "common/reference/oracle.h"

namespace attnbench::nsa {

constexpr uint64_t kGateStream = 0x6e7361000;  // gate vectors of head h: stream kGateStream + h
constexpr int64_t kForced = 3;                 // the initial block and the two local blocks

Config config_of(const ParamValues& pv) {
  Config c{pv.get_int("cmp_block"), pv.get_int("cmp_stride"), pv.get_int("sel_block"),
           pv.get_int("sel_top"), pv.get_int("window")};
  auto eq = [](const char* name, int64_t x) { return std::string(name) + "=" + std::to_string(x); };
  if (c.l % c.s != 0)
    throw SpecError("nsa: " + eq("cmp_block", c.l) + " must be a multiple of " +
                    eq("cmp_stride", c.s) + " (each compressed block is whole stride pieces)");
  if (c.lsel % c.s != 0)
    throw SpecError("nsa: " + eq("sel_block", c.lsel) + " must be a multiple of " +
                    eq("cmp_stride", c.s) + " (the block scores count stride pieces)");
  if (c.top < kForced)
    throw SpecError("nsa: " + eq("sel_top", c.top) +
                    " must be >= 3: the initial and the two local blocks are always selected");
  return c;
}

std::vector<float> gate_vectors(uint64_t seed, int64_t heads, int64_t d) {
  std::vector<float> u(size_t(heads * 3 * d));
  const double sd = 1.0 / std::sqrt(double(d));
  for (int64_t h = 0; h < heads; ++h) {
    const RandomStream rs(seed, kGateStream + uint64_t(h));
    for (int64_t e = 0; e < 3 * d; ++e)
      u[size_t(h * 3 * d + e)] = float(sd * rs.normal(uint64_t(e)));
  }
  return u;
}

void pool(const Config& c, const float* x, int64_t sr, int64_t d, int64_t i0, int64_t i1,
          float* out) {
  const float inv = 1.0f / float(c.l);
  for (int64_t i = i0; i < i1; ++i) {
    float* o = out + i * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t j = i * c.s; j < i * c.s + c.l; ++j) {
      const float* r = x + j * sr;
      for (int64_t e = 0; e < d; ++e) o[e] += r[e];
    }
    for (int64_t e = 0; e < d; ++e) o[e] *= inv;
  }
}

std::array<const float*, 3> given_gates(const Variant& var, const Problem& p) {
  std::array<const float*, 3> given = {};
  for (size_t x = 0; x < 3; ++x) given[x] = var.input(p, kGateInputs[x]);
  return given;
}

}  // namespace attnbench::nsa

namespace attnbench {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr int64_t kWinRows = 64;   // query rows per window tile
constexpr int64_t kCmpRows = 256;  // query rows per compression sub-tile
constexpr int64_t kWinBlock = 64;  // keys per window tile

/// Query positions per task: about 512 rows (positions x the group's heads), so a selection
/// block chosen by a small share of the positions still fills a tile of several rows (at
/// n = 16384, about 26 per block; 2048 rows per task measured no faster).
int64_t task_rows(int64_t gs) { return std::clamp<int64_t>(512 / gs / 64 * 64, 64, 512); }

using nsa::Config;
using nsa::config_of;
using nsa::gate_vectors;
using nsa::given_gates;
using nsa::kForced;
using nsa::kGateInputs;
using nsa::pool;

/// One (batch, kv head) group's rows for positions i0 .. i0 + rows - 1: query head hg of the
/// group (0 .. gs - 1) at position i0 + r is q + hg q_sh + r q_sr (out likewise); key j at
/// k + j kv_sr (keys 0 .. i0 + rows - 1 present); kc, vc the group's nc pooled rows [nc, d].
struct GroupRows {
  const float* q;
  int64_t q_sh, q_sr;
  float* out;
  int64_t o_sh, o_sr;
  const float *k, *v;
  int64_t k_sr, v_sr;
  const float *kc, *vc;
  int64_t nc;
  const float* gates;  // [gs][3][d]
  int64_t gs, d;
  int32_t* chosen = nullptr;  // optional: position r's blocks at chosen + r top, -1 padded
  /// The given gates g_cmp, g_slc, g_swa of query head hg at position i0 + r, at
  /// given[c][hg * given_sh + r]; null: sigmoid(q . u_c) stands in.
  std::array<const float*, 3> given = {};
  int64_t given_sh = 0;
  /// forward_train: branch c's output of query head hg at position i0 + r goes to
  /// keep_o + c keep_oc + hg keep_sh d + r d, its log-sum-exp (selection, window: c = 1, 2) to
  /// keep_lse + (c - 1) keep_lc + hg keep_sh + r (nsa::Saved); null: nothing is kept.
  float *keep_o = nullptr, *keep_lse = nullptr;
  int64_t keep_oc = 0, keep_lc = 0, keep_sh = 0;
};

/// Per-thread buffers of attend_rows for up to max_rows positions, max_nc pooled rows and
/// max_keys keys.
struct Workspace {
  Workspace(const Config& c, int64_t d, int64_t gs, int64_t max_rows, int64_t max_nc,
            int64_t max_keys)
      : sel(max_rows * gs, c.lsel, d, float(1.0 / std::sqrt(double(d)))),
        win(std::min(max_rows, kWinRows), kWinBlock, d, float(1.0 / std::sqrt(double(d)))) {
    const int64_t nc = std::max<int64_t>(max_nc, 1), nb = max_keys / c.lsel + 1;
    s.resize(size_t(std::min(max_rows, kCmpRows) * nc));
    psum.resize(size_t(std::min(max_rows, kCmpRows) * nc));
    for (auto* o : {&ocmp, &osel, &owin, &qg, &og}) o->resize(size_t(gs * max_rows * d));
    lse.resize(size_t(gs * max_rows));
    lg.resize(size_t(gs * max_rows));
    lwin.resize(size_t(gs * max_rows));
    who.resize(size_t(gs * max_rows));
    pieces.resize(size_t(nb * (c.lsel / c.s)));
    chosen.resize(size_t(max_rows * c.top));
    nchosen.resize(size_t(max_rows));
    bstart.resize(size_t(nb + 1));
    brows.resize(size_t(max_rows * c.top));
    best.resize(size_t(c.top));
    scores.resize(size_t(nb));
  }
  static double bytes(const Config& c, int64_t d, int64_t gs, int64_t max_rows, int64_t max_nc,
                      int64_t max_keys) {
    const double nb = double(max_keys / c.lsel + 2);
    return 4.0 * (2.0 * double(std::min(max_rows, kCmpRows) * std::max<int64_t>(max_nc, 1)) +
                  5.0 * double(gs * max_rows * d) + 4.0 * double(gs * max_rows) + 3.0 * nb +
                  2.0 * double(max_rows * c.top) + double(max_rows)) +
           8.0 * nb + double(TileAttention::bytes(max_rows * gs, c.lsel, d)) +
           4.0 * nb * double(c.lsel / c.s) +
           double(TileAttention::bytes(std::min(max_rows, kWinRows), kWinBlock, d));
  }
  TileAttention sel, win;
  std::vector<float> s, psum, ocmp, osel, owin, qg, og, lse, lg, lwin, pieces, best, scores;
  std::vector<int32_t> who, chosen, nchosen, bstart, brows;
};

/// (o, lse) becomes the softmax result over its keys and those of (o2, lse2) (disjoint).
inline void merge_row(float* o, float& lse, const float* o2, float lse2, int64_t d) {
  if (lse2 == -std::numeric_limits<float>::infinity()) return;
  if (lse == -std::numeric_limits<float>::infinity()) {
    std::memcpy(o, o2, size_t(d) * sizeof(float));
    lse = lse2;
    return;
  }
  const float mx = std::max(lse, lse2);
  const float a = std::exp(lse - mx), b = std::exp(lse2 - mx), inv = 1.0f / (a + b);
  for (int64_t e = 0; e < d; ++e) o[e] = (a * o[e] + b * o2[e]) * inv;
  lse = mx + std::log(a + b);
}

/// Pass 1 for the sub-tile of sr positions s0 .. s0 + sr - 1 of the task (absolute positions
/// i0 + s0 ..), seeing C pooled rows: the compression branch of every head of the group into
/// ws.ocmp, and the probabilities summed over the group into ws.psum (sr x C).
void compression_pass(const Config& c, const GroupRows& g, int64_t i0, int64_t rows, int64_t s0,
                      int64_t sr, int64_t C, Workspace& ws) {
  const int64_t d = g.d, gs = g.gs, si0 = i0 + s0;
  const float scale = float(1.0 / std::sqrt(double(d)));
  if (C > 0) {
    Eigen::Map<RowMat> S(ws.s.data(), sr, C), P(ws.psum.data(), sr, C);
    for (int64_t hg = 0; hg < gs; ++hg) {
      // S = Q K~^T (sr x C)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(sr), int(C), int(d), 1.0f,
                  g.q + hg * g.q_sh + s0 * g.q_sr, int(g.q_sr), g.kc, int(d), 0.0f, ws.s.data(),
                  int(C));
      for (int64_t r = 0; r < sr; ++r) {
        const int64_t vc = std::min(C, c.visible(si0 + r));
        auto row = S.row(r);
        row.tail(C - vc).setZero();
        if (vc == 0) continue;
        auto x = row.head(vc).array();
        const float mx = x.maxCoeff();
        x = ((x - mx) * scale).exp();
        x *= 1.0f / x.sum();
      }
      // O = P V~ (sr x d)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(sr), int(d), int(C), 1.0f,
                  ws.s.data(), int(C), g.vc, int(d), 0.0f, ws.ocmp.data() + (hg * rows + s0) * d,
                  int(d));
      if (hg == 0)
        P = S;
      else
        P += S;
    }
  } else {
    for (int64_t hg = 0; hg < gs; ++hg)
      std::fill_n(ws.ocmp.data() + (hg * rows + s0) * d, sr * d, 0.0f);
  }
}

/// Pass 2 for the same sub-tile: block scores (overlap weights w(i, j), see the header) from
/// ws.psum and the top-n per position into ws.chosen / ws.nchosen (and g.chosen if set).
void choose_blocks(const Config& c, const GroupRows& g, int64_t i0, int64_t s0, int64_t sr,
                   int64_t C, Workspace& ws) {
  const int64_t si0 = i0 + s0;
  const int64_t a = c.lsel / c.s,
                bw = c.l / c.s;  // a stride pieces per sel block, bw per cmp block
  for (int64_t r = 0; r < sr; ++r) {
    const int64_t t = si0 + r, cur = t / c.lsel;
    int32_t* ch = ws.chosen.data() + (s0 + r) * c.top;
    int64_t n = 0;
    if (cur + 1 <= c.top) {
      for (int64_t j = 0; j <= cur; ++j) ch[n++] = int32_t(j);
    } else {
      // stride piece u (keys [u s, (u + 1) s)) collects the probabilities of the compressed
      // blocks covering it, i = u - bw + 1 .. u; block j's score is the sum of its a pieces,
      // that is sum_i w(i, j) p_i with w the number of pieces of block i inside block j.
      // Entries of p past the row's visible blocks are 0 (pass 1), so only i < C is bounded.
      const float* p = ws.psum.data() + r * std::max<int64_t>(C, 1);
      const int64_t U = (cur - 1) * a;  // pieces of blocks 0 .. cur - 2
      float* pc = ws.pieces.data();
      std::fill(pc, pc + U, 0.0f);
      for (int64_t o = 0; o < bw; ++o)
        for (int64_t u = o, u1 = std::min(U, C + o); u < u1; ++u) pc[u] += p[u - o];
      float* sc = ws.scores.data();  // sc[j] = sum of block j's pieces, j = 0 .. cur - 2
      std::fill(sc, sc + cur - 1, 0.0f);
      for (int64_t x = 0; x < a; ++x)
        for (int64_t j = 0; j < cur - 1; ++j) sc[j] += pc[j * a + x];
      // the k = n - 3 best of blocks 1 .. cur - 2, kept sorted (score descending; a later
      // block must score strictly more to enter, so ties go to the lower index)
      const int64_t k = c.top - kForced;
      float* best = ws.best.data();
      int32_t* bj = ch + 1;
      int64_t have = 0;
      for (int64_t j = 1; j <= cur - 2 && k > 0; ++j) {
        if (have == k && !(sc[j] > best[k - 1])) continue;
        int64_t e = have < k ? have++ : k - 1;
        for (; e > 0 && sc[j] > best[e - 1]; --e) best[e] = best[e - 1], bj[e] = bj[e - 1];
        best[e] = sc[j], bj[e] = int32_t(j);
      }
      ch[0] = 0;
      n = 1 + k;
      ch[n++] = int32_t(cur - 1);
      ch[n++] = int32_t(cur);
      std::sort(ch, ch + n);
    }
    ws.nchosen[size_t(s0 + r)] = int32_t(n);
    if (g.chosen) {
      std::copy(ch, ch + n, g.chosen + (s0 + r) * c.top);
      std::fill(g.chosen + (s0 + r) * c.top + n, g.chosen + (s0 + r + 1) * c.top, -1);
    }
  }
}

/// Pass 3: selection branch into ws.osel (and ws.lse). Rows (position, head) are gathered per
/// chosen block; each block is one tile; the per-block results merge by log-sum-exp.
void selection_pass(const Config& c, const GroupRows& g, int64_t i0, int64_t rows, Workspace& ws) {
  const int64_t d = g.d, gs = g.gs, t_last = i0 + rows - 1;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t nb = t_last / c.lsel + 1;
  int32_t* off = ws.bstart.data();  // block j's positions: brows[off[j] .. off[j + 1])
  std::fill(off, off + nb + 1, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < ws.nchosen[size_t(r)]; ++e) ++off[ws.chosen[size_t(r * c.top + e)] + 1];
  for (int64_t j = 0; j < nb; ++j) off[j + 1] += off[j];
  for (int64_t r = 0; r < rows; ++r)  // off[j] moves to the end of block j's list ...
    for (int64_t e = 0; e < ws.nchosen[size_t(r)]; ++e)
      ws.brows[size_t(off[ws.chosen[size_t(r * c.top + e)]]++)] = int32_t(r);
  for (int64_t j = nb; j > 0; --j) off[j] = off[j - 1];  // ... and back to its start
  off[0] = 0;
  std::fill(ws.osel.begin(), ws.osel.begin() + gs * rows * d, 0.0f);
  std::fill(ws.lse.begin(), ws.lse.begin() + gs * rows, kNegInf);
  for (int64_t j = 0; j < nb; ++j) {
    if (off[j] == off[j + 1]) continue;
    const int64_t j0 = j * c.lsel, cols = std::min(c.lsel, t_last + 1 - j0);
    int64_t e = 0;
    bool masked = false;
    for (int64_t x = off[j]; x < off[j + 1]; ++x) {
      const int64_t r = ws.brows[size_t(x)];
      masked |= i0 + r < j0 + cols - 1;
      for (int64_t hg = 0; hg < gs; ++hg, ++e) {
        std::memcpy(ws.qg.data() + e * d, g.q + hg * g.q_sh + r * g.q_sr,
                    size_t(d) * sizeof(float));
        ws.who[size_t(e)] = int32_t(hg * rows + r);
      }
    }
    uint8_t* mask = nullptr;
    if (masked) {
      mask = ws.sel.mask();
      for (int64_t x = 0; x < e; ++x) {
        const int64_t lim = i0 + ws.who[size_t(x)] % rows - j0;  // keys c <= lim are causal
        for (int64_t cc = 0; cc < cols; ++cc) mask[x * cols + cc] = cc <= lim;
      }
    }
    ws.sel.begin(ws.qg.data(), d, e);
    ws.sel.attend(g.k + j0 * g.k_sr, g.k_sr, g.v + j0 * g.v_sr, g.v_sr, cols, mask);
    ws.sel.finish(ws.og.data(), d, ws.lg.data());
    for (int64_t x = 0; x < e; ++x) {
      const int64_t w = ws.who[size_t(x)];
      merge_row(ws.osel.data() + w * d, ws.lse[size_t(w)], ws.og.data() + x * d, ws.lg[size_t(x)],
                d);
    }
  }
}

/// Pass 4: window branch into ws.owin, keys max(0, t - w + 1) .. t: tiles of kWinRows
/// positions walking their band in blocks of kWinBlock keys, masked where a block leaves some
/// row's band.
void window_pass(const Config& c, const GroupRows& g, int64_t i0, int64_t rows, Workspace& ws) {
  const int64_t d = g.d, gs = g.gs;
  if (c.w > 0) {
    for (int64_t hg = 0; hg < gs; ++hg)
      for (int64_t r0 = 0; r0 < rows; r0 += kWinRows) {
        const int64_t wr = std::min(kWinRows, rows - r0), u0 = i0 + r0, u1 = u0 + wr - 1;
        ws.win.begin(g.q + hg * g.q_sh + r0 * g.q_sr, g.q_sr, wr);
        for (int64_t j0 = std::max<int64_t>(0, u0 - c.w + 1); j0 <= u1; j0 += kWinBlock) {
          const int64_t cols = std::min(kWinBlock, u1 + 1 - j0);
          uint8_t* mask = nullptr;
          if (j0 + cols - 1 > u0 || j0 < u1 - c.w + 1) {
            mask = ws.win.mask();
            for (int64_t r = 0; r < wr; ++r)
              for (int64_t cc = 0; cc < cols; ++cc) {
                const int64_t t = u0 + r, j = j0 + cc;
                mask[r * cols + cc] = j <= t && j > t - c.w;
              }
          }
          ws.win.attend(g.k + j0 * g.k_sr, g.k_sr, g.v + j0 * g.v_sr, g.v_sr, cols, mask);
        }
        ws.win.finish(ws.owin.data() + (hg * rows + r0) * d, d, ws.lwin.data() + hg * rows + r0);
      }
  } else {
    std::fill(ws.owin.begin(), ws.owin.begin() + gs * rows * d, 0.0f);
    std::fill_n(ws.lwin.begin(), gs * rows, -std::numeric_limits<float>::infinity());
  }
}

/// Pass 5: the gates and the gated sum of the three branches into g.out.
void gate_and_sum(const GroupRows& g, int64_t rows, const Workspace& ws) {
  const int64_t d = g.d, gs = g.gs;
  for (int64_t hg = 0; hg < gs; ++hg)
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = g.q + hg * g.q_sh + r * g.q_sr;
      float gate[3];
      for (int64_t b = 0; b < 3; ++b) {
        if (g.given[size_t(b)]) {
          gate[b] = g.given[size_t(b)][hg * g.given_sh + r];
          continue;
        }
        const float* u = g.gates + (hg * 3 + b) * d;
        float dot = 0.0f;
        for (int64_t e = 0; e < d; ++e) dot += qr[e] * u[e];
        gate[b] = 1.0f / (1.0f + std::exp(-dot));
      }
      const float* oc = ws.ocmp.data() + (hg * rows + r) * d;
      const float* os = ws.osel.data() + (hg * rows + r) * d;
      const float* ow = ws.owin.data() + (hg * rows + r) * d;
      float* o = g.out + hg * g.o_sh + r * g.o_sr;
      for (int64_t e = 0; e < d; ++e) o[e] = gate[0] * oc[e] + gate[1] * os[e] + gate[2] * ow[e];
    }
}

/// forward_train: the branch outputs and log-sum-exps of the task into the saved state.
void keep_branches(const GroupRows& g, int64_t rows, const Workspace& ws) {
  if (!g.keep_o) return;
  const int64_t d = g.d;
  const std::array<const float*, 3> o = {ws.ocmp.data(), ws.osel.data(), ws.owin.data()};
  const std::array<const float*, 2> lse = {ws.lse.data(), ws.lwin.data()};
  for (int64_t hg = 0; hg < g.gs; ++hg) {
    for (size_t c = 0; c < 3; ++c)
      std::copy_n(o[c] + hg * rows * d, rows * d,
                  g.keep_o + int64_t(c) * g.keep_oc + hg * g.keep_sh * d);
    for (size_t c = 0; c < 2; ++c)
      std::copy_n(lse[c] + hg * rows, rows, g.keep_lse + int64_t(c) * g.keep_lc + hg * g.keep_sh);
  }
}

/// out of the group's positions i0 .. i0 + rows - 1 (all heads of the group).
void attend_rows(const Config& c, const GroupRows& g, int64_t i0, int64_t rows, Workspace& ws) {
  // passes 1 and 2 in sub-tiles of kCmpRows positions (the probabilities of a sub-tile,
  // kCmpRows x C floats, stay in cache)
  for (int64_t s0 = 0; s0 < rows; s0 += kCmpRows) {
    const int64_t sr = std::min(kCmpRows, rows - s0);
    const int64_t C = std::min(g.nc, c.visible(i0 + s0 + sr - 1));
    compression_pass(c, g, i0, rows, s0, sr, C, ws);
    choose_blocks(c, g, i0, s0, sr, C, ws);
  }
  selection_pass(c, g, i0, rows, ws);
  window_pass(c, g, i0, rows, ws);
  gate_and_sum(g, rows, ws);
  keep_branches(g, rows, ws);
}

/// The pooled K~ and V~ of every (batch, kv head): [B, G, nc, d] each.
struct Pooled {
  int64_t nc = 0;
  std::vector<float> k, v;
};

Pooled pool_all(const Config& c, const Problem& p, ConstTensorView k, ConstTensorView v) {
  Pooled pl;
  const int64_t G = p.kv_head_count(), gs = p.kv_group(), d = p.dim;
  pl.nc = c.pooled(p.keys());
  pl.k.resize(size_t(p.batch * G * pl.nc * d));
  pl.v.resize(pl.k.size());
#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < p.batch * G; ++bg) {
    const int64_t b = bg / G, h = bg % G * gs;
    pool(c, k.head(b, h), k.stride_row, d, 0, pl.nc, pl.k.data() + bg * pl.nc * d);
    pool(c, v.head(b, h), v.stride_row, d, 0, pl.nc, pl.v.data() + bg * pl.nc * d);
  }
  return pl;
}

/// The forward pass; with `chosen` ([B, G, n, top], -1 padded), also every position's blocks.
/// `given`: the gate inputs [B, H, n] given, in branch order (null: stood in). With `keep`
/// (forward_train), also the branch outputs and log-sum-exps; chosen is then keep->chosen.
void nsa_forward(const Config& c, const Problem& p, ConstTensorView q, ConstTensorView k,
                 ConstTensorView v, TensorView out, int32_t* chosen = nullptr,
                 std::array<const float*, 3> given = {}, nsa::Saved* keep = nullptr) {
  if (keep) chosen = keep->chosen.data();
  const int64_t G = p.kv_head_count(), gs = p.kv_group(), d = p.dim, n = p.n;
  const Pooled pl = pool_all(c, p, k, v);
  const std::vector<float> gates = gate_vectors(p.seed, p.heads, d);
  const int64_t T = task_rows(gs), tiles = (n + T - 1) / T, tasks = p.batch * G * tiles;
#pragma omp parallel
  {
    Workspace ws(c, d, gs, std::min(T, n), pl.nc, n);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      // the last tiles (the most compressed keys) first
      const int64_t bg = task % (p.batch * G), tile = tiles - 1 - task / (p.batch * G);
      const int64_t b = bg / G, h0 = bg % G * gs, i0 = tile * T;
      const int64_t rows = std::min(T, n - i0);
      GroupRows g{q.row(b, h0, i0),
                  q.stride_h,
                  q.stride_row,
                  out.row(b, h0, i0),
                  out.stride_h,
                  out.stride_row,
                  k.head(b, h0),
                  v.head(b, h0),
                  k.stride_row,
                  v.stride_row,
                  pl.k.data() + bg * pl.nc * d,
                  pl.v.data() + bg * pl.nc * d,
                  pl.nc,
                  gates.data() + h0 * 3 * d,
                  gs,
                  d,
                  chosen ? chosen + (bg * n + i0) * c.top : nullptr};
      for (size_t x = 0; x < 3; ++x)
        if (given[x]) g.given[x] = given[x] + (b * p.heads + h0) * n + i0;
      g.given_sh = n;
      if (keep) {
        const int64_t bhn = p.batch * p.heads * n;
        g.keep_o = keep->branch.data() + ((b * p.heads + h0) * n + i0) * d;
        g.keep_lse = keep->lse.data() + (b * p.heads + h0) * n + i0;
        g.keep_oc = bhn * d, g.keep_lc = bhn, g.keep_sh = n;
      }
      attend_rows(c, g, i0, rows, ws);
    }
  }
}

/// Keys attended at full resolution: position t's chosen blocks and its window.
class NsaPattern final : public RowKeysPattern {
 public:
  NsaPattern(const Problem& p, const Config& c, std::vector<int32_t> chosen)
      : RowKeysPattern(p.n, p.keys()), p_(p), c_(c), chosen_(std::move(chosen)) {}

  void row_keys(int64_t b, int64_t h, int64_t i, std::vector<int64_t>& keys) const override {
    keys.clear();
    const int32_t* ch =
        chosen_.data() + ((b * p_.kv_head_count() + p_.kv_head(h)) * p_.n + i) * c_.top;
    const int64_t wlo = std::max<int64_t>(0, i - c_.w + 1);
    int64_t next = 0;                         // keys below are already listed
    auto add = [&](int64_t lo, int64_t hi) {  // [lo, hi], ascending calls
      for (int64_t j = std::max(lo, next); j <= std::min(hi, i); ++j) keys.push_back(j);
      next = std::max(next, hi + 1);
    };
    bool win_done = c_.w == 0;
    for (int64_t e = 0; e < c_.top && ch[e] >= 0; ++e) {
      const int64_t j0 = int64_t(ch[e]) * c_.lsel;
      if (!win_done && wlo < j0) {
        add(wlo, i);
        win_done = true;
      }
      add(j0, j0 + c_.lsel - 1);
    }
    if (!win_done) add(wlo, i);
  }
  double bytes() const override { return double(chosen_.size()) * sizeof(int32_t); }

 private:
  Problem p_;
  Config c_;
  std::vector<int32_t> chosen_;
};

class Nsa final : public Variant, public Decoder, public Backward {
 public:
  explicit Nsa(const ParamValues& pv) : c_(config_of(pv)) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    nsa_forward(c_, p, q, k, v, out, nullptr, given_gates(*this, p));
  }

  // ---- Backward (variants/nsa_backward.cpp) ----

  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    auto saved = std::make_unique<nsa::Saved>(c_, p);
    nsa_forward(c_, p, q, k, v, out, nullptr, given_gates(*this, p), saved.get());
    return saved;
  }
  using Variant::backward;  // the accessor stays visible beside the pass
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView /*out*/, ConstTensorView dout, const SavedState& saved,
                TensorView dq, TensorView dk, TensorView dv) override {
    nsa::backward(c_, p, q, k, v, dout, nsa::Saved::of(saved, c_, p), dq, dk, dv,
                  given_gates(*this, p), {});
  }
  bool gives_input_grads() const override { return true; }
  void backward_inputs(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       ConstTensorView /*out*/, ConstTensorView dout, const SavedState& saved,
                       TensorView dq, TensorView dk, TensorView dv, InputGrads& dinputs) override {
    const std::array<const float*, 3> given = given_gates(*this, p);
    std::array<float*, 3> dgates = {};
    for (size_t c = 0; c < 3; ++c)
      if (given[c]) {
        std::vector<float>& dg = dinputs[kGateInputs[c]];
        dg.assign(size_t(p.batch * p.heads * p.n), 0.0f);
        dgates[c] = dg.data();
      }
    nsa::backward(c_, p, q, k, v, dout, nsa::Saved::of(saved, c_, p), dq, dk, dv, given, dgates);
  }
  double backward_flops(const Problem& p) const override { return nsa::backward_flops(c_, p); }
  double saved_estimate(const Problem& p) const override { return nsa::Saved::bytes(c_, p); }
  double backward_memory_estimate(const Problem& p) const override {
    return nsa::backward_bytes(c_, p);
  }

  double flops(const Problem& p) const override {
    // per (head, position t): the logits and weighted sums of the three branches (4 d per
    // key) and the gates (6 d); pooling 2 l d per pooled row of k and v
    double keys = 0;
    for (int64_t t = 0; t < p.n; ++t) keys += double(c_.row_keys(t));
    const double d = double(p.dim);
    return double(p.batch * p.heads) * (4.0 * d * keys + 6.0 * d * double(p.n)) +
           double(p.batch * p.kv_head_count()) * 4.0 * double(c_.l) * d *
               double(c_.pooled(p.keys()));
  }

  double memory_estimate(const Problem& p) const override {
    const int64_t nc = c_.pooled(p.keys());
    return double(p.batch * p.kv_head_count() * nc * p.dim) * 8.0 +
           double(p.heads * 3 * p.dim) * 4.0 +
           double(team_threads()) * Workspace::bytes(c_, p.dim, p.kv_group(),
                                                     std::min(task_rows(p.kv_group()), p.n), nc,
                                                     p.n);
  }

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView q,
                                              ConstTensorView k) const override {
    if (!q.data || !k.data) return nullptr;
    if (!p.causal || p.keys() != p.n)
      throw UnsupportedError("nsa: causal self-attention only (its pattern likewise)");
    // the selection needs only q and k: v = k, the output is discarded
    std::vector<int32_t> chosen(size_t(p.batch * p.kv_head_count() * p.n * c_.top), -1);
    Tensor scratch(p.q_shape());
    nsa_forward(c_, p, q, k, k, scratch.view(), chosen.data());
    return std::make_unique<NsaPattern>(p, c_, std::move(chosen));
  }

  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override;
  double prefill_flops(const Problem& p, int64_t t0) const override {
    return double(p.batch * p.kv_head_count()) * 4.0 * double(c_.l) * double(p.dim) *
           double(c_.pooled(t0));
  }

  const Config& config() const { return c_; }

 private:
  Config c_;
};

/// Decode: per (batch, kv head) the keys and values of every position and the pooled rows.
class NsaState final : public DecodeState {
 public:
  NsaState(const Config& c, const Problem& p, ConstTensorView k, ConstTensorView v, int64_t t0)
      : c_(c),
        p_(p),
        G_(p.kv_head_count()),
        gs_(p.kv_group()),
        d_(p.dim),
        cap_(p.n),
        ncap_(std::max<int64_t>(c_.pooled(p.n), 1)),
        len_(t0),
        k_(size_t(p.batch * G_ * cap_ * d_)),
        v_(k_.size()),
        kc_(size_t(p.batch * G_ * ncap_ * d_)),
        vc_(kc_.size()),
        gates_(gate_vectors(p.seed, p.heads, d_)) {
    for (int64_t bg = 0; bg < p.batch * G_; ++bg) {
      const int64_t b = bg / G_, h = bg % G_ * gs_;
      for (int64_t t = 0; t < t0; ++t) {
        std::memcpy(kbuf(bg) + t * d_, k.row(b, h, t), size_t(d_) * sizeof(float));
        std::memcpy(vbuf(bg) + t * d_, v.row(b, h, t), size_t(d_) * sizeof(float));
      }
      pool(c_, kbuf(bg), d_, d_, 0, c_.pooled(t0), kc_.data() + bg * ncap_ * d_);
      pool(c_, vbuf(bg), d_, d_, 0, c_.pooled(t0), vc_.data() + bg * ncap_ * d_);
    }
  }

  int64_t length() const override { return len_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(len_, cap_, Shape4{p_.batch, p_.heads, 1, d_}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const SerialIfSmall small(step_flops());
    const int64_t t = len_, nc = c_.pooled(t + 1), tasks = p_.batch * G_;
    if (ws_.size() < size_t(team_threads())) ws_.resize(size_t(team_threads()));
#pragma omp parallel if (tasks > 1)
    {
      auto& mine = ws_[size_t(omp_get_thread_num())];
      if (!mine) mine = std::make_unique<Workspace>(c_, d_, gs_, 1, ncap_, cap_);
      Workspace& ws = *mine;
#pragma omp for schedule(dynamic, 1)
      for (int64_t bg = 0; bg < tasks; ++bg) {
        const int64_t b = bg / G_, h0 = bg % G_ * gs_;
        std::memcpy(kbuf(bg) + t * d_, k.row(b, h0, 0), size_t(d_) * sizeof(float));
        std::memcpy(vbuf(bg) + t * d_, v.row(b, h0, 0), size_t(d_) * sizeof(float));
        if (nc > c_.pooled(t)) {  // position t completes a compressed block
          pool(c_, kbuf(bg), d_, d_, nc - 1, nc, kc_.data() + bg * ncap_ * d_);
          pool(c_, vbuf(bg), d_, d_, nc - 1, nc, vc_.data() + bg * ncap_ * d_);
        }
        GroupRows g{q.row(b, h0, 0),
                    q.stride_h,
                    q.stride_row,
                    out.row(b, h0, 0),
                    out.stride_h,
                    out.stride_row,
                    kbuf(bg),
                    vbuf(bg),
                    d_,
                    d_,
                    kc_.data() + bg * ncap_ * d_,
                    vc_.data() + bg * ncap_ * d_,
                    nc,
                    gates_.data() + h0 * 3 * d_,
                    gs_,
                    d_};
        attend_rows(c_, g, t, 1, ws);
      }
    }
    ++len_;
  }

  double state_bytes() const override {
    return double(G_) * double(2 * len_ * d_ + 2 * c_.pooled(len_) * d_) * 4.0;
  }
  double step_bytes_read() const override {
    const int64_t t = len_;
    const int64_t full = std::min(c_.top, t / c_.lsel + 1) * c_.lsel + std::min(c_.w, t + 1);
    return double(p_.batch * G_) * double(2 * (full + c_.pooled(t + 1)) * d_) * 4.0;
  }
  double step_flops() const override {
    return double(p_.batch * p_.heads) *
           (4.0 * double(d_) * double(c_.row_keys(len_)) + 6.0 * double(d_));
  }

 private:
  float* kbuf(int64_t bg) { return k_.data() + bg * cap_ * d_; }
  float* vbuf(int64_t bg) { return v_.data() + bg * cap_ * d_; }

  Config c_;
  Problem p_;
  int64_t G_, gs_, d_, cap_, ncap_, len_;
  std::vector<float> k_, v_, kc_, vc_, gates_;
  std::vector<std::unique_ptr<Workspace>> ws_;  // one per thread, made at its first step
};

std::unique_ptr<DecodeState> Nsa::prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                          int64_t t0) {
  check_prefill(p, k, v, t0);
  return std::make_unique<NsaState>(c_, p, k, v, t0);
}

ATTNBENCH_REGISTER_VARIANT(
    nsa,
    VariantInfo{
        .name = "nsa",
        .summary = "native sparse attention: gated mean-pooled, top-n block and window branches "
                   "(Yuan et al.; seeded gates, mean pooling)",
        .complexity = "time O(n d (n / cmp_stride + sel_top sel_block + window)), memory "
                      "O(G m d / cmp_stride + threads 128 (m / cmp_stride + H/G d))",
        .family = "pattern",
        .display = "Native Sparse Attention",
        .paper = "Yuan et al. 2025 (arXiv:2502.11089)",
        .look = {.color = "#3182bd", .marker = "D"},
        .long_context = true,
        .params = {ParamSpec::Int("cmp_block", 32, 1, 1 << 16,
                                  "keys per compressed (mean-pooled) block, l"),
                   ParamSpec::Int("cmp_stride", 16, 1, 1 << 16,
                                  "stride between compressed blocks, s (divides cmp_block)"),
                   ParamSpec::Int("sel_block", 64, 1, 1 << 16,
                                  "keys per selection block, l' (a multiple of cmp_stride)"),
                   ParamSpec::Int("sel_top", 16, 3, 4096,
                                  "selection blocks per query, n (block 0 and the two local "
                                  "blocks included)"),
                   ParamSpec::Int("window", 512, 0, int64_t(1) << 30,
                                  "sliding-window keys per query, w (the last w up to t)")},
        .inputs = {{.name = "g_cmp",
                    .dims = {"B", "H", "n"},
                    .help = "gate of the compressed branch per token and query head, in (0, 1)",
                    .stand_in = "sigmoid(q_t . u_cmp), u_cmp seeded per head",
                    .min = 0,
                    .max = 1},
                   {.name = "g_slc",
                    .dims = {"B", "H", "n"},
                    .help = "gate of the selected branch per token and query head, in (0, 1)",
                    .stand_in = "sigmoid(q_t . u_slc), u_slc seeded per head",
                    .min = 0,
                    .max = 1},
                   {.name = "g_swa",
                    .dims = {"B", "H", "n"},
                    .help = "gate of the sliding-window branch per token and query head, in (0, 1)",
                    .stand_in = "sigmoid(q_t . u_swa), u_swa seeded per head",
                    .min = 0,
                    .max = 1}},
        .caps = {.causal = true, .cross = false, .exact = false, .causal_only = true},
        .make = [](const ParamValues& pv) { return std::make_unique<Nsa>(pv); },
        .oracle = nsa::float64_oracle,
        .tolerance = nsa::float32_tolerance});

}  // namespace
}  // namespace attnbench
