// nsa's float64 oracle and its float32 tolerance (VariantInfo::oracle, ::tolerance), beside the
// kernel of variants/nsa.cpp.
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "common/core/registry.h"
#include "common/reference/oracle.h"
#include "variants/nsa.h"

namespace attnbench::nsa {

// The oracle: the definition in the header of variants/nsa.cpp, in double, written row by row
// without the kernel's tiles, gathering or offset arithmetic (the block scores sum the overlap
// of every visible compressed block with every candidate block).
std::vector<double> float64_oracle(const Variant& var, const Problem& p, ConstTensorView q,
                                   ConstTensorView k, ConstTensorView v) {
  const Config c = config_of(var.params());
  const int64_t n = p.n, d = p.dim, gs = p.kv_group();
  const double scale = 1.0 / std::sqrt(double(d));
  const std::vector<float> gates = gate_vectors(p.seed, p.heads, d);
  const std::array<const float*, 3> given = given_gates(var, p);
  return oracle::per_head(p, [&](int64_t b, int64_t h) {
    const int64_t h0 = p.kv_head(h) * gs;
    const oracle::Matrix K = oracle::head(k, b, h), V = oracle::head(v, b, h);
    std::vector<oracle::Matrix> Q;
    for (int64_t x = 0; x < gs; ++x) Q.push_back(oracle::head(q, b, h0 + x));
    const oracle::Matrix& Qh = Q[size_t(h - h0)];
    // pooled keys and values
    const int64_t nc = n >= c.l ? (n - c.l) / c.s + 1 : 0;
    oracle::Matrix Kc(nc, d), Vc(nc, d);
    for (int64_t i = 0; i < nc; ++i)
      for (int64_t j = i * c.s; j < i * c.s + c.l; ++j)
        for (int64_t e = 0; e < d; ++e) {
          Kc(i, e) += K(j, e) / double(c.l);
          Vc(i, e) += V(j, e) / double(c.l);
        }
    // softmax attention of row qrow over the keys `keys` of (Km, Vm); 0 without keys
    auto attend = [&](const double* qrow, const oracle::Matrix& Km, const oracle::Matrix& Vm,
                      const std::vector<int64_t>& keys, std::vector<double>& probs) {
      std::vector<double> o(size_t(d), 0.0);
      probs.assign(keys.size(), 0.0);
      if (keys.empty()) return o;
      double mx = -INFINITY;
      for (size_t x = 0; x < keys.size(); ++x) {
        double s = 0;
        for (int64_t e = 0; e < d; ++e) s += qrow[e] * Km(keys[x], e);
        probs[x] = s * scale;
        mx = std::max(mx, probs[x]);
      }
      double sum = 0;
      for (double& w : probs) sum += (w = std::exp(w - mx));
      for (size_t x = 0; x < keys.size(); ++x) {
        probs[x] /= sum;
        for (int64_t e = 0; e < d; ++e) o[size_t(e)] += probs[x] * Vm(keys[x], e);
      }
      return o;
    };
    oracle::Matrix O(n, d);
    std::vector<double> probs;
    for (int64_t t = 0; t < n; ++t) {
      // compression: blocks whose last key is <= t; scores summed over the group
      std::vector<int64_t> vis;
      for (int64_t i = 0; i < nc; ++i)
        if (i * c.s + c.l - 1 <= t) vis.push_back(i);
      const int64_t cur = t / c.lsel;
      std::vector<double> score(size_t(cur + 1), 0.0);
      std::vector<double> ocmp;
      for (int64_t x = 0; x < gs; ++x) {
        std::vector<double> o = attend(Q[size_t(x)].row(t), Kc, Vc, vis, probs);
        if (h0 + x == h) ocmp = o;
        for (size_t y = 0; y < vis.size(); ++y) {
          const int64_t a0 = vis[y] * c.s, a1 = a0 + c.l;
          for (int64_t j = 0; j <= cur; ++j) {
            const int64_t ov = std::min(a1, (j + 1) * c.lsel) - std::max(a0, j * c.lsel);
            if (ov > 0) score[size_t(j)] += probs[y] * double(ov) / double(c.s);
          }
        }
      }
      // selection: all candidates, or block 0, c - 1, c and the best others
      std::vector<int64_t> blocks;
      if (cur + 1 <= c.top) {
        for (int64_t j = 0; j <= cur; ++j) blocks.push_back(j);
      } else {
        std::vector<int64_t> others;
        for (int64_t j = 1; j <= cur - 2; ++j) others.push_back(j);
        std::stable_sort(others.begin(), others.end(),
                         [&](int64_t x, int64_t y) { return score[size_t(x)] > score[size_t(y)]; });
        blocks = {0, cur - 1, cur};
        blocks.insert(blocks.end(), others.begin(), others.begin() + (c.top - 3));
      }
      std::vector<int64_t> sel_keys, win_keys;
      for (int64_t j : blocks)
        for (int64_t key = j * c.lsel; key < (j + 1) * c.lsel && key <= t; ++key)
          sel_keys.push_back(key);
      for (int64_t key = std::max<int64_t>(0, t - c.w + 1); key <= t && c.w > 0; ++key)
        win_keys.push_back(key);
      const std::vector<double> osel = attend(Qh.row(t), K, V, sel_keys, probs);
      const std::vector<double> owin = attend(Qh.row(t), K, V, win_keys, probs);
      double gate[3];
      for (int64_t x = 0; x < 3; ++x) {
        if (given[size_t(x)]) {
          gate[x] = double(given[size_t(x)][(b * p.heads + h) * p.n + t]);
          continue;
        }
        double dot = 0;
        for (int64_t e = 0; e < d; ++e)
          dot += Qh(t, e) * double(gates[size_t((h * 3 + x) * d + e)]);
        gate[x] = 1.0 / (1.0 + std::exp(-dot));
      }
      for (int64_t e = 0; e < d; ++e)
        O(t, e) = gate[0] * ocmp[size_t(e)] + gate[1] * osel[size_t(e)] + gate[2] * owin[size_t(e)];
    }
    return O;
  });
}

// Tolerance (the float32 error model of common/reference/oracle.h): the pooling (a reduction over
// l), then three softmax attentions whose reductions run over at most the pooled rows, n l' and w
// keys, a log-sum-exp merge per selected block (n merges), the gates (a reduction over d and
// an exp) and the sum of three terms.
double float32_tolerance(const Variant& var, const Problem& p, const Workload& wl) {
  const Config c = config_of(var.params());
  const double keys = double(c.l + c.pooled(p.keys()) + c.top * c.lsel + c.w + p.dim);
  return kErrorMargin * float32_error(double(p.dim), logit_size(wl), keys, 8.0 + double(c.top));
}

}  // namespace attnbench::nsa
