"""Learned inputs in torch: attnbench.torch.attention fills the .grad of the inputs it is
given, and attnbench.torch.MultiheadAttention produces them from learned projections of its
input (LearnedInputs), which train.

Run from the build tree: PYTHONPATH=build/python /usr/bin/python3 -m pytest -q tests/python
"""

import warnings

import numpy as np
import pytest

attnbench = pytest.importorskip("attnbench")
torch = pytest.importorskip("torch")
abt = pytest.importorskip("attnbench.torch")


def gla64(q, k, v, g):
    """gla's recurrence in torch float64: S_t = diag(exp g_t) S_(t-1) + k_t v_t^T,
    o_t = S_t^T q_t / sqrt(d); k, v, g one head per group of query heads."""
    B, H, n, d = q.shape
    rep = H // k.shape[1]
    k, v, g = (x.repeat_interleave(rep, dim=1) for x in (k, v, g))
    S = torch.zeros(B, H, d, d, dtype=torch.float64)
    outs = []
    for t in range(n):
        S = torch.exp(g[:, :, t, :]).unsqueeze(-1) * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(torch.einsum("bhc,bhce->bhe", q[:, :, t], S) / np.sqrt(d))
    return torch.stack(outs, dim=2)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_attention_fills_the_grad_of_given_inputs():
    gen = torch.Generator().manual_seed(3)
    B, H, G, n, d = 2, 4, 2, 19, 8
    q = torch.randn(B, H, n, d, generator=gen, requires_grad=True)
    k = torch.randn(B, G, n, d, generator=gen, requires_grad=True)
    v = torch.randn(B, G, n, d, generator=gen, requires_grad=True)
    g = (torch.nn.functional.logsigmoid(torch.randn(B, G, n, d, generator=gen)) / 4) \
        .requires_grad_()
    w = torch.randn(B, H, n, d, generator=gen)
    (abt.attention("gla", q, k, v, causal=True, g=g) * w).sum().backward()
    got = [x.grad.clone() for x in (q, k, v, g)]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g)]
    (gla64(*leaves) * w.double()).sum().backward()
    for name, a, b in zip("qkvg", got, leaves):
        assert rel(a.double(), b.grad) < 1e-4, name
    # an input that does not require grad is a constant; q alone gets its gradient
    q.grad = None
    g2 = g.detach()
    (abt.attention("gla", q, k, v, causal=True, g=g2) * w).sum().backward()
    assert g2.grad is None and rel(q.grad.double(), leaves[0].grad) < 1e-4
    # the gradient of the input alone (q, k, v constants) runs the training pass too
    gi = g.detach().requires_grad_()
    (abt.attention("gla", q.detach(), k.detach(), v.detach(), causal=True, g=gi) * w) \
        .sum().backward()
    assert rel(gi.grad.double(), leaves[3].grad) < 1e-4
    with pytest.raises(TypeError, match=r"unexpected keyword 'beta'.*inputs \(g\)"):
        abt.attention("gla", q, k, v, causal=True, beta=g)


def layer_input(B=2, L=24, E=32, seed=0):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed))


LEARNED = [("gla", {}, ["gk_proj.0.weight", "gk_proj.1.weight", "gk_proj.1.bias"]),
           ("deltanet:gated=true", {}, ["b_proj.weight", "a_proj.weight", "A_log", "dt_bias"]),
           ("deltanet", {}, ["b_proj.weight"]),
           ("nsa:cmp_block=8,cmp_stride=4,sel_block=8,sel_top=3,window=8", {},
            ["g_proj.weight", "g_proj.bias"]),
           ("rfa:gate=true,features=16", {}, ["g_proj.weight", "g_proj.bias"]),
           ("linformer:proj=8", dict(max_length=32), ["E", "F"]),
           ("linformer:proj=8,share_kv=true", dict(max_length=32), ["E"])]


@pytest.mark.parametrize("spec,kw,names", LEARNED, ids=[s for s, _, _ in LEARNED])
def test_the_layer_names_its_input_parameters(spec, kw, names):
    layer = abt.MultiheadAttention(32, 4, variant=spec, **kw)
    assert sorted(n for n in layer.state_dict() if n.startswith("inputs.")) == \
        sorted("inputs." + n for n in names)
    assert layer.inputs.names == layer.variant.inputs


@pytest.mark.parametrize("spec,kw,names", LEARNED, ids=[s for s, _, _ in LEARNED])
def test_a_tiny_model_trains_its_gates_and_projections(spec, kw, names):
    """Two layers and a readout learn to copy a shifted token; after a few Adam steps the
    input projections' gradients were finite and non-zero and the parameters moved."""
    torch.manual_seed(1)
    causal = not spec.startswith("linformer")
    E, L = 32, 24
    embed = torch.nn.Embedding(16, E)
    layers = torch.nn.ModuleList(abt.MultiheadAttention(E, 4, variant=spec, seed=i, **kw)
                                 for i in range(2))
    readout = torch.nn.Linear(E, 16)
    params = [*embed.parameters(), *layers.parameters(), *readout.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    before = {n: p.detach().clone() for n, p in layers.named_parameters() if ".inputs." in n}
    assert len(before) == 2 * len(names)
    tokens = torch.randint(0, 16, (2, L + 1), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(4):
        x = embed(tokens[:, :-1])
        for layer in layers:
            x = x + layer(x, x, x, need_weights=False, is_causal=causal)[0]
        loss = torch.nn.functional.cross_entropy(readout(x).reshape(-1, 16),
                                                 tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        for n, p in layers.named_parameters():
            if ".inputs." in n:
                assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n
        opt.step()
        losses.append(loss.item())
    for n, p in layers.named_parameters():
        if n in before:
            assert not torch.equal(p.detach(), before[n]), f"{n} did not change"
    assert np.isfinite(losses).all()


def test_a_state_dict_without_them_loads_with_the_stand_ins_and_says_so():
    x = layer_input()
    torch_layer = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    layer = abt.MultiheadAttention(32, 4, variant="gla")
    with pytest.warns(UserWarning, match=r"no inputs\.\* parameters; gla.*stand-ins for g"):
        layer.load_state_dict(torch_layer.state_dict())
    assert layer.inputs.stood_in
    out = layer(x, x, x, need_weights=False, is_causal=True)[0]
    # the stand-in's output: the variant run without g on the layer's q, k, v
    with torch.no_grad():
        w_q, w_k, w_v = layer.in_proj_weight.chunk(3)
        b_q, b_k, b_v = layer.in_proj_bias.chunk(3)
        heads = [torch.nn.functional.linear(x, w, b).reshape(2, 24, 4, 8).transpose(1, 2)
                 .contiguous() for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))]
        core = abt.attention("gla", *heads, causal=True)
        want = layer.out_proj(core.transpose(1, 2).reshape(2, 24, 32))
    assert torch.allclose(out, want, atol=1e-6)
    # learn() switches the projections back on: another function, and a round trip of the
    # layer's own state_dict keeps them
    learned = layer.inputs.learn()
    assert not learned.stood_in
    assert not torch.allclose(layer(x, x, x, need_weights=False, is_causal=True)[0], out)
    other = abt.MultiheadAttention(32, 4, variant="gla")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.load_state_dict(layer.state_dict())
    assert not other.inputs.stood_in
    for name, p in layer.inputs.state_dict().items():
        assert torch.equal(p, other.inputs.state_dict()[name])


def test_linformer_needs_the_maximum_length():
    with pytest.raises(ValueError, match="pass max_length"):
        abt.MultiheadAttention(32, 4, variant="linformer")
    layer = abt.MultiheadAttention(32, 4, variant="linformer:proj=8", max_length=16)
    x = layer_input(L=20)
    with pytest.raises(ValueError, match="20 keys; this layer's E covers max_length = 16"):
        layer(x, x, x, need_weights=False)
    # a shorter call reads the first columns: the same as E, F given as those columns
    x = layer_input(L=12)
    out = layer(x, x, x, need_weights=False)[0]
    with torch.no_grad():
        w_q, w_k, w_v = layer.in_proj_weight.chunk(3)
        heads = [torch.nn.functional.linear(x, w, b).reshape(2, 12, 4, 8).transpose(1, 2)
                 .contiguous() for w, b in zip((w_q, w_k, w_v), layer.in_proj_bias.chunk(3))]
        core = abt.attention("linformer:proj=8", *heads, E=layer.inputs.E[:, :, :12],
                             F=layer.inputs.F[:, :, :12])
        want = layer.out_proj(core.transpose(1, 2).reshape(2, 12, 32))
    assert torch.allclose(out, want, atol=1e-6)


@pytest.mark.parametrize("spec", ["gla", "deltanet:gated=true"])
def test_decoding_takes_the_inputs_token_by_token(spec):
    """Prefill with the first t0 tokens' inputs, then step with each token's: the rows of
    the causal forward pass given the whole inputs."""
    rng = np.random.default_rng(5)
    B, H, G, n, d, t0 = 1, 4, 2, 23, 8, 10
    q = rng.standard_normal((B, H, n, d), dtype=np.float32)
    k, v = (rng.standard_normal((B, G, n, d), dtype=np.float32) for _ in range(2))
    var = attnbench.Variant(spec)
    if spec == "gla":
        inputs = dict(g=rng.uniform(-0.5, -0.01, (B, G, n, d)).astype(np.float32))
    else:
        inputs = dict(beta=rng.uniform(0.1, 0.9, (B, G, n)).astype(np.float32),
                      g=rng.uniform(-0.5, 0.0, (B, G, n)).astype(np.float32))
    want = var.forward(q, k, v, causal=True, **inputs)
    tok = (lambda x, t: np.ascontiguousarray(x[:, :, t:t + 1]))
    dec = var.decoder(k[:, :, :t0], v[:, :, :t0], capacity=n, heads=H,
                      **{name: x[:, :, :t0] for name, x in inputs.items()})
    for t in range(t0, n):
        got = dec.step(tok(q, t), tok(k, t), tok(v, t),
                       **{name: tok(x, t) for name, x in inputs.items()})
        np.testing.assert_allclose(got[:, :, 0], want[:, :, t], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="every step takes the inputs its prefill took"):
        var.decoder(k[:, :, :t0], v[:, :, :t0], capacity=n, heads=H,
                    **{name: x[:, :, :t0] for name, x in inputs.items()}).step(
                        tok(q, t0), tok(k, t0), tok(v, t0))
    with pytest.raises(ValueError, match=r"the input '(g|beta)' of a decode step has shape \[1, 2, 2"):
        var.decoder(k[:, :, :t0], v[:, :, :t0], capacity=n, heads=H,
                    **{name: x[:, :, :t0] for name, x in inputs.items()}).step(
                        tok(q, t0), tok(k, t0), tok(v, t0),
                        **{name: x[:, :, t0:t0 + 2] for name, x in inputs.items()})
    with pytest.raises(NotImplementedError, match="the decode step takes no given input"):
        attnbench.Variant("rfa:gate=true").decoder(
            k[:, :, :t0], v[:, :, :t0], capacity=n, heads=H,
            g=np.full((B, H, t0), 0.5, np.float32))
