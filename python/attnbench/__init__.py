"""attnbench from Python: run attnbench's attention variants on NumPy arrays.

    import numpy as np, attnbench
    q = np.random.randn(1, 4, 128, 64).astype(np.float32)
    k = v = np.random.randn(1, 4, 128, 64).astype(np.float32)
    out = attnbench.attention("flash", q, k, v, causal=True)   # float32 [1, 4, 128, 64]

Arrays: q is [B, H, n, d], k and v are [B, G, m, d] with G (the key/value heads) dividing H.
C-contiguous float32 arrays are used in place (the variant reads their own buffers); anything
else is copied once with np.ascontiguousarray(x, dtype=np.float32). Outputs are new float32
arrays (reference(): float64).

Problem keywords (attention, reference, Variant.forward, Variant.forward_train):
  causal       bottom-right aligned causal mask (key j visible to query i iff j <= i + m - n)
  score        "scaled_dot" (default), "dot", "bilinear" or "additive"; the bilinear and
               additive weights are drawn from `seed` (as the command line draws them)
  key_padding  valid key lengths: one int for every batch element, or one per element
  attn_mask    [n, m] or [B|1, H|1, n, m]: float (added to the logits, -inf masks out; any
               finite value down to -FLT_MAX = torch.finfo(torch.float32).min, a row of
               such values only being the uniform average of its values, as in torch) or
               bool / uint8 (True = masked out, torch.nn.MultiheadAttention's convention)
  kv_heads     if given, must equal k.shape[1]
  seed         the variant's random draws (features, projections, hashes)
  threads      threads of the call (0: every core)
  dtype        "f32" (default) or "bf16": q, k, v rounded to bfloat16 (to nearest even, as
               torch's .to(torch.bfloat16)), bf16 products with float32 accumulation, the
               softmax in float32 (the forward of variants whose capabilities say bf16; the
               output stays float32). Variant.notes then names the bf16 kernel that ran.

Plugins: attnbench.load_plugin(path) loads the variants of a plugin (a shared library built
with attnbench_add_plugin, as `attnbench --plugin` loads them) for every function here, the
torch functions and the layer; the plugins of ATTNBENCH_PLUGINS (colon-separated) are loaded
when the package is imported. A plugin that cannot be loaded raises ImportError naming it.

Errors carry the C++ messages: a bad spec, value, shape or dtype raises ValueError; a keyword
of the wrong type (key_padding=3.7, seed="7") raises TypeError, one out of range (seed=-1,
threads=2**40) ValueError, both naming the keyword and what it accepts; a
problem the variant cannot run (causal, masks, a backward or decode step it lacks) raises
NotImplementedError. The GIL is released while a variant runs.
"""

import json as _json
import operator as _operator

import numpy as _np

from . import _attnbench

__all__ = ["variants", "Variant", "Decoder", "attention", "reference", "load_plugin",
           "loaded_plugins"]

# the plugins of ATTNBENCH_PLUGINS, as the command line loads them (ImportError naming the file)
_attnbench.load_env_plugins()


def _host(x):
    """A torch tensor as a NumPy array (detached, on the CPU; bfloat16, which NumPy lacks, as
    float32); anything else as it is."""
    if type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach"):
        x = x.detach().cpu()
        if x.is_floating_point() and x.element_size() == 2 and str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return x


def _as_f32(x, what):
    """x itself if it is a C-contiguous float32 ndarray, else its one float32 copy."""
    if isinstance(x, _np.ndarray) and x.dtype == _np.float32 and x.flags.c_contiguous:
        return x
    a = _np.asarray(_host(x))
    if a.dtype.kind not in "fiub":
        raise ValueError(f"{what}: dtype {a.dtype} of shape {list(a.shape)}; accepted: float32 "
                         "(used in place when C-contiguous) or a real dtype convertible to it")
    return _np.ascontiguousarray(a, dtype=_np.float32)


def _int(x, what, lo, hi, accepted):
    """x as a Python int in [lo, hi]: TypeError unless it is an integer (an int, a NumPy
    integer or anything with __index__; not a bool, a float or a string), ValueError out of
    range. Both name `what` and `accepted`."""
    if isinstance(x, (bool, _np.bool_)) or not hasattr(type(x), "__index__"):
        raise TypeError(f"{what}={x!r} ({type(x).__name__}); accepted: {accepted}")
    x = _operator.index(x)
    if not lo <= x <= hi:
        raise ValueError(f"{what}={x} is out of range; accepted: {accepted}")
    return x


def _bool(x, what):
    """x as a bool: True, False (or NumPy's), or the ints 0 and 1; TypeError otherwise."""
    if isinstance(x, (bool, _np.bool_)):
        return bool(x)
    if hasattr(type(x), "__index__") and _operator.index(x) in (0, 1):
        return bool(_operator.index(x))
    raise TypeError(f"{what}={x!r} ({type(x).__name__}); accepted: True or False")


def _str(x, what, accepted):
    if not isinstance(x, str):
        raise TypeError(f"{what}={x!r} ({type(x).__name__}); accepted: {accepted}")
    return x


_INT64_MAX = 2**63 - 1
_SEEDS = "an int in 0 .. 2**64 - 1"


def _threads(threads):
    top = _attnbench.max_threads()
    return _int(threads, "threads", 0, top, f"an int in 0 (every core) .. {top}")


_PROBLEM_KEYWORDS = ("causal", "score", "key_padding", "attn_mask", "kv_heads", "seed", "threads",
                     "dtype")


def _inputs(core, given):
    """The variant's inputs beyond q, k and v (its `inputs`, e.g. gla's g) as float32 arrays;
    TypeError for a keyword that is neither one of them nor a problem keyword."""
    taken = list(core.inputs)
    out = {}
    for name, x in given.items():
        if name not in taken:
            ins = ", ".join(taken) if taken else "none"
            raise TypeError(f"unexpected keyword {name!r}; accepted: the problem's "
                            f"{', '.join(_PROBLEM_KEYWORDS)} and {core.spec}'s inputs ({ins})")
        out[name] = _as_f32(x, name)
    return out


def _problem_kwargs(causal=False, score="scaled_dot", key_padding=None, attn_mask=None,
                    kv_heads=None, seed=0, threads=0, dtype="f32"):
    accepted = "None, an int or a sequence of ints (key lengths in 0 .. m)"
    if key_padding is None:
        lengths = []
    elif isinstance(key_padding, (str, bytes)):
        raise TypeError(f"key_padding={key_padding!r} (str); accepted: {accepted}")
    elif _np.ndim(key_padding) == 0:
        lengths = [_int(key_padding, "key_padding", 0, _INT64_MAX, accepted)]
    else:
        lengths = [_int(x, "key_padding", 0, _INT64_MAX, accepted)
                   for x in _np.asarray(key_padding, dtype=object).reshape(-1).tolist()]
    if attn_mask is not None:
        mask = _np.asarray(_host(attn_mask))
        if mask.dtype.kind == "f" and mask.dtype != _np.float32:
            if mask.dtype.itemsize > 4:
                # a finite value stays finite (a float64 -1e300 is -FLT_MAX, not -inf)
                big = _np.finfo(_np.float32).max
                mask = _np.where(_np.isfinite(mask), _np.clip(mask, -big, big), mask)
            mask = mask.astype(_np.float32)
        attn_mask = _np.ascontiguousarray(mask)
    return dict(causal=_bool(causal, "causal"),
                score=_str(score, "score", '"scaled_dot", "dot", "bilinear" or "additive"'),
                key_padding=lengths, attn_mask=attn_mask,
                kv_heads=0 if kv_heads is None else _int(
                    kv_heads, "kv_heads", 0, _INT64_MAX,
                    "None (or 0): from k's shape, or k.shape[1] (an int)"),
                seed=_int(seed, "seed", 0, 2**64 - 1, _SEEDS),
                threads=_threads(threads),
                dtype=_str(dtype, "dtype", '"f32" or "bf16"'))


def load_plugin(path):
    """Loads the variants of the plugin at `path` (str or os.PathLike) and returns their names.
    Loading a file already loaded does nothing more. ImportError names the file and why it
    cannot be loaded (missing, another ABI, a name already registered, no variant)."""
    import os
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"load_plugin: path {path!r} ({type(path).__name__}); accepted: a str "
                        "or os.PathLike naming a shared library")
    _attnbench.load_plugin(path)
    real = os.path.realpath(path)
    return [v["name"] for v in variants() if v.get("plugin") == real]


def loaded_plugins():
    """Real paths of the plugins loaded so far (ATTNBENCH_PLUGINS and load_plugin), in order."""
    return list(_attnbench.loaded_plugins())


def variants():
    """Every variant, as `attnbench list --json` prints it (a list of dicts)."""
    return _json.loads(_attnbench.variants_json())


class Decoder:
    """A decode state (see Variant.decoder): step(q, k, v) appends one token's key and value
    ([B, G, 1, d]) at position `length` and returns the output [B, H, 1, d] of its query.
    append(k, v) then attend(q) is the same step in two calls: the token's key and value,
    then its query."""

    def __init__(self, core, variant):
        self._core = core
        self._variant = variant
        self._pending = None

    @property
    def length(self):
        """Tokens held (prefill and steps): the position of the next step."""
        return self._core.length

    @property
    def capacity(self):
        return self._core.capacity

    @property
    def state_bytes(self):
        """Bytes the state holds per sequence (batch element)."""
        return self._core.state_bytes

    def step(self, q, k, v, **inputs):
        """The output [B, H, 1, d] of the token's q, k, v. `inputs`: the token's learned
        inputs (gla's g [B, G, 1, d], deltanet's beta [B, G, 1], ...), when the decoder was
        prefilled with them."""
        if self._pending is not None:
            raise ValueError("step(): a key and value appended by append() wait for their "
                             "query; call attend(q) first")
        return self._core.step(_as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v"),
                               inputs=_inputs(self._variant, inputs))

    def append(self, k, v, **inputs):
        """Appends the next token's key and value [B, G, 1, d] (and its learned inputs, as
        step() takes them); attend(q) then gives the output of its query. One token at a
        time: append, attend, append, attend, ..."""
        if self._pending is not None:
            raise ValueError("append(): the token appended before has not attended yet; call "
                             "attend(q) for it first (one token at a time)")
        if self.length >= self.capacity:
            raise ValueError(f"append(): the state is full (capacity {self.capacity} tokens)")
        self._pending = (_as_f32(k, "k"), _as_f32(v, "v"), _inputs(self._variant, inputs))
        return self

    def attend(self, q):
        """The output [B, H, 1, d] of the query q [B, H, 1, d] of the token append() added."""
        if self._pending is None:
            raise ValueError("attend(): no appended token; call append(k, v) first")
        k, v, inputs = self._pending
        out = self._core.step(_as_f32(q, "q"), k, v, inputs=inputs)
        self._pending = None
        return out


class Variant:
    """A variant built from a spec string "name:key=value,..." (ValueError if it is bad)."""

    def __init__(self, spec):
        self._core = _attnbench.Variant(_str(spec, "spec", 'a spec string "name:key=value,..."'))

    spec = property(lambda self: self._core.spec, doc="canonical spec, every parameter")
    name = property(lambda self: self._core.name)
    summary = property(lambda self: self._core.summary)
    params = property(lambda self: self._core.params, doc="parameter values, a dict (typed)")
    capabilities = property(lambda self: self._core.capabilities)
    notes = property(lambda self: self._core.notes,
                     doc="what the last call ran, as the results' notes column says it")
    has_backward = property(lambda self: self._core.capabilities["backward"])
    has_decode = property(lambda self: self._core.capabilities["decode"])

    def __repr__(self):
        return f"attnbench.Variant({self.spec!r})"

    inputs = property(lambda self: list(self._core.inputs),
                      doc="names of the inputs it takes beyond q, k and v (keyword arrays)")

    def _kwargs(self, problem):
        given = {k: problem.pop(k) for k in list(problem) if k not in _PROBLEM_KEYWORDS}
        return dict(_problem_kwargs(**problem), inputs=_inputs(self._core, given))

    def forward(self, q, k, v, **problem):
        """The output [B, H, n, d] (float32) of the variant on q, k, v. Keywords: the
        problem's (causal, score, ...) and the variant's inputs beyond q, k and v by name
        (gla's g, deltanet's beta, ...: `inputs`); an input not given is stood in for."""
        return self._core.forward(_as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v"),
                                  **self._kwargs(problem))

    def forward_train(self, q, k, v, **problem):
        """The training forward: (out, saved), saved being what backward() needs. It holds
        q, k, v (the arrays, not copies): do not change them before backward()."""
        return self._core.forward_train(_as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v"),
                                        **self._kwargs(problem))

    def backward(self, saved, dout):
        """(dq, dk, dv) of L = sum(dout * out) for the forward_train that gave `saved`; dk and
        dv are shaped like k and v (grouped heads: summed over each group). When forward_train
        was given inputs beyond q, k and v (gla's g, ...), (dq, dk, dv, grads) with grads a
        dict of their gradients by name, each shaped as its input."""
        return self._core.backward(saved, _as_f32(dout, "dout"))

    def decoder(self, k, v, *, capacity, heads=None, seed=0, threads=0, **inputs):
        """Generation: a Decoder holding the prefill k, v [B, G, t0, d] (t0 may be 0) of a
        causal self-attention of up to `capacity` tokens with `heads` query heads (default
        G). Call step(q, k, v) for positions t0, t0 + 1, ... (each [.., 1, d]): its outputs
        equal the rows of the causal forward pass on the whole sequence. `inputs`: the
        learned inputs of the prefill's tokens (gla's g [B, G, t0, d], deltanet's beta
        [B, G, t0], ...; gla and deltanet take them); each step then takes its token's."""
        return Decoder(self._core.decoder(
            _as_f32(k, "k"), _as_f32(v, "v"),
            capacity=_int(capacity, "capacity", 1, _INT64_MAX, "an int >= 1 (tokens)"),
            heads=0 if heads is None else _int(heads, "heads", 1, _INT64_MAX,
                                               "None or an int >= 1 (a multiple of G)"),
            seed=_int(seed, "seed", 0, 2**64 - 1, _SEEDS), threads=_threads(threads),
            inputs=_inputs(self._core, inputs)), self._core)


def attention(spec, q, k, v, *, causal=False, score="scaled_dot", key_padding=None,
              attn_mask=None, kv_heads=None, seed=0, threads=0, dtype="f32", **inputs):
    """Variant(spec).forward(q, k, v, ...): float32 [B, H, n, d]. `inputs`: the variant's
    inputs beyond q, k and v by name (gla's g, deltanet's beta, ...)."""
    return Variant(spec).forward(q, k, v, causal=causal, score=score, key_padding=key_padding,
                                 attn_mask=attn_mask, kv_heads=kv_heads, seed=seed,
                                 threads=threads, dtype=dtype, **inputs)


def reference(q, k, v, *, causal=False, score="scaled_dot", key_padding=None, attn_mask=None,
              kv_heads=None, seed=0, threads=0):
    """The exact float64 softmax attention [B, H, n, d] the variants are checked against."""
    return _attnbench.reference(_as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v"),
                                **_problem_kwargs(causal=causal, score=score,
                                                  key_padding=key_padding, attn_mask=attn_mask,
                                                  kv_heads=kv_heads, seed=seed, threads=threads))
