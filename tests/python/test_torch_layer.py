"""attnbench.torch.MultiheadAttention against torch.nn.MultiheadAttention: the same state_dict,
the same outputs, attention weights and gradients (float64 torch as the reference) with and
without masks, and a small model that trains with it."""
import numpy as np
import pytest
import torch

import attnbench.torch as abt

E, H = 32, 4


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def pair(variant, **kw):
    """An attnbench layer and a float64 torch layer with the same weights."""
    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, **kw)
    ours = abt.MultiheadAttention(E, H, variant=variant, **kw)
    ours.load_state_dict(ref.state_dict())
    return ours, ref.double()


def test_state_dict_is_torch_s():
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = abt.MultiheadAttention(E, H)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for name, t in ours.state_dict().items():
        assert t.shape == ref.state_dict()[name].shape, name
    ref.load_state_dict(ours.state_dict())  # both ways
    no_bias = abt.MultiheadAttention(E, H, bias=False)
    assert list(no_bias.state_dict()) == list(
        torch.nn.MultiheadAttention(E, H, bias=False).state_dict())


def masks(b, length, keys):
    g = torch.Generator().manual_seed(5)
    padding = torch.zeros(b, keys, dtype=torch.bool)
    padding[0, keys - 3:] = True
    float_mask = torch.rand(length, keys, generator=g) - 0.5
    bool_mask = torch.rand(b * H, length, keys, generator=g) < 0.3
    bool_mask[..., 0] = False  # every query keeps a key
    causal = torch.ones(length, keys, dtype=torch.bool).triu(1)
    return [
        dict(),
        dict(key_padding_mask=padding),
        dict(attn_mask=float_mask),
        dict(attn_mask=bool_mask, key_padding_mask=padding),
        dict(attn_mask=causal),
    ]


@pytest.mark.parametrize("variant", ["full", "flash"])
def test_matches_torch_with_masks(variant):
    ours, ref = pair(variant)
    g = torch.Generator().manual_seed(7)
    b, length = 2, 13
    x = torch.randn(b, length, E, generator=g)
    y = torch.randn(b, length + 4, E, generator=g)
    for query, key in ((x, x), (x, y)):
        for kw in masks(b, length, key.shape[1]):
            out, w = ours(query, key, key, **kw)
            ref_kw = {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}
            want, want_w = ref(query.double(), key.double(), key.double(), **ref_kw)
            assert rel(out, want) < 1e-5, (variant, list(kw))
            assert rel(w, want_w) < 1e-5, (variant, list(kw))
    # is_causal is the causal mask of self-attention
    out, _ = ours(x, x, x, is_causal=True, need_weights=False)
    want, _ = ref(x.double(), x.double(), x.double(),
                  attn_mask=torch.ones(length, length, dtype=torch.bool).triu(1))
    assert rel(out, want) < 1e-5


@pytest.mark.parametrize("variant", ["full", "flash"])
def test_gradients_match_torch(variant):
    ours, ref = pair(variant)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 17, E, generator=g, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    padding = torch.zeros(2, 17, dtype=torch.bool)
    padding[1, 12:] = True
    do = torch.randn(2, 17, E, generator=g)
    out, _ = ours(x, x, x, key_padding_mask=padding, need_weights=False)
    (out * do).sum().backward()
    want, _ = ref(xd, xd, xd, key_padding_mask=padding, need_weights=False)
    (want * do.double()).sum().backward()
    assert rel(x.grad, xd.grad) < 1e-5
    for (name, p), (_, pr) in zip(ours.named_parameters(), ref.named_parameters()):
        assert rel(p.grad, pr.grad) < 1e-5, name


def test_batch_first_false_and_refusals():
    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(E, H)  # [L, B, E]
    ours = abt.MultiheadAttention(E, H, variant="full", batch_first=False)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(9, 2, E)
    assert rel(ours(x, x, x)[0], ref.double()(x.double(), x.double(), x.double())[0]) < 1e-5
    with pytest.raises(ValueError, match="dropout"):
        abt.MultiheadAttention(E, H, dropout=0.1)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        abt.MultiheadAttention(30, 4)
    local = abt.MultiheadAttention(E, H, variant="local:window=4")
    x = torch.randn(2, 9, E)
    with pytest.raises(NotImplementedError, match="need_weights=False"):
        local(x, x, x)
    out, w = local(x, x, x, need_weights=False)
    assert w is None and out.shape == x.shape
    with pytest.raises(ValueError, match="attn_mask of shape"):
        local(x, x, x, need_weights=False, attn_mask=torch.zeros(3, 3))


def test_a_small_model_trains():
    """A next-token model on a repeating sequence: the loss falls with the attnbench layer."""
    torch.manual_seed(0)
    vocab, length = 11, 24

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, E)
            self.pos = torch.nn.Parameter(torch.randn(length, E) * 0.1)
            self.attn = abt.MultiheadAttention(E, H, variant="flash")
            self.head = torch.nn.Linear(E, vocab)

        def forward(self, tokens):
            x = self.emb(tokens) + self.pos
            y, _ = self.attn(x, x, x, need_weights=False, is_causal=True)
            return self.head(x + y)

    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seq = torch.arange(length + 1) * 3 % vocab
    tokens, target = seq[:-1].repeat(4, 1), seq[1:].repeat(4, 1)
    losses = []
    for _ in range(40):
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, vocab),
                                                 target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses


def test_torch_encoder_layer_calls_the_variant_in_inference_too():
    """TransformerEncoderLayer's fused inference path (eval, no grad) must not bypass it."""
    model = torch.nn.TransformerEncoderLayer(E, H, dropout=0.0, batch_first=True)
    layer = abt.MultiheadAttention(E, H, variant="local:window=2")
    layer.load_state_dict(model.self_attn.state_dict())
    model.self_attn = layer
    calls = []
    layer.register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(2, 10, E)
    model.eval()
    with torch.no_grad():
        model(x)
    assert calls == [1]
