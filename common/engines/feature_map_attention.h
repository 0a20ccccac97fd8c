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
// Decode (prefill_state): the same state, one (S, z, key shift) per (batch, head), kept between
// generation steps. A step maps its key (raising the shift and rescaling S and z as above),
// adds it, S += phi(k) v^T and z += phi(k), and reads its query with the engine's row rule
// (finish_row); the outputs are the causal forward's rows, to float rounding.
//
// GEMMs go through OpenBLAS (single-threaded inside the OpenMP region over (batch, head),
// multi-threaded when there are fewer heads than threads); the feature maps' exps, maxima and
// norms through the AVX-512 or AVX2 helpers of common/kernels/simd.h where the build targets them
// (a portable loop otherwise).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/core/backward.h"
#include "common/core/decode.h"
#include "common/core/problem.h"
#include "common/core/tensor.h"

namespace attnbench::feature_map {

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

  /// The backward of queries(): dx (row r at dx + r lddx, d floats, overwritten) of `rows`
  /// query rows x from their features phi (as queries() wrote them) and dL/dphi. A query's
  /// own positive scale factor (the Performer's per-row shift) is a constant. dphi may be
  /// overwritten.
  virtual void queries_backward(const float* x, int64_t ldx, int64_t rows, const float* phi,
                                int64_t ldp, float* dphi, int64_t ldd, float* dx,
                                int64_t lddx) const = 0;
  /// The backward of keys(), with the key scale exp(-shift) a constant (it cancels in the
  /// ratio, so the gradient through it is zero).
  virtual void keys_backward(const float* x, int64_t ldx, int64_t rows, const float* phi,
                             int64_t ldp, float* dphi, int64_t ldd, float* dx,
                             int64_t lddx) const = 0;
  /// Floating-point operations of the backward of one query row / one key row.
  virtual double query_backward_flops() const = 0;
  virtual double key_backward_flops() const = 0;
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
  /// dx = dphi for x > 0, dphi exp(x) = dphi phi otherwise.
  void queries_backward(const float* x, int64_t ldx, int64_t rows, const float* phi, int64_t ldp,
                        float* dphi, int64_t ldd, float* dx, int64_t lddx) const override;
  void keys_backward(const float* x, int64_t ldx, int64_t rows, const float* phi, int64_t ldp,
                     float* dphi, int64_t ldd, float* dx, int64_t lddx) const override {
    queries_backward(x, ldx, rows, phi, ldp, dphi, ldd, dx, lddx);
  }
  double query_backward_flops() const override { return 2.0 * double(d_); }
  double key_backward_flops() const override { return 2.0 * double(d_); }

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
  /// softmax: dx = W~^T (dphi o phi) (the query's shift, which takes |x~|^2/2 with it, is a
  /// constant); relu: dx = W~^T (features^-1/2 dphi [W x~ > 0]).
  void queries_backward(const float* x, int64_t ldx, int64_t rows, const float* phi, int64_t ldp,
                        float* dphi, int64_t ldd, float* dx, int64_t lddx) const override;
  /// softmax: dx = W~^T (dphi o phi) - x / sqrt(d) sum(dphi o phi) (the |x~|^2/2 term);
  /// relu: as queries.
  void keys_backward(const float* x, int64_t ldx, int64_t rows, const float* phi, int64_t ldp,
                     float* dphi, int64_t ldd, float* dx, int64_t lddx) const override;
  double query_backward_flops() const override;
  double key_backward_flops() const override;

 private:
  // dx = y W~ for y (rows x features): the transpose of project
  void project_back(const float* y, int64_t ldy, int64_t rows, float* dx, int64_t lddx) const;
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
/// den (n floats, optional): each row's denominator for the backward (HeadGrads::den).
int64_t attend_head(const FeatureMap& fm, const Problem& p, int64_t b, const Schedule& s,
                    const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                    int64_t ldv, float* out, int64_t ldo, float eps, float* work,
                    float* den = nullptr);

/// Every (batch, head) of the problem: OpenMP over (batch, head) with BLAS single-threaded
/// inside, or one head at a time with multi-threaded BLAS when there are fewer heads than
/// threads. map_for_head(h) gives the feature map of head h (the same for every batch item).
/// Returns the number of rows (over every batch item and head) raised to the map's floor.
/// den ([B, H, n] floats, optional): the rows' denominators for attend_backward.
int64_t attend(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out, float eps, int64_t features,
               const std::function<const FeatureMap&(int64_t head)>& map_for_head,
               float* den = nullptr);

/// The end of one output row, the rule attend_head and the decode steps share. o (d floats)
/// holds phi(q)^T S; den = phi(q)^T z + eps; the row sees keys of total weight `weight` (its
/// visible key count; a weighted recurrence passes its weight sum), 0 when it sees none; floor:
/// the map's FeatureMap::denominator_floor (0 for none). A denominator below floor * weight is
/// raised to it (floor > 0 only); then o is divided by the denominator, or set to exactly 0
/// when the row sees no key or the denominator is not positive (a division, not a reciprocal,
/// so that a subnormal denominator still gives num / den). Returns what attend's `den` output
/// holds for the row: the denominator divided by (> 0), its negation if it was raised to the
/// floor (< 0), or 0 for a zero row.
float finish_row(float* o, int64_t d, float den, float floor, float weight);

/// The decode state of the engine (common/core/decode.h) after keys and values 0 .. t0 - 1 of k and
/// v [B, H, >= t0, d], with room for p.n tokens (p: causal self-attention, as
/// Decoder::check_decode accepts). Per (batch, head) it holds S (F x d), z (F), the key shift
/// and counts the keys, and each step computes the causal forward's row for its position:
/// out = phi(q)^T S / (phi(q)^T z + eps) by finish_row (the floor per visible key for maps with
/// one). maps: one feature map for every head, or one per head (H of them); the state shares
/// their ownership. map_bytes: the bytes of one map's own weights a step reads (W: F d 4 for
/// the Performer), counted once per map in step_bytes_read. The prefill folds the keys in the
/// engine's blocks of R (GEMMs, as attend_head folds the keys every row of a block sees); both
/// it and the steps run OpenMP over (batch, head) when there are at least as many as threads
/// (BLAS single-threaded inside), else one head at a time with BLAS multi-threaded.
///   state_bytes():     per sequence H (F d + F + 2) 4 bytes: S, z, the shift and the key
///                      count (one word each per head; the count is the same for every head)
///   step_bytes_read(): B H (F d + F) 4 (S and z) + the maps' weights + B H 3 d 4 (q, k, v)
///   step_flops():      B H (query and key map, 2 F d for S += phi(k) v^T, F for z, 2 F d
///                      for phi(q)^T S, 2 F for phi(q)^T z, d for the division); a step whose
///                      key raises the shift also rescales S and z (F d + F, not counted)
/// step() throws UsageError when the state is full or a view's shape is not [B, H, >= 1, d].
std::unique_ptr<DecodeState> prefill_state(const Problem& p, ConstTensorView k, ConstTensorView v,
                                           int64_t t0, float eps,
                                           std::vector<std::shared_ptr<const FeatureMap>> maps,
                                           double map_bytes = 0.0);

/// Floating-point operations of prefill_state over t0 tokens: per key and (batch, head) its
/// map, S += phi(k) v^T (2 F d) and z (F), as attend_flops counts a fold.
double prefill_flops(const Problem& p, int64_t t0, int64_t features, double key_map_flops);

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

// ----- the backward -----
//
// With num_i = phi(q_i)^T S_i, den_i = phi(q_i)^T z_i + eps, out_i = num_i / den_i and
// upstream dO: g_i = dO_i / den_i, dden_i = -(dO_i . out_i) / den_i (0 for a row raised to the
// floor: the floor is a constant), and
//   dphi(q_i) = S_i^T g_i + dden_i z_i,
//   dphi(k_j) = sum_{i sees j} phi(q_i) (g_i . v_j + dden_i) = U_j v_j + u_j,
//   dv_j      = sum_{i sees j} (phi(q_i) . phi(k_j)) g_i    = U_j^T phi(k_j),
// U_j = sum_{i sees j} phi(q_i) g_i^T (F x d), u_j = sum_{i sees j} dden_i phi(q_i). The rows
// that see key j are a suffix of the rows (Problem::visible is non-decreasing in i), so:
//   pass 1 walks the rows forwards as attend_head does (prefix state S, z, the same key
//          blocks, sub-chunks and key scale): dphi(Q) of each block, then dq through the map;
//   pass 2 walks them backwards with the suffix state U, u: before a sub-chunk's rows join
//          it, the keys only later rows see are final (dphi(K) = V U^T + 1 u^T, dV = phi(K) U,
//          then dk through the map); the chunk's own diagonal keys add the masked products
//          B^T phi(Q_c) (B = G_c V_w^T + dden, masked) and (A o mask)^T G_c (A = phi(Q_c)
//          phi(K_w)^T).
// Nothing per position beyond one block is held; phi(Q) and phi(K) are mapped again in each
// pass. Key scale: pass 1 records the key shift of every row block (the one the forward used
// for the block's den); pass 2 keeps U at the shift of the block it is in (scaled down by
// exp(new - old) when it moves to an earlier block with a smaller shift) and maps keys at that
// shift, so phi(k) and 1/den always meet at the same scale.

/// What one (batch, head) of the backward reads and writes. den: the row denominators the
/// forward divided by (attend's `den` output): > 0 normally, < 0 (the negated floor) for a row
/// raised to the floor, 0 for a row that is 0 (no visible key, or a denominator <= 0).
struct HeadGrads {
  const float *q, *k, *v, *out, *dout, *den;
  int64_t ldq, ldk, ldv, ldo, lddo;
  float *dq, *dk, *dv;
  int64_t lddq, lddk, lddv;
};

/// The saved state of the kernel variants' forward_train: each row's denominator (attend's
/// `den` output, [B, H, n]), 4 B H n bytes. phi(Q) and phi(K) are not kept ((n + m) F floats
/// per head): the backward maps them again, one block at a time.
class RowDenominators final : public SavedState {
 public:
  explicit RowDenominators(const Problem& p) : den(size_t(p.batch * p.heads * p.n)) {}
  std::vector<float> den;
  /// Bytes of the state for p: the denominators and the object itself.
  static double bytes(const Problem& p);
  /// The state of a forward_train; UsageError if `saved` is another variant's.
  static const RowDenominators& of(const SavedState& saved, const Problem& p);
};

/// Floats of one thread's workspace for attend_backward_head.
int64_t backward_workspace_floats(const Schedule& s, int64_t features, int64_t d);

/// The gradients of one (batch, head) of batch element b (see above); dk and dv rows of keys
/// no row sees (key padding) are 0. `work`: backward_workspace_floats floats, 64-byte aligned.
void attend_backward_head(const FeatureMap& fm, const Problem& p, int64_t b, const Schedule& s,
                          const HeadGrads& io, float* work);

/// Every (batch, head), threaded as attend(). den: [B, H, n] from attend's `den` output.
void attend_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     ConstTensorView out, ConstTensorView dout, const float* den, TensorView dq,
                     TensorView dk, TensorView dv, int64_t features,
                     const std::function<const FeatureMap&(int64_t head)>& map_for_head);

/// Floating-point operations of attend_backward, walked over the engine's blocks.
double attend_backward_flops(const Problem& p, int64_t features, double query_map_flops,
                             double key_map_flops, double query_back_flops, double key_back_flops);

/// Bytes attend_backward allocates (per-thread workspaces and the block shifts).
double attend_backward_bytes(const Problem& p, int64_t features);

}  // namespace attnbench::feature_map
