#include "common/engines/block_sparse.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/threads.h"
#include "common/kernels/amx_kernels.h"
#include "common/kernels/attention_kernels.h"
#include "common/kernels/bf16.h"
#include "common/kernels/softmax.h"
#include "common/patterns/mask_bias.h"

namespace attnbench {
namespace {

/// Key blocks on the amx kernel start at a multiple of this many keys (its packed V^T chunks).
constexpr int64_t kAmxKeyAlign = 32;

/// Key blocks a thread's block list can hold without growing: a query block lists each key
/// block at most once.
int64_t max_key_blocks(const Problem& p, int64_t block) { return (p.keys() + block - 1) / block; }

using kernels::ScoreHook;

/// The additive score's projections, formed once per call (the score-tile hook reads them);
/// none for the dot-product scores.
std::optional<AdditiveProjections> additive_projections(const Problem& p, ConstTensorView q,
                                                        ConstTensorView k) {
  if (p.score != Score::additive) return std::nullopt;
  return std::optional<AdditiveProjections>(std::in_place, p, q, k);
}

/// The factor of the raw scores in the softmax: 1/sqrt(d) for q . k, 1 for the additive
/// score (its logits are the scores).
float logit_scale(const Problem& p) {
  return p.score == Score::additive ? 1.0f : p.softmax_scale();
}

/// Writes the log-sum-exp of the `rows` rows of a finished tile (rows i0 ..) of head (b, h):
/// mx[r] is the row's running max in raw score units, l[r] its sum of exp((s - mx) scale)
/// times pscale (the overflow retry's factor, 1 otherwise).
template <class Vec>
void write_lse(const LseView* lse, int64_t b, int64_t h, int64_t i0, int64_t rows, const Vec& mx,
               const Vec& l, float scale, float pscale) {
  if (!lse) return;
  for (int64_t r = 0; r < rows; ++r) {
    const float lr = l[r], m = mx[r];
    float& dst = lse->at(b, h, i0 + r);
    const bool split = lse->max != nullptr;  // max and log-sum apart (LseView::max)
    if (split) lse->max_at(b, h, i0 + r) = lr > 0 && !std::isnan(m) ? m : 0.0f;
    if (std::isnan(m) || std::isnan(lr))
      dst = NAN;
    else
      dst = lr > 0 ? float((split ? 0.0 : double(m) * scale) + std::log(double(lr) / pscale))
                   : -INFINITY;
  }
}

/// Query rows and keys of one thread's tiles: block_q and block_k clipped to the problem (a
/// tile larger than n or m is never filled).
int64_t tile_rows(const Problem& p, int64_t block_q) { return std::min(block_q, p.n); }
int64_t tile_cols(const Problem& p, int64_t block_k) { return std::min(block_k, p.keys()); }

/// The key blocks one thread's tasks walk. kDense: every block of bk keys up to the last key
/// the tile's last row sees, and no pattern (pat is null). Otherwise the blocks pat lists
/// (bk = pat->block()), a partial one masked element by element into `mask` (rows x cols
/// bytes). With an attention mask, every block gets its element mask (what the pattern keeps
/// and the attention mask does not set to -inf) and its bias tile (rows x cols floats, the
/// mask's finite values in raw score units), and a block the mask hides wholly is skipped.
template <bool kDense>
class KeyWalk {
 public:
  /// One per thread (the block list is reserved for every key block, so it never grows).
  /// mask and bias: the thread's tiles (mask null in the dense case without attention mask,
  /// bias null without attention mask).
  KeyWalk(const Problem& p, int64_t bk, const SparsePattern* pat, uint8_t* mask, float* bias)
      : bk_(bk),
        pat_(pat),
        am_(p.attn_mask.get()),
        root_(1.0f / logit_scale(p)),
        mask_(mask),
        bias_(bias) {
    if constexpr (!kDense) blocks_.reserve(size_t(max_key_blocks(p, bk)));
  }

  /// Starts the task of query tile qb (rows i0 .. i0 + rows - 1) of head (b, h), whose rows see
  /// no key at or past kend. Returns the number of key blocks to walk.
  int64_t start(int64_t b, int64_t h, int64_t qb, int64_t i0, int64_t rows, int64_t kend) {
    b_ = b, h_ = h, i0_ = i0, rows_ = rows, kend_ = kend;
    if constexpr (kDense) return (kend + bk_ - 1) / bk_;
    pat_->key_blocks(b, h, qb, blocks_);
    return int64_t(blocks_.size());
  }

  /// Key block i of the task: its first key j0, its keys cols (none past kend: they are hidden
  /// from every row, not computed), its element mask (null: none) and bias (null: none).
  /// False if the block lies wholly past kend (past the causal diagonal, the key padding or
  /// m) or the attention mask hides all of it.
  bool block(int64_t i, int64_t& j0, int64_t& cols, const uint8_t*& mask,
             const float*& bias) const {
    bool partial = false;
    if constexpr (kDense) {
      j0 = i * bk_;
    } else {
      j0 = blocks_[size_t(i)].index * bk_;
      if (j0 >= kend_) {
        mask = nullptr, bias = nullptr;
        return false;
      }
      partial = blocks_[size_t(i)].partial;
    }
    return pair(b_, h_, i0_, rows_, kend_, j0, partial, cols, mask, bias);
  }

  /// The key block from key j0 (j0 < kend) for the query tile of rows i0 .. i0 + rows - 1 of
  /// head (b, h) whose rows see no key at or past kend, `partial` as the pattern lists it:
  /// block() for a pair named directly, without start() (the backward's key-block tasks walk
  /// the pairs from the key side).
  bool pair(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t kend, int64_t j0, bool partial,
            int64_t& cols, const uint8_t*& mask, const float*& bias) const {
    mask = nullptr;
    bias = nullptr;
    cols = std::min(bk_, kend - j0);
    if constexpr (!kDense) {
      if (partial) {
        pat_->block_mask(b, h, i0, rows, j0, cols, mask_);
        mask = mask_;
      }
    }
    if (am_) {
      if (!mask) std::fill(mask_, mask_ + rows * cols, uint8_t(1));
      bool any = false;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float x = am_->at(b, h, i0 + r, j0 + c);
          const bool keep = mask_[r * cols + c] && x != -INFINITY;
          mask_[r * cols + c] = uint8_t(keep);
          bias_[r * cols + c] = keep ? mask_bias_raw(x, root_) : 0.0f;
          any |= keep;
        }
      if (!any) return false;
      mask = mask_;
      bias = bias_;
    }
    return true;
  }

 private:
  int64_t bk_;
  const SparsePattern* pat_;
  const AttnMask* am_;
  float root_;  // 1 / the softmax scale (sqrt(d), or 1 for the additive score): the mask's bias in
                // raw score units
  uint8_t* mask_;
  float* bias_;
  std::vector<KeyBlock> blocks_;
  int64_t b_ = 0, h_ = 0, i0_ = 0, rows_ = 0, kend_ = 0;
};

#ifdef __AVX512F__
namespace fast {

using namespace kernels;

Tiles tiles(const Problem& p, int64_t bq, int64_t bk) {
  return Tiles(tile_rows(p, bq), tile_cols(p, bk), p.dim);
}

/// One thread's working block: the kernels' tiles (tile_bytes), then (pattern case, or an
/// attention mask) the element-mask tile, then (attention mask) the bias tile.
int64_t thread_bytes(int64_t tile_bytes, int64_t bq, int64_t bk, bool dense, bool biased) {
  return tile_bytes + (dense && !biased ? 0 : mask_tile_bytes(bq, bk)) +
         (biased ? round_up(bq * bk * int64_t(sizeof(float)), 64) : 0);
}

/// The float32 passes of attention_kernels.h (under bf16, the f32 kernel: P rounded to bf16
/// before P V, the operands holding bf16 values).
class F32Kernel {
 public:
  using Work = Workspace;
  F32Kernel(const Problem& p, int64_t bq, int64_t bk)
      : tl_(fast::tiles(p, bq, bk)), round_p_(p.dtype == DType::bf16) {}
  const Tiles& tiles() const { return tl_; }
  int64_t bytes() const { return tl_.bytes(); }
  void enter() const {}
  void leave() const {}
  Work work(float* buf) const { return Workspace(tl_, buf); }
  void begin(const Work& w, const float* q0, int64_t ldq, int64_t rows) const {
    begin_tile(tl_, w, q0, ldq, rows);
  }
  void block(const Work& w, int64_t rows, ConstTensorView k, ConstTensorView v, int64_t b,
             int64_t h, int64_t j0, int64_t cols, float scale, int64_t causal_first,
             const uint8_t* mask, float pscale, const ScoreHook* hook, const float* bias) const {
    attend_block(tl_, w, rows, k.row(b, h, j0), k.stride_row, v.row(b, h, j0), v.stride_row, cols,
                 scale, causal_first, mask, pscale, hook, bias, round_p_);
  }
  bool finish(const Work& w, int64_t rows, float* out0, int64_t ldo) const {
    return finish_tile(tl_, w, rows, out0, ldo);
  }

 private:
  Tiles tl_;
  bool round_p_;
};

#ifdef ATTNBENCH_AMX_KERNELS
/// The bf16 passes on AMX tiles (amx_kernels.h), with K and V of every key/value head packed
/// as bf16 once per call (K rows of dk, V^T by 32-key chunks; keys padded to a multiple of
/// 32); grouped query heads share their group's.
class AmxKernel {
 public:
  using Work = amx::Workspace;
  AmxKernel(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t bq, int64_t bk)
      : tl_(tile_rows(p, bq), tile_cols(p, bk), p.dim),
        batch_(p.batch),
        kv_heads_(p.kv_head_count()),
        group_(p.kv_group()),
        keys_(padded_keys(p)),
        packed_(packed_bytes(p)) {
    uint16_t* kp = packed_k();
    uint16_t* vp = packed_v();
    const int64_t m = p.keys();
    OmpGuard guard;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bg = 0; bg < p.batch * kv_heads_; ++bg)
      guard.run([&] {
        // the first query head of the group reads key/value head g
        const int64_t b = bg / kv_heads_, h = bg % kv_heads_ * p.kv_group();
        amx::pack_keys(k.row(b, h, 0), k.stride_row, m, p.dim, tl_.dk, keys_,
                       kp + bg * keys_ * tl_.dk);
        amx::pack_values(v.row(b, h, 0), v.stride_row, m, p.dim, tl_.dv, keys_,
                         vp + bg * keys_ * tl_.dv);
      });
    guard.rethrow();
  }
  /// Bytes of the packed K and V (bf16) of every key/value head.
  static int64_t packed_bytes(const Problem& p) {
    const int64_t dp = round_up(p.dim, amx::kDepth);
    return 2 * p.batch * p.kv_head_count() * padded_keys(p) * dp * int64_t(sizeof(uint16_t));
  }
  static int64_t tile_bytes(const Problem& p, int64_t bq, int64_t bk) {
    return amx::Tiles(tile_rows(p, bq), tile_cols(p, bk), p.dim).bytes();
  }
  const amx::Tiles& tiles() const { return tl_; }
  int64_t bytes() const { return tl_.bytes(); }
  void enter() const { amx::configure(); }
  void leave() const { amx::release(); }
  Work work(float* buf) const { return Work(tl_, buf); }
  void begin(const Work& w, const float* q0, int64_t ldq, int64_t rows) const {
    amx::begin_tile(tl_, w, q0, ldq, rows);
  }
  void block(const Work& w, int64_t rows, ConstTensorView, ConstTensorView, int64_t b, int64_t h,
             int64_t j0, int64_t cols, float scale, int64_t causal_first, const uint8_t* mask,
             float pscale, const ScoreHook*, const float* bias) const {
    const int64_t bg = b * kv_heads_ + h / group_;
    amx::attend_block(tl_, w, rows, packed_k() + (bg * keys_ + j0) * tl_.dk,
                      packed_v() + (bg * keys_ + j0) * tl_.dv, cols, scale, causal_first, mask,
                      pscale, bias);
  }
  bool finish(const Work& w, int64_t rows, float* out0, int64_t ldo) const {
    return amx::finish_tile(tl_, w, rows, out0, ldo);
  }

 private:
  static int64_t padded_keys(const Problem& p) { return round_up(p.keys(), amx::kDepth); }
  uint16_t* packed_k() const { return reinterpret_cast<uint16_t*>(packed_.bytes()); }
  uint16_t* packed_v() const { return packed_k() + batch_ * kv_heads_ * keys_ * tl_.dk; }

  amx::Tiles tl_;
  int64_t batch_, kv_heads_, group_, keys_;
  AlignedBuffer packed_;
};
#endif

template <bool kDense, class Kernel>
void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
         int64_t bq, int64_t bk, const SparsePattern* pat, const LseView* lse,
         const Kernel& kernel) {
  const int64_t tbq = kernel.tiles().bq, tbk = kernel.tiles().bk;
  const int64_t n = p.n, qblocks = (n + bq - 1) / bq, tasks = p.batch * p.heads * qblocks;
  const std::optional<AdditiveProjections> add = additive_projections(p, q, k);
  const float scale = logit_scale(p) * kLog2e;  // applied in pass 3: base-2 weights

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles (and mask and block list), allocated once per call
    std::optional<AlignedBuffer> buf;
    std::optional<KeyWalk<kDense>> walk;
    bool entered = false;
    guard.run([&] {
      const bool biased = p.attn_mask != nullptr;
      buf.emplace(thread_bytes(kernel.bytes(), tbq, tbk, kDense, biased));
      uint8_t* mask = buf->bytes() + kernel.bytes();
      float* bias = biased ? reinterpret_cast<float*>(mask + mask_tile_bytes(tbq, tbk)) : nullptr;
      walk.emplace(p, bk, pat, mask, bias);
      kernel.enter();
      entered = true;
    });

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      // try/catch in place rather than guard.run([&] {...}): the task body inlined in a
      // lambda measured about 5% slower on `local`
      if (guard.failed()) continue;
      try {
        const typename Kernel::Work w = kernel.work(buf->floats());
        // within a head, the last query tiles first: under a causal mask they see the most keys
        const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bq;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
        // keys visible to some row of the tile (the last row sees the most)
        const int64_t kend = p.visible(b, i0 + rows - 1);
        const int64_t nb = walk->start(b, h, qb, i0, rows, kend);
        // Pattern case: Q and out are touched once per task, fetch this task's output tile and
        // the Q tiles of the next query tiles of this head (the next tasks, of this thread or
        // another) into L2 while this one computes, a share of the rows before each key block
        // (all at once stalls on the miss buffers). The dense case, whose tiles stream every
        // key block, runs without these prefetches.
        constexpr bool kPrefetch = !kDense;
        const int64_t ahead = std::min<int64_t>(2, qb);
        int64_t fetched = 0;  // rows of those tiles prefetched so far
        auto prefetch_upto = [&](int64_t upto) {
          prefetch_rows(out.row(b, h, i0 + fetched), upto - fetched, out.stride_row, p.dim, true);
          for (int64_t a = 1; a <= ahead; ++a)
            prefetch_rows(q.row(b, h, i0 - a * bq + fetched), upto - fetched, q.stride_row, p.dim,
                          false);
          fetched = upto;
        };
        // the key blocks; again with scaled weights if acc overflowed (huge v, see
        // attention_kernels.h: rare, so the prefetches are not repeated)
        for (float pscale = 1.0f;; pscale = safe_pscale(kend)) {
          kernel.begin(w, q.row(b, h, i0), q.stride_row, rows);
          for (int64_t i = 0; i < nb; ++i) {
            if (kPrefetch && pscale == 1.0f) prefetch_upto(rows * (i + 1) / nb);
            int64_t j0, cols;
            const uint8_t* mk;
            const float* bias;
            if (!walk->block(i, j0, cols, mk, bias)) continue;
            const ScoreHook hook{add ? &*add : nullptr, b, h, i0, j0};
            kernel.block(w, rows, k, v, b, h, j0, cols, scale, causal_first(p, i0, j0), mk, pscale,
                         add ? &hook : nullptr, bias);
          }
          if (kPrefetch && pscale == 1.0f) prefetch_upto(rows);
          if (kernel.finish(w, rows, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) {
            write_lse(lse, b, h, i0, rows, w.mx, w.l, logit_scale(p), pscale);
            break;
          }
        }
      } catch (...) {
        guard.capture();
      }
    }
    if (entered) kernel.leave();
  }
  guard.rethrow();
}

}  // namespace fast
#endif  // __AVX512F__

namespace portable {

using namespace kernels::portable;

/// One thread's working bytes: the tiles, then (pattern case, or an attention mask) the
/// element-mask tile, then (attention mask) the bias tile.
[[maybe_unused]] int64_t thread_bytes(const Problem& p, int64_t bq, int64_t bk, bool dense) {
  const int64_t rows = tile_rows(p, bq), cols = tile_cols(p, bk);
  const bool biased = p.attn_mask != nullptr;
  return floats(rows, cols, p.dim) * int64_t(sizeof(float)) + (dense && !biased ? 0 : rows * cols) +
         (biased ? rows * cols * int64_t(sizeof(float)) : 0);
}

template <bool kDense>
[[maybe_unused]] void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          TensorView out, int64_t bq, int64_t bk, const SparsePattern* pat,
                          const LseView* lse) {
  const int64_t n = p.n, d = p.dim;
  const int64_t qblocks = (n + bq - 1) / bq, tasks = p.batch * p.heads * qblocks;
  const std::optional<AdditiveProjections> add = additive_projections(p, q, k);
  const float scale = logit_scale(p);
  const bool round_p = p.dtype == DType::bf16;  // P in bfloat16 for P V

  OmpGuard guard;
#pragma omp parallel
  {
    // per-thread tiles (and mask and block list), allocated once per call
    const int64_t max_rows = tile_rows(p, bq), max_cols = tile_cols(p, bk);
    std::optional<Workspace> ws;
    std::vector<uint8_t> mask;
    std::vector<float> bias;
    std::optional<KeyWalk<kDense>> walk;
    guard.run([&] {
      ws.emplace(max_rows, max_cols, d);
      if (!kDense || p.attn_mask) mask.resize(size_t(max_rows * max_cols));
      if (p.attn_mask) bias.resize(size_t(max_rows * max_cols));
      walk.emplace(p, bk, pat, mask.data(), bias.data());
    });
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t)
      guard.run([&] {
        Workspace& w = *ws;
        const int64_t bh = t / qblocks, qb = qblocks - 1 - t % qblocks, i0 = qb * bq;
        const int64_t b = bh / p.heads, h = bh % p.heads, rows = std::min(bq, n - i0);
        const int64_t kend = p.visible(b, i0 + rows - 1);
        const int64_t nb = walk->start(b, h, qb, i0, rows, kend);
        for (float pscale = 1.0f;; pscale = kernels::safe_pscale(kend)) {
          begin_tile(w, rows);
          for (int64_t i = 0; i < nb; ++i) {
            int64_t j0, cols;
            const uint8_t* mk;
            const float* bias;
            if (!walk->block(i, j0, cols, mk, bias)) continue;
            const ScoreHook hook{add ? &*add : nullptr, b, h, i0, j0};
            attend_block(w, q.row(b, h, i0), q.stride_row, rows, d, k.row(b, h, j0), k.stride_row,
                         v.row(b, h, j0), v.stride_row, cols, scale,
                         kernels::causal_first(p, i0, j0), mk, pscale, add ? &hook : nullptr, bias,
                         round_p);
          }
          if (finish_tile(w, rows, d, out.row(b, h, i0), out.stride_row) || pscale != 1.0f) {
            write_lse(lse, b, h, i0, rows, w.mx, w.l, scale, pscale);
            break;
          }
        }
      });
  }
  guard.rethrow();
}

}  // namespace portable

/// The bf16 kernel the engine runs p on (p.dtype bf16) with key blocks of bk keys: amx, or
/// f32 and why not amx. Throws UnsupportedError when ATTNBENCH_BF16_KERNEL=amx asks for amx
/// and it cannot run.
struct Bf16Choice {
  bool amx = false;
  std::string why_not;
};

Bf16Choice bf16_choice(const Problem& p, int64_t bk) {
  Bf16Choice c;
  const std::string request = bf16_kernel_request();
  if (request == "f32")
    c.why_not = fmt::format("{}=f32", kBf16KernelEnv);
  else if (!amx_usable())
    c.why_not = amx_unusable_reason();
  else if (bk % kAmxKeyAlign != 0 && p.keys() > bk)
    c.why_not = fmt::format("key blocks of {} keys (amx takes multiples of {})", bk, kAmxKeyAlign);
  else
    c.amx = true;
  if (request == "amx" && !c.amx)
    throw UnsupportedError(
        fmt::format("{}=amx, but the amx bf16 kernel cannot run: {}", kBf16KernelEnv, c.why_not));
  return c;
}

[[maybe_unused]] bool use_amx(const Problem& p, int64_t bk) {
  return p.dtype == DType::bf16 && bf16_choice(p, bk).amx;
}

template <bool kDense>
void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
         int64_t bq, int64_t bk, const SparsePattern* pat, const LseView* lse) {
#ifdef __AVX512F__
#ifdef ATTNBENCH_AMX_KERNELS
  if (use_amx(p, bk)) {
    fast::run<kDense>(p, q, k, v, out, bq, bk, pat, lse, fast::AmxKernel(p, k, v, bq, bk));
    return;
  }
#endif
  fast::run<kDense>(p, q, k, v, out, bq, bk, pat, lse, fast::F32Kernel(p, bq, bk));
#else
  portable::run<kDense>(p, q, k, v, out, bq, bk, pat, lse);
#endif
}

/// Bytes the engine allocates beyond inputs, output and the pattern, on every thread (and,
/// on the amx kernel, K and V packed as bf16 once).
double engine_memory(const Problem& p, int64_t bq, int64_t bk, bool dense) {
  const int threads = team_threads();
  double shared = 0.0;
#ifdef __AVX512F__
  const bool biased = p.attn_mask != nullptr;
  const int64_t rows = tile_rows(p, bq), cols = tile_cols(p, bk);
  double tile_bytes =
      double(fast::thread_bytes(fast::tiles(p, bq, bk).bytes(), rows, cols, dense, biased));
#ifdef ATTNBENCH_AMX_KERNELS
  if (use_amx(p, bk)) {
    tile_bytes = double(
        fast::thread_bytes(fast::AmxKernel::tile_bytes(p, bq, bk), rows, cols, dense, biased));
    shared = double(fast::AmxKernel::packed_bytes(p));
  }
#endif
#else
  const double tile_bytes = double(portable::thread_bytes(p, bq, bk, dense));
#endif
  const double list = dense ? 0.0 : double(max_key_blocks(p, bk)) * sizeof(KeyBlock);
  const double additive = p.score == Score::additive ? AdditiveProjections::bytes(p) : 0.0;
  return (tile_bytes + list) * threads + additive + shared;
}

// ----- the backward pass -----
//
// The forward keeps out and each row's log-sum-exp L_i; the backward recomputes, pair by pair
// of (query tile, key block) that the forward visits, with the same KeyWalk (causal skipping,
// key padding, the pattern's element masks, the attention mask's bias and -inf entries):
//   S = Q K^T (+ bias),  P = exp(s S - L) (0 where hidden),  dP = dO V^T,
//   dS = s P ∘ (dP - D),  D_i = sum_c dO_ic O_ic,
//   dV_blk += P^T dO,  dK_blk += dS^T Q,  dQ_tile += dS K.
// Tasks are (batch, head, key block): a task owns its key block's dK and dV rows, summed in
// the thread's tiles and written once. dQ rows are shared by the key blocks of a query tile,
// so each thread sums its dQ contributions into an accumulator of its own (thread 0 into dq
// itself), reduced at the end. Measured at B=1 H=8 n=4096 d=64 on 2 cores against a second
// pass over query tiles recomputing S, P and dS for dQ alone (7 tile products per pair
// instead of 5), the accumulators took 3.1 s against 5.9 s (causal: 1.6 s against 2.6 s, on
// a loaded machine), for (threads - 1) B H n d floats more.
// The five tile products per pair are OpenBLAS sgemm calls (single-threaded inside the
// parallel region), on every target: at B=1 H=8 n=4096 d=64 on 2 Zen 4 cores they took the
// flash backward from 598 ms (Eigen's products) to 497 ms, local (window 256) from 92 to 75 ms.
namespace bwd {

using kernels::portable::RowMat;

/// A query tile that lists a key block: the inverse of SparsePattern::key_blocks.
struct Visit {
  int32_t qb;
  int32_t partial;
};

/// For every head and key block, the query tiles whose key_blocks list it (in increasing
/// order), as one offset table and one array of visits per head.
class Visits {
 public:
  Visits(const Problem& p, const SparsePattern& pat)
      : kblocks_(max_key_blocks(p, pat.block())),
        offsets_(size_t(p.batch * p.heads * (kblocks_ + 1))),
        visits_(size_t(p.batch * p.heads)) {
    const int64_t bs = pat.block(), qblocks = (p.n + bs - 1) / bs, heads = p.batch * p.heads;
    OmpGuard guard;
#pragma omp parallel
    {
      std::vector<KeyBlock> list;
      std::vector<std::pair<int64_t, Visit>> all;  // (key block, visit) of one head
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < heads; ++bh)
        guard.run([&] {
          all.clear();
          for (int64_t qb = 0; qb < qblocks; ++qb) {
            pat.key_blocks(bh / p.heads, bh % p.heads, qb, list);
            for (const KeyBlock& kb : list)
              if (kb.index >= 0 && kb.index < kblocks_)
                all.push_back({kb.index, Visit{int32_t(qb), int32_t(kb.partial)}});
          }
          // counting sort by key block; stable, so each key block's query tiles stay in order
          int64_t* off = offsets_.data() + bh * (kblocks_ + 1);
          std::fill(off, off + kblocks_ + 1, int64_t(0));
          for (const auto& e : all) ++off[e.first + 1];
          for (int64_t i = 0; i < kblocks_; ++i) off[i + 1] += off[i];
          std::vector<Visit>& out = visits_[size_t(bh)];
          out.resize(all.size());
          std::vector<int64_t> next(off, off + kblocks_);
          for (const auto& e : all) out[size_t(next[size_t(e.first)]++)] = e.second;
        });
    }
    guard.rethrow();
  }

  /// The visits of key block kb of head bh (= b H + h).
  std::pair<const Visit*, const Visit*> of(int64_t bh, int64_t kb) const {
    const int64_t* off = offsets_.data() + bh * (kblocks_ + 1);
    const Visit* base = visits_[size_t(bh)].data();
    return {base + off[kb], base + off[kb + 1]};
  }

 private:
  int64_t kblocks_;
  std::vector<int64_t> offsets_;
  std::vector<std::vector<Visit>> visits_;
};

/// One thread's tiles: S then P and dP then dS (bq x bk), the key block's dK and dV sums
/// (bk x d), and the element-mask and bias tiles of KeyWalk.
struct Tiles {
  RowMat s, ds, dk, dv;
  std::vector<uint8_t> mask;
  std::vector<float> bias;
  Tiles(const Problem& p, int64_t bq, int64_t bk, bool masked)
      : s(bq, bk), ds(bq, bk), dk(bk, p.dim), dv(bk, p.dim) {
    if (masked || p.attn_mask) mask.resize(size_t(bq * bk));
    if (p.attn_mask) bias.resize(size_t(bq * bk));
  }
  static double bytes(const Problem& p, int64_t bq, int64_t bk, bool masked) {
    const bool am = p.attn_mask != nullptr;
    return double(2 * bq * bk + 2 * bk * p.dim) * sizeof(float) +
           double(masked || am ? bq * bk : 0) + double(am ? bq * bk * 4 : 0);
  }
};

/// The inputs of one head's rows and keys the pair products read.
struct PairArgs {
  const float *q0, *do0, *k0, *v0;  // first row of the tile (q, dO) and of the block (k, v)
  int64_t ldq, ldo, ldk, ldv;
  const float *lse, *dsum;  // the tile's rows' L_i and D_i
  float* dq0;               // the tile's dQ accumulator rows (null: no dQ), stride lddq
  int64_t lddq;
  const float* mx = nullptr;  // the rows' max if L_i is relative to it (LseView::max)
};

/// One (query tile, key block) pair: rows query rows, cols keys, d features. Row r sees the
/// keys c < causal_first + r of the block, and with a mask only those with
/// mask[r * cols + c] != 0; bias (raw score units, with a mask only) is added to the scores.
/// Adds P^T dO to w.dv, dS^T Q to w.dk (kv: both) and dS K to the dQ rows (a.dq0 not null).
inline void pair_grads(Tiles& w, const PairArgs& a, int64_t rows, int64_t cols, int64_t d,
                       float scale, int64_t causal_first, const uint8_t* mask, const float* bias,
                       bool kv) {
  const int64_t lds = w.s.cols(), ldg = w.ds.cols();
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), int(d), 1.0f, a.q0,
              int(a.ldq), a.k0, int(a.ldk), 0.0f, w.s.data(), int(lds));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), int(d), 1.0f, a.do0,
              int(a.ldo), a.v0, int(a.ldv), 0.0f, w.ds.data(), int(ldg));
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = w.s.data() + r * lds;
    float* gr = w.ds.data() + r * ldg;
    const float L = a.lse[r], D = a.dsum[r];
    // P = exp((s - M) scale - L): M = 0 when L is the whole log-sum-exp
    const float M = a.mx ? a.mx[r] : 0.0f;
    // a row that attended no key (L = -inf) contributes nothing
    const int64_t vis = L == -INFINITY ? 0 : std::clamp<int64_t>(causal_first + r, 0, cols);
    if (mask) {
      const uint8_t* mr = mask + r * cols;
      const float* br = bias ? bias + r * cols : nullptr;
      for (int64_t c = 0; c < vis; ++c) {
        const float x = (sr[c] + (br ? br[c] : 0.0f) - M) * scale - L;
        const float pr = mr[c] ? fast_exp(x) : 0.0f;
        sr[c] = pr;
        gr[c] = pr * (gr[c] - D) * scale;
      }
    } else {
      int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 sv = _mm256_set1_ps(scale), lv = _mm256_set1_ps(L), dv = _mm256_set1_ps(D),
                   mv = _mm256_set1_ps(M);
      for (; c + 8 <= vis; c += 8) {
        const __m256 pr =
            simd::avx2::exp_ps(_mm256_fmsub_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + c), mv), sv, lv));
        _mm256_storeu_ps(sr + c, pr);
        _mm256_storeu_ps(
            gr + c,
            _mm256_mul_ps(_mm256_mul_ps(pr, _mm256_sub_ps(_mm256_loadu_ps(gr + c), dv)), sv));
      }
#endif
      for (; c < vis; ++c) {
        const float pr = fast_exp((sr[c] - M) * scale - L);
        sr[c] = pr;
        gr[c] = pr * (gr[c] - D) * scale;
      }
    }
    std::fill(sr + vis, sr + cols, 0.0f);
    std::fill(gr + vis, gr + cols, 0.0f);
  }
  if (kv) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(d), int(rows), 1.0f,
                w.s.data(), int(lds), a.do0, int(a.ldo), 1.0f, w.dv.data(), int(d));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(d), int(rows), 1.0f,
                w.ds.data(), int(ldg), a.q0, int(a.ldq), 1.0f, w.dk.data(), int(d));
  }
  if (a.dq0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(cols), 1.0f,
                w.ds.data(), int(ldg), a.k0, int(a.ldk), 1.0f, a.dq0, int(a.lddq));
}

/// D_i = sum_c dO_ic O_ic of every row, [B, H, n] contiguous.
std::vector<float> row_dots(const Problem& p, ConstTensorView out, ConstTensorView dout) {
  std::vector<float> dsum(size_t(p.batch * p.heads * p.n));
  const int64_t rows = p.batch * p.heads * p.n, d = p.dim;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t bh = t / p.n, i = t % p.n, b = bh / p.heads, h = bh % p.heads;
    const float *o = out.row(b, h, i), *g = dout.row(b, h, i);
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += o[c] * g[c];
    dsum[size_t(t)] = acc;
  }
  return dsum;
}

template <bool kDense>
void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
         ConstTensorView out, ConstTensorView dout, const LseView& lse, TensorView dq,
         TensorView dk, TensorView dv, int64_t bq, int64_t bk, const SparsePattern* pat) {
  const int64_t n = p.n, m = p.keys(), d = p.dim;
  const int64_t qblocks = (n + bq - 1) / bq, kblocks = (m + bk - 1) / bk;
  const int64_t heads = p.batch * p.heads, tasks = heads * kblocks;
  const float scale = p.softmax_scale();
  // a tile's rows' log-sum-exps are read as consecutive floats
  if (lse.stride_row != 1)
    throw std::logic_error("the engine's backward needs consecutive log-sum-exps (stride_row 1)");
  const std::vector<float> dsum = row_dots(p, out, dout);
  std::optional<Visits> visits;
  if constexpr (!kDense) visits.emplace(p, *pat);
  // per-thread dQ accumulators [B, H, n, d] (thread 0 sums into dq)
  std::vector<std::unique_ptr<float[]>> acc(static_cast<size_t>(team_threads()));

  OmpGuard guard;
#pragma omp parallel
  {
    const int tid = omp_get_thread_num();
    std::optional<Tiles> w;
    std::optional<KeyWalk<kDense>> walk;
    TensorView dqt = dq;  // this thread's dQ accumulator
    guard.run([&] {
      w.emplace(p, std::min(bq, n), std::min(bk, m), !kDense);
      walk.emplace(p, bk, pat, w->mask.data(), w->bias.data());
      if (tid > 0) {
        acc[size_t(tid)] = std::make_unique_for_overwrite<float[]>(size_t(heads * n * d));
        dqt = TensorView(acc[size_t(tid)].get(), p.q_shape());
        std::fill(dqt.data, dqt.data + heads * n * d, 0.0f);
      }
    });
#pragma omp for schedule(static)
    for (int64_t t = 0; t < heads * n; ++t) {
      float* r = dq.row(t / n / p.heads, t / n % p.heads, t % n);
      std::fill(r, r + d, 0.0f);
    }

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t)
      guard.run([&] {
        Tiles& tl = *w;
        const int64_t bh = t / kblocks, kb = t % kblocks, j0 = kb * bk;
        const int64_t b = bh / p.heads, h = bh % p.heads, kcols = std::min(bk, m - j0);
        tl.dk.topRows(kcols).setZero();
        tl.dv.topRows(kcols).setZero();
        auto visit = [&](int64_t qb, bool partial) {
          const int64_t i0 = qb * bq, rows = std::min(bq, n - i0);
          const int64_t kend = p.visible(b, i0 + rows - 1);
          if (j0 >= kend) return;
          int64_t cols;
          const uint8_t* mk;
          const float* bias;
          if (!walk->pair(b, h, i0, rows, kend, j0, partial, cols, mk, bias)) return;
          PairArgs a{
              q.row(b, h, i0),   dout.row(b, h, i0),        k.row(b, h, j0),   v.row(b, h, j0),
              q.stride_row,      dout.stride_row,           k.stride_row,      v.stride_row,
              &lse.at(b, h, i0), dsum.data() + bh * n + i0, dqt.row(b, h, i0), dqt.stride_row};
          if (lse.max) a.mx = &lse.max_at(b, h, i0);
          pair_grads(tl, a, rows, cols, d, scale, kernels::causal_first(p, i0, j0), mk, bias, true);
        };
        if constexpr (kDense) {
          for (int64_t qb = 0; qb < qblocks; ++qb) visit(qb, false);
        } else {
          const auto [first, last] = visits->of(bh, kb);
          for (const Visit* e = first; e != last; ++e) visit(e->qb, e->partial != 0);
        }
        for (int64_t c = 0; c < kcols; ++c) {
          float* kr = dk.row(b, h, j0 + c);
          float* vr = dv.row(b, h, j0 + c);
          for (int64_t x = 0; x < d; ++x) kr[x] = tl.dk(c, x), vr[x] = tl.dv(c, x);
        }
      });

      // dq += every other thread's accumulator
#pragma omp for schedule(static)
    for (int64_t t = 0; t < heads * n; ++t) {
      float* r = dq.row(t / n / p.heads, t / n % p.heads, t % n);
      for (size_t u = 1; u < acc.size(); ++u) {
        if (!acc[u]) continue;
        const float* x = acc[u].get() + t * d;
        for (int64_t c = 0; c < d; ++c) r[c] += x[c];
      }
    }
  }
  guard.rethrow();
}

/// Bytes run() allocates: D, per thread its tiles and (but one) a dQ accumulator, and the
/// visit lists of `listed` (query tile, key block) pairs.
double memory(const Problem& p, int64_t bq, int64_t bk, bool dense, double listed) {
  const int threads = team_threads();
  const double heads = double(p.batch * p.heads), rows = heads * double(p.n);
  const double tiles = Tiles::bytes(p, std::min(bq, p.n), std::min(bk, p.keys()), !dense);
  const double lists =
      dense ? 0.0
            : listed * sizeof(Visit) + heads * double(max_key_blocks(p, bk) + 1) * sizeof(int64_t);
  return rows * sizeof(float) + threads * tiles +
         double(threads - 1) * rows * double(p.dim) * sizeof(float) + lists;
}

}  // namespace bwd

}  // namespace

std::string bf16_engine_note(const Problem& p, int64_t block_k) {
  if (p.dtype != DType::bf16) return "";
  const Bf16Choice c = bf16_choice(p, block_k);
  if (c.amx)
    return "bf16 kernel: amx (AMX tile products of bf16 operands, float32 accumulation; "
           "float32 softmax)";
#ifdef __AVX512F__
  constexpr const char* passes = "AVX-512";
#else
  constexpr const char* passes = "portable";
#endif
  return fmt::format(
      "bf16 kernel: f32 (float32 arithmetic on bf16 operands, {} passes, float32 speed; amx not "
      "used: {})",
      passes, c.why_not);
}

void dense_attention(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                     TensorView out, int64_t block_q, int64_t block_k, const LseView* lse) {
  run<true>(p, q, k, v, out, block_q, block_k, nullptr, lse);
}

double dense_attention_memory(const Problem& p, int64_t block_q, int64_t block_k) {
  return engine_memory(p, block_q, block_k, /*dense=*/true);
}

void block_sparse_attention(const Problem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, TensorView out, const SparsePattern& pat,
                            const LseView* lse) {
  run<false>(p, q, k, v, out, pat.block(), pat.block(), &pat, lse);
}

void dense_attention_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                              ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                              const LseView& lse, TensorView dq, TensorView dk, TensorView dv,
                              int64_t block_q, int64_t block_k) {
  bwd::run<true>(p, q, k, v, out, dout, lse, dq, dk, dv, block_q, block_k, nullptr);
}

void block_sparse_attention_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                                     ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                                     const LseView& lse, const SparsePattern& pat, TensorView dq,
                                     TensorView dk, TensorView dv) {
  bwd::run<false>(p, q, k, v, out, dout, lse, dq, dk, dv, pat.block(), pat.block(), &pat);
}

double dense_attention_backward_memory(const Problem& p, int64_t block_q, int64_t block_k) {
  return bwd::memory(p, block_q, block_k, /*dense=*/true, 0.0);
}

double block_sparse_backward_memory(const Problem& p, int64_t block, double listed_blocks) {
  return bwd::memory(p, block, block, /*dense=*/false, listed_blocks);
}

double listed_blocks(const Problem& p, const SparsePattern& pat) {
  const int64_t qblocks = (p.n + pat.block() - 1) / pat.block();
  std::vector<KeyBlock> list;
  double total = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t qb = 0; qb < qblocks; ++qb) {
        pat.key_blocks(b, h, qb, list);
        total += double(list.size());
      }
  return total;
}

void merge_attention(const Problem& p, TensorView out, const LseView& lse_out,
                     ConstTensorView other, const LseView& lse_other) {
  const int64_t d = p.dim, heads = p.batch * p.heads;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / p.heads, h = bh % p.heads;
    for (int64_t i = 0; i < p.n; ++i) {
      float& la = lse_out.at(b, h, i);
      const float lb = lse_other.at(b, h, i);
      float* o = out.row(b, h, i);
      const float* x = other.row(b, h, i);
      if (std::isnan(la) || std::isnan(lb)) {
        std::fill(o, o + d, NAN);
        la = NAN;
        continue;
      }
      const float mx = std::max(la, lb);
      if (mx == -INFINITY) {  // neither part attended a key
        std::fill(o, o + d, 0.0f);
        continue;
      }
      const float wa = std::exp(la - mx), wb = std::exp(lb - mx), inv = 1.0f / (wa + wb);
      const float ca = wa * inv, cb = wb * inv;
      for (int64_t c = 0; c < d; ++c) o[c] = ca * o[c] + cb * x[c];
      la = mx + std::log(wa + wb);
    }
  }
}

double block_sparse_memory(const Problem& p, int64_t block) {
  return engine_memory(p, block, block, /*dense=*/false);
}

void PatternVariant::forward(const Problem& p, ConstTensorView q, ConstTensorView k,
                             ConstTensorView v, TensorView out) {
  auto pat = make_pattern(p, q, k);
  bf16_note_ = bf16_engine_note(p, pat->block());
  block_sparse_attention(p, q, k, v, out, *pat);
}

double PatternVariant::flops(const Problem& p) const {
  return (logit_flops(p) + 2.0 * double(p.dim)) * pattern_counts(p).scores;
}

double PatternVariant::memory_estimate(const Problem& p) const {
  auto pat = make_pattern(p, {}, {});
  return block_sparse_memory(p, pat->block()) + pat->bytes();
}

PatternVariant::Counts PatternVariant::pattern_counts(const Problem& p) const {
  auto pat = make_pattern(p, {}, {});
  Counts c;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) c.scores += pattern_scores(p, *pat, b, h);
  c.listed = listed_blocks(p, *pat);
  c.bytes = pat->bytes();
  c.block = pat->block();
  return c;
}

namespace {

/// What PatternVariant::forward_train keeps: the pattern it ran (data-dependent patterns are
/// constants of the backward) and the rows' log-sum-exps [B, H, n].
class PatternSaved final : public SavedState {
 public:
  std::unique_ptr<SparsePattern> pattern;
  std::vector<float> lse;
  std::vector<float> max;  // with an attention mask, the rows' max (LseView::max)
};

LseView lse_view(const Problem& p, std::vector<float>& lse, std::vector<float>& max) {
  return LseView{lse.data(), p.heads * p.n, p.n, 1, max.empty() ? nullptr : max.data()};
}

}  // namespace

std::unique_ptr<SavedState> PatternVariant::forward_train(const Problem& p, ConstTensorView q,
                                                          ConstTensorView k, ConstTensorView v,
                                                          TensorView out) {
  // Subclasses whose forward computes the same function by another route (strided and
  // sparse_transformer's reshapes) run the pattern through the engine here: the same output,
  // slower, with the log-sum-exps the backward needs.
  auto saved = std::make_unique<PatternSaved>();
  saved->pattern = make_pattern(p, q, k);
  saved->lse.resize(size_t(p.batch * p.heads * p.n));
  if (p.attn_mask) saved->max.resize(saved->lse.size());
  const LseView lse = lse_view(p, saved->lse, saved->max);
  block_sparse_attention(p, q, k, v, out, *saved->pattern, &lse);
  return saved;
}

void PatternVariant::backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                              ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                              const SavedState& saved, TensorView dq, TensorView dk,
                              TensorView dv) {
  const auto* st = dynamic_cast<const PatternSaved*>(&saved);
  if (!st || !st->pattern || st->lse.size() != size_t(p.batch * p.heads * p.n))
    throw UsageError(info().name +
                     ": the saved state is not from its forward_train on this problem");
  auto& mutable_st = const_cast<PatternSaved&>(*st);
  const LseView lse = lse_view(p, mutable_st.lse, mutable_st.max);
  block_sparse_attention_backward(p, q, k, v, out, dout, lse, *st->pattern, dq, dk, dv);
}

double PatternVariant::backward_flops(const Problem& p) const {
  // per computed score: S and dP (as in the forward), then dV, dK and dQ: 10 d against the
  // forward's 4 d
  return 2.5 * 4.0 * double(p.dim) * pattern_counts(p).scores;
}

double PatternVariant::saved_estimate(const Problem& p) const {
  // the rows' log-sum-exps, and with an attention mask their max too
  return double(p.batch * p.heads * p.n) * sizeof(float) * (p.attn_mask ? 2 : 1) +
         pattern_counts(p).bytes;
}

double PatternVariant::backward_memory_estimate(const Problem& p) const {
  const Counts c = pattern_counts(p);
  return block_sparse_backward_memory(p, c.block, c.listed);
}

}  // namespace attnbench
