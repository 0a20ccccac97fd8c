// sinkhorn: Sparse Sinkhorn attention, deterministic (no Gumbel noise). Positions are cut into
// blocks of b = `block` (nb = ceil(n / b) blocks, the last one ragged). Per (batch, head):
//
//   S_q[i] = mean of the queries of block i,  S_k[j] = mean of the keys of block j
//   R      = relu(S_q S_k^T / sqrt(d))                                        (nb x nb)
//   L      = log(R + 1e-6) / temperature   (the eps of the Sinkhorn Transformer code: R = 0
//                                           gives log(1e-6) / temperature, never -inf or NaN)
//   repeat `iterations` times:  L[i][j] -= LSE_j' L[i][j']  (rows),
//                               L[i][j] -= LSE_i' L[i'][j]  (columns)
//   P = exp(L) is the soft permutation; pi(i) = argmax_j L[i][j] (= argmax_j P[i][j]; ties:
//   the lowest j)
//
// and query block i attends, with exact softmax, key blocks i and pi(i) (one block when they
// are equal): out_q = sum_{j in blocks {i, pi(i)}, j visible} softmax_j(q . k_j / sqrt(d)) v_j.
//
// Causal (m = n): the matching must not see anything a row may not. Plain masking of j > i is
// not enough: the own block's key mean holds keys after most of its rows, and the column step
// sums over later rows (later blocks' queries and keys). So under a causal mask
//   - the candidates of query block i are the past blocks j < i only (its own block is attended
//     anyway, under the element causal mask the engine applies); block 0 has none: pi(0) = 0;
//   - S_q[i] is the mean of the b queries ending at the block's first one (positions
//     max(0, i0 - b + 1) .. i0, which every row of the block sees);
//   - the column step divides entry (i, j) by its column's sum over rows j < i' <= i only (a
//     running log-sum-exp down the column, in the spirit of the paper's causal Sinkhorn
//     balancing), so row i depends on blocks 0 .. i - 1 and on queries up to i0 alone.
//
// Key padding (Problem::key_lengths): the keys j >= L_b of batch element b are absent. Key
// block j's mean S_k[j] is the mean of its valid keys only (a block straddling L_b averages
// the keys before L_b); a block with no valid key (j >= ceil(L_b / block)) is no candidate: its
// column of L does not exist for the row and column steps, and it is never matched. The query
// summaries, the causal rules and the attention are unchanged (the engine masks the padded keys
// of the blocks a row visits). A query block with no candidate at all (L_b = 0, or block 0
// under a causal mask) has pi(i) = i and visits its own block alone.
//
// The matching runs in double (exp and log by branch-free polynomials good to about 1 ulp, so
// its loops vectorise); attention runs in the block-sparse engine. Self-attention only: the own
// block needs m = n (caps.cross = false).
// Time O(B H (n b d + nb^2 d + iterations nb^2)); memory O(threads (block (block + d) +
// nb^2 + nb d)) plus the matching (4 B H nb bytes).
// Paper: Tay, Bahri, Yang, Metzler, Juan, "Sparse Sinkhorn Attention" (ICML 2020).
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/core/error.h"
#include "common/core/parallel_for.h"
#include "common/core/threads.h"
#include "common/engines/block_sparse.h"

namespace attnbench {
namespace {

constexpr double kLogEps = 1e-6;  // R + eps before the log, as in the Sinkhorn Transformer code

/// exp(x) for x <= 0 (and x = -inf) in double, about 1 ulp: x = k ln2 + r with |r| <= ln2/2,
/// exp(r) by its degree-13 Taylor polynomial (remainder < 1e-17), times 2^k built from the
/// exponent bits. x below -708 is clamped there (exp = 3e-308 instead of a subnormal or 0:
/// beside the row's largest term, 1, it changes no sum). Branch-free, so loops of it vectorise.
inline double exp_nonpositive(double x) {
  constexpr double kLog2e = 1.4426950408889634, kLn2Hi = 0.6931471803691238,
                   kLn2Lo = 1.9082149292705877e-10;
  constexpr double kShift = 0x1.8p52;  // adding it rounds to an integer held in the low bits
  x = std::max(x, -708.0);
  const double shifted = x * kLog2e + kShift;
  const double kf = shifted - kShift;  // k = round(x / ln2)
  const int64_t ki = std::bit_cast<int64_t>(shifted) - std::bit_cast<int64_t>(kShift);
  const double r = (x - kf * kLn2Hi) - kf * kLn2Lo;
  // Horner on 1/13!, 1/12!, ..., 1/1!, 1/0! (literals, not an array: no gathers once vectorised)
  double y = 1.0 / 6227020800.0;
  y = y * r + 1.0 / 479001600.0;
  y = y * r + 1.0 / 39916800.0;
  y = y * r + 1.0 / 3628800.0;
  y = y * r + 1.0 / 362880.0;
  y = y * r + 1.0 / 40320.0;
  y = y * r + 1.0 / 5040.0;
  y = y * r + 1.0 / 720.0;
  y = y * r + 1.0 / 120.0;
  y = y * r + 1.0 / 24.0;
  y = y * r + 1.0 / 6.0;
  y = y * r + 0.5;
  y = y * r + 1.0;
  y = y * r + 1.0;
  const int64_t bits = (ki + 1023) << 52;
  return y * std::bit_cast<double>(bits);
}

/// The matching of every (batch, head): pi(i) for each query block i. Query block i visits key
/// blocks i and pi(i), both whole tiles (the engine masks the causal diagonal).
class SinkhornPattern final : public SparsePattern {
 public:
  SinkhornPattern(int64_t block, int64_t heads, int64_t nb) : bs_(block), heads_(heads), nb_(nb) {}

  int64_t block() const override { return bs_; }

  void key_blocks(int64_t b, int64_t h, int64_t qb, std::vector<KeyBlock>& out) const override {
    out.clear();
    if (qb < 0 || qb >= nb_) return;
    const int64_t j = match(b, h, qb);
    out.push_back({std::min(qb, j), false});
    if (j != qb) out.push_back({std::max(qb, j), false});
  }

  void block_mask(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qb = (i0 + r) / bs_;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t kb = (j0 + c) / bs_;
        mask[r * cols + c] = qb < nb_ && (kb == qb || kb == match(b, h, qb));
      }
    }
  }

  double bytes() const override { return double(match_.capacity() * sizeof(int32_t)); }

  /// pi(qb) of head (b, h).
  int64_t match(int64_t b, int64_t h, int64_t qb) const {
    return match_[size_t((b * heads_ + h) * nb_ + qb)];
  }
  /// The nb matches of head (b, h), to be filled.
  int32_t* head(int64_t b, int64_t h) { return match_.data() + (b * heads_ + h) * nb_; }
  void resize(int64_t batch) { match_.assign(size_t(batch * heads_ * nb_), 0); }

 private:
  int64_t bs_, heads_, nb_;
  std::vector<int32_t> match_;  ///< [B][H][nb] pi
};

using RowMat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Working arrays of one thread's matching: summaries (nb x d each), L (nb x nb) and two
/// column vectors.
struct MatchWork {
  RowMat sq, sk, l;
  std::vector<double> colmax, colsum;
  MatchWork(int64_t nb, int64_t d)
      : sq(nb, d), sk(nb, d), l(nb, nb), colmax(size_t(nb)), colsum(size_t(nb)) {}
  static double bytes(int64_t nb, int64_t d) {
    return double(2 * nb * d + nb * nb + 2 * nb) * sizeof(double);
  }
};

/// log(x) for normal x > 0 in double, about 1 ulp: x = 2^e u with u in [sqrt(1/2), sqrt(2)),
/// log u = 2 atanh(s), s = (u - 1) / (u + 1), by its series to s^19 (|s| <= 0.172: remainder
/// < 1e-17). Branch-free, so loops of it vectorise.
inline double log_positive(double x) {
  constexpr double kLn2Hi = 0.6931471803691238, kLn2Lo = 1.9082149292705877e-10;
  const int64_t bits = std::bit_cast<int64_t>(x);
  int64_t e = (bits >> 52) - 1023;
  double u = std::bit_cast<double>((bits & 0x000fffffffffffffLL) | 0x3ff0000000000000LL);
  const int64_t big = u > 1.4142135623730951;  // arithmetic, not branches: vectorises
  u *= 1.0 - 0.5 * double(big);
  e += big;
  const double s = (u - 1.0) / (u + 1.0), s2 = s * s;
  double y = 1.0 / 19.0;  // Horner on 1/19, 1/17, ..., 1/3, 1
  y = y * s2 + 1.0 / 17.0;
  y = y * s2 + 1.0 / 15.0;
  y = y * s2 + 1.0 / 13.0;
  y = y * s2 + 1.0 / 11.0;
  y = y * s2 + 1.0 / 9.0;
  y = y * s2 + 1.0 / 7.0;
  y = y * s2 + 1.0 / 5.0;
  y = y * s2 + 1.0 / 3.0;
  y = y * s2 + 1.0;
  const double ef = double(e);
  return ef * kLn2Hi + (2.0 * s * y + ef * kLn2Lo);
}

/// Means of the rows [r0(i), r1(i)) of x (stride ld) for each of the s.rows() summaries, into
/// the rows of s (nb x d).
template <class Range>
void row_means(const float* x, int64_t ld, int64_t d, Range range, RowMat& s) {
  for (int64_t i = 0; i < s.rows(); ++i) {
    double* si = s.row(i).data();
    std::fill(si, si + d, 0.0);
    const auto [r0, r1] = range(i);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * ld;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) si[c] += double(xr[c]);
    }
    const double inv = 1.0 / double(std::max<int64_t>(r1 - r0, 1));
    for (int64_t c = 0; c < d; ++c) si[c] *= inv;
  }
}

/// Subtracts from each of the `len` entries of x their log-sum-exp (tmp: len scratch doubles).
inline void normalise(double* x, int64_t len, double* tmp) {
  double mx = -std::numeric_limits<double>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < len; ++j) mx = x[j] > mx ? x[j] : mx;
    // the exponentials first, then their sum: GCC leaves a fused exp-and-sum loop scalar
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) tmp[j] = exp_nonpositive(x[j] - mx);
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < len; ++j) sum += tmp[j];
  const double lse = mx + log_positive(sum);
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) x[j] -= lse;
}

/// pi of head (b, h) into pi[0 .. nb).
void match_head(const Problem& p, ConstTensorView q, ConstTensorView k, int64_t b, int64_t h,
                int64_t bs, double temperature, int64_t iterations, MatchWork& w, int32_t* pi) {
  const int64_t n = p.n, d = p.dim, nb = w.l.rows();
  const bool causal = p.causal;
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  // valid keys, and the key blocks holding any (the candidates)
  const int64_t len = p.key_lengths.empty() ? n : p.key_lengths[size_t(b)];
  const int64_t kb = (len + bs - 1) / bs;
  // the candidate columns of row i: j < cols(i)
  auto cols = [&](int64_t i) { return causal ? std::min(i, kb) : kb; };
  pi[0] = 0;
  if ((causal && nb == 1) || kb == 0) {  // no block to match: every block its own
    for (int64_t i = 0; i < nb; ++i) pi[i] = int32_t(i);
    return;
  }
  // pass 1: summaries. Key block j: the mean of its valid keys. Query block i: the mean of its
  // queries, or under a causal mask the mean of the b queries ending at its first one
  // (positions max(0, i0 - b + 1) .. i0, seen by every row of the block).
  using Span = std::pair<int64_t, int64_t>;
  row_means(
      k.row(b, h, 0), k.stride_row, d,
      [&](int64_t j) {
        return Span{j * bs, std::min(len, (j + 1) * bs)};
      },
      w.sk);
  if (causal)
    row_means(
        q.row(b, h, 0), q.stride_row, d,
        [&](int64_t i) {
          return Span{std::max<int64_t>(0, i * bs - bs + 1), i * bs + 1};
        },
        w.sq);
  else
    row_means(
        q.row(b, h, 0), q.stride_row, d,
        [&](int64_t i) {
          return Span{i * bs, std::min(n, (i + 1) * bs)};
        },
        w.sq);
  // pass 2: L = log(relu(S_q S_k^T / sqrt(d)) + eps) / temperature; causal: j < i only, and
  // valid key blocks only
  w.l.noalias() = w.sq * w.sk.transpose();
  const double inv_sqrt_d = 1.0 / std::sqrt(double(d)), inv_t = 1.0 / temperature;
  for (int64_t i = 0; i < nb; ++i) {
    double* li = w.l.row(i).data();
    const int64_t ci = cols(i);
#pragma omp simd
    for (int64_t j = 0; j < ci; ++j)
      li[j] = log_positive(std::max(li[j] * inv_sqrt_d, 0.0) + kLogEps) * inv_t;
    std::fill(li + ci, li + nb, kNegInf);
  }
  // pass 3: Sinkhorn steps, each a row then a column normalisation
  double* cmax = w.colmax.data();
  double* csum = w.colsum.data();
  for (int64_t it = 0; it < iterations; ++it) {
    for (int64_t i = causal ? 1 : 0; i < nb; ++i) normalise(w.l.row(i).data(), cols(i), cmax);
    std::fill(cmax, cmax + nb, kNegInf);
    std::fill(csum, csum + nb, 0.0);
    if (!causal) {
      // every row and candidate column (j < kb) holds finite entries: no LSE is -inf
      for (int64_t i = 0; i < nb; ++i) {
        const double* li = w.l.row(i).data();
#pragma omp simd
        for (int64_t j = 0; j < kb; ++j) cmax[j] = std::max(cmax[j], li[j]);
      }
      for (int64_t i = 0; i < nb; ++i) {
        const double* li = w.l.row(i).data();
#pragma omp simd
        for (int64_t j = 0; j < kb; ++j) csum[j] += exp_nonpositive(li[j] - cmax[j]);
      }
      for (int64_t j = 0; j < kb; ++j) cmax[j] += log_positive(csum[j]);  // column LSE
      for (int64_t i = 0; i < nb; ++i) {
        double* li = w.l.row(i).data();
#pragma omp simd
        for (int64_t j = 0; j < kb; ++j) li[j] -= cmax[j];
      }
    } else {
      // causal: entry (i, j) is divided by the sum of its column over rows j < i' <= i only
      // (a running log-sum-exp down each column), so row i never depends on later blocks
      for (int64_t i = 1; i < nb; ++i) {
        double* li = w.l.row(i).data();
        const int64_t ci = cols(i);
#pragma omp simd
        for (int64_t j = 0; j < ci; ++j) {
          const double x = li[j], mx = std::max(cmax[j], x);
          csum[j] = csum[j] * exp_nonpositive(cmax[j] - mx) + exp_nonpositive(x - mx);
          cmax[j] = mx;
        }
#pragma omp simd
        for (int64_t j = 0; j < ci; ++j) li[j] -= cmax[j] + log_positive(csum[j]);
      }
    }
  }
  // pass 4: pi(i) = argmax_j L[i][j] over the candidates, the lowest j on ties
  for (int64_t i = causal ? 1 : 0; i < nb; ++i) {
    const double* li = w.l.row(i).data();
    int64_t best = 0;
    for (int64_t j = 1; j < cols(i); ++j)
      if (li[j] > li[best]) best = j;
    pi[i] = int32_t(best);
  }
}

class Sinkhorn final : public PatternVariant {
 public:
  Sinkhorn(int64_t block, double temperature, int64_t iterations)
      : block_(block), temperature_(temperature), iterations_(iterations) {}

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView q,
                                              ConstTensorView k) const override {
    if (p.keys() != p.n)
      throw UnsupportedError(
          "sinkhorn: self-attention only (m = n): query block i attends its "
          "own key block i");
    if (q.data == nullptr || k.data == nullptr)
      throw InputError("sinkhorn: the pattern depends on q and k; make_pattern needs both");
    const int64_t nb = blocks(p), bh = p.batch * p.heads;
    auto pat = std::make_unique<SinkhornPattern>(block_, p.heads, nb);
    pat->resize(p.batch);
    parallel_for(
        bh, [&] { return MatchWork(nb, p.dim); },
        [&](int64_t t, MatchWork& w) {
          match_head(p, q, k, t / p.heads, t % p.heads, block_, temperature_, iterations_, w,
                     pat->head(t / p.heads, t % p.heads));
        },
        {.parallel = bh > 1});
    return pat;
  }

  // The matching depends on q and k, so the estimates do not build a pattern: they count the
  // worst case, an upper bound of what forward does.
  double flops(const Problem& p) const override {
    const int64_t n = p.n, m = p.keys(), nb = blocks(p);
    const double scores = head_scores(p);
    const double d = double(p.dim), blocks2 = double(nb) * double(nb);
    // matching: summaries (n + m) d adds, S_q S_k^T 2 nb^2 d, the log per entry and about
    // 6 operations per entry and Sinkhorn step (max, subtract, exp, add, subtract lse)
    const double matching =
        double(n + m) * d + 2.0 * blocks2 * d + blocks2 + 6.0 * 2.0 * double(iterations_) * blocks2;
    return double(p.batch * p.heads) * (4.0 * d * scores + matching);
  }

  // The backward's estimates, by the same worst case: two key blocks per query block.
  Counts pattern_counts(const Problem& p) const override {
    const double heads = double(p.batch * p.heads);
    Counts c;
    c.scores = heads * head_scores(p);
    c.listed = heads * 2.0 * double(blocks(p));
    c.bytes = heads * double(blocks(p)) * sizeof(int32_t);
    c.block = block_;
    return c;
  }

  double memory_estimate(const Problem& p) const override {
    const int threads = team_threads();
    const int64_t nb = blocks(p);
    // engine tiles, the matching table and every thread's matching arrays
    return block_sparse_memory(p, block_) + double(p.batch * p.heads * nb) * sizeof(int32_t) +
           double(threads) * MatchWork::bytes(nb, p.dim);
  }

 private:
  int64_t blocks(const Problem& p) const { return (p.n + block_ - 1) / block_; }

  // Scores the engine computes in one head, at most: query block i computes its own block (up
  // to the diagonal under a causal mask, as the engine counts it) and, in the worst case, one
  // other whole block.
  double head_scores(const Problem& p) const {
    const int64_t n = p.n, m = p.keys(), bs = block_, nb = blocks(p);
    double scores = 0;
    for (int64_t qb = 0; qb < nb; ++qb) {
      const int64_t i0 = qb * bs, rows = std::min(bs, n - i0), kend = p.visible(i0 + rows - 1);
      const int64_t own = std::clamp<int64_t>(kend - i0, 0, std::min(bs, m - i0));
      const bool other = nb > 1 && (!p.causal || qb > 0);
      scores += double(rows) * double(own + (other ? std::min(bs, m) : 0));
    }
    return scores;
  }

  int64_t block_;
  double temperature_;
  int64_t iterations_;
};

ATTNBENCH_REGISTER_VARIANT(
    sinkhorn,
    VariantInfo{
        .name = "sinkhorn",
        .summary = "Sparse Sinkhorn: each query block attends its own key block and the key block "
                   "matched by a deterministic Sinkhorn sort of block means",
        .complexity = "time O(n block d + (n / block)^2 (d + iterations)), "
                      "memory O(threads (block (block + d) + (n / block)^2))",
        .family = "pattern",
        .display = "Sparse Sinkhorn",
        .paper = "Tay et al. 2020 (arXiv:2002.11296)",
        .look = {.color = "#7b4173", .marker = ">"},
        .params = {block_param(),
                   ParamSpec::Float("temperature", 0.75, 1e-3, 1e3,
                                    "divides log(R + 1e-6) before the Sinkhorn steps"),
                   ParamSpec::Int("iterations", 5, 0, 1000,
                                  "Sinkhorn steps (each a row then a column normalisation)")},
        .caps = {.causal = true, .cross = false, .additive = true, .key_padding = true},
        .make = [](const ParamValues& v) {
          return std::make_unique<Sinkhorn>(v.get_int("block"), v.get_float("temperature"),
                                            v.get_int("iterations"));
        }});

}  // namespace
}  // namespace attnbench
