// The arithmetic of one decode step's query over cached rows, shared by the decode states of
// exact softmax attention (common/decode/kv_decode.h, common/decode/pattern_decode.h). Internal to
// libattnbench (not installed).
//
// A query q attends rows of a cache held as runs of contiguous rows (keys kh, values vh, d
// floats a row). The partial of a set of runs is
//   s_j = q . k_j,  M = max s_j,  l = sum_j exp((s_j - M) scale),  acc = sum_j exp(..) v_j
// with the max subtracted before scaling, as the tiled engine does; partials of disjoint sets
// merge by their log-sum-exps (merge_partials), so a head's keys may be cut into chunks.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attnbench::decode {

/// Throws UsageError unless a step's k (and v, which check_step holds alike) is grouped by
/// `group`, the grouping of a state holding `kv_heads` key/value heads.
void check_step_group(int64_t k_group, int64_t group, int64_t kv_heads);

/// `count` contiguous cached rows from row `row` of a head's keys and values.
struct Run {
  int64_t row, count;
};

/// sc[j] = q . k_j for `len` contiguous rows k_j = k + j d.
void dots(const float* q, const float* k, int64_t len, int64_t d, float* sc);
/// acc += sum_j w_j v_j for `len` contiguous rows v_j = v + j d.
void accumulate(const float* w, const float* v, int64_t len, int64_t d, float* acc);

/// The partial of q over `runs` (rows of kh and vh): part = {M, l, acc[d]}; sc holds the
/// runs' total count of floats. No run (or rows of count 0 only) gives {-inf, 0, 0 ..}.
void runs_partial(const float* q, const float* kh, const float* vh, const Run* runs,
                  size_t run_count, int64_t d, float scale, float* sc, float* part);

/// out[d] = the `chunks` partials (d + 2 floats each, back to back) merged by their
/// log-sum-exps: out = sum_c e_c acc_c / sum_c e_c l_c, e_c = exp((M_c - max M) scale).
/// Partials of no key are passed over; when every one is empty, out = 0 (a row that attends no
/// key, as the engine writes it).
void merge_partials(const float* parts, int64_t chunks, int64_t d, float scale, float* out);

/// out = the exact softmax attention of one query q over `len` contiguous rows of d floats
/// of keys and values, by the arithmetic above (one chunk, no merge):
/// s_j = q . k_j, out = sum_j exp((s_j - max s) scale) v_j / sum_j exp((s_j - max s) scale).
/// sc is a buffer of len floats; len = 0 gives out = 0. For decode states that attend a
/// contiguous block of rows of their own (compressed's pooled keys and values).
void attend_rows(const float* q, const float* keys, const float* values, int64_t len, int64_t d,
                 float scale, float* sc, float* out);

}  // namespace attnbench::decode
