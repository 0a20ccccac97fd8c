"""Crossover lengths: time relative to flash and to full against n, and where each variant
becomes faster."""

import math

import numpy as np
from matplotlib.lines import Line2D

from .style import code, finish, fmt_n, log2_n_axis, md_table, new_grid, ratio_axis, remove, series


def crossover(ns, ratio):
    """Where time / baseline time first drops below 1, interpolated in log-log.

    Returns (kind, n): kind "always" (faster at the smallest n), "never", or "at" with the
    interpolated n; plus whether it is slower again at a larger n after that."""
    if len(ns) == 0:
        return "none", None, False
    faster = ratio < 1
    if not faster.any():
        return "never", None, False
    i = int(np.argmax(faster))
    later_slower = bool((~faster[i:]).any())
    if i == 0:
        return "always", ns[0], later_slower
    la, lb = math.log(ns[i - 1]), math.log(ns[i])
    ra, rb = math.log(ratio[i - 1]), math.log(ratio[i])
    t = ra / (ra - rb)  # ra >= 0 > rb
    return "at", math.exp(la + t * (lb - la)), later_slower


def ratio_series(sub, spec, base_spec):
    n_v, t_v = series(sub, spec, "time_median_s")
    n_b, t_b = series(sub, base_spec, "time_median_s")
    common = np.intersect1d(n_v, n_b)
    if len(common) == 0:
        return common, common
    tv = t_v[np.searchsorted(n_v, common)]
    tb = t_b[np.searchsorted(n_b, common)]
    return common, tv / tb


def crossover_text(kind, n, later_slower, ns):
    rng = f"{fmt_n(ns[0])}–{fmt_n(ns[-1])}" if len(ns) else ""
    if kind == "none":
        return "— (no common n)"
    if kind == "never":
        return f"never in range ({rng})"
    text = f"faster at every n ({rng})" if kind == "always" else f"≈ {n:,.0f}"
    if later_slower:
        text += " (slower again at a larger n)"
    return text



# --- crossover lengths --------------------------------------------------------------------
def baselines(ctx):
    """The spec of `flash` and of `full` (the first of each name in the results)."""
    out = []
    for name in ["flash", "full"]:
        specs = [s for s in ctx.styles.order
                 if s.split(":")[0] == name and (ctx.timed["spec"] == s).any()]
        if not specs:
            ctx.note(f"crossover: no ok row of `{name}` with input {ctx.input}; no "
                     f"crossover lengths against {name}")
            continue
        if len(specs) > 1:
            ctx.note(f"crossover: several {name} specs; the baseline is {specs[0]}")
        out.append((name, specs[0]))
    return out

def crossover_section(ctx):
    lay = ctx.layout
    bases = baselines(ctx)
    ctx.md.append("## Crossover lengths\n")
    if not bases:
        ctx.md.append("Neither `flash` nor `full` was measured, so there is no crossover.\n")
        remove(ctx.fig_path("crossover"))
        return
    panels = [(cfg, causal) for cfg in lay.configs for causal in lay.causals]
    fig, axes = new_grid(len(panels), len(bases), sharey=False)
    present = set()
    table = {}  # (spec) -> {(panel, base): text}
    columns = []
    for r, (cfg, causal) in enumerate(panels):
        sub = lay.select(ctx.timed, cfg, causal)
        for c, (bname, bspec) in enumerate(bases):
            ax = axes[r][c]
            columns.append((ctx.panel_title(cfg, causal), bname))
            for spec in ctx.styles.order:
                if spec == bspec or not (sub["spec"] == spec).any():
                    continue
                ns, ratio = ratio_series(sub, spec, bspec)
                kind, nx, again = crossover(ns, ratio)
                table.setdefault(spec, {})[columns[-1]] = crossover_text(kind, nx, again, ns)
                if len(ns) == 0:
                    continue
                st = ctx.styles(spec)
                ax.plot(ns, ratio, label=ctx.styles.label(spec), **st)
                present.add(spec)
                if kind == "at":
                    ax.plot([nx], [1.0], linestyle="none", marker="|", markersize=14,
                            markeredgewidth=2, color=st["color"], zorder=3)
            ax.axhline(1.0, color="0.2", linewidth=1.0, zorder=1)
            ratio_axis(ax)
            log2_n_axis(ax, sub["n"].unique())
            ax.set_ylabel(f"time / time of {bname}")
            ax.set_title(f"vs {bname}: {ctx.panel_title(cfg, causal)}")
    handles = [ctx.styles.handle(s) for s in ctx.styles.order if s in present]
    handles += ctx.styles.family_handles([s for s in ctx.styles.order if s in present])
    handles.append(Line2D([], [], color="0.2", linestyle="none", marker="|", markersize=12,
                          markeredgewidth=2, label="crossover (interpolated in log-log)"))
    finish(fig, ctx.fig_path("crossover"), handles,
           f"Time relative to the baseline; below 1 = faster ({ctx.title_suffix()})")
    ctx.embed("crossover", "crossover")
    ctx.md.append("The smallest n at which each variant is faster than the baseline, "
                  "interpolated in log-log between the two measured lengths around the "
                  "crossing. \"faster at every n\" and \"never in range\" refer to the "
                  "measured lengths only.\n\n")
    header = ["variant"] + [f"vs {b}, {p}" for p, b in columns]
    rows = [[code(s)] + [table[s].get(col, "—") for col in columns]
            for s in ctx.styles.order if s in table]
    ctx.md.append(md_table(header, rows) + "\n")

