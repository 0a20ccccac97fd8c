#include "harness/sweep_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "common/error.h"
#include "common/inputs.h"
#include "harness/results.h"

namespace attnbench {

std::vector<std::unique_ptr<Variant>> make_sweep_variants(const std::vector<std::string>& specs) {
  std::vector<std::unique_ptr<Variant>> variants;
  if (specs.empty())
    for (const VariantInfo* v : Registry::instance().all())
      variants.push_back(make_variant(v->name));
  for (const auto& s : specs) variants.push_back(make_variant(s));
  return variants;
}

SweepPlan plan_sweep(std::vector<std::unique_ptr<Variant>> variants, const SweepAxes& axes) {
  SweepPlan plan;
  plan.axes = axes;
  plan.variants = std::move(variants);
  // Two specs that name the same canonical variant, or a value listed twice, would measure
  // one configuration twice: keep the first.
  std::set<std::string> seen;
  // Layer rows take the place of the head dimensions: d = E / H.
  const bool layer = !axes.embeds.empty();
  if (layer) {
    for (const auto& in : axes.inputs)
      if (in != "gaussian")
        throw UsageError(fmt::format(
            "--input {}: layer rows (--embed) draw gaussian inputs and parameters; accepted "
            "with --embed: gaussian",
            in));
    for (Score s : axes.scores)
      if (s != Score::scaled_dot)
        throw UsageError(fmt::format(
            "--score {}: layer rows (--embed) score as torch.nn.MultiheadAttention does; "
            "accepted with --embed: scaled_dot",
            score_name(s)));
  }
  const std::vector<int64_t>& sizes = layer ? axes.embeds : axes.dims;
  // the weights depend on the score, H, d and h only: one set per such shape
  std::map<std::tuple<Score, int64_t, int64_t>, std::shared_ptr<const ScoreWeights>> weights;
  for (const auto& in : axes.inputs)
    for (bool c : axes.causals)
      for (Score s : axes.scores)
        for (auto size : sizes)
          for (auto h : axes.heads)
            for (auto b : axes.batches)
              for (auto n : axes.seqs)
                for (const auto& v : plan.variants) {
                  Problem p;
                  p.batch = b, p.heads = h, p.n = n, p.dim = size, p.causal = c;
                  p.seed = axes.seed;
                  const int64_t embed = layer ? size : 0;
                  if (layer) {
                    LayerProblem lp;
                    lp.batch = b, lp.embed = size, lp.heads = h, lp.n = n, lp.causal = c;
                    lp.seed = axes.seed;
                    lp.validate();
                    p = lp.attention();
                  }
                  p.score = s, p.score_hidden = axes.score_hidden;
                  Workload w;
                  w.input = in, w.threads = axes.threads;
                  p.validate();
                  w.validate(p);
                  if (s == Score::bilinear || s == Score::additive) {
                    auto& sw = weights[{s, h, p.dim}];
                    if (!sw) sw = make_score_weights(p);
                    p.score_weights = sw;
                  }
                  Row key;
                  key.spec = v->spec(), key.problem = p, key.workload = w, key.embed = embed;
                  if (!seen.insert(row_key(key)).second) {
                    plan.duplicates.push_back(fmt::format("{} {}{}", key.spec,
                                                          layer ? fmt::format("E={},", embed) : "",
                                                          describe(p, w)));
                    continue;
                  }
                  plan.configs.push_back({v.get(), p, w, embed});
                }
  return plan;
}

std::vector<Score> parse_score_list(const std::string& text) {
  std::vector<Score> out;
  for (auto& s : split_csv_line(text)) {
    try {
      out.push_back(parse_score(s));
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("--score: {}", e.what()));
    }
  }
  return out;
}

std::vector<bool> parse_causal_mode(const std::string& mode) {
  if (mode == "off") return {false};
  if (mode == "on") return {true};
  if (mode == "both") return {false, true};
  throw UsageError(fmt::format("--causal: unknown mode '{}'; accepted: off, on, both", mode));
}

std::vector<std::string> parse_input_list(const std::string& text) {
  const auto& names = input_distributions();
  std::vector<std::string> inputs;
  for (auto& s : split_csv_line(text)) {
    if (std::find(names.begin(), names.end(), s) == names.end())
      throw UsageError(fmt::format("--input: unknown distribution '{}'; accepted: {}", s,
                                   fmt::join(names, ", ")));
    inputs.push_back(s);
  }
  return inputs;
}

LayerProblem layer_problem(const SweepConfig& config) {
  const Problem& p = config.problem;
  LayerProblem lp;
  lp.batch = p.batch, lp.embed = config.embed, lp.heads = p.heads, lp.n = p.n, lp.m = p.m;
  lp.causal = p.causal, lp.seed = p.seed;
  return lp;
}

double sweep_work(const SweepConfig& config) {
  // An estimate that fails counts as the fixed cost; run_one reports the failure in the row.
  double f = 0;
  try {
    f = config.embed > 0 ? layer_flops(*config.variant, layer_problem(config))
                         : config.variant->flops(config.problem);
  } catch (const std::exception&) {
  }
  return (std::isfinite(f) && f > 0 ? f : 0) + 1e8;
}

}  // namespace attnbench
