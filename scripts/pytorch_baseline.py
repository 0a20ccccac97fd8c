#!/usr/bin/python3
"""Times the PyTorch CPU expression softmax(Q K^T / sqrt(d)) V, the baseline `full` is held
against. Needs Debian's python3-torch (not installed by scripts/deps.sh).

    scripts/pytorch_baseline.py --seq 4096 --heads 8 --dim 64 --threads 2
"""
import argparse
import statistics
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("pytorch_baseline.py: PyTorch is missing; apt-get install python3-torch")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print("n,time_median_s,gflops")
    for n in a.seq:
        q, k, v = (torch.randn(a.batch, a.heads, n, a.dim) for _ in range(3))
        scale = a.dim ** -0.5
        times = []
        with torch.no_grad():
            for r in range(a.reps + 1):
                t0 = time.perf_counter()
                out = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
                if r:  # the first pass warms up
                    times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        flops = 4.0 * a.batch * a.heads * n * n * a.dim
        print(f"{n},{t:.6f},{flops / t / 1e9:.2f}")
        del out


if __name__ == "__main__":
    main()
