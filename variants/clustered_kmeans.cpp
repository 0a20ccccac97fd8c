// clustered: the query clustering (hash planes, initial rows, Lloyd rounds on LSH codes or on
// the vectors, the final assignment) and the grouping of the queries by cluster; the attention
// itself, its backward, the oracle and the registration are in clustered.cpp.
#include "variants/clustered_kmeans.h"

#include <cblas.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "common/core/parallel_for.h"
#include "common/core/random.h"
#include "variants/clustered.h"

namespace attnbench {
namespace clustered {

uint64_t plane_stream(int64_t head) {
  return (uint64_t(0x434c5550) << 32) + uint64_t(head);
}  // "CLUP"
uint64_t init_stream(int64_t head) {
  return (uint64_t(0x434c5549) << 32) + uint64_t(head);
}  // "CLUI"

void hash_planes(uint64_t seed, int64_t head, int64_t d, int bits, float* w, float* offset) {
  const RandomStream rs(seed, plane_stream(head));
  for (int b = 0; b < bits; ++b) {
    const uint64_t base = uint64_t(b) * uint64_t(d + 1);
    for (int64_t c = 0; c < d; ++c) w[c * bits + b] = float(rs.normal(base + uint64_t(c)));
    offset[b] = float(rs.normal(base + uint64_t(d)));
  }
}

std::vector<int64_t> initial_rows(uint64_t seed, int64_t head, int64_t n, int64_t c) {
  // Floyd: for j = n - c .. n - 1 take a random t in [0, j], or j itself if t is taken
  const RandomStream rs(seed, init_stream(head));
  std::vector<uint8_t> taken(static_cast<size_t>(n), 0);
  std::vector<int64_t> rows;
  rows.reserve(size_t(c));
  for (int64_t j = n - c; j < n; ++j) {
    int64_t t = int64_t(rs.below(uint64_t(j), uint64_t(j + 1)));
    if (taken[size_t(t)]) t = j;
    taken[size_t(t)] = 1;
    rows.push_back(t);
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

namespace {

constexpr int kLanes = 32;  // queries per step of the Hamming assignment

// Codes of rows [0, rows) of q: P = Q_blk W (GEMM), bit b = P[r][b] + offset[b] > 0.
template <class Code>
void hash_block(const float* q, int64_t ld, int64_t rows, int64_t d, int bits, const float* w,
                const float* offset, float* proj, Code* codes) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), bits, int(d), 1.0f, q, int(ld),
              w, bits, 0.0f, proj, bits);
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = proj + r * bits;
    Code x = 0;
    int b = 0;
#if defined(__AVX512F__)
    for (; b + 16 <= bits; b += 16) {
      const __m512 t = _mm512_add_ps(_mm512_loadu_ps(pr + b), _mm512_loadu_ps(offset + b));
      x |= Code(_mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_GT_OQ)) << b;
    }
#endif
    for (; b < bits; ++b) x |= Code(pr[b] + offset[b] > 0.0f) << b;
    codes[r] = x;
  }
}

// Nearest centroid code for queries [i0, i1): Hamming distance, ties to the lower index.
// kLanes queries at a time against every centroid, so the distances vectorise over queries.
// Returns whether any assignment changed.
template <class Code>
bool assign_hamming(const Code* codes, int64_t i0, int64_t i1, const Code* centres, int64_t c,
                    int32_t* assign) {
  bool changed = false;
  for (int64_t i = i0; i < i1; i += kLanes) {
    const int64_t len = std::min<int64_t>(kLanes, i1 - i);
    Code x[kLanes] = {};
    int32_t best[kLanes], arg[kLanes];
    for (int64_t l = 0; l < len; ++l) x[l] = codes[i + l];
    for (int l = 0; l < kLanes; ++l) best[l] = INT32_MAX, arg[l] = 0;
    for (int64_t k = 0; k < c; ++k) {
      const Code ck = centres[k];
      for (int l = 0; l < kLanes; ++l) {
        const int32_t dist = int32_t(std::popcount(Code(x[l] ^ ck)));
        const bool closer = dist < best[l];
        best[l] = closer ? dist : best[l];
        arg[l] = closer ? int32_t(k) : arg[l];
      }
    }
    for (int64_t l = 0; l < len; ++l) {
      changed |= assign[i + l] != arg[l];
      assign[i + l] = arg[l];
    }
  }
  return changed;
}

// Bit-wise majority of each non-empty cluster's member codes (a tie gives 0); empty clusters
// keep their code. ones: c x 64 counters, size: c counters.
template <class Code>
void update_hamming(const Code* codes, int64_t n, const int32_t* assign, int64_t c, int bits,
                    Code* centres, int32_t* ones, int32_t* size) {
  std::fill(ones, ones + c * 64, 0);
  std::fill(size, size + c, 0);
  for (int64_t i = 0; i < n; ++i) {
    const Code x = codes[i];
    int32_t* o = ones + int64_t(assign[i]) * 64;
    ++size[assign[i]];
    for (int b = 0; b < int(sizeof(Code) * 8); ++b) o[b] += int32_t((x >> b) & 1);
  }
  for (int64_t k = 0; k < c; ++k) {
    if (size[k] == 0) continue;
    Code x = 0;
    for (int b = 0; b < bits; ++b) x |= Code(2 * ones[k * 64 + b] > size[k]) << b;
    centres[k] = x;
  }
}

// Nearest centroid for rows [0, rows) of q by squared Euclidean distance, through the GEMM
// S = Q_blk C^T: |q - c_k|^2 - |q|^2 = |c_k|^2 - 2 q . c_k. Ties to the lower index.
bool assign_euclid(const float* q, int64_t ld, int64_t rows, int64_t d, const float* centres,
                   const float* norms, int64_t c, float* s, int32_t* assign) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(c), int(d), -2.0f, q, int(ld),
              centres, int(d), 0.0f, s, int(c));
  bool changed = false;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = s + r * c;
    float best = INFINITY;
    int32_t arg = 0;
    for (int64_t k = 0; k < c; ++k) {
      const float dist = row[k] + norms[k];
      if (dist < best) best = dist, arg = int32_t(k);
    }
    changed |= assign[r] != arg;
    assign[r] = arg;
  }
  return changed;
}

// Means of the members of each non-empty cluster (row order, in double); empty clusters keep
// their centroid. sums: c x d, size: c.
void update_euclid(const float* q, int64_t ld, int64_t n, int64_t d, const int32_t* assign,
                   int64_t c, float* centres, float* norms, double* sums, int32_t* size) {
  std::fill(sums, sums + c * d, 0.0);
  std::fill(size, size + c, 0);
  for (int64_t i = 0; i < n; ++i) {
    double* acc = sums + int64_t(assign[i]) * d;
    const float* x = q + i * ld;
    for (int64_t t = 0; t < d; ++t) acc[t] += double(x[t]);
    ++size[assign[i]];
  }
  for (int64_t k = 0; k < c; ++k) {
    if (size[k] == 0) continue;
    for (int64_t t = 0; t < d; ++t) centres[k * d + t] = float(sums[k * d + t] / double(size[k]));
  }
  for (int64_t k = 0; k < c; ++k) {
    double nn = 0;
    for (int64_t t = 0; t < d; ++t) nn += double(centres[k * d + t]) * centres[k * d + t];
    norms[k] = float(nn);
  }
}

// Lloyd's algorithm on codes (bits > 0) of type Code; codes holds n query codes then c centroid
// codes.
template <class Code>
void lloyd_hamming(const float* q, int64_t ld, int64_t n, int64_t d, const Settings& s,
                   uint64_t seed, int64_t head, bool parallel, int64_t c, Code* codes,
                   Clusters& out) {
  // pass 1: codes of every query
  std::vector<float> planes(size_t(s.bits) * size_t(d + 1));
  hash_planes(seed, head, d, s.bits, planes.data(), planes.data() + d * s.bits);
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  parallel_for(
      blocks,
      [&] {
        return std::make_unique_for_overwrite<float[]>(size_t(std::min(kBlockRows, n) * s.bits));
      },
      [&](int64_t bl, std::unique_ptr<float[]>& proj) {
        const int64_t i0 = bl * kBlockRows, rows = std::min(kBlockRows, n - i0);
        hash_block(q + i0 * ld, ld, rows, d, s.bits, planes.data(), planes.data() + d * s.bits,
                   proj.get(), codes + i0);
      },
      {.parallel = parallel});
  // pass 2: initial centroids, Lloyd rounds, final assignment
  Code* centres = codes + n;
  const std::vector<int64_t> init = initial_rows(seed, head, n, c);
  for (int64_t k = 0; k < c; ++k) centres[k] = codes[init[size_t(k)]];
  std::vector<int32_t> ones(size_t(c * 64)), size(static_cast<size_t>(c));
  int32_t* assign = out.assign.data();
  auto assign_all = [&] {
    bool changed = false;
#pragma omp parallel for if (parallel) schedule(static) reduction(|| : changed)
    for (int64_t bl = 0; bl < blocks; ++bl) {
      const int64_t i0 = bl * kBlockRows, i1 = std::min(n, i0 + kBlockRows);
      changed = assign_hamming(codes, i0, i1, centres, c, assign) || changed;
    }
    return changed;
  };
  for (int64_t it = 0; it < s.iterations; ++it) {
    if (!assign_all()) return;  // settled: the last update changed nothing
    ++out.rounds;
    update_hamming(codes, n, assign, c, s.bits, centres, ones.data(), size.data());
  }
  assign_all();
}

void lloyd_euclid(const float* q, int64_t ld, int64_t n, int64_t d, const Settings& s,
                  uint64_t seed, int64_t head, bool parallel, int64_t c, Clusters& out) {
  const std::vector<int64_t> init = initial_rows(seed, head, n, c);
  float* centres = out.centres.data();
  for (int64_t k = 0; k < c; ++k)
    std::memcpy(centres + k * d, q + init[size_t(k)] * ld, size_t(d) * sizeof(float));
  std::vector<float> norms(static_cast<size_t>(c));
  for (int64_t k = 0; k < c; ++k) {
    double nn = 0;
    for (int64_t t = 0; t < d; ++t) nn += double(centres[k * d + t]) * centres[k * d + t];
    norms[size_t(k)] = float(nn);
  }
  std::vector<double> sums(size_t(c * d));
  std::vector<int32_t> size(static_cast<size_t>(c));
  int32_t* assign = out.assign.data();
  const int64_t blocks = (n + kBlockEuclid - 1) / kBlockEuclid;
  auto assign_all = [&] {
    std::atomic<bool> changed{false};
    parallel_for(
        blocks,
        [&] {
          return std::make_unique_for_overwrite<float[]>(size_t(std::min(kBlockEuclid, n) * c));
        },
        [&](int64_t bl, std::unique_ptr<float[]>& sbuf) {
          const int64_t i0 = bl * kBlockEuclid, rows = std::min(kBlockEuclid, n - i0);
          if (assign_euclid(q + i0 * ld, ld, rows, d, centres, norms.data(), c, sbuf.get(),
                            assign + i0))
            changed = true;
        },
        {.parallel = parallel});
    return changed.load();
  };
  for (int64_t it = 0; it < s.iterations; ++it) {
    if (!assign_all()) return;
    ++out.rounds;
    update_euclid(q, ld, n, d, assign, c, centres, norms.data(), sums.data(), size.data());
  }
  assign_all();
}

}  // namespace

void cluster_queries(const float* q, int64_t ld, int64_t n, int64_t d, const Settings& s,
                     uint64_t seed, int64_t head, bool parallel, Clusters& out) {
  const int64_t c = std::min(s.clusters, n);
  out.bits = s.bits;
  out.c = c;
  out.rounds = 0;
  out.assign.assign(size_t(n), -1);
  out.codes32.clear();
  out.codes64.clear();
  out.centres.clear();
  if (s.bits == 0) {
    out.centres.resize(size_t(c * d));
    lloyd_euclid(q, ld, n, d, s, seed, head, parallel, c, out);
  } else if (s.bits <= 32) {
    out.codes32.resize(size_t(n + c));
    lloyd_hamming(q, ld, n, d, s, seed, head, parallel, c, out.codes32.data(), out);
  } else {
    out.codes64.resize(size_t(n + c));
    lloyd_hamming(q, ld, n, d, s, seed, head, parallel, c, out.codes64.data(), out);
  }
}

void group_queries(const float* q, int64_t ld, int64_t n, int64_t d, const int32_t* assign,
                   int64_t c, Groups& out) {
  // counting sort of the rows by cluster (stable: members ascending)
  std::vector<int64_t> count(size_t(c + 1), 0);
  for (int64_t i = 0; i < n; ++i) ++count[size_t(assign[i]) + 1];
  out.cluster.clear();
  out.start.assign(1, 0);
  std::vector<int64_t> slot(static_cast<size_t>(c), -1);
  for (int64_t k = 0; k < c; ++k) {
    if (count[size_t(k) + 1] == 0) continue;
    slot[size_t(k)] = out.start.back();
    out.cluster.push_back(int32_t(k));
    out.start.push_back(out.start.back() + count[size_t(k) + 1]);
  }
  out.members.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) out.members[size_t(slot[size_t(assign[i])]++)] = int32_t(i);
  // means, accumulated in double in member order
  const int64_t groups = out.size();
  out.means.resize(size_t(groups * d));
  std::vector<double> acc(static_cast<size_t>(d));
  for (int64_t g = 0; g < groups; ++g) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t e = out.start[size_t(g)]; e < out.start[size_t(g) + 1]; ++e) {
      const float* x = q + int64_t(out.members[size_t(e)]) * ld;
      for (int64_t t = 0; t < d; ++t) acc[size_t(t)] += double(x[t]);
    }
    const double inv = 1.0 / double(out.start[size_t(g) + 1] - out.start[size_t(g)]);
    for (int64_t t = 0; t < d; ++t) out.means[size_t(g * d + t)] = float(acc[size_t(t)] * inv);
  }
}

}  // namespace clustered
}  // namespace attnbench
