// The row blocks of the clustered variant's query clustering (variants/clustered_kmeans.cpp),
// shared with the variant's memory estimate (variants/clustered.cpp).
#pragma once

#include <cstdint>

namespace attnbench::clustered {

constexpr int64_t kBlockRows = 1024;   // query rows per hashing / Hamming assignment block
constexpr int64_t kBlockEuclid = 256;  // query rows per Euclidean assignment GEMM

}  // namespace attnbench::clustered
