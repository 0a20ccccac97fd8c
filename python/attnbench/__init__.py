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
  attn_mask    [n, m] or [B|1, H|1, n, m]: float (added to the logits, -inf masks out) or bool
               / uint8 (True = masked out, torch.nn.MultiheadAttention's convention)
  kv_heads     if given, must equal k.shape[1]
  seed         the variant's random draws (features, projections, hashes)
  threads      threads of the call (0: every core)
  dtype        "f32" (default) or "bf16": q, k, v rounded to bfloat16 (to nearest even, as
               torch's .to(torch.bfloat16)), bf16 products with float32 accumulation, the
               softmax in float32 (the forward of variants whose capabilities say bf16; the
               output stays float32). Variant.notes then names the bf16 kernel that ran.

Errors carry the C++ messages: a bad spec, value, shape or dtype raises ValueError; a
problem the variant cannot run (causal, masks, a backward or decode step it lacks) raises
NotImplementedError. The GIL is released while a variant runs.
"""

import json as _json

import numpy as _np

from . import _attnbench

__all__ = ["variants", "Variant", "Decoder", "attention", "reference"]


def _as_f32(x, what):
    """x itself if it is a C-contiguous float32 ndarray, else its one float32 copy."""
    if isinstance(x, _np.ndarray) and x.dtype == _np.float32 and x.flags.c_contiguous:
        return x
    a = _np.asarray(x)
    if a.dtype.kind not in "fiub":
        raise ValueError(f"{what}: dtype {a.dtype} of shape {list(a.shape)}; accepted: float32 "
                         "(used in place when C-contiguous) or a real dtype convertible to it")
    return _np.ascontiguousarray(a, dtype=_np.float32)


def _problem_kwargs(causal=False, score="scaled_dot", key_padding=None, attn_mask=None,
                    kv_heads=None, seed=0, threads=0, dtype="f32"):
    if key_padding is None:
        lengths = []
    elif _np.isscalar(key_padding):
        lengths = [int(key_padding)]
    else:
        lengths = [int(x) for x in key_padding]
    if attn_mask is not None:
        mask = _np.asarray(attn_mask)
        if mask.dtype.kind == "f" and mask.dtype != _np.float32:
            mask = mask.astype(_np.float32)
        attn_mask = _np.ascontiguousarray(mask)
    return dict(causal=bool(causal), score=str(score), key_padding=lengths, attn_mask=attn_mask,
                kv_heads=0 if kv_heads is None else int(kv_heads), seed=int(seed),
                threads=int(threads), dtype=str(dtype))


def variants():
    """Every variant, as `attnbench list --json` prints it (a list of dicts)."""
    return _json.loads(_attnbench.variants_json())


class Decoder:
    """A decode state (see Variant.decoder): step(q, k, v) appends one token's key and value
    ([B, G, 1, d]) at position `length` and returns the output [B, H, 1, d] of its query.
    append(k, v) then attend(q) is the same step in two calls: the token's key and value,
    then its query."""

    def __init__(self, core):
        self._core = core
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

    def step(self, q, k, v):
        if self._pending is not None:
            raise ValueError("step(): a key and value appended by append() wait for their "
                             "query; call attend(q) first")
        return self._core.step(_as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v"))

    def append(self, k, v):
        """Appends the next token's key and value [B, G, 1, d]; attend(q) then gives the
        output of its query. One token at a time: append, attend, append, attend, ..."""
        if self._pending is not None:
            raise ValueError("append(): the token appended before has not attended yet; call "
                             "attend(q) for it first (one token at a time)")
        if self.length >= self.capacity:
            raise ValueError(f"append(): the state is full (capacity {self.capacity} tokens)")
        self._pending = (_as_f32(k, "k"), _as_f32(v, "v"))
        return self

    def attend(self, q):
        """The output [B, H, 1, d] of the query q [B, H, 1, d] of the token append() added."""
        if self._pending is None:
            raise ValueError("attend(): no appended token; call append(k, v) first")
        k, v = self._pending
        out = self._core.step(_as_f32(q, "q"), k, v)
        self._pending = None
        return out


class Variant:
    """A variant built from a spec string "name:key=value,..." (ValueError if it is bad)."""

    def __init__(self, spec):
        self._core = _attnbench.Variant(str(spec))

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

    def forward(self, q, k, v, **problem):
        """The output [B, H, n, d] (float32) of the variant on q, k, v."""
        return self._core.forward(_as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v"),
                                  **_problem_kwargs(**problem))

    def forward_train(self, q, k, v, **problem):
        """The training forward: (out, saved), saved being what backward() needs. It holds
        q, k, v (the arrays, not copies): do not change them before backward()."""
        return self._core.forward_train(_as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v"),
                                        **_problem_kwargs(**problem))

    def backward(self, saved, dout):
        """(dq, dk, dv) of L = sum(dout * out) for the forward_train that gave `saved`; dk and
        dv are shaped like k and v (grouped heads: summed over each group)."""
        return self._core.backward(saved, _as_f32(dout, "dout"))

    def decoder(self, k, v, *, capacity, heads=None, seed=0, threads=0):
        """Generation: a Decoder holding the prefill k, v [B, G, t0, d] (t0 may be 0) of a
        causal self-attention of up to `capacity` tokens with `heads` query heads (default
        G). Call step(q, k, v) for positions t0, t0 + 1, ... (each [.., 1, d]): its outputs
        equal the rows of the causal forward pass on the whole sequence."""
        return Decoder(self._core.decoder(_as_f32(k, "k"), _as_f32(v, "v"),
                                          capacity=int(capacity),
                                          heads=0 if heads is None else int(heads),
                                          seed=int(seed), threads=int(threads)))


def attention(spec, q, k, v, *, causal=False, score="scaled_dot", key_padding=None,
              attn_mask=None, kv_heads=None, seed=0, threads=0, dtype="f32"):
    """Variant(spec).forward(q, k, v, ...): float32 [B, H, n, d]."""
    return Variant(spec).forward(q, k, v, causal=causal, score=score, key_padding=key_padding,
                                 attn_mask=attn_mask, kv_heads=kv_heads, seed=seed,
                                 threads=threads, dtype=dtype)


def reference(q, k, v, *, causal=False, score="scaled_dot", key_padding=None, attn_mask=None,
              kv_heads=None, seed=0, threads=0):
    """The exact float64 softmax attention [B, H, n, d] the variants are checked against."""
    return _attnbench.reference(_as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v"),
                                **_problem_kwargs(causal=causal, score=score,
                                                  key_padding=key_padding, attn_mask=attn_mask,
                                                  kv_heads=kv_heads, seed=seed, threads=threads))
