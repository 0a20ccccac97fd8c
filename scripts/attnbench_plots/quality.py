"""Quality: what a variant costs a model trained with it, beside what it saves.

Reads the files `scripts/quality.py` writes into DIR/quality/ (each optional):

  recall.csv  multi-query associative recall, a small model trained from scratch per variant,
              setting and seed (scripts/attnbench_recall.py): its accuracy on held-out sequences
  lm.csv      the byte model: the increase in bits per byte when the variant is swapped into
              the trained model (swap_delta), and after uptraining with it in place against
              flash uptrained the same way (uptrain_delta)

and writes the report's "Quality" section near its top: per variant the recall accuracy at
each setting (mean ± sd over seeds), the training time per token, Δ bits per byte before and
after uptraining, and the speed over flash at the same n from results.csv (passes fwd, fwdbwd
and decode, causal rows), with the figure

  recall_throughput   recall accuracy against the decode state per sequence and against the
                      training time per token (error bars: min to max over seeds)

A missing file leaves its part out; an unreadable one, or one without the columns a part needs,
is a note of the report and a warning, never a failure.
"""

import math
import os
from collections import Counter

import numpy as np
import pandas as pd
from matplotlib import ticker

from attnbench_results import DECODE, FORWARD

from .style import code, finish, fmt_bytes, fmt_n, freeze_layout, md_table, new_grid, \
    place_labels

FIGURES = ["recall_throughput"]
SECTION = "Quality"
# Chance on the recall task: one value among the value vocabulary of scripts/attnbench_recall.py
# (VALUES = 64 tokens).
CHANCE = 1.0 / 64
# The columns each part cannot do without, and those read as numbers.
RECALL_NEEDED = ["spec", "seq", "pairs", "seed", "status", "accuracy"]
RECALL_NUMERIC = ["seq", "pairs", "width", "seed", "steps", "tokens", "train_s", "accuracy",
                  "batch", "lr", "min_distance", "threads"]
LM_NEEDED = ["spec", "seed", "status", "swap_delta", "uptrain_delta"]
LM_NUMERIC = ["seed", "context", "eval_windows", "base_bpb", "swap_bpb", "swap_delta",
              "uptrain_steps", "uptrain_tokens", "uptrain_bpb", "flash_uptrain_bpb",
              "uptrain_delta", "recovered", "uptrain_s"]
# A recall setting: the task, the model and the budget; a column of the recall table each.
SETTING = ["mode", "seq", "pairs", "width", "steps", "batch", "lr"]
# The passes of the speed columns and their headers.
SPEED_PASSES = [(FORWARD, "fwd"), ("fwdbwd", "fwd+bwd"), (DECODE, "decode")]
FRONTIER = "frontier"


def load(ctx, name, needed, numeric):
    """DIR/quality/NAME as a frame of text columns (numeric ones as numbers), or None: when the
    file is absent (silently), or empty, unreadable or without a needed column (a note)."""
    path = os.path.join(ctx.dir, "quality", name)
    if not os.path.exists(path):
        return None
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError:
        ctx.note(f"quality: {path} is empty; left out of the report")
        return None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        ctx.note(f"quality: {path} is unreadable ({e}); left out of the report")
        return None
    df.columns = [str(c).strip() for c in df.columns]
    if "spec" not in df.columns and "variant" in df.columns:
        df["spec"] = df["variant"]
    missing = [c for c in needed if c not in df.columns]
    if missing:
        ctx.note(f"quality: {path} has no column {', '.join(missing)}; left out of the report")
        return None
    if df.empty:
        ctx.note(f"quality: {path} has no rows; left out of the report")
        return None
    for c in numeric:
        df[c] = pd.to_numeric(df[c], errors="coerce") if c in df.columns else math.nan
    df["spec"] = df["spec"].str.strip()
    df["status"] = df["status"].str.strip()
    if "message" not in df.columns:
        df["message"] = ""
    return df[df["spec"] != ""].copy()


def mark_unmeasured(ctx, df, column, path):
    """Rows of status ok without a finite `column` become failed rows that say so."""
    bad = (df["status"] == "ok") & ~np.isfinite(df[column].astype(float))
    if bad.any():
        ctx.note(f"quality: {int(bad.sum())} ok row(s) of {path} have no {column}; counted as "
                 f"failed")
        df.loc[bad, "status"] = "failed"
        df.loc[bad, "message"] = f"no {column} in the row"
    return df


def spread(values, fmt, count=True):
    """'mean ± sd (k)' of the finite values (sample sd), 'x (1)' for one value, '' for none."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if not len(v):
        return ""
    tail = f" ({len(v)})" if count else ""
    if len(v) == 1:
        return fmt(v[0]) + tail
    return f"{fmt(v.mean())} ± {fmt(v.std(ddof=1)).lstrip('+')}{tail}"


class Notes:
    """Numbered footnotes for the reasons of unsupported or failed cells: a table cell stays
    short and every distinct message is listed once under the table."""

    def __init__(self):
        self.messages = []

    def mark(self, status, messages):
        texts = [m for m in dict.fromkeys(str(x).strip() for x in messages) if m]
        refs = []
        for m in texts:
            if m not in self.messages:
                self.messages.append(m)
            refs.append(str(self.messages.index(m) + 1))
        return status + (f" [{','.join(refs)}]" if refs else "")

    def text(self):
        return "".join(f"\n[{i + 1}] {m}\n" for i, m in enumerate(self.messages))


# --- recall ---------------------------------------------------------------------------------
def settings_of(recall):
    """The settings of the recall rows, causal first, then by length, pairs and budget."""
    keys = recall[SETTING].drop_duplicates()
    rank = keys.assign(_m=(keys["mode"] != "causal").astype(int))
    rank = rank.sort_values(["_m", "seq", "pairs", "steps", "batch", "width", "lr"],
                            na_position="last")
    return [tuple(r) for r in rank[SETTING].itertuples(index=False)]


def fill_settings(recall):
    """A row without some of the model or budget columns (width, steps, batch, lr) takes the
    values of the other rows of its (mode, seq, pairs) where they agree on one, so that it
    joins their setting rather than making a column of its own."""
    for c in ["width", "steps", "batch", "lr"]:
        for _, idx in recall.groupby(["mode", "seq", "pairs"]).groups.items():
            values = recall.loc[idx, c].dropna().unique()
            if len(values) == 1:
                recall.loc[idx, c] = recall.loc[idx, c].fillna(values[0])
    return recall


def select(recall, setting):
    mask = np.ones(len(recall), dtype=bool)
    for c, v in zip(SETTING, setting):
        col = recall[c]
        mask &= (col.isna() if isinstance(v, float) and math.isnan(v) else col == v).to_numpy()
    return recall[mask]


def setting_label(setting, settings):
    """'n=512 P=8', with the mode when the rows hold both and whatever else varies."""
    values = dict(zip(SETTING, setting))
    varies = {c for i, c in enumerate(SETTING) if len({str(s[i]) for s in settings}) > 1}
    parts = []
    if "mode" in varies:
        parts.append("bidir." if values["mode"] == "bidirectional" else "causal")
    parts.append(f"n={fmt_n(values['seq'])} P={int(values['pairs'])}")
    for c, short in (("width", "E"), ("steps", "steps"), ("batch", "B"), ("lr", "lr")):
        if c in varies and not (isinstance(values[c], float) and math.isnan(values[c])):
            parts.append(f"{short}={values[c]:g}")
    return " ".join(parts)


def headline(settings):
    """The setting of the figure and of the sort: the longest causal one (the longest of any
    mode when none is causal)."""
    causal = [s for s in settings if s[0] == "causal"] or settings
    return max(causal, key=lambda s: (s[1], s[2], -settings.index(s)))


def recall_cell(rows, notes):
    ok = rows[rows["status"] == "ok"]
    bad = rows[rows["status"] != "ok"]
    if ok.empty:
        statuses = list(dict.fromkeys(bad["status"]))
        return notes.mark("/".join(statuses), bad["message"])
    cell = spread(ok["accuracy"], lambda x: f"{x:.2f}")
    if not bad.empty:
        cell = cell[:-1] + "; " + notes.mark(
            f"{len(bad)} {'/'.join(dict.fromkeys(bad['status']))}", bad["message"]) + ")"
    return cell


def training_cost(rows):
    """The training time per token (train_s / tokens) of each ok row of `rows` (one setting),
    as (Series by row, relative): in µs when the rows name one processor (`cpu`, or none),
    else as a multiple of flash's mean on the same processor and threads, never one processor's
    seconds beside another's (NaN where flash has no row there)."""
    ok = rows[(rows["status"] == "ok") & (rows["tokens"] > 0)]
    cost = (ok["train_s"] / ok["tokens"]).astype(float)
    cpu = ok["cpu"].astype(str).str.strip() if "cpu" in ok.columns else \
        pd.Series("", index=ok.index)
    if cpu.nunique() <= 1:
        return cost * 1e6, False
    machine = list(zip(cpu, ok["threads"].astype(str)))
    flash = {}
    for c, m, spec in zip(cost, machine, ok["spec"]):
        if str(spec).partition(":")[0] == "flash":
            flash.setdefault(m, []).append(c)
    return pd.Series([c / np.mean(flash[m]) if m in flash else math.nan
                      for c, m in zip(cost, machine)], index=ok.index), True


def processors(rows):
    """The processors (`cpu`) the ok rows name, in order of their count (most first), as
    training_cost reads them: beside named ones, rows that name none are one more processor
    ("not recorded"); rows that all name none give none."""
    if "cpu" not in rows.columns:
        return []
    cpu = rows.loc[rows["status"] == "ok", "cpu"].fillna("").astype(str).str.strip()
    if (cpu == "").all():
        return []
    return list(cpu.replace("", "not recorded").value_counts().index)


# --- speed over flash -----------------------------------------------------------------------
def timed_rows(ctx):
    """The causal float32 ok rows the speed columns compare: the timed input (gaussian by
    default), at the timed scale."""
    rows = ctx.all_ok[(ctx.all_ok["causal"] == 1) & (ctx.all_ok["input"] == ctx.input)]
    return ctx.of_scale(rows)


def match_specs(ctx, specs, known):
    """Per quality spec, the results spec that names the same variant with the same
    non-default parameters (the results spell every parameter out), or None."""
    def key(spec):
        name = str(spec).partition(":")[0]
        return name, frozenset(ctx.styles.changed(spec))
    by_key = {}
    for s in known:
        by_key.setdefault(key(s), s)
    return {s: (s if s in known else by_key.get(key(s))) for s in specs}


def nearest(ns, target):
    """The n of ns nearest target on a log scale (the larger on a tie)."""
    return min(ns, key=lambda n: (abs(math.log(n / target)), -n))


def speed_over_flash(ctx, rows, spec, pass_, target):
    """(flash's time over the spec's on the same problem, n) at the n nearest target that
    both have rows of `pass_` at, or None."""
    flash = [s for s in ctx.styles.order if s.partition(":")[0] == "flash"
             and ((rows["spec"] == s) & (rows["pass"] == pass_)).any()]
    if not flash or spec is None:
        return None
    mine = rows[(rows["spec"] == spec) & (rows["pass"] == pass_)]
    base = rows[(rows["spec"] == flash[0]) & (rows["pass"] == pass_)]
    keys = [c for c in ["batch", "heads", "kv_heads", "n", "m", "dim", "embed", "score",
                        "score_hidden", "scale", "seed", "threads", "key_padding", "attn_mask",
                        "dtype"] if c in rows.columns]
    both = mine.merge(base, on=keys, suffixes=("", "_flash"))
    both = both[(both["time_median_s"] > 0) & (both["time_median_s_flash"] > 0)]
    if both.empty:
        return None
    n = nearest(sorted(both["n"].unique()), target)
    at = both[both["n"] == n]
    return float((at["time_median_s_flash"] / at["time_median_s"]).median()), int(n)


def state_bytes(ctx, rows, spec, target):
    """(state per sequence after the prefill, n) of the spec's decode rows at the n nearest
    target, or None."""
    mine = rows[(rows["spec"] == spec) & (rows["pass"] == DECODE)]
    mine = mine[np.isfinite(mine["state_bytes"]) & (mine["state_bytes"] > 0)]
    if spec is None or mine.empty:
        return None
    n = nearest(sorted(mine["n"].unique()), target)
    return float(mine[mine["n"] == n]["state_bytes"].median()), int(n)


# --- the section ----------------------------------------------------------------------------
def section(ctx):
    recall = load(ctx, "recall.csv", RECALL_NEEDED, RECALL_NUMERIC)
    lm = load(ctx, "lm.csv", LM_NEEDED, LM_NUMERIC)
    ctx.quality_at = None
    if recall is None and lm is None:
        return
    if recall is not None:
        if "mode" not in recall.columns:
            recall["mode"] = "causal"
        recall["mode"] = recall["mode"].replace("", "causal")
        recall = mark_unmeasured(ctx, recall, "accuracy", "recall.csv")
        bad_setting = recall["seq"].isna() | recall["pairs"].isna()
        if bad_setting.any():
            ctx.note(f"quality: {int(bad_setting.sum())} row(s) of recall.csv without a "
                     f"numeric seq or pairs; left out")
            recall = recall[~bad_setting]
        recall = fill_settings(recall) if not recall.empty else None
    if lm is not None:
        lm = mark_unmeasured(ctx, lm, "uptrain_delta", "lm.csv")
    ctx.md.append(f"## {SECTION}\n")
    ctx.md.append(
        "What each variant costs a model trained with it (`scripts/quality.py`), beside its "
        "speed over flash. Every number is a mean over seeds with its spread (± the sample "
        "standard deviation, the seeds in parentheses; one seed is said as (1)).\n")
    settings = settings_of(recall) if recall is not None else []
    top = headline(settings) if settings else None
    if recall is not None:
        describe_recall(ctx, recall, settings)
    if lm is not None:
        describe_lm(ctx, lm)
    order = spec_order(ctx, recall, lm, top)
    ctx.quality_labels = spec_labels(ctx, order)
    rows = timed_rows(ctx)
    known = list(dict.fromkeys(rows["spec"]))
    matched = match_specs(ctx, order, known)
    if recall is not None:
        recall_table(ctx, recall, settings, order)
    # the speed columns at the n of the language rows (their context) when there are any,
    # else at the longest recall setting's length
    contexts = lm["context"].dropna().unique() if lm is not None and "context" in lm else []
    target = int(contexts[0]) if len(contexts) == 1 else (int(top[1]) if top else None)
    if target is None and len(contexts):
        target = int(max(contexts))
    language_speed_table(ctx, lm, order, rows, matched, target)
    if top is not None:
        figure(ctx, recall, top, settings, order, rows, matched)
    ctx.quality_at = len(ctx.md)
    ctx.md.append("\n")


def spec_labels(ctx, specs):
    """Each spec's label (its name and the parameters that differ from the defaults), or the
    spec as written where two specs of the section share a label (local and local:window=256,
    the default written out: two sets of rows)."""
    labels = {s: ctx.styles.label(s) for s in specs}
    counts = Counter(labels.values())
    return {s: (s if counts[text] > 1 else text) for s, text in labels.items()}


def spec_label(ctx, spec):
    return getattr(ctx, "quality_labels", {}).get(spec) or ctx.styles.label(spec)


def spec_order(ctx, recall, lm, top):
    """Exact variants first, then by the mean recall accuracy at the headline setting (best
    first), then the variants without recall rows by their Δ bits per byte after uptraining."""
    specs = list(dict.fromkeys(list(recall["spec"] if recall is not None else []) +
                               list(lm["spec"] if lm is not None else [])))

    def key(spec):
        acc = math.nan
        if recall is not None and top is not None:
            ok = select(recall, top)
            ok = ok[(ok["spec"] == spec) & (ok["status"] == "ok")]
            if not ok.empty:
                acc = float(ok["accuracy"].mean())
        delta = math.nan
        if lm is not None:
            ok = lm[(lm["spec"] == spec) & (lm["status"] == "ok")]
            if not ok.empty:
                delta = float(ok["uptrain_delta"].mean())
        return (ctx.styles.family(spec) != "exact", math.isnan(acc),
                -acc if not math.isnan(acc) else 0.0, math.isnan(delta),
                delta if not math.isnan(delta) else 0.0, specs.index(spec))
    return sorted(specs, key=key)


def count_text(values):
    """The distinct finite values as '400' or '400/800' (thousands separated), '' for none."""
    values = sorted({int(v) for v in values if np.isfinite(v)})
    return "/".join(f"{v:,}" for v in values)


def clause(template, *columns):
    """template formatted with the count_text of each column, or '' when one has no value."""
    texts = [count_text(c) for c in columns]
    return template.format(*texts) if all(texts) else ""


def describe_recall(ctx, recall, settings):
    seeds = recall.groupby(["spec"] + SETTING, dropna=False)["seed"].nunique()
    parts = []
    for s in settings:
        rows = select(recall, s)
        values = dict(zip(SETTING, s))
        inner = [x for x in (
            clause("every query at least {} positions after its key", rows["min_distance"]),
            clause("{} steps of {} sequences", rows["steps"], rows["batch"]),
            clause("{} tokens", rows["tokens"])) if x]
        parts.append(f"{values['mode']} n = {int(values['seq'])} with P = "
                     f"{int(values['pairs'])} pairs" + (f" ({'; '.join(inner)})" if inner else ""))
    seed_range = f"{seeds.min()}" if seeds.min() == seeds.max() else \
        f"{seeds.min()} to {seeds.max()}"
    ctx.md.append(
        "\n**Recall** (multi-query associative recall, `scripts/attnbench_recall.py`): a "
        "sequence holds P key-value pairs at its start and asks for the values of those keys "
        "in its last n/4 − 2P positions; a 2-block model"
        + clause(" of width {}", recall["width"]) +
        f" is trained from scratch with every attention the variant, the same budget for every "
        f"variant, and scored by its accuracy on held-out sequences (chance {CHANCE:.3f}, "
        f"1/64)" + ("; in the bidirectional form every position sees the whole sequence and "
                    "each pair takes one position (its key's and value's embeddings summed)"
                    if any(s[0] == "bidirectional" for s in settings) else "") +
        ". Settings: " + "; ".join(parts) +
        f". Seeds per variant and setting: {seed_range}.\n")


def describe_lm(ctx, lm):
    ok = lm[lm["status"] == "ok"]
    base = ok["base_bpb"].dropna().unique()
    ctx.md.append(
        "\n**Language** (the byte model of `scripts/train_lm.py`"
        + (f", {float(np.mean(base)):.3f} bits per byte with its own exact attention"
           if len(base) else "")
        + clause(", on {} held-out windows of {} bytes", ok["eval_windows"], ok["context"])
        + "): Δ before is the increase in bits per byte when the variant replaces every "
        "layer's attention without retraining; Δ after, the increase after "
        + (clause("{} uptraining steps", ok["uptrain_steps"]) or "uptraining")
        + clause(" ({} tokens)", ok["uptrain_tokens"]) +
        " with it in place, over flash uptrained the same way with the same seed; recovered "
        "= 1 − after / before.\n")


def recall_table(ctx, recall, settings, order):
    notes = Notes()
    top = headline(settings)
    cost, relative = training_cost(select(recall, top))
    out = []
    for spec in order:
        mine = recall[recall["spec"] == spec]
        if mine.empty:
            continue
        cells = []
        for s in settings:
            rows = select(mine, s)
            cells.append(recall_cell(rows, notes) if not rows.empty else "")
        values = cost[cost.index.isin(mine.index)]
        cells.append(spread(values, (lambda x: f"{x:.2f}×") if relative else
                            (lambda x: f"{x:.3g}"), count=False))
        out.append([code(spec_label(ctx, spec))] + cells)
    heads = ["variant"] + [setting_label(s, settings) for s in settings] + \
        ["train time × flash" if relative else "train µs/token"]
    timed = any(r[-1] for r in out)
    if not timed:  # no training times in recall.csv
        heads, out = heads[:-1], [r[:-1] for r in out]
    cpus = processors(select(recall, top))
    where = f" on {cpus[0]}" if len(cpus) == 1 else ""
    ctx.md.append("\n### Recall accuracy\n\nMean ± sd (seeds) per setting" +
                  ((f"; the last column is the training time per token at "
                    f"{setting_label(top, settings)} over flash's on the same processor "
                    f"(mean ± sd): the rows were trained on {len(cpus)} processors "
                    f"({', '.join(cpus)}), whose seconds are not comparable"
                    if relative else
                    f"; the last column is the training time per token at "
                    f"{setting_label(top, settings)} (µs, train_s / tokens, mean ± sd{where})")
                   if timed else "") + ".\n\n")
    ctx.md.append(md_table(heads, out))
    ctx.md.append(notes.text())


def language_speed_table(ctx, lm, order, rows, matched, target):
    """Per variant: Δ bits per byte before and after uptraining and recovered (lm.csv), and the
    speed over flash of each pass at the n nearest target (results.csv); a spec with neither
    (a recall budget setting) is left out."""
    notes = Notes()
    out, other_n = [], set()
    speed_any = False
    for spec in order:
        cells = []
        timed = False
        if lm is not None:
            mine = lm[lm["spec"] == spec]
            ok = mine[mine["status"] == "ok"]
            if mine.empty:
                cells += ["", "", ""]
            elif ok.empty:
                cells += [notes.mark("/".join(dict.fromkeys(mine["status"])),
                                     mine["message"]), "", ""]
            else:
                one = ok["seed"].nunique() == 1
                after = spread(ok["uptrain_delta"], lambda x: f"{x:+.3f}")
                after = after.replace(" (1)", " (1 seed)") if one else after
                bad = mine[mine["status"] != "ok"]
                if not bad.empty:
                    after = after[:-1] + "; " + notes.mark(
                        f"{len(bad)} {'/'.join(dict.fromkeys(bad['status']))}",
                        bad["message"]) + ")"
                cells += [spread(ok["swap_delta"], lambda x: f"{x:+.3f}", count=False),
                          after,
                          spread(ok["recovered"] * 100, lambda x: f"{x:.0f}%", count=False)]
        for pass_, _ in SPEED_PASSES:
            got = speed_over_flash(ctx, rows, matched.get(spec), pass_, target) \
                if target else None
            if got is None:
                cells.append("—")
                continue
            speed_any = timed = True
            ratio, n = got
            cells.append(f"{ratio:.2f}×" + ("" if n == target else f" (n={fmt_n(n)})"))
            if n != target:
                other_n.add(n)
        # a spec of recall alone (a budget setting) without lm rows or timed rows: nothing to say
        if lm is not None and mine.empty and not timed:
            continue
        out.append([code(spec_label(ctx, spec))] + cells)
    if lm is None and not speed_any:
        ctx.md.append("\nNo speed over flash: results.csv holds no causal rows of these "
                      "variants beside flash's on the same problem.\n")
        return
    heads = (["Δ bpb before", "Δ bpb after", "recovered"] if lm is not None else []) + \
        [f"{name} × flash" for _, name in SPEED_PASSES]
    ctx.md.append(("\n### Language and speed\n\n" if lm is not None else "\n### Speed\n\n"))
    speed_text = (
        f"Speed: flash's median time over the variant's on the same causal problem (input "
        f"`{ctx.input}`, results.csv) at n = {fmt_n(target)}" +
        (" or, where marked, at the nearest n measured" if other_n else "") +
        "; decode is one generation step after a prefill of n tokens. — : no such rows."
        if target else "Speed: no recall or language length to compare at.")
    if not speed_any and target:
        speed_text += " No row of these variants (or of flash) was timed: the speed columns " \
                      "are empty."
    ctx.md.append(speed_text + "\n\n")
    ctx.md.append(md_table(["variant"] + heads, out))
    ctx.md.append(notes.text())


def figure(ctx, recall, top, settings, order, rows, matched):
    """recall_throughput: accuracy at the headline setting against the decode state per
    sequence and against the training time per token."""
    at = select(recall, top)
    costs, relative = training_cost(at)
    points = []
    for spec in order:
        mine = at[at["spec"] == spec]
        ok = mine[mine["status"] == "ok"]
        if ok.empty:
            continue
        acc = ok["accuracy"].to_numpy(dtype=float)
        cost = costs[costs.index.isin(mine.index)].dropna()
        state = state_bytes(ctx, rows, matched.get(spec), top[1])
        points.append(dict(spec=spec, mean=float(acc.mean()), lo=float(acc.min()),
                           hi=float(acc.max()), seeds=len(acc),
                           state=state[0] if state else None, state_n=state[1] if state else None,
                           cost=float(cost.mean()) if len(cost) else None))
    if not points:
        return
    label = setting_label(top, settings)
    fig, axes = new_grid(1, 2, sharey=True)
    panels = [(axes[0][0], "state", "decode state per sequence (log)"),
              (axes[0][1], "cost", "training time per token over flash's on the same "
                                   "processor (log)" if relative else
                                   "training time per token (µs, log)")]

    drawn = {}
    for ax, key, xlabel in panels:
        mine = [p for p in points if p[key] is not None and p[key] > 0]
        for p in mine:
            ax.errorbar([p[key]], [p["mean"]], yerr=[[p["mean"] - p["lo"]], [p["hi"] - p["mean"]]],
                        linestyle="none", capsize=2.5, markersize=6, elinewidth=1.0,
                        **ctx.styles(p["spec"], line=False))
        ax.axhline(CHANCE, color="0.35", linestyle="--", linewidth=1.0)
        ax.set_xscale("log")
        # readable ticks over the few decades these span: powers of 4 bytes (B, KiB, MiB),
        # 1-2-5 microseconds
        if key == "state":
            ax.xaxis.set_major_locator(ticker.LogLocator(base=4.0))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: fmt_bytes(x)))
        else:
            ax.xaxis.set_major_locator(ticker.LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylim(-0.05, 1.08)
        ax.grid(True, alpha=0.3, which="both")
        if mine:
            xs = [p[key] for p in mine]
            lo, hi = min(xs), max(xs)
            ax.set_xlim(lo / 2.0, hi * (4.0 if hi > lo else 8.0))
        else:
            ax.xaxis.set_major_locator(ticker.NullLocator())
            ax.xaxis.set_minor_locator(ticker.NullLocator())
            ax.text(0.5, 0.5, "no " + ("decode rows in results.csv" if key == "state"
                                      else "training times in recall.csv"),
                    transform=ax.transAxes, ha="center", va="center", color="0.4")
        drawn[key] = mine
    axes[0][0].set_ylabel(f"recall accuracy at {label}")
    chance = [ax.text(0.99, CHANCE, "chance (1/64)", transform=ax.get_yaxis_transform(),
                      ha="right", va="bottom", fontsize=7, color="0.35")
              for ax, _, _ in panels]
    title = f"Recall accuracy against decode state and training cost ({label})"
    fig.suptitle(title, fontsize=10.5)
    freeze_layout(fig)
    renderer = fig.canvas.get_renderer()
    unlabelled = []
    for (ax, key, _), words in zip(panels, chance):
        mine = drawn[key]
        if not mine:
            continue
        # the labels keep off the chance line and its words
        frame = ax.get_window_extent(renderer)
        y = ax.transData.transform((1.0, CHANCE))[1]
        pt = fig.dpi / 72.0
        box = words.get_window_extent(renderer)
        avoid = [(frame.x0, y - 1.5 * pt, frame.x1, y + 1.5 * pt),
                 (box.x0, box.y0, box.x1, box.y1)]
        placed = place_labels(ax, [(p[key], p["mean"]) for p in mine],
                              [spec_label(ctx, p["spec"]) for p in mine], avoid=avoid)
        unlabelled += [p["spec"] for p, done in zip(mine, placed) if not done]
    handles = [ctx.styles.handle(s, line=False) for s in dict.fromkeys(unlabelled)]
    missing = [p["spec"] for p in points if p["state"] is None]
    notes = ([f"Left panel leaves out (no decode rows in results.csv): "
              f"{', '.join(spec_label(ctx, s) for s in missing)}"] if missing else [])
    ctx.record("recall_throughput", setting=label,
               points=[{k: p[k] for k in ("spec", "mean", "lo", "hi", "seeds", "state",
                                          "state_n", "cost")} for p in points],
               legend=[h.get_label() for h in handles], notes=notes)
    finish(fig, ctx.fig_path("recall_throughput"), handles, title, notes=notes)
    ns = sorted({p["state_n"] for p in points if p["state_n"]})
    ctx.md.append("\n### Recall against throughput\n\n")
    ctx.embed("recall_throughput", "recall accuracy against decode state and training time")
    ctx.md.append(
        f"Recall accuracy at {label} (mean over seeds, bars from the lowest to the highest "
        f"seed) against the decode state per sequence after a prefill of "
        f"{', '.join(fmt_n(n) for n in ns) or 'n'} tokens (results.csv, `state_bytes`; "
        f"left) and against the training time per token of the recall runs (right" +
        (", over flash's on the processor that trained the run: the runs were trained on "
         "several" if relative else "") + "). The "
        "dashed line is chance (1/64). Up and to the left is better: more recall for less "
        "state or less training time." +
        (f" Without decode rows: {', '.join(code(spec_label(ctx, s)) for s in missing)}."
         if missing else "") + "\n")
    states = [p for p in points if p["state"]]
    if states:
        ctx.md.append("\nState per sequence: " + ", ".join(
            f"{code(ctx.styles.label(p['spec']))} {fmt_bytes(p['state'])}" for p in states) +
            ".\n")


def frontier(ctx, figures):
    """After every section is drawn: the budget frontier figure, referenced at the end of the
    Quality section when this run drew it (or it is a file the report does not manage)."""
    at = getattr(ctx, "quality_at", None)
    if at is None:
        return
    path = ctx.fig_path(FRONTIER)
    from .style import SAVED
    if not os.path.exists(path) or (FRONTIER in figures and os.path.abspath(path) not in SAVED):
        return
    ctx.md.insert(at, f"\n### Budget frontier\n\n![budget frontier](plots/{FRONTIER}.png)\n")
