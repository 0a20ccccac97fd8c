"""Error against n (one panel per input distribution and causal setting that has rows) and
speed against error at one n, with the Pareto frontier of the variants that beat doing nothing.

Every error figure draws two references: the error of a zero output, which is 1 by the
definition of the relative error, and, where results.csv has the `uniform_error` column, the
error of the output that averages v over the keys each query may see (the same for every
variant of a problem, so its median over the problem's rows is drawn)."""

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.transforms import blended_transform_factory

from attnbench_results import UNIFORM_ERROR, ResultsError, format_seconds

from .style import (ERROR_LABEL, PANEL_H, PANEL_W, code, finish, fmt_n, fmt_sci, freeze_layout,
                    jsonable, log2_n_axis, md_table, pad_log_limits, place_labels,
                    series)

ZERO_ERROR = 1.0  # ||0 - O_ref|| / ||O_ref||
REFERENCE_COLOR = "0.35"
ZERO_STYLE = {"color": REFERENCE_COLOR, "linestyle": "-", "linewidth": 1.1}
UNIFORM_STYLE = {"color": "0.2", "linestyle": (0, (4, 2)), "linewidth": 1.8}
LINE_LABEL = {"fontsize": 7, "color": REFERENCE_COLOR, "zorder": 4,
              "bbox": {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.0}}
WORSE_SHADE = {"color": "#d62728", "alpha": 0.06, "linewidth": 0}
PALE_ALPHA = 0.28  # points that do not beat doing nothing
REFERENCE_HANDLES = {
    "zero": Line2D([], [], label="zero output (error 1)", **ZERO_STYLE),
    "uniform": Line2D([], [], label="uniform average over the visible keys", **UNIFORM_STYLE),
}


def pick_speed_error_n(ok, requested):
    """The n for speed-vs-error: the requested one, or the largest n at which more than half of
    the specs with ok rows have one."""
    counts = ok.groupby("n")["spec"].nunique()
    if requested is not None:
        if requested not in counts.index:
            raise ResultsError(f"--n {requested}: no ok row has n={requested}; measured n: "
                               f"{', '.join(str(int(n)) for n in counts.index)}")
        return requested
    total = ok["spec"].nunique()
    most = counts[counts * 2 > total]
    return int(most.index.max()) if len(most) else int(counts.idxmax())


def pareto(points):
    """Indices of the (error, time) points no other point beats in both (lower is better)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def uniform_series(sub):
    """(n, error of the uniform average) of a panel's rows: the median over the rows of each
    n; empty when results.csv has no uniform_error column or no value."""
    if UNIFORM_ERROR not in sub.columns:
        return np.array([]), np.array([])
    s = sub[np.isfinite(sub[UNIFORM_ERROR]) & (sub[UNIFORM_ERROR] > 0)]
    g = s.groupby("n")[UNIFORM_ERROR].median()
    return g.index.to_numpy(dtype=float), g.to_numpy(dtype=float)


def grid_shape(count):
    """(rows, columns) for `count` panels: one row up to three, else the width among 3, 2 and
    4 (in that order of preference) that leaves the fewest cells spare (the legend takes the
    spare cells)."""
    if count <= 3:
        return 1, max(count, 1)
    widths = (3, 2, 4)
    ncol = min(widths, key=lambda c: (math.ceil(count / c) * c - count, widths.index(c)))
    return math.ceil(count / ncol), ncol


def panel_grid(count):
    """A figure with `count` panels sharing the y axis, filled row by row, and the axes of the
    spare cells at the end of the last row merged into one for the legend (None when there
    are none), so that no cell is left empty."""
    rows, ncol = grid_shape(count)
    fig = plt.figure(figsize=(PANEL_W * ncol, PANEL_H * rows), layout="constrained")
    gs = fig.add_gridspec(rows, ncol)
    axes = []
    for i in range(count):
        axes.append(fig.add_subplot(gs[i // ncol, i % ncol],
                                    sharey=axes[0] if axes else None))
    spare = rows * ncol - count
    legend_ax = fig.add_subplot(gs[rows - 1, ncol - spare:]) if spare else None
    return fig, axes, legend_ax, ncol


def reference_lines(ax, uniform_n, uniform_y):
    """The zero output's error (1, labelled on the line) and the uniform average's, with the
    region worse than a zero output shaded."""
    ax.axhline(ZERO_ERROR, zorder=1.5, **ZERO_STYLE)
    ax.text(0.99, ZERO_ERROR, "zero output", va="center", ha="right",
            transform=blended_transform_factory(ax.transAxes, ax.transData), **LINE_LABEL)
    ax.axhspan(ZERO_ERROR, 1e12, zorder=0, **WORSE_SHADE)  # the y limits are set afterwards
    if len(uniform_n):
        ax.plot(uniform_n, uniform_y, zorder=3.5, **UNIFORM_STYLE)
        ax.text(uniform_n[0], uniform_y[0], "uniform average", va="top", ha="left",
                **LINE_LABEL)


def error_vs_n(ctx):
    lay = ctx.layout
    rows_ = [(cfg, causal) for cfg in lay.configs for causal in lay.causals]
    # One panel per (configuration, causal setting, input distribution) that has a drawable
    # row; nothing else takes a cell.
    panels = []
    for cfg, causal in rows_:
        for inp in lay.inputs:
            sub = lay.select(ctx.ok, cfg, causal, inp)
            if (sub["rel_fro_error"] > 0).any():
                panels.append((cfg, causal, inp))
    fig, axes, legend_ax, ncol = panel_grid(len(panels))
    present, dropped, records, with_uniform = set(), [], [], False
    lo, hi = [ZERO_ERROR], [ZERO_ERROR]
    for i, (cfg, causal, inp) in enumerate(panels):
        ax = axes[i]
        sub = lay.select(ctx.ok, cfg, causal, inp)
        lines = []
        for spec in ctx.styles.order:
            s = sub[sub["spec"] == spec]
            if s.empty:
                continue
            if (s["rel_fro_error"].isna() | (s["rel_fro_error"] <= 0)).any():
                dropped.append(spec)
            ns, ys = series(sub, spec, "rel_fro_error")
            if len(ns):
                ax.plot(ns, ys, label=ctx.styles.label(spec), **ctx.styles(spec))
                present.add(spec)
                lines.append({"spec": spec, "n": jsonable(ns), "y": jsonable(ys)})
                lo.append(ys.min())
                hi.append(ys.max())
        un, uy = uniform_series(sub)
        reference_lines(ax, un, uy)
        if len(un):
            with_uniform = True
            lo.append(uy.min())
            hi.append(uy.max())
        ax.set_yscale("log")
        log2_n_axis(ax, sub["n"].unique())
        title = f"input={inp}, {ctx.panel_title(cfg, causal)}"
        ax.set_title(title)
        if i % ncol == 0:
            ax.set_ylabel(ERROR_LABEL)
        records.append({"title": title, "input": inp, "causal": int(causal), "lines": lines,
                        "zero_output": ZERO_ERROR,
                        "uniform": {"n": jsonable(un), "y": jsonable(uy)} if len(un) else None})
    if panels:
        # the data and both references, a little room around them, nothing more
        axes[0].set_ylim(min(lo) / 2.0, max(hi) * 2.0)
    handles = [ctx.styles.handle(s) for s in ctx.styles.order if s in present]
    handles += ctx.styles.family_handles([s for s in ctx.styles.order if s in present])
    handles.append(REFERENCE_HANDLES["zero"])
    if with_uniform:
        handles.append(REFERENCE_HANDLES["uniform"])
    fixed = ctx.layout.fixed_label()
    ctx.record("error_vs_n", panels=records, legend=[h.get_label() for h in handles],
               grid={"columns": ncol, "cells": len(axes) + (len(legend_ax.get_subplotspec()
                     .colspan) if legend_ax else 0), "legend_in_grid": legend_ax is not None},
               ylim=jsonable(axes[0].get_ylim()) if panels else None)
    finish(fig, ctx.fig_path("error_vs_n"), handles,
           "Error against the float64 reference" + (f" ({fixed})" if fixed else ""),
           legend_ax=legend_ax)
    ctx.md.append("## Error against sequence length: a stress test of the input distribution\n")
    ctx.embed("error_vs_n", "error against n")
    ctx.md.append("A stress test of the input distribution, not a measure of quality: on "
                  "generated inputs (gaussian unless the panel names another) attention lacks "
                  "the structure a trained model's has (locality, sinks, a few heavy keys), so "
                  "these errors say how a variant fares on such inputs, not what it costs a "
                  "model" + (" (the Quality section above measures that)"
                             if getattr(ctx, "quality_at", None) is not None else "") + ". "
                  "Relative Frobenius error of the output against the double-precision "
                  "reference (on sampled rows where the full product is too large). The solid "
                  "grey line at 1 is the error of a zero output; above it (shaded) a variant "
                  "does worse than returning nothing. " +
                  ("The dashed grey line is the error of the uniform average (v averaged over "
                   "the keys each query may see, the median over the problem's rows): a "
                   "variant above it does no better than ignoring the scores.\n" if with_uniform
                   else "These results have no `uniform_error` column (an older sweep), so the "
                   "uniform average's error is not drawn.\n"))
    if dropped:
        ctx.note("error_vs_n: rows without a positive rel_fro_error are not drawn for: " +
                 ", ".join(dict.fromkeys(dropped)))
    for cfg, causal, inp in panels:
        sub = lay.select(ctx.ok, cfg, causal, inp)
        ctx.md.append(f"\ninput={inp}, {ctx.panel_title(cfg, causal)}:\n\n")
        ctx.md.append(ctx.table_by_n(sub, "rel_fro_error", fmt_sci))
        un, uy = uniform_series(sub)
        if len(un):
            ctx.md.append("\nUniform average: " + ", ".join(
                f"n={fmt_n(n)}: {fmt_sci(y)}" for n, y in zip(un, uy)) + ".\n")
    ctx.md.append("\n")


# --- speed against error ------------------------------------------------------------------
class ErrorAxis:
    """What a time-against-error figure draws on its error axis: the figure's name, the column
    of the error, its axis label, what a zero of it is called (its relative error is 1),
    whether the uniform average's error is a reference, and the words of its report section
    (`short`: the error's column heading in its tables)."""

    def __init__(self, name, column, label, short, zero, uniform, time_label, title, heading,
                 intro):
        self.name, self.column, self.label, self.short = name, column, label, short
        self.zero = zero
        self.uniform, self.time_label, self.title = uniform, time_label, title
        self.heading, self.intro = heading, intro


FORWARD_AXIS = ErrorAxis(
    "speed_vs_error", "rel_fro_error", ERROR_LABEL, "rel. error", "zero output", True,
    "median time (s)", "Time against error", "Speed against error",
    "Lower left is better. A variant \"beats doing nothing\" when its error is below that of "
    "a zero output (1) and, where the results have it, below that of the uniform average "
    "(dashed line); the others are drawn pale. The frontier joins the variants that beat doing "
    "nothing and that no other such variant beats in both time and error.")


def speed_points(ctx, sub, column="rel_fro_error"):
    """(spec, error, time) of each spec in a panel at one n, medians over its rows."""
    out = []
    for spec in ctx.styles.order:
        s = sub[sub["spec"] == spec]
        s = s[(s[column] > 0) & (s["time_median_s"] > 0)]
        if not s.empty:
            out.append((spec, float(s[column].median()), float(s["time_median_s"].median())))
    return out


def speed_vs_error(ctx):
    """Time against error at one n, a panel per configuration of the timed input (every scale:
    sharper inputs change the error, not the time)."""
    with ctx.every_scale():
        n = pick_speed_error_n(ctx.timed, ctx.args.n)
        how = "chosen with --n" if ctx.args.n is not None else \
            "the largest n at which more than half of the variants have a measured row"
        return speed_error_figure(ctx, FORWARD_AXIS, n, how)


def label_points(ctx, fig, panels, records):
    """Labels each panel's points next to them where they collide with nothing (after
    freeze_layout): `panels` are (ax, [(spec, x, y)], reference-line labels to avoid), and
    each record's "points" get "label": "direct" or "legend". Returns the specs the legend
    must name."""
    freeze_layout(fig)
    in_legend = set()
    renderer = fig.canvas.get_renderer()
    for (ax, pts, marks), rec in zip(panels, records):
        labels = [ctx.styles.label(s) for s, _, _ in pts]
        avoid = [tuple(m.get_window_extent(renderer).extents) for m in marks]
        placed = place_labels(ax, [(x, y) for _, x, y in pts], labels, avoid)
        for p, done in zip(rec["points"], placed):
            p["label"] = "direct" if done else "legend"
            if not done:
                in_legend.add(p["spec"])
    return in_legend


def speed_error_figure(ctx, axis, n, how):
    """Time against the error `axis` names at length n of the timed rows, a panel per
    configuration and causal setting, with the Pareto frontier of the variants that beat a
    zero (and the uniform average, when `axis` has it); its report section says n and `how`
    it was chosen."""
    title = f"{axis.title} at n = {fmt_n(n)} ({ctx.title_suffix()})"
    fig, cells = ctx.panels_at(n, title)
    panels, records, tables = [], [], []
    for ax, sub, panel_title in cells:
        pts = speed_points(ctx, sub, axis.column)
        un, uy = uniform_series(sub) if axis.uniform else ([], [])
        uniform = float(uy[0]) if len(uy) else None
        beats = [e < ZERO_ERROR and (uniform is None or e < uniform) for _, e, _ in pts]
        for (spec, e, t), good in zip(pts, beats):
            ax.plot([e], [t], linestyle="none", markersize=6.5, label=ctx.styles.label(spec),
                    alpha=1.0 if good else PALE_ALPHA, **ctx.styles(spec, line=False))
        kept = [i for i, good in enumerate(beats) if good]
        front = [kept[i] for i in pareto([(pts[i][1], pts[i][2]) for i in kept])]
        if front:
            fe = [pts[i][1] for i in front]
            ft = [pts[i][2] for i in front]
            ax.step(fe, ft, where="post", color="0.25", linewidth=1.0, zorder=0)
            ax.plot(fe, ft, linestyle="none", marker="o", markersize=11, markerfacecolor="none",
                    markeredgecolor="0.25", markeredgewidth=0.8, zorder=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(axis.label)
        ax.set_ylabel(axis.time_label)
        ax.set_title(panel_title)
        if pts:
            xs = [p[1] for p in pts] + [ZERO_ERROR] + ([uniform] if uniform else [])
            pad_log_limits(ax, xs, [p[2] for p in pts])
        else:
            ax.set_xlim(ZERO_ERROR / 100, ZERO_ERROR * 10)
            ax.text(0.5, 0.5, f"no row with an error at n = {fmt_n(n)}", ha="center",
                    va="center", transform=ax.transAxes, color="0.4")
        ax.axvline(ZERO_ERROR, zorder=1.5, **ZERO_STYLE)
        ax.axvspan(ZERO_ERROR, ax.get_xlim()[1], zorder=0, **WORSE_SHADE)
        on_x = blended_transform_factory(ax.transData, ax.transAxes)
        marks = [ax.text(ZERO_ERROR, 0.99, f"{axis.zero} ", rotation=90, fontsize=7,
                         color=REFERENCE_COLOR, ha="left", va="top", transform=on_x)]
        if uniform is not None:
            ax.axvline(uniform, zorder=1.5, **UNIFORM_STYLE)
            marks.append(ax.text(uniform, 0.01, " uniform average", rotation=90, fontsize=7,
                                 color=REFERENCE_COLOR, ha="right", va="bottom",
                                 transform=on_x))
        panels.append((ax, pts, marks))
        records.append({"title": panel_title, "zero_output": ZERO_ERROR, "uniform": uniform,
                        "points": [{"spec": s, "text": ctx.styles.label(s), "error": e,
                                    "time": t, "beats": good, "on_front": i in front}
                                   for i, ((s, e, t), good) in enumerate(zip(pts, beats))],
                        "front": [pts[i][0] for i in front]})
        rows = [[code(s), format_seconds(t), fmt_sci(e), "yes" if good else "no",
                 "yes" if i in front else ""]
                for i, ((s, e, t), good) in enumerate(zip(pts, beats))]
        tables.append((panel_title, rows, uniform))
    # Labels next to the points where they collide with nothing; the legend names the rest.
    in_legend = label_points(ctx, fig, panels, records)
    handles = [ctx.styles.handle(s, line=False) for s in ctx.styles.order if s in in_legend]
    handles.append(Line2D([], [], color="0.25", linewidth=1.0, marker="o", markersize=9,
                          markerfacecolor="none", markeredgewidth=0.8,
                          label="Pareto frontier of the variants that beat doing nothing"))
    handles.append(Line2D([], [], label=f"{axis.zero} (error 1)", **ZERO_STYLE))
    with_uniform = any(rec["uniform"] is not None for rec in records)
    if with_uniform:
        handles.append(REFERENCE_HANDLES["uniform"])
    handles.append(Line2D([], [], color="0.4", marker="o", alpha=PALE_ALPHA, linestyle="none",
                          label=f"pale: no better than the {axis.zero}" +
                          (" or the uniform average" if with_uniform else "")))
    ctx.record(axis.name, n=int(n), panels=records, legend=[h.get_label() for h in handles])
    finish(fig, ctx.fig_path(axis.name), handles, title)
    ctx.md.append(f"## {axis.heading} at n = {fmt_n(n)}\n")
    ctx.embed(axis.name, axis.heading.lower())
    ctx.md.append(f"n = {n} ({how}). {axis.intro}\n")
    for title_, rows, uniform in tables:
        ctx.md.append(f"\n{title_}" + (f" (uniform average: {fmt_sci(uniform)})"
                                       if uniform is not None else "") + ":\n\n")
        ctx.md.append(md_table(["variant", "time", axis.short, "beats doing nothing",
                                "on the frontier"], rows))
    ctx.md.append("\n")
