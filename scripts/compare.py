#!/usr/bin/python3
"""Time of each row in two attnbench results directories, side by side.

    scripts/compare.py DIR_A DIR_B [--min-change FRAC] [--ignore COLUMN] [--normalize none|gemm]
                       [--fail-on-regression]

Rows are joined on the variant spec and the problem columns (batch, heads, n, m, dim, embed,
causal, score, score_hidden, input, scale, seed, threads; embed is 0 for plain attention), the
key `attnbench sweep` itself uses (a results.csv written before the embed or score columns reads
as embed 0 and scaled_dot); `--ignore COLUMN` leaves a problem column out of that key, so that
runs that differ in it (two thread counts, two inputs) are compared row by row, the column then
shown as A's value -> B's. When rows of one run find no partner in the other, the columns that
kept them apart are named, with the --ignore that would join them. For every row measured in
both runs it prints the median times, the ratio B/A and the speed-up A/B, and flags the change
when it is beyond the measured spread: each run's repetitions span [time_min_s, time_max_s],
and a row is flagged "slower" or "faster" when the two spans do not overlap and the ratio
differs from 1 by more than --min-change, by default the runs' typical spread (the larger of
the two runs' median of (time_max_s - time_min_s) / time_median_s over their rows with at least
two repetitions; --min-change 0 judges by the spans alone). A row with a single
repetition has no spread and is marked "no spread" instead of being judged, and a row marked
noisy in either run (the `noisy` column: its repetitions spread too far, or other processes
competed for the processors) is marked "noisy" and never called slower or faster. Rows found in
one run only, and rows not measured (status other than ok) in either, are listed after the table.

The header shows each run's machine figures (GEMM rate and memory bandwidth measured at its
start, the load average, its duration). Two runs on a machine that was loaded differently
measure different GEMM rates; --normalize gemm compares times multiplied by each run's GEMM
rate (time x GFLOP/s = work in units of the machine's own GEMM), so a machine that was twice as
slow throughout does not read as a regression of every row.

Exit code 0, or 1 with --fail-on-regression when a row is flagged slower; 2 when a directory
cannot be read.
"""

import argparse
import difflib
import math
import sys

import numpy as np

from attnbench_results import (KEY_COLUMNS, MASK_COLUMNS, PROBLEM_COLUMNS, ResultsError,
                               format_seconds, load_meta, load_results, problem_label, run_main,
                               spec_order)

PROG = "compare.py"
SHORT = {"batch": "B", "heads": "H", "kv_heads": "G", "n": "n", "m": "m", "dim": "d", "embed": "E",
         "causal": "causal", "score": "score", "score_hidden": "h", "input": "input",
         "scale": "scale", "seed": "seed", "threads": "threads", "key_padding": "padding",
         "attn_mask": "mask", "pass": "pass", "dtype": "dtype"}


def machine(meta):
    return meta.get("machine", {}) if isinstance(meta, dict) and \
        isinstance(meta.get("machine"), dict) else {}


def gemm_rate(meta):
    """The GEMM rate (GFLOP/s) a run measured at its start, or None."""
    try:
        rate = float(machine(meta).get("gemm_gflops"))
    except (TypeError, ValueError):
        return None
    return rate if math.isfinite(rate) and rate > 0 else None


def describe(directory, meta):
    if meta is None:
        return f"{directory} (no meta.json)"
    commit = str(meta.get("git_commit", "unknown"))[:12]
    mach = machine(meta)
    cpu = mach.get("cpu_model", meta.get("cpu_model", "unknown CPU"))
    text = (f"{directory} (commit {commit}, {meta.get('date', 'unknown date')}, {cpu}, "
            f"{meta.get('threads', '?')} threads)")
    figures = []
    if gemm_rate(meta):
        figures.append(f"GEMM {gemm_rate(meta):.1f} GFLOP/s")
    if isinstance(mach.get("bandwidth_gbs"), (int, float)):
        figures.append(f"bandwidth {mach['bandwidth_gbs']:.1f} GB/s")
    loads = [meta.get(k) for k in ("load_avg_start", "load_avg_end")]
    if any(isinstance(x, (int, float)) for x in loads):
        figures.append("load average " + " -> ".join(
            f"{x:.2f}" if isinstance(x, (int, float)) else "?" for x in loads))
    if isinstance(meta.get("duration_s"), (int, float)):
        figures.append(f"took {format_seconds(meta['duration_s'])}")
    if isinstance(meta.get("rows_noisy"), int):
        figures.append(f"{meta['rows_noisy']} noisy row(s)")
    if figures:
        text += "\n   machine: " + ", ".join(figures)
    return text


def is_noisy(value):
    try:
        return float(value) == 1.0
    except (TypeError, ValueError):
        return False


def judge(a, b, min_change):
    """'slower', 'faster', '' (within the spread), 'no spread' or 'noisy' for one joined
    row."""
    if is_noisy(a["noisy"]) or is_noisy(b["noisy"]):
        return "noisy"
    if a["reps"] < 2 or b["reps"] < 2:
        return "no spread"
    ratio = b["time_median_s"] / a["time_median_s"]
    if abs(ratio - 1.0) <= min_change:
        return ""
    if b["time_min_s"] > a["time_max_s"]:
        return "slower"
    if b["time_max_s"] < a["time_min_s"]:
        return "faster"
    return ""


def typical_spread(df):
    """The median relative spread (time_max_s - time_min_s) / time_median_s of a run's ok rows
    with at least two repetitions, 0 when it has none."""
    ok = df[(df["status"] == "ok") & (df["reps"] >= 2) & (df["time_median_s"] > 0)]
    spread = ((ok["time_max_s"] - ok["time_min_s"]) / ok["time_median_s"]).to_numpy(dtype=float)
    spread = spread[np.isfinite(spread)]
    return float(np.median(spread)) if len(spread) else 0.0


def value_text(values):
    return ", ".join(str(_plain(v)) if v != "" else "(none)" for v in sorted(set(values), key=str))


def why_apart(a_only, b_only, key):
    """Lines naming the problem columns that keep the rows of a_only (in run A only) from those
    of b_only: a column whose leaving out of `key` joins rows, with the --ignore that does it,
    else the columns whose values differ between the two sides."""
    if a_only.empty or b_only.empty:
        return []
    lines = []
    for c in key:
        if c == "spec":
            continue
        rest = [k for k in key if k != c]
        joined = a_only[rest].drop_duplicates().merge(b_only[rest].drop_duplicates(), on=rest)
        if len(joined):
            lines.append(f"{len(joined)} differ from a row of the other run only in {c} (A: "
                         f"{value_text(a_only[c])}; B: {value_text(b_only[c])}): --ignore {c} "
                         f"compares them across it")
    if not lines:
        differ = [c for c in key if c != "spec" and set(a_only[c]) != set(b_only[c])]
        if differ:
            lines.append("they differ in " + "; ".join(
                f"{c} (A: {value_text(a_only[c])}; B: {value_text(b_only[c])})"
                for c in differ))
    return lines


def print_table(header, rows, out):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    numeric = [i > 0 and all(_is_number_text(r[i]) for r in rows) for i in range(len(header))]

    def line(cells):
        parts = [str(c).rjust(w) if num else str(c).ljust(w)
                 for c, w, num in zip(cells, widths, numeric)]
        return "  ".join(parts).rstrip()

    print(line(header), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print(line(r), file=out)


def _is_number_text(s):
    try:
        float(str(s).split()[0].rstrip("×"))
        return True
    except (ValueError, IndexError):
        return False


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Per-row time ratio B/A of two attnbench results directories, "
                               "with changes beyond the measured spread flagged.")
    ap.add_argument("dir_a", metavar="DIR_A", help="results directory of the first run (A)")
    ap.add_argument("dir_b", metavar="DIR_B", help="results directory of the second run (B)")
    ap.add_argument("--min-change", type=float, default=None, metavar="FRAC",
                    help="flag only changes with |B/A - 1| above FRAC as well as beyond the "
                         "spread (default: the runs' typical spread, the larger of their median "
                         "(max - min) / median over rows of 2 or more repetitions)")
    ap.add_argument("--ignore", action="append", default=[], metavar="COLUMN",
                    help="leave a problem column out of the join (repeatable or comma-separated; "
                         f"one of {', '.join(PROBLEM_COLUMNS)}), e.g. --ignore threads to compare "
                         "runs at two thread counts")
    ap.add_argument("--normalize", choices=["none", "gemm"], default="none",
                    help="gemm: compare times multiplied by each run's measured GEMM rate "
                         "(default: %(default)s)")
    ap.add_argument("--fail-on-regression", action="store_true",
                    help="exit with code 1 when a row is flagged slower")
    args = ap.parse_args()
    if args.min_change is not None and not args.min_change >= 0:
        ap.error("--min-change must be a fraction >= 0")
    ignored = []
    for word in (w.strip() for text in args.ignore for w in text.split(",")):
        if word not in PROBLEM_COLUMNS:
            close = difflib.get_close_matches(word.lower(), PROBLEM_COLUMNS, n=1)
            ap.error(f"--ignore {word}: not a problem column" +
                     (f" (did you mean {close[0]}?)" if close else "") +
                     f"; expected one of {', '.join(PROBLEM_COLUMNS)}")
        if word not in ignored:
            ignored.append(word)
    key = [c for c in KEY_COLUMNS if c not in ignored]

    a = load_results(args.dir_a)
    b = load_results(args.dir_b)
    meta_a, meta_b = load_meta(args.dir_a), load_meta(args.dir_b)
    out = sys.stdout
    print(f"A: {describe(args.dir_a, meta_a)}", file=out)
    print(f"B: {describe(args.dir_b, meta_b)}", file=out)
    scale_a = scale_b = 1.0
    if args.normalize == "gemm":
        rates = [gemm_rate(meta_a), gemm_rate(meta_b)]
        for d, rate in zip((args.dir_a, args.dir_b), rates):
            if rate is None:
                raise ResultsError(f"--normalize gemm: {d}/meta.json records no GEMM rate "
                                   f"(machine.gemm_gflops); compare without --normalize")
        # times in units of run A's machine: B's scaled by rate_B / rate_A
        scale_b = rates[1] / rates[0]
        print(f"times normalised by each run's GEMM rate: B's times x {scale_b:.3f} "
              f"({rates[1]:.1f} / {rates[0]:.1f} GFLOP/s)", file=out)
    rates_differ = gemm_rate(meta_a) and gemm_rate(meta_b) and \
        max(gemm_rate(meta_a), gemm_rate(meta_b)) > 1.25 * min(gemm_rate(meta_a),
                                                               gemm_rate(meta_b))
    if rates_differ and args.normalize == "none":
        print(f"{PROG}: warning: the two runs measured GEMM rates {gemm_rate(meta_a):.1f} and "
              f"{gemm_rate(meta_b):.1f} GFLOP/s: the machine differed (load, clock, threads); "
              f"--normalize gemm compares in units of each run's own GEMM rate",
              file=sys.stderr)

    if args.min_change is None:
        spread_a, spread_b = typical_spread(a), typical_spread(b)
        min_change = max(spread_a, spread_b)
        print(f"--min-change {min_change:.3f}: the runs' typical spread (median (max - min) / "
              f"median of a row's repetitions: A {spread_a:.3f}, B {spread_b:.3f}); "
              f"--min-change 0 judges by the spans alone", file=out)
    else:
        min_change = args.min_change
    for df, name in ((a, "A"), (b, "B")):
        dup = df.duplicated(key)
        if dup.any():
            r = df[dup].iloc[0]
            print(f"{PROG}: warning: several rows of {name} for {r['spec']} "
                  f"{problem_label(r, [c for c in PROBLEM_COLUMNS if c in key])}"
                  + (f" (with {', '.join(ignored)} ignored)" if ignored else "") +
                  "; the last one is compared", file=sys.stderr)
    a = a.drop_duplicates(key, keep="last")
    b = b.drop_duplicates(key, keep="last")
    joined = a.merge(b, on=key, how="outer", suffixes=("_a", "_b"), indicator=True)
    for c in ignored:  # an ignored column: A's value where A has the row, else B's
        joined[c] = joined[f"{c}_a"].where(joined["_merge"] != "right_only", joined[f"{c}_b"])
    both = joined[joined["_merge"] == "both"]
    measured = both[(both["status_a"] == "ok") & (both["status_b"] == "ok")]
    # one block per variant, in the order of run A, then by problem
    rank = {s: i for i, s in enumerate(spec_order(a))}
    measured = measured.assign(_rank=measured["spec"].map(rank)).sort_values(
        ["_rank", "causal", "score", "score_hidden", "input", "dim", "heads", "kv_heads", "batch", "n",
         "m"],
        kind="stable")

    # Show the problem columns that differ between rows; the others once, above the table.
    # m is left out when it equals n everywhere (self-attention).
    m_is_n = bool((joined["m"] == joined["n"]).all())
    across = [c for c in ignored
              if (both[f"{c}_a"].astype(str) != both[f"{c}_b"].astype(str)).any()]
    shown = [c for c in PROBLEM_COLUMNS
             if c == "n" or c in across or
             (joined[c].nunique() > 1 and not (c == "m" and m_is_n))]
    fixed = [c for c in PROBLEM_COLUMNS if c not in shown and c != "m" and
             not (c == "embed" and (joined[c] == 0).all()) and
             not (c in MASK_COLUMNS and (joined[c] == "").all())]
    first = joined.iloc[0]
    print("all rows: " + ", ".join((["m=n"] if m_is_n else []) +
                                   [f"{c}={_plain(first[c])}" for c in fixed]), file=out)
    print(file=out)

    rows, flags, ratios = [], [], []
    timing = ["time_median_s", "time_min_s", "time_max_s"]
    for _, r in measured.iterrows():
        ra = {k: r[f"{k}_a"] * (scale_a if k in timing else 1)
              for k in timing + ["reps", "noisy"]}
        rb = {k: r[f"{k}_b"] * (scale_b if k in timing else 1)
              for k in timing + ["reps", "noisy"]}
        ratio = rb["time_median_s"] / ra["time_median_s"]
        flag = judge(ra, rb, min_change)
        flags.append(flag)
        ratios.append(ratio)
        rows.append([r["spec"]] + [f"{_plain(r[c + '_a'])}->{_plain(r[c + '_b'])}"
                                   if c in across else _plain(r[c]) for c in shown] +
                    [format_seconds(ra["time_median_s"]), format_seconds(rb["time_median_s"]),
                     f"{ratio:.3f}", f"{1.0 / ratio:.2f}×", flag])
    header = ["variant"] + [SHORT[c] for c in shown] + ["time A", "time B", "B/A", "speed-up",
                                                        "change"]
    a_only = joined[joined["_merge"] == "left_only"]
    b_only = joined[joined["_merge"] == "right_only"]
    apart = why_apart(a_only, b_only, key)
    if rows:
        print_table(header, rows, out)
    else:
        print("No row is measured (status ok) in both runs" +
              (f": {len(a_only)} row(s) are in A only and {len(b_only)} in B only; " +
               "; ".join(apart) + "." if apart else "."), file=out)

    slower = flags.count("slower")
    faster = flags.count("faster")
    nospread = flags.count("no spread")
    noisy = flags.count("noisy")
    print(file=out)
    if ratios:
        gmean = math.exp(float(np.mean(np.log(ratios))))
        print(f"{len(ratios)} row(s) compared: {slower} slower and {faster} faster beyond the "
              f"measured spread, {len(ratios) - slower - faster - nospread - noisy} within it"
              + (f", {nospread} with a single repetition (not judged)" if nospread else "")
              + (f", {noisy} noisy in either run (not judged)" if noisy else "")
              + f"; geometric mean B/A = {gmean:.3f}"
              + (" (GEMM-normalised)" if args.normalize == "gemm" else "") + ".", file=out)

    not_measured = both[(both["status_a"] != "ok") | (both["status_b"] != "ok")]
    if not not_measured.empty:
        print(f"\nIn both runs but not measured in both ({len(not_measured)}):", file=out)
        for _, r in not_measured.iterrows():
            print(f"  {r['spec']} {problem_label(r, shown)}: A {r['status_a']}, "
                  f"B {r['status_b']}", file=out)
    for only, name in ((a_only, "A"), (b_only, "B")):
        if not only.empty:
            print(f"\nOnly in {name} ({len(only)}):", file=out)
            for _, r in only.iterrows():
                status = r["status_a" if name == "A" else "status_b"]
                print(f"  {r['spec']} {problem_label(r, shown)} ({status})", file=out)
    if rows and apart:
        print("\nRows in one run only: " + "; ".join(apart) + ".", file=out)

    if args.fail_on_regression and slower:
        print(f"{PROG}: {slower} row(s) slower beyond the measured spread", file=sys.stderr)
        return 1
    return 0


def _plain(v):
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return int(v)
    if isinstance(v, (np.integer,)):
        return int(v)
    return v


if __name__ == "__main__":
    run_main(main, PROG)
