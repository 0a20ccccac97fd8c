// Splitting the keys of every (batch, head) into contiguous runs of whole chunks, so that
// B H splits tasks keep every thread busy even with fewer heads than threads; each task's
// partial result is merged per head afterwards.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "common/core/problem.h"
#include "common/core/threads.h"

namespace attnbench {

struct KeySplit {
  int64_t threads = 1;  ///< OpenMP threads available
  int64_t chunks = 1;   ///< chunks of chunk_keys keys (the last one ragged)
  int64_t splits = 1;   ///< runs of chunks per (batch, head): enough for every thread
  int64_t tasks = 1;    ///< B H splits

  KeySplit() = default;
  KeySplit(const Problem& p, int64_t chunk_keys)
      : threads(team_threads()), chunks((p.keys() + chunk_keys - 1) / chunk_keys) {
    const int64_t bh = p.batch * p.heads;
    splits = std::min(chunks, std::max<int64_t>(1, (threads + bh - 1) / bh));
    tasks = bh * splits;
  }
  /// Split sp holds chunks [first_chunk(sp), first_chunk(sp + 1)).
  int64_t first_chunk(int64_t sp) const { return sp * chunks / splits; }
};

}  // namespace attnbench
