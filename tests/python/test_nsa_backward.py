"""nsa's backward pass from Python: the gradients of its given gates g_cmp, g_slc, g_swa from
Variant.forward_train / Variant.backward against central differences of attnbench.attention
with the same gates (float32; the output is linear in each gate, so the differences are exact
up to rounding), and dq, dk, dv as without the gates given.

Run from the build tree: PYTHONPATH=build/python /usr/bin/python3 -m pytest -q tests/python
"""

import numpy as np
import pytest

attnbench = pytest.importorskip("attnbench")

SPEC = "nsa:cmp_block=8,cmp_stride=4,sel_block=8,sel_top=4,window=12"
GATES = ("g_cmp", "g_slc", "g_swa")


def rand(*shape, seed=0, lo=None, hi=None):
    rng = np.random.default_rng(seed)
    if lo is None:
        return rng.standard_normal(shape).astype(np.float32)
    return rng.uniform(lo, hi, shape).astype(np.float32)


def test_gate_gradients_match_differences():
    B, H, G, n, d = 2, 4, 2, 53, 16
    q, k, v = rand(B, H, n, d, seed=1), rand(B, G, n, d, seed=2), rand(B, G, n, d, seed=3)
    gates = {name: rand(B, H, n, seed=4 + i, lo=0.05, hi=0.95) for i, name in enumerate(GATES)}
    dout = rand(B, H, n, d, seed=9)
    var = attnbench.Variant(SPEC)
    out, saved = var.forward_train(q, k, v, causal=True, **gates)
    assert np.allclose(out, attnbench.attention(SPEC, q, k, v, causal=True, **gates), atol=1e-6)
    dq, dk, dv, grads = var.backward(saved, dout)
    assert sorted(grads) == sorted(GATES)
    rng = np.random.default_rng(11)
    h = 0.04  # the gates stay in [0, 1]
    for name in GATES:
        g = grads[name]
        assert g.shape == gates[name].shape and np.isfinite(g).all()
        for _ in range(3):
            u = rng.choice([-1.0, 1.0], size=g.shape).astype(np.float32)

            def loss(sign):
                moved = dict(gates)
                moved[name] = (gates[name] + sign * h * u).astype(np.float32)
                o = attnbench.attention(SPEC, q, k, v, causal=True, **moved)
                return float(np.sum(dout.astype(np.float64) * o))

            central = (loss(1.0) - loss(-1.0)) / (2 * h)
            assert abs(float(np.sum(g.astype(np.float64) * u)) - central) <= 1e-3 * np.linalg.norm(g)
    # the gates' gradients leave dq, dk, dv those of the function with the gates held
    out2, saved2 = var.forward_train(q, k, v, causal=True, **gates)
    again = var.backward(saved2, dout)
    for a, b in zip((dq, dk, dv), again[:3]):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6)
