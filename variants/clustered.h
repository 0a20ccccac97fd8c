// The query clustering of the clustered variant (variants/clustered.cpp) and its float64
// oracle, exposed so that tests can check the clustering itself and rebuild the attention from
// the variant's own assignment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/core/problem.h"
#include "common/core/tensor.h"

namespace attnbench::clustered {

/// How the queries of one head are clustered.
struct Settings {
  int64_t clusters = 100;   ///< c = min(clusters, n)
  int64_t iterations = 10;  ///< Lloyd rounds (assign, update) before the final assignment
  int bits = 32;            ///< 1..64: k-means on LSH codes in Hamming space; 0: Euclidean
};

/// RandomStream ids of head h's hash planes and initial centroids. They depend on the head index
/// only: every batch item of a head uses the same planes and the same initial rows.
uint64_t plane_stream(int64_t head);
uint64_t init_stream(int64_t head);

/// The `bits` hash hyperplanes of head `head`: w is d x bits (w[c * bits + b] is component c of
/// plane b) and offset has bits entries, all N(0, 1). Query x gets bit b = (x . w_b + offset_b >
/// 0).
void hash_planes(uint64_t seed, int64_t head, int64_t d, int bits, float* w, float* offset);

/// c distinct rows of [0, n) chosen from the seed (Floyd's sampling), ascending.
std::vector<int64_t> initial_rows(uint64_t seed, int64_t head, int64_t n, int64_t c);

/// The clustering of one head's queries.
struct Clusters {
  int bits = 0;
  int64_t c = 0;                  ///< number of clusters
  int64_t rounds = 0;             ///< Lloyd rounds run (fewer than asked once assignments settle)
  std::vector<int32_t> assign;    ///< n: cluster of each query (the final assignment)
  std::vector<uint32_t> codes32;  ///< bits <= 32: query codes (n) then centroid codes (c)
  std::vector<uint64_t> codes64;  ///< bits > 32: the same
  std::vector<float> centres;     ///< bits = 0: c x d centroids

  /// Hash code of query i (bits > 0).
  uint64_t code(int64_t i) const { return bits <= 32 ? codes32[size_t(i)] : codes64[size_t(i)]; }
  /// Code of centroid k as used by the final assignment (bits > 0).
  uint64_t centre_code(int64_t k) const { return code(int64_t(assign.size()) + k); }
};

/// Clusters the n x d queries q (rows ld apart) of head `head` exactly as forward() does:
///   init    c = min(clusters, n) centroids = the queries (or their codes) at initial_rows();
///   rounds  `iterations` times: assign every query to its nearest centroid (Hamming distance of
///           codes, or squared Euclidean distance; ties to the lower cluster index), then move
///           each non-empty cluster's centroid to the bit-wise majority of its members' codes
///           (a tied bit becomes 0), or to their mean; an empty cluster keeps its centroid;
///   final   one more assignment against the last centroids.
/// Rounds stop early once an assignment repeats the previous one: every later round would
/// reproduce it exactly, so the result is the same. With `parallel`, row blocks of the
/// assignments are spread over OpenMP threads (the result does not depend on their number).
void cluster_queries(const float* q, int64_t ld, int64_t n, int64_t d, const Settings& s,
                     uint64_t seed, int64_t head, bool parallel, Clusters& out);

/// The non-empty clusters of an assignment, in cluster index order, with their members
/// (ascending) and the mean of their members' query vectors (accumulated in double).
struct Groups {
  std::vector<int32_t> cluster;  ///< g -> cluster index
  std::vector<int64_t> start;    ///< members of group g: members[start[g] .. start[g + 1])
  std::vector<int32_t> members;  ///< n query rows, grouped
  std::vector<float> means;      ///< groups x d centroid query vectors Q_g

  int64_t size() const { return int64_t(cluster.size()); }
};
void group_queries(const float* q, int64_t ld, int64_t n, int64_t d, const int32_t* assign,
                   int64_t c, Groups& out);

/// The improved variant's top keys T_g of every group g of gr: the kk keys with the largest
/// float32 scores Q_g . k_j (the GEMM forward() computes, ties to the lower index), ascending,
/// at [g kk, (g + 1) kk). k: m rows of d values, ldk apart.
std::vector<int32_t> group_top_keys(const Groups& gr, const float* k, int64_t ldk, int64_t m,
                                    int64_t d, int64_t kk);

/// The variant's function in double (the formulas of variants/clustered.cpp), on the clusters
/// cluster_queries() gives and the top keys group_top_keys() picks: both are discrete choices
/// made from float32 arithmetic (hash codes, distances, centroid scores) where a double
/// recomputation could flip a near tie, so the oracle takes them as the variant makes them and
/// computes everything else (centroid means, both softmaxes, the centroid's mass on its top
/// keys, the outputs) in double. Returns [B, H, n, d].
std::vector<double> oracle(const Problem& p, const Settings& s, int64_t topk, ConstTensorView q,
                           ConstTensorView k, ConstTensorView v);

/// The discrete choices of one head: the final assignment of its queries to c clusters and
/// the top keys of its groups ([g kk, (g + 1) kk), kk = min(topk, valid keys)).
struct Choices {
  std::vector<int32_t> assign;
  int64_t c = 0;
  std::vector<int32_t> top;
};
/// The choices forward() makes on every head, [b H + h].
std::vector<Choices> choices(const Problem& p, const Settings& s, int64_t topk, ConstTensorView q,
                             ConstTensorView k);
/// oracle() on given choices: the function the backward pass differentiates (the centroid
/// means follow q; the memberships and top keys are constants).
std::vector<double> oracle_on_choices(const Problem& p, int64_t topk,
                                      const std::vector<Choices>& choices, ConstTensorView q,
                                      ConstTensorView k, ConstTensorView v);

}  // namespace attnbench::clustered
