#include "common/kv_decode.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/attention_kernels.h"
#include "common/checked.h"
#include "common/decode_kernels.h"
#include "common/error.h"
#include "common/threads.h"

namespace attnbench {
namespace {

class KvDecodeState final : public DecodeState {
 public:
  KvDecodeState(const Problem& p, ConstTensorView k, ConstTensorView v, int64_t t0,
                const KvDecodeOptions& opt)
      : batch_(p.batch),
        heads_(p.heads),
        d_(p.dim),
        cap_(p.n),
        window_(opt.window),
        slots_(opt.window == KvDecodeOptions::kNoWindow ? p.n : std::min(p.n, opt.window + 1)),
        min_chunk_(opt.min_chunk),
        max_chunk_(opt.max_chunk),
        parallel_floats_(opt.parallel_floats),
        scale_(p.softmax_scale()),
        len_(t0),
        head_floats_(slots_ * d_),
        keys_(cache_bytes(p, slots_)),
        values_(cache_bytes(p, slots_)) {
    // the last `slots` of rows 0 .. t0 - 1, each to its slot (in parallel over the heads when
    // there is more than a few pages to copy)
    const int64_t first = std::max<int64_t>(0, t0 - slots_), bh_count = batch_ * heads_;
    const size_t row_bytes = size_t(d_) * sizeof(float);
    const bool parallel = bh_count > 1 && (t0 - first) * bh_count * d_ >= (int64_t(1) << 16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t bh = 0; bh < bh_count; ++bh) {
      const int64_t b = bh / heads_, h = bh % heads_;
      for (int64_t t = first; t < t0; ++t) {
        std::memcpy(key_row(bh, t), k.row(b, h, t), row_bytes);
        std::memcpy(value_row(bh, t), v.row(b, h, t), row_bytes);
      }
    }
  }

  int64_t length() const override { return len_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(len_, cap_, Shape4{batch_, heads_, 1, d_}, q, k, v, out);
    const int64_t t = len_, lo = first_visible(t), visible = t - lo + 1;
    const int64_t bh_count = batch_ * heads_;
    const size_t row_bytes = size_t(d_) * sizeof(float);
    for (int64_t bh = 0; bh < bh_count; ++bh) {
      const int64_t b = bh / heads_, h = bh % heads_;
      std::memcpy(key_row(bh, t), k.row(b, h, 0), row_bytes);
      std::memcpy(value_row(bh, t), v.row(b, h, 0), row_bytes);
    }
    ++len_;

    // chunks of min_chunk .. max_chunk keys, about 4 tasks per thread in all; on one thread,
    // chunks of max_chunk keys
    const int threads = team_threads();
    const int64_t want_chunks = threads > 1 ? (4 * threads + bh_count - 1) / bh_count : 1;
    const int64_t chunk =
        std::clamp((visible + want_chunks - 1) / want_chunks, min_chunk_, max_chunk_);
    const int64_t chunks = (visible + chunk - 1) / chunk, tasks = bh_count * chunks;
    const int64_t part = d_ + 2;  // per task: mx, l, acc[d]
    if (int64_t(partials_.size()) < tasks * part) partials_.resize(size_t(tasks * part));
    const int64_t score_floats = std::min(chunk, visible);
    if (int64_t(scores_.size()) < threads * score_floats)
      scores_.resize(size_t(threads * score_floats));
    float* partials = partials_.data();
    float* scores = scores_.data();

    const bool parallel = threads > 1 && tasks > 1 && bh_count * visible * d_ >= parallel_floats_;
#pragma omp parallel if (parallel)
    {
      float* sc = scores + omp_get_thread_num() * score_floats;
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t bh = task / chunks, c = task % chunks;
        const int64_t b = bh / heads_, h = bh % heads_;
        const int64_t a0 = lo + c * chunk, a1 = std::min(t + 1, a0 + chunk);
        chunk_partial(bh, q.row(b, h, 0), a0, a1, sc, partials + task * part);
      }
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < bh_count; ++bh)
        decode::merge_partials(partials + bh * chunks * part, chunks, d_, scale_,
                               out.row(bh / heads_, bh % heads_, 0));
    }
  }

  double state_bytes() const override {
    return double(heads_) * double(std::min(len_, slots_)) * 2.0 * double(d_) * sizeof(float);
  }

  double step_bytes_read() const override {
    // every visible cached key and value row once (the new ones included), and per (b, h)
    // the q, k, v rows read and the out row written
    if (len_ >= cap_) return 0.0;
    return double(batch_ * heads_) * double(next_visible() * 2 + 4) * double(d_) * sizeof(float);
  }

  double step_flops() const override {
    // 4 d per visible key (the dot q . k_j and the multiply-add of p_j v_j, multiply-add = 2),
    // as flash's forward counts a (query, key) pair; the exponentials, the scaling and the
    // merge of the chunks (O(chunks d) per head) are not counted
    if (len_ >= cap_) return 0.0;
    return double(batch_ * heads_) * double(next_visible()) * 4.0 * double(d_);
  }

 private:
  /// Bytes of one cache (keys or values) of B H slots rows of d floats.
  static int64_t cache_bytes(const Problem& p, int64_t slots) {
    const int64_t rows = checked_mul<UsageError>(p.batch * p.heads, slots, "decode cache rows");
    return checked_mul<UsageError>(checked_mul<UsageError>(rows, p.dim, "decode cache floats"),
                                   int64_t(sizeof(float)), "decode cache bytes");
  }
  int64_t first_visible(int64_t t) const {
    return window_ == KvDecodeOptions::kNoWindow ? 0 : std::max<int64_t>(0, t - window_);
  }
  int64_t next_visible() const { return len_ - first_visible(len_) + 1; }
  float* key_row(int64_t bh, int64_t t) const {
    return keys_.floats() + bh * head_floats_ + (t % slots_) * d_;
  }
  float* value_row(int64_t bh, int64_t t) const {
    return values_.floats() + bh * head_floats_ + (t % slots_) * d_;
  }

  /// The partial of positions a0 .. a1 - 1 of head bh: part = {mx, l, acc[d]}, sc a buffer of
  /// a1 - a0 floats. The positions are one run of contiguous slots, or two where the ring
  /// wraps.
  void chunk_partial(int64_t bh, const float* q, int64_t a0, int64_t a1, float* sc,
                     float* part) const {
    decode::Run runs[2];
    size_t count = 0;
    for (int64_t a = a0; a < a1; a += runs[count++].count) {
      const int64_t s = a % slots_;
      runs[count] = {s, std::min(a1 - a, slots_ - s)};
    }
    decode::runs_partial(q, keys_.floats() + bh * head_floats_,
                         values_.floats() + bh * head_floats_, runs, count, d_, scale_, sc, part);
  }

  int64_t batch_, heads_, d_, cap_, window_, slots_, min_chunk_, max_chunk_, parallel_floats_;
  float scale_;
  int64_t len_;
  int64_t head_floats_;  // slots d: one (b, h) of the cache
  // the caches [B H, slots, d] of keys and values, 64-byte aligned and uninitialised: only
  // the slots of positions written are ever read
  kernels::AlignedBuffer keys_, values_;
  // per-step workspace, kept between steps: the chunks' partials and each thread's scores
  std::vector<float> partials_, scores_;
};

}  // namespace

std::unique_ptr<DecodeState> kv_decode_prefill(const Problem& p, ConstTensorView k,
                                               ConstTensorView v, int64_t t0,
                                               const KvDecodeOptions& opt) {
  check_prefill(p, k, v, t0);
  if (opt.window < 0 && opt.window != KvDecodeOptions::kNoWindow)
    throw UsageError(fmt::format("decode: window {} must be >= 0", opt.window));
  if (opt.min_chunk < 1 || opt.max_chunk < opt.min_chunk)
    throw UsageError(fmt::format("decode: chunk bounds {} .. {} need 1 <= min <= max",
                                 opt.min_chunk, opt.max_chunk));
  return std::make_unique<KvDecodeState>(p, k, v, t0, opt);
}

}  // namespace attnbench
