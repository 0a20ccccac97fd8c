// Kernelised ("linear") attention shared by variants/linear.cpp, variants/performer.cpp and
// variants/rfa.cpp: feature maps, the random projection of the Performer, and one chunked
// engine that computes
//
//   out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps),   S_i = sum_{j visible to i} phi(k_j) v_j^T,
//                                                      z_i = sum_{j visible to i} phi(k_j)
//
// for a feature map phi: R^d -> R^F (F = "features"), without the n x m matrix.
//
// The engine (attend_head) walks one (batch, head) in blocks of R query rows (R x F floats
// of at most 256 KiB: R = 1024 for F <= 64, 256 for F = 256, fewer beyond):
//   * keys visible to every row of the block are folded into the running state first,
//       S += phi(K_blk)^T V_blk (GEMM F x d x R),  z += column sums of phi(K_blk);
//   * the block's queries are mapped, phi(Q_blk) (for the Performer a GEMM R x F x d plus exp),
//     and so are the block's remaining keys (causal only: at most R - 1 of them);
//   * the block is cut into sub-chunks of C = 16 rows (the whole block when nothing is
//     masked); per sub-chunk
//       out = phi(Q_c) S                          (GEMM C x d x F, S = every key all rows see)
//       den = phi(Q_c) z                          (GEMV)
//       A   = phi(Q_c) phi(K_c)^T, causal mask    (GEMM C x w x F, w <= C keys on the diagonal)
//       out += A V_c, den += row sums of A        (GEMM C x d x w)
//       S += phi(K_c)^T V_c, z += colsum phi(K_c) (GEMM F x d x w)
//     then out /= den + eps (raised to the map's floor, FeatureMap::denominator_floor, if it
//     has one), and rows that see no key are set to exactly 0.
// Non-causal attention is the same walk with every key folded before the first query block.
// The causal mask is the bottom-right aligned one of Problem::visible (m != n works, rows
// with no visible key give 0). Time O((n + m) F d + n C (F + d)); memory per thread
// O(R F + C^2 + F d).
//
// Key scale: a feature map may scale every key feature by a common factor exp(-shift) (the
// Performer's stabiliser). It cancels in the ratio, so the engine only keeps S and z at the
// current scale: when a new key block raises the shift, S and z are multiplied by
// exp(old - new) first. With every key folded before the queries (non-causal) the final
// shift is the global maximum over all keys and features of the head; causal rows use the
// maximum over the keys mapped so far (see PerformerFeatureMap).
//
// GEMMs go through OpenBLAS (single-threaded inside the OpenMP region over (batch, head),
// multi-threaded when there are fewer heads than threads); the feature maps' exps, maxima and
// norms through the AVX-512 or AVX2 helpers of common/simd.h where the build targets them
// (a portable loop otherwise).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "common/problem.h"
#include "common/tensor.h"

namespace attnbench::kernel_attention {

/// A feature map phi: R^d -> R^features applied to rows of a matrix.
class FeatureMap {
 public:
  virtual ~FeatureMap() = default;
  virtual int64_t features() const = 0;
  /// phi of `rows` query rows (row r at x + r ldx, d floats) into out (row r at out + r ldo).
  /// A query row may be scaled by any positive factor of its own (it cancels in the ratio).
  virtual void queries(const float* x, int64_t ldx, int64_t rows, float* out,
                       int64_t ldo) const = 0;
  /// phi(k) exp(-shift) of `rows` key rows. `shift` is the log-scale of the keys mapped so
  /// far (-inf before the first); a map may raise it (never lower it) and must then scale
  /// these rows by the new value. Maps without a stabiliser leave it alone.
  virtual void keys(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo,
                    float& shift) const = 0;
  /// Floating-point operations to map one query row / one key row.
  virtual double query_flops() const = 0;
  virtual double key_flops() const = 0;
  /// Denominator floor per visible key, for maps whose features can be negative (so that
  /// phi(q)^T z can approach 0 or fall below it): a row that sees c keys divides by
  /// max(phi(q)^T z + eps, floor c), and attend counts the rows it raised. 0 (the default):
  /// no floor; a denominator <= 0 gives a 0 row.
  virtual float denominator_floor() const { return 0.0f; }
};

/// Katharopoulos et al. 2020: phi(x) = elu(x) + 1 (x + 1 for x > 0, exp(x) otherwise),
/// features = d. No stabiliser (phi is at most x + 1).
class EluFeatureMap final : public FeatureMap {
 public:
  explicit EluFeatureMap(int64_t d) : d_(d) {}
  int64_t features() const override { return d_; }
  void queries(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo) const override;
  void keys(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo,
            float& shift) const override;
  double query_flops() const override { return 2.0 * double(d_); }
  double key_flops() const override { return 2.0 * double(d_); }

 private:
  int64_t d_;
};

enum class PerformerKernel { Softmax, Relu };

/// Constant added to every relu feature, as numerical_stabilizer = 0.001 in the Performer
/// code's relu_kernel_transformation (it keeps the denominator positive).
inline constexpr float kReluFeatureEps = 1e-3f;

/// Performer feature maps with projection W (features x d), x~ = x d^-1/4:
///   softmax: phi(x) = features^-1/2 exp(W x~ - |x~|^2 / 2 - shift)   (FAVOR+, positive
///            features; E[phi(q)^T phi(k)] = exp(q.k / sqrt(d)) before the shifts)
///            queries: shift = the row's own max over features of W x~ - |x~|^2/2;
///            keys: shift = the running max of W k~ - |k~|^2/2 over every key and feature
///            mapped so far (see the engine: non-causal, that is the global max of the head).
///   relu:    phi(x) = features^-1/2 relu(W x~) + kReluFeatureEps, no shift.
class PerformerFeatureMap final : public FeatureMap {
 public:
  /// w: features x d, row-major (as returned by performer_projection).
  PerformerFeatureMap(std::vector<float> w, int64_t features, int64_t d, PerformerKernel kernel);
  int64_t features() const override { return features_; }
  void queries(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo) const override;
  void keys(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo,
            float& shift) const override;
  double query_flops() const override;
  double key_flops() const override;

 private:
  // out = x W~^T with W~ = W d^-1/4 (the scaling is folded into the projection)
  void project(const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo) const;
  std::vector<float> ws_;  // W d^-1/4, features x d
  int64_t features_, d_;
  PerformerKernel kernel_;
};

/// The Performer's random projection W (features x d, row-major) of head `head` under
/// `seed`. Orthogonal: blocks of d rows, each the transpose of the Q factor of a QR of a
/// d x d standard Gaussian matrix (signs fixed by diag(R) > 0, so Q is Haar distributed),
/// the last block cut to the rows needed, and row f rescaled to the norm of an independent
/// d-dim standard Gaussian vector (chi_d), so every row is marginally N(0, I_d). Otherwise
/// iid N(0, 1) entries. The numbers come from RandomStream(seed, s) with s derived from the
/// head index alone, and block b uses the same numbers whatever `features` is: W for F rows
/// is the first F rows of W for more rows.
std::vector<float> performer_projection(uint64_t seed, int64_t head, int64_t features, int64_t d,
                                        bool orthogonal);

/// Row blocking of the engine for a feature count.
struct Schedule {
  int64_t block;  ///< query / key rows per block (R)
  int64_t chunk;  ///< rows per causal sub-chunk (C <= R)
  static Schedule for_features(int64_t features);
};

/// Floats of one thread's workspace for attend_head.
int64_t workspace_floats(const Schedule& s, int64_t features, int64_t d);

/// One (batch, head) of batch element b: q is n x d (row stride ldq), k and v m x d, out
/// n x d; the keys past b's key padding length are never mapped nor summed. `work` holds
/// workspace_floats(s, fm.features(), p.dim) floats, 64-byte aligned. Returns the number of
/// rows whose denominator was raised to the map's floor (FeatureMap::denominator_floor).
int64_t attend_head(const FeatureMap& fm, const Problem& p, int64_t b, const Schedule& s,
                    const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                    int64_t ldv, float* out, int64_t ldo, float eps, float* work);

/// Every (batch, head) of the problem: OpenMP over (batch, head) with BLAS single-threaded
/// inside, or one head at a time with multi-threaded BLAS when there are fewer heads than
/// threads. map_for_head(h) gives the feature map of head h (the same for every batch item).
/// Returns the number of rows (over every batch item and head) raised to the map's floor.
int64_t attend(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out, float eps, int64_t features,
               const std::function<const FeatureMap&(int64_t head)>& map_for_head);

/// Threads attend() runs on: min(threads, B H) when there are at least as many heads as
/// threads, else 1 (multi-threaded BLAS).
int attend_threads(const Problem& p);

/// Floating-point operations of attend() for maps with these per-row costs (from
/// FeatureMap::query_flops / key_flops): the feature maps, every GEMM and GEMV (multiply-add
/// = 2), column sums, masked row sums and the final division, walked over the same blocks and
/// sub-chunks as the engine (so the causal diagonal chunks are counted as computed: whole
/// C x w products, not half).
double attend_flops(const Problem& p, int64_t features, double query_map_flops,
                    double key_map_flops);

/// Bytes attend() allocates: one workspace per thread (plus OpenBLAS's per-call job array
/// when it runs the GEMMs multi-threaded, with fewer heads than threads).
double attend_bytes(const Problem& p, int64_t features);

}  // namespace attnbench::kernel_attention
