// The hashing step of the reformer variant (variants/reformer.cpp) and its float64 oracle,
// exposed so that tests can rebuild its buckets exactly instead of duplicating the recipe.
#pragma once

#include <cstdint>
#include <vector>

#include "common/core/problem.h"
#include "common/core/tensor.h"

namespace attnbench::reformer {

constexpr int64_t kHashRows = 256;  // rows projected per GEMM when hashing

/// Bucket counts used for n tokens and chunk length `chunk` when none are given (the HF rule):
/// the largest power of two <= 2 floor(n / chunk) (at least 2), split into two factors
/// 2^floor(p/2) x 2^ceil(p/2) once it exceeds 2 max(floor(sqrt(n / chunk)), chunk).
std::vector<int64_t> auto_buckets(int64_t n, int64_t chunk);

/// Rotations of head h, round r: a d x C matrix (row-major), C = sum of factors / 2, the
/// factors' blocks side by side; entries N(0, 1) from the seed, independent of n and of the
/// head count.
std::vector<float> rotations(uint64_t seed, int64_t head, int64_t round, int64_t d,
                             const std::vector<int64_t>& factors);

/// Bucket of one row from its projections x R (C values): per factor f, the argmax over
/// [xR_f, -xR_f] (first maximum wins, the positive half first), combined as
/// sum_f idx_f prod_{g < f} factor_g.
int64_t bucket_of(const float* proj, const std::vector<int64_t>& factors);

/// The hashing plan of one problem.
struct Plan {
  std::vector<int64_t> factors;  ///< bucket factors of a round
  int64_t buckets = 1;           ///< product of the factors
  int64_t cols = 0;              ///< rotation columns per round (sum of factors / 2)
  int64_t chunk = 0;             ///< chunk length, min(chunk, n)
  int64_t hashes = 0;            ///< rounds
  int64_t chunks = 0;            ///< ceil(n / chunk)
};

/// The plan for n tokens (n >= 1) and the variant's parameters (`buckets` empty:
/// auto_buckets(n, chunk)).
Plan plan(int64_t n, const std::vector<int64_t>& buckets, int64_t hashes, int64_t chunk);

/// The plan of problem p without key padding: plan(p.n, ...).
Plan plan(const Problem& p, const std::vector<int64_t>& buckets, int64_t hashes, int64_t chunk);

/// Number of valid tokens of batch element b: p.n, or its key length under key padding.
inline int64_t valid_tokens(const Problem& p, int64_t b) {
  return p.key_lengths.empty() ? p.n : p.key_lengths[size_t(b)];
}

/// Buckets of the n rows of q (d values each, rows ld apart) of head `head` in every round:
/// bucket[r n + i] = bucket_of(q_i R_r) with R_r = rotations(seed, head, r, ...). The
/// projections of all rounds come from one float32 GEMM per block of rows, spread over the
/// OpenMP threads when called outside a parallel region (the result does not depend on their
/// number).
void hash_rows(const Plan& pl, uint64_t seed, int64_t head, const float* q, int64_t ld, int64_t n,
               int64_t d, int32_t* bucket);

/// The buckets of every head and round as the variant makes them: hash_rows() of head (b, h)
/// with plan(L, buckets, hashes, chunk) for the L valid tokens of batch element b, at
/// [((b H + h) hashes + r) n + i] (all zero for an element with L = 0, which hashes nothing).
std::vector<int32_t> hash_all(const Problem& p, const std::vector<int64_t>& buckets, int64_t hashes,
                              int64_t chunk, ConstTensorView q);

/// The variant's function in double, on the buckets hash_rows() gives (the buckets are the
/// variant's discrete choice, an argmax of float32 projections: recomputed in double a
/// near-tied argmax could flip, so the oracle takes them as the variant makes them):
/// oracle_on_buckets() on hash_all(). Per batch
/// element b with L valid tokens (L = n without key padding), plan(L, buckets, hashes, chunk),
/// per head and round: the valid tokens stably sorted by bucket, chunks of `chunk` sorted
/// tokens attending themselves and the previous chunk with logits q_i . q_j / |q_j| (a zero
/// q_j gives 0), a token never attending itself unless nothing else is visible to it (then its
/// own value at logit -1e5), causal keys at later positions hidden; a padded token (i >= L) is
/// a query only: it attends the chunk of the last valid token whose bucket is at most its own
/// (chunk 0 if none) and that chunk's previous chunk; the rounds combined with weights
/// softmax_r(lse_r); L = 0 gives zero rows. Returns [B, H, n, d]. `attended`, if given,
/// receives for every row ((b H + h) n + i) the keys it attends in some round, ascending
/// (itself alone if none; empty if L = 0).
std::vector<double> oracle(const Problem& p, const std::vector<int64_t>& buckets, int64_t hashes,
                           int64_t chunk, ConstTensorView q, ConstTensorView v,
                           std::vector<std::vector<int64_t>>* attended = nullptr);

/// The same function on given buckets, laid out as hash_all() gives them (UsageError if their
/// count is not B H hashes n): the function the backward pass differentiates, the buckets
/// (hence every round's order, chunks and visible keys) being constants of it.
std::vector<double> oracle_on_buckets(const Problem& p, const std::vector<int64_t>& buckets,
                                      int64_t hashes, int64_t chunk,
                                      const std::vector<int32_t>& bucket, ConstTensorView q,
                                      ConstTensorView v,
                                      std::vector<std::vector<int64_t>>* attended = nullptr);

}  // namespace attnbench::reformer
