// The pseudo-inverse of nystrom (variants/nystrom.cpp): the iteration of Xiong et al. 2021
// in float or double, its reverse-mode derivative, and the landmark means. Internal to the
// variant.
#pragma once

#include <cstdint>

namespace attnbench::nystrom {

/// W = Z B with Z L x L and B L x d, row-major.
void gemm_rect(int64_t L, int64_t d, const double* z, const double* b, double* w);
void gemm_rect(int64_t L, int64_t d, const float* z, const float* b, float* w);

/// Z = pinv(A) by `iters` iterations of the Nyströmformer iteration. work holds 3 L^2 values.
/// With `iterates`, Z_0 .. Z_{iters - 1} (the input of every iteration) are kept there, L^2
/// values each (for the backward).
/// Instantiated for float and double.
template <class T>
void iterative_pinv(int64_t L, const T* a, int64_t iters, T* z, T* work, T* iterates = nullptr);

/// The gradient dA of pinv(A) by iterative_pinv from dZ (the gradient of its result), given A
/// and the iterates Z_0 .. Z_{iters - 1}; dz is overwritten. Reverse mode through each step
/// Z' = Z T5 / 4, T5 = 13I - X T3, T3 = 15I - X T1, T1 = 7I - X, X = A Z, then through
/// Z_0 = A^T / (R C), R and C the largest row and column sums of |A| (A >= 0 here): the
/// argmax row and column take the gradient of R and C. work holds 6 L^2 values.
void iterative_pinv_backward(int64_t L, const double* a, int64_t iters, const double* iterates,
                             double* dz, double* da, double* work);

/// Mean of rows [floor(r len / L), floor((r + 1) len / L)) of a len x d matrix, for r < L.
void segment_means(const float* x, int64_t ld, int64_t len, int64_t d, int64_t L, float* out,
                   double* acc);

}  // namespace attnbench::nystrom
