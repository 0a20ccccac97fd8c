#!/usr/bin/python3
"""Times the PyTorch CPU expression softmax(Q K^T / sqrt(d)) V, the baseline `full` is held
against: its forward pass (`--pass fwd`, under no_grad), torch.autograd's backward alone
(`--pass bwd`, from a forward kept with its graph) or both (`--pass fwdbwd`), with dO drawn
N(0, 1); or one generation step on cached tensors at context n (`--pass decode`: the new key
and value written into preallocated caches, then the expression for one query over the n + 1
cached positions, under no_grad; Debian's PyTorch 1.13 has no scaled_dot_product_attention).
With `--kv-heads G` (grouped-query attention, G dividing H) k and v have G heads: the passes
expand them to the H query heads with repeat_interleave, and the decode step keeps caches of G
heads and attends the H / G queries of each group in one product (q viewed [B, G, H / G, d]).
With `--rss`, each pass runs in a fresh process and its maximum resident set size (the
training peak PyTorch reaches) is reported too. Needs Debian's python3-torch (not
installed by scripts/deps.sh).

    scripts/pytorch_baseline.py --seq 4096 --heads 8 --dim 64 --threads 2 --pass fwd bwd fwdbwd
"""
import argparse
import resource
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("pytorch_baseline.py: PyTorch is missing; apt-get install python3-torch")


def attention(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v


def grouped(x, heads):
    """k or v of G heads [B, G, n, d] as the H query heads read them."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def time_decode(a, n, kind):
    """Median seconds of one decode step at context n (after a warm-up step): the caches hold
    n positions and room for the steps; each step appends one key and value per (batch, head)
    and attends one query over every cached position."""
    steps = max(a.reps, 20) + 1
    g = a.kv_heads
    shape = (a.batch, g, n + steps, a.dim)
    kc, vc = torch.randn(shape), torch.randn(shape)
    q = torch.randn(a.batch, g, a.heads // g, a.dim)  # the H queries, by group
    k, v = (torch.randn(a.batch, g, 1, a.dim) for _ in range(2))
    scale = a.dim ** -0.5
    times = []
    with torch.no_grad():
        for r in range(steps):
            t = n + r
            t0 = time.perf_counter()
            kc[:, :, t] = k[:, :, 0]
            vc[:, :, t] = v[:, :, 0]
            attention(q, kc[:, :, :t + 1], vc[:, :, :t + 1], scale)
            if r:  # the first step warms up
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_pass(a, n, kind):
    """Median seconds of one pass of `kind` over a.reps repetitions (after a warm-up)."""
    if kind == "decode":
        return time_decode(a, n, kind)
    q = torch.randn(a.batch, a.heads, n, a.dim, requires_grad=kind != "fwd")
    k, v = (torch.randn(a.batch, a.kv_heads, n, a.dim, requires_grad=kind != "fwd")
            for _ in range(2))
    do = torch.randn(a.batch, a.heads, n, a.dim)
    scale = a.dim ** -0.5
    times = []
    for r in range(a.reps + 1):
        if kind == "fwd":
            with torch.no_grad():
                t0 = time.perf_counter()
                attention(q, grouped(k, a.heads), grouped(v, a.heads), scale)
        elif kind == "bwd":
            # the forward and its graph, not timed
            out = attention(q, grouped(k, a.heads), grouped(v, a.heads), scale)
            q.grad = k.grad = v.grad = None
            t0 = time.perf_counter()
            out.backward(do)
        else:
            q.grad = k.grad = v.grad = None
            t0 = time.perf_counter()
            attention(q, grouped(k, a.heads), grouped(v, a.heads), scale).backward(do)
        if r:  # the first pass warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="key/value heads G (a divisor of --heads; 0 = as many as the heads)")
    ap.add_argument("--seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pass", dest="passes", nargs="+", default=["fwd"],
                    choices=["fwd", "bwd", "fwdbwd", "decode"])
    ap.add_argument("--rss", action="store_true",
                    help="also report each pass's maximum resident set size (fresh process)")
    ap.add_argument("--one", nargs=2, metavar=("N", "PASS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.kv_heads = a.kv_heads or a.heads
    if a.kv_heads < 1 or a.heads % a.kv_heads:
        ap.error(f"--kv-heads {a.kv_heads} does not divide --heads {a.heads}")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.one:  # a child of --rss: one pass, then its peak RSS
        t = time_pass(a, int(a.one[0]), a.one[1])
        print(t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return
    print("n,pass,time_median_s,gflops" + (",max_rss_bytes" if a.rss else ""))
    for n in a.seq:
        for kind in a.passes:
            rss = ""
            if a.rss:
                cmd = [sys.executable, __file__, "--batch", str(a.batch), "--heads", str(a.heads),
                       "--kv-heads", str(a.kv_heads),
                       "--dim", str(a.dim), "--threads", str(a.threads), "--reps", str(a.reps),
                       "--one", str(n), kind]
                t, peak = subprocess.run(cmd, check=True, capture_output=True,
                                         text=True).stdout.split()
                t, rss = float(t), f",{int(peak)}"
            else:
                t = time_pass(a, n, kind)
            fwd = 4.0 * a.batch * a.heads * n * n * a.dim
            # the backward's four products against the forward's two
            step = 4.0 * a.batch * a.heads * (n + 1) * a.dim  # one query, n + 1 keys
            flops = {"fwd": fwd, "bwd": 2.0 * fwd, "fwdbwd": 3.0 * fwd, "decode": step}[kind]
            print(f"{n},{kind},{t:.6f},{flops / t / 1e9:.2f}{rss}")


if __name__ == "__main__":
    main()
