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
forward, and backward() raises NotImplementedError saying why. Changing q, k or v in place between the two is caught by torch's version
check.
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

    @staticmethod
    def forward(ctx, q, k, v, mask, variant, problem):
        arrays = (_array(q, "q"), _array(k, "k"), _array(v, "v"))
        ctx.variant = variant
        ctx.problem = problem
        ctx.no_backward = None
        ctx.core_saved = None
        out = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            try:
                out, ctx.core_saved = variant.forward_train(*arrays, **problem)
            except NotImplementedError as e:
                # no backward for this problem: the forward runs, backward() raises why
                ctx.no_backward = str(e)
        if out is None:
            out = variant.forward(*arrays, **problem)
        out = _torch.from_numpy(out)
        # q, k, v for torch's in-place (version) check; with the mask and out, what the
        # mask's gradient is recomputed from
        if ctx.needs_input_grad[3]:
            ctx.save_for_backward(q, k, v, mask, out)
        else:
            ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # raises if q, k or v changed in place since the forward
        dq = dk = dv = dmask = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            if ctx.no_backward is not None:
                raise NotImplementedError(ctx.no_backward)
            dq, dk, dv = (_torch.from_numpy(x) for x in
                          ctx.variant.backward(ctx.core_saved, _array(dout, "dout")))
        if ctx.needs_input_grad[3]:
            q, k, v, mask, out = saved
            with _torch.no_grad():
                dmask = _mask_grad(*(x.detach().to(_torch.float32) for x in (q, k, v)), out,
                                   dout.to(_torch.float32), mask.detach(), ctx.problem)
        return dq, dk, dv, dmask, None, None


def attention(spec, q, k, v, *, causal=False, score="scaled_dot", key_padding=None,
              attn_mask=None, kv_heads=None, seed=0, threads=0):
    """attnbench.attention on torch tensors, differentiable through the variant's backward.
    `spec` is a spec string or an attnbench.Variant."""
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
    return _Attention.apply(q, k, v, mask, variant, problem)


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
    """

    def __init__(self, embed_dim, num_heads, variant="flash", batch_first=True, dropout=0.0,
                 bias=True, add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None,
                 device=None, dtype=None, threads=0, seed=0):
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
                        threads=self.threads)
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
