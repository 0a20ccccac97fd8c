// moba: Mixture of Block Attention (Lu et al. 2025, "MoBA: Mixture of Block Attention for
// Long-Context LLMs"). The keys are cut into chunks of `chunk` keys (chunk c: keys
// [c chunk, min(n, (c + 1) chunk))); query i scores chunk c by a parameter-free gate, the dot
// of the raw query (no 1/sqrt(d)) with the chunk's mean key,
//
//   g_ic = q_i . mean_{j in chunk c} k_j,
//
// keeps its `topk` best chunks S(i) (ties: the lower chunk) and attends them with an exact
// softmax: out_i = sum_{j in S(i)} softmax_j(q_i . k_j / sqrt(d)) v_j.
// Causal (the paper's setting, after its reference implementation): only complete chunks
// wholly before the query's own chunk c(i) = i / chunk are gated; the own chunk is always in
// S(i) (causally masked inside) and counts toward topk, so S(i) = {c(i)} plus the topk - 1
// best earlier chunks (all of them if there are fewer). Not causal: the topk best of all
// chunks (the last one, if shorter, by the mean of its keys), no forced chunk.
// Per query head: with grouped-query heads each query head gates with its own q against the
// chunk means of its key/value head. Self-attention only (m = n).
//
// Parameters: chunk (paper default 512), topk (paper default 3), block (the engine's tile,
// used by the backward and the exported pattern only). The paper's 512 x 3 is for contexts of
// 8K and more; for short contexts (n of 1K - 4K) chunk=128,topk=3 keeps the same selection
// ratio per chunk count (a few hundred keys of a few thousand) and is the second setting the
// sweep runs. Any chunk >= 1 works (no need to be a multiple of block).
//
// Forward: the chunk means once per key/value head (sums in key order, divided by the chunk's
// length), the gate scores of every query (a row of dots over the earlier chunks), a partial
// top-k per query; then chunk by chunk, the queries that chose the chunk are gathered in tiles
// and attend its keys (the flash tile passes, common/kernels/tile_attention.h), each (query, chosen
// chunk) a partial output with its log-sum-exp; the partials of a query merge by their
// log-sum-exps. Time O(n (n / chunk) d + n topk chunk d), memory O(n topk d) per head (the
// partials) plus the selection B H n topk.
// Backward: the engine's block-sparse backward over the pattern (the selection a constant).
// Decode: a KV cache per key/value head with running per-chunk key sums; a step at t gates the
// complete earlier chunks by their means and attends the chosen chunks plus its own up to t,
// O(t / chunk d + topk chunk d) per step and query head. It equals row t of the causal forward
// (same means, same gate dots).
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/omp_guard.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"
#include "common/core/registry.h"
#include "common/core/threads.h"
#include "common/decode/decode_kernels.h"
#include "common/engines/block_sparse.h"
#include "common/kernels/attention_kernels.h"
#include "common/kernels/tile_attention.h"
#include "common/patterns/pattern.h"

namespace attnbench {
namespace {

/// Chunk count of n keys.
int64_t chunks_of(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

/// means[c d ..] = mean of the keys of chunk c of rows k (ld floats apart), for chunks
/// c0 .. c1 - 1: the sum in key order, then divided by the chunk's length (the decode state
/// sums in the same order, so both get the same means).
void chunk_means(const float* k, int64_t ld, int64_t n, int64_t d, int64_t chunk, int64_t c0,
                 int64_t c1, float* means) {
  for (int64_t c = c0; c < c1; ++c) {
    float* mc = means + c * d;
    std::fill(mc, mc + d, 0.0f);
    const int64_t j0 = c * chunk, j1 = std::min(n, j0 + chunk);
    for (int64_t j = j0; j < j1; ++j) {
      const float* kj = k + j * ld;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) mc[x] += kj[x];
    }
    const float len = float(j1 - j0);
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) mc[x] /= len;
  }
}

/// The chunks query `q` selects: the `want` best of chunks 0 .. cand - 1 by the gate
/// sc[c] = q . means_c (ties: the lower chunk), plus `own` if own >= 0; ascending in sel.
/// Returns the count. sc: cand floats of scratch.
int64_t select_chunks(const float* q, const float* means, int64_t cand, int64_t d, int64_t want,
                      int64_t own, float* sc, int32_t* sel) {
  int64_t count = 0;
  if (cand > 0 && want > 0) {
    decode::dots(q, means, cand, d, sc);
    // insertion into a list kept best first: O(cand want), want is a handful
    auto better = [&](int32_t a, int32_t b) { return sc[a] > sc[b] || (sc[a] == sc[b] && a < b); };
    for (int32_t c = 0; c < int32_t(cand); ++c) {
      if (count == want && !better(c, sel[count - 1])) continue;
      int64_t pos = count < want ? count++ : count - 1;
      while (pos > 0 && better(c, sel[pos - 1])) {
        sel[pos] = sel[pos - 1];
        --pos;
      }
      sel[pos] = c;
    }
  }
  if (own >= 0) sel[count++] = int32_t(own);
  std::sort(sel, sel + count);
  return count;
}

/// The selection of every query of every head: sel[(bh n + i) topk ..] its chunks ascending,
/// count[bh n + i] how many. As a SparsePattern (blocks of `block`), key j is in row i iff
/// its chunk j / chunk is selected.
class MobaPattern final : public SparsePattern {
 public:
  MobaPattern(const Problem& p, int64_t chunk, int64_t topk, int64_t block)
      : n_(p.n),
        heads_(p.heads),
        chunk_(chunk),
        topk_(topk),
        bs_(block),
        nc_(chunks_of(p.n, chunk)),
        sel_(size_t(p.batch * p.heads * p.n * topk)),
        count_(size_t(p.batch * p.heads * p.n)) {}

  int64_t block() const override { return bs_; }
  int64_t chunk() const { return chunk_; }
  int64_t topk() const { return topk_; }
  int32_t* sel(int64_t bh, int64_t i) { return sel_.data() + (bh * n_ + i) * topk_; }
  const int32_t* sel(int64_t bh, int64_t i) const { return sel_.data() + (bh * n_ + i) * topk_; }
  int32_t& count(int64_t bh, int64_t i) { return count_[size_t(bh * n_ + i)]; }
  int32_t count(int64_t bh, int64_t i) const { return count_[size_t(bh * n_ + i)]; }

  bool selects(int64_t bh, int64_t i, int64_t c) const {
    const int32_t* s = sel(bh, i);
    return std::binary_search(s, s + count(bh, i), int32_t(c));
  }

  void key_blocks(int64_t b, int64_t h, int64_t qb, std::vector<KeyBlock>& out) const override {
    out.clear();
    const int64_t bh = b * heads_ + h, i0 = qb * bs_, i1 = std::min(n_, i0 + bs_);
    if (i0 < 0 || i0 >= i1) return;
    // rows of the tile selecting each chunk
    std::vector<int32_t> rows(size_t(nc_), 0);
    for (int64_t i = i0; i < i1; ++i)
      for (int32_t s = 0; s < count(bh, i); ++s) ++rows[size_t(sel(bh, i)[s])];
    const int64_t nkb = (n_ + bs_ - 1) / bs_;
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t c0 = kb * bs_ / chunk_, c1 = (std::min(n_, (kb + 1) * bs_) - 1) / chunk_;
      bool any = false, full = true;
      for (int64_t c = c0; c <= c1; ++c) {
        any = any || rows[size_t(c)] > 0;
        full = full && rows[size_t(c)] == i1 - i0;
      }
      if (any) out.push_back({kb, !full});
    }
  }

  void block_mask(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  uint8_t* mask) const override {
    const int64_t bh = b * heads_ + h;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        mask[r * cols + c] = selects(bh, i0 + r, (j0 + c) / chunk_);
  }

  double bytes() const override {
    return double(sel_.size()) * sizeof(int32_t) + double(count_.size()) * sizeof(int32_t);
  }

 private:
  int64_t n_, heads_, chunk_, topk_, bs_, nc_;
  std::vector<int32_t> sel_, count_;
};

/// Key/value state of decode: the cache of one (batch, key/value head) is rows of the whole
/// capacity; sums hold the running key sum of the current chunk, means the complete chunks'.
class MobaDecodeState final : public DecodeState {
 public:
  MobaDecodeState(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t t0, int64_t chunk,
                  int64_t topk)
      : batch_(p.batch),
        heads_(p.heads),
        kv_heads_(p.kv_head_count()),
        group_(p.kv_group()),
        d_(p.dim),
        cap_(p.n),
        chunk_(chunk),
        topk_(topk),
        nc_(chunks_of(p.n, chunk)),
        scale_(p.softmax_scale()),
        len_(0),
        keys_(size_t(batch_ * kv_heads_ * cap_ * d_)),
        values_(keys_.size()),
        sums_(size_t(batch_ * kv_heads_ * d_), 0.0f),
        means_(size_t(batch_ * kv_heads_ * nc_ * d_)) {
    for (int64_t bg = 0; bg < batch_ * kv_heads_; ++bg) {
      const int64_t b = bg / kv_heads_, h = bg % kv_heads_ * group_;
      for (int64_t t = 0; t < t0; ++t) append(bg, t, k.row(b, h, t), v.row(b, h, t));
    }
    len_ = t0;
  }

  int64_t length() const override { return len_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(len_, cap_, Shape4{batch_, heads_, 1, d_}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const double flops = step_flops();
    const SerialIfSmall small(flops);
    decode::check_step_group(k.group, group_, kv_heads_);
    const int64_t t = len_;
    for (int64_t bg = 0; bg < batch_ * kv_heads_; ++bg) {
      const int64_t b = bg / kv_heads_, h = bg % kv_heads_ * group_;
      append(bg, t, k.row(b, h, 0), v.row(b, h, 0));
    }
    ++len_;
    const int64_t own = t / chunk_;
    const int64_t bhs = batch_ * heads_;
    const bool parallel = parallel_worth(flops, bhs);
    struct Scratch {
      std::vector<float> sc, part;    // scores, the partial sums of the step
      std::vector<int32_t> sel;       // the chosen chunks
      std::vector<decode::Run> runs;  // their key ranges
    };
    parallel_for(
        bhs,
        [&] {
          return Scratch{std::vector<float>(size_t(std::max(own, topk_ * chunk_))),
                         std::vector<float>(size_t(d_ + 2)), std::vector<int32_t>(size_t(topk_)),
                         std::vector<decode::Run>(size_t(topk_))};
        },
        [&](int64_t bh, Scratch& s) {
          const int64_t b = bh / heads_, h = bh % heads_, bg = b * kv_heads_ + h / group_;
          const float* qr = q.row(b, h, 0);
          const int64_t cnt = select_chunks(qr, means_.data() + bg * nc_ * d_, own, d_, topk_ - 1,
                                            own, s.sc.data(), s.sel.data());
          for (int64_t c = 0; c < cnt; ++c) {
            const int64_t j0 = s.sel[size_t(c)] * chunk_;
            s.runs[size_t(c)] = {j0, std::min(j0 + chunk_, t + 1) - j0};
          }
          const float* kh = keys_.data() + bg * cap_ * d_;
          const float* vh = values_.data() + bg * cap_ * d_;
          decode::runs_partial(qr, kh, vh, s.runs.data(), size_t(cnt), d_, scale_, s.sc.data(),
                               s.part.data());
          decode::merge_partials(s.part.data(), 1, d_, scale_, out.row(b, h, 0));
        },
        {.parallel = parallel});
  }

  double state_bytes() const override {
    // cache rows, the running sums and the complete chunks' means
    return double(kv_heads_) * (double(len_) * 2.0 + 1.0 + double(len_ / chunk_)) * double(d_) *
           sizeof(float);
  }

  double step_bytes_read() const override {
    if (len_ >= cap_) return 0.0;
    return double(batch_ * heads_) * (double(len_ / chunk_) + 2.0 * keys_next() + 2.0) *
           double(d_) * sizeof(float);
  }

  double step_flops() const override {
    if (len_ >= cap_) return 0.0;
    // the gate (2 d per earlier chunk) and 4 d per attended key, per query head
    return double(batch_ * heads_) * (2.0 * double(len_ / chunk_) + 4.0 * keys_next()) * double(d_);
  }

 private:
  /// Keys the next step attends (an upper bound: every query head takes topk - 1 earlier
  /// chunks when there are that many).
  double keys_next() const {
    const int64_t own = len_ / chunk_;
    return double(std::min(own, topk_ - 1) * chunk_ + len_ - own * chunk_ + 1);
  }

  void append(int64_t bg, int64_t t, const float* kr, const float* vr) {
    const size_t row_bytes = size_t(d_) * sizeof(float);
    std::memcpy(keys_.data() + (bg * cap_ + t) * d_, kr, row_bytes);
    std::memcpy(values_.data() + (bg * cap_ + t) * d_, vr, row_bytes);
    float* sum = sums_.data() + bg * d_;
    for (int64_t x = 0; x < d_; ++x) sum[x] += kr[x];
    if ((t + 1) % chunk_ == 0) {  // chunk t / chunk is complete: its mean, as the forward's
      float* mean = means_.data() + (bg * nc_ + t / chunk_) * d_;
      const float len = float(chunk_);
      for (int64_t x = 0; x < d_; ++x) mean[x] = sum[x] / len;
      std::fill(sum, sum + d_, 0.0f);
    }
  }

  int64_t batch_, heads_, kv_heads_, group_, d_, cap_, chunk_, topk_, nc_;
  float scale_;
  int64_t len_;
  std::vector<float> keys_, values_, sums_, means_;
};

class Moba final : public PatternVariant, public Decoder {
 public:
  Moba(int64_t chunk, int64_t topk, int64_t block) : chunk_(chunk), topk_(topk), block_(block) {}

  std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView q,
                                              ConstTensorView k) const override {
    if (q.data == nullptr || k.data == nullptr) return nullptr;  // depends on q and k
    check(p);
    const int64_t n = p.n, d = p.dim, nc = chunks_of(n, chunk_), G = p.kv_head_count();
    auto pat = std::make_unique<MobaPattern>(p, chunk_, topk_, block_);
    // the chunk means of every key/value head (for causal problems only complete chunks are
    // gated, but the means of all are cheap)
    std::vector<float> means(size_t(p.batch * G * nc * d));
    const int64_t bgs = p.batch * G, tiles = (n + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t bg = 0; bg < bgs; ++bg)
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t b = bg / G, h = bg % G * p.kv_group();
        chunk_means(k.head(b, h), k.stride_row, n, d, chunk_, c, c + 1, means.data() + bg * nc * d);
      }
    parallel_for(
        p.batch * p.heads * tiles, [&] { return std::vector<float>(size_t(nc)); },
        [&](int64_t task, std::vector<float>& sc) {
          const int64_t bh = task / tiles, i0 = task % tiles * kRows;
          const int64_t b = bh / p.heads, h = bh % p.heads;
          const float* mh = means.data() + (b * G + p.kv_head(h)) * nc * d;
          for (int64_t i = i0; i < std::min(n, i0 + kRows); ++i) {
            const int64_t own = i / chunk_;
            pat->count(bh, i) =
                int32_t(p.causal ? select_chunks(q.row(b, h, i), mh, own, d, topk_ - 1, own,
                                                 sc.data(), pat->sel(bh, i))
                                 : select_chunks(q.row(b, h, i), mh, nc, d, topk_, -1, sc.data(),
                                                 pat->sel(bh, i)));
          }
        });
    return pat;
  }

  void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out) override {
    const auto pat = make_pattern(p, q, k);
    const auto& sel = static_cast<const MobaPattern&>(*pat);
    const int64_t n = p.n, d = p.dim, nc = chunks_of(n, chunk_);
    const float scale = p.softmax_scale();
    // per head: the partials of every (query, chosen chunk) [n topk (d + 1)], merged into out
    std::vector<float> parts(size_t(n * topk_ * d)), lse(size_t(n * topk_));
    std::vector<int64_t> start(size_t(nc + 1));
    std::vector<int32_t> members(size_t(n * topk_));  // per chunk, (query topk + slot)
    for (int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
      const int64_t b = bh / p.heads, h = bh % p.heads;
      // the queries of each chunk, ascending (a counting sort)
      std::fill(start.begin(), start.end(), 0);
      for (int64_t i = 0; i < n; ++i)
        for (int32_t s = 0; s < sel.count(bh, i); ++s) ++start[size_t(sel.sel(bh, i)[s] + 1)];
      for (int64_t c = 0; c < nc; ++c) start[size_t(c + 1)] += start[size_t(c)];
      {
        std::vector<int64_t> fill(start.begin(), start.end() - 1);
        for (int64_t i = 0; i < n; ++i)
          for (int32_t s = 0; s < sel.count(bh, i); ++s)
            members[size_t(fill[size_t(sel.sel(bh, i)[s])]++)] = int32_t(i * topk_ + s);
      }
      // tasks: (chunk, tile of kRows of its queries)
      std::vector<int64_t> task_start(size_t(nc + 1), 0);
      for (int64_t c = 0; c < nc; ++c)
        task_start[size_t(c + 1)] =
            task_start[size_t(c)] + (start[size_t(c + 1)] - start[size_t(c)] + kRows - 1) / kRows;
      const int64_t tasks = task_start[size_t(nc)];
      OmpGuard guard;
#pragma omp parallel if (tasks > 1)
      {
        std::unique_ptr<TileAttention> tile;
        std::vector<float> qbuf, obuf, lbuf;
        guard.run([&] {
          tile = std::make_unique<TileAttention>(kRows, kCols, d, scale);
          qbuf.resize(size_t(kRows * d));
          obuf.resize(size_t(kRows * d));
          lbuf.resize(size_t(kRows));
        });
#pragma omp for schedule(dynamic)
        for (int64_t task = tasks - 1; task >= 0; --task)
          guard.run([&] {
            const int64_t c = std::upper_bound(task_start.begin(), task_start.end(), task) -
                              task_start.begin() - 1;
            const int64_t m0 = start[size_t(c)] + (task - task_start[size_t(c)]) * kRows;
            const int64_t rows = std::min(kRows, start[size_t(c + 1)] - m0);
            const int32_t* mem = members.data() + m0;
            for (int64_t r = 0; r < rows; ++r)
              std::memcpy(qbuf.data() + r * d, q.row(b, h, mem[r] / topk_),
                          size_t(d) * sizeof(float));
            const int64_t j0 = c * chunk_, j1 = std::min(n, j0 + chunk_);
            const int64_t first = mem[0] / topk_, last = mem[rows - 1] / topk_;
            // under the causal mask, keys past the last row are never seen
            const int64_t kend = p.causal ? std::min(j1, last + 1) : j1;
            auto run = [&](float pscale) {
              tile->begin(qbuf.data(), d, rows, pscale);
              for (int64_t k0 = j0; k0 < kend; k0 += kCols) {
                const int64_t cols = std::min(kCols, kend - k0);
                const uint8_t* mask = nullptr;
                if (p.causal && k0 + cols - 1 > first) {  // some key past some row
                  uint8_t* mk = tile->mask();
                  for (int64_t r = 0; r < rows; ++r) {
                    const int64_t i = mem[r] / topk_;
                    for (int64_t cc = 0; cc < cols; ++cc) mk[r * cols + cc] = k0 + cc <= i;
                  }
                  mask = mk;
                }
                tile->attend(k.row(b, h, k0), k.stride_row, v.row(b, h, k0), v.stride_row, cols,
                             mask);
              }
              return tile->finish(obuf.data(), d, lbuf.data());
            };
            if (!run(1.0f)) run(kernels::safe_pscale(kend - j0));
            for (int64_t r = 0; r < rows; ++r) {
              std::memcpy(parts.data() + int64_t(mem[r]) * d, obuf.data() + r * d,
                          size_t(d) * sizeof(float));
              // a row whose partial is not finite (non-finite logits, or overflow past the
              // rescaled run) marks its merge NaN: never a finite wrong output
              const float* orow = obuf.data() + r * d;
              const bool finite =
                  std::all_of(orow, orow + d, [](float x) { return std::isfinite(x); });
              lse[size_t(mem[r])] =
                  finite ? lbuf[size_t(r)] : std::numeric_limits<float>::quiet_NaN();
            }
          });
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i)
          guard.run([&] {
            merge_row(parts.data() + i * topk_ * d, lse.data() + i * topk_, sel.count(bh, i), d,
                      out.row(b, h, i));
          });
      }
      guard.rethrow();
    }
  }

  double flops(const Problem& p) const override {
    const double heads = double(p.batch * p.heads), d = double(p.dim);
    return heads * (2.0 * d * gate_candidates(p) + 4.0 * d * attended_bound(p));
  }

  double memory_estimate(const Problem& p) const override {
    const int64_t nc = chunks_of(p.n, chunk_);
    return double(p.batch * p.kv_head_count() * nc * p.dim) * sizeof(float) +
           double(p.batch * p.heads * p.n * (topk_ + 1)) * sizeof(int32_t) +
           double(p.n * topk_ * (p.dim + 2) + nc + 1) * sizeof(float) +
           double(team_threads()) * (double(TileAttention::bytes(kRows, kCols, p.dim)) +
                                     double(3 * kRows * p.dim + nc) * sizeof(float));
  }

  // Decode: the KV cache of the whole capacity with running chunk sums (MobaDecodeState).
  std::unique_ptr<DecodeState> prefill(const Problem& p, ConstTensorView k, ConstTensorView v,
                                       int64_t t0) override {
    check_prefill(p, k, v, t0);
    return std::make_unique<MobaDecodeState>(p, k, v, t0, chunk_, topk_);
  }
  double prefill_flops(const Problem& p, int64_t t0) const override {
    return double(p.batch * p.kv_head_count() * t0 * p.dim);  // the chunk sums
  }

 protected:
  // Bounds for the engine's estimates (backward): a query block lists at most the key blocks
  // of the chunks its rows chose, each at most a whole block of rows by block keys.
  Counts pattern_counts(const Problem& p) const override {
    const int64_t nb = (p.n + block_ - 1) / block_;
    // key blocks one chunk spans at most, and the chunks one query block can touch
    const int64_t per_chunk = (chunk_ + block_ - 1) / block_ + 1;
    const int64_t nc = chunks_of(p.n, chunk_);
    double listed = 0;
    for (int64_t qb = 0; qb < nb; ++qb) {
      const int64_t rows = std::min(block_, p.n - qb * block_);
      const int64_t chunks = std::min(nc, rows * topk_ + 1);
      listed += double(std::min(nb, chunks * per_chunk));
    }
    const double heads = double(p.batch * p.heads);
    Counts c;
    c.listed = heads * listed;
    c.scores = c.listed * double(block_ * block_);
    c.bytes = double(p.batch * p.heads * p.n * (topk_ + 1)) * sizeof(int32_t);
    c.block = block_;
    return c;
  }

 private:
  static constexpr int64_t kRows = 64, kCols = 256;

  void check(const Problem& p) const {
    if (p.keys() != p.n)
      throw UnsupportedError(
          "moba: self-attention only (m = n): the chunks are of the keys and "
          "the causal own chunk is the query's");
  }

  /// out = the count partials (o_s [d], lse_s) merged by their log-sum-exps; 0 if none
  /// attended a key.
  static void merge_row(const float* o, const float* lse, int64_t count, int64_t d, float* out) {
    float mx = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t s = 0; s < count; ++s) {
      nan = nan || std::isnan(lse[s]);
      mx = std::max(mx, lse[s]);
    }
    std::fill(out, out + d, 0.0f);
    if (!nan && (count == 0 || mx == -std::numeric_limits<float>::infinity())) return;
    if (nan || std::isinf(mx)) {  // a non-finite logit: NaN, as the engine writes
      std::fill(out, out + d, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    float wsum = 0;
    for (int64_t s = 0; s < count; ++s) {
      const float w = std::exp(lse[s] - mx);
      wsum += w;
      for (int64_t x = 0; x < d; ++x) out[x] += w * o[s * d + x];
    }
    const float inv = 1.0f / wsum;
    for (int64_t x = 0; x < d; ++x) out[x] *= inv;
  }

  /// Gate scores per head: sum over queries of the chunks gated.
  double gate_candidates(const Problem& p) const {
    const int64_t nc = chunks_of(p.n, chunk_);
    if (!p.causal) return double(p.n) * double(nc);
    double s = 0;
    for (int64_t c = 0; c < nc; ++c) s += double(std::min(chunk_, p.n - c * chunk_)) * double(c);
    return s;
  }

  /// (query, key) pairs attended per head, at most (every query takes its full topk).
  double attended_bound(const Problem& p) const {
    const int64_t nc = chunks_of(p.n, chunk_);
    double s = 0;
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t rows = std::min(chunk_, p.n - c * chunk_);
      if (p.causal)
        s += double(std::min(c, topk_ - 1) * chunk_) * double(rows) +
             double(rows) * double(rows + 1) / 2.0;
      else
        s += double(rows) * double(std::min(p.n, topk_ * chunk_));
    }
    return s;
  }

  int64_t chunk_, topk_, block_;
};

ATTNBENCH_REGISTER_VARIANT(
    moba,
    VariantInfo{
        .name = "moba",
        .summary = "MoBA: each query attends its topk key chunks chosen by the gate q . mean(K "
                   "of the chunk) (raw q, no 1/sqrt(d)); causal: own chunk forced, topk - 1 "
                   "earlier complete chunks; short-context setting chunk=128,topk=3",
        .complexity = "time O(n (n / chunk) d + n topk chunk d), memory O(n topk d + (n / chunk) "
                      "d) per head",
        .family = "pattern",
        .display = "MoBA",
        .paper = "Lu et al. 2025 (arXiv:2502.13189)",
        .look = {.color = "#e6550d", .marker = "X"},
        .long_context = true,
        .sweep_specs = {"moba:chunk=128"},
        .params = {ParamSpec::Int("chunk", 512, 1, int64_t(1) << 30,
                                  "keys per chunk (MoBA's block size; paper 512)"),
                   ParamSpec::Int("topk", 3, 1, int64_t(1) << 20,
                                  "chunks each query attends (causal: its own chunk included)"),
                   block_param()},
        .caps = {.causal = true, .cross = false},
        .make = [](const ParamValues& v) {
          return std::make_unique<Moba>(v.get_int("chunk"), v.get_int("topk"), v.get_int("block"));
        }});

}  // namespace
}  // namespace attnbench
