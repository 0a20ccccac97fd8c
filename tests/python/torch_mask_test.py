#!/usr/bin/env python3
"""attnbench run with --attn-mask and --key-padding against PyTorch.

For full and flash, on self- and cross-attention, causal and not: a bool mask (true = masked
out, torch.nn.MultiheadAttention's convention) and a float additive mask (with -inf entries),
and one holding -FLT_MAX and -1e30 on whole rows, each with key padding, saved as .npy / .npz, run through `attnbench run --inputs --attn-mask
--key-padding --output`, and compared with torch.nn.functional.scaled_dot_product_attention in
float64 (whose bool mask means the opposite: true = attend; a torch without it, such as
1.13, gets the same function composed of torch ops). Rows with no visible key give 0 in
attnbench and NaN in PyTorch: they are checked to be exactly 0 and left out of the error.

usage: torch_mask_test.py ATTNBENCH
"""
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

TOL = 1e-5


def torch_attention(q, k, v, mask):
    """PyTorch's attention with an attention mask: F.scaled_dot_product_attention where this
    torch has it (bool mask: true = attend), else the same function composed of torch ops."""
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if sdpa is not None:
        return sdpa(q, k, v, attn_mask=mask)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(scores, dim=-1) @ v


def run_case(exe, tmp, variant, n, m, causal, kind, rng):
    b, h, d = 2, 3, 24
    q = rng.standard_normal((b, h, n, d)).astype(np.float32)
    k = rng.standard_normal((b, h, m, d)).astype(np.float32)
    v = rng.standard_normal((b, h, m, d)).astype(np.float32)
    lens = [m // 2 + 1, m]
    inputs = os.path.join(tmp, "inputs.npz")
    np.savez(inputs, q=q, k=k, v=v)
    if kind == "bool":
        masked = rng.random((n, m)) < 0.3  # true = masked out
        masked[n // 3, :] = True           # a row with no key
        path = os.path.join(tmp, "mask.npy")
        np.save(path, masked)
        bias = np.where(masked, -np.inf, 0.0)[None, None]
    else:
        bias = rng.uniform(-2, 2, (b, 1, n, m)).astype(np.float32)
        bias[rng.random(bias.shape) < 0.25] = -np.inf
        bias[1, 0, n // 2, :] = -np.inf
        if kind == "extreme":
            # the finite values masks are written with: torch.finfo(torch.float32).min (=
            # -FLT_MAX, Hugging Face's) and -1e30, on whole rows (the uniform average of the
            # row's visible values) and beside ordinary values (weight 0)
            lowest = np.finfo(np.float32).min
            bias[0, 0, 1, :] = lowest
            bias[1, 0, 2, :] = -1e30
            bias[:, 0, 3, ::2] = lowest
            bias[0, 0, 4, :] = np.where(np.arange(m) % 3 == 0, -np.inf, lowest)
        path = os.path.join(tmp, "mask.npz")
        np.savez(path, attn_mask=bias)
        bias = bias.astype(np.float64)
    # combined additive mask: the file's, key padding, bottom-right causal
    full = np.broadcast_to(bias, (b, h, n, m)).copy()
    for bi, L in enumerate(lens):
        full[bi, :, :, L:] = -np.inf
    if causal:
        i = np.arange(n)[:, None]
        j = np.arange(m)[None, :]
        full[:, :, j > i + (m - n)] = -np.inf
    out = os.path.join(tmp, "out.npy")
    cmd = [exe, "run", "--variant", variant, "--inputs", inputs, "--attn-mask", path,
           "--key-padding", ",".join(map(str, lens)), "--output", out, "--reps", "1",
           "--min-time", "0.001"]
    if causal:
        cmd.append("--causal")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    got = np.load(out).astype(np.float64)
    allow = torch.from_numpy(np.isfinite(full))  # SDPA's bool convention: true = attend
    qt, kt, vt = (torch.from_numpy(x.astype(np.float64)) for x in (q, k, v))
    ref_bool = torch_attention(qt, kt, vt, allow)
    ref = torch_attention(qt, kt, vt, torch.from_numpy(full)).numpy()
    empty = ~np.isfinite(full).any(axis=-1)  # [b, h, n]
    assert empty.any(), "the case must hold a row with no key"
    assert np.all(got[empty] == 0), f"{variant}: rows with no key are not 0"
    assert np.all(np.isfinite(got)), f"{variant}: non-finite output"
    keep = ~empty
    if kind == "bool":  # the bool and float forms of one mask agree in PyTorch too
        rb = ref_bool.numpy()
        assert np.allclose(rb[keep], ref[keep], rtol=0, atol=1e-12)
    err = np.linalg.norm(got[keep] - ref[keep]) / np.linalg.norm(ref[keep])
    label = f"{variant} n={n} m={m} causal={int(causal)} {kind} mask + padding {lens}"
    print(f"{label}: rel error {err:.2e}")
    if not err < TOL:
        raise SystemExit(f"FAIL {label}: relative error {err:.3e} >= {TOL}")


def main():
    exe = sys.argv[1]
    rng = np.random.default_rng(14)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("full", "flash"):
            for n, m in ((97, 97), (64, 150)):
                for causal in (False, True):
                    for kind in ("bool", "float", "extreme"):
                        run_case(exe, tmp, variant, n, m, causal, kind, rng)
    print("ok")


if __name__ == "__main__":
    main()
