// reformer: the hashing (rotations, buckets, plans) and the exact oracle on frozen buckets;
// the attention itself, its backward and the registration are in reformer.cpp.
#include <cblas.h>

#include "variants/reformer.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <memory>
#include <numeric>
#include <optional>

#include "common/core/backward.h"
#include "common/core/error.h"
#include "common/core/parallel_for.h"
#include "common/core/phase.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/core/tensor.h"
#include "common/core/threads.h"
#include "common/kernels/tile_attention.h"
#include "common/patterns/row_pattern.h"
#include "common/reference/oracle.h"

namespace attnbench {
namespace reformer {

std::vector<int64_t> auto_buckets(int64_t n, int64_t chunk) {
  const int64_t target = 2 * (n / chunk);
  const int pw = target < 2 ? 1 : int(std::bit_width(uint64_t(target))) - 1;
  const int64_t buckets = int64_t(1) << pw;
  const int64_t root = int64_t(std::sqrt(double(n / chunk)));
  const int64_t limit = 2 * std::max(root, chunk);
  if (buckets > limit) return {int64_t(1) << (pw / 2), int64_t(1) << (pw - pw / 2)};
  return {buckets};
}

std::vector<float> rotations(uint64_t seed, int64_t head, int64_t round, int64_t d,
                             const std::vector<int64_t>& factors) {
  int64_t cols = 0;
  for (int64_t f : factors) cols += f / 2;
  const RandomStream rs(seed, 0x7265666f726d6572ULL ^ (uint64_t(head) << 20) ^ uint64_t(round));
  std::vector<float> r(static_cast<size_t>(d * cols));
  // entry (x, c) is number c * 4096 + x of the stream: independent of d up to 4096
  for (int64_t x = 0; x < d; ++x)
    for (int64_t c = 0; c < cols; ++c)
      r[size_t(x * cols + c)] = float(rs.normal(uint64_t(c * 4096 + x)));
  return r;
}

int64_t bucket_of(const float* proj, const std::vector<int64_t>& factors) {
  int64_t bucket = 0, mult = 1, off = 0;
  for (int64_t f : factors) {
    const int64_t half = f / 2;
    if (half == 0) continue;  // a factor of 1: one bucket, nothing to hash
    const float* x = proj + off;
    // the largest and the smallest projection; the negative half [-xR] comes after the
    // positive one, so it wins only if -min is strictly larger than max
    float hi = x[0], lo = x[0];
    int64_t c = 1;
#ifdef __AVX512F__
    if (half >= 16) {
      __m512 vh = _mm512_loadu_ps(x), vl = vh;
      for (c = 16; c + 16 <= half; c += 16) {
        const __m512 t = _mm512_loadu_ps(x + c);
        vh = _mm512_max_ps(vh, t);
        vl = _mm512_min_ps(vl, t);
      }
      hi = _mm512_reduce_max_ps(vh);
      lo = _mm512_reduce_min_ps(vl);
    }
#endif
    for (; c < half; ++c) {
      hi = std::max(hi, x[c]);
      lo = std::min(lo, x[c]);
    }
    const bool negative = -lo > hi;
    const float target = negative ? lo : hi;
    int64_t idx = 0;
    while (idx + 1 < half && x[idx] != target) ++idx;  // the first occurrence
    bucket += (negative ? half + idx : idx) * mult;
    mult *= f;
    off += half;
  }
  return bucket;
}

Plan plan(int64_t n, const std::vector<int64_t>& buckets, int64_t hashes, int64_t chunk) {
  Plan pl;
  pl.factors = buckets.empty() ? auto_buckets(n, chunk) : buckets;
  for (int64_t f : pl.factors) {
    pl.buckets *= f;
    pl.cols += f / 2;
  }
  pl.chunk = std::min(chunk, n);
  pl.hashes = hashes;
  pl.chunks = (n + pl.chunk - 1) / pl.chunk;
  return pl;
}

Plan plan(const Problem& p, const std::vector<int64_t>& buckets, int64_t hashes, int64_t chunk) {
  return plan(p.n, buckets, hashes, chunk);
}

void hash_rows(const Plan& pl, uint64_t seed, int64_t head, const float* q, int64_t ld, int64_t n,
               int64_t d, int32_t* bucket) {
  const int64_t c = pl.hashes * pl.cols;
  if (c == 0) {  // one bucket: nothing to hash
    std::fill(bucket, bucket + pl.hashes * n, 0);
    return;
  }
  std::vector<float> rot(static_cast<size_t>(d * c));
  for (int64_t r = 0; r < pl.hashes; ++r) {
    const auto part = rotations(seed, head, r, d, pl.factors);
    for (int64_t x = 0; x < d; ++x)
      std::copy_n(part.begin() + x * pl.cols, pl.cols, rot.begin() + x * c + r * pl.cols);
  }
  parallel_for(
      (n + kHashRows - 1) / kHashRows, [&] { return std::vector<float>(size_t(kHashRows * c)); },
      [&](int64_t blk, std::vector<float>& proj) {
        const int64_t i0 = blk * kHashRows;
        const int64_t rows = std::min(kHashRows, n - i0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(c), int(d), 1.0f,
                    q + i0 * ld, int(ld), rot.data(), int(c), 0.0f, proj.data(), int(c));
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t r = 0; r < pl.hashes; ++r)
            bucket[r * n + i0 + t] =
                int32_t(bucket_of(proj.data() + t * c + r * pl.cols, pl.factors));
      });
}

std::vector<int32_t> hash_all(const Problem& p, const std::vector<int64_t>& buckets, int64_t hashes,
                              int64_t chunk, ConstTensorView q) {
  const int64_t n = p.n;
  std::vector<int32_t> bucket(static_cast<size_t>(p.batch * p.heads * hashes * n), 0);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t L = valid_tokens(p, b);
    if (L == 0) continue;  // nothing is hashed: every row is zero
    const Plan pl = plan(L, buckets, hashes, chunk);
    for (int64_t h = 0; h < p.heads; ++h)
      hash_rows(pl, p.seed, h, q.row(b, h, 0), q.stride_row, n, p.dim,
                bucket.data() + (b * p.heads + h) * hashes * n);
  }
  return bucket;
}

std::vector<double> oracle(const Problem& p, const std::vector<int64_t>& buckets, int64_t hashes,
                           int64_t chunk, ConstTensorView q, ConstTensorView v,
                           std::vector<std::vector<int64_t>>* attended) {
  return oracle_on_buckets(p, buckets, hashes, chunk, hash_all(p, buckets, hashes, chunk, q), q, v,
                           attended);
}

std::vector<double> oracle_on_buckets(const Problem& p, const std::vector<int64_t>& buckets,
                                      int64_t hashes, int64_t chunk,
                                      const std::vector<int32_t>& bucket, ConstTensorView q,
                                      ConstTensorView v,
                                      std::vector<std::vector<int64_t>>* attended) {
  constexpr double kSelfLogit = -1e5;
  const int64_t n = p.n, d = p.dim, R = hashes;
  if (bucket.size() != size_t(p.batch * p.heads * R * n))
    throw UsageError(fmt::format(
        "reformer::oracle_on_buckets: {} bucket numbers given, expected batch x heads x hashes x "
        "n = {} x {} x {} x {}",
        bucket.size(), p.batch, p.heads, R, n));
  std::vector<double> out(size_t(p.q_shape().numel()), 0.0);
  if (attended != nullptr) attended->assign(size_t(p.batch * p.heads * n), {});
  std::vector<int64_t> order, rank, window, seen;
  std::vector<double> inv_norm(static_cast<size_t>(n)), logit;
  // per round: the output row of every token (n x d) and its log-sum-exp (n)
  std::vector<double> o_round(static_cast<size_t>(R * n * d)), lse(static_cast<size_t>(R * n));
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t L = valid_tokens(p, b);
    if (L == 0) continue;  // no keys: zero rows
    const Plan pl = plan(L, buckets, hashes, chunk);
    const int64_t ch = pl.chunk, nch = pl.chunks;
    for (int64_t h = 0; h < p.heads; ++h) {
      const int32_t* head_bucket = bucket.data() + (b * p.heads + h) * R * n;
      for (int64_t j = 0; j < n; ++j) {
        double nn = 0;
        for (int64_t x = 0; x < d; ++x) nn += double(q.row(b, h, j)[x]) * double(q.row(b, h, j)[x]);
        inv_norm[size_t(j)] = nn > 0 ? 1.0 / std::sqrt(nn) : 0.0;
      }
      std::vector<int64_t>* keys =
          attended != nullptr ? attended->data() + (b * p.heads + h) * n : nullptr;
      for (int64_t r = 0; r < R; ++r) {
        const int32_t* bk = head_bucket + r * n;
        order.resize(size_t(L));  // the valid tokens by (bucket, position)
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t x, int64_t y) { return bk[x] < bk[y]; });
        rank.resize(size_t(L));
        for (int64_t s = 0; s < L; ++s) rank[size_t(order[size_t(s)])] = s;
        for (int64_t i = 0; i < n; ++i) {
          int64_t c;  // the chunk of row i
          if (i < L) {
            c = rank[size_t(i)] / ch;
          } else {  // after the last valid token with a bucket <= its own
            int64_t before = 0;
            for (int64_t j = 0; j < L; ++j) before += bk[j] <= bk[i];
            c = before == 0 ? 0 : (before - 1) / ch;
          }
          window.clear();
          for (int64_t cc : {c, nch > 1 ? (c + nch - 1) % nch : int64_t(-1)}) {
            if (cc < 0) continue;
            for (int64_t t = cc * ch; t < std::min(L, (cc + 1) * ch); ++t)
              window.push_back(order[size_t(t)]);
          }
          seen.clear();
          for (int64_t j : window)
            if (j != i && j < p.visible(b, i)) seen.push_back(j);
          double* o = o_round.data() + (r * n + i) * d;
          double& l = lse[size_t(r * n + i)];
          const float* qi = q.row(b, h, i);
          if (seen.empty()) {  // nothing but itself: its own value at the self logit
            for (int64_t x = 0; x < d; ++x) o[x] = double(v.row(b, h, i)[x]);
            l = kSelfLogit;
            continue;
          }
          logit.assign(seen.size(), 0.0);
          for (size_t e = 0; e < seen.size(); ++e) {
            const float* qj = q.row(b, h, seen[e]);
            double dot = 0;
            for (int64_t x = 0; x < d; ++x) dot += double(qi[x]) * double(qj[x]);
            logit[e] = dot * inv_norm[size_t(seen[e])];
          }
          const double mx = *std::max_element(logit.begin(), logit.end());
          double z = 0;
          for (double& w : logit) z += (w = std::exp(w - mx));
          std::fill(o, o + d, 0.0);
          for (size_t e = 0; e < seen.size(); ++e) {
            const float* vj = v.row(b, h, seen[e]);
            for (int64_t x = 0; x < d; ++x) o[x] += logit[e] / z * double(vj[x]);
          }
          l = mx + std::log(z);
          if (keys != nullptr) keys[i].insert(keys[i].end(), seen.begin(), seen.end());
        }
      }
      // rounds weighted by softmax_r(lse_r)
      double* dst = out.data() + (b * p.heads + h) * n * d;
      for (int64_t i = 0; i < n; ++i) {
        double mx = -INFINITY, z = 0;
        for (int64_t r = 0; r < R; ++r) mx = std::max(mx, lse[size_t(r * n + i)]);
        for (int64_t r = 0; r < R; ++r) z += std::exp(lse[size_t(r * n + i)] - mx);
        for (int64_t r = 0; r < R; ++r) {
          const double w = std::exp(lse[size_t(r * n + i)] - mx) / z;
          const double* o = o_round.data() + (r * n + i) * d;
          for (int64_t x = 0; x < d; ++x) dst[i * d + x] += w * o[x];
        }
        if (keys != nullptr) {
          std::sort(keys[i].begin(), keys[i].end());
          keys[i].erase(std::unique(keys[i].begin(), keys[i].end()), keys[i].end());
          if (keys[i].empty()) keys[i].push_back(i);
        }
      }
    }
  }
  return out;
}

}  // namespace reformer
}  // namespace attnbench
