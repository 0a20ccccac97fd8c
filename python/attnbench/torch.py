"""attnbench variants as torch autograd functions, on CPU float32 tensors.

    import torch, attnbench.torch
    q = torch.randn(1, 4, 128, 64, requires_grad=True)
    k = v = torch.randn(1, 4, 128, 64, requires_grad=True)
    out = attnbench.torch.attention("flash", q, k, v, causal=True)
    out.sum().backward()          # the variant's own backward pass fills q.grad, k.grad, ...

Shapes and keywords are those of attnbench.attention (k, v [B, G, m, d]). Contiguous CPU
float32 tensors are shared with the variant (tensor.numpy(), torch.from_numpy: no copies);
others are copied once to that. When any input requires a gradient the forward runs the
variant's training pass (Variant.forward_train) and backward() its backward pass; otherwise
the plain forward. A problem the variant has no backward for (the additive score) runs its
forward, and backward() raises NotImplementedError saying why. Changing q, k, v or a given
input in place between the two is caught by torch's version check.

The variant's inputs beyond q, k and v (gla's g, deltanet's beta, ...: Variant.inputs) are
keywords; those that require grad get it from the variant's backward pass:

    g = torch.nn.functional.logsigmoid(torch.randn(1, 4, 128, 64)).div(16).requires_grad_()
    attnbench.torch.attention("gla", q, k, v, causal=True, g=g).sum().backward()   # g.grad
"""

import torch as _torch

from . import Variant, _as_f32, _problem_kwargs


def _array(x, what):
    if not isinstance(x, _torch.Tensor):
        return _as_f32(x, what)
    if x.device.type != "cpu":
        raise ValueError(f"{what}: a tensor on {x.device}; attnbench runs on CPU tensors")
    x = x.detach()
    if x.dtype != _torch.float32 or not x.is_contiguous():
        x = x.to(_torch.float32).contiguous()
    return x.numpy()


def _mask_array(m):
    """A torch mask as the NumPy array attnbench.attention takes (its graph left alone)."""
    m = m.detach().cpu()
    if m.is_floating_point() and m.dtype not in (_torch.float32, _torch.float64, _torch.float16):
        m = m.to(_torch.float32)  # bfloat16 has no NumPy dtype; it converts exactly
    return m.numpy()


# the variants whose probabilities are the softmax of every logit (no pattern, no approximation)
_DENSE_EXACT = ("full", "flash")


def _mask_grad_refusal(variant, problem):
    """Why the gradient of a float attn_mask cannot be given for this call, or None."""
    if variant.name not in _DENSE_EXACT:
        return (f"attn_mask requires grad, but {variant.name} is not a dense exact variant: "
                "the gradient of the mask is given for full and flash, whose softmax "
                "probabilities are those of every masked logit; detach the mask (or "
                "requires_grad_(False)) to run it as a constant")
    if problem["score"] not in ("scaled_dot", "dot"):
        return (f"attn_mask requires grad with score={problem['score']!r}: its gradient is "
                "given for the scaled_dot and dot scores; detach the mask to run it as a "
                "constant")
    return None


def _mask_grad(q, k, v, out, dout, mask, problem):
    """The gradient of L = sum(dout * out) in the float mask (shape of `mask`): dS = P o (dP -
    D), the gradient of the logits (dP = dout Vᵀ, D = rowsum(dout o out)), summed over the
    dims the mask broadcasts over. P is recomputed densely, [B, H, n, m] in float32."""
    b, h, n, d = q.shape
    m = k.shape[2]
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = d ** -0.5 if problem["score"] == "scaled_dot" else 1.0
    logits = (q @ k.transpose(-1, -2)) * scale + mask.to(_torch.float32)
    hidden = _torch.zeros(b, 1, n, m, dtype=_torch.bool)
    if problem["causal"]:
        i = _torch.arange(n)[:, None]
        j = _torch.arange(m)[None, :]
        hidden |= j > i + (m - n)
    lengths = problem["key_padding"]
    if lengths:
        if len(lengths) == 1:
            lengths = lengths * b
        hidden |= _torch.arange(m)[None, None, None, :] >= \
            _torch.tensor(lengths).reshape(b, 1, 1, 1)
    logits = logits.masked_fill(hidden, float("-inf"))
    p = _torch.nan_to_num(_torch.softmax(logits, dim=-1), nan=0.0)  # a row of no key: 0
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return ds.sum_to_size(mask.shape).to(mask.dtype)


class _Attention(_torch.autograd.Function):
    """q, k, v, the optional float mask and the variant's given inputs (by `names`, in that
    order) in; the output out. The variant's backward gives the gradients of q, k, v and of
    the given inputs (dict by name); the mask's is recomputed densely (_mask_grad)."""

    @staticmethod
    def forward(ctx, variant, problem, names, q, k, v, mask, *inputs):
        arrays = (_array(q, "q"), _array(k, "k"), _array(v, "v"))
        given = {name: _array(x, name) for name, x in zip(names, inputs)}
        ctx.variant = variant
        ctx.problem = problem
        ctx.names = names
        ctx.no_backward = None
        ctx.core_saved = None
        out = None
        if any(ctx.needs_input_grad[3:6]) or any(ctx.needs_input_grad[7:]):
            try:
                out, ctx.core_saved = variant.forward_train(*arrays, **problem, **given)
            except NotImplementedError as e:
                # no backward for this problem: the forward runs, backward() raises why
                ctx.no_backward = str(e)
        if out is None:
            out = variant.forward(*arrays, **problem, **given)
        out = _torch.from_numpy(out)
        # q, k, v and the inputs for torch's in-place (version) check; with the mask and out,
        # what the mask's gradient is recomputed from
        ctx.mask_grad = ctx.needs_input_grad[6]
        if ctx.mask_grad:
            ctx.save_for_backward(q, k, v, mask, out, *inputs)
        else:
            ctx.save_for_backward(q, k, v, *inputs)
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # raises if q, k, v or an input changed in place since
        dq = dk = dv = dmask = None
        dinputs = [None] * len(ctx.names)
        if any(ctx.needs_input_grad[3:6]) or any(ctx.needs_input_grad[7:]):
            if ctx.no_backward is not None:
                raise NotImplementedError(ctx.no_backward)
            grads = ctx.variant.backward(ctx.core_saved, _array(dout, "dout"))
            dq, dk, dv = (_torch.from_numpy(x) for x in grads[:3])
            if ctx.names:
                by_name = grads[3]
                dinputs = [_torch.from_numpy(by_name[name]) if ctx.needs_input_grad[7 + i]
                           else None for i, name in enumerate(ctx.names)]
        if ctx.mask_grad:
            q, k, v, mask, out = saved[:5]
            with _torch.no_grad():
                dmask = _mask_grad(*(x.detach().to(_torch.float32) for x in (q, k, v)), out,
                                   dout.to(_torch.float32), mask.detach(), ctx.problem)
        return (None, None, None, dq, dk, dv, dmask, *dinputs)


def attention(spec, q, k, v, *, causal=False, score="scaled_dot", key_padding=None,
              attn_mask=None, kv_heads=None, seed=0, threads=0, **inputs):
    """attnbench.attention on torch tensors, differentiable through the variant's backward.
    `spec` is a spec string or an attnbench.Variant. `inputs`: the variant's inputs beyond q,
    k and v by name (gla's g, deltanet's beta, ...: Variant.inputs), tensors or arrays; those
    that require grad get their gradient from the variant's backward pass."""
    variant = spec if isinstance(spec, Variant) else Variant(spec)
    mask = None  # the mask as an input of the graph, when it requires grad
    if isinstance(attn_mask, _torch.Tensor):
        if attn_mask.requires_grad and _torch.is_grad_enabled():
            mask = attn_mask
        attn_mask = _mask_array(attn_mask)
    problem = _problem_kwargs(causal=causal, score=score, key_padding=key_padding,
                              attn_mask=attn_mask, kv_heads=kv_heads, seed=seed,
                              threads=threads)
    if mask is not None:
        refusal = _mask_grad_refusal(variant, problem)
        if refusal is not None:
            raise NotImplementedError(refusal)
    taken = variant.inputs
    for name in inputs:
        if name not in taken:
            raise TypeError(f"unexpected keyword {name!r}; accepted: the problem's keywords "
                            f"and {variant.spec}'s inputs ({', '.join(taken) or 'none'})")
    names = tuple(inputs)
    values = [x if isinstance(x, _torch.Tensor) else _torch.from_numpy(_as_f32(x, name))
              for name, x in inputs.items()]
    return _Attention.apply(variant, problem, names, q, k, v, mask, *values)


class LearnedInputs(_torch.nn.Module):
    """The inputs a variant takes beyond q, k and v (Variant.inputs), produced from the
    layer's input as each mechanism's paper produces them, with learned parameters:

    ========== ============= ============================================================
    variant    input         produced from x [B, L, E] (x of the keys for per-key inputs)
    ========== ============= ============================================================
    gla        g             logsigmoid(gk_proj(x)) / 16, gk_proj = Linear(E, 16, no bias)
                             then Linear(16, G d): a rank-16 gate per key feature
    deltanet   beta          sigmoid(b_proj(x)), b_proj = Linear(E, G, no bias)
    deltanet   g (gated)     -exp(A_log) softplus(a_proj(x) + dt_bias), a_proj =
                             Linear(E, G, no bias), A_log and dt_bias [G] (Mamba-2's decay)
    nsa        g_cmp, g_slc, sigmoid(g_proj(x)), g_proj = Linear(E, 3 H): one gate per query,
               g_swa         head and branch
    rfa        g (gate=true) sigmoid(g_proj(x)), g_proj = Linear(E, H), per key and head
    linformer  E, F          parameters E, F [H, proj, max_length] (F without share_kv),
                             entries N(0, 1/proj); a call with S keys reads columns 0..S-1
    ========== ============= ============================================================

    Parameter names are those of the first column's modules, under the layer's `inputs.`
    (e.g. `inputs.gk_proj.0.weight`, `inputs.b_proj.weight`, `inputs.E`). An input with no
    rule here (a plugin's) is left to the variant's seeded stand-in, with a warning.

    A state_dict without these parameters (one saved from torch.nn.MultiheadAttention, or
    before they existed) loads: the layer then runs the variant's seeded stand-ins for them
    and warns; `stood_in` is True until learn() switches the projections (as initialised)
    back on.
    """

    def __init__(self, variant, embed_dim, num_heads, head_dim, kv_heads=None,
                 max_length=None, seed=0):
        super().__init__()
        self.variant = variant if isinstance(variant, Variant) else Variant(variant)
        G = kv_heads or num_heads
        H, d, E = num_heads, head_dim, embed_dim
        gen = _torch.Generator().manual_seed(int(seed))
        self.names = []         # the inputs produced here
        self.unproduced = []    # the variant's inputs left to its stand-ins
        self.stood_in = False
        self._load_hook = self._register_load_state_dict_pre_hook(self._on_load, with_module=False)
        name = self.variant.name
        lin = _torch.nn.Linear
        for x in self.variant.inputs:
            if name == "gla" and x == "g":
                self.gk_proj = _torch.nn.Sequential(lin(E, 16, bias=False), lin(16, G * d))
            elif name == "deltanet" and x == "beta":
                self.b_proj = lin(E, G, bias=False)
            elif name == "deltanet" and x == "g":
                self.a_proj = lin(E, G, bias=False)
                # A in [1, 16] and dt in [1e-3, 1e-1] log-uniform, as Mamba-2 initialises them
                a = _torch.empty(G).uniform_(1.0, 16.0, generator=gen)
                dt = _torch.exp(_torch.rand(G, generator=gen) * (_torch.log(_torch.tensor(0.1))
                                                                - _torch.log(_torch.tensor(1e-3)))
                                + _torch.log(_torch.tensor(1e-3)))
                self.A_log = _torch.nn.Parameter(_torch.log(a))
                self.dt_bias = _torch.nn.Parameter(dt + _torch.log(-_torch.expm1(-dt)))
            elif name == "nsa" and x in ("g_cmp", "g_slc", "g_swa"):
                if not hasattr(self, "g_proj"):
                    self.g_proj = lin(E, 3 * H)
            elif name == "rfa" and x == "g":
                self.g_proj = lin(E, H)
            elif name == "linformer" and x in ("E", "F"):
                if max_length is None:
                    raise ValueError(f"{self.variant.spec} learns its projections E and F over "
                                     f"the layer's maximum length: pass max_length (the most "
                                     f"keys a call will have)")
                proj = int(self.variant.params["proj"])
                w = _torch.randn(H, proj, int(max_length), generator=gen) / proj ** 0.5
                setattr(self, x, _torch.nn.Parameter(w))
            else:
                self.unproduced.append(x)
                continue
            self.names.append(x)
        if self.unproduced:
            import warnings
            warnings.warn(f"attnbench.torch: no learned projection for {self.variant.spec}'s "
                          f"inputs {', '.join(self.unproduced)}; its seeded stand-ins are used")
        self.num_heads, self.kv_heads, self.head_dim = H, G, d
        self.max_length = max_length

    def _on_load(self, state_dict, prefix, local_metadata, strict, missing_keys,
                 unexpected_keys, error_msgs):
        own = [prefix + k for k in self.state_dict()]
        if own and not any(k in state_dict for k in own):
            for k, t in zip(own, self.state_dict().values()):
                state_dict[k] = t  # kept as they are: nothing missing
            self.stood_in = True
            import warnings
            warnings.warn(f"attnbench.torch: the state_dict has no {prefix}* parameters; "
                          f"{self.variant.spec} runs its seeded stand-ins for "
                          f"{', '.join(self.names)} (call learn() on {prefix.rstrip('.') or 'the module'} to "
                          f"train projections instead)")

    def learn(self):
        """Produces the inputs from the projections again (after a load without them)."""
        self.stood_in = False
        return self

    def forward(self, x, x_keys=None):
        """{name: tensor} of the inputs from the queries' x [B, L, E] and the keys' x_keys
        [B, S, E] (default x); {} while stood_in."""
        if self.stood_in or not self.names:
            return {}
        xk = x if x_keys is None else x_keys
        B, S = xk.shape[0], xk.shape[1]
        G, H, d = self.kv_heads, self.num_heads, self.head_dim
        f = _torch.nn.functional
        out = {}
        for name in self.names:
            if name == "g" and self.variant.name == "gla":
                g = f.logsigmoid(self.gk_proj(xk)) / 16.0
                out[name] = g.reshape(B, S, G, d).permute(0, 2, 1, 3)
            elif name == "beta":
                out[name] = _torch.sigmoid(self.b_proj(xk)).transpose(1, 2)
            elif name == "g" and self.variant.name == "deltanet":
                dt = f.softplus(self.a_proj(xk) + self.dt_bias)
                out[name] = (-_torch.exp(self.A_log) * dt).transpose(1, 2)
            elif name.startswith("g_"):
                if "g_cmp" not in out:
                    gates = _torch.sigmoid(self.g_proj(x)).reshape(B, x.shape[1], 3, H)
                    for i, gname in enumerate(("g_cmp", "g_slc", "g_swa")):
                        out[gname] = gates[:, :, i, :].transpose(1, 2)
            elif name == "g":  # rfa
                out[name] = _torch.sigmoid(self.g_proj(xk)).transpose(1, 2)
            else:  # linformer's E, F
                w = getattr(self, name)
                if S > w.shape[2]:
                    raise ValueError(f"{S} keys; this layer's {name} covers max_length = "
                                     f"{w.shape[2]} keys")
                out[name] = w[:, :, :S]
        return {k: t.contiguous() for k, t in out.items() if k in self.names}


class MultiheadAttention(_torch.nn.Module):
    """torch.nn.MultiheadAttention with an attnbench variant as its attention core.

    Its parameters and state_dict are torch.nn.MultiheadAttention's (in_proj_weight,
    in_proj_bias, out_proj.weight, out_proj.bias, initialised the same way), so a model swaps
    one for the other by loading the same weights:

        layer = attnbench.torch.MultiheadAttention(512, 8, variant="flash")
        layer.load_state_dict(torch_layer.state_dict())
        out, _ = layer(x, x, x, need_weights=False)

    forward() takes torch's arguments: key_padding_mask [B, S] (bool, True = ignored, or float
    added) and attn_mask [L, S] or [B num_heads, L, S] (bool, True = not allowed, or float
    added), both passed to the variant as one float mask, so the variant must honour masks
    (`list`: mask). is_causal=True is the causal mask of self-attention (L = S). A query that
    sees no key gives 0 here where torch gives NaN. need_weights=True returns the attention
    probabilities (averaged over heads with average_attn_weights), which only the dense exact
    variants (full, flash) have; the others need need_weights=False. Unlike torch's default,
    batch_first is True ([B, L, E]). Not supported (ValueError): dropout > 0, add_bias_kv,
    add_zero_attn, kdim or vdim other than embed_dim.

    A variant with learned inputs (gla's gates, deltanet's beta, nsa's branch gates, rfa's
    gate, linformer's E and F) gets them from learned projections of the layer's input, the
    module `inputs` (LearnedInputs: its table gives each rule and parameter name, e.g.
    `inputs.gk_proj.0.weight`); linformer needs max_length, the most keys a call will have.
    A state_dict without them (torch.nn.MultiheadAttention's) loads, and the layer then runs
    the variant's seeded stand-ins for them and warns.
    """

    def __init__(self, embed_dim, num_heads, variant="flash", batch_first=True, dropout=0.0,
                 bias=True, add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None,
                 device=None, dtype=None, threads=0, seed=0, max_length=None):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} and num_heads {num_heads}: embed_dim must "
                             f"be a positive multiple of num_heads")
        unsupported = [name for name, bad in (
            ("dropout > 0", dropout), ("add_bias_kv", add_bias_kv),
            ("add_zero_attn", add_zero_attn),
            ("kdim != embed_dim", kdim not in (None, embed_dim)),
            ("vdim != embed_dim", vdim not in (None, embed_dim))) if bad]
        if unsupported:
            raise ValueError("attnbench.torch.MultiheadAttention does not support " +
                             ", ".join(unsupported) + "; accepted: torch's defaults for them")
        if dtype not in (None, _torch.float32):
            raise ValueError(f"dtype {dtype}: attnbench's variants run in float32")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.batch_first = batch_first
        self.dropout = 0.0
        self.kdim = self.vdim = embed_dim
        # torch.nn.TransformerEncoderLayer's fused inference path reads a layer's weights and
        # computes attention itself, skipping this module (and its variant) when this flag is
        # True; False keeps every call going through forward()
        self._qkv_same_embed_dim = False
        self.variant = variant if isinstance(variant, Variant) else Variant(variant)
        self.threads, self.seed = threads, seed
        factory = dict(device=device, dtype=_torch.float32)
        self.in_proj_weight = _torch.nn.Parameter(_torch.empty(3 * embed_dim, embed_dim, **factory))
        self.register_parameter("q_proj_weight", None)
        self.register_parameter("k_proj_weight", None)
        self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = _torch.nn.Parameter(_torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = _torch.nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()
        # the variant's learned inputs (gla's g, deltanet's beta, linformer's E, ...), from
        # projections of the layer's input: LearnedInputs
        self.inputs = LearnedInputs(self.variant, embed_dim, num_heads, self.head_dim,
                                    max_length=max_length, seed=seed)

    def _reset_parameters(self):
        # as torch.nn.MultiheadAttention initialises them
        _torch.nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            _torch.nn.init.constant_(self.in_proj_bias, 0.0)
            _torch.nn.init.constant_(self.out_proj.bias, 0.0)

    def _mask(self, key_padding_mask, attn_mask, batch, length, keys):
        """One float mask [B|1, H|1, L, S] (-inf where masked), or None."""
        def as_float(m, what):
            # a float mask keeps its graph: one that requires grad gets its gradient
            if m.dtype == _torch.bool:
                return _torch.zeros(m.shape).masked_fill_(m, float("-inf"))
            if not m.is_floating_point():
                raise ValueError(f"{what}: dtype {m.dtype}; accepted: bool or floating point")
            return m.to(_torch.float32)
        mask = None
        if attn_mask is not None:
            m = as_float(attn_mask, "attn_mask")
            if m.dim() == 2 and m.shape == (length, keys):
                m = m.reshape(1, 1, length, keys)
            elif m.dim() == 3 and m.shape == (batch * self.num_heads, length, keys):
                m = m.reshape(batch, self.num_heads, length, keys)
            else:
                raise ValueError(f"attn_mask of shape {tuple(m.shape)}; accepted: "
                                 f"[L, S] = [{length}, {keys}] or [B num_heads, L, S] = "
                                 f"[{batch * self.num_heads}, {length}, {keys}]")
            mask = m
        if key_padding_mask is not None:
            m = as_float(key_padding_mask, "key_padding_mask")
            if m.shape != (batch, keys):
                raise ValueError(f"key_padding_mask of shape {tuple(m.shape)}; accepted: "
                                 f"[B, S] = [{batch}, {keys}]")
            m = m.reshape(batch, 1, 1, keys)
            mask = m if mask is None else mask + m
        if mask is None:
            return None
        shape = (mask.shape[0], mask.shape[1], length, keys)
        return _torch.broadcast_to(mask, shape).contiguous()

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError("query, key and value must be [B, L, E] (batched; batch_first="
                             f"{self.batch_first} takes {'[B, L, E]' if self.batch_first else '[L, B, E]'})")
        b, length, e = query.shape
        keys = key.shape[1]
        if e != self.embed_dim or key.shape[2] != e or value.shape[2] != e or \
                key.shape[0] != b or value.shape[:2] != key.shape[:2]:
            raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                             f"{tuple(value.shape)}: expected the same B, key and value of one "
                             f"length S, and E = {self.embed_dim}")
        if is_causal and length != keys:
            raise ValueError(f"is_causal needs self-attention lengths (L = S), got L = {length}, "
                             f"S = {keys}")
        h, d = self.num_heads, self.head_dim
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        def heads(x, w, bias, n):
            y = _torch.nn.functional.linear(x, w, bias)
            return y.reshape(b, n, h, d).transpose(1, 2).contiguous()
        q = heads(query, w_q, b_q, length)
        k = heads(key, w_k, b_k, keys)
        v = heads(value, w_v, b_v, keys)
        mask = self._mask(key_padding_mask, attn_mask, b, length, keys)
        out = attention(self.variant, q, k, v, causal=is_causal,
                        attn_mask=mask, seed=self.seed,
                        threads=self.threads, **self.inputs(query, key))
        out = self.out_proj(out.transpose(1, 2).reshape(b, length, e))
        weights = None
        if need_weights:
            if self.variant.name not in ("full", "flash"):
                raise NotImplementedError(
                    f"need_weights=True returns attention probabilities, which {self.variant.name} "
                    "does not form; the dense exact variants (full, flash) do. Pass "
                    "need_weights=False")
            with _torch.no_grad():
                logits = q @ k.transpose(-2, -1) / d ** 0.5
                if mask is not None:
                    logits = logits + mask
                if is_causal:
                    logits = logits.masked_fill(
                        _torch.ones(length, keys, dtype=_torch.bool).triu(1), float("-inf"))
                weights = _torch.softmax(logits, dim=-1)
                if average_attn_weights:
                    weights = weights.mean(dim=1)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights
