// The hashing step of the reformer variant (variants/reformer.cpp), exposed so that tests can
// rebuild its buckets exactly instead of duplicating the recipe.
#pragma once

#include <cstdint>
#include <vector>

namespace attnbench::reformer {

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

}  // namespace attnbench::reformer
