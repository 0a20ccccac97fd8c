// One query tile attending a few key blocks, for variants that gather their own rows (hash
// chunks, clusters) instead of walking a pattern over the original layout: a thin wrapper of
// the flash tile passes (common/kernels/attention_kernels.h), AVX-512 or portable, that also hands
// back each row's log-sum-exp so that several partial softmaxes can be combined exactly.
//
//   TileAttention t(max_rows, max_cols, d, scale);   // one per thread
//   t.begin(q0, ldq, rows);
//   t.attend(k0, ldk, v0, ldv, cols, mask);          // any number of key blocks
//   t.finish(out0, ldo, lse);                        // false: some output not finite
//
// finish returns false when an output is not finite: NaN/inf inputs, a logit past float, or
// an accumulator that overflowed on v near FLT_MAX. For the last, run the tile again from
// begin with pscale = kernels::safe_pscale(keys attended), as the exact variants do.
//
// Row r of the tile attends key c of a block iff mask is null or mask[r * cols + c] != 0
// (fill t.mask() for that). A row that attended no key gets output 0 and lse -inf.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/kernels/attention_kernels.h"

namespace attnbench {

class TileAttention {
 public:
  /// Tiles of up to max_rows query rows and max_cols keys per block; logits are
  /// scale * q . k (scale = 1/sqrt(d) for softmax attention).
  TileAttention(int64_t max_rows, int64_t max_cols, int64_t d, float scale)
#ifdef __AVX512F__
      : tl_(max_rows, max_cols, d),
        buf_(bytes(max_rows, max_cols, d)),
        w_(tl_, buf_.floats()),
        mask_(buf_.bytes() + tl_.bytes()),
        scale_(scale * kernels::kLog2e){}
#else
      : w_(max_rows, max_cols, d),
        mask_buf_(size_t(kernels::mask_tile_bytes(max_rows, max_cols))),
        mask_(mask_buf_.data()),
        d_(d),
        scale_(scale) {
  }
#endif

        /// Heap bytes one TileAttention holds.
        static int64_t bytes(int64_t max_rows, int64_t max_cols, int64_t d) {
#ifdef __AVX512F__
    return kernels::Tiles(max_rows, max_cols, d).bytes() +
           kernels::mask_tile_bytes(max_rows, max_cols);
#else
    return kernels::portable::floats(max_rows, max_cols, d) * int64_t(sizeof(float)) +
           kernels::mask_tile_bytes(max_rows, max_cols);
#endif
  }

  /// The element-mask tile (rows x cols bytes of the next attend call).
  uint8_t* mask() { return mask_; }

  void begin(const float* q0, int64_t ldq, int64_t rows, float pscale = 1.0f) {
    rows_ = rows;
    pscale_ = pscale;
#ifdef __AVX512F__
    kernels::begin_tile(tl_, w_, q0, ldq, rows);
#else
    q0_ = q0;
    ldq_ = ldq;
    kernels::portable::begin_tile(w_, rows);
#endif
  }

  void attend(const float* k0, int64_t ldk, const float* v0, int64_t ldv, int64_t cols,
              const uint8_t* mask) {
    constexpr int64_t kEveryKey = int64_t(1) << 60;
#ifdef __AVX512F__
    kernels::attend_block(tl_, w_, rows_, k0, ldk, v0, ldv, cols, scale_, kEveryKey, mask, pscale_);
#else
    kernels::portable::attend_block(w_, q0_, ldq_, rows_, d_, k0, ldk, v0, ldv, cols, scale_,
                                    kEveryKey, mask, pscale_);
#endif
  }

  /// out row r (at out0 + r ldo) = the row's softmax output; lse[r] = natural log of the sum
  /// of exp(logit) over the keys the row attended (-inf if none). Returns whether every
  /// output is finite. (The running max mx is in raw score units, l is scaled by pscale.)
  bool finish(float* out0, int64_t ldo, float* lse) {
#ifdef __AVX512F__
    const bool finite = kernels::finish_tile(tl_, w_, rows_, out0, ldo);
    constexpr float kLn2 = 0.693147180559945309f;
    for (int64_t r = 0; r < rows_; ++r)
      lse[r] = w_.l[r] > 0 ? (w_.mx[r] * scale_ + std::log2(w_.l[r] / pscale_)) * kLn2
                           : -std::numeric_limits<float>::infinity();
#else
    const bool finite = kernels::portable::finish_tile(w_, rows_, d_, out0, ldo);
    for (int64_t r = 0; r < rows_; ++r)
      lse[r] = w_.l[r] > 0 ? w_.mx[r] * scale_ + std::log(w_.l[r] / pscale_)
                           : -std::numeric_limits<float>::infinity();
#endif
    return finite;
  }

 private:
#ifdef __AVX512F__
  kernels::Tiles tl_;
  kernels::AlignedBuffer buf_;
  kernels::Workspace w_;
  uint8_t* mask_;
#else
  kernels::portable::Workspace w_;
  std::vector<uint8_t> mask_buf_;
  uint8_t* mask_;
  const float* q0_ = nullptr;
  int64_t ldq_ = 0, d_;
#endif
  float scale_, pscale_ = 1.0f;
  int64_t rows_ = 0;
};

}  // namespace attnbench
