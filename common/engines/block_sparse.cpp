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
#include "common/core/parallel_for.h"
#include "common/core/threads.h"
#include "common/engines/block_sparse_internal.h"
#include "common/kernels/amx_kernels.h"
#include "common/kernels/attention_kernels.h"
#include "common/kernels/bf16.h"
#include "common/kernels/softmax.h"
#include "common/patterns/mask_bias.h"

namespace attnbench {
namespace {

using namespace block_sparse_detail;

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
    parallel_for(p.batch * kv_heads_, [&](int64_t bg) {
      // the first query head of the group reads key/value head g
      const int64_t b = bg / kv_heads_, h = bg % kv_heads_ * p.kv_group();
      amx::pack_keys(k.row(b, h, 0), k.stride_row, m, p.dim, tl_.dk, keys_,
                     kp + bg * keys_ * tl_.dk);
      amx::pack_values(v.row(b, h, 0), v.stride_row, m, p.dim, tl_.dv, keys_,
                       vp + bg * keys_ * tl_.dv);
    });
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
