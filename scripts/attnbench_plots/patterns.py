"""The attention-pattern gallery: one head's pattern per pattern variant and causal setting,
read from what the sweep stored (DIR/patterns/index.csv and the .npy files it lists); no
attnbench binary is run."""

import math
import os
import textwrap

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from attnbench_results import ADDED_COLUMNS, KEY_COLUMNS, MASK_COLUMNS, ResultsError, read_csv

from .style import causal_name, code, fmt_n, md_table, save_figure, warn

# DIR/patterns/index.csv (harness/patterns.h): the results.csv key of the row a pattern belongs
# to, the file (empty for a variant without a pattern) and why there is no file.
INDEX_COLUMNS = KEY_COLUMNS + ["file", "message"]
INDEX_NUMERIC = ["batch", "heads", "n", "m", "dim", "embed", "causal", "score_hidden", "scale",
                 "seed", "threads"]
TILE_PIXELS = 256  # largest side of one pattern image in the gallery


def index_path(directory):
    return os.path.join(directory, "patterns", "index.csv")


def load_index(directory):
    """DIR/patterns/index.csv as a DataFrame, or None when the directory has none (results of
    a sweep that did not store patterns). Raises ResultsError for an index that cannot be used."""
    path = index_path(directory)
    if not os.path.isfile(path):
        return None
    idx = read_csv(path, ["spec", "score", "input", "file", "message"] + MASK_COLUMNS,
                   [c for c in INDEX_COLUMNS if c not in ADDED_COLUMNS],
                   "a header line and one line per variant spec and causal setting")
    for c in MASK_COLUMNS:  # empty: no padding, no mask
        idx[c] = idx[c].fillna("").astype(str)
    idx["file"] = idx["file"].fillna("")
    idx["message"] = idx["message"].fillna("")
    for c in INDEX_NUMERIC:
        idx[c] = pd.to_numeric(idx[c], errors="coerce")
        if idx[c].isna().any():
            line = int(idx[c].isna().idxmax()) + 2
            raise ResultsError(f"'{path}' line {line}: column {c} is not a number; expected "
                               f"the problem's {c} as results.csv writes it")
    for c in INDEX_NUMERIC:
        if c != "scale":
            idx[c] = idx[c].astype(int)
    return idx


def load_mask(directory, entry):
    """The stored uint8 [n, m] mask of an index entry; raises ResultsError naming what is
    wrong with the file."""
    path = os.path.join(directory, "patterns", entry["file"])
    if not os.path.isfile(path):
        raise ResultsError(f"'{path}' does not exist")
    try:
        mask = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ResultsError(f"'{path}' is not a readable .npy file ({e})") from None
    shape = (int(entry["n"]), int(entry["m"]))
    if mask.dtype != np.uint8 or mask.shape != shape:
        raise ResultsError(f"'{path}' holds a {mask.dtype} array of shape {mask.shape}; expected "
                           f"uint8 of shape {shape} (n x m of its row)")
    return mask


def stored_entries(ctx, idx):
    """Index entries whose row is an ok row of results.csv, and the number of the others."""
    keys = ctx.ok[KEY_COLUMNS].drop_duplicates()
    joined = idx.reset_index().merge(keys, on=KEY_COLUMNS, how="inner")
    kept = idx.loc[sorted(joined["index"])]
    return kept, len(idx) - len(kept)


def section(ctx):
    ctx.md.append("## Attention patterns\n")
    path = ctx.fig_path("patterns")
    where = index_path(ctx.dir)
    try:
        idx = load_index(ctx.dir)
    except ResultsError as e:
        ctx.note(f"patterns: {e}; no pattern gallery")
        ctx.md.append(f"No pattern gallery: {e}.\n")
        return
    if idx is None:
        ctx.note(f"patterns: {where} does not exist (these results come from a sweep that did "
                 f"not store patterns); no pattern gallery")
        ctx.md.append("No pattern gallery: these results hold no stored patterns "
                      "(`patterns/index.csv`); a sweep with this version of attnbench stores "
                      "them.\n")
        return
    idx, stray = stored_entries(ctx, idx)
    if stray:
        ctx.note(f"patterns: {where} lists {stray} pattern(s) whose row is not an ok row of "
                 f"results.csv; they are not drawn")
    want_n = ctx.args.pattern_n
    if want_n is not None and not (idx["n"] == want_n).any():
        lengths = ", ".join(str(n) for n in sorted(idx["n"].unique())) or "none"
        ctx.note(f"patterns: --pattern-n {want_n}: no stored pattern has n={want_n} (stored "
                 f"lengths: {lengths}); no pattern gallery")
        ctx.md.append(f"No pattern gallery: no stored pattern has n = {want_n} (stored lengths: "
                      f"{lengths}).\n")
        return
    if want_n is not None:
        idx = idx[idx["n"] == want_n]
    tiles, without, missing, failed = [], {}, [], []
    for spec in ctx.styles.order:
        rows = ctx.ok[ctx.ok["spec"] == spec]
        for causal in sorted(rows["causal"].unique()):
            e = idx[(idx["spec"] == spec) & (idx["causal"] == causal)]
            if e.empty:
                missing.append((spec, causal))
                continue
            pref = e[e["input"] == ctx.input]
            entry = (pref if not pref.empty else e).iloc[0]
            if not entry["file"]:
                without[spec] = entry["message"]
                continue
            try:
                mask = load_mask(ctx.dir, entry)
            except ResultsError as err:
                failed.append((spec, causal, str(err)))
                continue
            tiles.append((spec, int(causal), int(entry["n"]), mask))
    if without:
        warn("patterns: no attention pattern (not drawn): " + ", ".join(without))
    for spec, causal in missing:
        ctx.note(f"patterns: {where} holds no pattern of {spec} ({causal_name(causal)})"
                 + (f" at n={want_n}" if want_n is not None else ""))
    for spec, causal, msg in failed:
        ctx.note(f"patterns: the stored pattern of {spec} ({causal_name(causal)}) is unusable: "
                 f"{msg}")
    if tiles:
        lengths = sorted({t[2] for t in tiles})
        figure(ctx, tiles, path)
        ctx.embed("patterns", "attention patterns")
        at = f"at n = {lengths[0]}" if len(lengths) == 1 else "at the n in its title"
        ctx.md.append(f"One head (head 0) of each pattern variant {at}, as the sweep measured it "
                      f"(`patterns/*.npy`); black = attended pair (query row i, key column j). "
                      f"The percentage is the share of the n × m pairs attended. Above "
                      f"{TILE_PIXELS} positions a pixel stands for a square cell of pairs; its "
                      f"grey is the square root of the share of the cell's pairs attended "
                      f"(black: all of them).\n")
    else:
        ctx.md.append("No variant in these results has a stored attention pattern to draw.\n")
    if without:
        ctx.md.append("\nNot drawn, because the variant has no attention pattern (it does not "
                      "restrict softmax attention to a set of keys): "
                      + ", ".join(code(s) for s in without) + ".\n")
    if missing:
        ctx.md.append("\nNo stored pattern for: " + ", ".join(
            f"{code(s)} ({causal_name(c)})" for s, c in missing) + ".\n")
    if failed:
        ctx.md.append("\nStored pattern unusable for:\n\n" + md_table(
            ["variant", "causal", "message"], [[code(s), causal_name(c), m] for s, c, m in failed]))
    ctx.md.append("\n")


def figure(ctx, tiles, path):
    # A tile is about TILE_PIXELS wide; larger patterns are shown in factor x factor cells
    # whose grey is the square root of the share of the cell's pairs attended: a dense
    # block is black, a scattered data-dependent pattern (hash buckets, clusters) shows as
    # grey rather than as solid black, and a single attended key column (strided
    # patterns) still stays visible (1/f of a cell -> grey sqrt(1/f)).
    factor = max(1, math.ceil(max(max(t[3].shape) for t in tiles) / TILE_PIXELS))
    lengths = sorted({t[2] for t in tiles})
    ncol = min(6, len(tiles))
    nrow = math.ceil(len(tiles) / ncol)
    size = 1.9
    fig, axes = plt.subplots(nrow, ncol, figsize=(size * ncol, (size + 0.75) * nrow),
                             squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for ax, (spec, causal, n, mask) in zip(axes.flat, tiles):
        ax.axis("on")
        ax.grid(False)
        ax.imshow(np.sqrt(pool_share(mask, factor)), cmap="Greys", vmin=0, vmax=1,
                  interpolation="nearest", aspect="equal")
        ax.set_xticks([])
        ax.set_yticks([])
        for side in ["top", "right", "bottom", "left"]:
            ax.spines[side].set_visible(True)
            ax.spines[side].set_color(ctx.styles(spec)["color"])
            ax.spines[side].set_linewidth(1.5)
        wrapped = "\n".join(textwrap.wrap(spec.replace(",", ", "), 30, break_long_words=False))
        share = 100.0 * mask.mean()
        at = f"n = {fmt_n(n)}, " if len(lengths) > 1 else ""
        ax.set_title(f"{wrapped}\n{at}{causal_name(causal)}, {share:.1f}% attended",
                     fontsize=7, linespacing=1.15)
    cell = (f"; one pixel = {factor} × {factor} pairs, grey = √(share attended)"
            if factor > 1 else "")
    at = f", n = {fmt_n(lengths[0])}" if len(lengths) == 1 else ""
    fig.suptitle(f"Attention patterns, head 0{at} (black = attended; rows queries, columns "
                 f"keys{cell})", fontsize=10.5)
    save_figure(fig, path, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    ctx.record("patterns", factor=factor, tiles=[
        {"spec": spec, "causal": causal, "n": n, "shape": list(mask.shape),
         "attended": float(mask.mean())} for spec, causal, n, mask in tiles])


def pool_share(mask, f):
    """Share of attended pairs in each f x f cell of a 0/1 mask (partial last cells count
    the pairs they hold)."""
    if f == 1:
        return mask.astype(float)
    n, m = mask.shape
    rows, cols = math.ceil(n / f) * f, math.ceil(m / f) * f
    padded = np.zeros((rows, cols))
    count = np.zeros((rows, cols))
    padded[:n, :m] = mask
    count[:n, :m] = 1
    shape = (rows // f, f, cols // f, f)
    return padded.reshape(shape).sum(axis=(1, 3)) / count.reshape(shape).sum(axis=(1, 3))
