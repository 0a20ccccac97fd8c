"""The multi-head layer (rows with embed > 0, from `sweep --embed`): layer time and the
attention core's share of it against n, and the length at which each variant makes the layer
twice as fast as with `full`."""

import math

import numpy as np

from attnbench_results import format_seconds

from .crossover import Crossing, ratio_series
from .style import NOISY_FOOTNOTE, code, finish, log2_n_axis, md_table, new_grid, series

# The speed-up of the layer the table asks for (time with full / time with the variant).
TARGET_SPEEDUP = 2.0


def layer_rows(ctx):
    if "embed" not in ctx.timed.columns:
        return ctx.timed.iloc[0:0]
    return ctx.timed[ctx.timed["embed"] > 0]


def twice_as_fast_text(ns, ratio, bad=None):
    """Where time / time with full is below 1 / TARGET_SPEEDUP, judged on the lengths
    without a noisy row."""
    return Crossing(ns, np.asarray(ratio) * TARGET_SPEEDUP, bad).text(
        f"{TARGET_SPEEDUP:g}× faster")


def panel_title(ctx, rows, cfg, causal):
    """The panel's title, with the embedding size when every layer row has the same one (the
    layout then leaves it out of the configuration)."""
    title = ctx.panel_title(cfg, causal)
    if "embed" not in ctx.layout.cols:
        title += f", E={int(rows['embed'].iloc[0])}"
    return title


def section(ctx):
    rows = layer_rows(ctx)
    name = "layer"
    ctx.md.append("## Multi-head layer\n")
    if rows.empty:
        ctx.md.append("No multi-head layer rows (`sweep --embed`) in these results.\n")
        return
    lay = ctx.layout
    panels = [(cfg, causal) for cfg in lay.configs for causal in lay.causals
              if not lay.select(rows, cfg, causal).empty]
    fig, axes = new_grid(len(panels), 2, sharey=False)
    present = set()
    for r, (cfg, causal) in enumerate(panels):
        sub = lay.select(rows, cfg, causal)
        ax_t, ax_s = axes[r][0], axes[r][1]
        for spec in ctx.styles.order:
            ns, ts = series(sub, spec, "time_median_s")
            if len(ns) == 0:
                continue
            st = ctx.styles(spec)
            ax_t.plot(ns, ts, label=ctx.styles.label(spec), **st)
            ns_s, share = series(sub, spec, "attention_share")
            if len(ns_s):
                ax_s.plot(ns_s, share, label=ctx.styles.label(spec), **st)
            present.add(spec)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("median layer time (s)")
        ax_s.set_ylim(0, 1)
        ax_s.set_ylabel("attention core's share of the layer time")
        for ax, what in ((ax_t, "layer time"), (ax_s, "attention share")):
            log2_n_axis(ax, sub["n"].unique())
            ax.set_title(f"{what}: {panel_title(ctx, rows, cfg, causal)}")
    handles = [ctx.styles.handle(s) for s in ctx.styles.order if s in present]
    handles += ctx.styles.family_handles([s for s in ctx.styles.order if s in present])
    finish(fig, ctx.fig_path(name), handles,
           f"Multi-head layer: in-projection, attention, out-projection ({ctx.title_suffix()})")
    ctx.embed(name, "multi-head layer")
    ctx.md.append("The whole layer as `attnbench layer` runs it (in-projection, attention by "
                  "the variant, out-projection), and the share of its time spent in the "
                  "attention core, both measured in the same timed passes.\n")
    full = [s for s in ctx.styles.order if s.split(":")[0] == "full"]
    for cfg, causal in panels:
        sub = lay.select(rows, cfg, causal)
        title = panel_title(ctx, rows, cfg, causal)
        ctx.md.append(f"\n{title}, layer time:\n\n")
        ctx.md.append(ctx.table_by_n(sub, "time_median_s", format_seconds))
        ctx.md.append(f"\n{title}, attention share:\n\n")
        ctx.md.append(ctx.table_by_n(
            sub, "attention_share", lambda x: "—" if math.isnan(x) else f"{x:.2f}"))
        if not full or not (sub["spec"] == full[0]).any():
            ctx.md.append("\nNo `full` layer rows here, so no length at which a variant makes "
                          "the layer twice as fast.\n")
            continue
        out = []
        for spec in ctx.styles.order:
            if spec == full[0] or not (sub["spec"] == spec).any():
                continue
            ns, ratio, bad = ratio_series(sub, spec, full[0])
            out.append([code(spec), twice_as_fast_text(ns, ratio, bad)])
        ctx.md.append(f"\n{title}: the smallest n at which the layer with the variant is "
                      f"{TARGET_SPEEDUP:g}× as fast as with `{full[0]}` (interpolated in "
                      f"log-log between measured lengths):\n\n")
        ctx.md.append(md_table(["variant", f"layer {TARGET_SPEEDUP:g}× faster than full"], out))
        if any("†" in cells[1] for cells in out):
            ctx.md.append("\n" + NOISY_FOOTNOTE + "\n")
    ctx.md.append("\n")
