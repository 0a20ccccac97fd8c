#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <optional>

#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"
#include "common/core/random.h"
#include "common/core/threads.h"
#include "common/engines/feature_map_attention.h"
#include "common/engines/feature_map_internal.h"
#include "common/kernels/simd.h"
#include "common/kernels/softmax.h"

namespace attnbench::feature_map {

using detail::Aligned;
using detail::KeyState;
using detail::round_up;

namespace {

/// Threads a loop over `heads` (batch, head) pairs of `flops` work in all runs on, as
/// attend(): every thread of the team when there are at least as many pairs and the work is
/// worth a parallel region (common/core/threads.h), else 1.
int head_threads(int64_t heads, double flops) {
  return heads >= team_threads() && parallel_worth(flops, heads) ? team_threads() : 1;
}

/// body(bh, work) for every (batch, head) index bh < heads, OpenMP over them on
/// head_threads(heads, flops) threads (BLAS single-threaded inside a region); work: the
/// running thread's `stride` floats of `pool` (head_threads(heads, flops) stride floats).
template <class Body>
void for_each_head(int64_t heads, double flops, float* pool, int64_t stride, const Body& body) {
  const bool per_head = head_threads(heads, flops) > 1;
  parallel_for(heads, [&](int64_t bh) { body(bh, pool + int64_t(omp_get_thread_num()) * stride); },
               {.parallel = per_head});
}

class KernelDecodeState final : public DecodeState {
 public:
  KernelDecodeState(const Problem& p, float eps,
                    std::vector<std::shared_ptr<const FeatureMap>> maps, double map_bytes)
      : batch_(p.batch),
        heads_(p.heads),
        capacity_(p.n),
        d_(p.dim),
        eps_(eps),
        map_bytes_(map_bytes),
        maps_(std::move(maps)) {
    if (maps_.empty() || (maps_.size() != 1 && int64_t(maps_.size()) != heads_))
      throw UsageError(fmt::format(
          "kernel attention decode: {} feature maps for {} heads (one for all, or one per head)",
          maps_.size(), heads_));
    f_ = maps_[0]->features();
    for (const auto& m : maps_)
      if (!m || m->features() != f_)
        throw UsageError("kernel attention decode: the feature maps differ in their features");
    zoff_ = round_up(f_ * d_, 16);
    stride_ = zoff_ + round_up(f_, 16);
    state_ = std::make_unique<Aligned>(batch_ * heads_ * stride_);
    shift_.assign(size_t(batch_ * heads_), -INFINITY);
  }

  /// Folds keys and values 0 .. t0 - 1 in the engine's blocks.
  void prefill(ConstTensorView k, ConstTensorView v, int64_t t0) {
    const int64_t block = Schedule::for_features(f_).block, stride = round_up(block * f_, 16);
    const int64_t heads = batch_ * heads_;
    double flops = 0;
    for (int64_t h = 0; h < heads_; ++h)
      flops += double(batch_) * double(t0) * (map(h).key_flops() + 2.0 * double(f_ * d_));
    // phi(K) of one key block per thread, freed when the prefill ends
    Aligned work(stride * head_threads(heads, flops));
    for_each_head(heads, flops, work.get(), stride, [&](int64_t bh, float* phk) {
      const int64_t b = bh / heads_, h = bh % heads_;
      KeyState st(map(h), k.head(b, h), k.stride_row, v.head(b, h), v.stride_row, d_, s(bh), z(bh));
      while (st.kdone < t0) {
        const int64_t cnt = std::min(block, t0 - st.kdone);
        st.map_keys(st.kdone, cnt, phk);
        st.fold(phk, st.kdone, cnt);
        st.kdone += cnt;
      }
      shift_[size_t(bh)] = st.shift;
    });
    length_ = t0;
  }

  int64_t length() const override { return length_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(length_, capacity_, Shape4{batch_, heads_, 1, d_}, q, k, v, out);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h)
    const SerialIfSmall small(step_flops());
    const int64_t f = f_, d = d_, fpad = round_up(f, 16), heads = batch_ * heads_;
    // a step is one key and one query per head: most often too little for a parallel region
    const double flops = step_flops();
    // phi(k) and phi(q) per thread, kept between steps so that a step allocates nothing
    const int64_t need = 2 * fpad * head_threads(heads, flops);
    if (work_floats_ < need) {
      work_.reset();
      work_ = std::make_unique<Aligned>(need);
      work_floats_ = need;
    }
    // the key count of the step's row: every key so far and its own
    const float weight = float(length_ + 1);
    for_each_head(heads, flops, work_->get(), 2 * fpad, [&](int64_t bh, float* w) {
      const int64_t b = bh / heads_, h = bh % heads_;
      const FeatureMap& fm = map(h);
      float *phk = w, *phq = w + fpad, *o = out.head(b, h);
      // 1. the key, at the shift it raises (S and z rescaled first), into S and z
      KeyState st(fm, k.head(b, h), k.stride_row, v.head(b, h), v.stride_row, d, s(bh), z(bh),
                  shift_[size_t(bh)], length_);
      st.map_keys(0, 1, phk);
      st.fold(phk, 0, 1);
      shift_[size_t(bh)] = st.shift;
      // 2. the query: out = phi(q)^T S / (phi(q)^T z + eps) by the engine's row rule
      fm.queries(q.head(b, h), q.stride_row, 1, phq, f);
      cblas_sgemv(CblasRowMajor, CblasTrans, int(f), int(d), 1.0f, s(bh), int(d), phq, 1, 0.0f, o,
                  1);
      finish_row(o, d, dot(phq, z(bh), f) + eps_, fm.denominator_floor(), weight);
    });
    ++length_;
  }

  double state_bytes() const override { return double(heads_ * (f_ * d_ + f_ + 2)) * 4.0; }

  double step_bytes_read() const override {
    const double bh = double(batch_ * heads_);
    return bh * double(f_ * d_ + f_) * 4.0 + double(maps_.size()) * map_bytes_ +
           bh * 3.0 * double(d_) * 4.0;
  }

  double step_flops() const override {
    double total = 0;
    for (int64_t h = 0; h < heads_; ++h) {
      const FeatureMap& fm = map(h);
      total += fm.query_flops() + fm.key_flops();
    }
    const double f = double(f_), d = double(d_);
    return double(batch_) * (total + double(heads_) * (4.0 * f * d + 3.0 * f + d));
  }

 private:
  const FeatureMap& map(int64_t h) const { return *maps_[maps_.size() == 1 ? 0 : size_t(h)]; }
  float* s(int64_t bh) const { return state_->get() + bh * stride_; }
  float* z(int64_t bh) const { return s(bh) + zoff_; }
  // a view [B, H, >= rows, d] of this state's problem

  int64_t batch_, heads_, capacity_, d_, f_ = 0, zoff_ = 0, stride_ = 0, length_ = 0;
  float eps_;
  double map_bytes_;
  std::vector<std::shared_ptr<const FeatureMap>> maps_;
  std::unique_ptr<Aligned> state_;  // per (batch, head): S (F x d), then z (F)
  std::vector<float> shift_;        // the key shift of each (batch, head)
  std::unique_ptr<Aligned> work_;   // a step's per-thread phi(k), phi(q)
  int64_t work_floats_ = 0;
};

}  // namespace

std::unique_ptr<DecodeState> prefill_state(const Problem& p, ConstTensorView k, ConstTensorView v,
                                           int64_t t0, float eps,
                                           std::vector<std::shared_ptr<const FeatureMap>> maps,
                                           double map_bytes) {
  check_prefill(p, k, v, t0);
  auto state = std::make_unique<KernelDecodeState>(p, eps, std::move(maps), map_bytes);
  state->prefill(k, v, t0);
  return state;
}

double prefill_flops(const Problem& p, int64_t t0, int64_t features, double key_map_flops) {
  const double f = double(features), d = double(p.dim);
  return double(p.batch * p.heads) * double(t0) * (key_map_flops + 2.0 * f * d + f);
}
}  // namespace attnbench::feature_map
