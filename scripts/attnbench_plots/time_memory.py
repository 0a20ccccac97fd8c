"""Time and memory against n, and the efficiency table relative to full (Long Range Arena
style)."""

import math

import numpy as np

from attnbench_results import format_seconds, noisy, time_spread

from .style import (MIB, NOISY_FOOTNOTE, NOISY_HANDLE, SPREAD_HANDLE, code, finish, fmt_mib,
                    fmt_n, guide_handles, guides, jsonable, log2_n_axis, md_table, series,
                    times)

LRA_LENGTHS = [1024, 2048, 4096, 8192]


# Lines of memory_vs_n whose values agree this closely at every n are drawn side by side (on
# a log axis of a few decades they would cover each other).
COINCIDE_REL = 0.02
# Horizontal shift between coinciding lines, in octaves of n (a marker's width at the default
# panel size).
DODGE_OCTAVES = 0.07


def time_points(sub, spec):
    """Per n of one spec in a panel, sorted by n: the median time, the smallest time_min_s and
    largest time_max_s of its rows (the bar), and whether any of its rows is noisy."""
    s = sub[(sub["spec"] == spec) & (sub["time_median_s"] > 0)].copy()
    s["noisy_"] = noisy(s)
    g = s.groupby("n").agg(t=("time_median_s", "median"), lo=("time_min_s", "min"),
                           hi=("time_max_s", "max"), noisy=("noisy_", "any"))
    g["lo"] = g["lo"].where(g["lo"] > 0, g["t"]).fillna(g["t"])
    g["hi"] = g["hi"].fillna(g["t"])
    return (g.index.to_numpy(dtype=float), g["t"].to_numpy(dtype=float),
            g["lo"].to_numpy(dtype=float), g["hi"].to_numpy(dtype=float),
            g["noisy"].to_numpy(dtype=bool))


def draw_time(ctx, ax, sub, spec):
    """One spec's median times with min–max bars; noisy points hollow. Returns (n, t, record)."""
    ns, ts, lo, hi, bad = time_points(sub, spec)
    if len(ns) == 0:
        return ns, ts, None
    st = ctx.styles(spec)
    ax.plot(ns, ts, label=ctx.styles.label(spec), **st)
    ax.errorbar(ns, ts, yerr=[np.maximum(ts - lo, 0), np.maximum(hi - ts, 0)], fmt="none",
                ecolor=st["color"], elinewidth=0.9, capsize=2.0, capthick=0.9, zorder=2.5)
    if bad.any():
        ax.plot(ns[bad], ts[bad], linestyle="none", marker=st["marker"], markersize=6.5,
                markerfacecolor="white", markeredgecolor=st["color"], markeredgewidth=1.3,
                zorder=3)
    return ns, ts, {"spec": spec, "n": jsonable(ns), "y": jsonable(ts), "lo": jsonable(lo),
                    "hi": jsonable(hi), "noisy_n": jsonable(ns[bad])}


def coinciding(lines):
    """Groups of specs (2 or more) whose (n, y) series agree within COINCIDE_REL at every n,
    from a {spec: (ns, ys)} of one panel, each group in the order of `lines`: a list of
    {"specs": [...], "exact": whether the values are equal}."""
    groups = []
    for spec, (ns, ys) in lines.items():
        for g in groups:
            n0, y0 = lines[g["specs"][0]]
            if np.array_equal(ns, n0) and np.all(np.abs(ys / y0 - 1) <= COINCIDE_REL):
                g["specs"].append(spec)
                g["exact"] = g["exact"] and bool(np.array_equal(ys, y0))
                break
        else:
            groups.append({"specs": [spec], "exact": True})
    return [g for g in groups if len(g["specs"]) > 1]


def draw_memory(ctx, ax, sub, scale, record, column="peak_bytes"):
    """Every spec's peak memory (or another byte count, `column`) in a panel; lines that
    coincide are shifted sideways by DODGE_OCTAVES each so that all of them show. Returns
    (n, y, drawn specs, groups)."""
    lines = {}
    for spec in ctx.styles.order:
        ns, ys = series(sub, spec, column)
        if len(ns):
            lines[spec] = (ns, ys / scale)
    groups = coinciding(lines)
    shift = {}
    for g in groups:
        for k, spec in enumerate(g["specs"]):
            shift[spec] = 2.0 ** ((k - (len(g["specs"]) - 1) / 2) * DODGE_OCTAVES)
    all_n, all_y = [], []
    for spec, (ns, ys) in lines.items():
        x = ns * shift.get(spec, 1.0)
        ax.plot(x, ys, label=ctx.styles.label(spec), **ctx.styles(spec))
        all_n += list(ns)
        all_y += list(ys)
        record.append({"spec": spec, "n": jsonable(ns), "y": jsonable(ys), "x": jsonable(x)})
    return all_n, all_y, list(lines), groups


def coinciding_notes(ctx, groups_by_panel, n_panels):
    """Lines under the legend naming the lines drawn side by side: "a = b = c" (≈ when not
    equal to the byte), with the panels where they coincide when that is not every panel."""
    where = {}
    for title, groups in groups_by_panel:
        for g in groups:
            where.setdefault((tuple(g["specs"]), g["exact"]), []).append(title)
    notes = []
    for (g, exact), titles in where.items():
        text = (" = " if exact else " ≈ ").join(ctx.styles.label(s) for s in g)
        if len(titles) < n_panels:
            text += f" ({'; '.join(titles)})"
        notes.append(text)
    if notes:
        notes.insert(0, "Same peak memory at every n" + (f" (within {COINCIDE_REL:.0%})" if any(
            not e for _, e in where) else "") + ", drawn side by side, slightly apart along n:")
    return notes


def against_n(ctx, name, column, scale, ylabel, title, section, explain, table, also=None,
              level=2, orders=("n", "n2"), xlabel=None):
    """A figure of `column` (divided by `scale`) against n with a panel per configuration and
    causal setting of the timed rows, its report section (a heading of `level`) and a table
    per panel. `column` is time_median_s, drawn with the repetitions' bars, or a byte count,
    drawn as memory (coinciding lines side by side); `orders` are its guides (style.guides);
    `xlabel` replaces the label of the n axis. `also`, when given, draws more in a panel,
    also(ctx, ax, sub, record), and returns legend entries."""
    lay = ctx.layout
    fig, axes = ctx.grid(sharey=True)
    present, dropped, with_guides, any_noisy = set(), [], False, False
    panels, groups_by_panel = [], []
    for r, c, cfg, causal in ctx.panels():
        ax = axes[r][c]
        sub = lay.select(ctx.timed, cfg, causal)
        record = []
        for spec in ctx.styles.order:
            s = sub[sub["spec"] == spec]
            if (s[column].isna() | (s[column] <= 0)).any():
                dropped.append(spec)
        if column != "time_median_s":
            all_n, all_y, drawn, groups = draw_memory(ctx, ax, sub, scale, record, column)
            groups_by_panel.append((ctx.panel_title(cfg, causal), groups))
        else:
            all_n, all_y, drawn, groups = [], [], [], []
            for spec in ctx.styles.order:
                ns, ys, rec = draw_time(ctx, ax, sub, spec)
                if rec is None:
                    continue
                drawn.append(spec)
                record.append(rec)
                any_noisy = any_noisy or bool(rec["noisy_n"])
                all_n += list(ns)
                all_y += list(ys)
        present.update(drawn)
        if also is not None:
            extra_handles = also(ctx, ax, sub, record)
        with_guides = guides(ax, all_n, all_y, orders) or with_guides
        ax.set_yscale("log")
        log2_n_axis(ax, sub["n"].unique())
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.set_title(ctx.panel_title(cfg, causal))
        if c == 0:
            ax.set_ylabel(ylabel)
        else:
            ax.tick_params(labelleft=True)
        panels.append({"title": ctx.panel_title(cfg, causal), "lines": record,
                       "coinciding": groups})
    handles = [ctx.styles.handle(s) for s in ctx.styles.order if s in present]
    handles += ctx.styles.family_handles([s for s in ctx.styles.order if s in present])
    if column == "time_median_s":
        handles.append(SPREAD_HANDLE)
        if any_noisy:
            handles.append(NOISY_HANDLE)
    if also is not None and panels:
        handles += extra_handles
    handles += guide_handles(orders) if with_guides else []
    notes = coinciding_notes(ctx, groups_by_panel, len(panels))
    ctx.record(name, panels=panels, legend=[h.get_label() for h in handles] + notes)
    finish(fig, ctx.fig_path(name), handles, f"{title} ({ctx.title_suffix()})", notes=notes)
    ctx.md.append(f"{'#' * level} {section}\n")
    ctx.embed(name, section)
    ctx.md.append(explain + "\n")
    if dropped:
        ctx.note(f"{name}: rows whose {column} is missing or not positive are left out of "
                 f"the log-scale figure (the table shows them) for: " +
                 ", ".join(dict.fromkeys(dropped)))
    footnote = False
    for cfg in lay.configs:
        for causal in lay.causals:
            sub = lay.select(ctx.timed, cfg, causal)
            if sub.empty:
                continue
            ctx.md.append(f"\n{ctx.panel_title(cfg, causal)}:\n\n")
            text, marked = table(ctx, sub)
            ctx.md.append(text)
            footnote = footnote or marked
    if footnote:
        ctx.md.append("\n" + NOISY_FOOTNOTE + "\n")
    ctx.md.append("\n")


def time_cell(t, spread, bad):
    """A time with the spread of its repetitions (max/min) and † when noisy."""
    if not math.isfinite(t):
        return "—"
    text = format_seconds(t)
    if math.isfinite(spread):
        text += f" ×{spread:.2f}"
    return text + (" †" if bad else "")


def time_table(ctx, sub):
    """Markdown table of the median time per spec and n with max/min and † for noisy rows;
    returns it and whether a row is marked."""
    sub = sub.assign(spread_=time_spread(sub), noisy_=noisy(sub))
    ns = sorted(sub["n"].unique())
    rows, marked = [], False
    for spec in ctx.styles.order:
        s = sub[sub["spec"] == spec]
        if s.empty:
            continue
        g = s.groupby("n").agg(t=("time_median_s", "median"), spread=("spread_", "max"),
                               noisy=("noisy_", "any"))
        cells = []
        for n in ns:
            if n in g.index:
                cells.append(time_cell(g.at[n, "t"], g.at[n, "spread"], g.at[n, "noisy"]))
                marked = marked or bool(g.at[n, "noisy"])
            else:
                cells.append("—")
        rows.append([code(spec)] + cells)
    return md_table(["variant"] + [f"n={fmt_n(n)}" for n in ns], rows), marked


def time_vs_n(ctx):
    against_n(ctx, "time_vs_n", "time_median_s", 1.0, "median time (s)", "Time per forward pass",
              "Time against sequence length",
              "Median wall-clock time of one forward pass over the repetitions; the bars span "
              "the fastest to the slowest repetition, and a hollow marker is a noisy row. The "
              "wide pale grey lines are O(n) and O(n²) guides through the smallest n. In the "
              "tables, the factor after a time (×1.05) is its repetitions' spread, slowest over "
              "fastest, and † marks a noisy row.",
              time_table)


def memory_vs_n(ctx):
    against_n(ctx, "memory_vs_n", "peak_bytes", MIB, "peak heap of the forward pass (MiB)",
              "Peak memory", "Peak memory against sequence length",
              "Peak heap allocated during a forward pass beyond what was allocated before it "
              "(inputs and output excluded), in MiB. Variants with the same peak at every n "
              "(the same workspace) are drawn side by side, a little apart along n, and the "
              "legend names them (a = b); the tables hold every value.",
              lambda ctx, sub: (ctx.table_by_n(sub, "peak_bytes", fmt_mib), False))


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

