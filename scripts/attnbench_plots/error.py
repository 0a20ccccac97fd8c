"""Error against n (one panel per input distribution) and speed against error at one n,
with the Pareto frontier."""

import math

from matplotlib.lines import Line2D

from attnbench_results import ResultsError, format_seconds

from .style import (ERROR_LABEL, code, finish, fmt_n, fmt_sci, log2_n_axis, md_table, new_grid,
                    pad_log_limits, series)


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



def error_vs_n(ctx):
    lay = ctx.layout
    rows_ = [(cfg, causal) for cfg in lay.configs for causal in lay.causals]
    # One panel per input distribution in a row; with a single input, the causal settings
    # go side by side instead.
    panels = [(cfg, causal, inp) for cfg, causal in rows_ for inp in lay.inputs
              if not lay.select(ctx.ok, cfg, causal, inp).empty]
    ncol = len(lay.inputs) if len(lay.inputs) > 1 else len(lay.causals)
    ncol = max(1, min(ncol, len(panels)))
    fig, axes = new_grid(math.ceil(len(panels) / ncol), ncol, sharey=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    present, dropped = set(), []
    for i, (cfg, causal, inp) in enumerate(panels):
        ax = axes.flat[i]
        sub = lay.select(ctx.ok, cfg, causal, inp)
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
        ax.set_yscale("log")
        log2_n_axis(ax, sub["n"].unique())
        ax.set_title(f"input={inp}, {ctx.panel_title(cfg, causal)}")
        if i % ncol == 0:
            ax.set_ylabel(ERROR_LABEL)
        else:
            ax.tick_params(labelleft=True)
    handles = [ctx.styles.handle(s) for s in ctx.styles.order if s in present]
    handles += ctx.styles.family_handles([s for s in ctx.styles.order if s in present])
    fixed = ctx.layout.fixed_label()
    finish(fig, ctx.fig_path("error_vs_n"), handles,
           "Error against the float64 reference" + (f" ({fixed})" if fixed else ""))
    ctx.md.append("## Error against sequence length\n")
    ctx.embed("error_vs_n", "error against n")
    ctx.md.append("Relative Frobenius error of the output against the double-precision "
                  "reference (on sampled rows where the full product is too large).\n")
    if dropped:
        ctx.note("error_vs_n: rows without a positive rel_fro_error are not drawn for: " +
                 ", ".join(dict.fromkeys(dropped)))
    for cfg, causal in rows_:
        for inp in lay.inputs:
            sub = lay.select(ctx.ok, cfg, causal, inp)
            if sub.empty:
                continue
            ctx.md.append(f"\ninput={inp}, {ctx.panel_title(cfg, causal)}:\n\n")
            ctx.md.append(ctx.table_by_n(sub, "rel_fro_error", fmt_sci))
    ctx.md.append("\n")

# --- speed against error ------------------------------------------------------------------
def speed_vs_error(ctx):
    lay = ctx.layout
    n = pick_speed_error_n(ctx.timed, ctx.args.n)
    at_n = ctx.timed[ctx.timed["n"] == n]
    fig, axes = new_grid(len(lay.configs), len(lay.causals), sharey=False)
    present = set()
    tables = []
    for r, c, cfg, causal in ctx.panels():
        ax = axes[r][c]
        sub = lay.select(at_n, cfg, causal)
        pts, specs = [], []
        for spec in ctx.styles.order:
            s = sub[sub["spec"] == spec]
            s = s[(s["rel_fro_error"] > 0) & (s["time_median_s"] > 0)]
            if s.empty:
                continue
            e, t = float(s["rel_fro_error"].median()), float(s["time_median_s"].median())
            pts.append((e, t))
            specs.append(spec)
            ax.plot([e], [t], linestyle="none", markersize=6.5, label=ctx.styles.label(spec),
                    **ctx.styles(spec, line=False))
            present.add(spec)
        front = pareto(pts)
        if front:
            fe = [pts[i][0] for i in front]
            ft = [pts[i][1] for i in front]
            ax.step(fe, ft, where="post", color="0.25", linewidth=1.0, zorder=0)
            ax.plot(fe, ft, linestyle="none", marker="o", markersize=11, markerfacecolor="none",
                    markeredgecolor="0.25", markeredgewidth=0.8, zorder=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(ERROR_LABEL)
        ax.set_ylabel("median time (s)")
        ax.set_title(ctx.panel_title(cfg, causal))
        pad_log_limits(ax, [p[0] for p in pts], [p[1] for p in pts])
        rows = [[code(s), format_seconds(p[1]), fmt_sci(p[0]), "yes" if i in front else ""]
                for i, (s, p) in enumerate(zip(specs, pts))]
        tables.append((ctx.panel_title(cfg, causal), rows))
    handles = [ctx.styles.handle(s, line=False) for s in ctx.styles.order if s in present]
    handles.append(Line2D([], [], color="0.25", linewidth=1.0, marker="o", markersize=9,
                          markerfacecolor="none", markeredgewidth=0.8,
                          label="Pareto frontier (no variant both faster and more exact)"))
    finish(fig, ctx.fig_path("speed_vs_error"), handles,
           f"Time against error at n = {fmt_n(n)} ({ctx.title_suffix()})")
    ctx.md.append(f"## Speed against error at n = {fmt_n(n)}\n")
    ctx.embed("speed_vs_error", "speed against error")
    how = "chosen with --n" if ctx.args.n is not None else \
        "the largest n at which more than half of the variants have a measured row"
    ctx.md.append(f"n = {n} ({how}). Lower left is better; the frontier joins the variants "
                  f"that no other variant beats in both time and error.\n")
    for title, rows in tables:
        ctx.md.append(f"\n{title}:\n\n")
        ctx.md.append(md_table(["variant", "time", "rel. error", "on the frontier"], rows))
    ctx.md.append("\n")
