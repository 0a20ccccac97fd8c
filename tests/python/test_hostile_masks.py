"""Hostile attention masks through attnbench.attention: the finite extremes masks are written
with (-FLT_MAX = torch.finfo(torch.float32).min, the value Hugging Face models put in their
masks, and -1e30), mixed with -inf and ordinary values, and rows masked wholly by them. A
row of finite values only is the uniform average of its values (as in torch and the float64
reference), never NaN; every variant that accepts attn_mask is checked."""
import numpy as np
import pytest

attnbench = pytest.importorskip("attnbench")
torch = pytest.importorskip("torch")

LOWEST = float(np.finfo(np.float32).min)
assert LOWEST == torch.finfo(torch.float32).min


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def qkv(b=1, h=2, n=24, m=40, d=64, seed=0):
    return rand(b, h, n, d, seed=seed), rand(b, h, m, d, seed=seed + 1), \
        rand(b, h, m, d, seed=seed + 2)


def hostile_mask(n, m, seed=0):
    """[n, m] float32: ordinary values in [-3, 1] with rows of finite extremes:
      1 -FLT_MAX everywhere          2 -1e30 everywhere       3 -FLT_MAX / -inf alternating
      4 -FLT_MAX on even keys        5 +1e30 on key 0         6 -inf everywhere (no key)
      7 -1e30 on odd keys, -FLT_MAX on even keys (the odd keys only: -1e30 sqrt(d) is
        within float, and far above -FLT_MAX)
    """
    g = np.random.default_rng(seed)
    mask = (g.random((n, m)) * 4 - 3).astype(np.float32)
    mask[1] = LOWEST
    mask[2] = -1e30
    mask[3, 0::2], mask[3, 1::2] = LOWEST, -np.inf
    mask[4, 0::2] = LOWEST
    mask[5, 0] = 1e30
    mask[6] = -np.inf
    mask[7, 0::2], mask[7, 1::2] = LOWEST, -1e30
    return mask


def formula64(q, k, v, mask, causal=False):
    """softmax(Q Kᵀ / sqrt(d) + mask) V in float64, written out; a row with no key is 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]) + np.asarray(mask, np.float64)
    if causal:
        n, m = s.shape[-2:]
        s = np.where(np.arange(m)[None, :] > np.arange(n)[:, None] + (m - n), -np.inf, s)
    mx = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(mx), mx, 0))
    den = e.sum(-1, keepdims=True)
    return np.where(den > 0, (e / np.where(den > 0, den, 1)) @ v, 0.0)


def sdpa(q, k, v, mask):
    """torch.nn.functional.scaled_dot_product_attention where this torch has it, else the
    same function of torch ops (the dtype of q, k, v and mask)."""
    f = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if f is not None:
        return f(q, k, v, attn_mask=mask)
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + mask
    return torch.softmax(s, dim=-1) @ v


def sdpa32(q, k, v, mask):
    out = sdpa(*(torch.from_numpy(x) for x in (q, k, v)), torch.from_numpy(mask))
    return torch.nan_to_num(out).numpy()  # torch's rows of -inf only are NaN; attnbench's 0


def masked_variants():
    return [v["name"] for v in attnbench.variants() if v["attn_mask"]]


def test_a_row_of_lowest_is_the_uniform_average():
    q, k, v = qkv()
    mask = np.zeros((24, 40), np.float32)
    mask[3] = LOWEST
    for spec in ("full", "flash", "local"):
        out = attnbench.attention(spec, q, k, v, attn_mask=mask)
        assert np.isfinite(out).all(), spec
    for spec in ("full", "flash"):
        out = attnbench.attention(spec, q, k, v, attn_mask=mask)
        np.testing.assert_allclose(out[:, :, 3], v.mean(axis=2), atol=1e-5, err_msg=spec)


@pytest.mark.parametrize("spec", ["full", "flash", "flash:block_q=8,block_k=16"])
@pytest.mark.parametrize("d", [16, 64, 256])
def test_exact_variants_match_torch_and_float64(spec, d):
    q, k, v = qkv(d=d, seed=d)
    mask = hostile_mask(24, 40, seed=d)
    out = attnbench.attention(spec, q, k, v, attn_mask=mask)
    assert np.isfinite(out).all()
    want = formula64(q, k, v, mask)
    assert np.abs(out - want).max() < 2e-5
    assert np.abs(out - sdpa32(q, k, v, mask)).max() < 2e-5
    assert np.abs(attnbench.reference(q, k, v, attn_mask=mask) - want).max() < 1e-12
    # the fully masked row (-inf everywhere) is 0; the finite ones are averages
    assert (out[:, :, 6] == 0).all()
    np.testing.assert_allclose(out[:, :, 1], v.mean(axis=2), atol=1e-5)
    np.testing.assert_allclose(out[:, :, 5], v[:, :, 0], atol=1e-6)


def test_broadcast_and_causal_masks_with_extremes():
    q, k, v = qkv(b=2, h=3, n=24, m=40, d=32, seed=4)
    mask = np.stack([hostile_mask(24, 40, seed=s) for s in range(2)])[:, None]  # [2, 1, n, m]
    for spec in ("full", "flash"):
        for causal in (False, True):
            out = attnbench.attention(spec, q, k, v, attn_mask=mask, causal=causal)
            want = formula64(q, k, v, mask, causal=causal)
            assert np.abs(out - want).max() < 2e-5, (spec, causal)


def test_float64_mask_values_past_float32_stay_finite():
    """A float64 -1e300 is converted to -FLT_MAX (finite), not -inf: the row is the uniform
    average, as torch computes it in float64."""
    q, k, v = qkv(d=16)
    mask = np.zeros((24, 40))
    mask[2] = -1e300
    mask[4, :5] = -np.inf
    out = attnbench.attention("flash", q, k, v, attn_mask=mask)
    np.testing.assert_allclose(out[:, :, 2], v.mean(axis=2), atol=1e-5)
    t = sdpa(*(torch.from_numpy(x).double() for x in (q, k, v)), torch.from_numpy(mask))
    assert np.abs(out - t.numpy()).max() < 2e-5


def pattern_support(name, n, m):
    """[n, m] bool: the keys each query of the variant's pattern attends (q = 0 and v = the
    identity: each output row is the uniform distribution over its row's keys). These
    patterns depend on n, m and the seed only, not on q, k, v or d."""
    q = np.zeros((1, 1, n, m), np.float32)
    k = rand(1, 1, m, m, seed=99)
    v = np.eye(m, dtype=np.float32)[None, None]
    return attnbench.attention(name, q, k, v)[0, 0] > 0


@pytest.mark.parametrize("name", masked_variants())
def test_every_masked_variant_matches_float64_on_its_pattern(name):
    """Every variant that accepts attn_mask, against the float64 formula restricted to its
    own pattern (a key outside it is -inf): finite extremes never give NaN, a row of them only
    is the uniform average of its pattern's keys, and beside ordinary logits they weigh 0."""
    q, k, v = qkv(d=32, n=40, seed=7)  # self-attention: bigbird takes n = m only
    mask = hostile_mask(40, 40, seed=7)
    out = attnbench.attention(name, q, k, v, attn_mask=mask)
    assert np.isfinite(out).all()
    support = pattern_support(name, 40, 40)
    assert support.any(-1).all()
    want = formula64(q, k, v, np.where(support, mask, -np.inf))
    assert np.abs(out - want).max() < 2e-5


@pytest.mark.parametrize("name", [v["name"] for v in attnbench.variants()
                                  if v["attn_mask"] and v["bf16"]])
def test_bf16_path_with_extremes(name):
    q, k, v = qkv(d=32, n=40, seed=8)
    mask = hostile_mask(40, 40, seed=8)
    f32 = attnbench.attention(name, q, k, v, attn_mask=mask)
    bf = attnbench.attention(name, q, k, v, attn_mask=mask, dtype="bf16")
    assert np.isfinite(bf).all()
    assert np.abs(bf - f32).max() < 5e-2


def test_torch_finfo_min_mask_as_a_tensor():
    q, k, v = qkv(d=64)
    mask = torch.zeros(24, 40)
    mask[:, 20:] = torch.finfo(torch.float32).min
    mask[9] = torch.finfo(torch.float32).min
    import attnbench.torch as abt
    out = abt.attention("flash", *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=mask)
    want = sdpa(*(torch.from_numpy(x) for x in (q, k, v)), mask)
    assert float((out - want).abs().max()) < 2e-5
