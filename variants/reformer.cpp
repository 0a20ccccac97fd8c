// reformer: LSH attention with shared queries and keys (Kitaev et al. 2020, "Reformer: The
// Efficient Transformer", ICLR 2020; defaults and details as in the HF/trax code).
//
// Keys are the queries, length-normalised: k_j = q_j / |q_j| (a zero query gives a zero key),
// values are v; logits are q_i . k_j (the unit keys already carry the 1/sqrt(d) of the HF
// "length and dim norm", so there is no further scale). Per head and per round r of `hashes`:
//   hash    bucket(i) from random rotations R_r (d x B/2, N(0,1), from the seed per (head,
//           round)): argmax of [q_i R_r, -q_i R_r]; with factorised buckets B = B1 x B2 each
//           factor has its own rotations and the bucket combines the factors' indices;
//   sort    tokens by (bucket, position), a stable counting sort;
//   chunk   the sorted sequence is cut into chunks of `chunk` tokens; each chunk attends to
//           itself and to the previous chunk (chunk 0 to the last one, as in the HF/trax
//           code; a single chunk attends to itself only);
//   mask    a token never attends to itself unless nothing else is visible to it in the
//           round (its logit is then -1e5, as in the HF code, so such a round weighs nothing
//           next to a round with real keys); causal: keys at later positions are hidden;
//   combine out_i = sum_r w_r o_i^r with w = softmax_r(lse_i^r), lse the per-round log-sum-exp
//           of the logits the row attended. A key found in several rounds counts once per
//           round (no de-duplication, as in the HF code).
// The sorted Q, K, V of a round are gathered contiguously and each chunk runs the flash tile
// passes (common/kernels/tile_attention.h) on two key blocks with an element mask from the
// positions.
//
// Defaults: chunk 64 (HF), hashes 4 (the paper uses 1-8; HF's default is 1), buckets from
// reformer::auto_buckets (HF's rule: about 2 n / chunk, factorised once large).
// Self-attention only (m = n): the keys are the queries. Causal supported.
//
// Key padding (L valid tokens of n in a batch element): padded tokens are no keys but still
// queries. Hashing, sorting and chunking run on the L valid tokens as if n were L (their
// plan is plan(L, ...): automatic buckets from L, chunk min(chunk, L), ceil(L / chunk)
// chunks; the rotations do not depend on n), so the valid rows are exactly those of the
// unpadded problem of the L valid tokens. A padded token is hashed with the same rotations
// and, per round, attends the chunk it would sort into without joining it (the chunk of the
// last valid token whose bucket is at most its own; chunk 0 if none) and that chunk's
// previous chunk, every such key visible to it (causal keeps them all: they precede it).
// L = 0 gives zero rows. Unpadded problems run exactly as before.
// Time O(hashes (n (chunk + C) d + buckets)): per round the projections (n d C), a counting
// sort (n + buckets) and the chunks (2 n chunk d); memory O(n (3 d + hashes C)) for one head at
// a time plus per-thread tiles.
//
// Backward. Constants of the backward: the buckets of every round (hence each round's sorted
// order, its chunks and which keys each row sees, and which rows see none and take their own
// value at the fixed logit -1e5). forward_train keeps them (int32, hashes x n per head; hashing
// again would cost the projections' GEMM for 4 bytes a row and round) with every row's
// log-sum-exp per round (float, the same size). Everything else is differentiated:
//   rounds  out_i = sum_r w_ir o_ir, w_ir = softmax_r(lse_ir): with D_i = dO_i . out_i,
//           dlse_ir = w_ir (dO_i . o_ir - D_i), and as dlse_ir / ds_ij = p_ij the round's
//           dS_ij = w_ir p_ij (dO_i . v_j - D_i): softmax attention's backward with the upstream
//           gradient w_ir dO_i and the combined output's D_i in place of the round's own;
//   a round per chunk (as the forward runs it): P = exp(S - lse) recomputed, dQ = dS K,
//           dK = dS^T Q, dV = P^T (w dO); a row that saw no key gets dv_i += w_ir dO_i and no
//           logit gradient (its logit is the constant -1e5); gradients go back to the tokens'
//           positions, summed over the rounds and the two chunks a key serves;
//   keys    k_j = q_j / |q_j|: dq_j += (I - k_j k_j^T) dk_j / |q_j| (a zero q_j has k_j = 0
//           and no gradient through it).
// The k input is unused (shared QK): its gradient is exactly zero. Heads run as in the
// forward; within a head the rounds run one after another and a round's chunks in parallel,
// each writing only its own chunk's and its previous chunk's key rows (separate buffers), which
// are added to the tokens after the round. Tested against finite differences of
// reformer::oracle_on_buckets with the forward's buckets frozen.
#include "variants/reformer.h"

#include <cblas.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <memory>
#include <numeric>
#include <optional>

#include "common/core/backward.h"
#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel_for.h"
#include "common/core/phase.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/core/tensor.h"
#include "common/core/threads.h"
#include "common/kernels/tile_attention.h"
#include "common/patterns/row_pattern.h"
#include "common/reference/oracle.h"

namespace attnbench {

namespace {

using reformer::kHashRows;
using reformer::Plan;

/// Working buffers of one head (reused head after head).

struct HeadBuffers {
  std::vector<int32_t> bucket;  // hashes x n: bucket of token i in round r at r n + i
  std::vector<int32_t> perm;    // the current round's order (sorted position -> token)
  std::vector<int32_t> count;   // buckets + 1
  // key padding (L valid tokens < n): perm[L + pstart[c] ..] are the padded queries that
  // attend chunk c; next is scratch for placing them
  std::vector<int32_t> pstart, next;
  std::vector<std::array<int64_t, 3>> items;  // the round's tiles: chunk, first row, rows
  Tensor qs, ks, vs;                          // sorted q, unit keys, v: n x d
  std::vector<float> inv_norm, lse, mx, z;
  HeadBuffers(const Plan& pl, int64_t n, int64_t d)
      : bucket(static_cast<size_t>(pl.hashes * n)),
        perm(size_t(n)),
        count(size_t(pl.buckets + 1)),
        qs(Shape4{1, 1, n, d}),
        ks(Shape4{1, 1, n, d}),
        vs(Shape4{1, 1, n, d}),
        inv_norm(size_t(n)),
        lse(size_t(n)),
        mx(size_t(n)),
        z(size_t(n)) {}
  static double bytes(const Plan& pl, int64_t n, int64_t d) {
    return 4.0 * double(n) * double(pl.hashes + 3 * d + 5) + 4.0 * double(pl.buckets + 1);
  }
};

/// What forward_train keeps for the backward: the buckets of every head and round (the
/// discrete choice the backward holds fixed) and every row's log-sum-exp per round (the
/// round weights), both at [(b H + h) hashes + r) n + i].
class ReformerSaved final : public SavedState {
 public:
  std::vector<int32_t> bucket;
  std::vector<float> lse;
};

/// The backward's buffers of one head, beside HeadBuffers (reused head after head).
struct GradBuffers {
  std::vector<float> weight;  // hashes x n: round weight w_ir = softmax_r(lse_ir)
  std::vector<float> dfin;    // n: D_i = dO_i . out_i
  std::vector<float> dw;      // n, sorted: w_ir D_i of the current round
  // n x d: sorted w_ir dO_i; sorted dQ of the query role; the key and value gradients of
  // the current round by sorted key position, from the key's own chunk (own) and from the
  // chunk after it (prev: the key is in that chunk's previous chunk); the unit keys' gradient
  // summed over the rounds, by token
  Tensor gs, dqs, dk_own, dk_prev, dv_own, dv_prev, dk_sum;
  GradBuffers(const Plan& pl, int64_t n, int64_t d)
      : weight(static_cast<size_t>(pl.hashes * n)),
        dfin(size_t(n)),
        dw(size_t(n)),
        gs(Shape4{1, 1, n, d}),
        dqs(Shape4{1, 1, n, d}),
        dk_own(Shape4{1, 1, n, d}),
        dk_prev(Shape4{1, 1, n, d}),
        dv_own(Shape4{1, 1, n, d}),
        dv_prev(Shape4{1, 1, n, d}),
        dk_sum(Shape4{1, 1, n, d}) {}
  static double bytes(const Plan& pl, int64_t n, int64_t d) {
    return 4.0 * double(n) * double(pl.hashes + 2 + 7 * d);
  }
};

/// One thread's buffers for a chunk of the backward: the window of up to 2 chunk keys (the
/// previous chunk's, then the chunk's own), gathered when the two are not adjacent in sorted
/// order, their gradients, and the scores of up to `chunk` query rows against them.
struct TaskBuffers {
  std::vector<float> kw, vw, dkw, dvw;  // 2 chunk x d
  std::vector<float> sp, dsp;           // chunk x 2 chunk: P and dP, then dS
  std::vector<int32_t> wperm;           // 2 chunk: the window's tokens
  std::vector<int64_t> self_rows;       // sorted positions of the rows that saw no key
  TaskBuffers(int64_t ch, int64_t d)
      : kw(static_cast<size_t>(2 * ch * d)),
        vw(static_cast<size_t>(2 * ch * d)),
        dkw(static_cast<size_t>(2 * ch * d)),
        dvw(static_cast<size_t>(2 * ch * d)),
        sp(static_cast<size_t>(2 * ch * ch)),
        dsp(static_cast<size_t>(2 * ch * ch)),
        wperm(static_cast<size_t>(2 * ch)) {
    self_rows.reserve(size_t(ch));
  }
  static double bytes(int64_t ch, int64_t d) {
    return 4.0 * double(ch) * double(8 * d + 4 * ch + 2) + 8.0 * double(ch);
  }
};

/// Most buckets per round (the product of the factors): bucket numbers are int32 and the
/// counting sort keeps a counter per bucket.
constexpr int64_t kMaxBuckets = int64_t(1) << 24;

/// Throws SpecError unless every factor is 1 or even and their product is at most
/// kMaxBuckets (checked before it can overflow).
void check_buckets(const std::vector<int64_t>& factors) {
  const std::string given = fmt::format("{}", fmt::join(factors, "+"));
  int64_t product = 1;
  for (int64_t f : factors) {
    if (f != 1 && f % 2 != 0)
      throw SpecError(fmt::format(
          "reformer: parameter 'buckets' = '{}' has the factor {}; accepted: factors that are "
          "each 1 (no hashing) or even (a factor B hashes to the argmax of [xR, -xR], R d x B/2)",
          given, f));
    if (f > kMaxBuckets / product)
      throw SpecError(fmt::format(
          "reformer: parameter 'buckets' = '{}' makes more than {} buckets per round; accepted: "
          "factors whose product is at most {}",
          given, kMaxBuckets, kMaxBuckets));
    product *= f;
  }
}

class Reformer final : public Variant, public Backward {
 public:
  Reformer(std::vector<int64_t> buckets, int64_t hashes, int64_t chunk)
      : buckets_(std::move(buckets)), hashes_(hashes), chunk_(chunk) {
    check_buckets(buckets_);
  }

  /// The hashing plan; the factors were checked when the variant was made (auto_buckets
  /// gives powers of two).
  Plan plan(const Problem& p) const { return reformer::plan(p, buckets_, hashes_, chunk_); }

  /// Buckets of every token of head (b, h) in every round (hb.bucket): the projections
  /// q R_r of all rounds come from one GEMM per block of kHashRows rows, and each block is
  /// hashed while it is in cache (the n x hashes C projections are never stored whole).
  void hash(const Problem& p, const Plan& pl, ConstTensorView q, int64_t b, int64_t h,
            HeadBuffers& hb) const {
    reformer::hash_rows(pl, p.seed, h, q.row(b, h, 0), q.stride_row, p.n, p.dim, hb.bucket.data());
  }

  /// Round r's order into hb.perm: the L valid tokens sorted by (bucket, position), then the
  /// padded ones (L <= i < n) by the chunk they attend (hb.pstart), by position within one.
  void sort_round(const Problem& p, const Plan& pl, int64_t L, int64_t r, HeadBuffers& hb) const {
    sort_round(p, pl, L, hb.bucket.data() + r * p.n, hb);
  }

  /// The same for the round whose n buckets are `bucket`.
  void sort_round(const Problem& p, const Plan& pl, int64_t L, const int32_t* bucket,
                  HeadBuffers& hb) const {
    const int64_t n = p.n;
    // stable counting sort by bucket
    hb.count.assign(size_t(pl.buckets + 1), 0);
    for (int64_t i = 0; i < L; ++i) ++hb.count[size_t(bucket[i]) + 1];
    for (int64_t u = 0; u < pl.buckets; ++u) hb.count[size_t(u + 1)] += hb.count[size_t(u)];
    for (int64_t i = 0; i < L; ++i) hb.perm[size_t(hb.count[size_t(bucket[i])]++)] = int32_t(i);
    if (L == n) return;
    // count[u] is now the end of bucket u: a padded token of bucket u would sort in after
    // count[u] valid ones and attends the chunk of the last of them (chunk 0 if none)
    const auto chunk_of = [&](int64_t i) {
      const int64_t before = hb.count[size_t(bucket[i])];
      return before == 0 ? 0 : (before - 1) / pl.chunk;
    };
    hb.pstart.assign(size_t(pl.chunks + 1), 0);
    for (int64_t i = L; i < n; ++i) ++hb.pstart[size_t(chunk_of(i) + 1)];
    for (int64_t c = 0; c < pl.chunks; ++c) hb.pstart[size_t(c + 1)] += hb.pstart[size_t(c)];
    hb.next.assign(hb.pstart.begin(), hb.pstart.end() - 1);
    for (int64_t i = L; i < n; ++i)
      hb.perm[size_t(L + hb.next[size_t(chunk_of(i))]++)] = int32_t(i);
  }

  /// Heads run one per thread when there are at least as many (batch, head) pairs as
  /// threads (no synchronisation inside a head); otherwise one head at a time, each step
  /// parallel inside.
  static bool by_head(const Problem& p, int threads) {
    return threads > 1 && p.batch * p.heads >= threads;
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView, ConstTensorView v,
               TensorView out) override {
    run(p, q, v, out, nullptr);
  }

  // The backward (see the top of the file): the forward's buckets are constants of it.

  std::unique_ptr<SavedState> forward_train(const Problem& p, ConstTensorView q, ConstTensorView,
                                            ConstTensorView v, TensorView out) override {
    auto st = std::make_unique<ReformerSaved>();
    const size_t size = static_cast<size_t>(p.batch * p.heads * hashes_ * p.n);
    st->bucket.assign(size, 0);
    st->lse.assign(size, 0.0f);
    run(p, q, v, out, st.get());
    return st;
  }

  using Variant::backward;  // the accessor stays visible beside the pass
  void backward(const Problem& p, ConstTensorView q, ConstTensorView, ConstTensorView v,
                ConstTensorView out, ConstTensorView dout, const SavedState& saved, TensorView dq,
                TensorView dk, TensorView dv) override {
    const auto* st = dynamic_cast<const ReformerSaved*>(&saved);
    const size_t size = static_cast<size_t>(p.batch * p.heads * hashes_ * p.n);
    if (!st || st->bucket.size() != size || st->lse.size() != size)
      throw UsageError("reformer: the saved state is not from its forward_train on this problem");
    const Plan full = plan(p);
    const int64_t n = p.n, d = p.dim, heads = p.batch * p.heads, R = hashes_;
    struct Scratch {
      HeadBuffers buffers;
      GradBuffers grads;
    };
    parallel_for(
        heads,
        [&] {
          return Scratch{HeadBuffers(full, n, d), GradBuffers(full, n, d)};
        },
        [&](int64_t bh, Scratch& s) {
          const int64_t b = bh / p.heads, h = bh % p.heads, L = reformer::valid_tokens(p, b);
          // the keys are the normalised queries: the k input is unused and gets no gradient
          for (int64_t j = 0; j < n; ++j) std::fill_n(dk.row(b, h, j), d, 0.0f);
          if (L == 0) {  // zero rows: zero gradients
            for (int64_t i = 0; i < n; ++i) {
              std::fill_n(dq.row(b, h, i), d, 0.0f);
              std::fill_n(dv.row(b, h, i), d, 0.0f);
            }
            return;
          }
          const Plan pl = L == n ? full : reformer::plan(L, buckets_, hashes_, chunk_);
          backward_head(p, pl, L, q, v, out, dout, st->bucket.data() + bh * R * n,
                        st->lse.data() + bh * R * n, dq, dv, b, h, s.buffers, s.grads);
        },
        {.parallel = by_head(p, team_threads())});
  }

  double backward_flops(const Problem& p) const override {
    const Plan pl = plan(p);
    const double n = double(p.n), d = double(p.dim);
    // per round and (query, key) pair: S, dP, dQ, dK and dV (2 d each), the exponential,
    // dS and the mask (about 4); per round and row the gathered w_r dO and w_r D (2 d); per
    // row D, the round weights (4 hashes) and the projection of dK onto the query (6 d)
    const double per_head = double(pl.hashes) * ((10.0 * d + 4.0) * pairs(p) + 2.0 * n * d) +
                            n * (8.0 * d + 4.0 * double(pl.hashes));
    return double(p.batch * p.heads) * per_head;
  }

  double saved_estimate(const Problem& p) const override {
    // every head's buckets (int32) and log-sum-exps (float) of every round
    return 8.0 * double(p.batch * p.heads) * double(hashes_) * double(p.n) +
           double(sizeof(ReformerSaved));
  }

  double backward_memory_estimate(const Problem& p) const override {
    Plan pl = plan(p);
    for (int64_t L : p.key_lengths)  // as in memory_estimate: plan(L) may have more buckets
      if (L > 0)
        pl.buckets = std::max(pl.buckets, reformer::plan(L, buckets_, hashes_, chunk_).buckets);
    const int threads = team_threads();
    const int copies = by_head(p, threads) ? threads : 1;
    return (HeadBuffers::bytes(pl, p.n, p.dim) + GradBuffers::bytes(pl, p.n, p.dim)) * copies +
           TaskBuffers::bytes(pl.chunk, p.dim) * threads;
  }

  /// The forward; with `keep`, every head's buckets and per-round log-sum-exps are kept.
  void run(const Problem& p, ConstTensorView q, ConstTensorView v, TensorView out,
           ReformerSaved* keep) {
    const Plan full = plan(p);
    const int64_t n = p.n, d = p.dim, heads = p.batch * p.heads;
    // phases (common/core/phase.h): "hash" is hashing and sorting (projections, buckets, counting
    // sort, gathering the sorted rows), "attend" the rest of a head's work
    parallel_for(
        heads, [&] { return HeadBuffers(full, n, d); },
        [&](int64_t bh, HeadBuffers& hb) {
          const int64_t b = bh / p.heads, h = bh % p.heads, L = reformer::valid_tokens(p, b);
          if (L == 0) {  // no keys: zero rows
            for (int64_t i = 0; i < n; ++i) std::fill_n(out.row(b, h, i), d, 0.0f);
            return;
          }
          const Plan pl = L == n ? full : reformer::plan(L, buckets_, hashes_, chunk_);
          {
            Phase ph("hash");
            hash(p, pl, q, b, h, hb);
            if (keep != nullptr)
              std::copy_n(hb.bucket.data(), pl.hashes * n,
                          keep->bucket.data() + bh * pl.hashes * n);
          }
          {
            Phase ph("attend");
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < n; ++i) {
              const float* qi = q.row(b, h, i);
              double ss = 0;
              for (int64_t x = 0; x < d; ++x) ss += double(qi[x]) * double(qi[x]);
              hb.inv_norm[size_t(i)] = ss > 0 ? float(1.0 / std::sqrt(ss)) : 0.0f;
              hb.mx[size_t(i)] = -INFINITY;
              hb.z[size_t(i)] = 0.0f;
              std::fill_n(out.row(b, h, i), d, 0.0f);
            }
          }
          for (int64_t r = 0; r < pl.hashes; ++r) {
            {
              Phase ph("hash");
              sort_round(p, pl, L, r, hb);
              gather(p, q, v, b, h, hb);
            }
            Phase ph("attend");
            attend_round(p, pl, L, v, out, b, h, hb,
                         keep != nullptr ? keep->lse.data() + (bh * pl.hashes + r) * n : nullptr);
          }
          Phase ph("attend");
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < n; ++i) {
            float* o = out.row(b, h, i);
            const float inv = 1.0f / hb.z[size_t(i)];
            for (int64_t x = 0; x < d; ++x) o[x] *= inv;
          }
        },
        {.parallel = by_head(p, team_threads())});
  }

  /// (query, key) scores of one round of one head of n tokens.
  double pairs(const Problem& p) const {
    const Plan pl = plan(p);
    const int64_t n = p.n, ch = pl.chunk, nch = pl.chunks;
    double count = 0;
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t rows = std::min(ch, n - c * ch);
      const int64_t prev = nch > 1 ? std::min(ch, n - ((c + nch - 1) % nch) * ch) : 0;
      count += double(rows) * double(rows + prev);
    }
    return count;
  }

  double flops(const Problem& p) const override {
    const Plan pl = plan(p);
    const double hashing = 2.0 * double(p.n) * double(p.dim) * double(pl.hashes * pl.cols);
    return double(p.batch * p.heads) *
           (hashing + double(pl.hashes) * 4.0 * double(p.dim) * pairs(p));
  }

  double memory_estimate(const Problem& p) const override {
    Plan pl = plan(p);
    // a batch element of L < n valid tokens hashes with plan(L), whose buckets may not be
    // factorised yet: more rotation columns than for n
    for (int64_t L : p.key_lengths)
      if (L > 0) pl.cols = std::max(pl.cols, reformer::plan(L, buckets_, hashes_, chunk_).cols);
    const int threads = team_threads();
    const double per_thread = double(TileAttention::bytes(pl.chunk, pl.chunk, p.dim)) +
                              4.0 * double(pl.chunk) * double(p.dim + 1) +
                              4.0 * double(kHashRows * pl.hashes * pl.cols);
    const double rot = 8.0 * double(p.dim) * double(pl.hashes * pl.cols);
    const int copies = by_head(p, threads) ? threads : 1;
    return (HeadBuffers::bytes(pl, p.n, p.dim) + rot) * copies + per_thread * threads;
  }

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView q,
                                              ConstTensorView) const override {
    if (q.data == nullptr) return nullptr;
    const Plan full = plan(p);
    const int64_t n = p.n;
    HeadBuffers hb(full, n, p.dim);
    auto pat = std::make_unique<GroupPattern>(p, /*self_rule=*/true);
    std::vector<int32_t> keys;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t L = reformer::valid_tokens(p, b);
      const Plan pl = L == n || L == 0 ? full : reformer::plan(L, buckets_, hashes_, chunk_);
      const int64_t ch = pl.chunk, nch = pl.chunks;
      for (int64_t h = 0; h < p.heads; ++h) {
        pat->begin_head();
        if (L > 0) {
          hash(p, pl, q, b, h, hb);
          for (int64_t r = 0; r < pl.hashes; ++r) {
            sort_round(p, pl, L, r, hb);
            for (int64_t c = 0; c < nch; ++c) {
              const int64_t s0 = c * ch, rows = std::min(ch, L - s0);
              keys.assign(hb.perm.begin() + s0, hb.perm.begin() + s0 + rows);
              if (nch > 1) {
                const int64_t pc = (c + nch - 1) % nch, p0 = pc * ch;
                keys.insert(keys.end(), hb.perm.begin() + p0,
                            hb.perm.begin() + p0 + std::min(ch, L - p0));
              }
              const int32_t g = pat->add_group(keys.data(), int64_t(keys.size()));
              for (int64_t s = s0; s < s0 + rows; ++s) pat->add_membership(hb.perm[size_t(s)], g);
              if (L < n)  // the padded queries attending this chunk
                for (int64_t s = L + hb.pstart[size_t(c)]; s < L + hb.pstart[size_t(c + 1)]; ++s)
                  pat->add_membership(hb.perm[size_t(s)], g);
            }
          }
        }
        pat->finish_head();
      }
    }
    return pat;
  }

 private:
  /// Sorted copies of q, the unit keys and v for the current round's order.
  void gather(const Problem& p, ConstTensorView q, ConstTensorView v, int64_t b, int64_t h,
              HeadBuffers& hb) const {
    const int64_t n = p.n, d = p.dim;
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < n; ++s) {
      // the rows come in bucket order, at random positions: fetch some ahead
      if (s + 8 < n) {
        const int64_t ahead = hb.perm[size_t(s + 8)];
        for (int64_t o = 0; o < d; o += 16) {
          __builtin_prefetch(q.row(b, h, ahead) + o);
          __builtin_prefetch(v.row(b, h, ahead) + o);
        }
      }
      const int64_t i = hb.perm[size_t(s)];
      const float* qi = q.row(b, h, i);
      const float* vi = v.row(b, h, i);
      float* qd = hb.qs.data() + s * d;
      float* kd = hb.ks.data() + s * d;
      float* vd = hb.vs.data() + s * d;
      const float in = hb.inv_norm[size_t(i)];
      for (int64_t x = 0; x < d; ++x) {
        qd[x] = qi[x];
        kd[x] = qi[x] * in;
        vd[x] = vi[x];
      }
    }
  }

  /// One round: every chunk attends itself and the previous chunk; the result is folded into
  /// out (running max mx and sum z of the round weights per token).
  void attend_round(const Problem& p, const Plan& pl, int64_t L, ConstTensorView v, TensorView out,
                    int64_t b, int64_t h, HeadBuffers& hb, float* keep_lse) const {
    const int64_t n = p.n, d = p.dim, ch = pl.chunk, nch = pl.chunks;
    // the tiles: each chunk's own rows, then the padded queries of each chunk, ch at a time
    hb.items.clear();
    for (int64_t c = 0; c < nch; ++c) hb.items.push_back({c, c * ch, std::min(ch, L - c * ch)});
    if (L < n)
      for (int64_t c = 0; c < nch; ++c)
        for (int64_t s = L + hb.pstart[size_t(c)], e = L + hb.pstart[size_t(c + 1)]; s < e; s += ch)
          hb.items.push_back({c, s, std::min(ch, e - s)});
    const int64_t items = int64_t(hb.items.size());
    constexpr float kSelfLogit = -1e5f;  // the HF self-mask value
    OmpGuard guard;
#pragma omp parallel
    {
      std::optional<TileAttention> tile;
      std::vector<float> o, lse;
      // without a causal mask a chunk's only masked pairs are the tokens themselves: the
      // diagonal of its own block (the previous chunk holds other tokens)
      std::vector<uint8_t> off_diagonal;
      guard.run([&] {
        tile.emplace(ch, ch, d, 1.0f);
        o.resize(size_t(ch * d));
        lse.resize(size_t(ch));
        off_diagonal.assign(size_t(ch * ch), 1);
        for (int64_t t = 0; t < ch; ++t) off_diagonal[size_t(t * ch + t)] = 0;
      });
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < items; ++it)
        guard.run([&] {
          TileAttention& ta = *tile;
          const auto [c, s0, rows] = hb.items[size_t(it)];
          // padded queries are no keys and see every valid key: no mask
          const bool padded = s0 >= L;
          // again with scaled weights if the accumulator overflowed (v near FLT_MAX)
          for (float pscale = 1.0f;; pscale = kernels::safe_pscale(2 * ch)) {
            ta.begin(hb.qs.data() + s0 * d, d, rows, pscale);
            const int64_t blocks[2] = {nch > 1 ? (c + nch - 1) % nch : -1, c};
            for (int64_t kb : blocks) {
              if (kb < 0) continue;
              const int64_t j0 = kb * ch, cols = std::min(ch, L - j0);
              const uint8_t* mask = nullptr;
              if (!padded && p.causal) {
                uint8_t* mk = ta.mask();
                causal_mask(p, hb.perm.data() + s0, rows, hb.perm.data() + j0, cols, mk);
                mask = mk;
              } else if (!padded && kb == c) {
                // rows x cols corner of the off-diagonal tile (cols == rows here)
                uint8_t* mk = ta.mask();
                for (int64_t rr = 0; rr < rows; ++rr)
                  std::copy_n(off_diagonal.data() + rr * ch, cols, mk + rr * cols);
                mask = mk;
              }
              ta.attend(hb.ks.data() + j0 * d, d, hb.vs.data() + j0 * d, d, cols, mask);
            }
            if (ta.finish(o.data(), d, lse.data()) || pscale != 1.0f) break;
          }
          for (int64_t rr = 0; rr < rows; ++rr) {
            if (rr + 4 < rows)
              for (int64_t o = 0; o < d; o += 16)
                __builtin_prefetch(out.row(b, h, hb.perm[size_t(s0 + rr + 4)]) + o, 1);
            const int32_t i = hb.perm[size_t(s0 + rr)];
            const float* orow = o.data() + rr * d;
            float l = lse[size_t(rr)];
            if (l == -INFINITY) {  // nothing but itself: its own value, at logit -1e5
              orow = v.row(b, h, i);
              l = kSelfLogit;
            }
            if (keep_lse != nullptr) keep_lse[i] = l;
            float& mx = hb.mx[size_t(i)];
            float& z = hb.z[size_t(i)];
            const float nm = std::max(mx, l);
            const float a = std::exp(mx - nm), w = std::exp(l - nm);
            float* dst = out.row(b, h, i);
            for (int64_t x = 0; x < d; ++x) dst[x] = dst[x] * a + orow[x] * w;
            z = z * a + w;
            mx = nm;
          }
        });
    }
    guard.rethrow();
  }

  /// mask[r * cols + c] = 1 iff key token kpos[c] is another token than qpos[r] and visible
  /// to it under the causal mask.
  static void causal_mask(const Problem& p, const int32_t* qpos, int64_t rows, const int32_t* kpos,
                          int64_t cols, uint8_t* mask) {
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t i = qpos[r], vis = int32_t(p.visible(i));
      uint8_t* m = mask + r * cols;
      int64_t c = 0;
#ifdef __AVX512F__
      const __m512i vi = _mm512_set1_epi32(i), vv = _mm512_set1_epi32(vis);
      for (; c + 16 <= cols; c += 16) {
        const __m512i k = _mm512_loadu_si512(kpos + c);
        const __mmask16 keep = _mm512_cmpneq_epi32_mask(k, vi) & _mm512_cmplt_epi32_mask(k, vv);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(m + c), _mm_maskz_set1_epi8(keep, 1));
      }
#endif
      for (; c < cols; ++c) m[c] = uint8_t(kpos[c] != i && kpos[c] < vis);
    }
  }

  /// The gradients of head (b, h) on the forward's buckets (bucket: hashes x n) and
  /// per-round log-sum-exps (lse: hashes x n); dq and dv rows are overwritten.
  void backward_head(const Problem& p, const Plan& pl, int64_t L, ConstTensorView q,
                     ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                     const int32_t* bucket, const float* lse, TensorView dq, TensorView dv,
                     int64_t b, int64_t h, HeadBuffers& hb, GradBuffers& gb) const {
    const int64_t n = p.n, d = p.dim, R = pl.hashes;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float* qi = q.row(b, h, i);
      const float *g = dout.row(b, h, i), *o = out.row(b, h, i);
      double ss = 0;
      float D = 0.0f;
      for (int64_t x = 0; x < d; ++x) {
        ss += double(qi[x]) * double(qi[x]);
        D += g[x] * o[x];
      }
      hb.inv_norm[size_t(i)] = ss > 0 ? float(1.0 / std::sqrt(ss)) : 0.0f;
      gb.dfin[size_t(i)] = D;
      // w_ir = softmax_r(lse_ir), as the forward combined the rounds
      float mx = -INFINITY, z = 0.0f;
      for (int64_t r = 0; r < R; ++r) mx = std::max(mx, lse[r * n + i]);
      for (int64_t r = 0; r < R; ++r)
        z += gb.weight[size_t(r * n + i)] = std::exp(lse[r * n + i] - mx);
      for (int64_t r = 0; r < R; ++r) gb.weight[size_t(r * n + i)] /= z;
      std::fill_n(dq.row(b, h, i), d, 0.0f);
      std::fill_n(dv.row(b, h, i), d, 0.0f);
      std::fill_n(gb.dk_sum.data() + i * d, d, 0.0f);
    }
    for (int64_t r = 0; r < R; ++r) {
      sort_round(p, pl, L, bucket + r * n, hb);
      gather(p, q, v, b, h, hb);
      const float* w = gb.weight.data() + r * n;
#pragma omp parallel for schedule(static)
      for (int64_t s = 0; s < n; ++s) {
        const int64_t i = hb.perm[size_t(s)];
        const float* g = dout.row(b, h, i);
        float* gd = gb.gs.data() + s * d;
        const float wi = w[i];
        for (int64_t x = 0; x < d; ++x) gd[x] = wi * g[x];
        gb.dw[size_t(s)] = wi * gb.dfin[size_t(i)];
      }
      backward_round(p, pl, L, lse + r * n, b, hb, gb);
      // back to the tokens: each token has one sorted position, so rows do not collide
      const bool has_prev = pl.chunks > 1;
#pragma omp parallel for schedule(static)
      for (int64_t s = 0; s < n; ++s) {
        const int64_t i = hb.perm[size_t(s)];
        float* o = dq.row(b, h, i);
        const float* src = gb.dqs.data() + s * d;
        for (int64_t x = 0; x < d; ++x) o[x] += src[x];
        if (s >= L) continue;  // padded tokens are no keys
        float* ok = gb.dk_sum.data() + i * d;
        float* ov = dv.row(b, h, i);
        const float *ko = gb.dk_own.data() + s * d, *vo = gb.dv_own.data() + s * d;
        for (int64_t x = 0; x < d; ++x) ok[x] += ko[x], ov[x] += vo[x];
        if (!has_prev) continue;
        const float *kp = gb.dk_prev.data() + s * d, *vp = gb.dv_prev.data() + s * d;
        for (int64_t x = 0; x < d; ++x) ok[x] += kp[x], ov[x] += vp[x];
      }
    }
    // through k_j = q_j / |q_j|: dq_j += (I - k_j k_j^T) dk_j / |q_j| (0 for a zero q_j)
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < L; ++j) {
      const float in = hb.inv_norm[size_t(j)];
      if (in == 0.0f) continue;
      const float* qj = q.row(b, h, j);
      const float* g = gb.dk_sum.data() + j * d;
      float kg = 0.0f;
      for (int64_t x = 0; x < d; ++x) kg += qj[x] * in * g[x];
      float* o = dq.row(b, h, j);
      for (int64_t x = 0; x < d; ++x) o[x] += (g[x] - qj[x] * in * kg) * in;
    }
  }

  /// One round of the backward on the sorted rows (hb.qs, ks, vs, gb.gs, dw): per chunk c,
  /// its rows and the padded rows attending it against the window (previous chunk, then
  /// chunk c), P = exp(S - lse) under the forward's mask, dP = G V^T, dS = P o (dP - w D),
  /// dQ = dS K (gb.dqs), dK = dS^T Q and dV = P^T G (+ G for rows that saw no key: their own
  /// value) into gb.dk_own / dv_own for chunk c's keys and gb.dk_prev / dv_prev for the
  /// previous chunk's. Each chunk writes its own blocks only: the chunks run in parallel.
  void backward_round(const Problem& p, const Plan& pl, int64_t L, const float* lse, int64_t b,
                      HeadBuffers& hb, GradBuffers& gb) const {
    const int64_t n = p.n, d = p.dim, ch = pl.chunk, nch = pl.chunks;
    parallel_for(
        nch, [&] { return TaskBuffers(ch, d); },
        [&](int64_t c, TaskBuffers& t) {
          const int64_t own0 = c * ch, cols_c = std::min(ch, L - own0);
          const int64_t prev = nch > 1 ? (c + nch - 1) % nch : -1;
          const int64_t cols_p = prev >= 0 ? std::min(ch, L - prev * ch) : 0, cw = cols_p + cols_c;
          const float *kw, *vw;
          const int32_t* wperm;
          if (prev < 0 || prev == c - 1) {  // contiguous in sorted order (chunk c - 1 is full)
            const int64_t w0 = prev < 0 ? own0 : prev * ch;
            kw = hb.ks.data() + w0 * d, vw = hb.vs.data() + w0 * d;
            wperm = hb.perm.data() + w0;
          } else {  // chunk 0 and the last chunk
            for (auto [src, dst, rows] : {std::array<int64_t, 3>{prev * ch, 0, cols_p},
                                          std::array<int64_t, 3>{own0, cols_p, cols_c}}) {
              std::copy_n(hb.ks.data() + src * d, rows * d, t.kw.data() + dst * d);
              std::copy_n(hb.vs.data() + src * d, rows * d, t.vw.data() + dst * d);
              std::copy_n(hb.perm.data() + src, rows, t.wperm.data() + dst);
            }
            kw = t.kw.data(), vw = t.vw.data(), wperm = t.wperm.data();
          }
          t.self_rows.clear();
          // the query rows: chunk c's own, then the padded ones attending it, ch at a time
          bool first = true;
          const int64_t pad0 = L < n ? L + hb.pstart[size_t(c)] : n;
          const int64_t pad1 = L < n ? L + hb.pstart[size_t(c + 1)] : n;
          for (int64_t s0 = own0; s0 < pad1;) {
            const bool padded = s0 >= L;
            const int64_t rows = padded ? std::min(ch, pad1 - s0) : cols_c;
            const float *qt = hb.qs.data() + s0 * d, *gt = gb.gs.data() + s0 * d;
            float *sp = t.sp.data(), *dsp = t.dsp.data();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cw), int(d), 1.0f,
                        qt, int(d), kw, int(d), 0.0f, sp, int(cw));
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cw), int(d), 1.0f,
                        gt, int(d), vw, int(d), 0.0f, dsp, int(cw));
            for (int64_t rr = 0; rr < rows; ++rr) {
              const int32_t i = hb.perm[size_t(s0 + rr)];
              const float l = lse[i], dwi = gb.dw[size_t(s0 + rr)];
              float *srow = sp + rr * cw, *drow = dsp + rr * cw;
              if (padded) {  // a padded row sees every key of its window
                for (int64_t e = 0; e < cw; ++e) {
                  const float pe = std::exp(srow[e] - l);
                  srow[e] = pe;
                  drow[e] = pe * (drow[e] - dwi);
                }
                continue;
              }
              // the forward's mask: another token, visible under the causal rule
              const int64_t vis = p.visible(b, i);
              bool any = false;
              for (int64_t e = 0; e < cw; ++e) {
                const int32_t j = wperm[e];
                const bool seen = j != i && j < vis;
                const float pe = seen ? std::exp(srow[e] - l) : 0.0f;
                any |= seen;
                srow[e] = pe;
                drow[e] = pe * (drow[e] - dwi);
              }
              // nothing else visible: its own value at the constant logit -1e5
              if (!any) t.self_rows.push_back(s0 + rr);
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(cw), 1.0f,
                        dsp, int(cw), kw, int(d), 0.0f, gb.dqs.data() + s0 * d, int(d));
            const float beta = first ? 0.0f : 1.0f;
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cw), int(d), int(rows), 1.0f,
                        dsp, int(cw), qt, int(d), beta, t.dkw.data(), int(d));
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cw), int(d), int(rows), 1.0f,
                        sp, int(cw), gt, int(d), beta, t.dvw.data(), int(d));
            first = false;
            s0 = padded ? s0 + rows : pad0;
          }
          for (int64_t s : t.self_rows) {
            float* o = t.dvw.data() + (cols_p + s - own0) * d;
            const float* g = gb.gs.data() + s * d;
            for (int64_t x = 0; x < d; ++x) o[x] += g[x];
          }
          std::copy_n(t.dkw.data() + cols_p * d, cols_c * d, gb.dk_own.data() + own0 * d);
          std::copy_n(t.dvw.data() + cols_p * d, cols_c * d, gb.dv_own.data() + own0 * d);
          if (cols_p > 0) {
            std::copy_n(t.dkw.data(), cols_p * d, gb.dk_prev.data() + prev * ch * d);
            std::copy_n(t.dvw.data(), cols_p * d, gb.dv_prev.data() + prev * ch * d);
          }
        });
  }

  std::vector<int64_t> buckets_;
  int64_t hashes_, chunk_;
};

ATTNBENCH_REGISTER_VARIANT(
    reformer,
    VariantInfo{
        .name = "reformer",
        .summary = "LSH attention, shared QK: hash rounds, sort, chunk + previous chunk, "
                   "rounds combined by log-sum-exp (Reformer)",
        .complexity = "time O(hashes n (chunk + C) d + hashes n), memory O(n (d + hashes C))",
        .family = "clustering",
        .display = "Reformer (LSH)",
        .paper = "Kitaev et al. 2020 (arXiv:2001.04451)",
        .look = {.color = "#6b6ecf", .marker = "h"},
        .params = {ParamSpec::IntList(
                       "buckets", "none", 1, int64_t(1) << 24,
                       "buckets per round, or factors 'B1+B2' hashed separately "
                       "(each 1 or even); none: about 2n/chunk, factorised when large"),
                   ParamSpec::Int("hashes", 4, 1, 64, "hash rounds"),
                   ParamSpec::Int("chunk", 64, 1, 4096,
                                  "chunk length of the sorted sequence (attends itself and the "
                                  "previous chunk)")},
        .caps = {.causal = true,
                 .cross = false,
                 .exact = false,
                 .linear_score = false,
                 .key_padding = true},
        .make =
            [](const ParamValues& pv) {
              return std::make_unique<Reformer>(pv.get_int_list("buckets"), pv.get_int("hashes"),
                                                pv.get_int("chunk"));
            },
        .oracle =
            [](const Variant& var, const Problem& p, ConstTensorView q, ConstTensorView,
               ConstTensorView v) {
              const ParamValues& pv = var.params();
              return reformer::oracle(p, pv.get_int_list("buckets"), pv.get_int("hashes"),
                                      pv.get_int("chunk"), q, v);
            },
        // A round is softmax attention over w = min(2 chunk, n) keys with logits q_i . q_j / |q_j|
        // of the default model's size (the unit key adds a rounding). The rounds are then combined
        // with weights exp(lse_r - max) in float32: a log-sum-exp of size L = S sqrt(2 ln w) + ln w
        // (the largest of w logits of size S, plus the log of the sum) carries an absolute error
        // of about u L, which exp turns into a relative error of the weights, and the weighted sum
        // runs over `hashes` rounds: float32_error(1, L, hashes, 4) on top of the round's own.
        .tolerance =
            [](const Variant& var, const Problem& p, const Workload& wl) {
              const ParamValues& pv = var.params();
              const double w = double(std::min(2 * pv.get_int("chunk"), p.n)), S = logit_size(wl);
              const double L = S * std::sqrt(2 * std::log(w)) + std::log(w);
              return kErrorMargin * (float32_error(double(p.dim), S, w, 5) +
                                     float32_error(1, L, double(pv.get_int("hashes")), 4));
            }});

}  // namespace
}  // namespace attnbench
