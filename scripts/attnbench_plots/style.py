"""Look of every attnbench figure: colours and markers per variant spec, panel sizes, axes
helpers, the shared legend, and the markdown helpers of the report."""

import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import (FixedLocator, FuncFormatter, LogLocator, NullFormatter,  # noqa: E402
                               NullLocator)

PROG = "plot.py"
MIB = float(1 << 20)

# tab10 and six darker colours; with 7 markers, (colour, marker) pairs repeat only after 112
# specs, and no two of the first 16 specs share a colour.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#393b79", "#637939", "#8c6d31",
           "#843c39", "#7b4173"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]

PANEL_W, PANEL_H = 5.0, 3.5  # inches; two panels side by side leave room for two legend columns
DPI = 150

plt.rcParams.update({
    "font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9, "legend.fontsize": 8,
    "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.grid": True, "grid.alpha": 0.3,
    "grid.linewidth": 0.6, "axes.spines.top": False, "axes.spines.right": False,
    "lines.linewidth": 1.4, "lines.markersize": 4.5, "savefig.dpi": DPI,
})


def warn(msg):
    print(f"{PROG}: {msg}", file=sys.stderr)


class Styles:
    """One colour and marker per variant spec, fixed by the order specs appear in the CSV."""

    def __init__(self, specs):
        self.order = list(specs)
        self.index = {s: i for i, s in enumerate(self.order)}

    def __call__(self, spec):
        i = self.index[spec]
        return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)]}

    def handle(self, spec, line=True):
        return Line2D([], [], label=spec, linestyle="-" if line else "none", **self(spec))


def fmt_n(n):
    n = int(n)
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def causal_name(c):
    return "causal" if int(c) else "non-causal"



def num(v):
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return int(v)
    return v


def series(sub, spec, column):
    """(n, y) of one spec in a panel, sorted by n, positive finite y only; several rows at one
    n (different m) are reduced to their median."""
    s = sub[sub["spec"] == spec]
    s = s[np.isfinite(s[column]) & (s[column] > 0)]
    if s.empty:
        return np.array([]), np.array([])
    g = s.groupby("n")[column].median()
    return g.index.to_numpy(dtype=float), g.to_numpy(dtype=float)


def log2_n_axis(ax, ns):
    ax.set_xscale("log", base=2)
    ns = sorted(set(int(n) for n in ns))
    if ns and len(ns) <= 12:
        ax.xaxis.set_major_locator(FixedLocator(ns))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: fmt_n(x)))
        pad = 2 ** 0.25
        ax.set_xlim(ns[0] / pad, ns[-1] * pad)
    ax.set_xlabel("sequence length n (tokens)")


def guides(ax, ns, ys):
    """O(n) and O(n^2) guide lines through the geometric mean of the values at the smallest n.
    Returns whether they were drawn (they need two lengths)."""
    if len(set(ns)) < 2:
        return False
    n0 = min(ns)
    y0 = math.exp(np.mean(np.log([y for n, y in zip(ns, ys) if n == n0])))
    x = np.array([n0, max(ns)], dtype=float)
    ax.plot(x, y0 * (x / n0), color="0.45", linestyle="--", linewidth=0.9, zorder=1)
    ax.plot(x, y0 * (x / n0) ** 2, color="0.45", linestyle=":", linewidth=1.1, zorder=1)
    return True


ERROR_LABEL = r"relative error $\Vert O - O_\mathrm{ref}\Vert_F\ /\ \Vert O_\mathrm{ref}\Vert_F$"

GUIDE_HANDLES = [Line2D([], [], color="0.45", linestyle="--", linewidth=0.9, label="O(n) guide"),
                 Line2D([], [], color="0.45", linestyle=":", linewidth=1.1, label="O(n²) guide")]


def ratio_axis(ax):
    """Log y axis for ratios, labelled 0.1, 0.2, 0.5, 1, 2, 5, ... rather than in powers of 10."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def new_grid(nrows, ncols, sharey=False):
    fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_W * ncols, PANEL_H * nrows),
                             squeeze=False, sharey=sharey, layout="constrained")
    return fig, axes


def finish(fig, path, handles, title):
    """Title, one shared legend below the panels (outside the layout, so the saved bounding
    box grows to hold it), save, close."""
    fig.suptitle(title, fontsize=10.5)
    if handles:
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=legend_columns(fig, handles), frameon=False, handlelength=2.2,
                   columnspacing=1.5)
    fig.savefig(path, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def legend_columns(fig, handles):
    """As many legend columns as fit in the figure's width, measured on the rendered labels
    (the column width is the widest label plus its line sample and spacing)."""
    renderer = fig.canvas.get_renderer()
    size = plt.rcParams["legend.fontsize"]
    widest = 0.0
    for h in handles:
        t = fig.text(0, 0, h.get_label(), fontsize=size)
        widest = max(widest, t.get_window_extent(renderer).width)
        t.remove()
    pt = fig.dpi / 72.0
    column = widest + (2.2 + 0.8 + 1.5) * size * pt  # handle, text pad, column spacing
    return max(1, min(len(handles), int(fig.get_figwidth() * fig.dpi // column)))


def pad_log_limits(ax, xs, ys):
    """Leaves room around the points of a log-log scatter (a single point included)."""
    if not xs:
        return
    for setter, vals in ((ax.set_xlim, xs), (ax.set_ylim, ys)):
        lo, hi = min(vals), max(vals)
        setter(lo / 2.0, hi * 2.0)


def md_table(header, rows):
    def cell(x):
        return str(x).replace("|", "\\|").replace("\n", " ")
    out = ["| " + " | ".join(cell(h) for h in header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def code(spec):
    return f"`{spec}`"


def fmt_sci(x):
    return "—" if x is None or not np.isfinite(x) else f"{x:.2e}"


def fmt_mib(b):
    return "—" if b is None or not np.isfinite(b) else f"{b / MIB:.3g} MiB"


def unit(v, name):
    return f"{v:.1f} {name}" if isinstance(v, (int, float)) else "unknown"


def times(x):
    return "—" if not np.isfinite(x) else f"{x:.3g}×"


def remove(path):
    if os.path.exists(path):
        os.remove(path)
