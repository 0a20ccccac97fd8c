#!/usr/bin/env python3
"""attnbench's backward pass against torch.autograd.

For every exact variant with a backward pass (`attnbench list --json`: exact and backward),
on self- and cross-attention, causal and not, with key padding and a float attention mask
(-inf entries and a finite bias), and under the scaled_dot, dot and bilinear scores: the
inputs file carries q, k, v, the upstream gradient `do` (and for bilinear its weights),
`attnbench run --pass bwd --save-grads` writes dq, dk, dv, and torch.autograd computes the
gradients of sum(do * softmax(a(q, k) + mask) v) in float64 on the same arrays. Rows with no
visible key give 0 in attnbench (no gradient) and NaN in PyTorch's softmax: torch gets them
with a zero dO.
Pattern variants are compared with the dense function restricted to their pattern, exported
by `attnbench pattern`. Grouped-query cases (`--kv-heads`: k, v with 2 heads for 4 query heads)
give torch k and v through repeat_interleave, so autograd sums the gradients of a key/value
head over its group.

usage: torch_grad_test.py ATTNBENCH
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

TOL = 1e-5

# Pattern variants at settings that leave several blocks and a real pattern in the test's
# short sequences (their defaults cover 45 keys whole, or leave each query its own key only);
# a variant not named here runs at its defaults.
SMALL = {
    "local": "local:window=8,block=8",
    "strided": "strided:stride=4,block=8",
    "global": "global:global=4,block=8",
    "longformer": "longformer:window=8,global=2,block=8",
    "bigbird": "bigbird:block=8,window_blocks=3,random_blocks=1,global_blocks=1",
    "sparse_transformer": "sparse_transformer:stride=6,block=8",
    "sinkhorn": "sinkhorn:block=8",
}


def torch_grads(q, k, v, do, bias, score, w):
    """dq, dk, dv of sum(do * softmax(logits + bias) v) in float64 by autograd."""
    qt, kt, vt = (torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]  # query heads per key/value head
    ke, ve = (x.repeat_interleave(group, dim=1) for x in (kt, vt))
    if score == "scaled_dot":
        logits = qt @ ke.transpose(-2, -1) / math.sqrt(q.shape[-1])
    elif score == "dot":
        logits = qt @ ke.transpose(-2, -1)
    else:  # bilinear: q^T W k per head, W [H, d, d]
        wt = torch.from_numpy(w.astype(np.float64))
        logits = torch.einsum("bhic,hcx,bhjx->bhij", qt, wt, ke)
    out = torch.softmax(logits + torch.from_numpy(bias), dim=-1) @ ve
    (out * torch.from_numpy(do.astype(np.float64))).sum().backward()
    return qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()


def pattern_bias(exe, tmp, variant, n, m, causal, h_count):
    """-inf where the variant's pattern leaves a pair out, per head: [1, H, n, m]."""
    out = np.zeros((1, h_count, n, m))
    for h in range(h_count):
        path = os.path.join(tmp, f"pattern{h}.npy")
        cmd = [exe, "pattern", "--variant", variant, "--seq", str(n), "--seq-k", str(m),
               "--head", str(h), "--output", path]
        if causal:
            cmd.append("--causal")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        out[0, h][np.load(path) == 0] = -np.inf
    return out


def run_case(exe, tmp, variant, pattern, n, m, causal, score, rng, h=3, g=3):
    b, d = 2, 16
    q = rng.standard_normal((b, h, n, d)).astype(np.float32)
    k = rng.standard_normal((b, g, m, d)).astype(np.float32)
    v = rng.standard_normal((b, g, m, d)).astype(np.float32)
    do = rng.standard_normal((b, h, n, d)).astype(np.float32)
    arrays = dict(q=q, k=k, v=v, do=do)
    w = None
    if score == "bilinear":
        w = (rng.standard_normal((h, d, d)) / d).astype(np.float32)
        arrays["w_bilinear"] = w
    inputs = os.path.join(tmp, "inputs.npz")
    np.savez(inputs, **arrays)
    # a float mask with a finite bias and some -inf entries, never a whole row
    bias = rng.uniform(-1, 1, (b, 1, n, m)).astype(np.float32)
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    bias[..., 0] = 0.0
    mask_path = os.path.join(tmp, "mask.npz")
    np.savez(mask_path, attn_mask=bias)
    lens = [m - m // 3, m]
    full = np.broadcast_to(bias.astype(np.float64), (b, h, n, m)).copy()
    for bi, L in enumerate(lens):
        full[bi, :, :, L:] = -np.inf
    if causal:
        i = np.arange(n)[:, None]
        j = np.arange(m)[None, :]
        full[:, :, j > i + (m - n)] = -np.inf
    if pattern:
        full = full + pattern_bias(exe, tmp, variant, n, m, causal, h)
    # a row with no visible key is 0 in attnbench, a constant with no gradient; PyTorch's
    # softmax gives NaN there, so torch sees such rows with a finite bias and a zero dO (the
    # same zero contribution)
    empty = ~np.isfinite(full).any(axis=-1)
    do_torch = do.copy()
    do_torch[empty] = 0
    full[empty] = 0
    grads = os.path.join(tmp, "grads.npz")
    cmd = [exe, "run", "--variant", variant, "--inputs", inputs, "--attn-mask", mask_path,
           "--key-padding", ",".join(map(str, lens)), "--score", score, "--pass", "bwd",
           "--save-grads", grads, "--reps", "1", "--min-time", "0.001"]
    if causal:
        cmd.append("--causal")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    got = np.load(grads)
    want = torch_grads(q, k, v, do_torch, full, score, w)
    label = f"{variant} n={n} m={m} causal={int(causal)} score={score} H={h} G={g}"
    for name, ref in zip(("dq", "dk", "dv"), want):
        g = got[name].astype(np.float64)
        assert g.shape == ref.shape, f"{label}: {name} shape {g.shape} != {ref.shape}"
        # relative, or absolute where the exact gradient is 0 (a query alone with its key)
        scale = np.linalg.norm(ref)
        err = np.linalg.norm(g - ref) / scale if scale > 0 else np.linalg.norm(g)
        print(f"{label}: {name} rel error {err:.2e}")
        if not err < TOL:
            raise SystemExit(f"FAIL {label}: {name} relative error {err:.3e} >= {TOL}")
    return 1


def main():
    exe = sys.argv[1]
    listing = json.loads(subprocess.run([exe, "list", "--json"], check=True,
                                        capture_output=True, text=True).stdout)
    exact = [v for v in listing if v["exact"] and v["backward"] and v["attn_mask"]
             and v["key_padding"] and not v["plugin"]]
    if not exact:
        raise SystemExit("no exact variant with a backward pass, a mask and key padding")
    rng = np.random.default_rng(17)
    cases = 0
    with tempfile.TemporaryDirectory() as tmp:
        for v in exact:
            name = v["name"]
            pattern = name not in ("full", "flash")
            spec = SMALL.get(name, name)
            for n, m in ((45, 45), (33, 70)):
                if m != n and not v["cross"]:
                    continue
                for causal in (False, True):
                    if causal and not v["causal"]:
                        continue
                    scores = ("scaled_dot", "dot", "bilinear") if not pattern else ("scaled_dot",)
                    for score in scores:
                        cases += run_case(exe, tmp, spec, pattern, n, m, causal, score, rng)
            # grouped-query attention: 4 query heads on 2 key/value heads
            cases += run_case(exe, tmp, spec, pattern, 45, 45, v["causal"], "scaled_dot", rng,
                              h=4, g=2)
    names = ", ".join(v["name"] for v in exact)
    print(f"ok: {cases} cases of {names}")


if __name__ == "__main__":
    main()
