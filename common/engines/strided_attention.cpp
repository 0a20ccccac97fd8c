#include "common/engines/strided_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/parallel_for.h"
#include "common/core/threads.h"
#include "common/kernels/additive_score.h"
#include "common/patterns/strided_pattern.h"

namespace attnbench {
namespace {

/// Residue class r: its queries first_query + u stride (u < rows) and its keys r + t stride
/// (t < keys).
struct ResidueClass {
  int64_t r = 0, first_query = 0, rows = 0, keys = 0;
};

/// The class of query u (u < min(n, s)): the first min(n, s) queries fall in distinct classes,
/// and every class holding a query holds one of them. Classes without queries have nothing to
/// compute.
ResidueClass query_class(const Problem& p, int64_t s, int64_t u) {
  const int64_t n = p.n, m = p.keys();
  ResidueClass c;
  c.r = pmod(u + (m - n), s);  // a(u) mod s
  c.first_query = u;
  c.rows = (n - 1 - u) / s + 1;
  c.keys = c.r < m ? (m - 1 - c.r) / s + 1 : 0;
  return c;
}

/// Number of classes holding a query.
int64_t query_classes(const Problem& p, int64_t s) { return std::min(p.n, s); }

/// The problem of class c (rows x keys; key padding and attention mask restricted to it).
Problem class_problem(const Problem& p, int64_t s, const ResidueClass& c) {
  Problem sub = p;
  sub.n = c.rows;
  sub.m = c.keys;
  for (int64_t& len : sub.key_lengths)
    len = len > c.r ? std::min(c.keys, (len - 1 - c.r) / s + 1) : 0;
  if (p.attn_mask) {
    const AttnMask& am = *p.attn_mask;
    auto cm = std::make_shared<AttnMask>();
    cm->batch = am.batch, cm->heads = am.heads, cm->n = c.rows, cm->m = c.keys;
    cm->is_bool = am.is_bool, cm->name = am.name;
    cm->bias.resize(size_t(am.batch * am.heads * c.rows * c.keys));
    float* dst = cm->bias.data();
    for (int64_t b = 0; b < am.batch; ++b)
      for (int64_t h = 0; h < am.heads; ++h)
        for (int64_t u = 0; u < c.rows; ++u)
          for (int64_t t = 0; t < c.keys; ++t)
            *dst++ = am.at(b, h, c.first_query + u * s, c.r + t * s);
    sub.attn_mask = std::move(cm);
  }
  return sub;
}

/// View of rows first, first + s, ... (len of them) of every head of x.
template <class T>
View4<T> every_sth_row(View4<T> x, int64_t first, int64_t s, int64_t len) {
  x.data = x.row(0, 0, first);
  x.shape.len = len;
  x.stride_row *= s;
  return x;
}

/// The band of a class problem: limit / s keys on each side (none without a limit).
int64_t class_limit(int64_t s, int64_t limit) { return limit < 0 ? -1 : limit / s; }

void run_class(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out, int64_t s, int64_t limit, int64_t block, const LseView* lse,
               const ResidueClass& c) {
  TensorView o = every_sth_row(out, c.first_query, s, c.rows);
  LseView l;
  if (lse) {
    l = {&lse->at(0, 0, c.first_query), lse->stride_b, lse->stride_h, lse->stride_row * s};
    if (lse->max) l.max = &lse->max_at(0, 0, c.first_query);
  }
  if (c.keys == 0) {  // the class's queries see no key
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t u = 0; u < c.rows; ++u) {
          std::fill(o.row(b, h, u), o.row(b, h, u) + p.dim, 0.0f);
          if (lse) l.at(b, h, u) = -INFINITY;
        }
    return;
  }
  const Problem sub = class_problem(p, s, c);
  const ConstTensorView qs = every_sth_row(q, c.first_query, s, c.rows);
  const ConstTensorView ks = every_sth_row(k, c.r, s, c.keys);
  const ConstTensorView vs = every_sth_row(v, c.r, s, c.keys);
  const int64_t w = class_limit(s, limit);
  if (w < 0) {
    dense_attention(sub, qs, ks, vs, o, block, block, lse ? &l : nullptr);
  } else {
    const StridedPattern band(c.rows, c.keys, 1, w, 0, block);
    block_sparse_attention(sub, qs, ks, vs, o, band, lse ? &l : nullptr);
  }
}

void backward_class(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    ConstTensorView out, ConstTensorView dout, const LseView& lse, TensorView dq,
                    TensorView dk, TensorView dv, int64_t s, int64_t limit, int64_t block,
                    const ResidueClass& c) {
  const TensorView dqs = every_sth_row(dq, c.first_query, s, c.rows);
  if (c.keys == 0) {  // the class's queries see no key: their gradient is 0
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t u = 0; u < c.rows; ++u) std::fill_n(dqs.row(b, h, u), p.dim, 0.0f);
    return;
  }
  const Problem sub = class_problem(p, s, c);
  // the engine's backward reads each tile's log-sum-exps as consecutive floats: the class's own
  // (and their max, when the forward kept it apart: LseView::max)
  std::vector<float> ls(size_t(p.batch * p.heads * c.rows)), mx(lse.max ? ls.size() : 0);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t u = 0; u < c.rows; ++u) {
        ls[size_t((b * p.heads + h) * c.rows + u)] = lse.at(b, h, c.first_query + u * s);
        if (lse.max)
          mx[size_t((b * p.heads + h) * c.rows + u)] = lse.max_at(b, h, c.first_query + u * s);
      }
  const LseView l{ls.data(), p.heads * c.rows, c.rows, 1, lse.max ? mx.data() : nullptr};
  const ConstTensorView qs = every_sth_row(q, c.first_query, s, c.rows);
  const ConstTensorView os = every_sth_row(out, c.first_query, s, c.rows);
  const ConstTensorView gs = every_sth_row(dout, c.first_query, s, c.rows);
  const ConstTensorView ks = every_sth_row(k, c.r, s, c.keys);
  const ConstTensorView vs = every_sth_row(v, c.r, s, c.keys);
  const TensorView dks = every_sth_row(dk, c.r, s, c.keys);
  const TensorView dvs = every_sth_row(dv, c.r, s, c.keys);
  const int64_t w = class_limit(s, limit);
  if (w < 0) {
    dense_attention_backward(sub, qs, ks, vs, os, gs, l, dqs, dks, dvs, block, block);
  } else {
    const StridedPattern band(c.rows, c.keys, 1, w, 0, block);
    block_sparse_attention_backward(sub, qs, ks, vs, os, gs, l, band, dqs, dks, dvs);
  }
}

/// Calls f(class) for every class holding a query: in parallel, one thread each, when there
/// are enough of them to keep the team busy; otherwise one after another, each on the whole
/// team.
template <class F>
void for_each_class(const Problem& p, int64_t stride, F&& f) {
  const int64_t classes = query_classes(p, stride);
  const int threads = team_threads();
  if (threads > 1 && classes >= 4 * int64_t(threads)) {
    parallel_for(classes, [&](int64_t u) {
      omp_set_num_threads(1);  // the engine's regions inside this class: this thread alone
      f(query_class(p, stride, u));
    });
  } else {
    for (int64_t u = 0; u < classes; ++u) f(query_class(p, stride, u));
  }
}

}  // namespace

void strided_attention(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       TensorView out, int64_t stride, int64_t limit, int64_t block,
                       const LseView* lse) {
  if (stride < 1)
    throw UsageError("strided attention: stride must be at least 1, got " + std::to_string(stride));
  for_each_class(p, stride, [&](const ResidueClass& c) {
    run_class(p, q, k, v, out, stride, limit, block, lse, c);
  });
}

void strided_attention_backward(const Problem& p, ConstTensorView q, ConstTensorView k,
                                ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                                const LseView& lse, TensorView dq, TensorView dk, TensorView dv,
                                int64_t stride, int64_t limit, int64_t block) {
  if (stride < 1)
    throw UsageError("strided attention: stride must be at least 1, got " + std::to_string(stride));
  // with fewer queries than the stride, some classes hold keys but no query: those keys get 0
  // (the classes' engine calls overwrite the keys they hold)
  if (query_classes(p, stride) < stride)
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads; ++h)
        for (int64_t j = 0; j < p.keys(); ++j) {
          std::fill_n(dk.row(b, h, j), p.dim, 0.0f);
          std::fill_n(dv.row(b, h, j), p.dim, 0.0f);
        }
  for_each_class(p, stride, [&](const ResidueClass& c) {
    backward_class(p, q, k, v, out, dout, lse, dq, dk, dv, stride, limit, block, c);
  });
}

double strided_attention_scores(const Problem& p, int64_t stride, int64_t limit, int64_t block) {
  double total = 0;
  for (int64_t u = 0; u < query_classes(p, stride); ++u) {
    const ResidueClass c = query_class(p, stride, u);
    if (c.keys == 0) continue;
    Problem sub = p;
    sub.n = c.rows, sub.m = c.keys, sub.key_lengths.clear(), sub.attn_mask.reset();
    const int64_t w = class_limit(stride, limit);
    if (w < 0) {  // the dense case: each query tile's keys up to its last row's last key
      for (int64_t i0 = 0; i0 < c.rows; i0 += block)
        total += double(std::min(block, c.rows - i0)) *
                 double(sub.visible(std::min(c.rows, i0 + block) - 1));
    } else {
      total += pattern_scores(sub, StridedPattern(c.rows, c.keys, 1, w, 0, block), 0, 0);
    }
  }
  return total * double(p.batch * p.heads);
}

double strided_attention_backward_memory(const Problem& p, int64_t stride, int64_t limit,
                                         int64_t block) {
  // the largest class: ceil(n / s) queries, ceil(m / s) keys; the engine's backward on it
  // (dense, or on its band)
  const int64_t s = std::max<int64_t>(1, stride);
  Problem sub = p;
  sub.n = (p.n + s - 1) / s;
  sub.m = (p.keys() + s - 1) / s;
  sub.attn_mask.reset();
  const int64_t w = class_limit(s, limit);
  double engine =
      w < 0 ? dense_attention_backward_memory(sub, block, block)
            : block_sparse_backward_memory(
                  sub, block, listed_blocks(sub, StridedPattern(sub.n, sub.m, 1, w, 0, block)));
  const int threads = team_threads();
  const bool parallel = threads > 1 && query_classes(p, s) >= 4 * int64_t(threads);
  // per class in flight: its log-sum-exps, and its rows and columns of the mask
  const double rows = double(p.batch * p.heads * sub.n) * sizeof(float);
  double per_class = rows;
  if (p.attn_mask)
    per_class += double(p.attn_mask->batch * p.attn_mask->heads) * double(sub.n) * double(sub.m) *
                 sizeof(float);
  // classes in parallel run the engine one thread each: no dQ accumulators (threads - 1 of
  // them in the team's estimate), and each class its own rows' D
  if (parallel) engine += double(threads - 1) * (rows - rows * double(p.dim));
  return engine + (parallel ? threads : 1) * per_class;
}

double strided_attention_memory(const Problem& p, int64_t stride, int64_t block) {
  // the largest class: ceil(n / s) queries, ceil(m / s) keys
  const int64_t s = std::max<int64_t>(1, stride);
  Problem sub = p;
  sub.n = (p.n + s - 1) / s;
  sub.m = (p.keys() + s - 1) / s;
  sub.attn_mask.reset();
  // the engine's tiles (a team's worth either way: one thread per class, or the team on one)
  const double engine =
      std::max(dense_attention_memory(sub, block, block), block_sparse_memory(sub, block));
  // and per class in flight, its additive projections and its rows and columns of the mask
  double per_class = p.score == Score::additive ? AdditiveProjections::bytes(sub) : 0.0;
  if (p.attn_mask)
    per_class += double(p.attn_mask->batch * p.attn_mask->heads) * double(sub.n) * double(sub.m) *
                 sizeof(float);
  const int threads = team_threads();
  const double at_once = threads > 1 && query_classes(p, s) >= 4 * int64_t(threads) ? threads : 1;
  return engine + at_once * per_class;
}

}  // namespace attnbench
