// The variant interface and the registry that builds variants from spec strings.
//
// A variant file in variants/ describes itself with a VariantInfo (name, typed parameters,
// capabilities, a factory) and registers it at static-initialisation time:
//
//   ATTNBENCH_REGISTER_VARIANT(flash, VariantInfo{...});
//
// A spec string "name:key=value,key=value" names a variant and overrides parameters.
//
// The same macro registers a variant built into libattnbench and one in a plugin (a shared
// library loaded at run time, common/io/plugin.h). This header and everything it includes are
// installed; changing them means bumping ATTNBENCH_ABI_VERSION (common/core/abi.h).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/core/abi.h"
#include "common/core/backward.h"
#include "common/core/decode.h"
#include "common/core/problem.h"
#include "common/core/tensor.h"
#include "common/core/workload.h"

namespace attnbench {

enum class ParamType { Int, Float, Bool, Choice, IntList };
const char* to_string(ParamType t);

/// One typed variant parameter. A name means the same thing, with the same type, in every
/// variant that declares it (the registry rejects a clash).
struct ParamSpec {
  std::string name;
  ParamType type = ParamType::Int;
  std::string default_value;
  double min = 0, max = 0;           ///< inclusive range for Int and Float
  std::vector<std::string> choices;  ///< allowed values for Choice
  std::string help;
  /// Variant::spec() leaves the parameter out while it holds its default: a parameter added
  /// to a variant later (local's sinks), so the specs and results of the variant as it was
  /// keep their names.
  bool omit_at_default = false;

  static ParamSpec Int(std::string name, int64_t def, int64_t lo, int64_t hi, std::string help);
  static ParamSpec Float(std::string name, double def, double lo, double hi, std::string help);
  static ParamSpec Bool(std::string name, bool def, std::string help);
  static ParamSpec Choice(std::string name, std::string def, std::vector<std::string> choices,
                          std::string help);
  /// A list of integers in [lo, hi] written with '+' between them ("0+64+4095"); "none" is
  /// the empty list.
  static ParamSpec IntList(std::string name, std::string def, int64_t lo, int64_t hi,
                           std::string help);
  /// "int in [1, 4096]", "one of strided|fixed", ...
  std::string accepted() const;
};

/// Validated parameter values of one variant instance, in canonical text form.
class ParamValues {
 public:
  int64_t get_int(const std::string& name) const;
  double get_float(const std::string& name) const;
  bool get_bool(const std::string& name) const;
  const std::string& get_choice(const std::string& name) const;
  std::vector<int64_t> get_int_list(const std::string& name) const;
  /// Canonical text of a value; throws if the parameter does not exist.
  const std::string& text(const std::string& name) const;

  std::map<std::string, std::string> values;
};

/// What a variant can do beyond non-causal self-attention.
struct Capabilities {
  bool causal = false;  ///< supports the bottom-right aligned causal mask
  bool cross = false;   ///< supports m != n
  /// The output is exact softmax attention (restricted to the variant's pattern, if it has
  /// one), so the tests hold it to the reference at float rounding. Approximations say false
  /// and must give VariantInfo::oracle, the float64 statement of their own function, instead.
  bool exact = true;
  /// Runs the dot and bilinear scores: Variant::compute maps q once (they are scaled_dot on a
  /// linear map of q), so this holds for every variant whose function is attention of q over
  /// k; a variant whose keys are not k (shared-QK attention) says false and refuses them.
  bool linear_score = true;
  /// Computes the additive score wᵀ tanh(W_q q + W_k k) itself.
  bool additive = false;
  /// Honours key padding (Problem::key_lengths): padded keys contribute nothing.
  bool key_padding = false;
  /// Honours an arbitrary attention mask (Problem::attn_mask).
  bool attn_mask = false;
  /// Refuses problems without the causal mask: its function is a causal recurrence (retention,
  /// gated linear attention, the delta rule) or is defined causally only. Implies causal.
  bool causal_only = false;
  /// Computes in bfloat16 (Problem::dtype, DType::bf16): its products take bf16 operands with
  /// float32 accumulation, its softmax statistics stay float32.
  bool bf16 = false;
};

class Variant;

/// The dot and bilinear scores as scaled_dot on a mapped q (docs/cli.md, "Scoring
/// functions"): q' = sqrt(d) q (dot) or q'_i = sqrt(d) Wᵀ q_i per head (bilinear), formed in
/// float. linear_score_problem is p with score scaled_dot and no weights.
Problem linear_score_problem(const Problem& p);
/// q' of p (p.score is dot or bilinear, with its weights), [B, H, n, d].
Tensor linear_score_query(const Problem& p, ConstTensorView q);

class SparsePattern;

/// A float64 statement of a variant's own function, independent of its kernels: the output
/// [B, H, n, d] (row-major) the variant should give for these inputs, drawing the same random
/// numbers (projections, hashes) as the variant. The variant is passed for its parameters.
using Oracle = std::function<std::vector<double>(const Variant&, const Problem&, ConstTensorView q,
                                                 ConstTensorView k, ConstTensorView v)>;
/// The largest relative Frobenius error ‖O − O*‖_F / ‖O*‖_F accepted against the oracle on a
/// problem, derived from an error model of the variant's float32 arithmetic
/// (common/reference/oracle.h). The variant is passed for its parameters (they can lengthen the
/// chain), the workload for the size of the inputs' logits (its scale).
using Tolerance = std::function<double(const Variant&, const Problem&, const Workload&)>;

/// How plots draw a variant: its colour and marker in every figure of every run. Empty: the
/// plot scripts pick them from a hash of the name.
struct Look {
  std::string color = {};   ///< "#rrggbb"
  std::string marker = {};  ///< a matplotlib marker: one of o s ^ v D P X < > h
};

/// The families `list`, the documentation and the plots group variants by.
inline constexpr const char* kFamilies[] = {"exact",      "pattern", "lowrank",
                                            "clustering", "decay",   "other"};

/// A tensor a variant takes beyond q, k and v: a learned part of its mechanism (a gate, a
/// decay, a projection) that a model computes and trains. Without it the variant computes a
/// seeded stand-in of the same shape.
struct InputSpec {
  std::string name;  ///< as --inputs files and the Python keyword arguments name it: "g", "beta"
  /// Its axes, in order: the problem's B, H (query heads), G (key/value heads), n, m and d,
  /// or an Int parameter of the variant (linformer's proj). Float32, row-major.
  std::vector<std::string> dims;
  std::string help;      ///< what it holds, in the variant's formula
  std::string stand_in;  ///< what the variant computes when it is not given
  /// The values its formula admits (a log decay <= 0, a gate in [0, 1]); a given tensor with
  /// an entry outside is refused. Infinite: no bound.
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  /// "param=value": declared only while that parameter holds that value (rfa's gate=true);
  /// empty: always.
  std::string when = {};

  /// "[B, H, n, d]".
  std::string shape() const;
};

/// Everything the registry knows about a variant.
struct VariantInfo {
  std::string name;
  std::string summary;     ///< one line: what it computes
  std::string complexity;  ///< e.g. "O(n m d) time, O(n m) memory"
  /// One of kFamilies: exact softmax, a sparse pattern with exact softmax inside it, a low-rank
  /// or feature-map approximation, clustering or hashing, linear attention with a decay or a
  /// delta rule.
  std::string family = "other";
  std::string display = {};  ///< a readable name ("FlashAttention"); empty: the name
  std::string paper = {};    ///< where it is defined: "Author et al. YEAR (arXiv:NNNN.NNNNN)"
  Look look = {};
  /// A design for long contexts: the default sweep measures it up to its longest lengths and
  /// the report's long-context section shows it.
  bool long_context = false;
  /// Settings besides the defaults that the default sweep's long-context set also measures
  /// (full specs, e.g. "moba:chunk=128").
  std::vector<std::string> sweep_specs = {};
  std::vector<ParamSpec> params;
  /// The tensors it takes beyond q, k and v (InputSpec); empty for most variants.
  std::vector<InputSpec> inputs = {};
  Capabilities caps;
  std::function<std::unique_ptr<Variant>(const ParamValues&)> make;
  /// Empty for an exact variant: its oracle is softmax attention restricted to its pattern
  /// (reference_attention with make_pattern). An approximation must give its own.
  Oracle oracle = {};
  /// Empty: the default float32 error model of attention (attention_tolerance,
  /// common/reference/oracle.h).
  Tolerance tolerance = {};
  /// The plugin file the variant was loaded from (absolute path); empty for a built-in one.
  /// Set by the plugin loader, not by the variant.
  std::string plugin = {};
};

/// An attention variant: computes out = attention(q, k, v) for one problem.
/// The harness owns timing, memory and error; a variant only computes.
class Variant {
 public:
  virtual ~Variant() = default;

  /// q: [B, H, n, d], k, v: [B, H, m, d], out: [B, H, n, d]. Shapes are already checked
  /// against the problem, and the problem against the capabilities.
  virtual void forward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       TensorView out) = 0;
  /// Floating-point operations of one forward pass (multiply-add = 2).
  virtual double flops(const Problem& p) const = 0;
  /// Working bytes allocated by one forward pass beyond inputs and output.
  virtual double memory_estimate(const Problem& p) const = 0;
  /// For variants that attend, per query, a subset of the keys: that subset on this problem
  /// (the fixed patterns of local, bigbird, ...; the buckets, routes or sorted blocks that
  /// reformer, routing, sinkhorn and clustered:topk choose from q and k). q and k matter only
  /// to data-dependent patterns and may be empty views for the others (a data-dependent
  /// variant then returns nullptr). nullptr for variants that attend every key (full, flash)
  /// or none directly (low-rank and kernel approximations).
  virtual std::unique_ptr<SparsePattern> make_pattern(const Problem& p, ConstTensorView q,
                                                      ConstTensorView k) const;
  /// What the last forward pass did that its numbers alone do not show (e.g. rows a routing
  /// variant left without keys), for the results' notes column; "" if nothing.
  virtual std::string notes() const { return {}; }
  /// Draws once what this variant's forward() would otherwise draw on every call and what
  /// depends only on the problem's seed and shapes (random projections, feature maps), and
  /// keeps it for later forward() calls on problems with the same seed and shapes. Returns
  /// whether there was anything to prepare (false: the default, forward() needs nothing).
  /// The harness calls it before the checked and timed passes and reports its wall time in
  /// the results' prepare_s column; a variant whose forward() reuses prepared draws says so
  /// in notes(). forward() without prepare() draws everything itself on every call.
  virtual bool prepare(const Problem& /*p*/) { return false; }
  /// The training pass (common/core/backward.h) if this variant implements one, else nullptr:
  /// a variant with a backward derives from Backward too, and this finds it. `list` and the
  /// harness read the capability from here; a variant whose backward depends on its
  /// parameters overrides it.
  virtual Backward* backward() { return dynamic_cast<Backward*>(this); }
  /// The generation pass (common/core/decode.h) if this variant implements one, else nullptr:
  /// a variant that decodes derives from Decoder too, and this finds it. `list` and the
  /// harness read the capability from here.
  virtual Decoder* decoder() { return dynamic_cast<Decoder*>(this); }

  const VariantInfo& info() const { return *info_; }
  const ParamValues& params() const { return params_; }
  /// The inputs beyond q, k and v this instance takes: those of info().inputs whose `when`
  /// its parameters meet, in declared order.
  std::vector<const InputSpec*> inputs() const;
  /// Canonical spec: name, then every parameter in declared order ("flash:block_q=64,...").
  std::string spec() const;

  /// Throws UnsupportedError if this variant cannot run the problem, UsageError if p gives an
  /// input it does not take (check_inputs).
  void check_supported(const Problem& p) const;
  /// The shape of one of its inputs on p (InputSpec::dims, the parameters resolved).
  std::vector<int64_t> input_shape(const InputSpec& in, const Problem& p) const;
  /// The tensor p gives for the input `name` (Problem::extra_inputs, of input_shape), or
  /// nullptr: the variant computes its stand-in.
  const float* input(const Problem& p, std::string_view name) const;
  /// The inputs it takes (inputs()) that p does not give, in declared order: stood in for.
  std::vector<std::string> stand_ins(const Problem& p) const;
  /// The declared input `name` among inputs(); UsageError naming them when it is not one.
  const InputSpec* taken_input(const Problem& p, const std::string& name) const;
  /// "gla:... takes g [B, G, n, d] = [1, 8, 1024, 64]": what a message names as accepted.
  std::string accepted_inputs(const Problem& p) const;
  /// Throws UsageError for a tensor of p.extra_inputs that this variant does not take or
  /// whose shape is not input_shape, naming what it accepts.
  void check_inputs(const Problem& p) const;
  /// Throws UsageError unless `given` are inputs it takes, each shaped as on p but with
  /// `tokens` (at_least: `tokens` or more) on its token axis: a decode prefill's or step's
  /// (Decoder::prefill_given, DecodeState::step_given).
  void check_token_inputs(const Problem& p, const ExtraInputs& given, int64_t tokens,
                          bool at_least) const;
  /// forward() under the problem's scoring function: the dot and bilinear scores map q once
  /// (q' = sqrt(d) q, or q' = sqrt(d) Wᵀ q per head) and run forward() on the scaled_dot
  /// problem; every other score goes to forward() as it is. What the harness times.
  void compute(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               TensorView out);
  /// Checks shapes and support, then calls compute().
  void run(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
           TensorView out);

  /// Throws UnsupportedError unless this variant has a backward pass for the problem.
  void check_backward(const Problem& p) const;
  /// Throws UnsupportedError unless this variant has a decode step for the problem (causal
  /// self-attention of p.n tokens).
  void check_decode(const Problem& p) const;
  /// Backward::forward_train under the problem's scoring function, as compute() runs
  /// forward(): the dot and bilinear scores map q once and keep the mapped q in the saved
  /// state. What the harness times for the training forward.
  std::unique_ptr<SavedState> compute_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                            ConstTensorView v, TensorView out);
  /// Backward::backward under the problem's scoring function: for dot and bilinear the
  /// gradient of the mapped q is taken back through the map (dq = sqrt(d) dq', or
  /// dq_i = sqrt(d) W dq'_i). saved comes from compute_train on the same problem and inputs.
  /// With inputs beyond q, k and v given (p.extra_inputs), their gradients go to *dinputs
  /// (Backward::backward_inputs), which must then be given.
  void compute_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                        ConstTensorView out, ConstTensorView dout, const SavedState& saved,
                        TensorView dq, TensorView dk, TensorView dv, InputGrads* dinputs = nullptr);
  /// Checks shapes and support (forward and backward), then compute_train / compute_backward.
  std::unique_ptr<SavedState> run_train(const Problem& p, ConstTensorView q, ConstTensorView k,
                                        ConstTensorView v, TensorView out);
  void run_backward(const Problem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    ConstTensorView out, ConstTensorView dout, const SavedState& saved,
                    TensorView dq, TensorView dk, TensorView dv, InputGrads* dinputs = nullptr);

 private:
  friend class Registry;
  const VariantInfo* info_ = nullptr;
  ParamValues params_;
};

/// Registry of all variants linked into the process.
class Registry {
 public:
  static Registry& instance();
  /// Adds a variant; throws on a duplicate name or a parameter type clash.
  bool add(VariantInfo info);
  const VariantInfo* find(std::string_view name) const;
  /// The variant called `name`; throws SpecError naming the closest name and every
  /// registered one when there is none.
  const VariantInfo& get(std::string_view name) const;
  /// All variants, sorted by name.
  std::vector<const VariantInfo*> all() const;
  /// Builds a variant from "name:key=value,...". Throws SpecError listing what is valid.
  std::unique_ptr<Variant> make(std::string_view spec) const;
  /// Names of all registered variants joined by ", ".
  std::string names() const;

  /// Adds several variants, all or none: throws SpecError, adding nothing, if any of them
  /// would be rejected by add() (also for a name given twice among them).
  void add_all(std::vector<VariantInfo> infos);

  /// Plugin loading (common/io/plugin.cpp). While a stage is open, registrations through
  /// ATTNBENCH_REGISTER_VARIANT are held back instead of added, so the loader can check a
  /// plugin's variants (and unload it) before any of them becomes visible.
  void open_stage();
  /// Closes the stage and returns what was registered while it was open.
  std::vector<VariantInfo> close_stage();
  /// Called by ATTNBENCH_REGISTER_VARIANT: add(), or into the stage while one is open.
  bool register_static(VariantInfo info);

 private:
  // Throws SpecError if `info` cannot join a registry holding `types` as parameter types.
  void check(const VariantInfo& info, const std::map<std::string, ParamType>& types) const;
  // Throws SpecError if the family, look or sweep settings of `info` are not ones accepted.
  static void check_presentation(const VariantInfo& info);
  // Throws SpecError if a declared input has a bad or repeated name, an axis that is neither a
  // problem letter nor an Int parameter, or a `when` that is not a valid "param=value".
  static void check_inputs(const VariantInfo& info);

  std::map<std::string, std::unique_ptr<VariantInfo>, std::less<>> variants_;
  std::map<std::string, ParamType> param_types_;
  bool staging_ = false;
  std::vector<VariantInfo> staged_;
};

/// Splits "name:key=value,key=value" into the name and its key/value pairs (in order).
/// Throws SpecError on malformed text (empty name or key, missing '=', repeated key).
std::pair<std::string, std::vector<std::pair<std::string, std::string>>> parse_spec(
    std::string_view spec);

/// Shorthand for Registry::instance().make(spec).
std::unique_ptr<Variant> make_variant(std::string_view spec);

}  // namespace attnbench

#define ATTNBENCH_CAT_(a, b) a##b
#define ATTNBENCH_CAT(a, b) ATTNBENCH_CAT_(a, b)
/// The registration entry point, register_variant_abiN with N = ATTNBENCH_ABI_VERSION. Its
/// name carries the ABI version, so a plugin compiled against another version does not load
/// (an undefined symbol at dlopen) instead of registering through a mismatched interface.
#define ATTNBENCH_REGISTER_ENTRY ATTNBENCH_CAT(register_variant_abi, ATTNBENCH_ABI_VERSION)

namespace attnbench {
/// Registry::instance().register_static(info); see ATTNBENCH_REGISTER_ENTRY.
bool ATTNBENCH_REGISTER_ENTRY(VariantInfo info);
}  // namespace attnbench

/// Registers a variant from its own translation unit (built in, or in a plugin). `ident` is
/// any identifier unique in the file.
#define ATTNBENCH_REGISTER_VARIANT(ident, ...)                      \
  [[maybe_unused]] static const bool attnbench_registered_##ident = \
      ::attnbench::ATTNBENCH_REGISTER_ENTRY(__VA_ARGS__)
