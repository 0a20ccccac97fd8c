// Inputs beyond q, k and v (VariantInfo::inputs): the learned parts of gla, deltanet, nsa, rfa
// and linformer. Declared in `list --json` and on each instance as its parameters allow; read by
// the forward pass in place of the seeded stand-ins (checked against each variant's float64
// formula with the same given tensors); refused, naming what is accepted, where they are not
// taken or have another shape; and named in the rows that stood them in.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "harness/catalog.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

// The declared inputs of every variant that has any: name, axes and `when`.
TEST(GivenInputs, ListDeclaresThem) {
  const std::map<std::string, std::vector<std::vector<std::string>>> want = {
      {"gla", {{"g", "[B, G, n, d]", ""}}},
      {"deltanet", {{"beta", "[B, G, n]", ""}, {"g", "[B, G, n]", "gated=true"}}},
      {"nsa", {{"g_cmp", "[B, H, n]", ""}, {"g_slc", "[B, H, n]", ""}, {"g_swa", "[B, H, n]", ""}}},
      {"rfa", {{"g", "[B, H, m]", "gate=true"}}},
      {"linformer", {{"E", "[H, proj, m]", ""}, {"F", "[H, proj, m]", "share_kv=false"}}}};
  for (const auto& v : variants_json()) {
    const std::string name = v.at("name");
    ASSERT_TRUE(v.contains("inputs")) << name;
    std::vector<std::vector<std::string>> got;
    for (const auto& in : v.at("inputs")) {
      EXPECT_FALSE(in.at("help").get<std::string>().empty()) << name;
      EXPECT_FALSE(in.at("stand_in").get<std::string>().empty()) << name;
      got.push_back({in.at("name"), in.at("shape"),
                     in.at("when").is_null() ? std::string() : in.at("when").get<std::string>()});
    }
    auto it = want.find(name);
    EXPECT_EQ(got, it == want.end() ? std::vector<std::vector<std::string>>{} : it->second) << name;
  }
  // an instance takes those its parameters allow
  auto names = [](const std::string& spec) {
    std::vector<std::string> out;
    for (const InputSpec* in : make_variant(spec)->inputs()) out.push_back(in->name);
    return out;
  };
  using Names = std::vector<std::string>;
  EXPECT_EQ(names("deltanet"), (Names{"beta"}));
  EXPECT_EQ(names("deltanet:gated=true"), (Names{"beta", "g"}));
  EXPECT_EQ(names("rfa"), Names{});
  EXPECT_EQ(names("rfa:gate=true"), (Names{"g"}));
  EXPECT_EQ(names("linformer:share_kv=true"), (Names{"E"}));
  EXPECT_EQ(names("linformer"), (Names{"E", "F"}));
  EXPECT_EQ(names("flash"), Names{});
}

// A declaration the registry refuses: a taken or malformed name, an axis that is neither a
// problem letter nor an Int parameter, a `when` that is not a parameter with a valid value.
TEST(GivenInputs, RegistrationChecksThem) {
  auto refused = [](InputSpec in) {
    VariantInfo info = *Registry::instance().find("gla");
    info.name = "given_inputs_probe";
    info.inputs = {std::move(in)};
    return test::error_message<SpecError>([&] { Registry::instance().add(info); });
  };
  EXPECT_CONTAINS(refused({.name = "q", .dims = {"B"}, .help = "h", .stand_in = "s"}),
                  "declares the input 'q'");
  EXPECT_CONTAINS(refused({.name = "a b", .dims = {"B"}, .help = "h", .stand_in = "s"}),
                  "letters, digits and '_'");
  EXPECT_CONTAINS(refused({.name = "x", .dims = {"B", "T"}, .help = "h", .stand_in = "s"}),
                  "with the axis 'T'; accepted: B, G, H, d, m, n or an integer parameter");
  EXPECT_CONTAINS(refused({.name = "x", .dims = {"tau"}, .help = "h", .stand_in = "s"}),
                  "with the axis 'tau'");  // a Float parameter is no axis
  EXPECT_CONTAINS(
      refused({.name = "x", .dims = {"rank"}, .help = "h", .stand_in = "s", .when = "nope=1"}),
      "when 'nope=1'");
  EXPECT_NE(
      refused(
          {.name = "x", .dims = {"rank"}, .help = "h", .stand_in = "s", .when = "form=sideways"}),
      "");
  EXPECT_EQ(Registry::instance().find("given_inputs_probe"), nullptr);
}

using test::uniform_input;

struct Given {
  std::string name;
  double lo, hi;
};

struct Case {
  std::string spec;
  bool causal;
  std::vector<Given> given;
};

// With its inputs given, each variant matches its float64 formula with the same tensors, and
// its output is not the stand-in's: the forward reads them. One input of two given leaves the
// other stood in, and still matches.
TEST(GivenInputs, ForwardReadsThemAndMatchesTheFormula) {
  const std::vector<Case> cases = {
      {"gla", true, {{"g", -0.6, -0.01}}},
      {"gla:form=recurrent", true, {{"g", -0.6, -0.01}}},
      {"deltanet", true, {{"beta", 0.05, 0.95}}},
      {"deltanet:gated=true", true, {{"beta", 0.05, 0.95}, {"g", -0.6, 0.0}}},
      {"deltanet:gated=true,form=recurrent", true, {{"beta", 0.05, 0.95}, {"g", -0.6, 0.0}}},
      {"deltanet:gated=true", true, {{"g", -0.6, 0.0}}},
      {"nsa:cmp_block=8,cmp_stride=4,sel_block=8,sel_top=3,window=16",
       true,
       {{"g_cmp", 0.0, 1.0}, {"g_slc", 0.0, 1.0}, {"g_swa", 0.0, 1.0}}},
      {"nsa:cmp_block=8,cmp_stride=4,sel_block=8,sel_top=3,window=16", true, {{"g_slc", 0.0, 1.0}}},
      {"rfa:gate=true", true, {{"g", 0.05, 0.95}}},
      {"linformer:proj=8", false, {{"E", -0.5, 0.5}, {"F", -0.5, 0.5}}},
      {"linformer:proj=8,share_kv=true", false, {{"E", -0.5, 0.5}}},
      {"linformer:proj=8", false, {{"F", -0.5, 0.5}}}};
  for (const Case& c : cases)
    for (int64_t n : {1, 37, 100}) {
      Problem p = test::problem(2, 4, n, 0, 16, c.causal, uint64_t(n + 5));
      p.kv_heads = 2;
      SCOPED_TRACE(c.spec + " " + p.str());
      const Inputs in = generate_inputs(p);
      auto v = make_variant(c.spec);
      const Tensor stand_in = test::run(c.spec, p, in);
      auto extra = std::make_shared<ExtraInputs>();
      uint64_t seed = uint64_t(n);
      for (const Given& g : c.given)
        extra->emplace(g.name, uniform_input(*v, p, g.name, g.lo, g.hi, ++seed));
      p.extra_inputs = extra;
      std::vector<std::string> left;
      for (const InputSpec* s : v->inputs())
        if (!extra->count(s->name)) left.push_back(s->name);
      EXPECT_EQ(v->stand_ins(p), left);
      Tensor out(p.q_shape());
      v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
      const test::Expected e = test::expected(*v, p, in);
      EXPECT_LE(test::rel_fro_error(out.data(), e.out), e.tolerance);
      if (n > 1) {  // one row of a causal recurrence attends its own key alone, gates or not
        std::vector<double> plain(stand_in.data(), stand_in.data() + stand_in.numel());
        EXPECT_GT(test::rel_fro_error(out.data(), plain), 10 * e.tolerance);
      }
    }
}

// A given input the variant does not take, or of another shape, is a usage error naming
// what the variant takes; a backward that gives no gradient of a given input and decode refuse
// given inputs (no gradient or step for them), while they run with the stand-ins.
TEST(GivenInputs, RefusedWhereNotTaken) {
  Problem p = test::problem(2, 4, 37, 0, 16, true, 3);
  p.kv_heads = 2;
  auto gla = make_variant("gla");
  auto with = [&](const std::string& name, std::vector<int64_t> shape) {
    auto extra = std::make_shared<ExtraInputs>();
    int64_t count = 1;
    for (int64_t s : shape) count *= s;
    extra->emplace(name, ExtraInput{shape, std::vector<float>(size_t(count), -0.1f)});
    Problem q = p;
    q.extra_inputs = extra;
    return q;
  };
  EXPECT_CONTAINS(test::error_message<UsageError>([&] { gla->check_inputs(with("h", {1})); }),
                  "an input 'h' was given, which gla:");
  EXPECT_CONTAINS(test::error_message<UsageError>([&] { gla->check_inputs(with("h", {1})); }),
                  "takes g [B, G, n, d] = [2, 2, 37, 16]");
  EXPECT_CONTAINS(test::error_message<UsageError>([&] {
                    gla->check_inputs(with("g", {2, 2, 37, 15}));
                  }),
                  "the input 'g' has shape [2, 2, 37, 15]; gla:");
  EXPECT_CONTAINS(test::error_message<UsageError>([&] {
                    make_variant("flash")->check_inputs(with("g", {2, 2, 37, 16}));
                  }),
                  "takes no input beyond q, k and v");
  Problem growing = with("g", {2, 2, 37, 16});
  auto bad = std::make_shared<ExtraInputs>(*growing.extra_inputs);
  bad->at("g").data[5] = 0.25f;  // a log decay above 0: a growing state
  growing.extra_inputs = bad;
  EXPECT_CONTAINS(test::error_message<UsageError>([&] { gla->check_inputs(growing); }),
                  "the input 'g' of gla:");
  EXPECT_CONTAINS(test::error_message<UsageError>([&] { gla->check_inputs(growing); }),
                  "holds 0.25 at flat index 5; accepted: values in [-inf, 0]");
  const Problem given = with("g", {2, 2, 37, 16});
  EXPECT_NO_THROW(gla->check_inputs(given));
  EXPECT_NO_THROW(gla->check_backward(given));  // gla gives dL/dg (GlaGradientOfG... below)
  // deltanet, rfa and linformer give theirs too (input_grads_test.cpp), nsa its gates'
  // (nsa_backward_test.cpp)
  auto deltanet = make_variant("deltanet");
  auto beta = std::make_shared<ExtraInputs>();
  beta->emplace("beta", ExtraInput{{2, 2, 37}, std::vector<float>(2 * 2 * 37, 0.5f)});
  Problem with_beta = p;
  with_beta.extra_inputs = beta;
  EXPECT_NO_THROW(deltanet->check_inputs(with_beta));
  EXPECT_NO_THROW(deltanet->check_backward(with_beta));
  auto nsa = make_variant("nsa");
  auto gate = std::make_shared<ExtraInputs>();
  gate->emplace("g_slc", ExtraInput{{2, 4, 37}, std::vector<float>(2 * 4 * 37, 0.5f)});
  Problem with_gate = p;
  with_gate.extra_inputs = gate;
  EXPECT_NO_THROW(nsa->check_inputs(with_gate));
  EXPECT_NO_THROW(nsa->check_backward(with_gate));
  // a backward that gives no input gradients refuses to be asked for them
  auto flash_variant = make_variant("flash");
  Backward* flash = flash_variant->backward();
  ASSERT_NE(flash, nullptr);
  EXPECT_FALSE(flash->gives_input_grads());
  InputGrads none;
  EXPECT_CONTAINS(test::error_message<UnsupportedError>([&] {
                    flash->backward_inputs(given, {}, {}, {}, {}, {}, NothingSaved(), {}, {}, {},
                                           none);
                  }),
                  "gives no gradient of a given input (g)");
  EXPECT_NO_THROW(gla->check_decode(given));  // token by token: DecodeInputs.*
  EXPECT_NO_THROW(gla->check_backward(p));
  EXPECT_NO_THROW(gla->check_decode(p));
}

// The row of a variant with inputs says which it stood in: the stand_ins column and a note.
TEST(GivenInputs, RowsNameTheirStandIns) {
  Problem p = test::problem(1, 2, 64, 0, 16, true, 9);
  const RunOptions opt{.reps = 1, .min_time = 0};
  auto row_of = [&](const std::string& spec, const Problem& q) {
    auto v = make_variant(spec);
    return run_one(*v, q, Workload{}, nullptr, MachineFigures{}, opt);
  };
  const Row stood = row_of("deltanet:gated=true", p);
  ASSERT_EQ(stood.status, "ok") << stood.message;
  EXPECT_EQ(stood.stand_ins, "beta+g");
  EXPECT_CONTAINS(stood.notes, "stand-ins for its learned inputs: beta+g");
  auto v = make_variant("deltanet:gated=true");
  auto extra = std::make_shared<ExtraInputs>();
  extra->emplace("beta", uniform_input(*v, p, "beta", 0.1, 0.9, 1));
  Problem q = p;
  q.extra_inputs = extra;
  const Row half = row_of("deltanet:gated=true", q);
  ASSERT_EQ(half.status, "ok") << half.message;
  EXPECT_EQ(half.stand_ins, "g");
  const Row flash = row_of("flash", p);
  EXPECT_EQ(flash.stand_ins, "");
  EXPECT_EQ(flash.notes.find("stand-ins"), std::string::npos) << flash.notes;
}

}  // namespace
}  // namespace attnbench

namespace attnbench {
namespace {

// gla's dL/dg (with g given) against central differences of its float64 recurrence in g, with
// dq, dk, dv as without g; grouped heads (the key/value head's g serves its query heads),
// chunk spacings that do not divide n, both forms.
TEST(GivenInputs, GlaGradientOfGMatchesDifferences) {
  for (const std::string spec : {"gla", "gla:chunk=4", "gla:form=recurrent,chunk=3"})
    for (int64_t g : {2, 1})
      for (int64_t n : {1, 13}) {
        Problem p = test::causal_problem(2, 2, g, n, 8, uint64_t(n * 7 + g));
        SCOPED_TRACE(spec + " " + p.str());
        auto var = make_variant(spec);
        const Inputs in = generate_inputs(p);
        const ExtraInput gin = uniform_input(*var, p, "g", -0.5, -0.01, uint64_t(n + g), true);
        auto given = [&](const ExtraInput& t) {
          auto extra = std::make_shared<ExtraInputs>();
          extra->emplace("g", t);
          Problem q = p;
          q.extra_inputs = extra;
          return q;
        };
        const Problem pg = given(gin);
        std::mt19937_64 rng(p.seed);
        const test::TrainStep step = test::train_step(*var, pg, in, rng);
        const Tensor &dout = step.dout, &dv = step.dv;
        const InputGrads& dinputs = step.dinputs;
        ASSERT_EQ(dinputs.size(), 1u);
        ASSERT_EQ(dinputs.at("g").size(), gin.data.size());
        Tensor dg(Shape4{gin.shape[0], gin.shape[1], gin.shape[2], gin.shape[3]});
        std::copy(dinputs.at("g").begin(), dinputs.at("g").end(), dg.data());
        auto central = [&](const std::vector<double>& u) {
          auto loss = [&](double sign) {
            ExtraInput moved = gin;
            for (size_t i = 0; i < moved.data.size(); ++i)
              moved.data[i] = float(double(gin.data[i]) + sign * 0x1p-12 * u[i]);
            const std::vector<double> o =
                var->info().oracle(*var, given(moved), in.q.view(), in.k.view(), in.v.view());
            double l = 0;
            for (size_t i = 0; i < o.size(); ++i) l += double(dout.data()[i]) * o[i];
            return l;
          };
          return (loss(1.0) - loss(-1.0)) / (2.0 * 0x1p-12);
        };
        test::expect_matches_differences(dg, rng, 3, 3, 1e-3, central);
        // dq, dk, dv are those of the function with g held: central differences in v
        auto central_v = [&](const std::vector<double>& u) {
          auto loss = [&](double sign) {
            Tensor moved(in.v.shape(), in.v.group());
            for (int64_t i = 0; i < moved.numel(); ++i)
              moved.data()[i] = float(double(in.v.data()[i]) + sign * 0x1p-10 * u[size_t(i)]);
            const std::vector<double> o =
                var->info().oracle(*var, pg, in.q.view(), in.k.view(), moved.view());
            double l = 0;
            for (size_t i = 0; i < o.size(); ++i) l += double(dout.data()[i]) * o[i];
            return l;
          };
          return (loss(1.0) - loss(-1.0)) / (2.0 * 0x1p-10);
        };
        test::expect_matches_differences(dv, rng, 2, 2, 1e-3, central_v);
      }
}

}  // namespace
}  // namespace attnbench
