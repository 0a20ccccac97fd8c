"""The gradients of the learned inputs from Python: Variant.forward_train with the inputs given,
then Variant.backward, whose fourth value holds dL/dx of every given x, against torch autograd
of the variant's formula written in torch in float64 (gla's g, deltanet's beta and g, linformer's
E and F), together with dq, dk and dv. rfa's gate is checked in C++ only
(tests/variants/input_grads_test.cpp): its random feature map is not reachable from Python.

Run from the build tree: PYTHONPATH=build/python /usr/bin/python3 -m pytest -q tests/python
"""

import numpy as np
import pytest

attnbench = pytest.importorskip("attnbench")
torch = pytest.importorskip("torch")
from test_given_inputs import rand  # noqa: E402 (this directory is on sys.path under pytest)


def leaf(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64)).requires_grad_()


def per_query_head(x, heads):
    """A key/value head's tensor repeated for each query head of its group (dim 1)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def gla(q, k, v, g):
    """S_t = diag(exp g_t) S_(t-1) + k_t v_t^T, o_t = S_t^T q_t / sqrt(d)."""
    B, H, n, d = q.shape
    k, v, g = (per_query_head(x, H) for x in (k, v, g))
    S = torch.zeros(B, H, d, d, dtype=torch.float64)
    outs = []
    for t in range(n):
        S = torch.exp(g[:, :, t, :, None]) * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(torch.einsum("bhc,bhce->bhe", q[:, :, t], S) / np.sqrt(d))
    return torch.stack(outs, dim=2)


def deltanet(q, k, v, beta, g):
    """S_t = a_t S_(t-1) (I - b_t k^_t k^_t^T) + b_t v_t k^_t^T, o_t = S_t q^_t / sqrt(d) with
    L2-normalised q^ and k^, a_t = exp(g_t) (g = None: a_t = 1)."""
    B, H, n, d = q.shape
    k, v, beta = (per_query_head(x, H) for x in (k, v, beta))
    g = None if g is None else per_query_head(g, H)
    k = k / k.norm(dim=-1, keepdim=True)
    q = q / (q.norm(dim=-1, keepdim=True) * np.sqrt(d))
    S = torch.zeros(B, H, d, d, dtype=torch.float64)  # rows over the value dimension
    eye = torch.eye(d, dtype=torch.float64)
    outs = []
    for t in range(n):
        kt, vt = k[:, :, t], v[:, :, t]
        b = beta[:, :, t, None, None]
        S = S @ (eye - b * kt[..., :, None] * kt[..., None, :])
        if g is not None:
            S = torch.exp(g[:, :, t, None, None]) * S
        S = S + b * vt[..., :, None] * kt[..., None, :]
        outs.append((S @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, dim=2)


def linformer(q, k, v, E, F):
    """softmax(Q (E K)^T / sqrt(d)) (F V), E and F per query head."""
    H = q.shape[1]
    k, v = per_query_head(k, H), per_query_head(v, H)
    ek, fv = torch.einsum("hpm,bhmd->bhpd", E, k), torch.einsum("hpm,bhmd->bhpd", F, v)
    s = q @ ek.transpose(-1, -2) / np.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ fv


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def check(spec, formula, q, k, v, given, causal, order):
    """forward_train + backward of `spec` with the inputs `given` (a dict) against autograd of
    formula(q, k, v, *inputs in `order`, None for one not given); returns the worst relative
    error of out, dq, dk, dv and each input's gradient."""
    var = attnbench.Variant(spec)
    dout = rand(*q.shape, seed=99)
    out, saved = var.forward_train(q, k, v, causal=causal, **given)
    dq, dk, dv, grads = var.backward(saved, dout)
    assert sorted(grads) == sorted(given)
    leaves = {name: leaf(x) for name, x in given.items()}
    tq, tk, tv = leaf(q), leaf(k), leaf(v)
    want = formula(tq, tk, tv, *(leaves.get(name) for name in order))
    (want * torch.from_numpy(dout.astype(np.float64))).sum().backward()
    errors = {"out": rel(out, want.detach().numpy())}
    for name, got, t in (("q", dq, tq), ("k", dk, tk), ("v", dv, tv)):
        errors[name] = rel(got, t.grad.numpy())
    for name, t in leaves.items():
        assert grads[name].shape == given[name].shape and grads[name].dtype == np.float32
        errors[name] = rel(grads[name], t.grad.numpy())
    for name, e in errors.items():
        assert e < 1e-4, f"{spec}: d{name} relative error {e:.3g}"
    return max(errors.values())


@pytest.mark.parametrize("spec", ["deltanet", "deltanet:chunk=5", "deltanet:form=recurrent"])
def test_deltanet_beta(spec):
    B, H, G, n, d = 2, 4, 2, 23, 8
    q, k, v = rand(B, H, n, d, seed=1), rand(B, G, n, d, seed=2), rand(B, G, n, d, seed=3)
    beta = rand(B, G, n, seed=4, lo=0.05, hi=0.95)
    check(spec, deltanet, q, k, v, {"beta": beta}, True, ("beta", "g"))


@pytest.mark.parametrize("spec", ["deltanet:gated=true", "deltanet:gated=true,chunk=6",
                                  "deltanet:gated=true,form=recurrent"])
def test_gated_deltanet_beta_and_g(spec):
    B, H, G, n, d = 2, 4, 2, 23, 8
    q, k, v = rand(B, H, n, d, seed=5), rand(B, G, n, d, seed=6), rand(B, G, n, d, seed=7)
    beta = rand(B, G, n, seed=8, lo=0.05, hi=0.95)
    g = rand(B, G, n, seed=9, lo=-0.5, hi=-0.01)
    check(spec, deltanet, q, k, v, {"beta": beta, "g": g}, True, ("beta", "g"))


@pytest.mark.parametrize("share", [False, True])
def test_linformer_projections(share):
    B, H, G, n, m, d, proj = 2, 4, 2, 17, 29, 8, 6
    q, k, v = rand(B, H, n, d, seed=10), rand(B, G, m, d, seed=11), rand(B, G, m, d, seed=12)
    E = rand(H, proj, m, seed=13) / np.sqrt(proj)
    F = rand(H, proj, m, seed=14) / np.sqrt(proj)
    spec = f"linformer:proj={proj},share_kv={'true' if share else 'false'}"
    if share:
        check(spec, lambda q, k, v, E: linformer(q, k, v, E, E), q, k, v, {"E": E}, False, ("E",))
    else:
        check(spec, linformer, q, k, v, {"E": E, "F": F}, False, ("E", "F"))


@pytest.mark.parametrize("spec", ["gla", "gla:form=recurrent,chunk=5"])
def test_gla_g(spec):
    B, H, G, n, d = 2, 4, 2, 19, 8
    q, k, v = rand(B, H, n, d, seed=21), rand(B, G, n, d, seed=22), rand(B, G, n, d, seed=23)
    g = rand(B, G, n, d, seed=24, lo=-0.6, hi=-0.01)
    check(spec, gla, q, k, v, {"g": g}, True, ("g",))


def test_one_input_of_two_given():
    """Given one input of two, the backward gives that one's gradient alone (the other is
    stood in)."""
    B, H, G, n, d = 1, 2, 2, 12, 8
    q, k, v = rand(B, H, n, d, seed=31), rand(B, G, n, d, seed=32), rand(B, G, n, d, seed=33)
    g = rand(B, G, n, seed=34, lo=-0.5, hi=-0.01)
    dout = rand(B, H, n, d, seed=35)
    var = attnbench.Variant("deltanet:gated=true")
    out, saved = var.forward_train(q, k, v, causal=True, g=g)
    dq, dk, dv, grads = var.backward(saved, dout)
    assert sorted(grads) == ["g"] and grads["g"].shape == g.shape
    assert np.all(np.isfinite(grads["g"])) and np.abs(grads["g"]).max() > 0
    E = rand(H, 4, n, seed=36)
    lin = attnbench.Variant("linformer:proj=4")
    out, saved = lin.forward_train(q, k, v, F=E)
    grads = lin.backward(saved, dout)[3]
    assert sorted(grads) == ["F"] and grads["F"].shape == E.shape
