#include "common/core/problem.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/core/checked.h"
#include "common/core/error.h"

namespace attnbench {

namespace {
// Far beyond any memory, far below int64 overflow even after multiplying by a byte size.
constexpr int64_t kMaxElements = int64_t(1) << 56;
}  // namespace

std::string_view score_name(Score s) {
  switch (s) {
    case Score::scaled_dot:
      return "scaled_dot";
    case Score::dot:
      return "dot";
    case Score::bilinear:
      return "bilinear";
    case Score::additive:
      return "additive";
  }
  return "?";
}

Score parse_score(std::string_view name) {
  for (Score s : {Score::scaled_dot, Score::dot, Score::bilinear, Score::additive})
    if (score_name(s) == name) return s;
  throw UsageError(fmt::format(
      "unknown scoring function '{}'; accepted: scaled_dot, dot, bilinear, additive", name));
}

std::string Shape4::str() const { return fmt::format("[{}, {}, {}, {}]", batch, heads, len, dim); }

double Problem::visible_pairs() const {
  if (!causal) return double(n) * double(keys());
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += double(visible(i));
  return total;
}

float Problem::softmax_scale() const { return float(1.0 / std::sqrt(double(dim))); }

void Problem::validate() const {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) throw UsageError(fmt::format("{} must be a positive integer, got {}", name, v));
  };
  positive("batch", batch);
  positive("heads", heads);
  if (batch > kMaxBatchOrHeads || heads > kMaxBatchOrHeads)
    throw UsageError(
        fmt::format("batch {} and heads {}: accepted: at most {} (2^24) each, the "
                    "independent random streams of seeded inputs",
                    batch, heads, kMaxBatchOrHeads));
  if (kv_heads < 0 || kv_heads > heads || (kv_heads > 0 && heads % kv_heads != 0))
    throw UsageError(fmt::format(
        "kv-heads {} with {} heads: accepted: a divisor of the heads (1 = multi-query, {} = "
        "multi-head), or 0 for as many as the heads",
        kv_heads, heads, heads));
  positive("seq (n)", n);
  positive("dim (d)", dim);
  if (m < 0)
    throw UsageError(fmt::format("seq-k (m) must be positive (or 0 for m = n), got {}", m));
  // Every element count the harness and the kernels form must fit in int64 (and then the
  // memory guard decides whether it fits in memory): B H n d, B H m d and B H n m.
  auto product = [&](std::initializer_list<int64_t> factors, const char* what) {
    int64_t total = 1;
    for (int64_t f : factors)
      if ((total = checked_mul(total, f)) < 0 || total > kMaxElements)
        throw UsageError(
            fmt::format("{} of B={}, H={}, n={}, m={}, d={} exceeds {} elements; "
                        "accepted: problems whose tensors and score matrix hold at "
                        "most 2^56 elements",
                        what, batch, heads, n, keys(), dim, kMaxElements));
  };
  product({batch, heads, n, dim}, "q (B x H x n x d)");
  product({batch, heads, keys(), dim}, "k and v (B x H x m x d)");
  product({batch, heads, n, keys()}, "the scores (B x H x n x m)");
  if (score_hidden < 0 || score_hidden > kMaxElements / std::max<int64_t>(1, dim))
    throw UsageError(fmt::format("score hidden size must be 0 (= d) or a positive integer, got {}",
                                 score_hidden));
  if (!key_lengths.empty()) {
    if (int64_t(key_lengths.size()) != batch)
      throw UsageError(
          fmt::format("key padding gives {} lengths for a batch of {}; accepted: one "
                      "length per batch element (or one for all)",
                      key_lengths.size(), batch));
    for (int64_t len : key_lengths)
      if (len < 0 || len > keys())
        throw UsageError(fmt::format("key padding length {} is out of range; accepted: 0 .. m = {}",
                                     len, keys()));
  }
  if (attn_mask) {
    const AttnMask& a = *attn_mask;
    if ((a.batch != 1 && a.batch != batch) || (a.heads != 1 && a.heads != heads) || a.n != n ||
        a.m != keys() || int64_t(a.bias.size()) != a.batch * a.heads * a.n * a.m)
      throw UsageError(fmt::format(
          "attention mask of shape [{}, {}, {}, {}] does not fit the problem; accepted: "
          "[{} or 1, {} or 1, n = {}, m = {}]",
          a.batch, a.heads, a.n, a.m, batch, heads, n, keys()));
  }
  const bool weighted = score == Score::bilinear || score == Score::additive;
  if (weighted && score_weights) {
    const ScoreWeights& w = *score_weights;
    const bool fits =
        w.heads == heads && w.dim == dim &&
        (score == Score::bilinear
             ? int64_t(w.w_bilinear.size()) == heads * dim * dim
             : w.hidden == hidden() && int64_t(w.w_q.size()) == heads * hidden() * dim &&
                   int64_t(w.w_k.size()) == heads * hidden() * dim &&
                   int64_t(w.w_score.size()) == heads * hidden());
    if (!fits)
      throw UsageError(fmt::format("the {} score weights do not fit H = {}, d = {}, hidden = {}",
                                   score_name(score), heads, dim, hidden()));
  }
}

std::string Problem::kv_str() const {
  return kv_head_count() == heads ? "" : fmt::format(",G={}", kv_head_count());
}

std::string Problem::score_str() const {
  if (score == Score::scaled_dot) return "";
  if (score == Score::additive) return fmt::format(",score=additive,h={}", hidden());
  return fmt::format(",score={}", score_name(score));
}

std::string Problem::str() const {
  return fmt::format("B={},H={}{},n={},m={},d={},causal={}{},seed={}", batch, heads, kv_str(), n,
                     keys(), dim, int(causal), score_str(), seed) +
         mask_suffix(*this) + dtype_str();
}

std::string Problem::dtype_str() const {
  return dtype == DType::f32 ? std::string() : fmt::format(",dtype={}", dtype_name(dtype));
}

std::string_view dtype_name(DType t) { return t == DType::bf16 ? "bf16" : "f32"; }

DType parse_dtype(std::string_view name) {
  if (name == "f32") return DType::f32;
  if (name == "bf16") return DType::bf16;
  throw UsageError(fmt::format("unknown dtype '{}'; accepted: f32, bf16", name));
}

std::string key_padding_text(const Problem& p) {
  return fmt::format("{}", fmt::join(p.key_lengths, "+"));
}

std::string mask_suffix(const Problem& p) {
  std::string s;
  if (!p.key_lengths.empty()) s += ",key_padding=" + key_padding_text(p);
  if (p.attn_mask) s += ",attn_mask=" + p.attn_mask->name;
  return s;
}

int64_t Problem::rows_without_keys() const {
  int64_t rows = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t vis = visible(b, i);
        bool any = vis > 0;
        if (any && attn_mask) {
          any = false;
          for (int64_t j = 0; j < vis && !any; ++j) any = attn_mask->at(b, h, i, j) != -INFINITY;
        }
        rows += !any;
      }
    }
  return rows;
}

}  // namespace attnbench
