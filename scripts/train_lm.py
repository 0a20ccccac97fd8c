#!/usr/bin/env python3
"""Trains the byte-level language model of scripts/attnbench_lm.py on the Brown corpus and
writes CACHE/trained/model.pt and CACHE/trained/train_log.csv (validation bits per byte against
steps). A fixed seed, a fixed number of steps (600) sized to take about 13 minutes on 2
cores; the attention is attnbench's `flash` (exact softmax attention, with its own backward)
through attnbench_lm.attend, or torch's when the attnbench module is missing (`--attention
torch`).

    PYTHONPATH=build/python /usr/bin/python3 scripts/train_lm.py [--steps N] [--force]

With --out PATH the model goes to PATH (its curve to train_log.csv beside it) instead; the
longer-context base model of `scripts/quality.py lm` is trained that way. At every validation
the training state (model, optimiser, batch generator, curve) is kept in PATH.partial, so a run
that stops resumes from its last validation when started again with the same settings (the
file is removed once the model is written).
"""

import argparse
import csv
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnbench_lm as lm  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="cache root (default: ATTNBENCH_CACHE, "
                    "$XDG_CACHE_HOME/attnbench or ~/.cache/attnbench)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-windows", type=int, default=8,
                    help="held-out windows of C bytes in each validation")
    ap.add_argument("--attention", default="flash",
                    help="attnbench variant used in training, or 'torch'")
    ap.add_argument("--config", default="", help="model settings as key=value,... "
                    "(layers, heads, head_dim, width, mlp, context)")
    ap.add_argument("--out", help="model file (default CACHE/trained/model.pt)")
    ap.add_argument("--force", action="store_true", help="train even if model.pt exists")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "threads", "eval_every", "eval_windows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not (0 < args.lr < 1):
        ap.error("--lr must be in (0, 1)")
    cfg = {}
    for item in filter(None, args.config.split(",")):
        key, _, value = item.partition("=")
        if key not in lm.DEFAULT_CONFIG or key == "rope_base" or not value.isdigit():
            ap.error(f"--config: '{item}' is not key=integer with key one of "
                     f"layers, heads, head_dim, width, mlp, context")
        cfg[key] = int(value)

    root = args.cache or lm.cache_root()
    out = args.out or lm.checkpoint_path(root)
    if os.path.exists(out) and not args.force:
        print(f"train_lm.py: {out} exists (--force trains again)")
        return 0
    variant = None if args.attention == "torch" else args.attention
    if variant is not None:
        try:
            import attnbench
            variant = attnbench.Variant(variant)
        except ImportError:
            print("train_lm.py: the attnbench Python module is not importable (build it with "
                  "-DATTNBENCH_PYTHON=ON and put build/python on PYTHONPATH); training with "
                  "torch's attention", file=sys.stderr)
            variant = None

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train_path, valid_path = lm.fetch_corpus(root)
    train, valid = lm.read_bytes(train_path), lm.read_bytes(valid_path)
    model = lm.ByteLM(cfg)
    if variant is not None and variant.inputs:
        # the variant's learned parts (gla's gates, deltanet's beta, ...) train with the model
        model.learn_inputs(variant.spec, seed=args.seed)
    C = model.cfg["context"]
    valid_batches = list(lm.windows(valid, C, args.eval_windows).split(4))

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 16)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    log = []
    start = time.perf_counter()
    train_bpb = float("nan")
    params = sum(p.numel() for p in model.parameters())
    # the state of an earlier run of these very settings, kept at its last validation
    partial = out + ".partial"
    settings = dict(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                    eval_every=args.eval_every, eval_windows=args.eval_windows,
                    attention=args.attention, config=model.cfg)
    first = 0
    if os.path.exists(partial) and not args.force:
        kept = torch.load(partial, map_location="cpu")
        if kept.get("settings") == settings:
            model.load_state_dict(kept["state"])
            opt.load_state_dict(kept["optimizer"])
            rng.bit_generator.state = kept["rng"]
            log, first, train_bpb = kept["log"], kept["step"], kept["train_bpb"]
            start -= log[-1]["seconds"]
            print(f"train_lm.py: resuming from step {first} ({partial})")
        else:
            print(f"train_lm.py: {partial} is from other settings; starting again")
    print(f"train_lm.py: {params} parameters, {len(train)} training bytes, {args.steps} steps "
          f"of {args.batch} x {C} bytes, attention "
          f"{'torch' if variant is None else args.attention}")
    for step in range(first, args.steps + 1):
        if (step % args.eval_every == 0 or step == args.steps) and not (log and
                                                                        log[-1]["step"] == step):
            model.eval()
            bpb = lm.bits_per_byte(model, valid_batches, variant)
            model.train()
            elapsed = time.perf_counter() - start
            log.append(dict(step=step, tokens=step * args.batch * C, seconds=round(elapsed, 2),
                            train_bpb=train_bpb, valid_bpb=bpb))
            print(f"step {step:5d}  {elapsed:7.1f} s  train {train_bpb:.3f}  valid {bpb:.4f} "
                  f"bits/byte", flush=True)
            if 0 < step < args.steps:
                os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
                torch.save({"settings": settings, "state": model.state_dict(),
                            "optimizer": opt.state_dict(), "rng": rng.bit_generator.state,
                            "log": log, "step": step, "train_bpb": train_bpb}, partial + ".tmp")
                os.replace(partial + ".tmp", partial)
        if step == args.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = rng.integers(0, len(train) - C - 1, size=args.batch)
        batch = torch.from_numpy(np.stack([train[s:s + C + 1] for s in starts]).astype(np.int64))
        loss = model.loss(batch, variant)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_bpb = loss.item() / math.log(2)
    seconds = time.perf_counter() - start

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    log_path = os.path.join(os.path.dirname(os.path.abspath(out)), "train_log.csv")
    with open(log_path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(log[0]))
        w.writeheader()
        w.writerows(log)
    torch.save({"config": model.cfg, "state": model.state_dict(), "steps": args.steps,
                "inputs_variant": model.inputs_variant,
                "batch": args.batch, "lr": args.lr, "seed": args.seed, "threads": args.threads,
                "attention": "torch" if variant is None else args.attention,
                "train_seconds": seconds, "valid_bpb": log[-1]["valid_bpb"],
                "parameters": params, "corpus": lm.CORPUS_PACKAGE}, out + ".tmp")
    os.replace(log_path + ".tmp", log_path)
    os.replace(out + ".tmp", out)
    if os.path.exists(partial):
        os.remove(partial)
    print(f"train_lm.py: {out}: validation {log[-1]['valid_bpb']:.4f} bits per byte after "
          f"{seconds / 60:.1f} min")
    return 0


if __name__ == "__main__":
    lm.script_main(main)
