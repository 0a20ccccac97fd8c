"""The anatomy of a trained model's attention: what scripts/anatomy.py measured on the q, k, v
captured from the small trained language model (DIR/trained/anatomy.csv and anatomy.json),
drawn as

  anatomy_entropy      layer x head heatmap of the mean normalised entropy of the rows
  anatomy_window_mass  the mass on the w most recent keys against w, a panel per layer, a line
                       per head, the windows of the pattern variants marked
  anatomy_sinks        layer x head heatmaps of the mass on the first key and the first 4 keys
  anatomy_patterns     the mass each fixed pattern keeps, per pattern and (layer, head)

and the report section "Anatomy of a trained model's attention": the figures, a table per
layer and head, which pattern keeps the most mass in which head (with a sentence per layer
written from the numbers), and, when results.csv holds sweep rows on the trained inputs
(input `trained:layer=L`) with a mass_mean column, the mass every pattern variant kept there.
Results without DIR/trained/anatomy.csv get no section.
"""

import math
import os
import re

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from attnbench_results import FORWARD, ResultsError, read_json

from .style import DPI, Styles, code, fmt_n, md_table, save_figure

FIGURES = ["anatomy_entropy", "anatomy_window_mass", "anatomy_sinks", "anatomy_patterns"]
COLUMNS = ["layer", "head", "measure", "w", "s", "pattern", "value"]
MEASURES = ["entropy", "entropy_norm", "window_mass", "w50", "w90", "sink_mass", "pattern_mass"]
SECTION = "Anatomy of a trained model's attention"
TRAINED_INPUT = re.compile(r"^trained:(?:.*,)?layer=(\d+)(?:,|$)")
# Thresholds of the sentences per layer.
SINK_HEAD = 0.5       # mass on the first key
PREVIOUS_HEAD = 0.5   # mass on the previous token (window 2 minus window 1)
LOCAL_W90 = 16        # 90% of the mass within this many recent keys
FIT = 0.9             # a pattern that keeps this share "fits" the head


def paths(directory):
    out = os.path.join(directory, "trained")
    return os.path.join(out, "anatomy.csv"), os.path.join(out, "anatomy.json")


def load(directory):
    """(measures, info) of DIR/trained/anatomy.csv and anatomy.json, or None when there is no
    anatomy.csv; raises ResultsError for files that cannot be used."""
    csv, meta = paths(directory)
    if not os.path.isfile(csv):
        return None
    try:
        df = pd.read_csv(csv)
    except (OSError, ValueError) as e:
        raise ResultsError(f"'{csv}' is not a readable CSV file ({e})") from None
    lacking = [c for c in COLUMNS if c not in df.columns]
    if lacking:
        raise ResultsError(f"'{csv}' lacks the column(s) {', '.join(lacking)}; "
                           f"scripts/anatomy.py writes {', '.join(COLUMNS)}")
    unknown = sorted(set(df["measure"]) - set(MEASURES))
    if df.empty or unknown:
        raise ResultsError(f"'{csv}' " + (f"has unknown measures {', '.join(map(str, unknown))}"
                                          if unknown else "has no rows"))
    for c in ("layer", "head", "w", "s", "value"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    if df[["layer", "head"]].isna().any().any() or df["value"].isna().any():
        raise ResultsError(f"'{csv}': a layer, head or value is not a number")
    df["pattern"] = df["pattern"].fillna("").astype(str)
    info = read_json(meta, "the anatomy.json scripts/anatomy.py writes beside anatomy.csv")
    if not all(k in info for k in ("n", "context", "patterns")):
        raise ResultsError(f"'{meta}' lacks n, context or patterns")
    return df, info


def layers_heads(df):
    return ([int(x) for x in sorted(df["layer"].unique())],
            [int(x) for x in sorted(df["head"].unique())])


def grid(df, measure, **where):
    """Values of one measure as a [layers, heads] array (NaN where absent)."""
    sel = df[df["measure"] == measure]
    for c, v in where.items():
        sel = sel[sel[c] == v]
    layers, heads = layers_heads(df)
    out = np.full((len(layers), len(heads)), np.nan)
    for _, r in sel.iterrows():
        out[layers.index(int(r["layer"])), heads.index(int(r["head"]))] = r["value"]
    return out


def pattern_specs(df):
    return list(dict.fromkeys(df.loc[df["measure"] == "pattern_mass", "pattern"]))


def heatmap(ax, values, fig, xlabels, ylabels, fmt="{:.2f}", vmax=1.0, cmap="viridis"):
    im = ax.imshow(values, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto",
                   interpolation="nearest")
    ax.set_xticks(range(len(xlabels)), xlabels, fontsize=7)
    ax.set_yticks(range(len(ylabels)), ylabels, fontsize=8)
    ax.grid(False)
    if values.shape[1] <= 40:
        for (r, c), v in np.ndenumerate(values):
            if np.isfinite(v):
                ax.text(c, r, fmt.format(v), ha="center", va="center", fontsize=6.5,
                        color="white" if v < 0.6 * vmax else "black")
    return fig.colorbar(im, ax=ax, shrink=0.9)


def title(info):
    return (f"n = {fmt_n(info['n'])} positions of held-out text"
            + (f" (trained context {fmt_n(info['context'])})"
               if info["n"] != info["context"] else ""))


def draw(directory, df, info, record=None):
    """Draws the anatomy figures into DIR/plots/; returns the names of the files written (the
    caller removes the earlier ones it did not draw once its outputs are written:
    style.remove_unsaved). record(figure, **items) is told what each figure drew."""
    record = record or (lambda figure, **items: None)
    plots = os.path.join(directory, "plots")
    os.makedirs(plots, exist_ok=True)
    layers, heads = layers_heads(df)
    head_labels = [str(h) for h in heads]
    layer_labels = [f"layer {l}" for l in layers]
    drawn = []

    def save(fig, name):
        save_figure(fig, os.path.join(plots, name + ".png"), dpi=DPI, bbox_inches="tight",
                    facecolor="white")
        plt.close(fig)
        drawn.append(name + ".png")

    ent = grid(df, "entropy_norm")
    fig, ax = plt.subplots(figsize=(1.4 + 0.55 * len(heads), 1.3 + 0.45 * len(layers)),
                           layout="constrained")
    heatmap(ax, ent, fig, head_labels, layer_labels).set_label("entropy / ln(keys seen)")
    ax.set_xlabel("head")
    ax.set_title(f"Mean normalised entropy of the attention rows\n(0: one key, 1: uniform; "
                 f"{title(info)})", fontsize=9)
    save(fig, "anatomy_entropy")
    record("anatomy_entropy", values=ent.tolist())

    wm = df[df["measure"] == "window_mass"].sort_values("w")
    windows = {p["spec"]: p["window"] for p in info["patterns"] if p.get("window")}
    ncol = min(2, len(layers))
    nrow = math.ceil(len(layers) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.2 * nrow), squeeze=False,
                             sharey=True, layout="constrained")
    colors = plt.get_cmap("tab10" if len(heads) <= 10 else "tab20")
    lines = {}
    styles = Styles(list(windows))
    at_window = {}  # one line per window, named by every variant that has it
    for spec, w in sorted(windows.items(), key=lambda kv: kv[1]):
        if w <= info["n"]:
            at_window.setdefault(w, []).append(spec)
    for ax in axes.flat[len(layers):]:
        ax.set_visible(False)
    for ax, layer in zip(axes.flat, layers):
        for i, head in enumerate(heads):
            sel = wm[(wm["layer"] == layer) & (wm["head"] == head)]
            ax.plot(sel["w"], sel["value"], color=colors(i % colors.N), linewidth=1.3,
                    label=f"head {head}")
            lines[f"{layer}/{head}"] = {"w": sel["w"].astype(int).tolist(),
                                        "mass": sel["value"].tolist()}
        for w, specs in at_window.items():
            color = styles(specs[0])["color"]
            ax.axvline(w, color=color, linestyle="--", linewidth=0.9, alpha=0.8)
            ax.text(w, 0.02, " " + ", ".join(specs), rotation=90, fontsize=6.5, va="bottom",
                    color=color)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("w (most recent keys, the token itself included)")
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("mean mass on keys i-w < j ≤ i")
    fig.legend(handles=axes.flat[0].get_lines()[:len(heads)], loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=min(len(heads), 8), fontsize=8, frameon=False)
    fig.suptitle(f"Attention mass within the w most recent keys ({title(info)}; dashed: the "
                 f"windows of pattern variants)", fontsize=9.5)
    save(fig, "anatomy_window_mass")
    record("anatomy_window_mass", lines=lines, windows=windows)

    sinks = sorted(df.loc[df["measure"] == "sink_mass", "s"].dropna().astype(int).unique())
    if sinks:
        fig, axes = plt.subplots(1, len(sinks), figsize=((1.6 + 0.55 * len(heads)) * len(sinks),
                                                         1.3 + 0.45 * len(layers)),
                                 squeeze=False, layout="constrained")
        values = {}
        for ax, s in zip(axes[0], sinks):
            v = grid(df, "sink_mass", s=s)
            heatmap(ax, v, fig, head_labels, layer_labels, cmap="magma")
            ax.set_xlabel("head")
            ax.set_title(f"mass on the first {s} key{'s' if s > 1 else ''}", fontsize=9)
            values[str(s)] = v.tolist()
        fig.suptitle(f"Attention sinks: mean over the rows i ≥ {info.get('sink_start')} "
                     f"({title(info)})", fontsize=9.5)
        save(fig, "anatomy_sinks")
        record("anatomy_sinks", values=values)

    specs = pattern_specs(df)
    if specs:
        density = {p["spec"]: p.get("density") for p in info["patterns"]}
        cols = [(l, h) for l in layers for h in heads]
        pm = df[df["measure"] == "pattern_mass"]
        values = np.full((len(specs), len(cols)), np.nan)
        for _, r in pm.iterrows():
            values[specs.index(r["pattern"]), cols.index((int(r["layer"]), int(r["head"])))] = \
                r["value"]
        fig, ax = plt.subplots(figsize=(2.6 + 0.32 * len(cols), 1.2 + 0.42 * len(specs)),
                               layout="constrained")
        ylabels = [f"{s} ({100 * density[s]:.1f}% of pairs)" if density.get(s) is not None
                   else s for s in specs]
        heatmap(ax, values, fig, head_labels * len(layers), ylabels, fmt="{:.2f}")
        for i in range(1, len(layers)):
            ax.axvline(i * len(heads) - 0.5, color="white", linewidth=2)
        for i, layer in enumerate(layers):
            ax.text((i + 0.5) * len(heads) - 0.5, -0.7, f"layer {layer}", ha="center",
                    va="bottom", fontsize=8)
        ax.set_xlabel("head")
        ax.set_title(f"Attention mass inside each fixed pattern (causal, at its defaults, "
                     f"{title(info)})\n", fontsize=9)
        save(fig, "anatomy_patterns")
        record("anatomy_patterns", specs=specs, columns=[list(c) for c in cols],
               values=values.tolist())
    return drawn


def fmt(v, digits=2):
    return "—" if v is None or not np.isfinite(v) else f"{v:.{digits}f}"


def heads_list(heads):
    return ("head " if len(heads) == 1 else "heads ") + ", ".join(str(h) for h in heads)


def best_patterns(df, density):
    """Per (layer, head): the pattern keeping the most mass (ties: the sparser), and the
    sparsest pattern keeping at least FIT of it (None when none does)."""
    pm = df[df["measure"] == "pattern_mass"]
    out = {}
    for (layer, head), sel in pm.groupby(["layer", "head"]):
        ranked = sorted(sel.itertuples(), key=lambda r: (-r.value, density.get(r.pattern, 1.0),
                                                         r.pattern))
        fits = sorted((r for r in sel.itertuples() if r.value >= FIT - 1e-12),
                      key=lambda r: (density.get(r.pattern, 1.0), r.pattern))
        out[(int(layer), int(head))] = (ranked[0].pattern, ranked[0].value,
                                        fits[0].pattern if fits else None,
                                        fits[0].value if fits else None)
    return out


def layer_sentence(layer, heads, ent, w90, sink1, prev, best):
    """What the numbers say about one layer's heads, in one sentence."""
    parts = []
    if best:
        count = {}
        for h in heads:
            count.setdefault(best[(layer, h)][0], []).append(h)
        ordered = sorted(count.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        parts.append("the most mass is kept by " + "; ".join(
            f"{code(spec)} in {heads_list(hs)}" for spec, hs in ordered))
    sink = [h for i, h in enumerate(heads) if sink1[i] >= SINK_HEAD]
    if sink:
        parts.append(f"{heads_list(sink)} put{'s' if len(sink) == 1 else ''} at least "
                     f"{SINK_HEAD:.0%} of the mass on the first key (sink)")
    previous = [h for i, h in enumerate(heads) if prev[i] >= PREVIOUS_HEAD]
    if previous:
        parts.append(f"{heads_list(previous)} attend{'s' if len(previous) == 1 else ''} "
                     f"mostly the previous token")
    local = [h for i, h in enumerate(heads) if w90[i] <= LOCAL_W90]
    if local:
        parts.append(f"{heads_list(local)} hold{'s' if len(local) == 1 else ''} 90% of the "
                     f"mass within the last {LOCAL_W90} keys")
    if np.isfinite(ent).any():
        i = int(np.nanargmax(ent))
        parts.append(f"the most spread head is {heads[i]} (normalised entropy {ent[i]:.2f})")
    return f"Layer {layer}: " + "; ".join(parts) + "."


def sweep_masses(ctx, info):
    """Mean mass_mean per variant spec and layer of the ok forward rows of results.csv on the
    trained inputs at n = the trained context (the largest n below it when there is none);
    (table rows, n) or None."""
    df = ctx.df
    if "mass_mean" not in df.columns:
        return None
    rows = df[(df["status"] == "ok") & (df["pass"] == FORWARD) & (df["causal"] == 1)]
    layer = rows["input"].astype(str).str.extract(TRAINED_INPUT)[0]
    rows = rows.assign(layer=pd.to_numeric(layer, errors="coerce"),
                       mass=pd.to_numeric(rows["mass_mean"], errors="coerce"))
    rows = rows[rows["layer"].notna() & rows["mass"].notna()]
    if rows.empty:
        return None
    ns = sorted(rows["n"].unique())
    n = info["context"] if info["context"] in ns else max(ns)
    rows = rows[rows["n"] == n]
    layers = sorted(rows["layer"].astype(int).unique())
    means = rows.groupby(["spec", "layer"])["mass"].mean()
    out = []
    for spec in dict.fromkeys(rows["spec"]):
        out.append([code(spec)] + [fmt(means.get((spec, float(l)), math.nan), 3)
                                   for l in layers])
    return out, layers, n


def section(ctx):
    try:
        loaded = load(ctx.dir)
    except ResultsError as e:
        ctx.note(f"anatomy: {e}; no anatomy section")
        ctx.md.append(f"## {SECTION}\n\nNot drawn: {e}.\n")
        return
    if loaded is None:
        return
    df, info = loaded
    drawn = draw(ctx.dir, df, info, ctx.record)
    ctx.md.append(f"## {SECTION}\n")
    ctx.md.append(
        f"Exact causal softmax attention of every layer and head of the small byte-level "
        f"language model trained by `scripts/train_lm.py`, on the q, k, v "
        f"`scripts/capture_qkv.py` captured from held-out text (after the rotary embedding: "
        f"what the softmax sees), over the first n = {info['n']} positions (trained context "
        f"{info['context']}), measured by `scripts/anatomy.py` "
        f"(`trained/anatomy.csv`). Every measure is a mean over the query rows i; row i sees "
        f"the i + 1 keys j ≤ i.\n")
    ctx.md.append(
        "- **entropy**: the row's entropy −Σ p ln p in nats, divided by ln(i + 1), the "
        "entropy of a uniform row (rows i ≥ 1): 0 is one key, 1 is uniform, and early rows, "
        "which see few keys, do not dominate.\n"
        "- **window mass**: the mass on the w most recent keys (i − w < j ≤ i; w = 1 is the "
        "token itself, w = 2 adds the previous token); **w50** and **w90** are the smallest "
        "w holding 50% and 90% of the mass on average.\n"
        f"- **sink mass**: the mass on the first 1 and 4 keys, over the rows i ≥ "
        f"{info.get('sink_start')} (where the first keys are few among many).\n"
        "- **pattern mass**: the mass inside each fixed-pattern variant's causal pattern at "
        "its defaults and this n (`attnbench pattern`, head 0's pattern for every head): "
        "the share of the exact attention a variant can keep at best. The percentage beside "
        "a pattern is the share of the causal pairs it attends (its cost).\n")
    for name, alt in (("anatomy_entropy", "normalised entropy per layer and head"),
                      ("anatomy_window_mass", "window mass against w"),
                      ("anatomy_sinks", "attention sinks"),
                      ("anatomy_patterns", "mass inside each fixed pattern")):
        if name + ".png" in drawn:
            ctx.embed(name, alt)
    specs = pattern_specs(df)
    if not specs:
        ctx.md.append("No pattern masses: anatomy.py had no attnbench binary to export the "
                      "patterns with.\n")
    layers, heads = layers_heads(df)
    ent, nats = grid(df, "entropy_norm"), grid(df, "entropy")
    w50, w90 = grid(df, "w50"), grid(df, "w90")
    sink1, sink4 = grid(df, "sink_mass", s=1), grid(df, "sink_mass", s=4)
    prev = grid(df, "window_mass", w=2) - grid(df, "window_mass", w=1)
    pm = {spec: grid(df, "pattern_mass", pattern=spec) for spec in specs}
    ctx.md.append("\n### Per layer and head\n")
    rows = []
    for li, layer in enumerate(layers):
        for hi, head in enumerate(heads):
            rows.append([layer, head, fmt(ent[li, hi]), fmt(nats[li, hi]),
                         fmt(w50[li, hi], 0), fmt(w90[li, hi], 0), fmt(sink1[li, hi], 3),
                         fmt(sink4[li, hi], 3)] + [fmt(pm[s][li, hi], 3) for s in specs])
    ctx.md.append(md_table(["layer", "head", "entropy (norm.)", "entropy (nats)", "w50", "w90",
                            "sink s=1", "sink s=4"] + [code(s) for s in specs], rows))
    density = {p["spec"]: p.get("density") or 1.0 for p in info["patterns"]}
    best = best_patterns(df, density) if specs else {}
    if best:
        ctx.md.append("\n### Which patterns fit which heads\n")
        ctx.md.append(f"Per head, the pattern keeping the most mass (ties: the sparser), and "
                      f"the sparsest pattern keeping at least {FIT:.0%} of it.\n\n")
        rows = []
        for (layer, head), (spec, mass, cheap, cheap_mass) in sorted(best.items()):
            rows.append([layer, head, code(spec), fmt(mass, 3), f"{100 * density[spec]:.1f}%",
                         f"{code(cheap)} ({fmt(cheap_mass, 3)}, "
                         f"{100 * density[cheap]:.1f}%)" if cheap else "none"])
        ctx.md.append(md_table(["layer", "head", "most mass", "mass", "pairs attended",
                                f"sparsest keeping ≥ {FIT:.0%}"], rows))
    ctx.md.append("\n" + "\n".join(
        f"- {layer_sentence(layer, heads, ent[li], w90[li], sink1[li], prev[li], best)}"
        for li, layer in enumerate(layers)) + "\n")
    swept = sweep_masses(ctx, info)
    ctx.md.append("\n### Mass kept by every pattern variant in the sweep\n")
    if swept is None:
        ctx.md.append("results.csv holds no ok rows on the trained inputs (`--input "
                      "trained:layer=L`) with a `mass_mean`: the data-dependent patterns "
                      "(reformer, routing, sinkhorn, ...) are not measured here.\n")
    else:
        rows, swept_layers, n = swept
        ctx.md.append(f"The sweep's `mass_mean` (the share of the exact attention inside the "
                      f"keys the variant attends, mean over rows and heads) on the trained "
                      f"inputs of each layer, causal, n = {n}:\n\n")
        ctx.md.append(md_table(["variant"] + [f"layer {l}" for l in swept_layers], rows))
    ctx.md.append("\n")
