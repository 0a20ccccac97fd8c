"""Time and memory against n, and the efficiency table relative to full (Long Range Arena
style)."""

import math

from attnbench_results import format_seconds

from .style import (GUIDE_HANDLES, MIB, code, finish, fmt_mib, fmt_n, guides, log2_n_axis,
                    md_table, new_grid, series, times)

LRA_LENGTHS = [1024, 2048, 4096, 8192]


def against_n(ctx, name, column, scale, ylabel, title, section, cell, explain):
    lay = ctx.layout
    fig, axes = new_grid(len(lay.configs), len(lay.causals), sharey=True)
    present, dropped, with_guides = set(), [], False
    for r, c, cfg, causal in ctx.panels():
        ax = axes[r][c]
        sub = lay.select(ctx.timed, cfg, causal)
        all_n, all_y = [], []
        for spec in ctx.styles.order:
            s = sub[sub["spec"] == spec]
            if (s[column].isna() | (s[column] <= 0)).any():
                dropped.append(spec)
            ns, ys = series(sub, spec, column)
            if len(ns) == 0:
                continue
            ys = ys / scale
            ax.plot(ns, ys, label=ctx.styles.label(spec), **ctx.styles(spec))
            present.add(spec)
            all_n += list(ns)
            all_y += list(ys)
        with_guides = guides(ax, all_n, all_y) or with_guides
        ax.set_yscale("log")
        log2_n_axis(ax, sub["n"].unique())
        ax.set_title(ctx.panel_title(cfg, causal))
        if c == 0:
            ax.set_ylabel(ylabel)
        else:
            ax.tick_params(labelleft=True)
    handles = [ctx.styles.handle(s) for s in ctx.styles.order if s in present]
    handles += ctx.styles.family_handles([s for s in ctx.styles.order if s in present])
    finish(fig, ctx.fig_path(name), handles + (GUIDE_HANDLES if with_guides else []),
           f"{title} ({ctx.title_suffix()})")
    ctx.md.append(f"## {section}\n")
    ctx.embed(name, section)
    ctx.md.append(explain + "\n")
    if dropped:
        ctx.note(f"{name}: rows whose {column} is missing or not positive are left out of "
                 f"the log-scale figure (the table shows them) for: " +
                 ", ".join(dict.fromkeys(dropped)))
    for cfg in lay.configs:
        for causal in lay.causals:
            sub = lay.select(ctx.timed, cfg, causal)
            if sub.empty:
                continue
            ctx.md.append(f"\n{ctx.panel_title(cfg, causal)}:\n\n")
            ctx.md.append(ctx.table_by_n(sub, column, cell))
    ctx.md.append("\n")



def time_vs_n(ctx):
    against_n(ctx, "time_vs_n", "time_median_s", 1.0, "median time (s)", "Time per forward pass",
              "Time against sequence length", format_seconds,
              "Median wall-clock time of one forward pass over the repetitions. The dashed and "
              "dotted grey lines are O(n) and O(n²) guides through the smallest n.")


def memory_vs_n(ctx):
    against_n(ctx, "memory_vs_n", "peak_bytes", MIB, "peak heap of the forward pass (MiB)",
              "Peak memory", "Peak memory against sequence length", fmt_mib,
              "Peak heap allocated during a forward pass beyond what was allocated before it "
              "(inputs and output excluded), in MiB. Variants with the same workspace draw "
              "coinciding lines, of which only the last is visible; the tables hold every value.")


def efficiency(ctx):
    lay = ctx.layout
    ctx.md.append("## Efficiency relative to full (Long Range Arena style)\n")
    full = [s for s in ctx.styles.order if s.split(":")[0] == "full"]
    if not full:
        ctx.note("efficiency table: no `full` rows, so nothing to be relative to")
        ctx.md.append("No `full` rows in these results, so there is no efficiency table.\n")
        return
    base = full[0]
    ctx.md.append(f"Speed = time of `{base}` / time of the variant (higher is faster); "
                  f"memory = peak heap of the variant / peak heap of `{base}` (lower is "
                  f"smaller). \"—\" = not measured (either the variant or `{base}`). "
                  f"Input `{ctx.input}`.\n")
    for cfg in lay.configs:
        for causal in lay.causals:
            sub = lay.select(ctx.timed, cfg, causal)
            if sub.empty:
                continue
            med = sub.groupby(["spec", "n"])[["time_median_s", "peak_bytes"]].median()

            def get(spec, n, col):
                try:
                    v = float(med.loc[(spec, n), col])
                except KeyError:
                    return math.nan
                return v if v > 0 else math.nan

            rows = []
            for spec in ctx.styles.order:
                if not (sub["spec"] == spec).any():
                    continue
                speed = [get(base, n, "time_median_s") / get(spec, n, "time_median_s")
                         for n in LRA_LENGTHS]
                mem = [get(spec, n, "peak_bytes") / get(base, n, "peak_bytes")
                       for n in LRA_LENGTHS]
                rows.append([code(spec)] + [times(x) for x in speed] +
                            [times(x) for x in mem])
            header = (["variant"] + [f"speed {fmt_n(n)}" for n in LRA_LENGTHS] +
                      [f"memory {fmt_n(n)}" for n in LRA_LENGTHS])
            ctx.md.append(f"\n{ctx.panel_title(cfg, causal)}:\n\n")
            ctx.md.append(md_table(header, rows))
    ctx.md.append("\n")

