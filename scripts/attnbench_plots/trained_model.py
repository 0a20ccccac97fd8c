"""A trained model (scripts/train_lm.py): its training curve, the error of every variant on the
q, k, v its layers produce (rows of input `trained:layer=L`), and what swapping each variant
into the model costs in validation bits per byte (scripts/swap_eval.py, DIR/trained/swap.csv).

  train_valid_bpb       validation (and training) bits per byte against training steps
  swap_bpb_vs_speedup   increase in bits per byte against the attention's speedup over flash

Drawn only when the results hold trained-input rows or DIR/trained/ holds the swap files.
"""

import json
import math
import os

import pandas as pd

from .style import code, finish, freeze_layout, md_table, new_grid, place_labels, warn

FIGURES = ["train_valid_bpb", "swap_bpb_vs_speedup"]
SECTION = "A trained model: real attention inputs and swapping variants in"
TRAINED = "trained:"
LINEAR = 1e-4  # the swap figure's y axis is linear within ±LINEAR, logarithmic outside


def _read(ctx, name):
    path = os.path.join(ctx.dir, "trained", name)
    if not os.path.exists(path):
        return None
    try:
        if name.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        return pd.read_csv(path)
    except (OSError, ValueError) as e:
        ctx.note(f"trained model: {path} is unreadable ({e}); left out of the report")
        return None


def _fmt(x, digits=4):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.{digits}f}"


def section(ctx):
    info = _read(ctx, "model.json")
    log = _read(ctx, "train_log.csv")
    swap = _read(ctx, "swap.csv")
    rows = ctx.ok[ctx.ok["input"].astype(str).str.startswith(TRAINED)]
    if info is None and swap is None and rows.empty:
        return
    ctx.md.append(f"## {SECTION}\n")
    if info is not None:
        cfg = info.get("config") or {}
        ctx.md.append(
            f"The model (`scripts/train_lm.py`): a causal byte-level transformer of "
            f"{cfg.get('layers')} layers of {cfg.get('heads')} heads of dimension "
            f"{cfg.get('head_dim')}, width {cfg.get('width')}, rotary positions, context "
            f"C = {cfg.get('context')}, {info.get('parameters')} parameters, trained on the "
            f"Brown corpus ({info.get('corpus')}) for {info.get('steps')} steps of "
            f"{info.get('batch')} × {cfg.get('context')} bytes in "
            f"{(info.get('train_seconds') or float('nan')) / 60:.1f} min on "
            f"{info.get('threads')} threads (attention: `{info.get('attention')}`). Validation: "
            f"**{info.get('valid_bpb', float('nan')):.3f} bits per byte**. Checkpoint "
            f"`{str(info.get('checkpoint'))[:12]}`.\n")
    if log is not None and not log.empty:
        curve(ctx, log)
    if not rows.empty:
        input_table(ctx, rows, (info or {}).get("config", {}).get("context"))
    if swap is not None and not swap.empty:
        swap_section(ctx, swap)


def curve(ctx, log):
    fig, axes = new_grid(1, 1)
    ax = axes[0][0]
    ax.plot(log["step"], log["valid_bpb"], marker="o", ms=3, label="validation")
    if "train_bpb" in log and log["train_bpb"].notna().any():
        ax.plot(log["step"], log["train_bpb"], alpha=0.6, label="training batch")
    ax.set_xlabel("training step")
    ax.set_ylabel("bits per byte")
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    finish(fig, ctx.fig_path("train_valid_bpb"), handles,
           "The trained model: bits per byte against training steps")
    ctx.md.append("### Training\n")
    ctx.embed("train_valid_bpb", "bits per byte against training steps")


def input_table(ctx, rows, context):
    """Error of every variant on each layer's inputs at n = C (or the largest
    n measured up to it)."""
    ns = sorted(rows["n"].unique())
    n = max([x for x in ns if context is None or x <= context] or ns)
    at = rows[rows["n"] == n]
    layers = sorted(at["input"].unique(), key=lambda s: (len(s), s))
    ctx.md.append("### Error on the trained model's inputs\n")
    beyond = ""
    if context:
        far = [x for x in ns if x > context]
        if far:
            beyond = (f" Rows at n = {', '.join(str(int(x)) for x in far)} are beyond the "
                      f"trained context (C = {int(context)}) and appear in the error figure "
                      f"only.")
    ctx.md.append(
        f"`rel_fro_error` of each variant at n = {int(n)} on the q, k and v of each layer of the "
        f"trained model (`--input trained:layer=L`, causal rows when present; the mass each "
        f"pattern keeps is in the anatomy section below).{beyond} The error figure above has "
        f"a panel per layer.\n")
    table = []
    for spec in ctx.styles.order:
        mine = at[at["spec"] == spec]
        if mine.empty:
            continue
        cells = []
        for layer in layers:
            r = mine[mine["input"] == layer]
            if r.empty:
                cells.append("")
                continue
            cells.append(f"{r.sort_values('causal').iloc[-1]['rel_fro_error']:.2e}")
        table.append([code(spec)] + cells)
    ctx.md.append(md_table(["variant"] + [code(x) for x in layers], table))


def swap_section(ctx, swap):
    ok = swap[swap["status"] == "ok"].copy()
    bad = swap[swap["status"] != "ok"]
    exact = ok[ok["variant"] == "exact"]
    ctx.md.append("### Swapping a variant into the trained model\n")
    n = int(swap["n"].iloc[0])
    ctx.md.append(
        f"`scripts/swap_eval.py`: every layer's attention replaced by one variant at its "
        f"defaults (causal), on {int(swap['windows'].iloc[0])} held-out windows of n = {n} "
        f"bytes, without retraining. Δ is the increase in bits per byte over the model's own "
        f"exact attention; the speedup is flash's attention time over the variant's, both "
        f"timed inside the model on {int(swap['threads'].iloc[0])} threads.\n")
    tuned = "ft_bpb" in ok.columns and ok["ft_bpb"].notna().any()
    steps = int(ok["ft_steps"].max()) if tuned else 0
    rows = []
    ok["first"] = ok["variant"] != "exact"
    for _, r in ok.sort_values(["first", "delta_bpb"]).iterrows():
        rows.append([code(r["spec"]) if r["variant"] != "exact" else "exact (torch)",
                     f"{r['bpb']:.4f}", f"{r['delta_bpb']:+.4f}",
                     f"{r['attention_s_per_token'] * 1e6:.2f}",
                     f"{r['eval_s_per_token'] * 1e6:.1f}",
                     "" if pd.isna(r.get("speedup")) else f"{r['speedup']:.2f}×"] +
                    ([_fmt(r.get("ft_delta_bpb")),
                      "" if pd.isna(r.get("recovered")) else f"{r['recovered']:.0%}"]
                     if tuned else []))
    ctx.md.append(md_table(["variant", "bits per byte", "Δ", "attention µs per token",
                            "model µs per token", "speedup over flash"] +
                           ([f"Δ after {steps} fine-tune steps", "recovered"] if tuned else []),
                           rows))
    if tuned:
        ctx.md.append(
            f"Fine-tuned: the most harmful variants (and `flash`, the baseline) were each "
            f"trained {steps} more steps with the variant in place, through its own backward "
            f"pass, on the same batches. Δ after is against `flash` fine-tuned the same way; "
            f"recovered is the share of the increase the fine-tuning removed.\n")
    if not bad.empty:
        ctx.md.append("Refused (not causal, or not at this shape): " + "; ".join(
            f"{code(r['spec'])}: {r['message']}" for _, r in bad.iterrows()) + ".\n")
    if exact.empty:
        warn("swap: no exact row in swap.csv")
    drawn = ok[(ok["variant"] != "exact") & ok["speedup"].notna()]
    if drawn.empty:
        return
    fig, axes = new_grid(1, 1)
    ax = axes[0][0]
    handles = []
    for _, r in drawn.iterrows():
        ax.plot(r["speedup"], r["delta_bpb"], linestyle="none",
                **ctx.styles(r["spec"], line=False))
        handles.append(ctx.styles.handle(r["spec"], line=False))
    ax.set_xscale("log")
    # symmetric log: a swap can also lower the loss a little; linear within ±LINEAR
    ax.set_yscale("symlog", linthresh=LINEAR)
    ax.axhline(0.0, color="grey", lw=0.8)
    top = max(float(drawn["delta_bpb"].max()), LINEAR)
    ax.set_ylim(bottom=min(float(drawn["delta_bpb"].min()) * 1.5, -LINEAR), top=top * 4)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"attention speedup over flash at n = {n}")
    ax.set_ylabel(f"increase in bits per byte (linear within ±{LINEAR:g})")
    ax.grid(True, alpha=0.3, which="both")
    title = "Swapping a variant into the trained model: loss against speed"
    fig.suptitle(title, fontsize=10.5)
    freeze_layout(fig)
    place_labels(ax, list(zip(drawn["speedup"], drawn["delta_bpb"])),
                 [ctx.styles.label(s) for s in drawn["spec"]])
    finish(fig, ctx.fig_path("swap_bpb_vs_speedup"), handles, title)
    ctx.embed("swap_bpb_vs_speedup", "increase in bits per byte against attention speedup")
