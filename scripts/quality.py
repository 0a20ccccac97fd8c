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
    status, message, mode, batch, lr, min_distance, threads, cpu

status is `ok`, `unsupported` (the variant cannot train on the problem: its own message) or
`failed` (the training failed: the error). train_s is the training's wall time, tokens the
steps x batch x seq tokens it saw; final_loss the mean loss of the last 10% of its steps;
min_distance the fewest positions between a query and its key; cpu the processor that trained
the run (its model name), so that times are read against the machine that took them. The file
is rewritten whole after every row, and rows already there (ok or unsupported) are kept and not
run again: a run that stops resumes where it stopped (--force runs them again). The directory
is locked while the script writes (DIR/.attnbench.lock, as `attnbench sweep` takes it).

`lm`: language at a context where patterns drop keys. A base byte model (the model of
scripts/attnbench_lm.py at context --context, 2048 by default, trained by scripts/train_lm.py
for --base-steps steps with exact attention and cached in CACHE/quality/lm-C<context>/, its
validation curve copied to DIR/quality/lm_train_log.csv) has every variant swapped in for its
attention: (a) evaluated as it is, (b) uptrained from the base weights for --steps steps with
the variant in place (its learned inputs learned from a fresh start, batches of --batch x C
training bytes drawn from the seed, AdamW at a constant --lr) and evaluated again. flash is
uptrained the same way with each seed, as the baseline of (b): the extra steps lower exact
attention's loss too. Rows go to DIR/quality/lm.csv, one per (variant spec, seed):

    variant, spec, seed, context, eval_windows, base_bpb, swap_bpb, swap_delta,
    uptrain_steps, uptrain_tokens, uptrain_bpb, flash_uptrain_bpb, uptrain_delta, recovered,
    uptrain_s, status, message, checkpoint, cpu

base_bpb is the base model with its own attention (torch's softmax) on --windows held-out
windows of C bytes; swap_delta = swap_bpb - base_bpb; uptrain_delta = uptrain_bpb -
flash_uptrain_bpb; recovered = 1 - uptrain_delta / swap_delta, the share of the swap's cost
the uptraining removed (empty when the swap cost under 0.001 bits per byte). The variants of
--seeded (default flash, local, linear, performer, gla, deltanet, moba, nsa) are uptrained with
every seed of --seeds, the others with the first. Resumable as recall is; checkpoint is the
first 12 hex digits of the base model's sha256 (rows of another base model are run again).

`--shard I/N` (recall and lm): the runs of a command form a fixed, ordered list (recall: per
setting, per variant, per seed, as the rows are written; lm: flash's seeds first, then each
variant's seeds), and shard I of N runs every run whose index in that list is I modulo N (0 <=
I < N), into its own DIR. In lm, a shard that runs a variant's row of a seed also runs flash's
row of that seed first when its DIR lacks it (the row the variant's is compared with; it is
the same in every shard that runs it, from the seed). Each shard resumes as a whole run does.

`merge OUT SHARD_DIR...`: the rows of every SHARD_DIR/quality/recall.csv and lm.csv into
OUT/quality/ (with the rows already there), one row per key (the columns that identify a row:
RECALL_KEY, LM_KEY): an ok row wins over one that is not, a row repeated with the same values
(but its training time) is kept once, and of two ok rows of a key that differ the first is
kept, with a warning naming the key. lm_train_log.csv is copied too. OUT is locked while it is
written, and every file is written whole (a merge that stops leaves the earlier file).
"""

import argparse
import csv
import json
import os
import platform
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from attnbench_results import atomic_write, results_lock  # noqa: E402

PROG = "quality.py"

RECALL_COLUMNS = ["variant", "spec", "seq", "pairs", "width", "seed", "steps", "tokens",
                  "train_s", "accuracy", "final_loss", "status", "message", "mode", "batch",
                  "lr", "min_distance", "threads", "cpu"]
# the columns that identify a recall row (with the settings, the budget and the form)
RECALL_KEY = ["spec", "mode", "seq", "pairs", "width", "seed", "steps", "batch", "lr"]
DONE = ("ok", "unsupported")

# The default recall settings and budget: exact attention solves both within it, and at the
# longer one every query is farther from its key (770 positions) than two layers of the default
# local window (2 x 256) relay.
RECALL_SEQ = [128, 1024]
RECALL_PAIRS = [8]
RECALL_WIDTH = 64
RECALL_STEPS = 400
RECALL_TOKENS_PER_STEP = 4096  # the default batch: this many tokens per step, 4096 / n sequences
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


def cpu_model():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def record_run(out_dir, part, command):
    """Adds this invocation to DIR/quality/meta.json (`runs`: the part, command, host, CPU,
    threads of torch, torch's version, the OpenBLAS settings of the environment and when it
    started), so that the rows' times can be read against the machine that ran them."""
    import torch
    path = os.path.join(out_dir, "meta.json")
    meta = {}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = {}
    if not isinstance(meta, dict) or not isinstance(meta.get("runs"), list):
        meta = {"runs": []}
    meta["runs"].append({
        "part": part, "command": command, "host": socket.gethostname(),
        "cpu": cpu_model(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "environment": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                       "OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    atomic_write(path, lambda f: json.dump(meta, f, indent=1), binary=False)


def shard_arg(text):
    """--shard I/N -> (I, N): shard I (0-based) of N runs the runs whose index is I modulo N."""
    parts = text.split("/")
    try:
        if len(parts) != 2:
            raise ValueError
        index, count = int(parts[0]), int(parts[1])
    except ValueError:
        index = count = None
    if index is None or count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected I/N, shard I of N with N >= 1 and 0 <= I < N (e.g. 0/4, the "
            f"first of 4)")
    return index, count


def in_shard(runs, shard):
    """The runs of the list `runs` that shard (I, N) runs: those at an index I modulo N (every
    run without a shard)."""
    if shard is None:
        return list(runs)
    index, count = shard
    return [run for i, run in enumerate(runs) if i % count == index]


def shard_note(shard):
    return f", shard {shard[0]}/{shard[1]}" if shard else ""


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


def keep_row(rows, run, key, path, columns):
    """rows with `run` in place of a row of its key, written to path whole; returns them."""
    rows = [r for r in rows if key(r) != key(run)] + [run]
    write_rows(path, rows, columns)
    return rows


def progress(i, total, spent, label, run, ok_text):
    """The progress line of the i-th (from 0) of `total` runs, with the time left at the mean
    of the `spent` seconds so far."""
    left = total - i - 1
    eta = f", about {format_duration(spent / (i + 1) * left)} left" if left else ""
    result = ok_text() if run["status"] == "ok" else f"{run['status']}: {run['message']}"
    print(f"[{i + 1}/{total}] {label}: {result}{eta}", flush=True)


def row_key(row):
    return tuple(str(row[c]) for c in RECALL_KEY)


def format_duration(seconds):
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def training_refusal(attnbench, spec, n, causal, heads, dim):
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
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, n, dim), dtype=np.float32) for _ in range(3))
    try:
        variant.forward_train(q, k, v, causal=causal)
    except (NotImplementedError, ValueError) as e:
        return str(e)
    return None


def train_recall_run(run, causal, threads):
    """One recall run (a row of `recall`): trained, refused or failed; returns the row."""
    attnbench = import_attnbench()
    import attnbench_recall as task
    run = dict(run)
    width, steps, lr = run["width"], run["steps"], run["lr"]
    why = training_refusal(attnbench, run["spec"], run["seq"], causal,
                           width // task.HEAD_DIM, task.HEAD_DIM)
    if why is not None:
        run.update(status="unsupported", message=why)
    else:
        try:
            run.update(task.train(run["spec"], run["seq"], run["pairs"], width, run["seed"],
                                  steps, run["batch"], lr, causal=causal, threads=threads))
            run.update(status="ok", message="")
        except (NotImplementedError, ValueError, FloatingPointError, RuntimeError) as e:
            run.update(status="failed", message=f"{type(e).__name__}: {e}")
    for key in ("accuracy", "final_loss"):
        if key in run:
            run[key] = f"{run[key]:.6g}"
    if "train_s" in run:
        run["train_s"] = f"{run['train_s']:.3f}"
    run["cpu"] = cpu_model()
    return run


def _job_init(threads):
    """A recall worker: its torch threads, and quiet on Ctrl-C (the parent stops the pool)."""
    import signal
    import torch
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)


def _job_run(work):
    run, causal, threads = work
    return train_recall_run(run, causal, threads)


def pool_map(function, items, jobs, initializer, initargs):
    """function(item) of every item on `jobs` worker processes (each set up by
    initializer(*initargs)), yielded in the order they finish."""
    import multiprocessing
    # spawn: a fork of a process whose OpenMP and torch threads already run can hang
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(min(jobs, len(items)), initializer=initializer, initargs=initargs)
    try:
        yield from pool.imap_unordered(function, items)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def recall_results(pending, causal, threads, jobs):
    """The rows of the pending runs as they finish: one after the other in this process, or
    with jobs > 1 on that many worker processes (each with `threads` threads), in the order
    they finish."""
    if jobs <= 1 or len(pending) <= 1:
        for run in pending:
            yield train_recall_run(run, causal, threads)
        return
    yield from pool_map(_job_run, [(r, causal, threads) for r in pending], jobs, _job_init,
                        (threads,))


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
        record_run(out_dir, f"recall ({mode})", args.command_line)
        rows = read_rows(path)
        runs = []
        for n, p in settings:
            batch = args.batch or max(1, RECALL_TOKENS_PER_STEP // n)
            for spec in specs:
                for seed in args.seeds:
                    runs.append(dict(variant=spec.split(":")[0], spec=spec, seq=n, pairs=p,
                                     width=args.width, seed=seed, steps=args.steps,
                                     tokens=args.steps * batch * n, mode=mode,
                                     batch=batch, lr=args.lr,
                                     min_distance=task.min_distance(n, p, not causal),
                                     threads=args.threads))
        runs = in_shard(runs, args.shard)
        done = {row_key(r) for r in rows if r.get("status") in DONE}
        pending = [r for r in runs if args.force or row_key(r) not in done]
        jobs = f", {args.jobs} jobs of {args.threads} thread(s)" if args.jobs > 1 else ""
        print(f"{PROG}: recall ({mode}), {len(specs)} variant(s) x {len(settings)} setting(s) "
              f"x {len(args.seeds)} seed(s){shard_note(args.shard)}: {len(pending)} to train"
              f"{jobs}, {len(runs) - len(pending)} already in {path}", flush=True)
        start = time.perf_counter()
        for i, run in enumerate(recall_results(pending, causal, args.threads, args.jobs)):
            rows = keep_row(rows, run, row_key, path, RECALL_COLUMNS)
            progress(i, len(pending), time.perf_counter() - start,
                     f"{run['spec']} seq={run['seq']} pairs={run['pairs']} seed={run['seed']}", run,
                     lambda: f"accuracy {float(run['accuracy']):.3f}, loss "
                             f"{float(run['final_loss']):.3f}, {float(run['train_s']):.0f} s")
        print(f"{PROG}: {path}: {len(rows)} rows")
    return 0


LM_COLUMNS = ["variant", "spec", "seed", "context", "eval_windows", "base_bpb", "swap_bpb",
              "swap_delta", "uptrain_steps", "uptrain_tokens", "uptrain_bpb",
              "flash_uptrain_bpb", "uptrain_delta", "recovered", "uptrain_s", "status",
              "message", "checkpoint", "cpu"]
LM_KEY = ["spec", "seed", "context", "eval_windows", "uptrain_steps", "checkpoint"]
LM_CONTEXT = 2048
LM_BASE_STEPS = 1000
LM_BASE_BATCH = 2
LM_STEPS = 40
LM_BATCH = 2
LM_LR = 3e-4
LM_WINDOWS = 8
LM_SEEDED = ["flash", "local", "linear", "performer", "gla", "deltanet", "moba", "nsa"]


def base_model(args, log=print):
    """The base model of `lm` (trained when missing): (model, checkpoint dict, path)."""
    import attnbench_lm as lm
    import train_lm
    root = args.cache or lm.cache_root()
    name = f"lm-C{args.context}" + "".join(f"-{x.replace('=', '')}" for x in
                                            filter(None, args.base_config.split(",")))
    path = os.path.join(root, "quality", name, "model.pt")
    if not os.path.exists(path):
        log(f"{PROG}: training the base model at context {args.context} ({args.base_steps} "
            f"steps of {args.base_batch} x {args.context} bytes) into {path}")
        code = train_lm.main(["--out", path, "--steps", str(args.base_steps),
                              "--batch", str(args.base_batch),
                              "--threads", str(args.threads * args.jobs),
                              "--config", ",".join(filter(None, [f"context={args.context}",
                                                                 args.base_config])),
                              "--eval-every", "100",
                              "--attention", "flash"] +
                             (["--cache", args.cache] if args.cache else []))
        if code:
            sys.exit(f"{PROG}: training the base model failed")
    model, ckpt = lm.load_model(path)
    return model, ckpt, path


def uptrain(model, variant, train, steps, batch, lr, seed):
    """Trains `model` in place for `steps` steps with `variant` as its attention (its learned
    inputs, if any, from a fresh start); returns the seconds it took."""
    import numpy as np
    import torch
    import attnbench
    import attnbench_lm as lm
    torch.manual_seed(seed)
    if attnbench.Variant(variant).inputs:
        model.learn_inputs(variant, seed=seed)
    # every variant sees the same batches
    return lm.finetune(model, variant, train, steps, batch, lr, np.random.default_rng([seed, 2]))


def lm_shard(runs, shard):
    """The runs of `lm` that shard (I, N) runs (in_shard), with flash's run of every seed one of
    them needs (its row is the one compared with) added, and flash's runs first."""
    if shard is None:
        return runs
    mine = in_shard(runs, shard)
    seeds = {str(r["seed"]) for r in mine if r["spec"] != "flash"}
    flash = [r for r in runs if r["spec"] == "flash" and (r in mine or str(r["seed"]) in seeds)]
    return flash + [r for r in mine if r["spec"] != "flash"]


# The state of an `lm` job: the base model, the training bytes, the held-out windows and the
# variants' swapped-in bits per byte so far (in the parent process itself with --jobs 1).
_LM = {}


def _lm_state(base, cache, windows):
    """The state of an `lm` job around its base model: training bytes, held-out windows."""
    import attnbench_lm as lm
    train_path, valid_path = lm.fetch_corpus(cache or lm.cache_root())
    return dict(base=base, train=lm.read_bytes(train_path), swap={},
                batches=list(lm.windows(lm.read_bytes(valid_path), base.cfg["context"],
                                        windows).split(1)))


def _lm_init(ckpt_path, cache, windows, threads):
    """A worker process's _LM: the base model loaded from ckpt_path."""
    import signal
    import torch
    import attnbench_lm as lm
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    base, _ = lm.load_model(ckpt_path)
    _LM.clear()
    _LM.update(_lm_state(base, cache, windows))


def lm_run(work):
    """One row of `lm`: the variant swapped into the base model and evaluated, then uptrained
    and evaluated again (flash_bpb: flash's uptrained bits per byte of the seed, None for
    flash itself); returns the row."""
    import copy
    import attnbench_lm as lm
    attnbench = import_attnbench()
    run, flash_bpb, (steps, batch, lr) = work
    run = dict(run, cpu=cpu_model())
    base, batches, swap = _LM["base"], _LM["batches"], _LM["swap"]
    spec, base_bpb = run["spec"], float(run["base_bpb"])
    why = training_refusal(attnbench, spec, base.cfg["context"], True, base.cfg["heads"],
                           base.cfg["head_dim"])
    try:
        if why is not None:
            raise NotImplementedError(why)
        if spec not in swap:
            swap[spec] = lm.bits_per_byte(base, batches, attnbench.Variant(spec))
        run["swap_bpb"] = f"{swap[spec]:.6f}"
        run["swap_delta"] = f"{swap[spec] - base_bpb:.6f}".replace("-0.000000", "0.000000")
        if spec != "flash" and flash_bpb is None:
            raise RuntimeError(f"no flash row of seed {run['seed']} to compare with")
        model = copy.deepcopy(base)
        seconds = uptrain(model, spec, _LM["train"], steps, batch, lr, run["seed"])
        run["uptrain_s"] = f"{seconds:.3f}"
        up = lm.bits_per_byte(model, batches, spec)
        ref = up if spec == "flash" else flash_bpb
        run["uptrain_bpb"] = f"{up:.6f}"
        run["flash_uptrain_bpb"] = f"{ref:.6f}"
        run["uptrain_delta"] = f"{up - ref:.6f}"
        gap = swap[spec] - base_bpb
        run["recovered"] = f"{1 - (up - ref) / gap:.4f}" if gap >= 1e-3 else ""
        run.update(status="ok", message="")
    except NotImplementedError as e:
        run.update(status="unsupported", message=str(e))
    except (ValueError, FloatingPointError, RuntimeError) as e:
        run.update(status="failed", message=f"{type(e).__name__}: {e}")
    return run


def lm_results(work, setup, jobs, state):
    """The rows of the `work` items (lm_run's) as they finish: in this process (its _LM the
    `state` of _lm_state), or with jobs > 1 on that many worker processes, each set up by
    _lm_init(*setup)."""
    if jobs <= 1 or len(work) <= 1:
        _LM.clear()
        _LM.update(state)
        for item in work:
            yield lm_run(item)
        return
    yield from pool_map(lm_run, work, jobs, _lm_init, setup)


def language(args):
    attnbench = import_attnbench()
    import torch
    import attnbench_lm as lm
    specs = args.variant or default_recall_variants(attnbench, False)
    for spec in specs:
        try:
            attnbench.Variant(spec)
        except ValueError as e:
            sys.exit(f"{PROG}: --variant {spec}: {e}")
    torch.set_num_threads(args.threads)
    out_dir = os.path.join(args.out, "quality")
    path = os.path.join(out_dir, "lm.csv")
    with results_lock(args.out, PROG):
        os.makedirs(out_dir, exist_ok=True)
        record_run(out_dir, "lm", args.command_line)
        base, ckpt, ckpt_path = base_model(args)
        sha = lm.sha256_file(ckpt_path)[:12]
        curve = os.path.join(os.path.dirname(ckpt_path), "train_log.csv")
        if os.path.exists(curve):
            with open(curve, "rb") as f:
                data = f.read()
            atomic_write(os.path.join(out_dir, "lm_train_log.csv"), lambda f: f.write(data))
        C = base.cfg["context"]
        state = _lm_state(base, args.cache, args.windows)
        batches = state["batches"]
        rows = read_rows(path)
        seeded = set(args.seeded)
        runs = []
        for spec in (["flash"] if "flash" not in specs else []) + specs:
            for seed in (args.seeds if spec.split(":")[0] in seeded or spec == "flash"
                         else args.seeds[:1]):
                runs.append(dict(variant=spec.split(":")[0], spec=spec, seed=seed, context=C,
                                 eval_windows=args.windows, uptrain_steps=args.steps,
                                 uptrain_tokens=args.steps * args.batch * C, checkpoint=sha))
        runs = lm_shard(runs, args.shard)
        key = lambda r: tuple(str(r[c]) for c in LM_KEY)  # noqa: E731
        done = {key(r): r for r in rows if r.get("status") in DONE}
        pending = [r for r in runs if args.force or key(r) not in done]
        print(f"{PROG}: lm at context {C}, {len(specs)} variant(s){shard_note(args.shard)}: "
              f"{len(pending)} run(s) to do, "
              f"{len(runs) - len(pending)} already in {path}", flush=True)
        base_bpb = lm.bits_per_byte(base, batches, None)
        setup = (ckpt_path, args.cache, args.windows, args.threads)
        budget = (args.steps, args.batch, args.lr)
        jobs = min(args.jobs, len(pending))
        if jobs > 1:
            print(f"{PROG}: {jobs} jobs of {args.threads} thread(s)", flush=True)
        start, done_count = time.perf_counter(), 0
        # flash's rows first: every other row of a seed is compared with flash's
        for phase in ([r for r in pending if r["spec"] == "flash"],
                      [r for r in pending if r["spec"] != "flash"]):
            work = []
            for run in phase:
                flash = [r for r in rows if r["spec"] == "flash" and str(r["seed"]) ==
                         str(run["seed"]) and key(r)[2:] == key(run)[2:] and
                         r.get("status") == "ok"]
                run = dict(run, base_bpb=f"{base_bpb:.6f}")
                work.append((run, float(flash[0]["uptrain_bpb"]) if flash else None, budget))
            for run in lm_results(work, setup, jobs, state):
                rows = keep_row(rows, run, key, path, LM_COLUMNS)
                progress(done_count, len(pending), time.perf_counter() - start,
                         f"{run['spec']} seed={run['seed']}", run,
                         lambda: f"swap {float(run['swap_delta']):+.4f}, uptrained "
                                 f"{float(run['uptrain_delta']):+.4f} bits per byte")
                done_count += 1
        print(f"{PROG}: {path}: {len(rows)} rows")
    return 0


# the parts `merge` collects: file, its columns, the columns that identify a row, and those
# that differ between two runs of the same row (its wall time and the processor that took it)
MERGED_PARTS = [("recall.csv", RECALL_COLUMNS, RECALL_KEY, ("train_s", "cpu")),
                ("lm.csv", LM_COLUMNS, LM_KEY, ("uptrain_s", "cpu"))]
STATUS_RANK = {"ok": 0, "unsupported": 1, "failed": 2}


def merge_rows(sources, columns, key_columns, timing, warn):
    """The rows of `sources` (a list of (name, rows)), one per key: the first row of a key,
    unless a later one has a better status (ok, then unsupported, then failed); two ok rows of
    a key that differ but in the `timing` columns keep the first, and warn(message) names the
    key. Returns (rows, columns, duplicates): columns are `columns` and any others the rows
    hold, duplicates the count of rows left out."""
    merged, where, extra = {}, {}, []
    duplicates = 0
    rank = lambda r: STATUS_RANK.get(r.get("status"), 3)  # noqa: E731
    for name, rows in sources:
        for row in rows:
            for c in row:
                if c is not None and c not in columns and c not in extra:
                    extra.append(c)
            key = tuple(str(row[c]) for c in key_columns)
            if key not in merged:
                merged[key], where[key] = row, name
                continue
            duplicates += 1
            old = merged[key]
            if rank(row) < rank(old):
                merged[key], where[key] = row, name
            elif rank(row) == rank(old) == 0:
                differ = [c for c in set(old) | set(row)
                          if c not in timing and old.get(c, "") != row.get(c, "")]
                if differ:
                    named = ", ".join(f"{c}={v}" for c, v in zip(key_columns, key))
                    warn(f"{name} and {where[key]} hold different ok rows of {named} "
                         f"(differing in {', '.join(sorted(differ))}): the row of {where[key]} "
                         f"is kept")
    return list(merged.values()), columns + extra, duplicates


def merge(args):
    """`merge OUT SHARD_DIR...`: the shards' quality rows into OUT/quality."""
    out = os.path.abspath(args.out)
    for d in args.shards:
        if not os.path.isdir(d):
            sys.exit(f"{PROG}: merge: {d} is not a directory; expected the results directory "
                     f"of a shard (it holds quality/recall.csv or quality/lm.csv)")
        if os.path.abspath(d) == out:
            sys.exit(f"{PROG}: merge: {d} is OUT itself; OUT must be another directory (its "
                     f"rows are kept and merged with the shards')")
    found = [d for d in args.shards
             if any(os.path.exists(os.path.join(d, "quality", f)) for f, *_ in MERGED_PARTS)]
    if not found:
        sys.exit(f"{PROG}: merge: none of the {len(args.shards)} directories holds "
                 f"quality/recall.csv or quality/lm.csv")
    for d in sorted(set(args.shards) - set(found)):
        print(f"{PROG}: merge: warning: {d} holds no quality rows", file=sys.stderr)

    def warn(message):
        print(f"{PROG}: merge: warning: {message}", file=sys.stderr)

    out_dir = os.path.join(args.out, "quality")
    with results_lock(args.out, PROG):
        os.makedirs(out_dir, exist_ok=True)
        for name, columns, key_columns, timing in MERGED_PARTS:
            path = os.path.join(out_dir, name)
            sources = []
            for d in [out_dir] + [os.path.join(d, "quality") for d in found]:
                part = os.path.join(d, name)
                if not os.path.exists(part):
                    continue
                rows = read_rows(part)
                missing = [c for c in key_columns if rows and c not in rows[0]]
                if missing:
                    sys.exit(f"{PROG}: merge: {part} lacks the column(s) {', '.join(missing)} "
                             f"of a {name} row's key ({', '.join(key_columns)})")
                sources.append((part, rows))
            if len(sources) == (1 if os.path.exists(path) else 0):
                continue  # no shard holds this part: OUT's file, if any, stays as it is
            rows, header, duplicates = merge_rows(sources, columns, key_columns, timing, warn)
            write_rows(path, rows, header)
            counts = {}
            for r in rows:
                counts[r.get("status", "")] = counts.get(r.get("status", ""), 0) + 1
            statuses = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            print(f"{PROG}: merge: {path}: {len(rows)} rows ({statuses}) from "
                  f"{len(sources)} file(s), {duplicates} duplicate(s) left out")
        logs = [os.path.join(d, "quality", "lm_train_log.csv") for d in found]
        logs = [f for f in logs if os.path.exists(f)]
        if logs:
            with open(logs[0], "rb") as f:
                data = f.read()
            for other in logs[1:]:
                with open(other, "rb") as f:
                    if f.read() != data:
                        warn(f"{other} differs from {logs[0]} (another base model?): the "
                             f"training curve of {logs[0]} is kept")
            atomic_write(os.path.join(out_dir, "lm_train_log.csv"), lambda f: f.write(data))
        merge_meta(out_dir, [os.path.join(d, "quality") for d in found])
    return 0


def read_meta_runs(quality_dir):
    try:
        with open(os.path.join(quality_dir, "meta.json"), encoding="utf-8") as f:
            runs = json.load(f).get("runs")
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def merge_meta(out_dir, shard_dirs):
    """OUT/quality/meta.json lists the invocations recorded in OUT and in every shard (each
    once), so the merged rows keep the record of the machines that trained them."""
    runs = read_meta_runs(out_dir)
    seen = {json.dumps(r, sort_keys=True) for r in runs}
    for d in shard_dirs:
        for r in read_meta_runs(d):
            text = json.dumps(r, sort_keys=True)
            if text not in seen:
                seen.add(text)
                runs.append(r)
    runs.sort(key=lambda r: str(r.get("started", "")))
    atomic_write(os.path.join(out_dir, "meta.json"),
                 lambda f: json.dump({"runs": runs}, f, indent=1), binary=False)


def parallel_options(parser, jobs_are, more):
    parser.add_argument("--threads", type=int, default=2,
                        help="threads (of each job with --jobs; default 2)")
    parser.add_argument("--jobs", type=int, default=1, metavar="J",
                        help=f"{jobs_are}, each in a process of its own with --threads threads "
                             f"(default 1; {more})")


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  quality.py recall --out results/q\n"
               "  quality.py recall --variant flash --variant local --seeds 3 --out results/q\n"
               "  quality.py recall --bidirectional --out results/q\n"
               "  quality.py lm --out results/q\n"
               "  quality.py recall --shard 0/4 --out results/q-0\n"
               "  quality.py merge results/q results/q-0 results/q-1 results/q-2 results/q-3")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{recall,lm,merge}")
    shard_help = ("run shard I (0-based) of N: the runs at an index I modulo N of the command's "
                  "ordered list of runs (see above)")
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
    r.add_argument("--batch", type=int, default=None,
                   help=f"sequences per step (default {RECALL_TOKENS_PER_STEP} / n: "
                        f"{RECALL_TOKENS_PER_STEP} tokens per step at every length)")
    r.add_argument("--lr", type=float, default=RECALL_LR,
                   help=f"learning rate (default {RECALL_LR})")
    parallel_options(r, "runs trained at once", "on a machine of C cores, --jobs C "
                     "--threads 1 trains these small models fastest")
    r.add_argument("--bidirectional", action="store_true",
                   help="every position sees the whole sequence (the encoder-only variants)")
    r.add_argument("--force", action="store_true", help="train again rows already done")
    r.add_argument("--shard", type=shard_arg, metavar="I/N", help=shard_help)
    r.add_argument("--out", required=True, metavar="DIR",
                   help="results directory (writes DIR/quality/recall.csv)")
    m = sub.add_parser("lm", help="a byte language model with each variant swapped in, "
                       "before and after uptraining", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--variant", action="append", metavar="SPEC",
                   help="a variant spec (repeatable; default: every variant that can be causal)")
    m.add_argument("--seeds", type=seeds_arg, default=list(range(RECALL_SEEDS)),
                   metavar="K|S,S...", help="uptraining seeds of the --seeded variants "
                                            f"(default {RECALL_SEEDS}); the others take the first")
    m.add_argument("--seeded", type=lambda t: [x for x in t.split(",") if x],
                   default=LM_SEEDED, metavar="NAME,...",
                   help=f"variants uptrained with every seed (default {','.join(LM_SEEDED)})")
    m.add_argument("--steps", type=int, default=LM_STEPS,
                   help=f"uptraining steps (default {LM_STEPS})")
    m.add_argument("--batch", type=int, default=LM_BATCH,
                   help=f"uptraining sequences per step (default {LM_BATCH})")
    m.add_argument("--lr", type=float, default=LM_LR,
                   help=f"uptraining learning rate (default {LM_LR})")
    m.add_argument("--context", type=int, default=LM_CONTEXT,
                   help=f"the base model's context (default {LM_CONTEXT})")
    m.add_argument("--base-steps", type=int, default=LM_BASE_STEPS,
                   help=f"the base model's training steps (default {LM_BASE_STEPS})")
    m.add_argument("--base-batch", type=int, default=LM_BASE_BATCH,
                   help=f"the base model's sequences per step (default {LM_BASE_BATCH})")
    m.add_argument("--base-config", default="", metavar="KEY=N,...",
                   help="the base model's other settings (train_lm.py --config: layers, heads, "
                        "head_dim, width, mlp); default the model of attnbench_lm.py")
    m.add_argument("--windows", type=int, default=LM_WINDOWS,
                   help=f"held-out windows of C bytes evaluated (default {LM_WINDOWS})")
    parallel_options(m, "rows uptrained at once", "flash's rows first, as every other row of "
                     "a seed is compared with flash's; a missing base model trains on J x "
                     "--threads threads")
    m.add_argument("--cache", help="cache root (default: ATTNBENCH_CACHE, "
                   "$XDG_CACHE_HOME/attnbench or ~/.cache/attnbench)")
    m.add_argument("--force", action="store_true", help="run again rows already done")
    m.add_argument("--shard", type=shard_arg, metavar="I/N",
                   help=shard_help + "; a variant's shard runs flash's row of its seed too")
    m.add_argument("--out", required=True, metavar="DIR",
                   help="results directory (writes DIR/quality/lm.csv)")
    g = sub.add_parser("merge", help="the quality rows of shards' directories in one",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("out", metavar="OUT",
                   help="the merged results directory (writes OUT/quality/; its rows are kept)")
    g.add_argument("shards", nargs="+", metavar="SHARD_DIR",
                   help="a shard's results directory (reads SHARD_DIR/quality/recall.csv, "
                        "lm.csv and lm_train_log.csv)")
    args = ap.parse_args(argv)
    # the command line as meta.json records it
    words = sys.argv if argv is None else [os.path.join(HERE, "quality.py"), *argv]
    args.command_line = " ".join(words)
    if args.command == "merge":
        return merge(args)
    if args.command == "lm":
        for name in ("steps", "batch", "context", "base_steps", "base_batch", "windows",
                     "threads", "jobs"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 < args.lr < 1:
            ap.error("--lr must be in (0, 1)")
        return language(args)
    if args.command == "recall":
        if (args.steps < 1 or (args.batch or 1) < 1 or args.threads < 1 or args.jobs < 1 or
                not 0 < args.lr < 1):
            ap.error("--steps, --batch, --threads and --jobs must be at least 1, --lr in (0, 1)")
        return recall(args)
    return 2


if __name__ == "__main__":
    from attnbench_results import run_main
    run_main(main, PROG)
