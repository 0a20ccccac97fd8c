"""The learned inputs of gla, deltanet and linformer given from Python, against their formulas
written in torch in float64 (the recurrences step by step, linformer's projections as matmuls).

Run from the build tree: PYTHONPATH=build/python /usr/bin/python3 -m pytest -q tests/python
"""

import numpy as np
import pytest

attnbench = pytest.importorskip("attnbench")
torch = pytest.importorskip("torch")


def rand(*shape, seed=0, lo=None, hi=None):
    rng = np.random.default_rng(seed)
    if lo is None:
        return rng.standard_normal(shape).astype(np.float32)
    return rng.uniform(lo, hi, shape).astype(np.float32)


def t64(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def gla_torch(q, k, v, g):
    """S_t = diag(exp g_t) S_(t-1) + k_t v_t^T, o_t = S_t^T q_t / sqrt(d); one head of k, v, g
    per group of query heads."""
    q, k, v, g = map(t64, (q, k, v, g))
    B, H, n, d = q.shape
    rep = H // k.shape[1]
    k, v, g = (x.repeat_interleave(rep, dim=1) for x in (k, v, g))
    S = torch.zeros(B, H, d, d, dtype=torch.float64)
    out = torch.zeros(B, H, n, d, dtype=torch.float64)
    for t in range(n):
        S = torch.exp(g[:, :, t, :]).unsqueeze(-1) * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        out[:, :, t] = torch.einsum("bhc,bhce->bhe", q[:, :, t], S) / np.sqrt(d)
    return out.numpy()


def deltanet_torch(q, k, v, beta, g):
    """The gated delta rule with L2-normalised q and k (q also scaled by d^-1/2):
    S_t = a_t S_(t-1) (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t."""
    q, k, v, beta, g = map(t64, (q, k, v, beta, g))
    B, H, n, d = q.shape
    rep = H // k.shape[1]
    k, v, beta, g = (x.repeat_interleave(rep, dim=1) for x in (k, v, beta, g))
    k = k / k.norm(dim=-1, keepdim=True)
    q = q / (q.norm(dim=-1, keepdim=True) * np.sqrt(d))
    S = torch.zeros(B, H, d, d, dtype=torch.float64)  # rows over the value dimension
    eye = torch.eye(d, dtype=torch.float64)
    out = torch.zeros(B, H, n, d, dtype=torch.float64)
    for t in range(n):
        kt, vt = k[:, :, t], v[:, :, t]
        a, b = torch.exp(g[:, :, t])[..., None, None], beta[:, :, t][..., None, None]
        S = a * S @ (eye - b * kt[..., :, None] * kt[..., None, :]) + b * vt[..., :, None] * kt[..., None, :]
        out[:, :, t] = (S @ q[:, :, t, :, None])[..., 0]
    return out.numpy()


def linformer_torch(q, k, v, E, F):
    """softmax(Q (E K)^T / sqrt(d)) (F V) per head."""
    q, k, v, E, F = map(t64, (q, k, v, E, F))
    ek, fv = torch.einsum("hpm,bhmd->bhpd", E, k), torch.einsum("hpm,bhmd->bhpd", F, v)
    s = q @ ek.transpose(-1, -2) / np.sqrt(q.shape[-1])
    return (torch.softmax(s, dim=-1) @ fv).numpy()


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_gla_takes_g(form):
    B, H, G, n, d = 2, 4, 2, 45, 16
    q, k, v = rand(B, H, n, d, seed=1), rand(B, G, n, d, seed=2), rand(B, G, n, d, seed=3)
    g = rand(B, G, n, d, seed=4, lo=-0.6, hi=-0.01)
    out = attnbench.attention(f"gla:form={form}", q, k, v, causal=True, g=g)
    assert rel(out, gla_torch(q, k, v, g)) < 1e-5
    # the stand-in is another function
    assert rel(attnbench.attention("gla", q, k, v, causal=True), gla_torch(q, k, v, g)) > 1e-2


def test_deltanet_takes_beta_and_g():
    B, H, G, n, d = 1, 4, 2, 40, 16
    q, k, v = rand(B, H, n, d, seed=5), rand(B, G, n, d, seed=6), rand(B, G, n, d, seed=7)
    beta = rand(B, G, n, seed=8, lo=0.05, hi=0.95)
    g = rand(B, G, n, seed=9, lo=-0.5, hi=0.0)
    var = attnbench.Variant("deltanet:gated=true")
    assert var.inputs == ["beta", "g"]
    out = var.forward(q, k, v, causal=True, beta=beta, g=g)
    assert rel(out, deltanet_torch(q, k, v, beta, g)) < 1e-4
    # ungated: g is not an input; beta alone, alpha = 1
    out = attnbench.attention("deltanet", q, k, v, causal=True, beta=beta)
    assert rel(out, deltanet_torch(q, k, v, beta, np.zeros_like(g))) < 1e-4
    with pytest.raises(TypeError, match=r"unexpected keyword 'g'.*deltanet:.*inputs \(beta\)"):
        attnbench.attention("deltanet", q, k, v, causal=True, beta=beta, g=g)


def test_linformer_takes_e_and_f():
    B, H, n, m, d, proj = 2, 2, 30, 50, 16, 8
    q, k, v = rand(B, H, n, d, seed=10), rand(B, H, m, d, seed=11), rand(B, H, m, d, seed=12)
    E = rand(H, proj, m, seed=13) / np.sqrt(proj)
    F = rand(H, proj, m, seed=14) / np.sqrt(proj)
    out = attnbench.attention(f"linformer:proj={proj}", q, k, v, E=E, F=F)
    assert rel(out, linformer_torch(q, k, v, E, F)) < 1e-5
    out = attnbench.attention(f"linformer:proj={proj},share_kv=true", q, k, v, E=E)
    assert rel(out, linformer_torch(q, k, v, E, E)) < 1e-5


def test_bad_inputs_name_what_is_taken():
    q, k, v = rand(1, 2, 20, 8, seed=1), rand(1, 2, 20, 8, seed=2), rand(1, 2, 20, 8, seed=3)
    with pytest.raises(ValueError, match=r"the input 'g' has shape \[1, 2, 20, 7\].*"
                                         r"takes g \[B, G, n, d\] = \[1, 2, 20, 8\]"):
        attnbench.attention("gla", q, k, v, causal=True, g=np.zeros((1, 2, 20, 7), np.float32))
    with pytest.raises(TypeError, match=r"unexpected keyword 'causl'"):
        attnbench.attention("flash", q, k, v, causl=True)
    # a gate outside its range
    with pytest.raises(ValueError, match=r"the input 'g_slc' of nsa:.*holds 1.5 at flat index "
                                         r"0; accepted: values in \[0, 1\]"):
        attnbench.Variant("nsa").forward_train(q, k, v, causal=True,
                                               g_slc=np.full((1, 2, 20), 1.5, np.float32))


def test_gla_backward_gives_dg_as_torch_autograd():
    B, H, G, n, d = 1, 4, 2, 21, 8
    q, k, v = rand(B, H, n, d, seed=21), rand(B, G, n, d, seed=22), rand(B, G, n, d, seed=23)
    g = rand(B, G, n, d, seed=24, lo=-0.6, hi=-0.01)
    dout = rand(B, H, n, d, seed=25)
    var = attnbench.Variant("gla")
    out, saved = var.forward_train(q, k, v, causal=True, g=g)
    dq, dk, dv, grads = var.backward(saved, dout)
    assert sorted(grads) == ["g"] and grads["g"].shape == g.shape
    # torch autograd of the float64 recurrence
    tq, tk, tv, tg = (t64(x).requires_grad_() for x in (q, k, v, g))
    B_, H_, n_, d_ = tq.shape
    rep = H_ // tk.shape[1]
    kk, vv, gg = (x.repeat_interleave(rep, dim=1) for x in (tk, tv, tg))
    S = torch.zeros(B_, H_, d_, d_, dtype=torch.float64)
    outs = []
    for t in range(n_):
        S = torch.exp(gg[:, :, t, :]).unsqueeze(-1) * S + kk[:, :, t, :, None] * vv[:, :, t, None, :]
        outs.append(torch.einsum("bhc,bhce->bhe", tq[:, :, t], S) / np.sqrt(d_))
    (torch.stack(outs, dim=2) * t64(dout)).sum().backward()
    for got, want in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad), (grads["g"], tg.grad)):
        assert rel(got, want.numpy()) < 1e-4
    # without g: three gradients, as before
    out, saved = var.forward_train(q, k, v, causal=True)
    assert len(var.backward(saved, dout)) == 3
