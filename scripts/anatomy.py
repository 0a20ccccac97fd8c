#!/usr/bin/python3
"""The anatomy of a trained model's attention heads, from the q, k, v captured on held-out text.

    scripts/anatomy.py [--cache DIR] --out RESULTS_DIR [--n N] [--pattern SPEC ...]
                       [--attnbench PATH]

Reads the captured queries, keys and values of every layer (the cache written by
scripts/train_lm.py and scripts/capture_qkv.py: <root>/trained/qkv/meta.json and
layer{L}.npz, q, k, v float32 [1, heads, length, dim], after the rotary embedding, i.e. what
the softmax sees), computes for every layer and head the exact causal softmax attention
P = softmax(q k^T / sqrt(d)) over the first n positions (float64, a block of rows at a time)
and writes

  RESULTS_DIR/trained/anatomy.csv   one row per layer, head, measure (and w, s or pattern)
  RESULTS_DIR/trained/anatomy.json  what was measured: the cache, n, the patterns' densities
  RESULTS_DIR/plots/anatomy_*.png   the figures (attnbench_plots/anatomy.py draws them, and
                                    scripts/plot.py draws them again with the report)

The measures (means over the query rows i = 0 .. n-1; row i sees the i + 1 keys j <= i):

  entropy        the row's entropy -sum_j P[i,j] ln P[i,j], in nats
  entropy_norm   the entropy over ln(i + 1), the uniform row's entropy (rows i >= 1): 0 is one
                 key, 1 is uniform over every visible key, so early rows do not dominate
  window_mass    per w: the mass on the w most recent keys, i - w < j <= i (w = 1 is the token
                 itself, w = 2 adds the previous token), for a log-spaced set of w
  w50, w90       the smallest w whose window_mass is at least 0.5 and 0.9
  sink_mass      per s (1 and 4): the mass on the first s keys, over the rows i >= 64 (the
                 sink is then one key among many)
  pattern_mass   per fixed-pattern variant at its defaults (or --pattern SPEC): the mass
                 inside the variant's causal pattern at n, as `attnbench pattern` exports it
                 (head 0's pattern for every head; bigbird's random blocks are head 0's)

Without an attnbench binary the pattern masses are left out, with a note. Nothing here is
random: the same cache gives the same numbers.

RESULTS_DIR is locked while the script measures and writes (DIR/.attnbench.lock, the lock of
`attnbench sweep`): another process writing it is refused, naming the holder. Every file is
written whole or not at all (a temporary file renamed over the old one); a write that fails
leaves the earlier file and exits with status 2.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import pandas as pd

from attnbench_plots import anatomy as figures
from attnbench_plots.style import remove_unsaved
from attnbench_results import (ResultsError, atomic_write, atomic_write_json, cache_root,
                               read_json, results_lock, run_main)
from attnbench_variants import default_binary

PROG = "anatomy.py"
# The variants whose pattern depends on the positions alone (not on the inputs). The
# data-dependent ones (reformer, routing, sinkhorn, clustered:topk=K) report the mass they keep
# on trained inputs in the sweep's own mass_mean column.
FIXED_PATTERNS = ["local", "strided", "global", "longformer", "bigbird", "sparse_transformer"]
SINKS = [1, 4]
SINK_START = 64
BLOCK_ROWS = 256
BUILD_HINT = ("scripts/train_lm.py trains the model and scripts/capture_qkv.py captures its q, "
              "k, v there")


def qkv_dir(arg):
    """The directory of meta.json and layer{L}.npz: --cache as that directory or as the cache
    root holding trained/qkv/, else the default root's trained/qkv/."""
    if arg is None:
        return os.path.join(cache_root(), "trained", "qkv")
    if not os.path.isfile(os.path.join(arg, "meta.json")) and \
            os.path.isdir(os.path.join(arg, "trained", "qkv")):
        return os.path.join(arg, "trained", "qkv")
    return arg


def missing(path, why):
    return ResultsError(f"no usable captured q, k, v at {path}: {why}; {BUILD_HINT} (the cache "
                        f"root is $ATTNBENCH_CACHE, $XDG_CACHE_HOME/attnbench or "
                        f"~/.cache/attnbench; --cache DIR names another)")


def load_meta(directory):
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        raise missing(directory, "meta.json does not exist")
    try:
        meta = read_json(path, "the meta.json of the captured q, k, v")
    except ResultsError as e:
        raise missing(directory, str(e)) from None
    if meta.get("format") != 1:
        raise missing(path, "not a meta.json of format 1")
    for key in ("layers", "heads", "dim", "context", "length"):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise missing(path, f"'{key}' is {v!r}, expected a positive integer")
    return meta


def load_layer(directory, meta, layer):
    """q, k of one layer as float64 arrays [heads, length, dim]."""
    path = os.path.join(directory, f"layer{layer}.npz")
    if not os.path.isfile(path):
        raise missing(directory, f"layer{layer}.npz does not exist (meta.json says "
                                 f"{meta['layers']} layers)")
    shape = (1, meta["heads"], meta["length"], meta["dim"])
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {}
            for name in ("q", "k", "v"):
                if name not in z.files:
                    raise missing(path, f"it holds no array '{name}' (it has "
                                        f"{', '.join(z.files) or 'none'})")
                a = z[name]
                if a.dtype != np.float32 or a.shape != shape:
                    raise missing(path, f"'{name}' is {a.dtype} {list(a.shape)}, expected "
                                        f"float32 {list(shape)} as meta.json says")
                if not np.isfinite(a).all():
                    raise missing(path, f"'{name}' holds values that are not finite")
                arrays[name] = a
    except (OSError, ValueError) as e:
        raise missing(path, f"not a readable .npz file ({e})") from None
    return arrays["q"][0].astype(np.float64), arrays["k"][0].astype(np.float64)


def window_set(n, windows):
    """The w at which window_mass is written: about 40 log-spaced values, 1..4, the powers of
    two, the windows of the pattern variants and n, all within 1..n."""
    ws = {int(round(x)) for x in np.geomspace(1, n, 40)} | {1, 2, 3, 4, n}
    ws |= {1 << e for e in range(n.bit_length()) if 1 << e <= n}
    ws |= {int(w) for w in windows if 1 <= w <= n}
    return sorted(ws)


def head_measures(q, k, masks, sink_start):
    """Exact causal softmax attention of one head (q, k [n, d], float64), a block of rows at a
    time, and what it is measured by: per-row entropies, the mass per offset i - j summed over
    rows, the sink masses and the pattern masses per row."""
    n, d = q.shape
    entropy = np.empty(n)
    per_offset = np.zeros(n)
    sinks = {s: [] for s in SINKS}
    pattern = {spec: np.empty(n) for spec in masks}
    for r0 in range(0, n, BLOCK_ROWS):
        r1 = min(n, r0 + BLOCK_ROWS)
        rows = np.arange(r0, r1)[:, None]
        cols = np.arange(r1)[None, :]
        visible = cols <= rows
        s = (q[r0:r1] @ k[:r1].T) / math.sqrt(d)
        s = np.where(visible, s, -np.inf)
        s -= s.max(axis=1, keepdims=True)
        e = np.exp(s)
        z = e.sum(axis=1, keepdims=True)
        p = e / z
        # -sum p ln p = ln z - sum p s for p = exp(s) / z (s = 0 where p is 0, not -inf)
        # (>= 0; a one-key row can round below it)
        entropy[r0:r1] = np.maximum(
            np.log(z[:, 0]) - (p * np.where(visible, s, 0.0)).sum(axis=1), 0.0)
        offsets = (rows - cols)[visible]
        per_offset += np.bincount(offsets, weights=p[visible], minlength=n)
        for sk in SINKS:
            sinks[sk].append(p[:, :sk].sum(axis=1))
        for spec, mask in masks.items():
            pattern[spec][r0:r1] = (p * mask[r0:r1, :r1]).sum(axis=1)
    window = np.cumsum(per_offset) / n  # window[w - 1]: mean mass on keys i - w < j <= i
    rows = np.arange(n)
    norm = entropy[1:] / np.log(rows[1:] + 1.0)
    return {
        "entropy": float(entropy.mean()),
        "entropy_norm": float(norm.mean()) if n > 1 else math.nan,
        "window": window,
        "sinks": {s: float(np.concatenate(v)[sink_start:].mean()) for s, v in sinks.items()},
        "patterns": {spec: float(m.mean()) for spec, m in pattern.items()},
    }


def smallest_window(window, share):
    """The smallest w whose mean window mass reaches `share` (up to rounding)."""
    return int(np.argmax(window >= share - 1e-12)) + 1


def variant_defaults(binary):
    """{name: {param: default}} from `attnbench list --json`, or {} when it cannot be asked."""
    try:
        run = subprocess.run([binary, "list", "--json"], capture_output=True, text=True,
                             timeout=120)
        listed = json.loads(run.stdout) if run.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}
    return {v["name"]: {p["name"]: str(p.get("default")) for p in v.get("params", [])}
            for v in listed if isinstance(v, dict) and "name" in v}


def window_of(spec, defaults):
    """The recent-keys window (keys i - w < j <= i) a causal pattern holds whole, for the
    variants that have one: local and longformer window + 1, sparse_transformer's strided band
    (stride keys); None for the others."""
    name, _, rest = spec.partition(":")
    params = dict(defaults.get(name, {}))
    params.update(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
    try:
        if name in ("local", "longformer"):
            return int(params["window"]) + 1
        if name == "sparse_transformer" and params.get("mode", "strided") == "strided":
            return int(params["stride"])
    except (KeyError, ValueError):
        pass
    return None


def export_patterns(binary, specs, n, dim, note):
    """{spec: uint8 [n, n] causal pattern of head 0} from `attnbench pattern`; a spec the
    binary cannot export is left out with a note."""
    masks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(specs):
            out = os.path.join(tmp, f"{i}.npy")
            cmd = [binary, "pattern", "--variant", spec, "--seq", str(n), "--causal", "--dim",
                   str(dim), "--output", out]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                note(f"pattern of {spec} not exported ({e}); its mass is left out")
                continue
            if run.returncode != 0 or not os.path.isfile(out):
                err = run.stderr.strip().splitlines()
                note(f"pattern of {spec} not exported ({err[-1] if err else run.returncode}); "
                     f"its mass is left out")
                continue
            mask = np.load(out, allow_pickle=False)
            if mask.dtype != np.uint8 or mask.shape != (n, n):
                note(f"pattern of {spec}: {mask.dtype} {list(mask.shape)}, expected uint8 "
                     f"[{n}, {n}]; its mass is left out")
                continue
            masks[spec] = (mask != 0) & np.tri(n, dtype=bool)
    return masks


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Entropy, window mass, sinks and pattern mass of every head of "
                               "the trained model's captured attention.")
    ap.add_argument("--cache", default=None, metavar="DIR",
                    help="the cache root (holding trained/qkv/) or the qkv directory itself "
                         "(default: $ATTNBENCH_CACHE, $XDG_CACHE_HOME/attnbench or "
                         "~/.cache/attnbench)")
    ap.add_argument("--out", required=True, metavar="RESULTS_DIR",
                    help="results directory: writes trained/anatomy.csv, trained/anatomy.json "
                         "and plots/anatomy_*.png in it")
    ap.add_argument("--n", type=int, default=None,
                    help="query and key positions measured, the first n (default: the "
                         "model's context)")
    ap.add_argument("--pattern", action="append", default=None, metavar="SPEC",
                    help="a pattern variant spec whose mass to measure (repeatable; default: "
                         + ", ".join(FIXED_PATTERNS) + " at their defaults)")
    ap.add_argument("--attnbench", default=None, metavar="PATH",
                    help="attnbench binary that exports the patterns (default: the one "
                         "installed with this script, or build/attnbench)")
    args = ap.parse_args()
    directory = qkv_dir(args.cache)
    meta = load_meta(directory)
    n = meta["context"] if args.n is None else args.n
    if not 2 <= n <= meta["length"]:
        ap.error(f"--n {n}: must be in 2..{meta['length']} (the captured length)")
    notes = []

    def note(text):
        print(f"{PROG}: {text}", file=sys.stderr)
        notes.append(text)

    if n > meta["context"]:
        note(f"n = {n} reaches beyond the trained context {meta['context']}")
    # the results directory's lock from here to the last file written, as `attnbench sweep`
    # takes it: a second writer of the directory is refused, naming this one
    with results_lock(args.out, PROG):
        return measure(args, directory, meta, n, note, notes)


def measure(args, directory, meta, n, note, notes):
    """Measures every layer and head, writes anatomy.csv, anatomy.json and the figures."""
    binary = args.attnbench or default_binary()
    masks, defaults = {}, {}
    if os.path.isfile(binary) and os.access(binary, os.X_OK):
        defaults = variant_defaults(binary)
        specs = args.pattern or [v for v in FIXED_PATTERNS if not defaults or v in defaults]
        masks = export_patterns(binary, specs, n, meta["dim"], note)
    else:
        note(f"no attnbench binary at {binary} (give one with --attnbench): the pattern "
             f"masses are left out")
    windows = {spec: window_of(spec, defaults) for spec in masks}
    sink_start = min(SINK_START, n - 1)
    ws = window_set(n, [w for w in windows.values() if w])
    rows = []
    for layer in range(meta["layers"]):
        q, k = load_layer(directory, meta, layer)
        for head in range(meta["heads"]):
            m = head_measures(q[head, :n], k[head, :n], masks, sink_start)

            def add(measure, value, w=None, s=None, pattern=None):
                rows.append({"layer": layer, "head": head, "measure": measure, "w": w, "s": s,
                             "pattern": pattern, "value": value})

            add("entropy", m["entropy"])
            add("entropy_norm", m["entropy_norm"])
            for w in ws:
                add("window_mass", float(m["window"][w - 1]), w=w)
            add("w50", smallest_window(m["window"], 0.5))
            add("w90", smallest_window(m["window"], 0.9))
            for s, v in m["sinks"].items():
                add("sink_mass", v, s=s)
            for spec, v in m["patterns"].items():
                add("pattern_mass", v, pattern=spec)
    df = pd.DataFrame(rows, columns=figures.COLUMNS)
    df["w"] = df["w"].astype("Int64")
    df["s"] = df["s"].astype("Int64")
    causal_pairs = n * (n + 1) / 2
    info = {
        "format": 1, "cache": os.path.abspath(directory), "checkpoint": meta.get("checkpoint"),
        "layers": meta["layers"], "heads": meta["heads"], "dim": meta["dim"],
        "context": meta["context"], "length": meta["length"], "n": n, "entropy_unit": "nats",
        "sink_start": sink_start, "sinks": SINKS,
        "patterns": [{"spec": spec, "head": 0, "window": windows[spec],
                      "density": float(mask.sum() / causal_pairs)}
                     for spec, mask in masks.items()],
        "notes": notes,
    }
    out = os.path.join(args.out, "trained")
    os.makedirs(out, exist_ok=True)
    atomic_write(os.path.join(out, "anatomy.csv"), lambda f: df.to_csv(f, index=False),
                 binary=False)
    atomic_write_json(os.path.join(out, "anatomy.json"), info, indent=1)
    drawn = figures.draw(args.out, df, info)
    # an earlier run's figures this one did not draw (no patterns measured), once every file
    # of this run is written
    remove_unsaved([os.path.join(args.out, "plots", name + ".png")
                    for name in figures.FIGURES])
    print(f"{PROG}: wrote {os.path.join(out, 'anatomy.csv')} ({meta['layers']} layers x "
          f"{meta['heads']} heads, n = {n}) and {', '.join(drawn)} in "
          f"{os.path.join(args.out, 'plots')}")
    return 0


if __name__ == "__main__":
    run_main(main, PROG)
