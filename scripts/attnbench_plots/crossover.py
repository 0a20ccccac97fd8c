"""Crossover lengths: time relative to flash and to full against n, and where each variant
becomes faster.

Where a variant is faster is judged from the lengths at which neither its rows nor the
baseline's are noisy; the report says which lengths it left out. The statement follows the
data: faster at every n, from some n on (interpolated where the ratio crosses 1), at a list of
lengths when it goes back and forth, or never."""

import math

import numpy as np
from matplotlib.lines import Line2D

from attnbench_results import noisy

from .style import (NOISY_FOOTNOTE, NOISY_HANDLE, code, finish, fmt_n, freeze_layout,
                    jsonable, log2_n_axis, md_table, new_grid, ratio_axis)

# Crossover marks closer than this along n (display points) are stacked above and below the
# line at 1 instead of drawn over each other.
MARK_SIZE = 7.5
MARK_STEP = 9.0
# A crossover mark: the variant's marker and colour with a dark outline, unlike its data points.
MARK_EDGE = {"markeredgecolor": "0.05", "markeredgewidth": 1.1}


class Crossing:
    """Where a time ratio (variant / baseline, at sorted lengths) is below 1, judged on the
    quiet lengths only.

    kind: "none" (no common length), "noisy" (every common length noisy), "never", "always",
    "from" (slower below some n, faster from it on: `n` is where the ratio crosses 1,
    interpolated in log-log, and `first` the smallest quiet length from which it is faster) or
    "some" (faster at `faster`, which is neither a suffix nor empty). `ignored` are the noisy
    lengths left out, `lengths` the quiet ones."""

    def __init__(self, ns, ratio, bad=None):
        ns = np.asarray(ns, dtype=float)
        ratio = np.asarray(ratio, dtype=float)
        bad = np.zeros(len(ns), dtype=bool) if bad is None else np.asarray(bad, dtype=bool)
        self.all_lengths = list(ns)
        self.ignored = list(ns[bad])
        qn, qr = ns[~bad], ratio[~bad]
        self.lengths = list(qn)
        self.faster = list(qn[qr < 1])
        self.n = self.first = None
        if len(ns) == 0:
            self.kind = "none"
        elif len(qn) == 0:
            self.kind = "noisy"
        elif not self.faster:
            self.kind = "never"
        elif len(self.faster) == len(qn):
            self.kind = "always"
        else:
            first = int(np.argmax(qr < 1))
            if first > 0 and (qr[first:] < 1).all():
                self.kind = "from"
                self.first = float(qn[first])
                la, lb = math.log(qn[first - 1]), math.log(qn[first])
                ra, rb = math.log(qr[first - 1]), math.log(qr[first])
                t = ra / (ra - rb)  # ra >= 0 > rb
                self.n = math.exp(la + t * (lb - la))
            else:
                self.kind = "some"

    def text(self, faster="faster", measured=False):
        """The statement for the report, e.g. "≈ 1,234: faster from there on (256–8K)";
        `faster` names what is judged (e.g. "2× faster"). With `measured`, a crossing is the
        measured length it is faster from ("2K: faster from there on"), not interpolated.
        With noisy lengths, the lengths it was judged on and the noisy ones (†) replace the
        range."""
        ns, fmt = self.all_lengths, lambda values: ", ".join(fmt_n(n) for n in values)
        if self.kind == "none":
            return "— (no common n)"
        if self.kind == "noisy":
            return f"— (noisy at every n: {fmt(self.ignored)} †)"
        if self.ignored:
            scope = (f"(judged at n = {fmt(self.lengths)}; noisy, not judged: "
                     f"{fmt(self.ignored)} †)")
            every = "every judged n"
        else:
            scope = f"({fmt_n(ns[0])}–{fmt_n(ns[-1])})"
            every = "every n"
        if self.kind == "never":
            return f"never in range {scope}"
        if self.kind == "always":
            return f"{faster} at {every} {scope}"
        if self.kind == "from" and measured:
            return f"{fmt_n(self.first)}: {faster} from there on {scope}"
        if self.kind == "from":
            return f"≈ {self.n:,.0f}: {faster} from there on {scope}"
        return f"{faster} only at n ∈ {{{fmt(self.faster)}}} {scope}"

    def record(self):
        return {"kind": self.kind, "n": self.n, "first": self.first,
                "faster": jsonable(self.faster),
                "ignored": jsonable(self.ignored)}


def ratio_series(sub, spec, base_spec):
    """(n, time of spec / time of base_spec, noisy) at the lengths both have: medians over the
    rows of each n; a length is noisy when a row of either is."""
    def per_n(s):
        s = s[s["time_median_s"] > 0]
        return s.assign(noisy_=noisy(s)).groupby("n").agg(t=("time_median_s", "median"),
                                                          bad=("noisy_", "any"))
    v = per_n(sub[sub["spec"] == spec])
    b = per_n(sub[sub["spec"] == base_spec])
    j = v.join(b, lsuffix="_v", rsuffix="_b", how="inner").sort_index()
    return (j.index.to_numpy(dtype=float), (j["t_v"] / j["t_b"]).to_numpy(dtype=float),
            (j["bad_v"] | j["bad_b"]).to_numpy(dtype=bool))


def baseline(ctx, name, what="crossover"):
    """The spec of the variant `name` in the timed rows (the first, said when there are
    several), or None, said as a note of `what`."""
    specs = [s for s in ctx.styles.order
             if s.split(":")[0] == name and (ctx.timed["spec"] == s).any()]
    if not specs:
        ctx.note(f"{what}: no ok row of `{name}` with input {ctx.input}; no crossover lengths "
                 f"against {name}")
        return None
    if len(specs) > 1:
        ctx.note(f"{what}: several {name} specs; the baseline is {specs[0]}")
    return specs[0]


def baselines(ctx):
    """The spec of `flash` and of `full` (the first of each name in the results)."""
    return [(name, spec) for name in ["flash", "full"]
            if (spec := baseline(ctx, name)) is not None]


def stack_marks(ax, marks):
    """Draws each (spec style, n) crossover mark on the line at 1, stacked above and below it
    (MARK_STEP points a level) where it would overlap a mark placed before it. Returns the
    (n, y) of each mark. Call after freeze_layout."""
    pt = ax.figure.dpi / 72.0
    to_display = ax.transData.transform
    to_data = ax.transData.inverted().transform
    placed, out = [], []  # (x, level) in display pixels
    for style, n in sorted(marks, key=lambda m: m[1]):
        x, y = to_display((n, 1.0))
        for level in [0] + [s * k for k in range(1, 20) for s in (1, -1)]:
            if all(abs(x - px) >= (MARK_SIZE + 1.5) * pt or level != pl for px, pl in placed):
                break
        placed.append((x, level))
        _, yd = to_data((x, y + level * MARK_STEP * pt))
        ax.plot([n], [yd], linestyle="none", marker=style["marker"], color=style["color"],
                markersize=MARK_SIZE, zorder=4, clip_on=False, **MARK_EDGE)
        out.append((n, float(yd)))
    return out


def crossover_section(ctx):
    lay = ctx.layout
    bases = baselines(ctx)
    ctx.md.append("## Crossover lengths\n")
    if not bases:
        ctx.md.append("Neither `flash` nor `full` was measured, so there is no crossover.\n")
        return
    panels = [(cfg, causal) for _, _, cfg, causal in ctx.panels()]
    fig, axes = new_grid(len(panels), len(bases), sharey=False)
    title = f"Time relative to the baseline; below 1 = faster ({ctx.title_suffix()})"
    fig.suptitle(title, fontsize=10.5)
    present, any_noisy = set(), False
    table = {}  # spec -> {(panel, base): text}
    columns, records, pending = [], [], []
    for r, (cfg, causal) in enumerate(panels):
        sub = lay.select(ctx.timed, cfg, causal)
        for c, (bname, bspec) in enumerate(bases):
            ax = axes[r][c]
            columns.append((ctx.panel_title(cfg, causal), bname))
            lines, marks = [], []
            for spec in ctx.styles.order:
                if spec == bspec or not (sub["spec"] == spec).any():
                    continue  # the baseline against itself is 1 everywhere
                ns, ratio, bad = ratio_series(sub, spec, bspec)
                cross = Crossing(ns, ratio, bad)
                table.setdefault(spec, {})[columns[-1]] = cross.text()
                if len(ns) == 0:
                    continue
                st = ctx.styles(spec)
                ax.plot(ns, ratio, label=ctx.styles.label(spec), **st)
                if bad.any():
                    any_noisy = True
                    ax.plot(ns[bad], ratio[bad], linestyle="none", marker=st["marker"],
                            markersize=6.5, markerfacecolor="white", markeredgecolor=st["color"],
                            markeredgewidth=1.3, zorder=3)
                present.add(spec)
                lines.append({"spec": spec, "n": jsonable(ns), "ratio": jsonable(ratio),
                              "crossing": cross.record()})
                if cross.kind == "from":
                    marks.append((st, cross.n, spec))
            ax.axhline(1.0, color="0.2", linewidth=1.0, zorder=1)
            ratio_axis(ax)
            log2_n_axis(ax, sub["n"].unique())
            ax.set_ylabel(f"time / time of {bname}")
            ax.set_title(f"vs {bname}: {ctx.panel_title(cfg, causal)}")
            records.append({"title": f"vs {bname}: {ctx.panel_title(cfg, causal)}",
                            "baseline": bspec, "lines": lines})
            pending.append((ax, marks, records[-1]))
    freeze_layout(fig)
    for ax, marks, rec in pending:
        where = stack_marks(ax, [(st, n) for st, n, _ in marks])
        by_n = sorted(marks, key=lambda m: m[1])
        rec["marks"] = [{"spec": spec, "n": n, "y": y}
                        for (_, _, spec), (n, y) in zip(by_n, where)]
    handles = [ctx.styles.handle(s) for s in ctx.styles.order if s in present]
    handles += ctx.styles.family_handles([s for s in ctx.styles.order if s in present])
    handles.append(Line2D([], [], color="0.75", linestyle="none", marker="o",
                          markersize=MARK_SIZE, label="outlined: crossover n (on the line at 1, "
                          "stacked where close)", **MARK_EDGE))
    if any_noisy:
        handles.append(NOISY_HANDLE)
    ctx.record("crossover", panels=records, legend=[h.get_label() for h in handles])
    finish(fig, ctx.fig_path("crossover"), handles, title)
    ctx.embed("crossover", "crossover")
    ctx.md.append("Where each variant is faster than the baseline, from the measured lengths at "
                  "which neither is noisy (lengths with a noisy row are listed and not judged, "
                  "†): \"≈ n: faster from there on\" when it is slower below a length and "
                  "faster at every length from it (interpolated in log-log between the two "
                  "measured lengths around the crossing; the figure marks it on the line at "
                  "1), \"only at n ∈ {…}\" when it goes back and forth, \"faster at every "
                  "n\" or \"never in range\" for the measured range.\n\n")
    header = ["variant"] + [f"vs {b}, {p}" for p, b in columns]
    rows = [[code(s)] + [table[s].get(col, "—") for col in columns]
            for s in ctx.styles.order if s in table]
    ctx.md.append(md_table(header, rows) + "\n")
    if any("†" in t for cells in table.values() for t in cells.values()):
        ctx.md.append(NOISY_FOOTNOTE + "\n\n")
