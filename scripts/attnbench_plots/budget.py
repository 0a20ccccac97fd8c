"""Error against budget: each approximation run at several settings of the parameter that sets
how much work it does (its budget: a window, a number of features, landmarks, clusters, ...) on
the trained model's inputs at n = BUDGET_N (scripts/quality_sweep.sh runs them), and what those
settings buy:

  budget    a row of three small panels per series: median time, relative error and mean
            cosine against the parameter's value, flash's time as a reference line
  frontier  time against error, a point per setting labelled with it (e.g. "window=128"), the
            settings of one series joined in order, a panel per causal setting

A series is the specs of one variant that differ only in one of its budget parameters
(BUDGET_PARAMETERS) and take at least two numeric values of it, on ok forward float32 rows at
n = BUDGET_N with input trained:layer=L, all of one causal setting. Each point is the mean over
the trained layers every setting of its series was measured on (flash's reference time too).
Results without such a series get neither figure nor section.
"""

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import (FixedLocator, FuncFormatter, LogLocator, NullFormatter,
                               NullLocator)

from attnbench_results import format_seconds

from .error import ZERO_ERROR, ZERO_STYLE
from .style import (ERROR_LABEL, FAMILY_LINESTYLE, MARKERS, _same_value, _split_spec,
                    causal_name, code, finish, fmt_n, fmt_sci, freeze_layout, jsonable, md_table,
                    place_labels)

FIGURES = ["budget", "frontier"]
SECTION = "Error against budget"
BUDGET_N = 4096
TRAINED = "trained:"
EXACT = "flash"  # the exact baseline whose time is the reference line
# The parameters that set each approximation's budget, as `attnbench list` names them; the
# values scripts/quality_sweep.sh sweeps them over are chosen there.
BUDGET_PARAMETERS = {
    "local": ["window"], "longformer": ["window"],
    "bigbird": ["window_blocks", "random_blocks"], "performer": ["features"],
    "rfa": ["features"], "linformer": ["proj"], "nystrom": ["landmarks"],
    "reformer": ["buckets", "hashes"], "routing": ["clusters"], "clustered": ["clusters"],
    "moba": ["topk"], "nsa": ["sel_top"], "compressed": ["ratio"], "sinkhorn": ["block"],
}
FLASH_STYLE = {"color": "0.3", "linestyle": (0, (5, 3)), "linewidth": 1.1}
LABEL_SIZE = 6.0  # the frontier's setting labels
SMALL_W, SMALL_H = 2.35, 1.75  # one panel of the budget figure, inches
SERIES_PER_ROW = 2


def _number(text):
    """The parameter value as a float, None when it is not a finite number ("none", "8+16")."""
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def value_text(x):
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


class Series:
    """One variant at several values of one budget parameter, its other parameters fixed."""

    def __init__(self, name, param, causal, others, label):
        self.name, self.param, self.causal, self.others = name, param, causal, others
        self.label = label
        self.points = []  # (value, spec, time, error, cosine), sorted by value
        self.layers = []
        self.flash_time = None
        self.style = {}

    def record(self):
        return {"variant": self.name, "param": self.param, "causal": int(self.causal),
                "label": self.label, "layers": self.layers,
                "values": [p[0] for p in self.points], "specs": [p[1] for p in self.points],
                "time": jsonable(p[2] for p in self.points),
                "error": jsonable(p[3] for p in self.points),
                "cosine": jsonable(p[4] for p in self.points),
                "flash_time": self.flash_time}


def budget_rows(ctx):
    """The rows budget series are drawn from: ok forward float32 rows at n = BUDGET_N on the
    trained model's inputs."""
    ok = ctx.ok
    rows = ok[(ok["n"] == BUDGET_N) & ok["input"].astype(str).str.startswith(TRAINED)].copy()
    cos = rows["mean_cosine"] if "mean_cosine" in rows.columns else np.nan
    rows["mean_cosine"] = pd.to_numeric(cos, errors="coerce")
    rows["variant_name"] = [_split_spec(s)[0] for s in rows["spec"]]
    return rows


def find_series(ctx, rows):
    """Every series in `rows`, the causal ones first, each in the order of BUDGET_PARAMETERS,
    with its points (sorted by value) averaged over the layers every one of its settings has."""
    found = []
    for name, params in BUDGET_PARAMETERS.items():
        mine = rows[rows["variant_name"] == name]
        if mine.empty:
            continue
        specs = list(dict.fromkeys(mine["spec"]))
        for param in params:
            groups = {}
            for spec in specs:
                pairs = _split_spec(spec)[1]
                value = dict(pairs).get(param)
                x = _number(value) if value is not None else None
                if x is None:
                    continue
                others = tuple((k, v) for k, v in pairs if k != param)
                for causal in sorted(mine.loc[mine["spec"] == spec, "causal"].unique()):
                    groups.setdefault((int(causal), others), {})[x] = spec
            for (causal, others), by_value in groups.items():
                if len(by_value) < 2:
                    continue
                s = make_series(ctx, rows, name, param, causal, others, by_value)
                if s is not None:
                    found.append(s)
    found.sort(key=lambda s: -s.causal)  # the causal series first: the model is causal
    return found


def make_series(ctx, rows, name, param, causal, others, by_value):
    """The series of `name` over `param` (`by_value`: value -> spec) with its other parameters
    `others`, at one causal setting: its points and flash's time, the means over the layers
    every setting has; None (and a note) when they share none."""
    defaults = ctx.styles.defaults.get(name, {})
    changed = [f"{k}={v}" for k, v in others
               if k not in defaults or not _same_value(v, defaults[k])]
    label = f"{name}: {param}" + (f" ({', '.join(changed)})" if changed else "")
    at = rows[rows["causal"] == causal]
    layer_sets = [set(at.loc[at["spec"] == spec, "input"]) for spec in by_value.values()]
    layers = sorted(set.intersection(*layer_sets), key=lambda s: (len(s), s))
    if not layers:
        ctx.note(f"budget: {label} ({causal_name(causal)}) has no trained layer every setting "
                 f"was measured on; left out")
        return None
    s = Series(name, param, causal, others, label)
    s.layers = layers
    on = at[at["input"].isin(layers)]
    for x in sorted(by_value):
        r = on[on["spec"] == by_value[x]]
        s.points.append((x, by_value[x], float(r["time_median_s"].mean()),
                         float(r["rel_fro_error"].mean()), float(r["mean_cosine"].mean())))
    flash = on[on["variant_name"] == EXACT]
    if not flash.empty and set(flash["input"]) >= set(layers):
        # the default flash spec when the results hold several
        pick = sorted(flash["spec"].unique(), key=lambda sp: (len(ctx.styles.changed(sp)), sp))
        s.flash_time = float(flash[flash["spec"] == pick[0]]["time_median_s"].mean())
    return s


def assign_styles(ctx, series):
    """Each series in its variant's colour; a variant's second budget parameter takes another
    marker and a dashed line (the same parameter in the other causal setting, in its own
    panel, keeps its style)."""
    params = {}
    for s in series:
        mine = params.setdefault(s.name, [])
        if s.param not in mine:
            mine.append(s.param)
        k = mine.index(s.param)
        base = ctx.styles(s.name, line=False)
        marker = base["marker"] if k == 0 else \
            MARKERS[(MARKERS.index(base["marker"]) + 3 * k) % len(MARKERS)]
        s.style = {"color": base["color"], "marker": marker,
                   "linestyle": "-" if k == 0 else FAMILY_LINESTYLE["pattern"]}


def value_axis(ax, values, param):
    """The parameter's axis: base-2 logarithmic when its values are positive and span a factor
    of 4 or more, else linear; ticks at the values measured."""
    vals = sorted(values)
    if vals[0] > 0 and vals[-1] / vals[0] >= 4:
        ax.set_xscale("log", base=2)
        ax.set_xlim(vals[0] / 1.4, vals[-1] * 1.4)
    else:
        pad = (vals[-1] - vals[0]) * 0.08 or 0.5
        ax.set_xlim(vals[0] - pad, vals[-1] + pad)
    ax.xaxis.set_major_locator(FixedLocator(vals))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: value_text(x)))
    ax.tick_params(axis="x", labelsize=6.5, labelrotation=45 if len(vals) > 5 else 0)
    ax.set_xlabel(param, fontsize=7.5)


def log_y(ax):
    """A logarithmic y axis with ticks at 1, 2 and 5 times the powers of ten, in plain
    numbers (a panel's range is often less than a decade)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def budget_figure(ctx, series):
    per_row = min(SERIES_PER_ROW, len(series))
    nrows = math.ceil(len(series) / per_row)
    ncols = 3 * per_row
    fig, axes = plt.subplots(nrows, ncols, figsize=(SMALL_W * ncols, SMALL_H * nrows + 0.4),
                             squeeze=False, layout="constrained")
    with_flash = False
    for i, s in enumerate(series):
        row, first = i // per_row, 3 * (i % per_row)
        xs = [p[0] for p in s.points]
        for j, (col, ylabel) in enumerate(((2, "time (s)"), (3, "rel. error"),
                                           (4, "mean cosine"))):
            ax = axes[row][first + j]
            ys = np.array([p[col] for p in s.points], dtype=float)
            ax.plot(xs, ys, markersize=4, linewidth=1.1, **s.style)
            value_axis(ax, xs, s.param)
            ax.tick_params(axis="y", labelsize=6.5)
            ax.set_ylabel(ylabel, fontsize=7.5)
            ax.grid(True, alpha=0.25, which="both")
            if j == 0:
                log_y(ax)
                if s.flash_time:
                    ax.axhline(s.flash_time, zorder=1.5, **FLASH_STYLE)
                    with_flash = True
                ax.set_title(f"{s.label}, {causal_name(s.causal)}", fontsize=8, loc="left")
            elif j == 1:
                if (ys > 0).all():
                    log_y(ax)
                ax.axhline(ZERO_ERROR, zorder=1.5, **ZERO_STYLE)
    for k in range(len(series), nrows * per_row):
        for j in range(3):
            axes[k // per_row][3 * (k % per_row) + j].set_visible(False)
    handles = [Line2D([], [], label=f"{EXACT} (exact): its time on the same inputs",
                      **FLASH_STYLE)] if with_flash else []
    handles.append(Line2D([], [], label="zero output (error 1)", **ZERO_STYLE))
    title = (f"Time, error and mean cosine against the budget (trained inputs, n = "
             f"{fmt_n(BUDGET_N)}, mean over layers)")
    ctx.record("budget", n=BUDGET_N, series=[s.record() for s in series],
               legend=[h.get_label() for h in handles])
    finish(fig, ctx.fig_path("budget"), handles, title)


def frontier_figure(ctx, series):
    causals = sorted({s.causal for s in series}, reverse=True)  # causal first: the model's own
    fig, axes = plt.subplots(1, len(causals), figsize=(7.2 * len(causals), 6.2), squeeze=False,
                             layout="constrained")
    records, unlabelled = [], []
    drawn = []
    for ax, causal in zip(axes[0], causals):
        mine = [s for s in series if s.causal == causal]
        errs, times = [ZERO_ERROR], []
        for s in mine:
            e = [p[3] for p in s.points]
            t = [p[2] for p in s.points]
            ax.plot(e, t, markersize=4.5, linewidth=1.0, alpha=0.9, **s.style)
            errs += e
            times += t
        flash = [s.flash_time for s in mine if s.flash_time]
        if flash:
            ft = float(np.median(flash))
            ax.axhline(ft, zorder=1.5, **FLASH_STYLE)
            times.append(ft)
        ax.axvline(ZERO_ERROR, zorder=1.5, **ZERO_STYLE)
        ax.set_xscale("log")
        ax.set_yscale("log")
        pos = [x for x in errs if x > 0]
        ax.set_xlim(min(pos) / 1.6, max(pos) * 1.6)
        ax.set_ylim(min(times) / 1.6, max(times) * 1.6)
        ax.set_xlabel(ERROR_LABEL)
        ax.set_ylabel("median time (s)")
        ax.grid(True, alpha=0.25, which="both")
        ax.set_title(f"{causal_name(causal)}, trained inputs, n = {fmt_n(BUDGET_N)}")
        drawn.append((ax, mine, flash))
    title = "Time against error over each approximation's budget (mean over layers)"
    fig.suptitle(title, fontsize=10.5)  # before the layout is frozen, so that it has room
    freeze_layout(fig)
    for ax, mine, flash in drawn:
        pts = [(p[3], p[2]) for s in mine for p in s.points]
        texts = [f"{s.param}={value_text(p[0])}" for s in mine for p in s.points]
        placed = place_labels(ax, pts, texts, fontsize=LABEL_SIZE, reaches=(1.0, 2.0, 3.5))
        k = 0
        panel = []
        for s in mine:
            pr = []
            for p in s.points:
                pr.append({"value": p[0], "error": p[3], "time": p[2],
                           "text": texts[k], "label": "direct" if placed[k] else "none"})
                if not placed[k]:
                    unlabelled.append(f"{s.name} {texts[k]}")
                k += 1
            panel.append({"variant": s.name, "param": s.param, "label": s.label,
                          "points": pr})
        records.append({"causal": int(mine[0].causal), "series": panel,
                        "flash_time": float(np.median(flash)) if flash else None})
    # one legend entry per label (a series in both causal settings is drawn alike in both)
    firsts = {s.label: s for s in reversed(series)}
    handles = [Line2D([], [], markersize=5, label=s.label, **s.style)
               for s in series if firsts[s.label] is s]
    if any(r["flash_time"] for r in records):
        handles.append(Line2D([], [], label=f"{EXACT} (exact)", **FLASH_STYLE))
    handles.append(Line2D([], [], label="zero output (error 1)", **ZERO_STYLE))
    notes = ["Settings without a label (no room beside their point): " +
             "; ".join(unlabelled) + "."] if unlabelled else []
    ctx.record("frontier", n=BUDGET_N, panels=records, legend=[h.get_label() for h in handles],
               unlabelled=unlabelled)
    finish(fig, ctx.fig_path("frontier"), handles, title, notes=notes)


def _range(values, fmt):
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    return fmt(lo) if lo == hi else f"{fmt(lo)} – {fmt(hi)}"


def section(ctx):
    rows = budget_rows(ctx)
    if rows.empty:
        return
    series = find_series(ctx, rows)
    if not series:
        return
    assign_styles(ctx, series)
    budget_figure(ctx, series)
    frontier_figure(ctx, series)
    layers = sorted({x for s in series for x in s.layers}, key=lambda s: (len(s), s))
    ctx.md.append(f"## {SECTION}\n")
    ctx.md.append(
        f"Each approximation at several settings of its budget parameter, on the trained "
        f"model's q, k and v at n = {BUDGET_N} ({', '.join(code(x) for x in layers)}; each "
        f"point is the mean over the layers every setting of its series ran on), causal where "
        f"the variant can be, non-causal where it cannot (`scripts/quality_sweep.sh`). The "
        f"error is `rel_fro_error`; the mean cosine (`mean_cosine`) is the mean over query rows "
        f"of the cosine between the row and exact attention's; 1 is exact.\n")
    ctx.embed("budget", "time, error and mean cosine against the budget")
    ctx.embed("frontier", "time against error over the budget settings")
    table = []
    for s in series:
        table.append([code(s.label), causal_name(s.causal),
                      ", ".join(value_text(p[0]) for p in s.points),
                      _range([p[3] for p in s.points], fmt_sci),
                      _range([p[4] for p in s.points], lambda x: f"{x:.3f}"),
                      _range([p[2] for p in s.points], format_seconds),
                      format_seconds(s.flash_time) if s.flash_time else ""])
    ctx.md.append(md_table(["variant: parameter", "masking", "settings", "rel. error",
                            "mean cosine", "time", f"{EXACT} time"], table))
    ctx.md.append("\n")
