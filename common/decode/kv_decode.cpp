#include "common/decode/kv_decode.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/core/checked.h"
#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/threads.h"
#include "common/decode/decode_kernels.h"
#include "common/kernels/attention_kernels.h"
#include "common/kernels/softmax.h"

namespace attnbench {
namespace {

class KvDecodeState final : public DecodeState {
 public:
  KvDecodeState(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t t0,
                const KvDecodeOptions& opt)
      : batch_(p.batch),
        heads_(p.heads),
        kv_heads_(p.kv_head_count()),
        group_(p.kv_group()),
        d_(p.dim),
        cap_(p.n),
        window_(opt.window),
        slots_(opt.window == KvDecodeOptions::kNoWindow ? p.n : std::min(p.n, opt.window + 1)),
        sinks_(opt.window == KvDecodeOptions::kNoWindow ? 0 : std::min(opt.sinks, p.n)),
        min_chunk_(opt.min_chunk),
        max_chunk_(opt.max_chunk),
        parallel_floats_(opt.parallel_floats),
        scale_(p.softmax_scale()),
        len_(t0),
        head_floats_(slots_ * d_),
        keys_(cache_bytes(p, slots_)),
        values_(cache_bytes(p, slots_)),
        sink_keys_(size_t(batch_ * kv_heads_ * sinks_ * d_)),
        sink_values_(sink_keys_.size()) {
    // the last `slots` of rows 0 .. t0 - 1, each to its slot (in parallel over the key/value
    // heads when there is more than a few pages to copy)
    const int64_t first = std::max<int64_t>(0, t0 - slots_), kv_count = batch_ * kv_heads_;
    const size_t row_bytes = size_t(d_) * sizeof(float);
    const bool parallel = kv_count > 1 && (t0 - first) * kv_count * d_ >= (int64_t(1) << 16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t bg = 0; bg < kv_count; ++bg) {
      const int64_t b = bg / kv_heads_, h = bg % kv_heads_ * group_;
      for (int64_t t = first; t < t0; ++t) {
        std::memcpy(key_row(bg, t), k.row(b, h, t), row_bytes);
        std::memcpy(value_row(bg, t), v.row(b, h, t), row_bytes);
      }
      for (int64_t t = 0; t < std::min(t0, sinks_); ++t) {
        std::memcpy(sink_key_row(bg, t), k.row(b, h, t), row_bytes);
        std::memcpy(sink_value_row(bg, t), v.row(b, h, t), row_bytes);
      }
    }
  }

  int64_t length() const override { return len_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(len_, cap_, Shape4{batch_, heads_, 1, d_}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const SerialIfSmall small(step_flops(), 4.0 * double(parallel_floats_));
    decode::check_step_group(k.group, group_, kv_heads_);
    // the visible positions in order: the sinks 0 .. ns - 1 left of the band, then lo .. t;
    // chunks cut this list (index u: position u below ns, lo + u - ns from there)
    const int64_t t = len_, lo = first_visible(t), ns = sink_count(t), visible = ns + t - lo + 1;
    const int64_t kv_count = batch_ * kv_heads_;
    const size_t row_bytes = size_t(d_) * sizeof(float);
    for (int64_t bg = 0; bg < kv_count; ++bg) {
      const int64_t b = bg / kv_heads_, h = bg % kv_heads_ * group_;
      std::memcpy(key_row(bg, t), k.row(b, h, 0), row_bytes);
      std::memcpy(value_row(bg, t), v.row(b, h, 0), row_bytes);
      if (t < sinks_) {
        std::memcpy(sink_key_row(bg, t), k.row(b, h, 0), row_bytes);
        std::memcpy(sink_value_row(bg, t), v.row(b, h, 0), row_bytes);
      }
    }
    ++len_;

    // chunks of min_chunk .. max_chunk keys, about 4 tasks per thread in all; on one thread,
    // chunks of max_chunk keys. A task is one chunk of one key/value head for every query head
    // of its group, so the cache is read once per group.
    const int threads = team_threads();
    const int64_t want_chunks = threads > 1 ? (4 * threads + kv_count - 1) / kv_count : 1;
    const int64_t chunk =
        std::clamp((visible + want_chunks - 1) / want_chunks, min_chunk_, max_chunk_);
    const int64_t chunks = (visible + chunk - 1) / chunk, tasks = kv_count * chunks;
    const int64_t part = d_ + 2;  // per task and query head: mx, l, acc[d]
    if (int64_t(partials_.size()) < tasks * group_ * part)
      partials_.resize(size_t(tasks * group_ * part));
    const int64_t score_floats = std::min(chunk, visible) * group_;
    if (int64_t(scores_.size()) < threads * score_floats)
      scores_.resize(size_t(threads * score_floats));
    float* partials = partials_.data();
    float* scores = scores_.data();

    const bool parallel =
        threads > 1 && tasks > 1 && batch_ * heads_ * visible * d_ >= parallel_floats_;
#pragma omp parallel if (parallel)
    {
      float* sc = scores + omp_get_thread_num() * score_floats;
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t bg = task / chunks, c = task % chunks;
        const int64_t u0 = c * chunk, u1 = std::min(visible, u0 + chunk);
        chunk_partials(bg, c, chunks, q, lo, ns, u0, u1, sc, partials);
      }
      // the partials of query head bh = b H + h are chunks of them back to back
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < batch_ * heads_; ++bh)
        decode::merge_partials(partials + bh * chunks * part, chunks, d_, scale_,
                               out.row(bh / heads_, bh % heads_, 0));
    }
  }

  double state_bytes() const override {
    return double(kv_heads_) * double(std::min(len_, slots_) + std::min(len_, sinks_)) * 2.0 *
           double(d_) * sizeof(float);
  }

  double step_bytes_read() const override {
    // every visible cached key and value row once per key/value head (the new ones included),
    // the k and v rows read per key/value head, and per query head the q row read and the out
    // row written
    if (len_ >= cap_) return 0.0;
    return (double(batch_ * kv_heads_) * double(next_visible() * 2 + 2) +
            double(batch_ * heads_) * 2.0) *
           double(d_) * sizeof(float);
  }

  double step_flops() const override {
    // 4 d per visible key and query head (the dot q . k_j and the multiply-add of p_j v_j,
    // multiply-add = 2), as flash's forward counts a (query, key) pair; the exponentials, the
    // scaling and the merge of the chunks (O(chunks d) per head) are not counted
    if (len_ >= cap_) return 0.0;
    return double(batch_ * heads_) * double(next_visible()) * 4.0 * double(d_);
  }

 private:
  /// Positions of a chunk scored (and then accumulated) for every query head of a group before
  /// the next ones: 64 rows of keys or values stay in the L1 cache across the group's heads.
  static constexpr int64_t kSubBlock = 64;

  /// Bytes of one cache (keys or values) of B G slots rows of d floats.
  static int64_t cache_bytes(const Problem& p, int64_t slots) {
    const int64_t rows =
        checked_mul<UsageError>(p.batch * p.kv_head_count(), slots, "decode cache rows");
    return checked_mul<UsageError>(checked_mul<UsageError>(rows, p.dim, "decode cache floats"),
                                   int64_t(sizeof(float)), "decode cache bytes");
  }
  int64_t first_visible(int64_t t) const {
    return window_ == KvDecodeOptions::kNoWindow ? 0 : std::max<int64_t>(0, t - window_);
  }
  /// Sinks visible to step t beside its band (those left of it).
  int64_t sink_count(int64_t t) const { return std::min(sinks_, first_visible(t)); }
  int64_t next_visible() const { return sink_count(len_) + len_ - first_visible(len_) + 1; }
  float* key_row(int64_t bg, int64_t t) const {
    return keys_.floats() + bg * head_floats_ + (t % slots_) * d_;
  }
  float* value_row(int64_t bg, int64_t t) const {
    return values_.floats() + bg * head_floats_ + (t % slots_) * d_;
  }
  float* sink_key_row(int64_t bg, int64_t t) { return sink_keys_.data() + (bg * sinks_ + t) * d_; }
  float* sink_value_row(int64_t bg, int64_t t) {
    return sink_values_.data() + (bg * sinks_ + t) * d_;
  }

  /// Calls f(keys, values, count, offset in the chunk) for the runs of contiguous rows of
  /// key/value head bg holding the visible positions u0 .. u1 - 1 of the step's list (ns sinks,
  /// then positions lo ..): sink rows, then ring slots (one run, or two where the ring wraps),
  /// in sub-blocks of at most kSubBlock positions.
  template <class F>
  void for_runs(int64_t bg, int64_t lo, int64_t ns, int64_t u0, int64_t u1, F&& f) const {
    const float* kh = keys_.floats() + bg * head_floats_;
    const float* vh = values_.floats() + bg * head_floats_;
    for (int64_t u = u0; u < u1;) {
      int64_t count;
      if (u < ns) {
        count = std::min({u1, ns, u + kSubBlock}) - u;
        const int64_t r = (bg * sinks_ + u) * d_;
        f(sink_keys_.data() + r, sink_values_.data() + r, count, u - u0);
      } else {
        const int64_t a = lo + u - ns, s = a % slots_;
        count = std::min({u1 - u, slots_ - s, kSubBlock});
        f(kh + s * d_, vh + s * d_, count, u - u0);
      }
      u += count;
    }
  }

  /// The partials of chunk c (of `chunks`: visible positions u0 .. u1 - 1, see for_runs) of
  /// key/value head bg for each query head bh = bg group + r of its group: parts + (bh chunks +
  /// c) (d + 2) = {mx, l, acc[d]}; sc a buffer of group (u1 - u0) floats.
  void chunk_partials(int64_t bg, int64_t c, int64_t chunks, ConstTensorView q, int64_t lo,
                      int64_t ns, int64_t u0, int64_t u1, float* sc, float* parts) const {
    const int64_t len = u1 - u0, part = d_ + 2;
    const int64_t b = bg / kv_heads_, h0 = bg % kv_heads_ * group_;
    auto partial = [&](int64_t r) { return parts + ((bg * group_ + r) * chunks + c) * part; };
    for_runs(bg, lo, ns, u0, u1, [&](const float* kr, const float*, int64_t count, int64_t off) {
      for (int64_t r = 0; r < group_; ++r)
        decode::dots(q.row(b, h0 + r, 0), kr, count, d_, sc + r * len + off);
    });
    for (int64_t r = 0; r < group_; ++r) {
      float* scr = sc + r * len;
      float* pr = partial(r);
      const float mx = row_max(scr, len);
      pr[0] = mx;
      pr[1] = exp_sum(scr, len, scale_, mx);
      std::fill(pr + 2, pr + 2 + d_, 0.0f);
    }
    for_runs(bg, lo, ns, u0, u1, [&](const float*, const float* vr, int64_t count, int64_t off) {
      for (int64_t r = 0; r < group_; ++r)
        decode::accumulate(sc + r * len + off, vr, count, d_, partial(r) + 2);
    });
  }

  int64_t batch_, heads_, kv_heads_, group_, d_, cap_, window_, slots_, sinks_, min_chunk_,
      max_chunk_, parallel_floats_;
  float scale_;
  int64_t len_;
  int64_t head_floats_;  // slots d: one (b, key/value head) of the cache
  // the caches [B G, slots, d] of keys and values, 64-byte aligned and uninitialised: only
  // the slots of positions written are ever read
  kernels::AlignedBuffer keys_, values_;
  // per-step workspace, kept between steps: the chunks' partials and each thread's scores
  std::vector<float> partials_, scores_;
  // the sink rows [B G, sinks, d] of keys and values (none without sinks)
  std::vector<float> sink_keys_, sink_values_;
};

}  // namespace

std::unique_ptr<DecodeState> kv_decode_prefill(const Problem& p, ConstTensorView k,
                                               ConstTensorView v, int64_t t0,
                                               const KvDecodeOptions& opt) {
  check_prefill(p, k, v, t0);
  if (opt.window < 0 && opt.window != KvDecodeOptions::kNoWindow)
    throw UsageError(fmt::format("decode: window {} must be >= 0", opt.window));
  if (opt.sinks < 0) throw UsageError(fmt::format("decode: sinks {} must be >= 0", opt.sinks));
  if (opt.min_chunk < 1 || opt.max_chunk < opt.min_chunk)
    throw UsageError(fmt::format("decode: chunk bounds {} .. {} need 1 <= min <= max",
                                 opt.min_chunk, opt.max_chunk));
  return std::make_unique<KvDecodeState>(p, k, v, t0, opt);
}

}  // namespace attnbench
