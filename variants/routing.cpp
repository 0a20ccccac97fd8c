// routing: Routing Transformer attention (Roy et al. 2021, "Efficient Content-Based Sparse
// Attention with Routing Transformers", TACL), for an untrained benchmark.
//
// Queries and keys are routed to c clusters by their directions (unit-normalised q and k
// share one set of unit centroids); every cluster takes its w_q nearest queries and its w_k
// nearest keys (balanced routing: top-w by q . mu / |q|, ties to the lower position), and
// each selected query attends, with an exact softmax (scale 1/sqrt(d), the given q and k),
// to the keys its cluster selected. A query selected by several clusters gets the mean of
// their outputs; a query selected by none, or whose clusters hold no key it may see (causal),
// gets 0 — notes() reports how many.
//
// Centroids: in the paper they are trained (an exponential moving average over training
// batches); with no training they come from `iterations` Lloyd (spherical k-means) steps on a
// sample of at most `sample` of the n + m unit vectors, chosen from the seed, starting from c
// distinct sample points chosen from the seed. Lloyd runs on a sample because the routing
// decision must stay a small share of the time: one step on all tokens costs as much as the
// final assignment, 2 (n + m) c d flops.
//
// Defaults: window w = ceil(4 sqrt(n)), c = ceil(n / w) clusters (about sqrt(n) / 4: both grow
// as sqrt(n), so time grows as n^1.5); w_q = min(n, w), w_k = min(m, ceil(w m / n)). Deciding
// the routes costs 2 (n + m) c d flops and attending 4 c w_q w_k d, a ratio of n / w^2 = 1/16
// for self-attention: the split keeps routing a small share of the time (with c = w = sqrt(n)
// routing would cost as much as attending).
// Giving only `clusters` sets w = ceil(n / c); giving only `window` sets c = ceil(n / w).
// Causal: the mask is applied inside each cluster by position (bottom-right rule); cluster
// selection itself looks at the whole sequence, as balanced top-w routing does. m != n is
// supported. One cluster with w >= n is full attention.
// Key padding (Problem::key_lengths): padded keys are absent. Batch element b routes as if m
// were its L_b valid keys: w_k = min(L_b, ceil(w L_b / n)) (at least 1), the Lloyd sample is
// drawn from its n + L_b tokens (sample capped at n + L_b), and each cluster's top-w_k keys
// are chosen among the valid keys, so no padded key is ever sampled, chosen or attended.
// c and w_q depend on n only. Causal combines with padding by intersection (bottom-right
// alignment over the full m). L_b = 0 gives rows of 0.
// Time O(iterations sample c d + (n + m) c d + c w_q w_k d) = O(n^1.5 d) with the defaults;
// memory O(n d + c w_q d) for one head at a time.
// Backward: forward_train keeps every head's routes (c (w_q + w_k) indices); the centroids,
// memberships and top-w selections are constants of the backward. Per cluster it gathers the
// queries, keys and values, recomputes P and the cluster's output, and runs softmax
// attention's backward with query i's upstream gradient divided by the number of clusters
// its output averages; dQ, dK, dV are scattered back (a row or key in several clusters sums
// them). Tested against finite differences of oracle_on_routes with the routes frozen.
#include "variants/routing.h"

#include <cblas.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel_for.h"
#include "common/core/phase.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/core/tensor.h"
#include "common/core/threads.h"
#include "common/kernels/softmax.h"
#include "common/kernels/tile_attention.h"
#include "common/patterns/row_pattern.h"
#include "common/reference/oracle.h"

namespace attnbench {
namespace routing {
namespace {

constexpr uint64_t kRoutingStream = 0x726f7574696e67ULL;  // "routing"

/// Cosines of `count` <= 4 tokens (rows x + t ldx, 1/|x| in inv[t]) with every centroid:
/// out[t cp + u] = (sum_j x_t[j] mut[j cp + u]) inv[t], mut = the centroids transposed (d x cp,
/// zero padded). The same arithmetic for every token, so a score is the
/// same number wherever it is computed. cp is a multiple of 64.
void cosines(const float* mut, int64_t cp, int64_t d, const float* x, int64_t ldx, const float* inv,
             int64_t count, float* out) {
#ifdef __AVX512F__
  // 4 tokens (the last one repeated past `count`) x 64 centroids per register tile
  const float* xr[4];
  for (int t = 0; t < 4; ++t) xr[t] = x + std::min<int64_t>(t, count - 1) * ldx;
  for (int64_t g = 0; g < cp; g += 64) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t)
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[t][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; ++j) {
      const float* mrow = mut + j * cp + g;
      const __m512 m0 = _mm512_loadu_ps(mrow), m1 = _mm512_loadu_ps(mrow + 16),
                   m2 = _mm512_loadu_ps(mrow + 32), m3 = _mm512_loadu_ps(mrow + 48);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512 xv = _mm512_set1_ps(xr[t][j]);
        acc[t][0] = _mm512_fmadd_ps(xv, m0, acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(xv, m1, acc[t][1]);
        acc[t][2] = _mm512_fmadd_ps(xv, m2, acc[t][2]);
        acc[t][3] = _mm512_fmadd_ps(xv, m3, acc[t][3]);
      }
    }
    for (int64_t t = 0; t < count; ++t) {
      const __m512 s = _mm512_set1_ps(inv[t]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v)
        _mm512_storeu_ps(out + t * cp + g + 16 * v, _mm512_mul_ps(acc[t][v], s));
    }
  }
#else
  for (int64_t t = 0; t < count; ++t) {
    float* o = out + t * cp;
    std::fill(o, o + cp, 0.0f);
    for (int64_t j = 0; j < d; ++j) {
      const float xj = x[t * ldx + j];
      for (int64_t u = 0; u < cp; ++u) o[u] += xj * mut[j * cp + u];
    }
    for (int64_t u = 0; u < cp; ++u) o[u] *= inv[t];
  }
#endif
}

/// For every centroid u, the w tokens t with the largest cosine (mu_u . x_t / |x_t|; ties:
/// lower index), ascending: out[u w .. u w + w). x: len rows at stride ldx; inv: 1/|x_t|.
///
/// The c x len score matrix is never stored: a threshold per centroid is read off a strided
/// sample of the tokens (its rank chosen to keep about 1.5 w + 8 tokens), then every token's
/// cosines with all centroids are computed in registers and only those at or above their
/// centroid's threshold are kept. Every discarded score is below every kept one (scores are
/// computed the same way everywhere), so the selection among the kept is the exact top-w; a
/// centroid left with fewer than w candidates is selected again from all its scores.
void select_top(const float* mu, int64_t c, int64_t d, const float* x, int64_t ldx,
                const float* inv, int64_t len, int64_t w, int32_t* out) {
  constexpr int64_t kSample = 512;
  const int64_t cp = (c + 63) / 64 * 64;  // whole register tiles of cosines()
  std::vector<float> mut(static_cast<size_t>(d * cp), 0.0f);
  for (int64_t u = 0; u < c; ++u)
    for (int64_t j = 0; j < d; ++j) mut[size_t(j * cp + u)] = mu[u * d + j];
  // thresholds (padding centroids: +inf, never selected)
  std::vector<float> thr(static_cast<size_t>(cp), INFINITY);
  std::fill(thr.begin(), thr.begin() + c, -INFINITY);
  const int64_t step = std::max<int64_t>(1, len / kSample), taken = (len + step - 1) / step;
  if (w < len) {
    const int64_t rank = std::min(taken - 1, (w * taken) / len * 3 / 2 + 8);
    std::vector<float> ss(static_cast<size_t>(taken * cp)), col(static_cast<size_t>(taken));
    for (int64_t t = 0; t < taken; ++t)
      cosines(mut.data(), cp, d, x + t * step * ldx, ldx, inv + t * step, 1, ss.data() + t * cp);
    for (int64_t u = 0; u < c; ++u) {
      for (int64_t t = 0; t < taken; ++t) col[size_t(t)] = ss[size_t(t * cp + u)];
      std::nth_element(col.begin(), col.begin() + rank, col.end(), std::greater<>());
      thr[size_t(u)] = col[size_t(rank)];
    }
  }
  // candidates per centroid, gathered per thread then joined
  const int threads = omp_in_parallel() ? 1 : team_threads();
  std::vector<std::vector<std::pair<float, int32_t>>> cand(static_cast<size_t>(threads * c));
  OmpGuard guard;
#pragma omp parallel num_threads(threads)
  {
    auto* mine = cand.data() + omp_get_thread_num() * c;
    std::vector<float> sc;
    guard.run([&] { sc.resize(size_t(4 * cp)); });
#pragma omp for schedule(static)
    for (int64_t t0 = 0; t0 < len; t0 += 4)
      guard.run([&] {
        const int64_t count = std::min<int64_t>(4, len - t0);
        cosines(mut.data(), cp, d, x + t0 * ldx, ldx, inv + t0, count, sc.data());
        for (int64_t t = 0; t < count; ++t) {
          const float* st = sc.data() + t * cp;
          for (int64_t g = 0; g < cp; g += 16) {
            uint32_t keep = 0;
#ifdef __AVX512F__
            keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(st + g), _mm512_loadu_ps(thr.data() + g),
                                      _CMP_GE_OQ);
#else
            for (int l = 0; l < 16; ++l) keep |= uint32_t(st[g + l] >= thr[size_t(g + l)]) << l;
#endif
            while (keep) {
              const int l = __builtin_ctz(keep);
              keep &= keep - 1;
              mine[g + l].emplace_back(st[g + l], int32_t(t0 + t));
            }
          }
        }
      });
  }
  guard.rethrow();
  std::vector<std::pair<float, int32_t>> all;
  std::vector<float> sc(static_cast<size_t>(4 * cp));
  for (int64_t u = 0; u < c; ++u) {
    all.clear();
    for (int th = 0; th < threads; ++th) {
      const auto& part = cand[size_t(th * c + u)];
      all.insert(all.end(), part.begin(), part.end());
    }
    if (int64_t(all.size()) < w) {  // the sample misjudged this centroid: all its scores
      all.clear();
      for (int64_t t0 = 0; t0 < len; t0 += 4) {
        const int64_t count = std::min<int64_t>(4, len - t0);
        cosines(mut.data(), cp, d, x + t0 * ldx, ldx, inv + t0, count, sc.data());
        for (int64_t t = 0; t < count; ++t)
          all.emplace_back(sc[size_t(t * cp + u)], int32_t(t0 + t));
      }
    }
    auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b2) {
      return a.first > b2.first || (a.first == b2.first && a.second < b2.second);
    };
    std::nth_element(all.begin(), all.begin() + w, all.end(), better);
    int32_t* dst = out + u * w;
    for (int64_t t = 0; t < w; ++t) dst[t] = all[size_t(t)].second;
    std::sort(dst, dst + w);
  }
}

}  // namespace

namespace {

/// pl with the sizes that follow from the number of keys m: wk and the sample.
Sizes with_keys(Sizes pl, int64_t n, int64_t m) {
  const int64_t w = pl.window, sample = pl.sample_limit;
  pl.wk = std::max<int64_t>(1, std::min(m, (w * m + n - 1) / n));
  pl.sample = sample == 0 ? n + m : std::min(sample, n + m);
  pl.sample = std::max(pl.sample, std::min(pl.c, n + m));
  return pl;
}

}  // namespace

Sizes sizes(const Problem& p, int64_t clusters, int64_t window, int64_t sample) {
  const int64_t n = p.n;
  int64_t c = clusters, w = window;
  if (c == 0 && w == 0) w = int64_t(std::ceil(4.0 * std::sqrt(double(n))));
  if (c == 0) c = (n + w - 1) / w;
  if (w == 0) w = (n + c - 1) / c;
  Sizes pl;
  pl.c = std::max<int64_t>(1, c);
  pl.wq = std::min(n, w);
  pl.window = w;
  pl.sample_limit = sample;
  return with_keys(pl, n, p.keys());
}

Sizes batch_sizes(const Problem& p, const Sizes& all, int64_t b) {
  if (p.key_lengths.empty()) return all;
  return with_keys(all, p.n, p.key_lengths[size_t(b)]);
}

Routes route(const Problem& p, const Sizes& sizes, int64_t iterations, ConstTensorView q,
             ConstTensorView k, int64_t b, int64_t h) {
  Workspace ws;
  return route(p, sizes, iterations, q, k, b, h, ws);
}

Routes route(const Problem& p, const Sizes& all, int64_t iterations, ConstTensorView q,
             ConstTensorView k, int64_t b, int64_t h, Workspace& ws) {
  // the valid keys of b are its only keys: m is their number, and the sizes follow from it
  const Sizes pl = batch_sizes(p, all, b);
  const int64_t n = p.n, m = p.key_lengths.empty() ? p.keys() : p.key_lengths[size_t(b)], d = p.dim,
                c = pl.c, total = n + m;
  Routes r;
  if (m == 0) return r;  // nothing to route to
  auto point = [&](int64_t t) { return t < n ? q.row(b, h, t) : k.row(b, h, t - n); };
  // 1 / |x| of every query and key (0 for a zero vector)
  std::vector<float>&inv_q = ws.inv_q, &inv_k = ws.inv_k;
  inv_q.resize(size_t(n));
  inv_k.resize(size_t(m));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < total; ++t) {
    const float* x = point(t);
    float ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; ++j) ss += x[j] * x[j];
    (t < n ? inv_q[size_t(t)] : inv_k[size_t(t - n)]) = ss > 0 ? 1.0f / std::sqrt(ss) : 0.0f;
  }
  auto unit = [&](int64_t t, float* dst) {
    const float* x = point(t);
    const float inv = t < n ? inv_q[size_t(t)] : inv_k[size_t(t - n)];
    for (int64_t j = 0; j < d; ++j) dst[j] = x[j] * inv;
  };
  // the sample: a seeded partial shuffle of the n + m tokens (per head)
  const RandomStream rs(p.seed, kRoutingStream ^ (uint64_t(h) << 8));
  std::vector<int64_t>& order = ws.order;
  order.resize(size_t(total));
  std::iota(order.begin(), order.end(), 0);
  const int64_t s_count = pl.sample;
  for (int64_t t = 0; t < s_count; ++t)
    std::swap(order[size_t(t)],
              order[size_t(t + int64_t(rs.below(uint64_t(t), uint64_t(total - t))))]);
  std::vector<float>& xs = ws.xs;
  xs.resize(size_t(s_count * d));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < s_count; ++t) unit(order[size_t(t)], xs.data() + t * d);

  const int64_t cc = std::min(c, s_count);
  r.centroids.assign(size_t(c * d), 0.0f);
  for (int64_t u = 0; u < cc; ++u)  // the first c sample points are distinct tokens
    std::copy_n(xs.data() + u * d, d, r.centroids.data() + u * d);
  std::vector<float>& sc = ws.sc;
  sc.resize(size_t(s_count * c));
  std::vector<int32_t>& assign = ws.assign;
  assign.resize(size_t(s_count));
  std::vector<double>& sums = ws.sums;
  sums.resize(size_t(c * d));
  std::vector<int64_t>& counts = ws.counts;
  counts.resize(size_t(c));
  for (int64_t it = 0; it < iterations; ++it) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(s_count), int(c), int(d), 1.0f,
                xs.data(), int(d), r.centroids.data(), int(d), 0.0f, sc.data(), int(c));
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < s_count; ++t) {
      const float* row = sc.data() + t * c;
      assign[size_t(t)] = int32_t(std::max_element(row, row + cc) - row);
    }
    std::fill(sums.begin(), sums.end(), 0.0);
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t t = 0; t < s_count; ++t) {
      const int64_t u = assign[size_t(t)];
      ++counts[size_t(u)];
      for (int64_t j = 0; j < d; ++j) sums[size_t(u * d + j)] += xs[size_t(t * d + j)];
    }
    for (int64_t u = 0; u < cc; ++u) {
      if (counts[size_t(u)] == 0) continue;  // an empty cluster keeps its centroid
      double ss = 0;
      for (int64_t j = 0; j < d; ++j) ss += sums[size_t(u * d + j)] * sums[size_t(u * d + j)];
      if (ss == 0) continue;
      const double inv = 1.0 / std::sqrt(ss);
      for (int64_t j = 0; j < d; ++j)
        r.centroids[size_t(u * d + j)] = float(sums[size_t(u * d + j)] * inv);
    }
  }
  r.wk = pl.wk;
  r.queries.resize(size_t(c * pl.wq));
  r.keys.resize(size_t(c * pl.wk));
  select_top(r.centroids.data(), c, d, q.row(b, h, 0), q.stride_row, inv_q.data(), n, pl.wq,
             r.queries.data());
  select_top(r.centroids.data(), c, d, k.row(b, h, 0), k.stride_row, inv_k.data(), m, pl.wk,
             r.keys.data());
  return r;
}

std::vector<double> oracle(const Problem& p, const Sizes& sz, int64_t iterations, ConstTensorView q,
                           ConstTensorView k, ConstTensorView v, int64_t* unrouted) {
  std::vector<Routes> routes;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) routes.push_back(route(p, sz, iterations, q, k, b, h));
  return oracle_on_routes(p, sz, routes, q, k, v, unrouted);
}

std::vector<double> oracle_on_routes(const Problem& p, const Sizes& sz,
                                     const std::vector<Routes>& routes, ConstTensorView q,
                                     ConstTensorView k, ConstTensorView v, int64_t* unrouted) {
  const int64_t n = p.n, d = p.dim;
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> out(size_t(p.q_shape().numel()), 0.0);
  int64_t missing = 0;
  std::vector<double> sum(static_cast<size_t>(n * d)), logit;
  std::vector<int64_t> used(static_cast<size_t>(n)), seen;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const Routes& r = routes[size_t(b * p.heads + h)];
      std::fill(sum.begin(), sum.end(), 0.0);
      std::fill(used.begin(), used.end(), 0);
      for (int64_t u = 0; u < (r.wk > 0 ? sz.c : 0); ++u)
        for (int64_t t = 0; t < sz.wq; ++t) {
          const int64_t i = r.queries[size_t(u * sz.wq + t)];
          const float* qi = q.row(b, h, i);
          logit.clear();
          seen.clear();
          for (int64_t e = 0; e < r.wk; ++e) {
            const int64_t j = r.keys[size_t(u * r.wk + e)];
            // causal and key padding (the routes hold valid keys only, so this is the causal
            // rule for them)
            if (j >= p.visible(b, i)) continue;
            const float* kj = k.row(b, h, j);
            double dot = 0;
            for (int64_t x = 0; x < d; ++x) dot += double(qi[x]) * double(kj[x]);
            logit.push_back(scale * dot);
            seen.push_back(j);
          }
          if (seen.empty()) continue;
          const double mx = *std::max_element(logit.begin(), logit.end());
          double z = 0;
          for (double& l : logit) z += (l = std::exp(l - mx));
          for (size_t e = 0; e < seen.size(); ++e) {
            const float* vj = v.row(b, h, seen[e]);
            for (int64_t x = 0; x < d; ++x) sum[size_t(i * d + x)] += logit[e] / z * double(vj[x]);
          }
          ++used[size_t(i)];
        }
      double* o = out.data() + (b * p.heads + h) * n * d;
      for (int64_t i = 0; i < n; ++i) {
        if (used[size_t(i)] == 0) {
          missing += p.visible(b, i) > 0;
          continue;
        }
        for (int64_t x = 0; x < d; ++x)
          o[i * d + x] = sum[size_t(i * d + x)] / double(used[size_t(i)]);
      }
    }
  if (unrouted != nullptr) *unrouted = missing;
  return out;
}

}  // namespace routing

namespace {

using routing::Routes;
using routing::Sizes;
constexpr int64_t kTile = 64;  // query tile and key block

/// The sizes of a routing variant (its parameters) on p.
Sizes sizes_of(const Variant& var, const Problem& p) {
  const ParamValues& pv = var.params();
  return routing::sizes(p, pv.get_int("clusters"), pv.get_int("window"), pv.get_int("sample"));
}

/// What forward_train keeps: the routes of every head, [b H + h].
class RoutingSaved final : public SavedState {
 public:
  std::vector<Routes> routes;
};

class RoutingVariant final : public Variant, public Backward {
 public:
  RoutingVariant(int64_t clusters, int64_t window, int64_t iterations, int64_t sample)
      : clusters_(clusters), window_(window), iterations_(iterations), sample_(sample) {}

  /// Heads run one per thread when there are at least as many (batch, head) pairs as
  /// threads; otherwise one head at a time, each step parallel inside.
  static bool by_head(const Problem& p, int threads) {
    return threads > 1 && p.batch * p.heads >= threads;
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    run_heads(p, q, k, v, out, nullptr);
  }

  // The backward: the routes (clusters, their top-w queries and keys) are the forward's and
  // constants of it; each cluster's softmax attention is differentiated as exact attention's,
  // with the upstream gradient of query i divided among the clusters its output averages.

  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out) override {
    auto st = std::make_unique<RoutingSaved>();
    st->routes.resize(size_t(p.batch * p.heads));
    run_heads(p, q, k, v, out, &st->routes);
    for (Routes& r : st->routes) r.centroids = {};  // the backward needs the memberships only
    return st;
  }

  using Variant::backward;  // the accessor stays visible beside the pass
  void backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                ConstTensorView, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    const auto* st = dynamic_cast<const RoutingSaved*>(&saved);
    if (!st || st->routes.size() != size_t(p.batch * p.heads))
      throw UsageError("routing: the saved state is not from its forward_train on this problem");
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    using Buffers = std::pair<std::vector<float>, std::vector<int32_t>>;
    parallel_for(
        p.batch * p.heads, [&] { return Buffers(size_t(cluster_floats(p, pl)), size_t(p.n)); },
        [&](int64_t bh, Buffers& buf) {
          backward_head(p, pl, st->routes[size_t(bh)], q, k, v, dout, dq, dk, dv, bh / p.heads,
                        bh % p.heads, buf.first.data(), buf.second.data());
        });
  }

  double backward_flops(const Problem& p) const override {
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    // per cluster: S again, dP, dQ, dK, dV (2 wq wk d each), the softmax and dS
    return double(p.batch * p.heads) * double(pl.c) * double(pl.wq) * double(pl.wk) *
           (10.0 * double(p.dim) + 8.0);
  }
  double saved_estimate(const Problem& p) const override {
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    return double(p.batch * p.heads) *
               (4.0 * double(pl.c) * double(pl.wq + pl.wk) + double(sizeof(Routes))) +
           double(sizeof(RoutingSaved));
  }
  double backward_memory_estimate(const Problem& p) const override {
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    return double(team_threads()) * (4.0 * double(cluster_floats(p, pl)) + 4.0 * double(p.n));
  }

  /// Every head's routes and attention; with `keep`, the routes of head (b, h) are kept in
  /// (*keep)[b H + h].
  void run_heads(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                 TensorView out, std::vector<Routes>* keep) {
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    const int64_t heads = p.batch * p.heads;
    std::atomic<int64_t> unrouted{0};
    // phases (common/core/phase.h): "route" is routing (Lloyd steps, centroid scores, top-w
    // selection), "attend" the attention within the clusters and the combination
    struct Scratch {
      HeadOutputs ho;
      routing::Workspace ws;
    };
    parallel_for(
        heads,
        [&] {
          return Scratch{HeadOutputs(p, pl), {}};
        },
        [&](int64_t bh, Scratch& s) {
          const int64_t b = bh / p.heads, h = bh % p.heads;
          const Routes r = [&] {
            Phase ph("route");
            return routing::route(p, pl, iterations_, q, k, b, h, s.ws);
          }();
          Phase ph("attend");
          if (r.wk == 0) {  // b has no valid key: its rows are 0
            for (int64_t i = 0; i < p.n; ++i) std::fill_n(out.row(b, h, i), p.dim, 0.0f);
            return;
          }
          attend(p, pl, r, q, k, v, b, h, s.ho);
          unrouted += combine(p, pl, r, out, b, h, s.ho);
          if (keep) (*keep)[size_t(bh)] = r;
        },
        {.parallel = by_head(p, team_threads())});
    unrouted_ = unrouted.load();
    rows_ = heads * p.n;
  }

  std::string notes() const override {
    if (rows_ == 0) return "";
    return fmt::format(
        "{} of {} query rows ({:.2f}%) routed to no cluster holding a key they "
        "may see: their output is 0",
        unrouted_, rows_, 100.0 * double(unrouted_) / double(rows_));
  }

  double flops(const Problem& p) const override {
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    const double d = double(p.dim), c = double(pl.c);
    const double lloyd = double(iterations_) * 2.0 * double(pl.sample) * c * d;
    const double assign = 2.0 * double(p.n + p.keys()) * c * d;
    const double attend = 4.0 * c * double(pl.wq) * double(pl.wk) * d;
    return double(p.batch * p.heads) * (lloyd + assign + attend);
  }

  double memory_estimate(const Problem& p) const override {
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    const int threads = team_threads();
    const double n = double(p.n), m = double(p.keys()), d = double(p.dim), c = double(pl.c);
    const double s = double(pl.sample);
    const double cp = std::ceil(c / 64) * 64;  // select_top's padded centroid count
    const double w = double(std::max(pl.wq, pl.wk));
    const double select = 4.0 * (d + 512 + 8) * cp + 8.0 * c * (1.5 * w + 16) * 2;
    const double head = 4.0 * (s * d + s * c + s + (n + m) + c * d) + 8.0 * ((n + m) + c * d + c) +
                        4.0 * c * double(pl.wq + pl.wk) + select;
    const double fwd = HeadOutputs::bytes(p, pl);
    const double per_thread =
        double(TileAttention::bytes(std::min(kTile, pl.wq), std::min(kTile, pl.wk), p.dim)) +
        4.0 * double(pl.wq + 2 * pl.wk) * d + 4.0 * double(kTile) +
        8.0 * double(std::max(p.n, p.keys())) + 4.0 * double(std::max(pl.wq, pl.wk));
    const int copies = by_head(p, threads) ? threads : 1;
    return (head + fwd) * copies + per_thread * threads;
  }

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView q,
                                              ConstTensorView k) const override {
    if (q.data == nullptr) return nullptr;
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    auto pat = std::make_unique<GroupPattern>(p);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h) {
        pat->begin_head();
        const Routes r = routing::route(p, pl, iterations_, q, k, b, h);
        for (int64_t u = 0; u < (r.wk > 0 ? pl.c : 0); ++u) {
          const int32_t g = pat->add_group(r.keys.data() + u * r.wk, r.wk);
          for (int64_t t = 0; t < pl.wq; ++t)
            pat->add_membership(r.queries[size_t(u * pl.wq + t)], g);
        }
        pat->finish_head();
      }
    return pat;
  }

 private:
  /// Per-cluster outputs of one head and the query -> (cluster, slot) index.
  struct HeadOutputs {
    std::vector<float> out;      // c x wq x d
    std::vector<uint8_t> valid;  // c x wq: the slot's query saw a key
    std::vector<int64_t> start;  // n + 1
    std::vector<int32_t> slots;  // c x wq
    HeadOutputs(const Problem& p, const Sizes& pl)
        : out(static_cast<size_t>(pl.c * pl.wq * p.dim)),
          valid(static_cast<size_t>(pl.c * pl.wq)),
          start(static_cast<size_t>(p.n + 1)),
          slots(static_cast<size_t>(pl.c * pl.wq)) {}
    static double bytes(const Problem& p, const Sizes& pl) {
      return 4.0 * double(pl.c * pl.wq) * double(p.dim + 2) + 8.0 * double(p.n + 1);
    }
  };

  /// Floats of one thread's buffers for backward_head: a cluster's gathered Q, K, V, dO (wq or
  /// wk rows of d), its P and dP (wq x wk) and the cluster's dQ rows (wq x d).
  static int64_t cluster_floats(const Problem& p, const Sizes& pl) {
    return (2 * pl.wq + 2 * pl.wk) * p.dim + 2 * pl.wq * pl.wk + pl.wq * p.dim;
  }

  /// The gradients of head (b, h) on its routes r: per cluster, gather its queries, keys and
  /// values, recompute P (softmax over the keys each query may see), and with dO_i divided by
  /// the number of clusters row i averages over:
  ///   dP = dO V^T, dS = P o (dP - rowsum(P o dP)), dQ = s dS K, dK = s dS^T Q, dV = P^T dO,
  /// scattered back to the rows and keys (a key or query in several clusters sums them).
  void backward_head(const Problem& p, const Sizes& pl, const Routes& r, ConstTensorView q,
                     ConstTensorView k, ConstTensorView v, ConstTensorView dout, TensorView dq,
                     TensorView dk, TensorView dv, int64_t b, int64_t h, float* buf,
                     int32_t* used) const {
    const int64_t n = p.n, m = p.keys(), d = p.dim, wq = pl.wq, wk = r.wk;
    for (int64_t i = 0; i < n; ++i) std::fill_n(dq.row(b, h, i), d, 0.0f);
    for (int64_t j = 0; j < m; ++j) {
      std::fill_n(dk.row(b, h, j), d, 0.0f);
      std::fill_n(dv.row(b, h, j), d, 0.0f);
    }
    if (wk == 0) return;  // no valid key: every row is 0
    const float scale = p.softmax_scale();
    // the clusters each row's output averages: those that selected it and hold a key it sees
    // (a cluster's keys ascend, so its first key decides)
    std::fill_n(used, n, 0);
    for (int64_t u = 0; u < pl.c; ++u)
      for (int64_t t = 0; t < wq; ++t) {
        const int32_t i = r.queries[size_t(u * wq + t)];
        if (r.keys[size_t(u * wk)] < p.visible(b, i)) ++used[i];
      }
    float *gq = buf, *gk = gq + wq * d, *gv = gk + wk * d, *go = gv + wk * d;
    float *pm = go + wq * d, *gp = pm + wq * wk, *gx = gp + wq * wk;  // gx: wq x d
    for (int64_t u = 0; u < pl.c; ++u) {
      const int32_t* qi = r.queries.data() + u * wq;
      const int32_t* kj = r.keys.data() + u * wk;
      for (int64_t t = 0; t < wq; ++t) {
        std::copy_n(q.row(b, h, qi[t]), d, gq + t * d);
        const float* g = dout.row(b, h, qi[t]);
        const float w = used[qi[t]] > 0 ? 1.0f / float(used[qi[t]]) : 0.0f;
        for (int64_t x = 0; x < d; ++x) go[t * d + x] = g[x] * w;
      }
      for (int64_t e = 0; e < wk; ++e) {
        std::copy_n(k.row(b, h, kj[e]), d, gk + e * d);
        std::copy_n(v.row(b, h, kj[e]), d, gv + e * d);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(wq), int(wk), int(d), 1.0f, gq,
                  int(d), gk, int(d), 0.0f, pm, int(wk));
      for (int64_t t = 0; t < wq; ++t) {
        float* row = pm + t * wk;
        const int64_t vis = p.visible(b, qi[t]);
        int64_t seen = 0;  // keys ascend: the visible ones are a prefix
        while (seen < wk && kj[seen] < vis) ++seen;
        softmax_row(row, seen, scale);
        std::fill(row + seen, row + wk, 0.0f);
      }
      // dP = dO V^T, dS = s P o (dP - rowsum(P o dP)) (the cluster's share of dO . O)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(wq), int(wk), int(d), 1.0f, go,
                  int(d), gv, int(d), 0.0f, gp, int(wk));
      softmax_backward_rows(pm, gp, wq, wk, scale);
      // dQ rows (through gx), then dK and dV rows (into gk and gv)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(wq), int(d), int(wk), 1.0f, gp,
                  int(wk), gk, int(d), 0.0f, gx, int(d));
      for (int64_t t = 0; t < wq; ++t) {
        float* o = dq.row(b, h, qi[t]);
        for (int64_t x = 0; x < d; ++x) o[x] += gx[t * d + x];
      }
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(wk), int(d), int(wq), 1.0f, gp,
                  int(wk), gq, int(d), 0.0f, gk, int(d));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(wk), int(d), int(wq), 1.0f, pm,
                  int(wk), go, int(d), 0.0f, gv, int(d));
      for (int64_t e = 0; e < wk; ++e) {
        float *ok = dk.row(b, h, kj[e]), *ov = dv.row(b, h, kj[e]);
        for (int64_t x = 0; x < d; ++x) ok[x] += gk[e * d + x], ov[x] += gv[e * d + x];
      }
    }
  }

  /// Every cluster: its queries attend its keys (exact softmax, causal mask by position; the
  /// keys are valid ones, so key padding needs no mask).
  void attend(const Problem& p, const Sizes& pl, const Routes& r, ConstTensorView q,
              ConstTensorView k, ConstTensorView v, int64_t b, int64_t h, HeadOutputs& ho) const {
    const int64_t d = p.dim, c = pl.c, wq = pl.wq, wk = r.wk;
    OmpGuard guard;
#pragma omp parallel
    {
      std::optional<TileAttention> tile;
      std::vector<float> gq, gk, gv, lse;
      guard.run([&] {
        tile.emplace(std::min(kTile, wq), std::min(kTile, wk), d, p.softmax_scale());
        gq.resize(size_t(wq * d));
        gk.resize(size_t(wk * d));
        gv.resize(size_t(wk * d));
        lse.resize(size_t(kTile));
      });
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < c; ++u)
        guard.run([&] {
          TileAttention& ta = *tile;
          const int32_t* qi = r.queries.data() + u * wq;
          const int32_t* kj = r.keys.data() + u * wk;
          for (int64_t t = 0; t < wq; ++t) std::copy_n(q.row(b, h, qi[t]), d, gq.data() + t * d);
          for (int64_t t = 0; t < wk; ++t) {
            std::copy_n(k.row(b, h, kj[t]), d, gk.data() + t * d);
            std::copy_n(v.row(b, h, kj[t]), d, gv.data() + t * d);
          }
          for (int64_t r0 = 0; r0 < wq; r0 += kTile) {
            const int64_t rows = std::min(kTile, wq - r0);
            // again with scaled weights if the accumulator overflowed (v near FLT_MAX)
            for (float pscale = 1.0f;; pscale = kernels::safe_pscale(wk)) {
              ta.begin(gq.data() + r0 * d, d, rows, pscale);
              // keys are in position order: under a causal mask, blocks every row sees need no
              // mask and blocks no row sees are skipped
              const int64_t first_vis = p.visible(qi[r0]), last_vis = p.visible(qi[r0 + rows - 1]);
              for (int64_t j0 = 0; j0 < wk; j0 += kTile) {
                const int64_t cols = std::min(kTile, wk - j0);
                if (kj[j0] >= last_vis) break;
                const uint8_t* mask = nullptr;
                if (kj[j0 + cols - 1] >= first_vis) {
                  uint8_t* mk = ta.mask();
                  for (int64_t rr = 0; rr < rows; ++rr) {
                    const int64_t vis = p.visible(qi[r0 + rr]);
                    for (int64_t cc = 0; cc < cols; ++cc)
                      mk[rr * cols + cc] = uint8_t(kj[j0 + cc] < vis);
                  }
                  mask = mk;
                }
                ta.attend(gk.data() + j0 * d, d, gv.data() + j0 * d, d, cols, mask);
              }
              if (ta.finish(ho.out.data() + (u * wq + r0) * d, d, lse.data()) || pscale != 1.0f)
                break;
            }
            for (int64_t rr = 0; rr < rows; ++rr)
              ho.valid[size_t(u * wq + r0 + rr)] = uint8_t(lse[size_t(rr)] > -INFINITY);
          }
        });
    }
    guard.rethrow();
  }

  /// out row i = the mean of the outputs of the clusters that selected query i and in which
  /// it saw a key (0 if none). Returns the number of such unrouted rows that see some key.
  int64_t combine(const Problem& p, const Sizes& pl, const Routes& r, TensorView out, int64_t b,
                  int64_t h, HeadOutputs& ho) const {
    const int64_t n = p.n, d = p.dim, slots = pl.c * pl.wq;
    std::fill(ho.start.begin(), ho.start.end(), 0);
    for (int32_t i : r.queries) ++ho.start[size_t(i) + 1];
    for (int64_t i = 0; i < n; ++i) ho.start[size_t(i + 1)] += ho.start[size_t(i)];
    // start[i] serves as row i's cursor, which leaves start[i] = end of row i; then shift back
    for (int64_t s = 0; s < slots; ++s)
      ho.slots[size_t(ho.start[size_t(r.queries[size_t(s)])]++)] = int32_t(s);
    for (int64_t i = n; i > 0; --i) ho.start[size_t(i)] = ho.start[size_t(i - 1)];
    ho.start[0] = 0;
    int64_t unrouted = 0;
#pragma omp parallel for schedule(static) reduction(+ : unrouted)
    for (int64_t i = 0; i < n; ++i) {
      float* o = out.row(b, h, i);
      std::fill_n(o, d, 0.0f);
      int64_t used = 0;
      for (int64_t t = ho.start[size_t(i)]; t < ho.start[size_t(i + 1)]; ++t) {
        const int32_t s = ho.slots[size_t(t)];
        if (!ho.valid[size_t(s)]) continue;
        const float* src = ho.out.data() + int64_t(s) * d;
        for (int64_t x = 0; x < d; ++x) o[x] += src[x];
        ++used;
      }
      if (used > 1) {
        const float inv = 1.0f / float(used);
        for (int64_t x = 0; x < d; ++x) o[x] *= inv;
      }
      if (used == 0 && p.visible(b, i) > 0) ++unrouted;
    }
    return unrouted;
  }

  int64_t clusters_, window_, iterations_, sample_;
  int64_t unrouted_ = 0, rows_ = 0;  // of the last forward
};

ATTNBENCH_REGISTER_VARIANT(
    routing,
    VariantInfo{
        .name = "routing",
        .summary = "k-means routing: each cluster's top-w queries attend its top-w keys "
                   "(Routing Transformer)",
        .complexity = "time O((n + m) c d + c w^2 d) = O(n^1.5 d), memory O((n + m) d + c w d)",
        .family = "clustering",
        .display = "Routing Transformer",
        .paper = "Roy et al. 2020 (arXiv:2003.05997)",
        .look = {.color = "#e7ba52", .marker = "h"},
        .params = {ParamSpec::Int("clusters", 0, 0, int64_t(1) << 20,
                                  "clusters c (0: ceil(n / window))"),
                   ParamSpec::Int("window", 0, 0, int64_t(1) << 24,
                                  "queries each cluster takes, w (0: ceil(4 sqrt(n)), or "
                                  "ceil(n / clusters) if clusters is given)"),
                   ParamSpec::Int("iterations", 2, 0, 100, "Lloyd (k-means) steps"),
                   ParamSpec::Int("sample", 4096, 0, int64_t(1) << 30,
                                  "tokens the Lloyd steps run on (0: all n + m)")},
        .caps = {.causal = true, .cross = true, .exact = false, .key_padding = true},
        .make =
            [](const ParamValues& pv) {
              return std::make_unique<RoutingVariant>(pv.get_int("clusters"), pv.get_int("window"),
                                                      pv.get_int("iterations"),
                                                      pv.get_int("sample"));
            },
        .oracle =
            [](const Variant& var, const Problem& p, ConstTensorView q, ConstTensorView k,
               ConstTensorView v) {
              return routing::oracle(p, sizes_of(var, p), var.params().get_int("iterations"), q, k,
                                     v);
            },
        // Softmax attention inside each cluster, over w_k <= m keys (the default model), then a
        // row's mean over the clusters that selected it: a float32 sum of at most c rows and a
        // scaling, float32_error(0, 0, c, 1) more.
        .tolerance =
            [](const Variant& var, const Problem& p, const Workload& wl) {
              return attention_tolerance(p, wl) +
                     kErrorMargin * float32_error(0, 0, double(sizes_of(var, p).c), 1);
            }});

}  // namespace
}  // namespace attnbench
