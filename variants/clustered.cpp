// clustered: clustered attention (Vyas, Katharopoulos and Fleuret 2020, "Fast Transformers with
// Clustered Attention", arXiv:2007.04825), plain and "improved".
//
// Per (batch, head), with s = 1/sqrt(d) and c = min(clusters, n):
//   1. cluster the n queries into c clusters (variants/clustered.h, cluster_queries): k-means
//      from c seeded query rows, `iterations` Lloyd rounds and a final assignment. With bits > 0
//      (default 32, as fast-transformers' constructor) the queries are clustered on bits-bit LSH
//      codes, bit b = [q . w_b + o_b > 0] for Gaussian planes (w_b, o_b) drawn per head from the
//      seed (fast-transformers' hash_bias = True planes), with Hamming distance and a bit-wise
//      majority update; bits = 0 runs Euclidean k-means on the query vectors themselves.
//   2. Q_g = mean of the member query vectors of each non-empty cluster g (in both modes);
//      A_g = softmax(s Q_g K^T) over all m keys.
//   plain (topk = 0): every member i of g gets out_i = A_g V.
//   improved (topk = k > 0): T_g = the k keys with the largest centroid scores (k capped at m,
//      ties to the lower index), mhat_g = sum_{j in T_g} A_g[j]; member i gets
//        out_i = mhat_g softmax_{j in T_g}(s q_i . k_j) V_T + sum_{j not in T_g} A_g[j] v_j,
//      i.e. exact attention over the centroid's top keys, carrying the centroid's mass there,
//      plus the centroid's attention to the rest. k = 32 is the paper's value.
// Key padding (Problem::key_lengths): padded keys are absent. Batch element b computes what it
// would compute on its L_b valid keys alone, as if m were L_b: the query clustering does not
// look at keys; A_g is the softmax over the valid keys, the top keys T_g are chosen among them
// (k capped at L_b), and no padded key or value enters A_g, mhat_g or the residual. L_b = 0
// gives rows of 0.
// Defaults: clusters = 100 as in the paper's experiments (fast-transformers has no default),
// iterations = 10 and bits = 32 as fast-transformers' ClusteredAttention constructor (its
// builder registry defaults bits to 63); topk = 0 (the plain variant). clusters = n with bits = 0
// gives exact attention (every query is its own centroid), and so does topk >= m for any clustering
// (mhat = 1, nothing left over).
//
// Steps:
//   1. per head (one head per thread; with fewer heads than threads, one head at a time with
//      the row blocks of the assignments spread over the threads): hash codes by a GEMM of
//      row blocks against the planes, Lloyd rounds (Hamming distances 32 queries at a time in
//      SIMD lanes, or a GEMM against the centroids), then the groups and their means;
//   2. per chunk of 128 groups of a head (one chunk at the default 100 clusters, so K and V
//      are packed for the GEMMs once per head): S = Q_chunk K^T (GEMM), top-k selection and row
//      softmax, zero the top-k entries (improved), O = S V (GEMM): the centroid outputs, or
//      the residuals sum_{j not in T} A[j] v_j; then plain: copy O_g to the members; improved:
//      per block of 128 members, S2 = Q_blk K_T^T (GEMM), row softmax times mhat,
//      out_blk = O_g + S2 V_T (GEMM). Chunks run in parallel; with fewer chunks than threads
//      they run one at a time and OpenBLAS spreads each GEMM over the threads.
// Every sum has a fixed order (row order, fixed chunks), so the output does not depend on the
// thread count.
// Time O(B H (iterations n c + n d bits + c m d + n k d)) with codes (iterations n c d with
// bits = 0); memory O(B H (n + c d) + threads (min(c, 128) m + n)).
// Backward: the forward keeps nothing; the backward clusters the queries again (the same
// clusters and top keys, deterministic functions of q and k) and holds them constant, as the
// paper trains: dR_g = sum of the members' dO; the members' exact attention over T_g (scaled
// by mhat_g) gives dq, dK_T, dV_T and dmhat_g; dA = dR V^T off T_g and dmhat_g on it; the
// centroid softmax's backward gives dQ_G and dK, and each member gets dQ_g / |g|.
// Departures from fast-transformers: it draws new planes on every call, initialises the
// centroids with the first c codes, reseeds empty clusters at random and counts `iterations`
// as the number of assignments; here planes and initial rows come from the seed per head,
// empty clusters keep their centroid, `iterations` counts update rounds, and rounds stop once
// the assignment repeats (which changes nothing, see clustered.h). bits = 0 (Euclidean k-means
// on the vectors) is an addition. Not causal: a centroid mixes the queries of all positions,
// so causal problems are refused (caps.causal = false; fast-transformers' separate causal
// form, with its own masking rules, is not part of this variant).
#include "variants/clustered.h"

#include <cblas.h>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel_for.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/kernels/softmax.h"
#include "common/patterns/row_pattern.h"
#include "common/reference/oracle.h"
#include "variants/clustered_kmeans.h"

namespace attnbench {
namespace {

using clustered::Clusters;
using clustered::Groups;
using clustered::Settings;

constexpr int64_t kChunkG = 128;      // groups (centroids) per task of step 2
constexpr int64_t kMemberRows = 128;  // members per GEMM block of the improved part

// The kk largest scores of s[0, m) (ties to the lower index), written to keys ascending.
// A min-heap of the kk best so far; scores are compared with its minimum 16 at a time, so most
// of a row costs one vector comparison per 16 scores.
void top_keys(const float* s, int64_t m, int64_t kk, std::pair<float, int32_t>* heap,
              int32_t* keys) {
  // heap order: the worst candidate (lowest score, then highest index) on top
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  for (int64_t j = 0; j < kk; ++j) heap[j] = {s[j], int32_t(j)};
  std::make_heap(heap, heap + kk, better);
  auto consider = [&](int64_t jj) {
    if (s[jj] > heap[0].first) {  // an equal score has a higher index: not better
      std::pop_heap(heap, heap + kk, better);
      heap[kk - 1] = {s[jj], int32_t(jj)};
      std::push_heap(heap, heap + kk, better);
    }
  };
  int64_t j = kk;
#if defined(__AVX512F__)
  // 16 scores per compare against the current minimum; only lanes above it are looked at
  for (; j + 16 <= m; j += 16) {
    uint32_t mask =
        _mm512_cmp_ps_mask(_mm512_loadu_ps(s + j), _mm512_set1_ps(heap[0].first), _CMP_GT_OQ);
    for (; mask != 0; mask &= mask - 1) consider(j + std::countr_zero(mask));
  }
#else
  for (; j + 16 <= m; j += 16) {
    if (row_max(s + j, 16) <= heap[0].first) continue;
    for (int64_t t = 0; t < 16; ++t) consider(j + t);
  }
#endif
  for (; j < m; ++j) consider(j);
  for (int64_t t = 0; t < kk; ++t) keys[t] = heap[t].second;
  std::sort(keys, keys + kk);
}

// S = Q_g K^T for groups [g0, g0 + rows) of gr (rows x m).
void scores(const Groups& gr, int64_t g0, int64_t rows, int64_t d, int64_t m, const float* k,
            int64_t ldk, float* s) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(m), int(d), 1.0f,
              gr.means.data() + g0 * d, int(d), k, int(ldk), 0.0f, s, int(m));
}

// Number of valid keys of batch element b: its key length under key padding, else all m.
int64_t valid_keys(const Problem& p, int64_t b) {
  return p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)];
}

// The clustering settings of a variant's parameters.
Settings settings(const ParamValues& pv) {
  return Settings{.clusters = pv.get_int("clusters"),
                  .iterations = pv.get_int("iterations"),
                  .bits = int(pv.get_int("bits"))};
}

class Clustered final : public Variant, public RecomputeBackward<Clustered> {
 public:
  Clustered(Settings s, int64_t topk) : s_(s), topk_(topk) {}

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const int64_t n = p.n, m = p.keys(), d = p.dim, H = p.heads, BH = p.batch * p.heads;
    std::vector<Groups> groups(static_cast<size_t>(BH));
    cluster_all(p, q, groups);
    // step 2: tasks of up to kChunkG groups of one head
    std::vector<int64_t> task_start(size_t(BH + 1), 0);
    for (int64_t bh = 0; bh < BH; ++bh)
      task_start[size_t(bh + 1)] =
          task_start[size_t(bh)] + (groups[size_t(bh)].size() + kChunkG - 1) / kChunkG;
    const int64_t tasks = task_start[size_t(BH)];
    const int64_t kk = std::min(topk_, m);
    const float scale = p.softmax_scale();
    // with fewer tasks than threads (one or two heads), the tasks run one at a time and the
    // GEMMs use the threads
    OmpGuard guard;
#pragma omp parallel if (tasks >= team_threads())
    {
      const int64_t rows_max = std::min({kChunkG, s_.clusters, n});
      std::unique_ptr<float[]> sbuf, obuf, mhat, ibuf;
      std::unique_ptr<int32_t[]> keys;
      std::unique_ptr<std::pair<float, int32_t>[]> heap;
      guard.run([&] {
        sbuf.reset(new float[size_t(rows_max * m)]);
        obuf.reset(new float[size_t(rows_max * d)]);
        keys.reset(new int32_t[size_t(rows_max * kk)]);
        mhat.reset(new float[size_t(rows_max)]);
        heap.reset(new std::pair<float, int32_t>[size_t(kk)]);
        // improved: K_T, V_T (kk x d each), member block Q (rows x d), S2 (rows x kk), O2
        // (rows x d)
        const int64_t mrows = std::min(kMemberRows, n);
        if (kk > 0) ibuf.reset(new float[size_t(2 * kk * d + mrows * (2 * d + kk))]);
      });
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < tasks; ++t)
        guard.run([&] {
          const int64_t bh =
              std::upper_bound(task_start.begin(), task_start.end(), t) - task_start.begin() - 1;
          const int64_t b = bh / H, h = bh % H;
          const Groups& gr = groups[size_t(bh)];
          const int64_t g0 = (t - task_start[size_t(bh)]) * kChunkG,
                        rows = std::min(kChunkG, gr.size() - g0);
          float* s = sbuf.get();
          float* o = obuf.get();
          // the batch element's valid keys only (all m without key padding): mb columns
          const int64_t mb = valid_keys(p, b), kb = std::min(topk_, mb);
          if (mb == 0) {  // no key: the members' rows are 0
            std::fill_n(o, d, 0.0f);
          } else {
            scores(gr, g0, rows, d, mb, k.head(b, h), k.stride_row, s);
            for (int64_t r = 0; r < rows; ++r) {
              float* row = s + r * mb;
              if (kb > 0) top_keys(row, mb, kb, heap.get(), keys.get() + r * kb);
              softmax_row(row, mb, scale);
              if (kb > 0) {
                float mass = 0;
                for (int64_t e = 0; e < kb; ++e) {
                  const int32_t j = keys[size_t(r * kb + e)];
                  mass += row[j];
                  row[j] = 0.0f;
                }
                mhat[r] = mass;
              }
            }
            // O = A V: centroid outputs (plain) or residuals (improved)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(mb), 1.0f,
                        s, int(mb), v.head(b, h), int(v.stride_row), 0.0f, o, int(d));
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t g = g0 + r;
            const int32_t* mem = gr.members.data() + gr.start[size_t(g)];
            const int64_t count = gr.start[size_t(g) + 1] - gr.start[size_t(g)];
            if (kb == 0) {
              const float* src = mb == 0 ? o : o + r * d;
              for (int64_t e = 0; e < count; ++e)
                std::memcpy(out.row(b, h, mem[e]), src, size_t(d) * sizeof(float));
            } else {
              improved_members(q, k, v, out, b, h, mem, count, keys.get() + r * kb, kb, mhat[r],
                               o + r * d, scale, ibuf.get());
            }
          }
        });
    }
    guard.rethrow();
  }

  // The backward: the clusters and the top keys are constants (recomputed as the forward
  // makes them); the centroid means, both softmaxes, mhat and the residual are differentiated
  // (backward_head). The forward keeps nothing (RecomputeBackward).
  void recompute_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          ConstTensorView, ConstTensorView dout, TensorView dq, TensorView dk,
                          TensorView dv) {
    std::vector<Groups> groups(size_t(p.batch * p.heads));
    cluster_all(p, q, groups);
    parallel_for(
        p.batch * p.heads, [&] { return std::vector<float>(size_t(backward_floats(p))); },
        [&](int64_t bh, std::vector<float>& buf) {
          backward_head(p, bh / p.heads, bh % p.heads, groups[size_t(bh)], q, k, v, dout, dq, dk,
                        dv, buf.data());
        });
  }

  double backward_flops(const Problem& p) const override {
    const double bh = double(p.batch * p.heads), n = double(p.n), m = double(p.keys()),
                 d = double(p.dim), c = double(std::min(s_.clusters, p.n)),
                 kk = double(std::min(topk_, p.keys()));
    // the clustering again (flops() less its attention part), then S, dA, dV, dQ_G and dK
    // (2 c m d each), both softmax backward passes, and per member of the improved variant
    // S2, O2, dP, dq, dK_T and dV_T (2 kk d each)
    const double attention = 10.0 * c * m * d + 8.0 * c * m + 2.0 * n * d;
    const double members = kk > 0 ? n * (12.0 * kk * d + 8.0 * kk) : 0.0;
    return flops(p) + bh * (attention + members);
  }
  // The forward's groups and clustering (memory_estimate), then per thread the buffers of
  // backward_head and group_top_keys' scores, heap and lists.
  double backward_memory_estimate(const Problem& p) const override {
    const double c = double(std::min(s_.clusters, p.n)), m = double(p.keys());
    const double kk = double(std::min(topk_, p.keys()));
    const double top =
        kk > 0 ? 4.0 * std::min(double(kChunkG), c) * m + 8.0 * kk + 4.0 * c * kk : 0;
    return memory_estimate(p) +
           double(team_threads()) * (double(backward_floats(p)) * sizeof(float) + top);
  }

  double flops(const Problem& p) const override {
    const double bh = double(p.batch * p.heads), n = double(p.n), m = double(p.keys()),
                 d = double(p.dim), c = double(std::min(s_.clusters, p.n)),
                 it = double(s_.iterations), kk = double(std::min(topk_, p.keys()));
    // clustering, at most iterations + 1 assignments (fewer once they settle): codes 2 n d bits
    // (GEMM) + n bits; a Hamming distance is xor, popcount and compare-select (3 operations);
    // a majority update n bits. Euclidean: 2 n c d per assignment (GEMM) and n d per update.
    double cluster;
    if (s_.bits > 0) {
      const double bits = double(s_.bits);
      cluster = 2 * n * d * bits + n * bits + (it + 1) * 3 * n * c + it * n * bits;
    } else {
      cluster = (it + 1) * (2 * n * c * d + n * c) + it * n * d;
    }
    // attention: means n d, scores and A V 2 c m d each, softmax about 4 per score, copies n d;
    // improved: top-k about one comparison per score, per member 4 kk d (two GEMMs) + 4 kk.
    double attn = n * d + 4 * c * m * d + 4 * c * m + n * d;
    if (kk > 0) attn += c * m + n * (4 * kk * d + 4 * kk);
    return bh * (cluster + attn);
  }

  double memory_estimate(const Problem& p) const override {
    const double n = double(p.n), m = double(p.keys()), d = double(p.dim), f = 4,
                 c = double(std::min(s_.clusters, p.n)), kk = double(std::min(topk_, p.keys()));
    const double BH = double(p.batch * p.heads), T = double(team_threads());
    // the groups of every head, kept from step 1 to step 2 (members, start, cluster, means)
    const double shared = BH * (4 * n + 12 * c + f * c * d + 8) + 8 * BH;
    // step 1, per head in flight: assignment, codes (or centroids), counters, initial rows
    // (and their Floyd marks), the groups' counting sort; per thread a block buffer
    const double heads = BH >= T ? T : 1.0;
    double head;
    double block;
    if (s_.bits > 0) {
      const double code = s_.bits <= 32 ? 4 : 8;
      head = 4 * n + code * (n + c) + c * (64 * 4 + 4) + 8 * c + n + f * d * (s_.bits + 1);
      block = f * double(std::min<int64_t>(clustered::kBlockRows, p.n)) * s_.bits;
    } else {
      head = 4 * n + f * c * d + f * c + 8 * c * d + 4 * c + 8 * c + n;
      block = f * double(std::min<int64_t>(clustered::kBlockEuclid, p.n)) * c;
    }
    head += 16 * c + 8 * d;  // group_queries: counts and slots, one double row
    const double step1 = heads * head + T * block;
    // step 2, per thread: scores and outputs of a chunk, top-k lists, improved buffers
    const double rows = double(std::min({kChunkG, s_.clusters, p.n}));
    double step2 = rows * (f * m + f * d + 4 * kk + f) + 8 * kk;
    if (kk > 0) step2 += f * (2 * kk * d + std::min<double>(double(kMemberRows), n) * (2 * d + kk));
    // (tasks of step 2: chunks of up to kChunkG groups; fewer than threads run one at a time,
    // and OpenBLAS's threaded GEMMs then take about 512 KiB of their own, as measured)
    const double tasks = BH * std::ceil(c / double(kChunkG));
    step2 = tasks >= T ? T * step2 : step2 + (T > 1 ? 512.0 * 1024 : 0.0);
    return shared + std::max(step1, step2);
  }

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView q,
                                              ConstTensorView k) const override {
    if (topk_ == 0) return nullptr;
    const int64_t d = p.dim;
    std::vector<Groups> groups(size_t(p.batch * p.heads));
    cluster_all(p, q, groups);
    auto pat = std::make_unique<GroupPattern>(p);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h) {
        const Groups& gr = groups[size_t(b * p.heads + h)];
        const int64_t mb = valid_keys(p, b), kk = std::min(topk_, mb);
        const std::vector<int32_t> keys =
            clustered::group_top_keys(gr, k.head(b, h), k.stride_row, mb, d, kk);
        pat->begin_head();
        for (int64_t g = 0; g < gr.size(); ++g) {
          const int32_t id = pat->add_group(keys.data() + g * kk, kk);
          for (int64_t e = gr.start[size_t(g)]; e < gr.start[size_t(g) + 1]; ++e)
            pat->add_membership(gr.members[size_t(e)], id);
        }
        pat->finish_head();
      }
    return pat;
  }

 private:
  // Step 1: clusters and groups of every head.
  // Floats of one thread's buffers for backward_head: A, dA and the masked A (c x m each), dR
  // and dQ_G (c x d each), mhat and dmhat (c), and for the improved members Q, dO, O2 (n x d
  // each), P and dP (n x kk), K_T, V_T and their gradients (kk x d each).
  int64_t backward_floats(const Problem& p) const {
    const int64_t c = std::min(s_.clusters, p.n), m = p.keys(), d = p.dim, n = p.n;
    const int64_t kk = std::min(topk_, m);
    return 3 * c * m + 2 * c * d + 2 * c + (kk > 0 ? 3 * n * d + 2 * n * kk + 4 * kk * d : 0);
  }

  /// The gradients of head (b, h) with its groups gr. With A = softmax(s Q_G K^T) over the
  /// valid keys, T_g the top keys, mhat_g = sum_{j in T_g} A_gj, R_g = sum_{j not in T_g} A_gj
  /// v_j and member i's out_i = R_g + mhat_g P_i V_T, P_i = softmax(s q_i K_T^T):
  ///   dR_g = sum_{i in g} dO_i;  per member, dO2_i = mhat_g dO_i, dmhat_g += dO_i . (P_i V_T),
  ///   softmax attention's backward over T_g (dq_i, dK_T, dV_T);
  ///   dA_gj = dR_g . v_j off T_g and dmhat_g on it, dV += A_masked^T dR,
  ///   dS = A o (dA - rowsum(A o dA)) s, dQ_G = dS K, dK += dS^T Q_G, dq_i += dQ_g / |g|.
  /// The plain variant is the case T empty. Padded keys get 0.
  void backward_head(const Problem& p, int64_t b, int64_t h, const Groups& gr, ConstTensorView q,
                     ConstTensorView k, ConstTensorView v, ConstTensorView dout, TensorView dq,
                     TensorView dk, TensorView dv, float* buf) const {
    const int64_t n = p.n, m = p.keys(), d = p.dim, G = gr.size();
    const int64_t mb = valid_keys(p, b), kb = std::min(topk_, mb);
    const float scale = p.softmax_scale();
    for (int64_t i = 0; i < n; ++i) std::fill_n(dq.row(b, h, i), d, 0.0f);
    for (int64_t j = 0; j < m; ++j) {
      std::fill_n(dk.row(b, h, j), d, 0.0f);
      std::fill_n(dv.row(b, h, j), d, 0.0f);
    }
    if (mb == 0 || G == 0) return;  // no key: the rows are 0
    const std::vector<int32_t> top =
        kb > 0 ? group_top_keys(gr, k.head(b, h), k.stride_row, mb, d, kb) : std::vector<int32_t>();
    float *a = buf, *da = a + G * mb, *am = da + G * mb, *dr = am + G * mb, *dqg = dr + G * d;
    float *mhat = dqg + G * d, *dmhat = mhat + G;
    float *qm = dmhat + G, *om = qm + n * d, *o2 = om + n * d, *pm = o2 + n * d, *gp = pm + n * kb;
    float *kt = gp + n * kb, *vt = kt + kb * d, *dkt = vt + kb * d, *dvt = dkt + kb * d;
    // A, its masked copy and mhat
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(G), int(mb), int(d), 1.0f,
                gr.means.data(), int(d), k.head(b, h), int(k.stride_row), 0.0f, a, int(mb));
    for (int64_t g = 0; g < G; ++g) {
      softmax_row(a + g * mb, mb, scale);
      std::copy_n(a + g * mb, mb, am + g * mb);
      float mass = 0.0f;
      for (int64_t e = 0; e < kb; ++e) {
        const int32_t j = top[size_t(g * kb + e)];
        mass += a[g * mb + j];
        am[g * mb + j] = 0.0f;
      }
      mhat[g] = mass;
      dmhat[g] = 0.0f;
    }
    // dR_g, and the members' exact attention over T_g
    for (int64_t g = 0; g < G; ++g) {
      const int32_t* mem = gr.members.data() + gr.start[size_t(g)];
      const int64_t count = gr.start[size_t(g) + 1] - gr.start[size_t(g)];
      float* r = dr + g * d;
      std::fill_n(r, d, 0.0f);
      for (int64_t e = 0; e < count; ++e) {
        const float* go = dout.row(b, h, mem[e]);
        for (int64_t x = 0; x < d; ++x) r[x] += go[x];
      }
      if (kb == 0) continue;
      const int32_t* tk = top.data() + g * kb;
      for (int64_t e = 0; e < kb; ++e) {
        std::copy_n(k.row(b, h, tk[e]), d, kt + e * d);
        std::copy_n(v.row(b, h, tk[e]), d, vt + e * d);
      }
      for (int64_t e = 0; e < count; ++e) {
        std::copy_n(q.row(b, h, mem[e]), d, qm + e * d);
        std::copy_n(dout.row(b, h, mem[e]), d, om + e * d);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(count), int(kb), int(d), 1.0f, qm,
                  int(d), kt, int(d), 0.0f, pm, int(kb));
      for (int64_t e = 0; e < count; ++e) softmax_row(pm + e * kb, kb, scale);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(count), int(d), int(kb), 1.0f, pm,
                  int(kb), vt, int(d), 0.0f, o2, int(d));
      // dmhat = sum_i dO_i . O2_i; then dO2 = mhat dO (in om)
      float dm = 0.0f;
      for (int64_t i = 0; i < count * d; ++i) dm += om[i] * o2[i];
      dmhat[g] = dm;
      for (int64_t i = 0; i < count * d; ++i) om[i] *= mhat[g];
      // dP = dO2 V_T^T, dS = P o (dP - rowsum(dO2 o O2)) s
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(count), int(kb), int(d), 1.0f, om,
                  int(d), vt, int(d), 0.0f, gp, int(kb));
      for (int64_t e = 0; e < count; ++e)
        softmax_backward_row(pm + e * kb, gp + e * kb, kb, dot(om + e * d, o2 + e * d, d), scale);
      // dq_i = dS K_T (through o2), dK_T = dS^T Q, dV_T = P^T dO2
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(count), int(d), int(kb), 1.0f, gp,
                  int(kb), kt, int(d), 0.0f, o2, int(d));
      for (int64_t e = 0; e < count; ++e) {
        float* o = dq.row(b, h, mem[e]);
        for (int64_t x = 0; x < d; ++x) o[x] += o2[e * d + x];
      }
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(kb), int(d), int(count), 1.0f, gp,
                  int(kb), qm, int(d), 0.0f, dkt, int(d));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(kb), int(d), int(count), 1.0f, pm,
                  int(kb), om, int(d), 0.0f, dvt, int(d));
      for (int64_t e = 0; e < kb; ++e) {
        float *ok = dk.row(b, h, tk[e]), *ov = dv.row(b, h, tk[e]);
        for (int64_t x = 0; x < d; ++x) ok[x] += dkt[e * d + x], ov[x] += dvt[e * d + x];
      }
    }
    // dA = dR V^T off T, dmhat on T; dV += A_masked^T dR
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(G), int(mb), int(d), 1.0f, dr, int(d),
                v.head(b, h), int(v.stride_row), 0.0f, da, int(mb));
    for (int64_t g = 0; g < G; ++g)
      for (int64_t e = 0; e < kb; ++e) da[g * mb + top[size_t(g * kb + e)]] = dmhat[g];
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(mb), int(d), int(G), 1.0f, am, int(mb),
                dr, int(d), 1.0f, dv.head(b, h), int(dv.stride_row));
    // the centroid softmax: dS, dQ_G = dS K, dK += dS^T Q_G
    softmax_backward_rows(a, da, G, mb, scale);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(G), int(d), int(mb), 1.0f, da,
                int(mb), k.head(b, h), int(k.stride_row), 0.0f, dqg, int(d));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(mb), int(d), int(G), 1.0f, da, int(mb),
                gr.means.data(), int(d), 1.0f, dk.head(b, h), int(dk.stride_row));
    // the means: each member gets dQ_g / |g|
    for (int64_t g = 0; g < G; ++g) {
      const int32_t* mem = gr.members.data() + gr.start[size_t(g)];
      const int64_t count = gr.start[size_t(g) + 1] - gr.start[size_t(g)];
      const float inv = 1.0f / float(count);
      for (int64_t e = 0; e < count; ++e) {
        float* o = dq.row(b, h, mem[e]);
        for (int64_t x = 0; x < d; ++x) o[x] += dqg[g * d + x] * inv;
      }
    }
  }

  void cluster_all(const Problem& p, ConstTensorView q, std::vector<Groups>& groups) const {
    const int64_t BH = p.batch * p.heads, H = p.heads;
    const bool per_head = BH >= team_threads();
    parallel_for(
        BH, [] { return Clusters(); },
        [&](int64_t bh, Clusters& cl) {
          const int64_t b = bh / H, h = bh % H;
          clustered::cluster_queries(q.head(b, h), q.stride_row, p.n, p.dim, s_, p.seed, h,
                                     !per_head, cl);
          clustered::group_queries(q.head(b, h), q.stride_row, p.n, p.dim, cl.assign.data(), cl.c,
                                   groups[size_t(bh)]);
        },
        {.parallel = per_head});
  }

  // The improved part for the `count` members of one group: out_i = resid +
  // mhat softmax(s q_i K_T^T) V_T, in blocks of kMemberRows members.
  static void improved_members(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                               TensorView out, int64_t b, int64_t h, const int32_t* mem,
                               int64_t count, const int32_t* keys, int64_t kk, float mhat,
                               const float* resid, float scale, float* buf) {
    const int64_t d = q.shape.dim;
    float* kt = buf;
    float* vt = kt + kk * d;
    float* qm = vt + kk * d;
    const int64_t block = std::min(kMemberRows, q.shape.len);  // rows of qm, s2, o2
    float* s2 = qm + block * d;
    float* o2 = s2 + block * kk;
    for (int64_t e = 0; e < kk; ++e) {
      std::memcpy(kt + e * d, k.row(b, h, keys[e]), size_t(d) * sizeof(float));
      std::memcpy(vt + e * d, v.row(b, h, keys[e]), size_t(d) * sizeof(float));
    }
    for (int64_t e0 = 0; e0 < count; e0 += block) {
      const int64_t rows = std::min(block, count - e0);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(qm + r * d, q.row(b, h, mem[e0 + r]), size_t(d) * sizeof(float));
        std::memcpy(o2 + r * d, resid, size_t(d) * sizeof(float));
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(kk), int(d), 1.0f, qm,
                  int(d), kt, int(d), 0.0f, s2, int(kk));
      for (int64_t r = 0; r < rows; ++r) {
        float* row = s2 + r * kk;
        softmax_row(row, kk, scale);
        for (int64_t e = 0; e < kk; ++e) row[e] *= mhat;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(kk), 1.0f, s2,
                  int(kk), vt, int(d), 1.0f, o2, int(d));
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out.row(b, h, mem[e0 + r]), o2 + r * d, size_t(d) * sizeof(float));
    }
  }

  Settings s_;
  int64_t topk_;
};

}  // namespace

namespace clustered {

std::vector<int32_t> group_top_keys(const Groups& gr, const float* k, int64_t ldk, int64_t m,
                                    int64_t d, int64_t kk) {
  std::vector<int32_t> keys(size_t(gr.size() * kk));
  if (kk == 0) return keys;
  const int64_t chunk = std::min(kChunkG, gr.size());
  std::vector<float> s(size_t(chunk * m));
  std::vector<std::pair<float, int32_t>> heap(static_cast<size_t>(kk));
  for (int64_t g0 = 0; g0 < gr.size(); g0 += kChunkG) {
    const int64_t rows = std::min(kChunkG, gr.size() - g0);
    scores(gr, g0, rows, d, m, k, ldk, s.data());
    for (int64_t r = 0; r < rows; ++r)
      top_keys(s.data() + r * m, m, kk, heap.data(), keys.data() + (g0 + r) * kk);
  }
  return keys;
}

std::vector<Choices> choices(const Problem& p, const Settings& s, int64_t topk, ConstTensorView q,
                             ConstTensorView k) {
  std::vector<Choices> out;
  Clusters cl;
  Groups gr;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t m = p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)];
      cluster_queries(q.head(b, h), q.stride_row, p.n, p.dim, s, p.seed, h, false, cl);
      group_queries(q.head(b, h), q.stride_row, p.n, p.dim, cl.assign.data(), cl.c, gr);
      out.push_back(Choices{
          cl.assign, cl.c,
          m == 0 ? std::vector<int32_t>()
                 : group_top_keys(gr, k.head(b, h), k.stride_row, m, p.dim, std::min(topk, m))});
    }
  return out;
}

std::vector<double> oracle(const Problem& p, const Settings& s, int64_t topk, ConstTensorView q,
                           ConstTensorView k, ConstTensorView v) {
  return oracle_on_choices(p, topk, choices(p, s, topk, q, k), q, k, v);
}

std::vector<double> oracle_on_choices(const Problem& p, int64_t topk,
                                      const std::vector<Choices>& choices, ConstTensorView q,
                                      ConstTensorView k, ConstTensorView v) {
  const int64_t n = p.n, d = p.dim;
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> out(size_t(p.q_shape().numel()), 0.0);
  Groups gr;
  std::vector<double> centre(static_cast<size_t>(d)), a, rest(static_cast<size_t>(d)), w;
  std::vector<uint8_t> in_top;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      // the keys are the valid ones, j < m (the key length of b under key padding): none
      // leaves the rows 0
      const int64_t m = p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)],
                    kk = std::min(topk, m);
      if (m == 0) continue;
      a.assign(size_t(m), 0.0);
      w.assign(size_t(kk), 0.0);
      in_top.assign(size_t(m), 0);
      const Choices& ch = choices[size_t(b * p.heads + h)];
      group_queries(q.head(b, h), q.stride_row, n, d, ch.assign.data(), ch.c, gr);
      const std::vector<int32_t>& top = ch.top;
      double* o = out.data() + (b * p.heads + h) * n * d;
      for (int64_t g = 0; g < gr.size(); ++g) {
        const int32_t* mem = gr.members.data() + gr.start[size_t(g)];
        const int64_t count = gr.start[size_t(g) + 1] - gr.start[size_t(g)];
        // the centroid query: the mean of the members
        std::fill(centre.begin(), centre.end(), 0.0);
        for (int64_t e = 0; e < count; ++e)
          for (int64_t x = 0; x < d; ++x) centre[size_t(x)] += double(q.row(b, h, mem[e])[x]);
        for (double& x : centre) x /= double(count);
        // A = softmax(s Q_g K^T) over the m valid keys
        double mx = -INFINITY;
        for (int64_t j = 0; j < m; ++j) {
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += centre[size_t(x)] * double(k.row(b, h, j)[x]);
          mx = std::max(mx, a[size_t(j)] = scale * dot);
        }
        double z = 0;
        for (double& x : a) z += (x = std::exp(x - mx));
        for (double& x : a) x /= z;
        // the centroid's mass on its top keys, and its attention to the others
        std::fill(in_top.begin(), in_top.end(), 0);
        double mhat = 0;
        for (int64_t e = 0; e < kk; ++e) {
          const int32_t j = top[size_t(g * kk + e)];
          in_top[size_t(j)] = 1;
          mhat += a[size_t(j)];
        }
        std::fill(rest.begin(), rest.end(), 0.0);
        for (int64_t j = 0; j < m; ++j)
          if (!in_top[size_t(j)])
            for (int64_t x = 0; x < d; ++x)
              rest[size_t(x)] += a[size_t(j)] * double(v.row(b, h, j)[x]);
        // member i: rest + mhat softmax_{j in T}(s q_i . k_j) V_T
        for (int64_t e = 0; e < count; ++e) {
          const int64_t i = mem[e];
          double* row = o + i * d;
          std::copy(rest.begin(), rest.end(), row);
          if (kk == 0) continue;
          double wmax = -INFINITY, wsum = 0;
          for (int64_t t = 0; t < kk; ++t) {
            const float* kj = k.row(b, h, top[size_t(g * kk + t)]);
            double dot = 0;
            for (int64_t x = 0; x < d; ++x) dot += double(q.row(b, h, i)[x]) * double(kj[x]);
            wmax = std::max(wmax, w[size_t(t)] = scale * dot);
          }
          for (double& x : w) wsum += (x = std::exp(x - wmax));
          for (int64_t t = 0; t < kk; ++t) {
            const float* vj = v.row(b, h, top[size_t(g * kk + t)]);
            for (int64_t x = 0; x < d; ++x) row[x] += mhat * w[size_t(t)] / wsum * double(vj[x]);
          }
        }
      }
    }
  return out;
}

}  // namespace clustered

namespace {

ATTNBENCH_REGISTER_VARIANT(
    clustered,
    VariantInfo{
        .name = "clustered",
        .summary = "queries k-means clustered (on LSH codes), each cluster attends with its "
                   "centroid; topk > 0: members attend the centroid's top-k keys exactly "
                   "(Vyas et al. 2020)",
        .complexity = "time O(iterations n c + c m d + n topk d), memory O(B H (n + c d) + "
                      "threads min(c, 128) m)",
        .family = "clustering",
        .display = "Clustered attention",
        .paper = "Vyas et al. 2020 (arXiv:2007.04825)",
        .look = {.color = "#ad494a", .marker = "h"},
        .params = {ParamSpec::Int("clusters", 100, 1, int64_t(1) << 24,
                                  "number of query clusters c (capped at n)"),
                   ParamSpec::Int("iterations", 10, 0, 1000,
                                  "Lloyd (k-means) rounds before the final assignment"),
                   ParamSpec::Int("bits", 32, 0, 64,
                                  "LSH code bits the queries are clustered on (Hamming "
                                  "k-means); 0 clusters the query vectors (Euclidean)"),
                   ParamSpec::Int("topk", 0, 0, int64_t(1) << 24,
                                  "improved variant: keys each member attends exactly (the "
                                  "paper uses 32; `attnbench pattern` exports them); 0 = plain "
                                  "clustered attention, which has no sparse pattern")},
        .caps = {.causal = false, .cross = true, .exact = false, .key_padding = true},
        .make =
            [](const ParamValues& pv) {
              return std::make_unique<Clustered>(settings(pv), pv.get_int("topk"));
            },
        .oracle =
            [](const Variant& var, const Problem& p, ConstTensorView q, ConstTensorView k,
               ConstTensorView v) {
              return clustered::oracle(p, settings(var.params()), var.params().get_int("topk"), q,
                                       k, v);
            },
        // Plain clustered attention is softmax attention of the centroids (their means rounded
        // to float32 once more), the chain of the default model. The improved part adds, per
        // member, softmax attention over its top keys, scaled by the centroid's mass on them (a
        // float32 sum of topk weights) and added to the residual: a second such chain whose
        // error adds to the first, hence twice the default.
        .tolerance =
            [](const Variant& var, const Problem& p, const Workload& wl) {
              return (var.params().get_int("topk") > 0 ? 2.0 : 1.0) * attention_tolerance(p, wl);
            }});

}  // namespace
}  // namespace attnbench
