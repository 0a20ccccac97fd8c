#include "common/io/inputs.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "common/core/error.h"
#include "common/core/parallel.h"
#include "common/core/parallel_for.h"
#include "common/core/random.h"
#include "common/io/trained.h"

namespace attnbench {

namespace {

// Stream ids: one per (tensor role, batch, head) so every head is independent.
enum Role : uint64_t {
  kQ = 1,
  kK,
  kV,
  kLatent,
  kCenters,
  kAssign,
  kBasis,
  kNoiseQ,
  kNoiseK,
  kWBilinear,
  kWQuery,
  kWKey,
  kWScore,
  kDout
};
// Generated tensors may start at head (b0, h0) of the problem's full input (see
// generate_head_inputs), whose key/value head is g0; stream ids are those of the full input.
// Streams of what a key/value head owns (k, v and, for the structured inputs, the latent shared
// by q and k) are numbered by the key/value head, the others by the query head, so grouped
// problems (Problem::kv_heads) draw k and v once per key/value head and G = H draws what it
// always drew.
struct Origin {
  int64_t b0 = 0, h0 = 0, g0 = 0;
};
uint64_t stream_id(Role r, const Origin& o, int64_t b, int64_t h) {
  return (uint64_t(r) << 48) ^ (uint64_t(o.b0 + b) << 24) ^ uint64_t(o.h0 + h);
}
uint64_t kv_stream_id(Role r, const Origin& o, int64_t b, int64_t g) {
  return (uint64_t(r) << 48) ^ (uint64_t(o.b0 + b) << 24) ^ uint64_t(o.g0 + g);
}

// Whether generating q, k and v of p is worth the team: about 20 flops per drawn entry (a
// counter-based draw and its normal transform), per (batch, head) task.
ParallelFor generator_team(const Problem& p) {
  const double entries = double(p.batch * p.heads) * double(p.n + 2 * p.keys()) * double(p.dim);
  return {.parallel = parallel_worth(20.0 * entries, p.batch * p.heads)};
}

// Fills every stored head of t (a grouped view fills each key/value head once).
void fill_gaussian(const Problem& p, const Origin& o, Role role, TensorView t) {
  const int64_t len = t.shape.len, d = t.shape.dim, stored = t.shape.heads / t.group;
  const bool kv = role == kK || role == kV;
  // about 20 flops per sample, as in generator_team
  const bool parallel =
      parallel_worth(20.0 * double(t.shape.batch * stored * len * d), t.shape.batch * stored);
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
  for (int64_t b = 0; b < t.shape.batch; ++b)
    for (int64_t g = 0; g < stored; ++g) {
      RandomStream rs(p.seed, kv ? kv_stream_id(role, o, b, g) : stream_id(role, o, b, g));
      float* x = t.head(b, g * t.group);
      for (int64_t i = 0; i < len * d; ++i) x[i] = float(rs.normal(uint64_t(i)));
    }
}

}  // namespace

Tensor generate_dout(const Problem& p) {
  Tensor t(p.q_shape());
  fill_gaussian(p, Origin{}, kDout, t.view());
  return t;
}

namespace {

// local: a shared latent AR(1) sequence z_t = rho z_{t-1} + sqrt(1 - rho^2) e_t with
// correlation length 16 positions; q and k are the latent plus a little noise, so q_i . k_j is
// large when i and j are close. Queries take the last n latent positions and keys the last m,
// matching the bottom-right alignment of the causal mask.
void fill_local(const Problem& p, const Origin& o, Inputs& in) {
  const int64_t n = p.n, m = p.keys(), d = p.dim, len = std::max(n, m);
  const double rho = std::exp(-1.0 / 16.0), innov = std::sqrt(1 - rho * rho), noise = 0.3;
  const double norm = 1.0 / std::sqrt(1 + noise * noise);
  parallel_for(
      p.batch * p.heads,
      [&](int64_t bh) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        const int64_t g = p.kv_head(h);
        RandomStream lat(p.seed, kv_stream_id(kLatent, o, b, g)),
            nq(p.seed, stream_id(kNoiseQ, o, b, h)), nk(p.seed, kv_stream_id(kNoiseK, o, b, g));
        std::vector<double> z(size_t(len * d));
        for (int64_t c = 0; c < d; ++c) z[size_t(c)] = lat.normal(uint64_t(c));
        for (int64_t t = 1; t < len; ++t)
          for (int64_t c = 0; c < d; ++c)
            z[size_t(t * d + c)] =
                rho * z[size_t((t - 1) * d + c)] + innov * lat.normal(uint64_t(t * d + c));
        float* q = in.q.view().head(b, h);
        float* k = in.k.view().head(b, h);
        for (int64_t i = 0; i < n * d; ++i)
          q[i] = float(norm * (z[size_t((len - n) * d + i)] + noise * nq.normal(uint64_t(i))));
        if (h % p.kv_group() != 0) return;  // the group's first head writes its k
        for (int64_t i = 0; i < m * d; ++i)
          k[i] = float(norm * (z[size_t((len - m) * d + i)] + noise * nk.normal(uint64_t(i))));
      },
      generator_team(p));
}

// clustered: 8 cluster centres per head shared by q and k; each token is its centre plus
// noise of standard deviation 0.5, scaled to unit variance per entry.
void fill_clustered(const Problem& p, const Origin& o, Inputs& in) {
  const int64_t d = p.dim, clusters = 8;
  const double sigma = 0.5, norm = 1.0 / std::sqrt(1 + sigma * sigma);
  parallel_for(
      p.batch * p.heads,
      [&](int64_t bh) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        const int64_t g = p.kv_head(h);
        RandomStream cs(p.seed, kv_stream_id(kCenters, o, b, g));
        std::vector<double> centres(size_t(clusters * d));
        for (size_t i = 0; i < centres.size(); ++i) centres[i] = cs.normal(i);
        auto fill = [&](float* x, int64_t len, RandomStream ns, RandomStream as, uint64_t offset) {
          for (int64_t t = 0; t < len; ++t) {
            int64_t c = int64_t(as.below(offset + uint64_t(t), clusters));
            for (int64_t j = 0; j < d; ++j)
              x[t * d + j] = float(
                  norm * (centres[size_t(c * d + j)] + sigma * ns.normal(uint64_t(t * d + j))));
          }
        };
        fill(in.q.view().head(b, h), p.n, RandomStream(p.seed, stream_id(kNoiseQ, o, b, h)),
             RandomStream(p.seed, stream_id(kAssign, o, b, h)), 0);
        if (h % p.kv_group() == 0)  // the group's first head writes its k
          fill(in.k.view().head(b, h), p.keys(),
               RandomStream(p.seed, kv_stream_id(kNoiseK, o, b, g)),
               RandomStream(p.seed, kv_stream_id(kAssign, o, b, g)), uint64_t(1) << 40);
      },
      generator_team(p));
}

// lowrank: q and k lie in a shared random subspace of rank r = min(d, 8): x = z U with
// z ~ N(0, I_r) and U entries N(0, 1/r), so every entry has unit variance.
void fill_lowrank(const Problem& p, const Origin& o, Inputs& in) {
  const int64_t d = p.dim, r = std::min<int64_t>(d, 8);
  parallel_for(
      p.batch * p.heads,
      [&](int64_t bh) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        const int64_t g = p.kv_head(h);
        RandomStream us(p.seed, kv_stream_id(kBasis, o, b, g));
        std::vector<double> u(size_t(r * d));
        for (size_t i = 0; i < u.size(); ++i) u[i] = us.normal(i) / std::sqrt(double(r));
        auto fill = [&](float* x, int64_t len, RandomStream zs) {
          std::vector<double> z(static_cast<size_t>(r));
          for (int64_t t = 0; t < len; ++t) {
            for (int64_t a = 0; a < r; ++a) z[size_t(a)] = zs.normal(uint64_t(t * r + a));
            for (int64_t j = 0; j < d; ++j) {
              double s = 0;
              for (int64_t a = 0; a < r; ++a) s += z[size_t(a)] * u[size_t(a * d + j)];
              x[t * d + j] = float(s);
            }
          }
        };
        fill(in.q.view().head(b, h), p.n, RandomStream(p.seed, stream_id(kQ, o, b, h)));
        if (h % p.kv_group() == 0)  // the group's first head writes its k
          fill(in.k.view().head(b, h), p.keys(), RandomStream(p.seed, kv_stream_id(kK, o, b, g)));
      },
      generator_team(p));
}

}  // namespace

const std::vector<std::string>& input_distributions() {
  static const std::vector<std::string> names = {"gaussian", "local", "clustered", "lowrank"};
  return names;
}

std::string accepted_inputs() {
  return fmt::format("{}, trained[:layer=L]", fmt::join(input_distributions(), ", "));
}

std::string canonical_input(const std::string& name) {
  if (is_trained_input(name)) return canonical_trained_input(name);
  const auto& names = input_distributions();
  if (std::find(names.begin(), names.end(), name) == names.end())
    throw UsageError(
        fmt::format("unknown input distribution '{}'; accepted: {}", name, accepted_inputs()));
  return name;
}

std::string describe_distribution(const std::string& name) {
  if (name == "gaussian")
    return "iid N(0,1) entries: logits are near-uniform noise, the easiest case for low-rank "
           "and kernel methods";
  if (name == "local")
    return "q and k follow a shared smooth AR(1) sequence (correlation length 16): attention "
           "concentrates near the diagonal, as in language and audio";
  if (name == "clustered")
    return "tokens drawn from 8 Gaussian clusters shared by q and k: attention is block "
           "structured by cluster, as with repeated entities or image regions";
  if (name == "lowrank")
    return "q and k in a shared rank-8 subspace: the score matrix has rank <= 8";
  if (is_trained_input(name))
    return "q, k, v of layer L (default 0) of a small trained byte-level language model on "
           "held-out text, read from the attnbench cache (batch 1, the model's heads and dim, n "
           "up to the captured length)";
  return "";
}

namespace {

// Multiplies q by w.scale (nothing for scale 1).
void scale_q(Inputs& in, const Workload& w) {
  if (w.scale == 1.0) return;
  float* q = in.q.data();
  const float s = float(w.scale);
  for (int64_t i = 0; i < in.q.numel(); ++i) q[i] *= s;
  // a scale that is finite in float (Workload::validate) can still overflow q
  for (int64_t i = 0; i < in.q.numel(); ++i)
    if (!std::isfinite(q[i]))
      throw InputError(
          fmt::format("scale {} overflows q in float32 (q holds {} at flat index "
                      "{}): use a smaller scale",
                      w.scale, q[i], i));
}

Inputs generate(const Problem& p, const Workload& w, const Origin& o) {
  if (is_trained_input(w.input)) {  // read, not generated: the seed plays no part
    Inputs in = load_trained_inputs(p, w.input);
    scale_q(in, w);
    return in;
  }
  canonical_input(w.input);  // throws for an unknown name
  Inputs in{Tensor(p.q_shape()), p.kv_tensor(), p.kv_tensor()};
  if (w.input == "gaussian") {
    fill_gaussian(p, o, kQ, in.q.view());
    fill_gaussian(p, o, kK, in.k.view());
  } else if (w.input == "local") {
    fill_local(p, o, in);
  } else if (w.input == "clustered") {
    fill_clustered(p, o, in);
  } else {
    fill_lowrank(p, o, in);
  }
  fill_gaussian(p, o, kV, in.v.view());
  scale_q(in, w);
  return in;
}

}  // namespace

Inputs generate_inputs(const Problem& p, const Workload& w) { return generate(p, w, Origin{}); }

double additive_tanh_variance() {
  // the integral of tanh(u)^2 against the N(0, 2) density, trapezoids on [-20, 20] (the tails
  // beyond hold less than 1e-40)
  constexpr int kSteps = 8000;
  constexpr double kHalf = 20.0, kStep = 2 * kHalf / kSteps;
  const double norm = 1.0 / std::sqrt(4.0 * M_PI);
  double sum = 0;
  for (int i = 0; i <= kSteps; ++i) {
    const double u = -kHalf + i * kStep, t = std::tanh(u);
    sum += (i == 0 || i == kSteps ? 0.5 : 1.0) * t * t * norm * std::exp(-u * u / 4.0);
  }
  return sum * kStep;
}

std::shared_ptr<const ScoreWeights> make_score_weights(const Problem& p) {
  if (p.score != Score::bilinear && p.score != Score::additive) return nullptr;
  auto sw = std::make_shared<ScoreWeights>();
  const int64_t d = p.dim, hd = p.hidden();
  sw->heads = p.heads, sw->dim = d, sw->hidden = hd;
  // one stream per (role, head): batch 0 of stream_id, the weights being shared by the batch
  auto fill = [&](std::vector<float>& out, Role role, int64_t per_head, double sd) {
    out.resize(size_t(p.heads * per_head));
    for (int64_t h = 0; h < p.heads; ++h) {
      RandomStream rs(p.seed, stream_id(role, Origin{}, 0, h));
      for (int64_t i = 0; i < per_head; ++i)
        out[size_t(h * per_head + i)] = float(sd * rs.normal(uint64_t(i)));
    }
  };
  if (p.score == Score::bilinear) {
    fill(sw->w_bilinear, kWBilinear, d * d, 1.0 / double(d));
  } else {
    fill(sw->w_q, kWQuery, hd * d, 1.0 / std::sqrt(double(d)));
    fill(sw->w_k, kWKey, hd * d, 1.0 / std::sqrt(double(d)));
    fill(sw->w_score, kWScore, hd, 1.0 / std::sqrt(double(hd) * additive_tanh_variance()));
  }
  return sw;
}

Inputs generate_head_inputs(const Problem& p, int64_t b, int64_t h, const Workload& w) {
  if (b < 0 || b >= p.batch || h < 0 || h >= p.heads)
    throw UsageError(fmt::format("head ({}, {}) is outside a problem of batch {} and {} heads", b,
                                 h, p.batch, p.heads));
  if (is_trained_input(w.input)) {  // the head's positions, read from the cache
    Inputs in = load_trained_inputs(p, w.input, h);
    scale_q(in, w);
    return in;
  }
  Problem one = p;
  one.batch = 1, one.heads = 1, one.kv_heads = 1;
  return generate(one, w, Origin{b, h, p.kv_head(h)});
}

}  // namespace attnbench
