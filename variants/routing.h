// The routing step of the routing variant (variants/routing.cpp) and its float64 oracle,
// exposed so that tests can check the selection and the formula on the same routes.
#pragma once

#include <cstdint>
#include <vector>

#include "common/core/problem.h"
#include "common/core/tensor.h"

namespace attnbench::routing {

/// Cluster count, queries and keys per cluster, and Lloyd sample size for a problem; window
/// and sample_limit are the resolved window w and the `sample` parameter the last two follow
/// from.
struct Sizes {
  int64_t c = 1, wq = 1, wk = 1, sample = 0;
  int64_t window = 1, sample_limit = 0;
};

/// The sizes the variant uses for `clusters`, `window` and `sample` (0 = automatic; see
/// variants/routing.cpp), for all m keys.
Sizes sizes(const Problem& p, int64_t clusters, int64_t window, int64_t sample);

/// The sizes of batch element b: those of `all` with m its number of valid keys (the key
/// length under key padding; all m without it): wk and sample change, c and wq do not.
Sizes batch_sizes(const Problem& p, const Sizes& all, int64_t b);

/// The routes of one head (no cluster and no route when its batch element has no valid key).
struct Routes {
  int64_t wk = 0;                      ///< keys per cluster (batch_sizes().wk; 0 without keys)
  std::vector<float> centroids;        ///< c x d unit centroids
  std::vector<int32_t> queries, keys;  ///< cluster u: [u wq, (u + 1) wq) / [u wk, (u + 1) wk),
                                       ///< each ascending
};

/// Working buffers of route(), kept by a caller that routes head after head.
struct Workspace {
  std::vector<float> xs, sc, inv_q, inv_k;
  std::vector<int32_t> assign;
  std::vector<double> sums;
  std::vector<int64_t> counts, order;
};

/// Routes head (b, h) with the sizes batch_sizes(p, sizes, b): `iterations` Lloyd steps on the
/// seeded sample of the queries and valid keys, then per cluster the top-wq queries and
/// top-wk valid keys by cosine with its centroid (ties: lower position).
Routes route(const Problem& p, const Sizes& sizes, int64_t iterations, ConstTensorView q,
             ConstTensorView k, int64_t b, int64_t h, Workspace& ws);
Routes route(const Problem& p, const Sizes& sizes, int64_t iterations, ConstTensorView q,
             ConstTensorView k, int64_t b, int64_t h);

/// The variant's function in double, on the routes route() chooses for each head (the routes
/// are the variant's discrete choice, computed in float32: recomputing them in double could
/// flip a near-tied selection, so the oracle takes them as the variant makes them). Every
/// selected query of cluster u attends the keys u selected with an exact softmax (scale
/// 1/sqrt(d), causal rule by position); a query gets the mean over the clusters that selected
/// it and in which it saw a key, and 0 if there is none (as for every row of a batch element
/// whose keys are all padding). Returns [B, H, n, d]; `unrouted`, if
/// given, receives the number of such rows that see some key (the count notes() reports).
std::vector<double> oracle(const Problem& p, const Sizes& sizes, int64_t iterations,
                           ConstTensorView q, ConstTensorView k, ConstTensorView v,
                           int64_t* unrouted = nullptr);

/// The same function on given routes, routes[b H + h] for head (b, h): the function the
/// backward pass differentiates, the routes being constants of it.
std::vector<double> oracle_on_routes(const Problem& p, const Sizes& sizes,
                                     const std::vector<Routes>& routes, ConstTensorView q,
                                     ConstTensorView k, ConstTensorView v,
                                     int64_t* unrouted = nullptr);

}  // namespace attnbench::routing
