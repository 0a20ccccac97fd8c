#!/usr/bin/env python3
"""What a mechanism costs in quality: every variant trained on a task that needs what it may
drop, at one budget for all, over seeds.

    PYTHONPATH=build/python /usr/bin/python3 scripts/quality.py recall --out DIR
    PYTHONPATH=build/python /usr/bin/python3 scripts/quality.py recall --bidirectional --out DIR

`recall`: multi-query associative recall (scripts/attnbench_recall.py describes the task and
the model). A small model is trained from scratch per (variant, setting, seed), with every
attention the variant and its learned inputs learned, for --steps steps of --batch sequences
(the same budget for every variant), then its accuracy is measured on 256 held-out sequences.
A setting is one (--seq, --pairs) pair of the lists given (every combination). Default
variants: every variant that can be causal; with --bidirectional (every position sees the whole
sequence, the answer is never visible at the query) those that cannot, non-causal sinkhorn, and
flash beside them. Rows go to DIR/quality/recall.csv, one per (variant spec, form, setting,
seed, budget):

    variant, spec, seq, pairs, width, seed, steps, tokens, train_s, accuracy, final_loss,
    status, message, mode, batch, lr, min_distance, threads

status is `ok`, `unsupported` (the variant cannot train on the problem: its own message) or
`failed` (the training failed: the error). train_s is the training's wall time, tokens the
steps x batch x seq tokens it saw; final_loss the mean loss of the last 10% of its steps;
min_distance the fewest positions between a query and its key. The file is rewritten whole
after every row, and rows already there (ok or unsupported) are kept and not run again: a run
that stops resumes where it stopped (--force runs them again). The directory is locked while
the script writes (DIR/.attnbench.lock, as `attnbench sweep` takes it).
"""

import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnbench_results import atomic_write, results_lock  # noqa: E402

PROG = "quality.py"

RECALL_COLUMNS = ["variant", "spec", "seq", "pairs", "width", "seed", "steps", "tokens",
                  "train_s", "accuracy", "final_loss", "status", "message", "mode", "batch",
                  "lr", "min_distance", "threads"]
# the columns that identify a recall row (with the settings, the budget and the form)
RECALL_KEY = ["spec", "mode", "seq", "pairs", "width", "seed", "steps", "batch", "lr"]
DONE = ("ok", "unsupported")

# The default recall settings and budget: exact attention solves both within it, and at the
# longer one every query is farther from its key (258 positions) than the default local
# window (256) reaches.
RECALL_SEQ = [128, 512]
RECALL_PAIRS = [8]
RECALL_WIDTH = 64
RECALL_STEPS = 400
RECALL_BATCH = 16
RECALL_LR = 3e-3
RECALL_SEEDS = 3


def int_list(text):
    """'128,512' -> [128, 512], with k for 1024 (1k = 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            value = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers separated "
                                             f"by commas (e.g. 128,512 or 1k)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: {value} is not positive")
        out.append(value)
    return out


def seeds_arg(text):
    """--seeds 3 (seeds 0, 1, 2) or --seeds 4,7 (those)."""
    values = int_list(text) if "," in text else None
    if values is not None:
        return values
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a count (3: seeds 0, 1, 2) or a list of "
                                         f"seeds (0,5,9)") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one seed")
    return list(range(count))


def import_attnbench():
    try:
        import attnbench
        import attnbench.torch  # noqa: F401
    except ImportError as e:
        sys.exit(f"{PROG}: the attnbench Python module is not importable ({e}): build with "
                 f"-DATTNBENCH_PYTHON=ON and put build/python on PYTHONPATH")
    return attnbench


def default_recall_variants(attnbench, bidirectional):
    listed = [v for v in attnbench.variants() if not v.get("plugin")]
    if not bidirectional:
        return [v["name"] for v in listed if v["causal"]]
    names = ["flash"] + [v["name"] for v in listed if not v["causal"]]
    if any(v["name"] == "sinkhorn" for v in listed):
        names.append("sinkhorn")
    return names


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def write_rows(path, rows, columns):
    def write(f):
        w = csv.DictWriter(f, fieldnames=columns, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    atomic_write(path, write, binary=False)


def row_key(row):
    return tuple(str(row[c]) for c in RECALL_KEY)


def format_duration(seconds):
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def training_refusal(attnbench, spec, n, causal, width):
    """Why the variant cannot train on this problem (no backward, a refused shape), or None."""
    import numpy as np
    try:
        variant = attnbench.Variant(spec)
    except ValueError as e:
        return str(e)
    info = {v["name"]: v for v in attnbench.variants()}.get(variant.name, {})
    if not info.get("backward", False):
        return f"{variant.name} has no backward pass, so it cannot be trained"
    if causal and not info.get("causal", False):
        return f"{variant.name} cannot be causal (it attends every key); --bidirectional runs it"
    heads = width // 32
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, n, 32), dtype=np.float32) for _ in range(3))
    try:
        variant.forward_train(q, k, v, causal=causal)
    except (NotImplementedError, ValueError) as e:
        return str(e)
    return None


def recall(args):
    attnbench = import_attnbench()
    import torch
    import attnbench_recall as task
    causal = not args.bidirectional
    mode = "bidirectional" if args.bidirectional else "causal"
    specs = args.variant or default_recall_variants(attnbench, args.bidirectional)
    for spec in specs:  # a misspelt spec is refused before anything runs
        try:
            attnbench.Variant(spec)
        except ValueError as e:
            sys.exit(f"{PROG}: --variant {spec}: {e}")
    settings = []
    for n in args.seq:
        for p in args.pairs:
            try:
                task.query_count(n, p)
            except ValueError as e:
                sys.exit(f"{PROG}: {e}")
            settings.append((n, p))
    if args.width < 32 or args.width % 32:
        sys.exit(f"{PROG}: --width {args.width}: a positive multiple of 32 (heads of dimension "
                 f"32)")
    torch.set_num_threads(args.threads)
    out_dir = os.path.join(args.out, "quality")
    path = os.path.join(out_dir, "recall.csv")
    with results_lock(args.out, PROG):
        os.makedirs(out_dir, exist_ok=True)
        rows = read_rows(path)
        runs = []
        for n, p in settings:
            for spec in specs:
                for seed in args.seeds:
                    runs.append(dict(variant=spec.split(":")[0], spec=spec, seq=n, pairs=p,
                                     width=args.width, seed=seed, steps=args.steps,
                                     tokens=args.steps * args.batch * n, mode=mode,
                                     batch=args.batch, lr=args.lr,
                                     min_distance=task.min_distance(n, p),
                                     threads=args.threads))
        done = {row_key(r) for r in rows if r.get("status") in DONE}
        todo = [r for r in runs if args.force or row_key(r) not in done]
        print(f"{PROG}: recall ({mode}), {len(specs)} variant(s) x {len(settings)} setting(s) "
              f"x {len(args.seeds)} seed(s): {len(todo)} to train, "
              f"{len(runs) - len(todo)} already in {path}", flush=True)
        spent = 0.0
        for i, run in enumerate(todo):
            start = time.perf_counter()
            why = training_refusal(attnbench, run["spec"], run["seq"], causal, args.width)
            if why is not None:
                run.update(status="unsupported", message=why)
            else:
                try:
                    run.update(task.train(run["spec"], run["seq"], run["pairs"], args.width,
                                          run["seed"], args.steps, args.batch, args.lr,
                                          causal=causal, threads=args.threads))
                    run.update(status="ok", message="")
                except (NotImplementedError, ValueError, FloatingPointError,
                        RuntimeError) as e:
                    run.update(status="failed", message=f"{type(e).__name__}: {e}")
            for key in ("accuracy", "final_loss"):
                if key in run:
                    run[key] = f"{run[key]:.6g}"
            if "train_s" in run:
                run["train_s"] = f"{run['train_s']:.3f}"
            rows = [r for r in rows if row_key(r) != row_key(run)] + [run]
            write_rows(path, rows, RECALL_COLUMNS)
            spent += time.perf_counter() - start
            left = len(todo) - i - 1
            eta = f", about {format_duration(spent / (i + 1) * left)} left" if left else ""
            result = (f"accuracy {float(run['accuracy']):.3f}, loss "
                      f"{float(run['final_loss']):.3f}, {float(run['train_s']):.0f} s"
                      if run["status"] == "ok" else f"{run['status']}: {run['message']}")
            print(f"[{i + 1}/{len(todo)}] {run['spec']} seq={run['seq']} pairs={run['pairs']} "
                  f"seed={run['seed']}: {result}{eta}", flush=True)
        print(f"{PROG}: {path}: {len(rows)} rows")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  quality.py recall --out results/q\n"
               "  quality.py recall --variant flash --variant local --seeds 3 --out results/q\n"
               "  quality.py recall --bidirectional --out results/q")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{recall}")
    r = sub.add_parser("recall", help="multi-query associative recall, trained per variant",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--variant", action="append", metavar="SPEC",
                   help="a variant spec (repeatable; default: every variant that can be "
                        "causal, or with --bidirectional those that cannot, non-causal sinkhorn "
                        "and flash)")
    r.add_argument("--seq", type=int_list, default=RECALL_SEQ, metavar="N[,N...]",
                   help=f"sequence lengths (default {','.join(map(str, RECALL_SEQ))})")
    r.add_argument("--pairs", type=int_list, default=RECALL_PAIRS, metavar="P[,P...]",
                   help=f"key-value pairs per sequence (default "
                        f"{','.join(map(str, RECALL_PAIRS))})")
    r.add_argument("--width", type=int, default=RECALL_WIDTH,
                   help=f"model width, a multiple of 32 (default {RECALL_WIDTH})")
    r.add_argument("--seeds", type=seeds_arg, default=list(range(RECALL_SEEDS)),
                   metavar="K|S,S...", help=f"a count (seeds 0..K-1) or a list (default "
                                            f"{RECALL_SEEDS})")
    r.add_argument("--steps", type=int, default=RECALL_STEPS,
                   help=f"training steps (default {RECALL_STEPS})")
    r.add_argument("--batch", type=int, default=RECALL_BATCH,
                   help=f"sequences per step (default {RECALL_BATCH})")
    r.add_argument("--lr", type=float, default=RECALL_LR,
                   help=f"learning rate (default {RECALL_LR})")
    r.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    r.add_argument("--bidirectional", action="store_true",
                   help="every position sees the whole sequence (the encoder-only variants)")
    r.add_argument("--force", action="store_true", help="train again rows already done")
    r.add_argument("--out", required=True, metavar="DIR",
                   help="results directory (writes DIR/quality/recall.csv)")
    args = ap.parse_args(argv)
    if args.command == "recall":
        if args.steps < 1 or args.batch < 1 or args.threads < 1 or not 0 < args.lr < 1:
            ap.error("--steps, --batch and --threads must be at least 1, --lr in (0, 1)")
        return recall(args)
    return 2


if __name__ == "__main__":
    from attnbench_results import run_main
    run_main(main, PROG)
