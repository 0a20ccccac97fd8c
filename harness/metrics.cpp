#include "harness/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/reference/reference.h"

namespace attnbench {

namespace {
// Largest reference cache (the rows of every head of one problem) measure_error keeps.
constexpr double kCacheBytes = 256.0 * (1 << 20);
}  // namespace

std::vector<std::vector<int64_t>> pick_rows(const Problem& p, double exact_limit) {
  const int64_t heads = p.batch * p.heads;
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(heads));
  const double pairs = double(heads) * double(p.n) * double(p.keys());
  if (pairs <= exact_limit) {
    for (auto& r : rows) {
      r.resize(size_t(p.n));
      for (int64_t i = 0; i < p.n; ++i) r[size_t(i)] = i;
    }
    return rows;
  }
  const int64_t wanted = std::max<int64_t>(256, int64_t(exact_limit / double(p.keys())));
  const int64_t per_head =
      std::min<int64_t>(p.n, std::max<int64_t>(1, (wanted + heads - 1) / heads));
  RandomStream rs(p.seed, 0xe7707ULL);
  uint64_t draw = 0;
  for (int64_t bh = 0; bh < heads; ++bh) {
    std::unordered_set<int64_t> chosen;
    while (int64_t(chosen.size()) < per_head)
      chosen.insert(int64_t(rs.below(draw++, uint64_t(p.n))));
    rows[size_t(bh)].assign(chosen.begin(), chosen.end());
    std::sort(rows[size_t(bh)].begin(), rows[size_t(bh)].end());
  }
  return rows;
}

double error_memory_estimate(const Problem& p, double exact_limit) {
  // the reference and uniform-average rows in double (every head's when they are cached,
  // else one head's), plus the row lists
  const double heads = double(p.batch * p.heads);
  const double pairs = heads * double(p.n) * double(p.keys());
  const double per_head =
      pairs <= exact_limit
          ? double(p.n)
          : std::min(double(p.n),
                     std::ceil(std::max(256.0, exact_limit / double(p.keys())) / heads));
  const double all = heads * per_head * (double(p.dim) * 16.0 + 8.0);
  const double held = all <= kCacheBytes ? all : per_head * (double(p.dim) * 16.0 + 8.0);
  return held + heads * per_head * 8.0 + double(p.keys()) * 8.0 * 2;
}

namespace {

// 64-bit hash of everything the reference rows depend on besides the problem's name: the
// inputs, the score weights and the mask, word by word.
class InputHash {
 public:
  void add(const void* data, size_t bytes) {
    const auto* c = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
      uint64_t w;
      std::memcpy(&w, c + i, 8);
      mix(w);
    }
    uint64_t tail = 0;
    if (bytes > i) std::memcpy(&tail, c + i, bytes - i);  // an empty vector's data() may be null
    mix(tail ^ (uint64_t(bytes) << 56));
  }
  void add(ConstTensorView t) {
    for (int64_t b = 0; b < t.shape.batch; ++b)
      for (int64_t h = 0; h < t.shape.heads; ++h)
        for (int64_t i = 0; i < t.shape.len; ++i)
          add(t.row(b, h, i), size_t(t.shape.dim) * sizeof(float));
  }
  uint64_t value() const { return h_; }

 private:
  void mix(uint64_t w) {
    h_ ^= w * 0x9e3779b97f4a7c15ULL;
    h_ = ((h_ << 29) | (h_ >> 35)) * 0xbf58476d1ce4e5b9ULL;
  }
  uint64_t h_ = 0x243f6a8885a308d3ULL;
};

// The reference and uniform-average rows of one problem on its inputs, for every head. They do
// not depend on the variant, and a sweep measures its variants one after another on the same
// problem and inputs, so the last problem's rows are kept and reused (up to kCacheBytes).
struct ReferenceRows {
  std::string problem;
  uint64_t inputs = 0;
  double exact_limit = 0;
  std::vector<std::vector<int64_t>> rows;
  std::vector<std::vector<double>> ref, uni;  // per head b * H + h: rows x d
  std::vector<std::vector<double>> lse;       // per head: each row's log-sum-exp
};

std::mutex cache_mutex;
std::shared_ptr<const ReferenceRows> cached_rows;

// Rows picked for every head, rows x d doubles each for the reference and the uniform average.
double rows_bytes(const std::vector<std::vector<int64_t>>& rows, int64_t d) {
  double n = 0;
  for (const auto& r : rows) n += double(r.size());
  return n * (double(d) * 16.0 + 8.0);
}

// The cached rows of this problem on these inputs, computing and caching them when they fit
// kCacheBytes; null (nothing cached) when they do not.
std::shared_ptr<const ReferenceRows> reference_for(const Problem& p, ConstTensorView q,
                                                   ConstTensorView k, ConstTensorView v,
                                                   double exact_limit,
                                                   const std::vector<std::vector<int64_t>>& rows) {
  if (rows_bytes(rows, p.dim) > kCacheBytes) return nullptr;
  InputHash hash;
  for (auto t : {q, k, v}) hash.add(t);
  if (const auto* w = p.score_weights.get())
    for (const auto* x : {&w->w_bilinear, &w->w_q, &w->w_k, &w->w_score})
      hash.add(x->data(), x->size() * sizeof(float));
  if (const auto* m = p.attn_mask.get()) hash.add(m->bias.data(), m->bias.size() * sizeof(float));
  hash.add(p.key_lengths.data(), p.key_lengths.size() * sizeof(int64_t));
  const std::string name = p.str() + p.score_str() + mask_suffix(p);
  {
    std::lock_guard lock(cache_mutex);
    if (cached_rows && cached_rows->problem == name && cached_rows->inputs == hash.value() &&
        cached_rows->exact_limit == exact_limit && cached_rows->rows == rows)
      return cached_rows;
  }
  auto r = std::make_shared<ReferenceRows>();
  r->problem = name, r->inputs = hash.value(), r->exact_limit = exact_limit, r->rows = rows;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const auto& hr = rows[size_t(b * p.heads + h)];
      auto& ref = r->ref.emplace_back(hr.size() * size_t(p.dim));
      auto& lse = r->lse.emplace_back(hr.size());
      reference_rows(p, q, k, v, b, h, hr, ref.data(), nullptr, lse.data());
      auto& uni = r->uni.emplace_back(ref.size());
      uniform_rows(p, k, v, b, h, hr, uni.data());
    }
  std::lock_guard lock(cache_mutex);
  cached_rows = r;
  return r;
}

}  // namespace

ErrorStats measure_error(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         ConstTensorView out, double exact_limit, const SparsePattern* pattern) {
  return measure_error_on_rows(p, q, k, v, out, pick_rows(p, exact_limit), exact_limit, pattern);
}

ErrorStats measure_error_on_rows(const Problem& p, ConstTensorView q, ConstTensorView k,
                                 ConstTensorView v, ConstTensorView out,
                                 const std::vector<std::vector<int64_t>>& rows, double exact_limit,
                                 const SparsePattern* pattern) {
  const int64_t d = p.dim;
  const auto cached = reference_for(p, q, k, v, exact_limit, rows);
  ErrorStats e;
  e.rows_total = p.batch * p.heads * p.n;
  double diff2 = 0, ref2 = 0, uni2 = 0, cos_sum = 0, mass_sum = 0, mass_min = INFINITY;
  std::vector<double> ref_head, uni_head, lse_head;  // one head's rows when nothing is cached
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h) {
      const auto& r = rows[size_t(b * p.heads + h)];
      if (!cached) {
        ref_head.resize(r.size() * size_t(d));
        lse_head.resize(r.size());
        reference_rows(p, q, k, v, b, h, r, ref_head.data(), nullptr, lse_head.data());
        uni_head.resize(ref_head.size());
        uniform_rows(p, k, v, b, h, r, uni_head.data());
      }
      const auto& ref = cached ? cached->ref[size_t(b * p.heads + h)] : ref_head;
      const auto& uni = cached ? cached->uni[size_t(b * p.heads + h)] : uni_head;
      const auto& lse = cached ? cached->lse[size_t(b * p.heads + h)] : lse_head;
      for (size_t t = 0; t < ref.size(); ++t) uni2 += (uni[t] - ref[t]) * (uni[t] - ref[t]);
      for (size_t t = 0; t < r.size(); ++t) {
        const float* o = out.row(b, h, r[t]);
        const double* o_ref = ref.data() + t * size_t(d);
        double dot = 0, nn = 0, nr = 0;
        for (int64_t c = 0; c < d; ++c) {
          const double a = o[c], x = o_ref[c];
          if (!std::isfinite(a) || !std::isfinite(x))
            throw Error(fmt::format(
                "the error cannot be measured: {} holds a non-finite value ({}) at batch {}, "
                "head {}, row {}, feature {}",
                std::isfinite(x) ? "the output" : "the float64 reference", std::isfinite(x) ? a : x,
                b, h, r[t], c));
          diff2 += (a - x) * (a - x);
          ref2 += x * x;
          dot += a * x;
          nn += a * a;
          nr += x * x;
          e.max_abs = std::max(e.max_abs, std::abs(a - x));
        }
        if (nn == 0 && nr == 0)
          cos_sum += 1;
        else if (nn > 0 && nr > 0)
          cos_sum += dot / (std::sqrt(nn) * std::sqrt(nr));
      }
      e.rows_used += int64_t(r.size());
      if (pattern)
        for (double x : pattern_mass(p, q, k, *pattern, b, h, r, lse)) {
          mass_sum += x;
          mass_min = std::min(mass_min, x);
        }
    }
  if (pattern && e.rows_used) {
    e.mass_mean = mass_sum / double(e.rows_used);
    e.mass_min = mass_min;
  }
  e.rel_fro = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  e.uniform_rel_fro = ref2 > 0 ? std::sqrt(uni2 / ref2) : std::sqrt(uni2);
  e.mean_cos = e.rows_used ? cos_sum / double(e.rows_used) : 0;
  // finite values can still overflow the sums of squares (|values| ~ 1e154 and more are
  // impossible in float, but a NaN error must never be reported as a result)
  if (!std::isfinite(e.rel_fro) || !std::isfinite(e.max_abs) || !std::isfinite(e.mean_cos))
    throw Error(
        fmt::format("the error against the reference is not finite (rel_fro {}, "
                    "max_abs {}, mean_cos {})",
                    e.rel_fro, e.max_abs, e.mean_cos));
  return e;
}

std::vector<int64_t> pick_gradient_heads(const Problem& p, double exact_limit) {
  const int64_t heads = p.batch * p.heads;
  const double per_head = double(p.n) * double(p.keys());
  std::vector<int64_t> chosen;
  if (per_head > exact_limit) return chosen;
  const int64_t wanted = std::min<int64_t>(heads, int64_t(exact_limit / per_head));
  if (wanted == heads) {
    for (int64_t bh = 0; bh < heads; ++bh) chosen.push_back(bh);
    return chosen;
  }
  RandomStream rs(p.seed, 0x67ad1e7dULL);
  std::unordered_set<int64_t> seen;
  for (uint64_t draw = 0; int64_t(seen.size()) < wanted; ++draw)
    seen.insert(int64_t(rs.below(draw, uint64_t(heads))));
  chosen.assign(seen.begin(), seen.end());
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

GradErrorStats measure_grad_error(const Problem& p, ConstTensorView q, ConstTensorView k,
                                  ConstTensorView v, ConstTensorView dout, ConstTensorView dq,
                                  ConstTensorView dk, ConstTensorView dv, double exact_limit) {
  GradErrorStats st;
  const std::vector<int64_t> heads = pick_gradient_heads(p, exact_limit);
  if (heads.empty()) return st;
  const int64_t d = p.dim;
  // squared norms of the differences and of the reference, per tensor
  double diff[3] = {0, 0, 0}, ref[3] = {0, 0, 0};
  const char* names[3] = {"dq", "dk", "dv"};
  // Grouped key/value heads: dk and dv of a key/value head are the sums over the query heads
  // of its group, compared once per (batch, key/value head).
  const int64_t group = p.kv_group();
  std::set<int64_t> kv_done;
  for (const int64_t bh : heads) {
    const int64_t b = bh / p.heads, h = bh % p.heads;
    HeadGradients g = reference_head_gradients(p, q, k, v, dout, b, h);
    const bool kv_first = kv_done.insert(b * p.heads + p.kv_head(h)).second;
    if (group > 1 && kv_first)
      for (int64_t r = p.kv_head(h) * group; r < (p.kv_head(h) + 1) * group; ++r) {
        if (r == h) continue;
        const HeadGradients o = reference_head_gradients(p, q, k, v, dout, b, r);
        for (size_t e = 0; e < g.dk.size(); ++e) g.dk[e] += o.dk[e], g.dv[e] += o.dv[e];
      }
    const std::vector<double>* want[3] = {&g.dq, &g.dk, &g.dv};
    const ConstTensorView got[3] = {dq, dk, dv};
    for (int t = 0; t < (kv_first ? 3 : 1); ++t) {
      const int64_t rows = t == 0 ? p.n : p.keys();
      for (int64_t i = 0; i < rows; ++i) {
        const float* r = got[t].row(b, h, i);
        const double* w = want[t]->data() + i * d;
        for (int64_t c = 0; c < d; ++c) {
          if (!std::isfinite(r[c]))
            throw Error(fmt::format("{} holds a non-finite value ({}) at [{}, {}, {}, {}]",
                                    names[t], r[c], b, h, i, c));
          const double e = double(r[c]) - w[c];
          diff[t] += e * e;
          ref[t] += w[c] * w[c];
        }
      }
    }
  }
  double err[3];
  for (int t = 0; t < 3; ++t) {
    // a zero reference (e.g. every row masked): the error is the gradient's own norm
    err[t] = ref[t] > 0 ? std::sqrt(diff[t] / ref[t]) : std::sqrt(diff[t]);
    if (!std::isfinite(err[t]))
      throw Error(fmt::format("the {} gradient error is not finite", names[t]));
  }
  st.q = err[0], st.k = err[1], st.v = err[2];
  st.heads = int64_t(heads.size());
  return st;
}

double grad_error_memory_estimate(const Problem& p) {
  // one head's dq, dk, dv in double, and the reference's row blocks (P, dS: 128 x m doubles
  // each, plus 128 x d)
  const double n = double(p.n), m = double(p.keys()), d = double(p.dim);
  // (with grouped key/value heads, another head's gradients while the group's are summed)
  return (p.kv_group() > 1 ? 2.0 : 1.0) * (n + 2 * m) * d * 8.0 + 2 * 128.0 * m * 8.0 +
         128.0 * d * 8.0 + double(p.n) * 8.0;
}

}  // namespace attnbench
