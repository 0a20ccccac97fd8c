// The routing step of the routing variant (variants/routing.cpp) and its float64 oracle,
// exposed so that tests can check the selection and the formula on the same routes.
#pragma once

#include <cstdint>
#include <vector>

#include "common/problem.h"
#include "common/tensor.h"

namespace attnbench::routing {

/// Cluster count, queries and keys per cluster, and Lloyd sample size for a problem.
struct Sizes {
  int64_t c = 1, wq = 1, wk = 1, sample = 0;
};

/// The sizes the variant uses for `clusters`, `window` and `sample` (0 = automatic; see
/// variants/routing.cpp).
Sizes sizes(const Problem& p, int64_t clusters, int64_t window, int64_t sample);

/// The routes of one head.
struct Routes {
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

/// Routes head (b, h): `iterations` Lloyd steps on the seeded sample, then per cluster the
/// top-wq queries and top-wk keys by cosine with its centroid (ties: lower position).
Routes route(const Problem& p, const Sizes& sizes, int64_t iterations, ConstTensorView q,
             ConstTensorView k, int64_t b, int64_t h, Workspace& ws);
Routes route(const Problem& p, const Sizes& sizes, int64_t iterations, ConstTensorView q,
             ConstTensorView k, int64_t b, int64_t h);

/// The variant's function in double, on the routes route() chooses for each head (the routes
/// are the variant's discrete choice, computed in float32: recomputing them in double could
/// flip a near-tied selection, so the oracle takes them as the variant makes them). Every
/// selected query of cluster u attends the keys u selected with an exact softmax (scale
/// 1/sqrt(d), causal rule by position); a query gets the mean over the clusters that selected
/// it and in which it saw a key, and 0 if there is none. Returns [B, H, n, d]; `unrouted`, if
/// given, receives the number of such rows that see some key (the count notes() reports).
std::vector<double> oracle(const Problem& p, const Sizes& sizes, int64_t iterations,
                           ConstTensorView q, ConstTensorView k, ConstTensorView v,
                           int64_t* unrouted = nullptr);

}  // namespace attnbench::routing
