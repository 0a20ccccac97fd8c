#!/usr/bin/python3
"""`attnbench layer` against torch.nn.MultiheadAttention on the same parameters and inputs.

    tests/python/layer_torch.py ATTNBENCH

For each case it builds torch.nn.MultiheadAttention(E, H, batch_first=True) with seeded
parameters (biases made non-zero, so they are checked too), saves the layer and its inputs with
np.savez under PyTorch's names, runs `attnbench layer --inputs F --output O` with the exact
variants full and flash, and requires the relative Frobenius error of the output (and, with
--need-weights, of the head-averaged attention weights) against PyTorch's float64 layer to be
below 1e-5. Cases: self-attention (query = key = value), cross-attention with L != S, causal
(attnbench's mask is bottom-right aligned: PyTorch gets the matching boolean attn_mask, true =
masked out), need_weights, ragged sizes, and masks in PyTorch's conventions saved in the file:
key_padding_mask [B, S] (bool, true = padded; as an end padding and with holes), attn_mask
[L, S] float (added to the logits, with -inf entries) and [B H, L, S] bool (true = masked out),
alone and together with causal. PyTorch's layer gives NaN on a row that sees no key where
attnbench gives the out-projection of zeros: the masked cases leave every row at least one key.
Exit status 0 when every case passes, 1 otherwise (or when torch is missing).
"""

import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"layer_torch.py: cannot import {e.name}: this test compares attnbench's layer with "
          f"torch.nn.MultiheadAttention and needs python3-torch and python3-numpy "
          f"(scripts/deps.sh installs them, or: apt-get install python3-torch python3-numpy)",
          file=sys.stderr)
    sys.exit(1)

TOLERANCE = 1e-5
VARIANTS = ["full", "flash"]

# (name, B, E, H, L, S or None for self-attention, causal, need_weights, masks), masks a
# subset of "pad" (end padding), "holes" (padding in the middle), "float" ([L, S] float mask),
# "bool" ([B H, L, S] bool mask)
CASES = [
    ("self", 2, 48, 4, 37, None, False, True, ()),
    ("self ragged d=11", 1, 33, 3, 29, None, False, False, ()),
    ("cross L<S", 2, 32, 4, 7, 19, False, True, ()),
    ("cross L>S", 1, 24, 2, 21, 9, False, True, ()),
    ("causal self", 2, 40, 5, 31, None, True, True, ()),
    ("causal cross L<S", 1, 32, 4, 6, 15, True, True, ()),
    ("self key padding", 3, 32, 4, 23, None, False, True, ("pad",)),
    ("cross key padding holes", 2, 24, 3, 9, 17, False, True, ("holes",)),
    ("self float mask", 2, 32, 4, 19, None, False, True, ("float",)),
    ("cross bool mask per head", 2, 24, 3, 11, 14, False, True, ("bool",)),
    ("causal self padding and float mask", 2, 40, 5, 27, None, True, True, ("pad", "float")),
    ("cross holes and bool mask", 2, 32, 4, 8, 21, False, False, ("holes", "bool")),
]


def make_masks(masks, B, H, L, S, causal, gen):
    """The masks of a case in PyTorch's conventions, drawn from `gen`, such that every query
    row keeps at least one key (key 0 is never masked)."""
    kpm = None
    if "pad" in masks:  # valid lengths, then padding: true = padded
        lengths = torch.randint(1, S + 1, (B,), generator=gen)
        lengths[0] = max(1, S // 3)
        kpm = torch.arange(S).unsqueeze(0) >= lengths.unsqueeze(1)
    if "holes" in masks:
        kpm = torch.rand(B, S, generator=gen) < 0.4
        kpm[:, 0] = False
    attn = None
    if "float" in masks:
        attn = torch.randn(L, S, generator=gen)
        attn[torch.rand(L, S, generator=gen) < 0.25] = float("-inf")
        attn[:, 0] = 0.5
    if "bool" in masks:
        attn = torch.rand(B * H, L, S, generator=gen) < 0.35
        attn[:, :, 0] = False
    return kpm, attn


def causal_mask(L, S):
    """PyTorch's boolean attn_mask (true = masked out) for attnbench's bottom-right aligned
    causal mask: key j is visible to query i iff j <= i + (S - L)."""
    i = torch.arange(L).unsqueeze(1)
    j = torch.arange(S).unsqueeze(0)
    return j > i + (S - L)


def rel_error(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def run_case(attnbench, tmp, case, seed):
    name, B, E, H, L, S, causal, need_weights, masks = case
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():  # PyTorch zeroes the biases: give them values so they are checked
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    query = torch.randn(B, L, E)
    if S is None:
        key = value = query
    else:
        key, value = torch.randn(B, S, E), torch.randn(B, S, E)
    S_len = key.shape[1]
    gen = torch.Generator().manual_seed(1000 + seed)
    kpm, attn = make_masks(masks, B, H, L, S_len, causal, gen)
    extra = {}
    if kpm is not None:
        extra["key_padding_mask"] = kpm.numpy()
    if attn is not None:
        extra["attn_mask"] = attn.numpy()
    path = os.path.join(tmp, f"layer_{seed}.npz")
    # The snippet of docs/cli.md ("Multi-head layer"): the layer's state_dict, its inputs and
    # masks under PyTorch's names.
    np.savez(path, query=query.numpy(), key=key.numpy(), value=value.numpy(),
             **{k: t.numpy() for k, t in mha.state_dict().items()}, **extra)

    # PyTorch's layer in float64 on the same parameters; attnbench's causal flag becomes
    # PyTorch's attn_mask, combined with the file's mask.
    ref = mha.double()
    mask = attn.double() if attn is not None and attn.dtype != torch.bool else attn
    if causal:
        cm = causal_mask(L, S_len)
        if mask is None:
            mask = cm
        elif mask.dtype == torch.bool:
            mask = mask | cm
        else:
            mask = mask.masked_fill(cm, float("-inf"))
    with torch.no_grad():
        out_ref, w_ref = ref(query.double(), key.double(), value.double(), attn_mask=mask,
                             key_padding_mask=kpm, need_weights=need_weights)
    if torch.isnan(out_ref).any():
        return [f"{name}: PyTorch's layer gives NaN: a row sees no key (the case is wrong)"]
    failures = []
    for variant in VARIANTS:
        out_path = os.path.join(tmp, f"out_{seed}_{variant}.npz")
        cmd = [attnbench, "layer", "--variant", variant, "--heads", str(H), "--inputs", path,
               "--output", out_path, "--min-time", "0", "--reps", "1", "--threads", "2"]
        if causal:
            cmd.append("--causal")
        if need_weights:
            cmd.append("--need-weights")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        label = f"{name} (B={B}, E={E}, H={H}, L={L}, S={S_len}) {variant}"
        if proc.returncode != 0:
            failures.append(f"{label}: attnbench exited {proc.returncode}: {proc.stderr.strip()}")
            continue
        got = np.load(out_path)
        if got["output"].shape != (B, L, E):
            failures.append(f"{label}: output has shape {got['output'].shape}, "
                            f"expected {(B, L, E)}")
            continue
        err = rel_error(got["output"], out_ref.numpy())
        line = f"{label}: output rel. error {err:.2e}"
        if not err < TOLERANCE:
            failures.append(line)
        if need_weights:
            if "attn_weights" not in got.files:
                failures.append(f"{label}: no attn_weights in {out_path}")
                continue
            werr = rel_error(got["attn_weights"], w_ref.numpy())
            line += f", weights rel. error {werr:.2e}"
            if not werr < TOLERANCE:
                failures.append(line)
        elif "attn_weights" in got.files:
            failures.append(f"{label}: attn_weights written without --need-weights")
        print(line)
    return failures


def main():
    if len(sys.argv) != 2:
        print("usage: layer_torch.py ATTNBENCH", file=sys.stderr)
        return 2
    attnbench = sys.argv[1]
    torch.set_num_threads(1)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed, case in enumerate(CASES):
            failures += run_case(attnbench, tmp, case, seed)
    if failures:
        print(f"layer_torch.py: {len(failures)} comparison(s) failed (tolerance {TOLERANCE}):",
              file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    print(f"layer_torch.py: every case matches torch.nn.MultiheadAttention within {TOLERANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
