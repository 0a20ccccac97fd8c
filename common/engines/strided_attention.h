// Dilated attention as a reshape: exact attention of each query i over the keys j with
// (a(i) - j) mod stride == 0 (and |a(i) - j| <= limit when limit >= 0), a(i) = i + (m - n).
//
// The pattern splits into residue classes: the queries whose aligned position a(i) is r mod
// stride attend exactly the keys j = r mod stride. Class r's queries and keys, read through
// views whose row stride is `stride` rows (nothing is copied), form a problem of its own with
// about n / stride queries and m / stride keys on which the pattern is dense: every key, or
// under the causal mask the keys up to the query's own position (the class's last query and
// last key share the aligned position, so the bottom-right aligned causal mask of the class
// problem is the original one), or with a limit a band of limit / stride keys on each side.
// Each class runs on the engine at the dense rate (common/engines/block_sparse.h: the dense case,
// or the block-sparse case for a band); key padding becomes each class's count of valid keys and
// the attention mask the class's rows and columns of it (gathered per call). Work
// O(B H n (m / stride) d) with no wasted tile, against the engine's O(B H n m d) for a stride
// under twice its block. The output (and the log-sum-exps, when asked) equals the block-sparse
// engine's on StridedPattern (common/patterns/strided_pattern.h).
//
// Classes run in parallel when there are enough of them for the team (each class's engine
// call on one thread); otherwise one after another, each on the whole team.
#pragma once

#include <cstdint>

#include "common/engines/block_sparse.h"

namespace attnbench {

/// out = the dilated attention above (rows that attend no key are 0); with `lse`, every row's
/// log-sum-exp. block: the engine's tile size. Throws UsageError for stride < 1.
void strided_attention(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       TensorView out, int64_t stride, int64_t limit, int64_t block,
                       const LseView* lse = nullptr);

/// The backward of strided_attention: dq [B, H, n, d], dk and dv [B, H, m, d] (overwritten) of
/// L = sum(dout o out) from its out and rows' log-sum-exps lse, class by class with the
/// engine's backward (dense_attention_backward, or block_sparse_attention_backward on a band)
/// on the same strided views; keys of classes without queries get 0. Scores scaled_dot, dot
/// and bilinear (the caller maps q), as the engine's backward.
void strided_attention_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                                ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                                const LseView& lse, TensorView dq, TensorView dk, TensorView dv,
                                int64_t stride, int64_t limit, int64_t block);

/// Bytes strided_attention_backward allocates beyond inputs, out, lse and gradients.
double strided_attention_backward_memory(const Problem& p, int64_t stride, int64_t limit,
                                         int64_t block);

/// Scores strided_attention computes, over every batch element and head.
double strided_attention_scores(const Problem& p, int64_t stride, int64_t limit, int64_t block);

/// Bytes strided_attention allocates beyond inputs and output (the engine's tiles, and with
/// an attention mask the classes' gathered masks).
double strided_attention_memory(const Problem& p, int64_t stride, int64_t block);

}  // namespace attnbench
