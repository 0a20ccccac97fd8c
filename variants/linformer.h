// The random projections of the linformer variant (variants/linformer.cpp), exposed so that
// tests can rebuild E and F exactly as forward() does instead of duplicating the recipe.
#pragma once

#include <cstdint>

namespace attnbench::linformer {

/// RandomStream id of head h's projection: E (`f` false) or F (`f` true). Depends on the head
/// index only (not on the head count, batch item, k or m), and E and F are separate streams.
uint64_t projection_stream(int64_t head, bool f);

/// Entries of the k x m projection E (or F) of head `head` under `seed`, for the key columns
/// j0 .. j0 + count - 1, written transposed: out[(j - j0) * k + r] = E[r][j]. Entries are
/// N(0, 1/k). Entry (r, j) does not depend on m or on how the columns are chunked, and on k only
/// through the 1/sqrt(k) factor (up to float rounding), so projections of different sizes are
/// nested: the k = 64 projection is the first 64 rows of the k = 256 one, times 2.
void projection_columns(uint64_t seed, int64_t head, bool f, int64_t k, int64_t j0, int64_t count,
                        float* out);

}  // namespace attnbench::linformer
