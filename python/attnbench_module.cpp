// _attnbench: the compiled core of the Python package attnbench (python/attnbench/).
//
// Arrays cross without copies: q, k, v (and dout, the decode tokens) must be C-contiguous
// float32 NumPy arrays, wrapped as tensor views of their own buffers; the package's Python
// layer (python/attnbench/__init__.py) makes the one documented copy of anything else before
// calling in. Outputs are NumPy arrays the variants write into directly. The GIL is released
// while a variant runs. Errors keep the C++ messages: SpecError, UsageError and InputError
// become ValueError, UnsupportedError NotImplementedError, any other attnbench error
// RuntimeError.
#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/core/decode.h"
#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/io/plugin.h"
#include "common/kernels/bf16.h"
#include "common/reference/reference.h"
#include "harness/catalog.h"
#include "harness/team.h"

namespace py = pybind11;

extern "C" int openblas_get_num_threads(void);

namespace attnbench {
namespace {

using F32 = py::array_t<float, py::array::c_style>;

// The data pointers of the last q, k, v wrapped (for the zero-copy test).
std::atomic<uintptr_t> g_last_q{0}, g_last_k{0}, g_last_v{0};

std::string shape_text(const py::array& a) {
  std::string s = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// `a` as a C-contiguous float32 array of 4 dimensions, or UsageError naming what it is.
F32 expect_f32(const py::handle& obj, const char* what) {
  if (!py::isinstance<py::array>(obj))
    throw UsageError(std::string(what) + ": expected a NumPy array");
  auto a = py::reinterpret_borrow<py::array>(obj);
  if (!a.dtype().is(py::dtype::of<float>()) || !(a.flags() & py::array::c_style))
    throw UsageError(std::string(what) + ": expected a C-contiguous float32 array, got dtype " +
                     std::string(py::str(a.dtype())) +
                     " (attnbench's Python layer converts other arrays once)");
  if (a.ndim() != 4)
    throw UsageError(std::string(what) + ": expected 4 dimensions [B, H, len, d], got shape " +
                     shape_text(a));
  return py::reinterpret_borrow<F32>(obj);
}

Shape4 shape4(const py::array& a) { return {a.shape(0), a.shape(1), a.shape(2), a.shape(3)}; }

ConstTensorView view(const F32& a) { return {a.data(), shape4(a)}; }
TensorView mut_view(F32& a) { return {a.mutable_data(), shape4(a)}; }

// k or v stored [B, G, m, d], viewed grouped as [B, H, m, d].
ConstTensorView kv_view(const F32& a, const Problem& p) {
  return {a.data(), shape4(a), p.kv_group()};
}

F32 empty(const Shape4& s) { return F32({s.batch, s.heads, s.len, s.dim}); }

// What attention(...) and friends take besides the arrays.
struct Options {
  bool causal = false;
  std::string score = "scaled_dot";
  std::vector<int64_t> key_padding;
  std::optional<py::array> attn_mask;
  int64_t kv_heads = 0;  // 0: from k's shape
  uint64_t seed = 0;
  std::string dtype = "f32";
  int threads = 0;
  /// The variant's inputs beyond q, k and v (VariantInfo::inputs), by name; copied once into
  /// the problem (Problem::extra_inputs).
  std::map<std::string, py::array> inputs;
};

// The key/value heads G of k [B, G, m, d] for `heads` query heads; UsageError unless G
// divides them.
int64_t kv_heads_of(const F32& k, int64_t heads) {
  const int64_t g = k.shape(1);
  if (g <= 0 || heads % g != 0)
    throw UsageError("k and v have " + std::to_string(g) + " heads (shape " + shape_text(k) +
                     ") for " + std::to_string(heads) +
                     " query heads; expected a divisor of the query heads");
  return g;
}

/// The variant's inputs beyond q, k and v, copied from float32 arrays by name.
ExtraInputs extra_inputs(const std::map<std::string, py::array>& arrays) {
  ExtraInputs extra;
  for (const auto& [name, a] : arrays) {
    if (!a.dtype().is(py::dtype::of<float>()) || !(a.flags() & py::array::c_style))
      throw UsageError(name + ": expected a C-contiguous float32 array, got dtype " +
                       std::string(py::str(a.dtype())));
    ExtraInput t;
    for (py::ssize_t i = 0; i < a.ndim(); ++i) t.shape.push_back(a.shape(i));
    const float* data = static_cast<const float*>(a.data());
    t.data.assign(data, data + a.size());
    extra.emplace(name, std::move(t));
  }
  return extra;
}

// The problem of q [B, H, n, d] and k, v [B, G, m, d] under `o`, validated.
Problem make_problem(const F32& q, const F32& k, const F32& v, const Options& o) {
  if (k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) || v.shape(0) != k.shape(0) ||
      v.shape(1) != k.shape(1) || v.shape(2) != k.shape(2) || v.shape(3) != k.shape(3))
    throw UsageError("q has shape " + shape_text(q) + ", k " + shape_text(k) + ", v " +
                     shape_text(v) +
                     "; expected q [B, H, n, d] and k, v both [B, G, m, d] (G divides H)");
  const int64_t h = q.shape(1), g = kv_heads_of(k, h);
  if (o.kv_heads != 0 && o.kv_heads != g)
    throw UsageError("kv_heads=" + std::to_string(o.kv_heads) + " but k and v have shape " +
                     shape_text(k) + " (" + std::to_string(g) + " key/value heads)");
  Problem p;
  p.batch = q.shape(0), p.heads = h, p.n = q.shape(2), p.dim = q.shape(3);
  p.m = k.shape(2);
  p.kv_heads = g < h ? g : 0;
  p.causal = o.causal;
  p.score = parse_score(o.score);
  p.dtype = parse_dtype(o.dtype);
  p.seed = o.seed;
  if (!o.key_padding.empty()) {
    p.key_lengths = o.key_padding;
    if (p.key_lengths.size() == 1) p.key_lengths.assign(size_t(p.batch), p.key_lengths[0]);
    if (int64_t(p.key_lengths.size()) != p.batch)
      throw UsageError("key_padding: " + std::to_string(o.key_padding.size()) +
                       " lengths for a batch of " + std::to_string(p.batch) +
                       "; accepted: one per batch element or one for all");
  }
  if (o.attn_mask) {
    // The mask is copied once into the problem's AttnMask; the npy reader's checks apply.
    const py::array& a = *o.attn_mask;
    NpyArray arr;
    arr.dtype = std::string(py::str(a.dtype().attr("str")));
    for (py::ssize_t i = 0; i < a.ndim(); ++i) arr.shape.push_back(a.shape(i));
    if (!(a.flags() & py::array::c_style))
      throw UsageError("attn_mask: expected a C-contiguous array");
    arr.data.assign(static_cast<const char*>(a.data()),
                    static_cast<const char*>(a.data()) + a.nbytes());
    p.attn_mask = attn_mask_from_array(arr, "attn_mask", p);
  }
  if (p.score == Score::bilinear || p.score == Score::additive)
    p.score_weights = make_score_weights(p);
  if (!o.inputs.empty()) p.extra_inputs = std::make_shared<ExtraInputs>(extra_inputs(o.inputs));
  p.validate();
  return p;
}

// value.cast<T>() for the keyword `key`, or UsageError naming it and what it accepts (a
// failed cast is pybind11's cast_error, which Python would see as a RuntimeError).
template <typename T>
T keyword(const py::handle& value, const std::string& key, const char* accepted) {
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    throw UsageError(key + "=" + std::string(py::repr(value)) + " (" +
                     std::string(Py_TYPE(value.ptr())->tp_name) + "); accepted: " + accepted);
  }
}

// The problem keywords (python/attnbench/__init__.py passes every one of them, checked).
Options options(const py::kwargs& kw) {
  Options o;
  for (const auto& [key, value] : kw) {
    const std::string k = py::str(key);
    if (k == "causal") {
      o.causal = keyword<bool>(value, k, "True or False");
    } else if (k == "score") {
      o.score = keyword<std::string>(value, k, "a score name (str)");
    } else if (k == "key_padding") {
      o.key_padding =
          keyword<std::vector<int64_t>>(value, k, "a list of key lengths (ints in 0 .. m)");
    } else if (k == "attn_mask") {
      if (!value.is_none()) o.attn_mask = keyword<py::array>(value, k, "a NumPy array or None");
    } else if (k == "kv_heads") {
      o.kv_heads = keyword<int64_t>(value, k, "an int (0: from k's shape)");
    } else if (k == "seed") {
      o.seed = keyword<uint64_t>(value, k, "an int in 0 .. 2**64 - 1");
    } else if (k == "threads") {
      const int64_t t = keyword<int64_t>(value, k, "an int (0: every core)");
      if (t < 0 || t > max_threads())
        throw UsageError("threads: " + std::to_string(t) +
                         " is out of range; accepted: 0 (every core) to " +
                         std::to_string(max_threads()));
      o.threads = int(t);
    } else if (k == "dtype") {
      o.dtype = keyword<std::string>(value, k, "\"f32\" or \"bf16\"");
    } else if (k == "inputs") {
      o.inputs = keyword<std::map<std::string, py::array>>(
          value, k, "a dict of the variant's inputs by name (float32 arrays)");
    } else {
      throw UsageError("unknown keyword '" + k +
                       "'; accepted: causal, score, key_padding, attn_mask, kv_heads, seed, "
                       "threads, dtype, inputs");
    }
  }
  return o;
}

// A variant built from a spec, shared by the Python objects that use it.
// Calls into one Variant object (and into one decode state) are serialised: they run with the
// GIL released, and a variant may keep state between calls (prepared draws, notes).
struct PyVariant {
  std::shared_ptr<Variant> v;
  std::shared_ptr<std::mutex> mu = std::make_shared<std::mutex>();
};

// What forward_train keeps for backward: the problem, the arrays (held, not copied) and the
// variant's saved state.
struct PySaved {
  std::shared_ptr<Variant> v;
  Problem p;
  F32 q, k, v_in, out;
  std::unique_ptr<SavedState> saved;
  int threads = 0;
};

// A decode state and what it was made from.
struct PyDecoder {
  std::shared_ptr<Variant> v;
  Problem p;
  std::unique_ptr<DecodeState> state;
  int threads = 0;
  std::shared_ptr<std::mutex> mu = std::make_shared<std::mutex>();
};

void record_pointers(const F32& q, const F32& k, const F32& v) {
  g_last_q = reinterpret_cast<uintptr_t>(q.data());
  g_last_k = reinterpret_cast<uintptr_t>(k.data());
  g_last_v = reinterpret_cast<uintptr_t>(v.data());
}

// A copy of a with every value rounded to bfloat16 (to nearest even).
F32 rounded_copy(const F32& a) {
  F32 r(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
  std::copy(a.data(), a.data() + a.size(), r.mutable_data());
  round_to_bf16(r.mutable_data(), int64_t(r.size()));
  return r;
}

F32 forward(Variant& variant, std::mutex& mu, const py::handle& qo, const py::handle& ko,
            const py::handle& vo, const Options& o) {
  const F32 q = expect_f32(qo, "q"), k = expect_f32(ko, "k"), v = expect_f32(vo, "v");
  const Problem p = make_problem(q, k, v, o);
  const int threads = resolve_threads(o.threads);
  F32 out = empty(p.q_shape());
  record_pointers(q, k, v);
  TensorView ov = mut_view(out);
  // bf16: the variant runs on copies of q, k, v rounded to bfloat16 (as the runner gives it)
  const bool bf16 = p.dtype == DType::bf16;
  F32 qr, kr, vr;
  if (bf16) {
    variant.check_supported(p);  // before the copies
    qr = rounded_copy(q), kr = rounded_copy(k), vr = rounded_copy(v);
  }
  {
    py::gil_scoped_release nogil;
    const std::lock_guard<std::mutex> lock(mu);
    ThreadTeam team(threads);
    variant.run(p, view(bf16 ? qr : q), kv_view(bf16 ? kr : k, p), kv_view(bf16 ? vr : v, p), ov);
  }
  return out;
}

// The parameter values of v, typed: int, float, bool, str (a choice) or a list of ints.
py::dict params_dict(const Variant& v) {
  py::dict d;
  const ParamValues& pv = v.params();
  for (const ParamSpec& s : v.info().params) {
    py::str key(s.name);
    switch (s.type) {
      case ParamType::Int:
        d[key] = pv.get_int(s.name);
        break;
      case ParamType::Float:
        d[key] = pv.get_float(s.name);
        break;
      case ParamType::Bool:
        d[key] = pv.get_bool(s.name);
        break;
      case ParamType::Choice:
        d[key] = pv.get_choice(s.name);
        break;
      case ParamType::IntList:
        d[key] = pv.get_int_list(s.name);
        break;
    }
  }
  return d;
}

py::dict capabilities(const Variant& v) {
  const Capabilities& c = v.info().caps;
  py::dict d;
  d["causal"] = c.causal, d["cross"] = c.cross, d["exact"] = c.exact;
  d["linear_score"] = c.linear_score, d["additive"] = c.additive;
  d["key_padding"] = c.key_padding, d["attn_mask"] = c.attn_mask, d["bf16"] = c.bf16;
  d["backward"] = const_cast<Variant&>(v).backward() != nullptr;
  d["decode"] = const_cast<Variant&>(v).decoder() != nullptr;
  return d;
}

}  // namespace
}  // namespace attnbench

PYBIND11_MODULE(_attnbench, m) {
  using namespace attnbench;
  m.doc() = "attnbench's compiled core; use the package attnbench";

  py::register_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (const PluginError& x) {
      PyErr_SetString(PyExc_ImportError, x.what());
    } catch (const UnsupportedError& x) {
      PyErr_SetString(PyExc_NotImplementedError, x.what());
    } catch (const SpecError& x) {
      PyErr_SetString(PyExc_ValueError, x.what());
    } catch (const UsageError& x) {
      PyErr_SetString(PyExc_ValueError, x.what());
    } catch (const InputError& x) {
      PyErr_SetString(PyExc_ValueError, x.what());
    } catch (const Error& x) {
      PyErr_SetString(PyExc_RuntimeError, x.what());
    }
  });

  m.def(
      "load_plugin", [](const std::string& path) { load_plugin(path); },
      "Loads a plugin's variants (ImportError naming the file when it cannot)");
  m.def("load_env_plugins", &load_env_plugins,
        "Loads the plugins of ATTNBENCH_PLUGINS (ImportError naming the file)");
  m.def("loaded_plugins", &loaded_plugins, "Real paths of the plugins loaded, in load order");

  m.def(
      "variants_json", [] { return variants_json().dump(); },
      "The catalogue of `attnbench list --json`, as JSON text");

  m.def(
      "_blas_threads", [] { return openblas_get_num_threads(); },
      "OpenBLAS's process-wide thread count now (tests of the thread teams)");

  m.def("max_threads", &max_threads,
        "The largest threads= accepted: 8 per core this process may use");

  m.def(
      "_last_pointers",
      [] { return py::make_tuple(g_last_q.load(), g_last_k.load(), g_last_v.load()); },
      "Data pointers of the last q, k, v wrapped (tests of the zero-copy path)");

  py::class_<PyVariant>(m, "Variant")
      .def(py::init([](const std::string& spec) { return PyVariant{make_variant(spec)}; }),
           py::arg("spec"))
      .def_property_readonly("spec", [](const PyVariant& s) { return s.v->spec(); })
      .def_property_readonly("name", [](const PyVariant& s) { return s.v->info().name; })
      .def_property_readonly("summary", [](const PyVariant& s) { return s.v->info().summary; })
      .def_property_readonly("params", [](const PyVariant& s) { return params_dict(*s.v); })
      .def_property_readonly("capabilities", [](const PyVariant& s) { return capabilities(*s.v); })
      .def_property_readonly("inputs",
                             [](const PyVariant& s) {
                               std::vector<std::string> names;
                               for (const InputSpec* in : s.v->inputs()) names.push_back(in->name);
                               return names;
                             })
      .def_property_readonly("notes",
                             [](const PyVariant& s) {
                               const std::lock_guard<std::mutex> lock(*s.mu);
                               return s.v->notes();
                             })
      .def(
          "forward",
          [](PyVariant& s, py::handle q, py::handle k, py::handle v, const py::kwargs& kw) {
            return forward(*s.v, *s.mu, q, k, v, options(kw));
          },
          py::arg("q"), py::arg("k"), py::arg("v"))
      .def(
          "forward_train",
          [](PyVariant& s, py::handle qo, py::handle ko, py::handle vo, const py::kwargs& kw) {
            const Options o = options(kw);
            auto st = std::make_unique<PySaved>();
            st->v = s.v;
            st->q = expect_f32(qo, "q"), st->k = expect_f32(ko, "k"),
            st->v_in = expect_f32(vo, "v");
            st->p = make_problem(st->q, st->k, st->v_in, o);
            s.v->check_backward(st->p);
            st->threads = resolve_threads(o.threads);
            st->out = empty(st->p.q_shape());
            record_pointers(st->q, st->k, st->v_in);
            TensorView ov = mut_view(st->out);
            {
              py::gil_scoped_release nogil;
              const std::lock_guard<std::mutex> lock(*s.mu);
              ThreadTeam team(st->threads);
              st->saved = s.v->run_train(st->p, view(st->q), kv_view(st->k, st->p),
                                         kv_view(st->v_in, st->p), ov);
            }
            F32 out = st->out;
            return py::make_tuple(out, std::move(st));
          },
          py::arg("q"), py::arg("k"), py::arg("v"))
      .def(
          "backward",
          [](PyVariant& s, PySaved& st, py::handle douto) {
            if (st.v != s.v)
              throw UsageError(
                  "backward: the saved state comes from another Variant object's forward_train");
            const F32 dout = expect_f32(douto, "dout");
            const Problem& p = st.p;
            F32 dq = empty(p.q_shape()), dk = empty(p.kv_storage_shape()),
                dv = empty(p.kv_storage_shape());
            TensorView dqv = mut_view(dq), dkv{dk.mutable_data(), shape4(dk), p.kv_group()},
                       dvv{dv.mutable_data(), shape4(dv), p.kv_group()};
            const bool given = p.extra_inputs && !p.extra_inputs->empty();
            InputGrads dinputs;
            {
              py::gil_scoped_release nogil;
              const std::lock_guard<std::mutex> lock(*s.mu);
              ThreadTeam team(st.threads);
              s.v->run_backward(p, view(st.q), kv_view(st.k, p), kv_view(st.v_in, p), view(st.out),
                                view(dout), *st.saved, dqv, dkv, dvv, given ? &dinputs : nullptr);
            }
            if (!given) return py::make_tuple(dq, dk, dv);
            // the given inputs' gradients, each shaped as its input
            py::dict grads;
            for (auto& [name, g] : dinputs) {
              const ExtraInput& x = p.extra_inputs->at(name);
              F32 a(std::vector<py::ssize_t>(x.shape.begin(), x.shape.end()));
              std::copy(g.begin(), g.end(), a.mutable_data());
              grads[py::str(name)] = a;
            }
            return py::make_tuple(dq, dk, dv, grads);
          },
          py::arg("saved"), py::arg("dout"))
      .def(
          "decoder",
          [](PyVariant& s, py::handle ko, py::handle vo, int64_t capacity, int64_t heads,
             uint64_t seed, int threads, const std::map<std::string, py::array>& inputs) {
            const F32 k = expect_f32(ko, "k"), v = expect_f32(vo, "v");
            if (!(shape4(k) == shape4(v)))
              throw UsageError("k has shape " + shape_text(k) + " but v " + shape_text(v) +
                               "; expected both [B, G, t0, d]");
            auto d = std::make_unique<PyDecoder>();
            d->v = s.v;
            Problem& p = d->p;
            p.batch = k.shape(0), p.heads = heads > 0 ? heads : k.shape(1), p.n = capacity,
            p.dim = k.shape(3);
            const int64_t g = kv_heads_of(k, p.heads);
            p.kv_heads = g < p.heads ? g : 0;
            p.causal = true;
            p.seed = seed;
            p.validate();
            s.v->check_decode(p);
            d->threads = resolve_threads(threads);
            const ConstTensorView kv = kv_view(k, p), vv = kv_view(v, p);
            const int64_t t0 = k.shape(2);
            // the learned inputs of the prefill's t0 tokens; each step then takes its token's
            const ExtraInputs given = extra_inputs(inputs);
            Decoder& dec = *s.v->decoder();
            if (!given.empty()) {
              if (!dec.decodes_inputs())
                throw UnsupportedError(fmt::format(
                    "{}: the decode step takes no given input ({}); without it the stand-in runs",
                    s.v->spec(), input_names(given)));
              s.v->check_token_inputs(p, given, t0, true);
            }
            {
              py::gil_scoped_release nogil;
              const std::lock_guard<std::mutex> lock(*s.mu);
              ThreadTeam team(d->threads);
              d->state = given.empty() ? dec.prefill(p, kv, vv, t0)
                                       : dec.prefill_given(p, kv, vv, t0, given);
            }
            return d;
          },
          py::arg("k"), py::arg("v"), py::kw_only(), py::arg("capacity"), py::arg("heads") = 0,
          py::arg("seed") = 0, py::arg("threads") = 0,
          py::arg("inputs") = std::map<std::string, py::array>{});

  py::class_<PySaved>(m, "Saved").def_property_readonly("out", [](const PySaved& s) {
    return s.out;
  });

  py::class_<PyDecoder>(m, "Decoder")
      .def_property_readonly("length", [](const PyDecoder& d) { return d.state->length(); })
      .def_property_readonly("capacity", [](const PyDecoder& d) { return d.p.n; })
      .def_property_readonly("state_bytes",
                             [](const PyDecoder& d) { return d.state->state_bytes(); })
      .def(
          "step",
          [](PyDecoder& d, py::handle qo, py::handle ko, py::handle vo,
             const std::map<std::string, py::array>& inputs) {
            const F32 q = expect_f32(qo, "q"), k = expect_f32(ko, "k"), v = expect_f32(vo, "v");
            const Problem& p = d.p;
            const ExtraInputs given = extra_inputs(inputs);  // this token's learned inputs
            if (!given.empty()) d.v->check_token_inputs(p, given, 1, false);
            F32 out = empty({p.batch, p.heads, 1, p.dim});
            const ConstTensorView qv = view(q), kv = kv_view(k, p), vv = kv_view(v, p);
            TensorView ov = mut_view(out);
            {
              py::gil_scoped_release nogil;
              const std::lock_guard<std::mutex> lock(*d.mu);
              ThreadTeam team(d.threads);
              if (given.empty())
                d.state->step(qv, kv, vv, ov);
              else
                d.state->step_given(qv, kv, vv, given, ov);
            }
            return out;
          },
          py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("inputs") = std::map<std::string, py::array>{});

  m.def(
      "reference",
      [](py::handle qo, py::handle ko, py::handle vo, const py::kwargs& kw) {
        const F32 q = expect_f32(qo, "q"), k = expect_f32(ko, "k"), v = expect_f32(vo, "v");
        const Options o = options(kw);
        const Problem p = make_problem(q, k, v, o);
        const int team_size = resolve_threads(o.threads);
        std::vector<double> r;
        {
          py::gil_scoped_release nogil;
          ThreadTeam team(team_size);
          r = reference_attention(p, view(q), kv_view(k, p), kv_view(v, p));
        }
        py::array_t<double> out({p.batch, p.heads, p.n, p.dim});
        std::memcpy(out.mutable_data(), r.data(), r.size() * sizeof(double));
        return out;
      },
      py::arg("q"), py::arg("k"), py::arg("v"));
}
