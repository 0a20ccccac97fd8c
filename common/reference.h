// The exact reference: softmax(QK^T / sqrt(d) + mask) V in double precision, written plainly
// so it can be trusted. Every variant is checked against it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/problem.h"
#include "common/tensor.h"

namespace attnbench {

/// Exact output rows of head (b, h) for the given query rows: out is rows.size() x d.
/// A row with no visible key is all zeros. O(rows * m * d).
void reference_rows(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    int64_t b, int64_t h, std::span<const int64_t> rows, double* out);

/// Exact output [B, H, n, d] in double. O(B H n m d).
std::vector<double> reference_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                                        ConstTensorView v);

/// Exact softmax probabilities of one query row over its visible keys (length m, zeros for
/// hidden keys).
std::vector<double> reference_probabilities(const Problem& p, ConstTensorView q,
                                            ConstTensorView k, int64_t b, int64_t h, int64_t i);

}  // namespace attnbench
