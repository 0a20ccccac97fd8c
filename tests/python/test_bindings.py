"""Tests of the Python package attnbench (python/), against torch in float64.

Run from the build tree: PYTHONPATH=build/python /usr/bin/python3 -m pytest -q tests/python
(ctest runs it as python_bindings when the module is built).
"""

import json
import os
import subprocess
import threading
import time

import numpy as np
import pytest

attnbench = pytest.importorskip("attnbench")
torch = pytest.importorskip("torch")

RTOL = 1e-5


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def qkv(b=2, h=4, n=33, m=None, d=16, g=None, seed=0):
    m = n if m is None else m
    g = h if g is None else g
    return rand(b, h, n, d, seed=seed), rand(b, g, m, d, seed=seed + 1), rand(b, g, m, d,
                                                                                 seed=seed + 2)


def torch_attention(q, k, v, causal=False, mask=None):
    """softmax(Q Kᵀ / sqrt(d) + mask) V in float64; mask additive [.., n, m] (or None). k and v
    with fewer heads are repeated (repeat_interleave) over the query heads."""
    q, k, v = (torch.from_numpy(np.asarray(x, dtype=np.float64)) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
    n, m = s.shape[-2:]
    if causal:
        i = torch.arange(n)[:, None]
        j = torch.arange(m)[None, :]
        s = s.masked_fill(j > i + (m - n), float("-inf"))
    if mask is not None:
        s = s + torch.as_tensor(mask, dtype=torch.float64)
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p @ v).numpy()


def rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def test_variants_match_list_json():
    binary = os.environ.get("ATTNBENCH_BIN")
    got = attnbench.variants()
    assert "flash" in [v["name"] for v in got]
    assert {"name", "causal", "backward", "decode", "params"} <= set(got[0])
    if binary:
        listed = json.loads(subprocess.check_output([binary, "list", "--json"]))
        assert got == listed


def test_variant_object():
    v = attnbench.Variant("flash:block_q=32")
    assert v.name == "flash"
    assert v.spec.startswith("flash:block_q=32,")
    assert v.params["block_q"] == 32
    assert v.capabilities["causal"] is True
    assert v.has_backward and v.has_decode


def test_bad_spec_is_value_error():
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        attnbench.Variant("nope")
    with pytest.raises(ValueError, match="block_q"):
        attnbench.attention("flash:block_q=0", *qkv())


def test_wrong_shape_and_dtype():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"shape \[2, 4, 33\]"):
        attnbench.attention("flash", q[..., 0], k, v)
    with pytest.raises(ValueError, match=r"\[2, 4, 33, 16\]"):
        attnbench.attention("flash", q, k[:, :, :, :8], v)
    with pytest.raises(ValueError, match="heads"):
        attnbench.attention("flash", q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="dtype"):
        attnbench.attention("flash", q.astype(str), k, v)
    with pytest.raises(ValueError, match="kv_heads=2"):
        attnbench.attention("flash", q, k, v, kv_heads=2)


def test_unsupported_is_not_implemented():
    q, k, v = qkv(n=64)
    # linformer projects the keys: no causal mask (NotImplementedError with the C++ message)
    with pytest.raises(NotImplementedError):
        attnbench.attention("linformer", q, k, v, causal=True)


def test_non_contiguous_and_other_dtypes_give_the_same_answer():
    q, k, v = qkv()
    want = attnbench.attention("flash", q, k, v)
    qt = np.asfortranarray(q)
    assert not qt.flags.c_contiguous
    np.testing.assert_array_equal(attnbench.attention("flash", qt, k, v), want)
    kb = np.stack([k, k], axis=-1)[..., 0]  # strided view of the same values
    np.testing.assert_array_equal(kb, k)
    np.testing.assert_array_equal(attnbench.attention("flash", q, kb, v), want)
    np.testing.assert_array_equal(attnbench.attention("flash", q.astype(np.float64), k, v), want)


def test_zero_copy():
    q, k, v = qkv()
    attnbench.attention("flash", q, k, v)
    seen = attnbench._attnbench._last_pointers()
    assert seen == tuple(x.__array_interface__["data"][0] for x in (q, k, v))
    qd = q.astype(np.float64)
    attnbench.attention("flash", qd, k, v)
    assert attnbench._attnbench._last_pointers()[0] != qd.__array_interface__["data"][0]


def test_two_threads_at_once():
    q, k, v = qkv(b=2, h=8, n=512, d=64)
    want = torch_attention(q, k, v)
    results = [None, None]

    def run(i):
        results[i] = attnbench.attention("flash", q, k, v, threads=1)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    for r in results:
        assert r is not None and rel(r, want) < RTOL


def test_one_variant_object_from_several_threads():
    """Calls into one Variant object are serialised: each thread gets its own problem's answer
    (performer keeps its prepared features between calls)."""
    var = attnbench.Variant("performer:features=64")
    problems = [(qkv(b=1, h=4, n=64 + 16 * i, d=32, seed=i), i) for i in range(4)]
    want = [var.forward(q, k, v, seed=seed) for (q, k, v), seed in problems]
    got = [None] * len(problems)

    def run(i):
        (q, k, v), seed = problems[i]
        for _ in range(5):
            got[i] = var.forward(q, k, v, seed=seed)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(problems))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    for g, w in zip(got, want):
        assert g is not None and np.array_equal(g, w)


def test_gil_released_during_a_call():
    q, k, v = qkv(b=1, h=8, n=1024, d=64)
    ticks = []
    done = threading.Event()

    def call():
        attnbench.reference(q, k, v, threads=1)  # float64, plain: a long call
        done.set()

    t = threading.Thread(target=call)
    t.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    t.join()
    # the main thread kept running while the call ran (with the GIL held it would wake once)
    assert len(ticks) > 10


@pytest.mark.parametrize("spec", ["flash", "full"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_vs_torch(spec, causal):
    q, k, v = qkv(n=40, m=40 if causal else 57)
    out = attnbench.attention(spec, q, k, v, causal=causal)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert rel(out, torch_attention(q, k, v, causal=causal)) < RTOL


def test_reference_vs_torch():
    q, k, v = qkv(n=31, m=45, g=2)
    r = attnbench.reference(q, k, v)
    assert r.dtype == np.float64
    assert rel(r, torch_attention(q, k, v)) < 1e-12
    r = attnbench.reference(q, k[:, :, :31], v[:, :, :31], causal=True)
    assert rel(r, torch_attention(q, k[:, :, :31], v[:, :, :31], causal=True)) < 1e-12


@pytest.mark.parametrize("spec", ["flash", "full"])
def test_masks_and_key_padding_vs_torch(spec):
    q, k, v = qkv(b=2, h=4, n=24, m=30)
    rng = np.random.default_rng(5)
    lengths = [17, 30]
    pad = np.zeros((2, 1, 1, 30))
    pad[0, ..., 17:] = -np.inf
    out = attnbench.attention(spec, q, k, v, key_padding=lengths)
    assert rel(out, torch_attention(q, k, v, mask=pad)) < RTOL
    out = attnbench.attention(spec, q, k, v, key_padding=20)
    pad20 = np.zeros(30)
    pad20[20:] = -np.inf
    assert rel(out, torch_attention(q, k, v, mask=pad20)) < RTOL
    boolmask = rng.random((24, 30)) < 0.3
    boolmask[:, 0] = False
    want = torch_attention(q, k, v, mask=np.where(boolmask, -np.inf, 0.0))
    assert rel(attnbench.attention(spec, q, k, v, attn_mask=boolmask), want) < RTOL
    bias = rng.standard_normal((2, 1, 24, 30)).astype(np.float32)
    want = torch_attention(q, k, v, mask=bias)
    assert rel(attnbench.attention(spec, q, k, v, attn_mask=bias), want) < RTOL
    with pytest.raises(ValueError, match=r"attention mask of shape \[3, 30\]"):
        attnbench.attention(spec, q, k, v, attn_mask=np.zeros((3, 30), np.float32))


@pytest.mark.parametrize("g", [1, 2])
def test_kv_heads_vs_torch(g):
    q, k, v = qkv(h=4, g=g, n=37)
    out = attnbench.attention("flash", q, k, v, causal=True, kv_heads=g)
    assert rel(out, torch_attention(q, k, v, causal=True)) < RTOL


def test_scores_run():
    q, k, v = qkv(n=20)
    for score in ["dot", "bilinear", "additive"]:
        out = attnbench.attention("full", q, k, v, score=score, seed=3)
        ref = attnbench.reference(q, k, v, score=score, seed=3)
        assert rel(out, ref) < 1e-5
    with pytest.raises(ValueError, match="unknown scoring function 'cosine'"):
        attnbench.attention("full", q, k, v, score="cosine")


@pytest.mark.parametrize("spec", ["flash", "full"])
@pytest.mark.parametrize("g", [4, 2])
def test_backward_vs_torch_autograd(spec, g):
    q, k, v = qkv(b=2, h=4, g=g, n=29, m=29)
    dout = rand(*q.shape, seed=9)
    var = attnbench.Variant(spec)
    out, saved = var.forward_train(q, k, v, causal=True)
    dq, dk, dv = var.backward(saved, dout)
    assert dk.shape == k.shape and dv.shape == v.shape
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    rep = 4 // g
    s = tq @ tk.repeat_interleave(rep, 1).transpose(-1, -2) / np.sqrt(16)
    s = s.masked_fill(torch.ones(29, 29, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, -1) @ tv.repeat_interleave(rep, 1)
    (o * torch.from_numpy(dout.astype(np.float64))).sum().backward()
    assert rel(out, o.detach().numpy()) < RTOL
    for got, want in [(dq, tq.grad), (dk, tk.grad), (dv, tv.grad)]:
        assert rel(got, want.numpy()) < RTOL


def test_unsupported_backward_is_not_implemented():
    # every built-in variant has a backward pass, none of them for the additive score
    var = attnbench.Variant("flash")
    with pytest.raises(NotImplementedError, match="additive"):
        var.forward_train(*qkv(n=16), score="additive")


def test_decode_steps_equal_causal_rows():
    b, h, g, n, d, t0 = 2, 4, 2, 24, 16, 10
    q, k, v = qkv(b=b, h=h, g=g, n=n, d=d)
    var = attnbench.Variant("flash")
    full = var.forward(q, k, v, causal=True)
    dec = var.decoder(k[:, :, :t0], v[:, :, :t0], capacity=n, heads=h)
    assert dec.length == t0 and dec.capacity == n and dec.state_bytes > 0
    for t in range(t0, n):
        row = dec.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert row.shape == (b, h, 1, d)
        np.testing.assert_allclose(row[:, :, 0], full[:, :, t], rtol=1e-5, atol=1e-6)
    assert dec.length == n
    with pytest.raises(ValueError, match="full"):
        dec.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    # append(k, v) then attend(q): the same steps in two calls
    dec = var.decoder(k[:, :, :t0], v[:, :, :t0], capacity=n, heads=h)
    with pytest.raises(ValueError, match="append"):
        dec.attend(q[:, :, t0:t0 + 1])
    for t in range(t0, n):
        dec.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        with pytest.raises(ValueError, match="attend"):
            dec.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        row = dec.attend(q[:, :, t:t + 1])
        np.testing.assert_allclose(row[:, :, 0], full[:, :, t], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="full"):
        dec.append(k[:, :, :1], v[:, :, :1])


def test_no_decode_is_not_implemented():
    var = attnbench.Variant("linformer")
    assert not var.has_decode
    k = rand(1, 2, 4, 8)
    with pytest.raises(NotImplementedError):
        var.decoder(k, k, capacity=16)


@pytest.mark.parametrize("spec", ["flash", "full"])
def test_torch_autograd_function(spec):
    import attnbench.torch as abt

    q, k, v = (torch.from_numpy(x).requires_grad_() for x in qkv(h=4, g=2, n=21))
    out = abt.attention(spec, q, k, v, causal=True)
    assert out.dtype == torch.float32 and out.shape == q.shape
    dout = torch.from_numpy(rand(*q.shape, seed=4))
    out.backward(dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2) / 4.0
    s = s.masked_fill(torch.ones(21, 21, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, -1) @ v64.repeat_interleave(2, 1)
    o.backward(dout.double())
    assert rel(out.detach().numpy(), o.detach().numpy()) < RTOL
    for got, want in [(q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)]:
        assert rel(got.numpy(), want.numpy()) < RTOL
    with torch.no_grad():  # no training pass needed: the plain forward
        assert rel(abt.attention(spec, q, k, v, causal=True).numpy(), o.detach().numpy()) < RTOL


def test_torch_backward_error_comes_at_backward():
    """A problem without a backward (the additive score) runs its forward; backward raises."""
    import attnbench.torch as abt

    q, k, v = (torch.from_numpy(x).requires_grad_() for x in qkv(n=16))
    out = abt.attention("flash", q, k, v, score="additive")
    with torch.no_grad():
        assert rel(out.detach().numpy(),
                   abt.attention("flash", q, k, v, score="additive").numpy()) == 0
    with pytest.raises(NotImplementedError, match="additive"):
        out.sum().backward()


def test_torch_shares_memory():
    import attnbench.torch as abt

    q, k, v = (torch.from_numpy(x) for x in qkv())
    abt.attention("flash", q, k, v)
    assert attnbench._attnbench._last_pointers() == tuple(x.data_ptr() for x in (q, k, v))


def to_bf16(x):
    """x rounded to bfloat16 by torch (to nearest even), back as float32."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("spec,causal", [("flash", False), ("flash", True),
                                         ("local:window=8,block=32", True)])
def test_bf16_rounds_as_torch_and_stays_in_the_roundoff_bound(spec, causal):
    q, k, v = qkv(n=70, m=70 if causal else 90, g=2)
    variant = attnbench.Variant(spec)
    assert variant.capabilities["bf16"]
    out = variant.forward(q, k, v, causal=causal, dtype="bf16")
    assert out.dtype == np.float32 and out.shape == q.shape
    assert variant.notes.startswith("bf16 kernel: ")
    # the inputs are rounded as torch rounds them: the same output bit for bit from torch's
    # bf16 values
    qr, kr, vr = to_bf16(q), to_bf16(k), to_bf16(v)
    again = variant.forward(qr, kr, vr, causal=causal, dtype="bf16")
    assert np.array_equal(out, again)
    # |o - o*| <= 2^-8 sum_j p_j |v_j| against the variant's float32 path on the same rounded
    # inputs (the float64 reference for flash), and the bound is used (bf16 arithmetic ran)
    exact = variant.forward(qr, kr, vr, causal=causal)
    scale = variant.forward(qr, kr, np.abs(vr), causal=causal)
    if spec == "flash":
        rq = torch_attention(qr, kr, vr, causal=causal)
        assert rel(exact, rq) < RTOL
    ratio = np.abs(out.astype(np.float64) - exact) / (2.0 ** -8 * scale + 1e-30)
    assert ratio.max() <= 1.02
    assert ratio.max() > 0.05


def test_bf16_refusals():
    q, k, v = qkv(n=32)
    assert not attnbench.Variant("linear").capabilities["bf16"]
    with pytest.raises(NotImplementedError, match="no bf16 path"):
        attnbench.attention("linear", q, k, v, dtype="bf16")
    with pytest.raises(NotImplementedError, match="float32 only"):
        attnbench.Variant("flash").forward_train(q, k, v, dtype="bf16")
    with pytest.raises(ValueError, match="accepted: f32, bf16"):
        attnbench.attention("flash", q, k, v, dtype="fp16")
