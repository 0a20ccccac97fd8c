// The pseudo-inverse of nystrom and its derivative (variants/nystrom_pinv.h).
#include "variants/nystrom_pinv.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace attnbench::nystrom {
namespace {

// C = alpha A B + beta C for L x L row-major matrices.
inline void gemm_square(int64_t L, const double* a, const double* b, double beta, double* c,
                        double alpha = 1.0) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(L), int(L), int(L), alpha, a, int(L),
              b, int(L), beta, c, int(L));
}
inline void gemm_square(int64_t L, const float* a, const float* b, float beta, float* c,
                        float alpha = 1.0f) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(L), int(L), int(L), alpha, a, int(L),
              b, int(L), beta, c, int(L));
}

// x <- c I - x for an L x L matrix.
template <class T>
void shifted_negation(int64_t L, T c, T* x) {
  for (int64_t i = 0; i < L * L; ++i) x[i] = -x[i];
  for (int64_t i = 0; i < L; ++i) x[i * L + i] += c;
}

}  // namespace

void gemm_rect(int64_t L, int64_t d, const double* z, const double* b, double* w) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(L), int(d), int(L), 1.0, z, int(L), b,
              int(d), 0.0, w, int(d));
}
void gemm_rect(int64_t L, int64_t d, const float* z, const float* b, float* w) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(L), int(d), int(L), 1.0f, z, int(L), b,
              int(d), 0.0f, w, int(d));
}

template <class T>
void iterative_pinv(int64_t L, const T* a, int64_t iters, T* z, T* work, T* iterates) {
  T max_row = 0, max_col = 0;
  for (int64_t i = 0; i < L; ++i) {
    T row = 0, col = 0;
    for (int64_t j = 0; j < L; ++j) row += std::abs(a[i * L + j]), col += std::abs(a[j * L + i]);
    max_row = std::max(max_row, row), max_col = std::max(max_col, col);
  }
  const T inv = T(1) / (max_row * max_col);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j) z[i * L + j] = a[j * L + i] * inv;
  T *az = work, *t1 = work + L * L, *t2 = work + 2 * L * L;
  for (int64_t it = 0; it < iters; ++it) {
    if (iterates) std::memcpy(iterates + it * L * L, z, size_t(L * L) * sizeof(T));
    gemm_square(L, a, z, T(0), az);  // AZ
    std::memcpy(t1, az, size_t(L * L) * sizeof(T));
    shifted_negation(L, T(7), t1);             // 7I - AZ
    gemm_square(L, az, t1, T(0), t2);          // AZ (7I - AZ)
    shifted_negation(L, T(15), t2);            // 15I - ...
    gemm_square(L, az, t2, T(0), t1);          // AZ (15I - ...)
    shifted_negation(L, T(13), t1);            // 13I - ...
    gemm_square(L, z, t1, T(0), t2, T(0.25));  // Z <- Z (13I - ...) / 4
    std::memcpy(z, t2, size_t(L * L) * sizeof(T));
  }
}

template void iterative_pinv<float>(int64_t, const float*, int64_t, float*, float*, float*);
template void iterative_pinv<double>(int64_t, const double*, int64_t, double*, double*, double*);

void iterative_pinv_backward(int64_t L, const double* a, int64_t iters, const double* iterates,
                             double* dz, double* da, double* work) {
  double *x = work, *t1 = x + L * L, *t3 = t1 + L * L, *t5 = t3 + L * L, *dx = t5 + L * L,
         *tmp = dx + L * L;
  auto mul = [L](CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, double alpha, const double* p,
                 const double* q, double beta, double* c) {
    cblas_dgemm(CblasRowMajor, ta, tb, int(L), int(L), int(L), alpha, p, int(L), q, int(L), beta, c,
                int(L));
  };
  std::fill(da, da + L * L, 0.0);
  for (int64_t it = iters - 1; it >= 0; --it) {
    const double* z = iterates + it * L * L;
    // the step's intermediates again
    gemm_square(L, a, z, 0.0, x);  // X = AZ
    std::memcpy(t1, x, size_t(L * L) * sizeof(double));
    shifted_negation(L, 7.0, t1);  // T1 = 7I - X
    gemm_square(L, x, t1, 0.0, t3);
    shifted_negation(L, 15.0, t3);  // T3 = 15I - X T1
    gemm_square(L, x, t3, 0.0, t5);
    shifted_negation(L, 13.0, t5);  // T5 = 13I - X T3
    // Z' = Z T5 / 4: dT5 = Z^T dZ' / 4 (in tmp), dZ = dZ' T5^T / 4 (through dx, free here)
    mul(CblasTrans, CblasNoTrans, 0.25, z, dz, 0.0, tmp);
    mul(CblasNoTrans, CblasTrans, 0.25, dz, t5, 0.0, dx);
    std::memcpy(dz, dx, size_t(L * L) * sizeof(double));
    // T5 = 13I - X T3: dX = -dT5 T3^T, dT3 = -X^T dT5
    mul(CblasNoTrans, CblasTrans, -1.0, tmp, t3, 0.0, dx);
    mul(CblasTrans, CblasNoTrans, -1.0, x, tmp, 0.0, t3);  // t3 <- dT3
    // T3 = 15I - X T1: dX -= dT3 T1^T, dT1 = -X^T dT3
    mul(CblasNoTrans, CblasTrans, -1.0, t3, t1, 1.0, dx);
    mul(CblasTrans, CblasNoTrans, -1.0, x, t3, 0.0, tmp);  // tmp <- dT1
    // T1 = 7I - X: dX -= dT1
    for (int64_t i = 0; i < L * L; ++i) dx[i] -= tmp[i];
    // X = A Z: dA += dX Z^T, dZ += A^T dX
    mul(CblasNoTrans, CblasTrans, 1.0, dx, z, 1.0, da);
    mul(CblasTrans, CblasNoTrans, 1.0, a, dx, 1.0, dz);
  }
  // Z_0 = A^T inv, inv = 1 / (R C)
  double rmax = -1, cmax = -1;
  int64_t ri = 0, ci = 0;
  for (int64_t i = 0; i < L; ++i) {
    double row = 0, col = 0;
    for (int64_t j = 0; j < L; ++j) row += std::abs(a[i * L + j]), col += std::abs(a[j * L + i]);
    if (row > rmax) rmax = row, ri = i;
    if (col > cmax) cmax = col, ci = i;
  }
  const double inv = 1.0 / (rmax * cmax);
  double dinv = 0;
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j) {
      da[i * L + j] += dz[j * L + i] * inv;
      dinv += dz[j * L + i] * a[i * L + j];
    }
  const double dr = -dinv * inv / rmax, dc = -dinv * inv / cmax;
  for (int64_t j = 0; j < L; ++j) {
    da[ri * L + j] += dr * (a[ri * L + j] < 0 ? -1.0 : 1.0);
    da[j * L + ci] += dc * (a[j * L + ci] < 0 ? -1.0 : 1.0);
  }
}

void segment_means(const float* x, int64_t ld, int64_t len, int64_t d, int64_t L, float* out,
                   double* acc) {
  for (int64_t r = 0; r < L; ++r) {
    const int64_t lo = r * len / L, hi = (r + 1) * len / L;
    std::fill(acc, acc + d, 0.0);
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t c = 0; c < d; ++c) acc[c] += double(x[i * ld + c]);
    const double inv = 1.0 / double(hi - lo);
    for (int64_t c = 0; c < d; ++c) out[r * d + c] = float(acc[c] * inv);
  }
}

}  // namespace attnbench::nystrom
