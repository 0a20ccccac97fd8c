#include "harness/catalog.h"

#include <cmath>

namespace attnbench {

bool has_backward(const VariantInfo& v) {
  return Registry::instance().make(v.name)->backward() != nullptr;
}

bool has_decode(const VariantInfo& v) {
  return Registry::instance().make(v.name)->decoder() != nullptr;
}

namespace {

// A bound of an input's range: null when infinite (JSON has no infinity).
nlohmann::ordered_json bound(double x) {
  return std::isfinite(x) ? nlohmann::ordered_json(x) : nlohmann::ordered_json();
}

}  // namespace

nlohmann::ordered_json variants_json() {
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  for (const VariantInfo* v : Registry::instance().all()) {
    nlohmann::ordered_json params = nlohmann::ordered_json::array();
    for (const auto& p : v->params) {
      nlohmann::ordered_json j = {
          {"name", p.name}, {"type", to_string(p.type)}, {"default", p.default_value}};
      if (p.type == ParamType::Int || p.type == ParamType::Float || p.type == ParamType::IntList)
        j["range"] = {p.min, p.max};
      if (p.type == ParamType::Choice) j["choices"] = p.choices;
      j["help"] = p.help;
      params.push_back(j);
    }
    nlohmann::ordered_json inputs = nlohmann::ordered_json::array();
    for (const InputSpec& in : v->inputs)
      inputs.push_back(
          {{"name", in.name},
           {"shape", in.shape()},
           {"dims", in.dims},
           {"help", in.help},
           {"stand_in", in.stand_in},
           {"range", {bound(in.min), bound(in.max)}},
           {"when", in.when.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(in.when)}});
    all.push_back({{"name", v->name},
                   {"summary", v->summary},
                   {"complexity", v->complexity},
                   {"family", v->family},
                   {"display", v->display.empty() ? v->name : v->display},
                   {"paper", v->paper},
                   {"color", v->look.color},
                   {"marker", v->look.marker},
                   {"long_context", v->long_context},
                   {"sweep_specs", v->sweep_specs},
                   {"causal", v->caps.causal},
                   {"causal_only", v->caps.causal_only},
                   {"cross", v->caps.cross},
                   {"exact", v->caps.exact},
                   {"linear_score", v->caps.linear_score},
                   {"additive", v->caps.additive},
                   {"key_padding", v->caps.key_padding},
                   {"attn_mask", v->caps.attn_mask},
                   {"bf16", v->caps.bf16},
                   {"backward", has_backward(*v)},
                   {"decode", has_decode(*v)},
                   {"plugin", v->plugin.empty() ? nlohmann::ordered_json()
                                                : nlohmann::ordered_json(v->plugin)},
                   {"params", params},
                   {"inputs", inputs}});
  }
  return all;
}

}  // namespace attnbench
