"""Hostile masks through attnbench.torch: MultiheadAttention with the masks Hugging Face
models write (torch.finfo(torch.float32).min above the diagonal, rows masked wholly by it),
key_padding_mask, and learnable float masks, whose gradients must be torch's."""
import pytest

torch = pytest.importorskip("torch")
abt = pytest.importorskip("attnbench.torch")

E, H, B, L = 32, 4, 2, 12
LOWEST = torch.finfo(torch.float32).min


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def pair(variant):
    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = abt.MultiheadAttention(E, H, variant=variant)
    ours.load_state_dict(ref.state_dict())
    return ours, ref.double()


def hf_mask(length, keys):
    """A Hugging Face style additive mask [L, S]: 0 where allowed, finfo.min above the
    diagonal, and row 4 finfo.min everywhere."""
    m = torch.zeros(length, keys).masked_fill(torch.ones(length, keys, dtype=torch.bool).triu(1),
                                              LOWEST)
    m[4] = LOWEST
    return m


def x_of(seed=0):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", ["full", "flash"])
def test_hugging_face_mask_matches_torch(variant):
    ours, ref = pair(variant)
    x = x_of()
    mask = hf_mask(L, L)
    out, w = ours(x, x, x, attn_mask=mask)
    want, want_w = ref(x.double(), x.double(), x.double(), attn_mask=mask.double())
    assert torch.isfinite(out).all()  # was 192 NaNs
    assert rel(out, want) < 1e-5
    assert rel(w, want_w) < 1e-5
    # torch in float32 gives the same (its uniform row included)
    ref32 = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ref32.load_state_dict(ours.state_dict())
    want32, _ = ref32(x, x, x, attn_mask=mask, need_weights=False)
    assert rel(out, want32) < 1e-5


@pytest.mark.parametrize("variant", ["full", "flash", "local"])
def test_key_padding_with_finfo_min(variant):
    ours, ref = pair(variant)
    x = x_of(1)
    pad = torch.zeros(B, L)
    pad[0, L - 4:] = LOWEST
    pad[1, :] = LOWEST  # a batch element padded wholly by finite values: uniform averages
    out, _ = ours(x, x, x, key_padding_mask=pad, need_weights=False)
    assert torch.isfinite(out).all()
    if variant != "local":
        want, _ = ref(x.double(), x.double(), x.double(), key_padding_mask=pad.double(),
                      need_weights=False)
        assert rel(out, want) < 1e-5
    bool_pad = pad < 0
    bool_pad[1] = False
    out_b, _ = ours(x, x, x, key_padding_mask=bool_pad, need_weights=False)
    assert torch.isfinite(out_b).all()


@pytest.mark.parametrize("variant", ["full", "flash"])
@pytest.mark.parametrize("shape", ["2d", "3d"])
def test_learnable_float_mask_gets_torch_s_gradient(variant, shape):
    ours, ref = pair(variant)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, L, E, generator=g)
    base = torch.randn(L, L, generator=g) * 0.5 if shape == "2d" else \
        torch.randn(B * H, L, L, generator=g) * 0.5
    base[..., 2, :] = LOWEST  # a row of finite extremes: uniform, its gradient torch's
    base[..., 5, :3] = LOWEST
    mask = base.clone().requires_grad_(True)
    mask64 = base.double().requires_grad_(True)
    out, _ = ours(x, x, x, attn_mask=mask, need_weights=False)
    want, _ = ref(x.double(), x.double(), x.double(), attn_mask=mask64, need_weights=False)
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    want.backward(dout.double())
    assert mask.grad is not None
    assert mask.grad.shape == mask.shape
    assert rel(mask.grad, mask64.grad) < 1e-4
    assert rel(ours.in_proj_weight.grad, ref.in_proj_weight.grad) < 1e-4


def test_learnable_key_padding_mask_gets_its_gradient():
    ours, ref = pair("flash")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, L, E, generator=g)
    base = torch.randn(B, L, generator=g)
    pad = base.clone().requires_grad_(True)
    pad64 = base.double().requires_grad_(True)
    out, _ = ours(x, x, x, key_padding_mask=pad, need_weights=False)
    want, _ = ref(x.double(), x.double(), x.double(), key_padding_mask=pad64, need_weights=False)
    out.sum().backward()
    want.sum().backward()
    assert rel(pad.grad, pad64.grad) < 1e-4


def test_attention_mask_gradient_broadcast_causal_padded_grouped():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 10, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 14, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 14, 16, generator=g, requires_grad=True)
    base = torch.randn(1, 4, 10, 14, generator=g)
    base[0, 1, 3] = LOWEST
    mask = base.clone().requires_grad_(True)
    out = abt.attention("flash", q, k, v, attn_mask=mask, causal=True, key_padding=[14, 11])
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    # torch on float64, the same problem written out
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    m64 = base.double().requires_grad_(True)
    kk, vv = k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1)
    s = q64 @ kk.transpose(-1, -2) / 4.0 + m64
    i, j = torch.arange(10)[:, None], torch.arange(14)[None, :]
    hide = (j > i + 4)[None, None] | (torch.arange(14) >= torch.tensor([14, 11])[:, None])[:, None,
                                                                                            None]
    want = torch.softmax(s.masked_fill(hide, float("-inf")), -1) @ vv
    want.backward(dout.double())
    assert rel(mask.grad, m64.grad) < 1e-4
    assert rel(q.grad, q64.grad) < 1e-4
    assert rel(k.grad, k64.grad) < 1e-4


def test_mask_gradient_only():
    """Only the mask requires grad: the plain forward runs and the mask still gets it."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    mask = torch.randn(8, 8, generator=g).requires_grad_(True)
    abt.attention("full", q, k, v, attn_mask=mask).sum().backward()
    m64 = mask.detach().double().requires_grad_(True)
    s = q.double() @ k.double().transpose(-1, -2) / 4.0 + m64
    (torch.softmax(s, -1) @ v.double()).sum().backward()
    assert rel(mask.grad, m64.grad) < 1e-5
    assert q.grad is None


def test_learnable_mask_refused_where_no_gradient_is_given():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    mask = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask requires grad.*local"):
        abt.attention("local", q, k, v, attn_mask=mask)
    with pytest.raises(NotImplementedError, match="attn_mask requires grad.*score"):
        abt.attention("full", q, k, v, attn_mask=mask, score="bilinear")
    # a constant mask runs: detached, or under no_grad
    abt.attention("local", q, k, v, attn_mask=mask.detach())
    with torch.no_grad():
        abt.attention("local", q, k, v, attn_mask=mask)
    layer = abt.MultiheadAttention(E, H, variant="local")
    x = x_of()
    with pytest.raises(NotImplementedError, match="full and flash"):
        layer(x, x, x, attn_mask=torch.zeros(L, L, requires_grad=True), need_weights=False)


def test_bf16_mask_tensor():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    mask = torch.zeros(8, 8, dtype=torch.bfloat16)
    mask[3] = torch.finfo(torch.bfloat16).min
    out = abt.attention("flash", q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :, 3], v.mean(2), atol=1e-5, rtol=0)
