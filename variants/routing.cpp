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
// Defaults: window w = ceil(2 sqrt(n)), c = ceil(n / w) clusters (about sqrt(n) / 2: both grow
// as sqrt(n), so time grows as n^1.5); w_q = min(n, w), w_k = min(m, ceil(w m / n)).
// Giving only `clusters` sets w = ceil(n / c); giving only `window` sets c = ceil(n / w).
// Causal: the mask is applied inside each cluster by position (bottom-right rule); cluster
// selection itself looks at the whole sequence, as balanced top-w routing does. m != n is
// supported. One cluster with w >= n is full attention.
// Time O(iterations sample c d + (n + m) c d + c w_q w_k d) = O(n^1.5 d) with the defaults;
// memory O(c (n + m) + c w_q d) for one head at a time.
#include "variants/routing.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "common/error.h"
#include "common/random.h"
#include "common/registry.h"
#include "common/row_pattern.h"
#include "common/tensor.h"
#include "common/tile_attention.h"

namespace attnbench {
namespace routing {
namespace {

constexpr uint64_t kRoutingStream = 0x726f7574696e67ULL;  // "routing"

/// Indices of the `count` largest scores (ties: lower index first), ascending by index.
void top_indices(const float* score, int64_t len, int64_t count, std::vector<int32_t>& idx,
                 std::vector<int32_t>& out) {
  idx.resize(size_t(len));
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [score](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  };
  if (count < len) std::nth_element(idx.begin(), idx.begin() + count, idx.end(), better);
  out.assign(idx.begin(), idx.begin() + count);
  std::sort(out.begin(), out.end());
}

}  // namespace

Sizes sizes(const Problem& p, int64_t clusters, int64_t window, int64_t sample) {
  const int64_t n = p.n, m = p.keys();
  int64_t c = clusters, w = window;
  if (c == 0 && w == 0) w = int64_t(std::ceil(2.0 * std::sqrt(double(n))));
  if (c == 0) c = (n + w - 1) / w;
  if (w == 0) w = (n + c - 1) / c;
  Sizes pl;
  pl.c = std::max<int64_t>(1, c);
  pl.wq = std::min(n, w);
  pl.wk = std::max<int64_t>(1, std::min(m, (w * m + n - 1) / n));
  pl.sample = sample == 0 ? n + m : std::min(sample, n + m);
  pl.sample = std::max(pl.sample, std::min(pl.c, n + m));
  return pl;
}

Routes route(const Problem& p, const Sizes& pl, int64_t iterations, ConstTensorView q,
           ConstTensorView k, int64_t b, int64_t h) {
  const int64_t n = p.n, m = p.keys(), d = p.dim, c = pl.c, total = n + m;
  auto point = [&](int64_t t) { return t < n ? q.row(b, h, t) : k.row(b, h, t - n); };
  auto unit = [&](int64_t t, float* dst) {
    const float* x = point(t);
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += double(x[j]) * double(x[j]);
    const float inv = ss > 0 ? float(1.0 / std::sqrt(ss)) : 0.0f;
    for (int64_t j = 0; j < d; ++j) dst[j] = x[j] * inv;
  };
  // the sample: a seeded partial shuffle of the n + m tokens (per head)
  const RandomStream rs(p.seed, kRoutingStream ^ (uint64_t(h) << 8));
  std::vector<int64_t> order(static_cast<size_t>(total));
  std::iota(order.begin(), order.end(), 0);
  const int64_t s_count = pl.sample;
  for (int64_t t = 0; t < s_count; ++t)
    std::swap(order[size_t(t)], order[size_t(t + int64_t(rs.below(uint64_t(t), uint64_t(total - t))))]);
  std::vector<float> xs(static_cast<size_t>(s_count * d));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < s_count; ++t) unit(order[size_t(t)], xs.data() + t * d);

  Routes r;
  const int64_t cc = std::min(c, s_count);
  r.centroids.assign(size_t(c * d), 0.0f);
  for (int64_t u = 0; u < cc; ++u)  // the first c sample points are distinct tokens
    std::copy_n(xs.data() + u * d, d, r.centroids.data() + u * d);
  std::vector<float> sc(static_cast<size_t>(s_count * c));
  std::vector<int32_t> assign(static_cast<size_t>(s_count));
  std::vector<double> sums(static_cast<size_t>(c * d));
  std::vector<int64_t> counts(static_cast<size_t>(c));
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
  // scores of every query and key against every centroid (c x n and c x m), divided by
  // the token's norm afterwards
  std::vector<float> sq(static_cast<size_t>(c * n)), sk(static_cast<size_t>(c * m));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(n), int(d), 1.0f,
              r.centroids.data(), int(d), q.row(b, h, 0), int(q.stride_row), 0.0f, sq.data(),
              int(n));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(m), int(d), 1.0f,
              r.centroids.data(), int(d), k.row(b, h, 0), int(k.stride_row), 0.0f, sk.data(),
              int(m));
  std::vector<float> inv_q(static_cast<size_t>(n)), inv_k(static_cast<size_t>(m));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < total; ++t) {
    const float* x = point(t);
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += double(x[j]) * double(x[j]);
    (t < n ? inv_q[size_t(t)] : inv_k[size_t(t - n)]) = ss > 0 ? float(1.0 / std::sqrt(ss)) : 0.0f;
  }
  r.queries.resize(size_t(c * pl.wq));
  r.keys.resize(size_t(c * pl.wk));
#pragma omp parallel
  {
    std::vector<int32_t> idx, top;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < 2 * c; ++u) {
      const bool is_q = u < c;
      const int64_t cl = is_q ? u : u - c, len = is_q ? n : m, w = is_q ? pl.wq : pl.wk;
      float* s = (is_q ? sq.data() : sk.data()) + cl * len;
      const float* inv = is_q ? inv_q.data() : inv_k.data();
      for (int64_t t = 0; t < len; ++t) s[t] *= inv[t];
      top_indices(s, len, w, idx, top);
      std::copy(top.begin(), top.end(), (is_q ? r.queries.data() : r.keys.data()) + cl * w);
    }
  }
  return r;
}

}  // namespace routing

namespace {

using routing::Routes;
using routing::Sizes;
constexpr int64_t kTile = 64;  // query tile and key block

class RoutingVariant final : public Variant {
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
    const Sizes pl = routing::sizes(p, clusters_, window_, sample_);
    const int64_t heads = p.batch * p.heads;
    int64_t unrouted = 0;
    // time spent routing (Lloyd steps, centroid scores, top-w selection) and in all, summed
    // over the threads that run heads
    double t_route = 0, t_all = 0;
#pragma omp parallel if (by_head(p, omp_get_max_threads())) reduction(+ : unrouted, t_route, t_all)
    {
      HeadOutputs ho(p, pl);
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < heads; ++bh) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        const double t0 = omp_get_wtime();
        const Routes r = routing::route(p, pl, iterations_, q, k, b, h);
        t_route += omp_get_wtime() - t0;
        attend(p, pl, r, q, k, v, b, h, ho);
        unrouted += combine(p, pl, r, out, b, h, ho);
        t_all += omp_get_wtime() - t0;
      }
    }
    unrouted_ = unrouted;
    route_share_ = t_all > 0 ? t_route / t_all : 0.0;
    rows_ = heads * p.n;
  }

  std::string notes() const override {
    if (rows_ == 0) return "";
    return fmt::format("{} of {} query rows ({:.2f}%) routed to no cluster holding a key they "
                       "may see: their output is 0; routing took {:.0f}% of the forward time",
                       unrouted_, rows_, 100.0 * double(unrouted_) / double(rows_),
                       100.0 * route_share_);
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
    const int threads = p.threads > 0 ? p.threads : omp_get_max_threads();
    const double n = double(p.n), m = double(p.keys()), d = double(p.dim), c = double(pl.c);
    const double s = double(pl.sample);
    const double head = 4.0 * (s * d + s * c + s + c * (n + m) + (n + m) + c * d) +
                        8.0 * ((n + m) + c * d + c) + 4.0 * c * double(pl.wq + pl.wk);
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
        for (int64_t u = 0; u < pl.c; ++u) {
          const int32_t g = pat->add_group(r.keys.data() + u * pl.wk, pl.wk);
          for (int64_t t = 0; t < pl.wq; ++t) pat->add_membership(r.queries[size_t(u * pl.wq + t)], g);
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

  /// Every cluster: its queries attend its keys (exact softmax, causal mask by position).
  void attend(const Problem& p, const Sizes& pl, const Routes& r, ConstTensorView q,
              ConstTensorView k, ConstTensorView v, int64_t b, int64_t h,
              HeadOutputs& ho) const {
    const int64_t d = p.dim, c = pl.c, wq = pl.wq, wk = pl.wk;
#pragma omp parallel
    {
      TileAttention ta(std::min(kTile, wq), std::min(kTile, wk), d, p.softmax_scale());
      std::vector<float> gq(static_cast<size_t>(wq * d)), gk(static_cast<size_t>(wk * d)),
          gv(static_cast<size_t>(wk * d)), lse(static_cast<size_t>(kTile));
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < c; ++u) {
        const int32_t* qi = r.queries.data() + u * wq;
        const int32_t* kj = r.keys.data() + u * wk;
        for (int64_t t = 0; t < wq; ++t) std::copy_n(q.row(b, h, qi[t]), d, gq.data() + t * d);
        for (int64_t t = 0; t < wk; ++t) {
          std::copy_n(k.row(b, h, kj[t]), d, gk.data() + t * d);
          std::copy_n(v.row(b, h, kj[t]), d, gv.data() + t * d);
        }
        for (int64_t r0 = 0; r0 < wq; r0 += kTile) {
          const int64_t rows = std::min(kTile, wq - r0);
          ta.begin(gq.data() + r0 * d, d, rows);
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
          ta.finish(ho.out.data() + (u * wq + r0) * d, d, lse.data());
          for (int64_t rr = 0; rr < rows; ++rr)
            ho.valid[size_t(u * wq + r0 + rr)] = uint8_t(lse[size_t(rr)] > -INFINITY);
        }
      }
    }
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
    for (int64_t s = 0; s < slots; ++s) ho.slots[size_t(ho.start[size_t(r.queries[size_t(s)])]++)] = int32_t(s);
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
      if (used == 0 && p.visible(i) > 0) ++unrouted;
    }
    return unrouted;
  }

  int64_t clusters_, window_, iterations_, sample_;
  int64_t unrouted_ = 0, rows_ = 0;  // of the last forward
  double route_share_ = 0;
};

ATTNBENCH_REGISTER_VARIANT(
    routing,
    VariantInfo{
        .name = "routing",
        .summary = "k-means routing: each cluster's top-w queries attend its top-w keys "
                   "(Routing Transformer)",
        .complexity = "time O((n + m) c d + c w^2 d) = O(n^1.5 d), memory O(c (n + m) + n d)",
        .params = {ParamSpec::Int("clusters", 0, 0, int64_t(1) << 20,
                                  "clusters c (0: ceil(n / window))"),
                   ParamSpec::Int("window", 0, 0, int64_t(1) << 24,
                                  "queries each cluster takes, w (0: ceil(2 sqrt(n)), or "
                                  "ceil(n / clusters) if clusters is given)"),
                   ParamSpec::Int("iterations", 2, 0, 100, "Lloyd (k-means) steps"),
                   ParamSpec::Int("sample", 4096, 0, int64_t(1) << 30,
                                  "tokens the Lloyd steps run on (0: all n + m)")},
        .caps = {.causal = true, .cross = true, .exact = false},
        .make = [](const ParamValues& pv) {
          return std::make_unique<RoutingVariant>(pv.get_int("clusters"), pv.get_int("window"),
                                                  pv.get_int("iterations"), pv.get_int("sample"));
        }});

}  // namespace
}  // namespace attnbench
