#include "common/decode/pattern_decode.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common/core/checked.h"
#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/threads.h"
#include "common/decode/decode_kernels.h"
#include "common/kernels/attention_kernels.h"

namespace attnbench {
namespace {

class PatternDecodeState final : public DecodeState {
 public:
  PatternDecodeState(const Problem& p, std::unique_ptr<SparsePattern> pattern, ConstTensorView k,
                     ConstTensorView v, int64_t t0, const PatternDecodeOptions& opt)
      : batch_(p.batch),
        heads_(p.heads),
        kv_heads_(p.kv_head_count()),
        group_(p.kv_group()),
        d_(p.dim),
        cap_(p.n),
        bs_(pattern->block()),
        nb_((p.n + bs_ - 1) / bs_),
        parallel_floats_(opt.parallel_floats),
        scale_(p.softmax_scale()),
        len_(t0),
        pat_(std::move(pattern)),
        last_(size_t(batch_ * kv_heads_ * nb_), -1),
        slot_(size_t(batch_ * kv_heads_ * nb_), -1),
        base_(size_t(batch_ * kv_heads_), 0),
        lists_(size_t(batch_ * heads_)),
        runs_(size_t(batch_ * heads_)),
        mask_(size_t(bs_)) {
    // 1. every key block's last reader, over the query heads of its group
    std::vector<KeyBlock> list;
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t h = 0; h < heads_; ++h) {
        int64_t* last = last_.data() + (b * kv_heads_ + h / group_) * nb_;
        for (int64_t qb = 0; qb < nb_; ++qb) {
          pat_->key_blocks(b, h, qb, list);
          for (const KeyBlock& kb : list) {
            if (kb.index > qb) break;  // sorted: the rest is past the causal diagonal
            last[kb.index] = std::max(last[kb.index], qb);
          }
        }
      }
    // 2. slots: block kb takes a free slot at query block kb and gives it back after its last
    // reader; the blocks freed after query block qb are chained from ends[qb]
    int64_t rows = 0;
    std::vector<int64_t> ends(size_t(nb_), -1), next(size_t(nb_), -1), spare;
    for (int64_t bg = 0; bg < batch_ * kv_heads_; ++bg) {
      const int64_t* last = last_.data() + bg * nb_;
      int64_t* slot = slot_.data() + bg * nb_;
      std::fill(ends.begin(), ends.end(), -1);
      spare.clear();
      int64_t slots = 0;
      for (int64_t qb = 0; qb < nb_; ++qb) {
        if (last[qb] >= qb) {
          if (spare.empty()) {
            slot[qb] = slots++;
          } else {
            slot[qb] = spare.back();
            spare.pop_back();
          }
          next[size_t(qb)] = ends[size_t(last[qb])];
          ends[size_t(last[qb])] = qb;
        }
        for (int64_t kb = ends[size_t(qb)]; kb >= 0; kb = next[size_t(kb)])
          spare.push_back(slot[kb]);
      }
      base_[size_t(bg)] = rows;
      rows += slots * bs_;
    }
    const int64_t floats = checked_mul<UsageError>(rows, d_, "decode cache floats");
    const int64_t bytes = checked_mul<UsageError>(floats, int64_t(sizeof(float)), "decode cache");
    keys_ = std::make_unique<kernels::AlignedBuffer>(bytes);
    values_ = std::make_unique<kernels::AlignedBuffer>(bytes);
    // 3. the rows of the blocks live at t0
    const size_t row_bytes = size_t(d_) * sizeof(float);
    for (int64_t bg = 0; bg < batch_ * kv_heads_; ++bg) {
      const int64_t b = bg / kv_heads_, h = (bg % kv_heads_) * group_;
      for (int64_t kb = 0; kb * bs_ < t0; ++kb) {
        if (!held(bg, kb)) continue;
        for (int64_t t = kb * bs_; t < std::min(t0, (kb + 1) * bs_); ++t) {
          std::memcpy(key_row(bg, t), k.row(b, h, t), row_bytes);
          std::memcpy(value_row(bg, t), v.row(b, h, t), row_bytes);
        }
      }
    }
  }

  int64_t length() const override { return len_; }

  void step(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out) override {
    check_step(len_, cap_, Shape4{batch_, heads_, 1, d_}, q, k, v, out);
    const int64_t t = len_;
    const size_t row_bytes = size_t(d_) * sizeof(float);
    for (int64_t bg = 0; bg < batch_ * kv_heads_; ++bg) {
      if (slot(bg, t / bs_) < 0) continue;  // no later query reads position t
      const int64_t b = bg / kv_heads_, h = (bg % kv_heads_) * group_;
      std::memcpy(key_row(bg, t), k.row(b, h, 0), row_bytes);
      std::memcpy(value_row(bg, t), v.row(b, h, 0), row_bytes);
    }
    plan(t);
    // a step below the parallel threshold runs on this thread alone (common/core/threads.h); its
    // flops as step_flops() counts them
    const SerialIfSmall small(double(keys_read_) * 4.0 * double(d_),
                              4.0 * double(parallel_floats_));
    ++len_;

    const int threads = team_threads();
    const int64_t bh_count = batch_ * heads_, part = d_ + 2;
    if (int64_t(partials_.size()) < bh_count * part) partials_.resize(size_t(bh_count * part));
    if (int64_t(scores_.size()) < threads * max_keys_)
      scores_.resize(size_t(threads * std::max<int64_t>(max_keys_, 1)));
    const bool parallel = threads > 1 && bh_count > 1 && keys_read_ * d_ >= parallel_floats_;
#pragma omp parallel for schedule(dynamic) if (parallel)
    for (int64_t bh = 0; bh < bh_count; ++bh) {
      const int64_t b = bh / heads_, h = bh % heads_;
      const int64_t base = base_[size_t(b * kv_heads_ + h / group_)] * d_;
      const std::vector<decode::Run>& runs = runs_[size_t(bh)];
      float* pt = partials_.data() + bh * part;
      decode::runs_partial(q.row(b, h, 0), keys_->floats() + base, values_->floats() + base,
                           runs.data(), runs.size(), d_, scale_,
                           scores_.data() + omp_get_thread_num() * max_keys_, pt);
      decode::merge_partials(pt, 1, d_, scale_, out.row(b, h, 0));
    }
  }

  double state_bytes() const override {
    // the rows of the live blocks written so far, per batch element
    int64_t rows = 0;
    for (int64_t bg = 0; bg < batch_ * kv_heads_; ++bg)
      for (int64_t kb = 0; kb * bs_ < len_; ++kb)
        if (held(bg, kb)) rows += std::min(len_, (kb + 1) * bs_) - kb * bs_;
    return double(rows) / double(batch_) * 2.0 * double(d_) * sizeof(float);
  }

  double step_bytes_read() const override {
    // the distinct cached rows the group's heads read (keys and values, the new one
    // included), per (batch, head) the q row read and the out row written, per (batch, key
    // head) the new k and v rows read
    if (len_ >= cap_) return 0.0;
    plan(len_);
    int64_t rows = 0;
    std::vector<decode::Run> all;
    for (int64_t bg = 0; bg < batch_ * kv_heads_; ++bg) {
      all.clear();
      const int64_t b = bg / kv_heads_, h0 = (bg % kv_heads_) * group_;
      for (int64_t h = h0; h < h0 + group_; ++h) {
        const auto& r = runs_[size_t(b * heads_ + h)];
        all.insert(all.end(), r.begin(), r.end());
      }
      std::sort(all.begin(), all.end(),
                [](const decode::Run& x, const decode::Run& y) { return x.row < y.row; });
      int64_t end = 0;  // rows below `end` are counted
      for (const decode::Run& r : all) {
        const int64_t lo = std::max(r.row, end), hi = r.row + r.count;
        if (hi > lo) rows += hi - lo;
        end = std::max(end, hi);
      }
    }
    const double row = double(d_) * sizeof(float);
    return (2.0 * double(rows) + 2.0 * double(batch_ * heads_) + 2.0 * double(batch_ * kv_heads_)) *
           row;
  }

  double step_flops() const override {
    // 4 d per key read by a query head (the dot and the multiply-add of p_j v_j), as the
    // engine counts a score; the exponentials and the scaling are not counted
    if (len_ >= cap_) return 0.0;
    plan(len_);
    return double(keys_read_) * 4.0 * double(d_);
  }

 private:
  int64_t slot(int64_t bg, int64_t kb) const { return slot_[size_t(bg * nb_ + kb)]; }
  /// Whether block kb of (batch, key head) bg is kept at length len_: some query from
  /// min(len_, n - 1) on reads it.
  bool held(int64_t bg, int64_t kb) const {
    return last_[size_t(bg * nb_ + kb)] >= std::min(len_, cap_ - 1) / bs_;
  }
  float* key_row(int64_t bg, int64_t t) const {
    return keys_->floats() + (base_[size_t(bg)] + slot(bg, t / bs_) * bs_ + t % bs_) * d_;
  }
  float* value_row(int64_t bg, int64_t t) const {
    return values_->floats() + (base_[size_t(bg)] + slot(bg, t / bs_) * bs_ + t % bs_) * d_;
  }

  /// runs_[bh]: the cached rows query t of every (batch, head) reads, as runs of rows of its
  /// group's cache; keys_read_ their total, max_keys_ the most of one head.
  void plan(int64_t t) const {
    if (plan_t_ == t) return;
    const int64_t qb = t / bs_;
    if (lists_qb_ != qb) {
      for (int64_t bh = 0; bh < batch_ * heads_; ++bh)
        pat_->key_blocks(bh / heads_, bh % heads_, qb, lists_[size_t(bh)]);
      lists_qb_ = qb;
    }
    keys_read_ = max_keys_ = 0;
    for (int64_t bh = 0; bh < batch_ * heads_; ++bh) {
      const int64_t b = bh / heads_, h = bh % heads_, bg = b * kv_heads_ + h / group_;
      std::vector<decode::Run>& runs = runs_[size_t(bh)];
      runs.clear();
      auto add = [&](int64_t row, int64_t count) {
        if (!runs.empty() && runs.back().row + runs.back().count == row)
          runs.back().count += count;
        else
          runs.push_back({row, count});
      };
      for (const KeyBlock& kb : lists_[size_t(bh)]) {
        const int64_t j0 = kb.index * bs_, cols = std::min(t + 1, j0 + bs_) - j0;
        if (cols <= 0) break;  // sorted: the rest is past the causal diagonal
        const int64_t s = slot(bg, kb.index);
        if (s < 0)
          throw std::logic_error(fmt::format(
              "pattern decode: key block {} read at position {} was not kept", kb.index, t));
        if (!kb.partial) {
          add(s * bs_, cols);
          continue;
        }
        pat_->block_mask(b, h, t, 1, j0, cols, mask_.data());
        for (int64_t c = 0; c < cols;) {
          if (!mask_[size_t(c)]) {
            ++c;
            continue;
          }
          const int64_t c0 = c;
          while (c < cols && mask_[size_t(c)]) ++c;
          add(s * bs_ + c0, c - c0);
        }
      }
      int64_t keys = 0;
      for (const decode::Run& r : runs) keys += r.count;
      keys_read_ += keys;
      max_keys_ = std::max(max_keys_, keys);
    }
    plan_t_ = t;
  }

  int64_t batch_, heads_, kv_heads_, group_, d_, cap_, bs_, nb_, parallel_floats_;
  float scale_;
  int64_t len_;
  std::unique_ptr<SparsePattern> pat_;
  // per (batch, key head) and key block: its last reading query block (-1: none) and its slot
  // (-1: not stored); per (batch, key head): its first row in the caches
  std::vector<int64_t> last_, slot_, base_;
  // the caches of keys and values [rows, d], 64-byte aligned and uninitialised: only the rows
  // of positions written are ever read
  std::unique_ptr<kernels::AlignedBuffer> keys_, values_;
  // the next step's plan (see plan), computed once per position, and the key blocks of the
  // query block it is in, listed once per query block
  mutable std::vector<std::vector<KeyBlock>> lists_;
  mutable std::vector<std::vector<decode::Run>> runs_;
  mutable std::vector<uint8_t> mask_;
  mutable int64_t lists_qb_ = -1, plan_t_ = -1, keys_read_ = 0, max_keys_ = 0;
  // per-step workspace: each (batch, head)'s partial and each thread's scores
  std::vector<float> partials_, scores_;
};

}  // namespace

std::unique_ptr<DecodeState> pattern_decode_prefill(const Problem& p,
                                                    std::unique_ptr<SparsePattern> pattern,
                                                    ConstTensorView k, ConstTensorView v,
                                                    int64_t t0, const PatternDecodeOptions& opt) {
  check_prefill(p, k, v, t0);
  if (!pattern || pattern->block() < 1)
    throw UsageError("pattern decode: the problem has no pattern with a block size >= 1");
  return std::make_unique<PatternDecodeState>(p, std::move(pattern), k, v, t0, opt);
}

std::unique_ptr<DecodeState> FixedPatternVariant::prefill(const Problem& p, ConstTensorView k,
                                                          ConstTensorView v, int64_t t0) {
  return pattern_decode_prefill(p, make_pattern(p, {}, {}), k, v, t0);
}

}  // namespace attnbench
