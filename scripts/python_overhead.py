#!/usr/bin/python3
"""The per-call cost of the Python package over the C++ call it makes.

Times attnbench.attention(spec, q, k, v) on a small problem (default: flash, B = 1, H = 8,
n = 64, d = 64, one thread), the fastest of --reps batches of --calls calls, against the
fastest repetition of `attnbench run` on the same problem (the C++ forward alone, timed by
Google Benchmark), and prints both and their difference: what a Python caller pays per call
for the spec parsing, the checks, the array wrapping and the GIL.

    PYTHONPATH=build/python scripts/python_overhead.py --attnbench build/attnbench
"""
import argparse
import json
import subprocess
import time

import numpy as np

import attnbench


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attnbench", default="build/attnbench", help="the attnbench binary")
    ap.add_argument("--variant", default="flash")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, a.heads, a.seq, a.dim), dtype=np.float32)
    for _ in range(a.calls // 10):  # warm-up
        attnbench.attention(a.variant, q, k, v, threads=a.threads)
    py = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            attnbench.attention(a.variant, q, k, v, threads=a.threads)
        py.append((time.perf_counter() - t0) / a.calls)
    row = json.loads(subprocess.run(
        [a.attnbench, "run", "--variant", a.variant, "--seq", str(a.seq), "--heads", str(a.heads),
         "--dim", str(a.dim), "--threads", str(a.threads), "--reps", str(a.reps), "--json"],
        check=True, capture_output=True, text=True).stdout)
    cpp = row["time_min_s"]
    print(f"python attnbench.attention: {min(py) * 1e6:.2f} us per call (fastest of {a.reps} x "
          f"{a.calls})")
    print(f"C++ forward (attnbench run): {cpp * 1e6:.2f} us (fastest repetition)")
    print(f"overhead: {(min(py) - cpp) * 1e6:.2f} us per call")


if __name__ == "__main__":
    main()
