#!/usr/bin/env python3
"""What swapping an attnbench variant into the trained model costs: the validation bits per
byte of scripts/train_lm.py's model with every layer's attention replaced by one variant at its
defaults (causal), its increase over exact attention, and the time.

Writes DIR/trained/swap.csv, one row per variant (status `ok`, or `unsupported` with the
variant's own refusal), and DIR/trained/train_log.csv and model.json (the training curve and
the checkpoint's description, for the report). The baseline is the model's own exact
attention in torch; `flash` (exact) must reproduce it.

    PYTHONPATH=build/python /usr/bin/python3 scripts/swap_eval.py DIR [--windows K]

Columns of swap.csv: variant, spec (what ran: the variant's name, so its defaults), status,
message, n (= C), windows, tokens, bpb, delta_bpb (bpb minus exact attention's),
attention_s_per_token (the variant's attention calls, all layers, per evaluated token),
eval_s_per_token (the whole model's forward), speedup (flash's attention time over the
variant's), threads.

DIR is locked while the script evaluates and writes (DIR/.attnbench.lock, the lock of
`attnbench sweep`): another process writing it is refused, naming the holder. Every file is
written whole or not at all (a temporary file renamed over the old one); a write that fails
leaves the earlier file and exits with status 2.

With --finetune-steps S, the --finetune-top K variants with the largest increase (and
`flash`, the exact baseline) are each fine-tuned for S steps with the variant in place,
through its own backward pass (batches of 4 × C training bytes drawn from the seed, AdamW at
a constant --finetune-lr), and evaluated again: ft_bpb, ft_delta_bpb (against flash
fine-tuned the same way, since the extra steps also lower exact attention's loss) and
recovered (the share of the increase the fine-tuning removed: 1 − ft_delta_bpb / delta_bpb).
"""

import argparse
import csv
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnbench_lm as lm  # noqa: E402
from attnbench_results import atomic_write, atomic_write_bytes, results_lock  # noqa: E402

PROG = "swap_eval.py"

EXACT = "exact"  # the row of the model's own attention (torch)


class Timed:
    """Runs one attention (a variant, or None for torch's) and adds up its time."""

    def __init__(self, variant, threads):
        self.variant, self.threads, self.seconds = variant, threads, 0.0

    def attend(self, q, k, v):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        start = time.perf_counter()
        if self.variant is None:
            out = lm.exact_attention(q, k, v)
        else:
            import attnbench.torch
            out = attnbench.torch.attention(self.variant, q, k, v, causal=True,
                                            threads=self.threads)
        self.seconds += time.perf_counter() - start
        return out


def evaluate(model, batches, variant, threads):
    timer = Timed(variant, threads)
    start = time.perf_counter()
    bpb = lm.bits_per_byte(model, batches, timer)
    total = time.perf_counter() - start
    tokens = sum(b[:, 1:].numel() for b in batches)
    return bpb, timer.seconds / tokens, total / tokens


def refusal(attnbench, name, cfg, n):
    """The variant's error on a causal problem of the model's shape, or None."""
    rng = np.random.default_rng(0)
    shape = (1, cfg["heads"], n, cfg["head_dim"])
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    try:
        attnbench.attention(name, q, k, v, causal=True)
    except Exception as e:  # the binding raises ValueError/NotImplementedError with the reason
        return str(e)
    return None


def finetune(args, attnbench, ckpt_path, root, batches, rows):
    """Fine-tunes a copy of the model with each chosen variant in place (see the module's
    docstring) and adds ft_* and recovered to its row."""
    backward = {v["name"] for v in attnbench.variants() if v["backward"]}
    harmful = sorted((r for r in rows if r["status"] == "ok" and r["variant"] in backward
                      and r["spec"] != "flash" and r["delta_bpb"] > 0),
                     key=lambda r: -r["delta_bpb"])[:args.finetune_top]
    chosen = [r for r in rows if r["spec"] == "flash" and r["status"] == "ok"] + harmful
    if not chosen or chosen[0]["spec"] != "flash":
        print("swap_eval.py: no flash row, so no fine-tuning baseline", file=sys.stderr)
        return
    train_path, _ = lm.fetch_corpus(root)
    train = lm.read_bytes(train_path)
    for r in chosen:
        model, _ = lm.load_model(ckpt_path)
        variant = attnbench.Variant(r["spec"])
        # every variant sees the same batches
        lm.finetune(model, variant, train, args.finetune_steps, 4, args.finetune_lr,
                    np.random.default_rng(args.seed))
        r["ft_steps"] = args.finetune_steps
        r["ft_bpb"] = lm.bits_per_byte(model, batches, variant)
        base = chosen[0]["ft_bpb"]
        r["ft_delta_bpb"] = r["ft_bpb"] - base
        if r["spec"] != "flash":
            r["recovered"] = 1.0 - r["ft_delta_bpb"] / r["delta_bpb"]
        print(f"  fine-tuned {r['spec']:20s} {r['ft_bpb']:.5f} bits per byte "
              f"({r['ft_delta_bpb']:+.5f} over flash fine-tuned)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="results directory (writes DIR/trained/)")
    ap.add_argument("--cache", help="cache root (default: ATTNBENCH_CACHE, "
                    "$XDG_CACHE_HOME/attnbench or ~/.cache/attnbench)")
    ap.add_argument("--checkpoint", help="model file (default CACHE/trained/model.pt)")
    ap.add_argument("--windows", type=int, default=16,
                    help="held-out windows of C bytes evaluated (default 16)")
    ap.add_argument("--variants", default="",
                    help="comma-separated variants or specs (default: every variant)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--finetune-steps", type=int, default=0,
                    help="fine-tune steps with the variant in place (default 0: none)")
    ap.add_argument("--finetune-top", type=int, default=4,
                    help="how many of the most harmful variants are fine-tuned (default 4)")
    ap.add_argument("--finetune-lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0, help="seed of the fine-tuning batches")
    ap.add_argument("--force", action="store_true",
                    help="evaluate again even if swap.csv exists for this checkpoint")
    args = ap.parse_args(argv)
    if args.windows < 1 or args.threads < 1:
        ap.error("--windows and --threads must be at least 1")
    if args.finetune_steps < 0 or args.finetune_top < 0 or not 0 < args.finetune_lr < 1:
        ap.error("--finetune-steps and --finetune-top must be >= 0, --finetune-lr in (0, 1)")
    try:
        import attnbench
    except ImportError as e:
        raise lm.CacheError(f"the attnbench Python module is not importable ({e}): build with "
                            f"-DATTNBENCH_PYTHON=ON and put build/python on PYTHONPATH")
    root = args.cache or lm.cache_root()
    ckpt_path = args.checkpoint or lm.checkpoint_path(root)
    model, ckpt = lm.load_model(ckpt_path)
    sha = lm.sha256_file(ckpt_path)
    # the results directory's lock from here to the last file written, as `attnbench sweep`
    # takes it: a second writer of the directory is refused, naming this one
    with results_lock(args.dir, PROG):
        return evaluate_into(args, attnbench, model, ckpt, ckpt_path, sha, root)


def evaluate_into(args, attnbench, model, ckpt, ckpt_path, sha, root):
    """Evaluates the variants and writes DIR/trained/ (swap.csv, train_log.csv, model.json)."""
    out_dir = os.path.join(args.dir, "trained")
    out = os.path.join(out_dir, "swap.csv")
    info_path = os.path.join(out_dir, "model.json")
    # the variants as evaluated: with the default (every variant), one registered since the
    # last evaluation makes it stale
    names = ([s.strip() for s in args.variants.split(",") if s.strip()] if args.variants
             else [v["name"] for v in attnbench.variants()])
    settings = {k: getattr(args, k) for k in ("windows", "threads", "finetune_steps",
                                              "finetune_top", "finetune_lr", "seed")}
    settings["variants"] = names
    if os.path.exists(out) and os.path.exists(info_path) and not args.force:
        with open(info_path) as f:
            old = json.load(f)
        if old.get("checkpoint") == sha and old.get("swap_settings") == settings:
            print(f"swap_eval.py: {out} is from this checkpoint and these settings (--force "
                  f"evaluates again)")
            return 0
    torch.set_num_threads(args.threads)
    cfg = model.cfg
    C = cfg["context"]
    _, valid_path = lm.fetch_corpus(root)
    batches = list(lm.windows(lm.read_bytes(valid_path), C, args.windows).split(1))

    base = dict(n=C, windows=args.windows, tokens=args.windows * C, threads=args.threads)
    rows = []
    bpb0, att0, eval0 = evaluate(model, batches, None, args.threads)
    rows.append(dict(variant=EXACT, spec="torch softmax", status="ok", message="",
                     bpb=bpb0, delta_bpb=0.0, attention_s_per_token=att0,
                     eval_s_per_token=eval0, **base))
    print(f"swap_eval.py: exact attention {bpb0:.5f} bits per byte "
          f"({args.windows} x {C} held-out bytes)")
    for name in names:
        why = refusal(attnbench, name, cfg, C)
        if why is not None:
            rows.append(dict(variant=name.split(":")[0], spec=name, status="unsupported",
                             message=why, **base))
            print(f"  {name:20s} unsupported: {why}")
            continue
        variant = attnbench.Variant(name)
        bpb, att, ev = evaluate(model, batches, variant, args.threads)
        rows.append(dict(variant=name.split(":")[0], spec=name, status="ok", message="",
                         bpb=bpb, delta_bpb=bpb - bpb0, attention_s_per_token=att,
                         eval_s_per_token=ev, **base))
        print(f"  {name:20s} {bpb:.5f} bits per byte ({bpb - bpb0:+.5f}), attention "
              f"{att * 1e6:.2f} us per token", flush=True)
    flash = [r for r in rows if r["spec"] == "flash" and r["status"] == "ok"]
    for r in rows:
        if flash and r["status"] == "ok":
            r["speedup"] = flash[0]["attention_s_per_token"] / r["attention_s_per_token"]
    if args.finetune_steps:
        finetune(args, attnbench, ckpt_path, root, batches, rows)
    os.makedirs(out_dir, exist_ok=True)
    fields = ["variant", "spec", "status", "message", "n", "windows", "tokens", "bpb",
              "delta_bpb", "attention_s_per_token", "eval_s_per_token", "speedup", "threads",
              "ft_steps", "ft_bpb", "ft_delta_bpb", "recovered"]

    def write_rows(f):
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)

    atomic_write(out, write_rows, binary=False)
    log = os.path.join(os.path.dirname(ckpt_path), "train_log.csv")
    if os.path.exists(log):
        with open(log, "rb") as f:
            atomic_write_bytes(os.path.join(out_dir, "train_log.csv"), f.read())
    info = {k: ckpt.get(k) for k in ("config", "steps", "batch", "lr", "seed", "threads",
                                     "attention", "train_seconds", "valid_bpb", "parameters",
                                     "corpus")}
    info["checkpoint"] = sha
    info["swap_settings"] = settings
    lm.write_json(info_path, info)
    print(f"swap_eval.py: {out}")
    return 0


if __name__ == "__main__":
    lm.script_main(main)
