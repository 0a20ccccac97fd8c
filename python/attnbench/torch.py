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
the plain forward. Changing q, k or v in place between the two is caught by torch's version
check.
"""

import torch as _torch

from . import Variant, _as_f32


def _array(x, what):
    if not isinstance(x, _torch.Tensor):
        return _as_f32(x, what)
    if x.device.type != "cpu":
        raise ValueError(f"{what}: a tensor on {x.device}; attnbench runs on CPU tensors")
    x = x.detach()
    if x.dtype != _torch.float32 or not x.is_contiguous():
        x = x.to(_torch.float32).contiguous()
    return x.numpy()


class _Attention(_torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, variant, problem):
        arrays = (_array(q, "q"), _array(k, "k"), _array(v, "v"))
        ctx.variant = variant
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            out, ctx.core_saved = variant.forward_train(*arrays, **problem)
            ctx.save_for_backward(q, k, v)  # only for torch's in-place (version) check
        else:
            out = variant.forward(*arrays, **problem)
        return _torch.from_numpy(out)

    @staticmethod
    def backward(ctx, dout):
        ctx.saved_tensors  # raises if q, k or v changed in place since the forward
        dq, dk, dv = ctx.variant.backward(ctx.core_saved, _array(dout, "dout"))
        return _torch.from_numpy(dq), _torch.from_numpy(dk), _torch.from_numpy(dv), None, None


def attention(spec, q, k, v, *, causal=False, score="scaled_dot", key_padding=None,
              attn_mask=None, kv_heads=None, seed=0, threads=0):
    """attnbench.attention on torch tensors, differentiable through the variant's backward.
    `spec` is a spec string or an attnbench.Variant."""
    variant = spec if isinstance(spec, Variant) else Variant(spec)
    if isinstance(attn_mask, _torch.Tensor):
        attn_mask = attn_mask.detach().cpu().numpy()
    problem = dict(causal=causal, score=score, key_padding=key_padding, attn_mask=attn_mask,
                   kv_heads=kv_heads, seed=seed, threads=threads)
    return _Attention.apply(q, k, v, variant, problem)
