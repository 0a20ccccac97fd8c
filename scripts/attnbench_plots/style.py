"""Look of every attnbench figure: colours and markers per variant spec, panel sizes, axes
helpers, the shared legend, and the markdown helpers of the report."""

import math
import os
import sys
import json
import subprocess
import textwrap
import zlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from attnbench_results import atomic_write  # noqa: E402
from attnbench_variants import default_binary  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import (FixedLocator, FuncFormatter, LogLocator, NullFormatter,  # noqa: E402
                               NullLocator)

PROG = "plot.py"
MIB = float(1 << 20)
# The figures this process has written (save_figure), by absolute path: the report removes
# its own figures it did not draw only once everything else is written (remove_unsaved).
SAVED = set()

# Colours for variants that name none in their registration (`attnbench list --json`, "color"
# and "marker"): picked by a hash of the name, so a variant keeps its colour whatever else a
# run holds.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#393b79", "#637939", "#8c6d31",
           "#843c39", "#7b4173"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h"]

# The binary asked for the registration of variants a run's meta.json does not describe
# (plot.py --attnbench sets it; None: the binary beside these scripts).
BINARY = None
_CATALOG = None


def catalog():
    """Every variant's description by name, as `attnbench list --json` gives it (asked once per
    process); {} when no binary answers."""
    global _CATALOG
    if _CATALOG is None:
        _CATALOG = {}
        binary = BINARY or default_binary()
        try:
            run = subprocess.run([binary, "list", "--json"], capture_output=True, text=True,
                                 timeout=120)
            if run.returncode == 0:
                _CATALOG = {v["name"]: v for v in json.loads(run.stdout)
                            if isinstance(v, dict) and "name" in v}
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    return _CATALOG


# The variants the results being drawn describe (meta.json's "variants", set by Styles).
DESCRIBED = {}


def variant_info(name):
    """A variant's description: the run's own (meta.json) when it has the registration's
    presentation (family, look, long_context: recorded since variants declare them), else the
    binary's (`catalog`, asked only then), else {}."""
    v = DESCRIBED.get(name)
    if isinstance(v, dict) and "family" in v:
        return v
    return catalog().get(name, {})


FAMILY_LINESTYLE = {"exact": "-", "pattern": "--", "lowrank": "-.", "clustering": ":",
                    "decay": (0, (6, 2)), "other": (0, (5, 1, 1, 1, 1, 1))}
FAMILY_NAME = {"exact": "exact", "pattern": "sparse pattern", "lowrank": "low-rank / kernel",
               "clustering": "clustering / hashing", "decay": "linear with decay / delta rule",
               "other": "other"}

PANEL_W, PANEL_H = 5.0, 3.5  # inches; two panels side by side leave room for two legend columns
DPI = 150

plt.rcParams.update({
    "font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9, "legend.fontsize": 8,
    "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.grid": True, "grid.alpha": 0.3,
    "grid.linewidth": 0.6, "axes.spines.top": False, "axes.spines.right": False,
    "lines.linewidth": 1.4, "lines.markersize": 4.5, "savefig.dpi": DPI,
})


# The O(n) and O(n²) guides: wide and pale, so they never read as a variant's line style.
GUIDE_STYLE = {"n": {"color": "0.55", "linestyle": "-", "linewidth": 3.0, "alpha": 0.3},
               "n2": {"color": "0.55", "linestyle": (0, (3, 2)), "linewidth": 3.0, "alpha": 0.3}}


# Legend entries of the marks the time figures add to a variant's line.
SPREAD_HANDLE = Line2D([], [], color="0.3", marker="|", markersize=9, markeredgewidth=1.0,
                       linestyle="none", label="bar: min–max of repetitions")
NOISY_HANDLE = Line2D([], [], color="0.3", marker="o", markersize=6, markerfacecolor="white",
                      markeredgewidth=1.2, linestyle="none", label="hollow: noisy row")


# Said under every table that marks a row noisy.
NOISY_FOOTNOTE = ("† noisy: the repetitions of this row spread by more than 1.5× (max/min), or "
                  "other processes kept more processors busy than its threads left free "
                  "(harness/runner.h, `noise_reason`); do not compare its time without "
                  "measuring it again (docs/methodology.md, \"Stable numbers\").")


def warn(msg):
    print(f"{PROG}: {msg}", file=sys.stderr)


def _hash(text):
    return zlib.crc32(text.encode("utf-8"))


def _split_spec(spec):
    name, _, params = str(spec).partition(":")
    pairs = [p.partition("=") for p in params.split(",") if p]
    return name, [(k, v) for k, _, v in pairs]


def _same_value(a, b):
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


class Styles:
    """Colour, marker and line style per variant spec, derived from the variant's name (not the
    order specs appear in), so every figure of every run draws a variant alike. Specs of one
    variant with other parameters share its colour and take another marker. Labels are short:
    the name and the parameters that differ from the defaults `variants` gives (meta.json's
    "variants", as `attnbench list --json`); the full spec without them."""

    def __init__(self, specs, variants=None):
        self.order = list(specs)
        self.defaults = {}
        for v in variants or []:
            if isinstance(v, dict) and "name" in v:
                DESCRIBED[v["name"]] = v
                self.defaults[v["name"]] = {p.get("name"): str(p.get("default"))
                                            for p in v.get("params", []) if isinstance(p, dict)}

    def registration(self, name):
        """The variant's family, colour and marker as it registers them (variant_info)."""
        v = variant_info(name)
        family = v.get("family")
        return (v.get("color") or None, v.get("marker") or None,
                family if family in FAMILY_LINESTYLE else "other")

    def family(self, spec):
        return self.registration(_split_spec(spec)[0])[2]

    def __call__(self, spec, line=True):
        name, params = _split_spec(spec)
        color, marker, family = self.registration(name)
        color = color or PALETTE[_hash(name) % len(PALETTE)]
        if marker not in MARKERS:
            marker = MARKERS[_hash(name) // 7 % len(MARKERS)]
        if self.changed(spec):
            # another parameter setting of the same variant: another marker, by the setting's
            # rank among this variant's non-default settings in the run (sorted, so the order
            # of the rows does not matter)
            settings = sorted(s for s in self.order
                              if _split_spec(s)[0] == name and self.changed(s))
            rank = settings.index(spec) if spec in settings else len(settings)
            base = MARKERS.index(marker)
            marker = MARKERS[(base + 1 + rank) % len(MARKERS)]
        style = {"color": color, "marker": marker}
        if line:
            style["linestyle"] = FAMILY_LINESTYLE[family]
        return style

    def changed(self, spec):
        """The (parameter, value) pairs of spec that differ from the variant's defaults; all of
        them when the defaults are unknown."""
        name, params = _split_spec(spec)
        d = self.defaults.get(name)
        if d is None:
            return params
        return [(k, v) for k, v in params if not (k in d and _same_value(v, d[k]))]

    def label(self, spec):
        name, params = _split_spec(spec)
        if name not in self.defaults:
            return str(spec)
        changed = self.changed(spec)
        return name + (":" + ",".join(f"{k}={v}" for k, v in changed) if changed else "")

    def handle(self, spec, line=True):
        style = self(spec, line=line)
        if not line:
            style["linestyle"] = "none"
        return Line2D([], [], label=self.label(spec), **style)

    def family_handles(self, specs):
        """Legend entries for the line styles of the families among specs."""
        families = []
        for s in specs:
            f = self.family(s)
            if f not in families:
                families.append(f)
        order = list(FAMILY_LINESTYLE)
        return [Line2D([], [], color="0.3", linestyle=FAMILY_LINESTYLE[f], linewidth=1.2,
                       label=FAMILY_NAME[f]) for f in sorted(families, key=order.index)]


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


GUIDE_POWERS = {"n": 1, "n2": 2}


def guides(ax, ns, ys, orders=("n", "n2")):
    """Guide lines through the geometric mean of the values at the smallest n, one per order
    of `orders`: "n" for O(n), "n2" for O(n^2). Returns whether they were drawn (they need two
    lengths)."""
    if len(set(ns)) < 2:
        return False
    n0 = min(ns)
    y0 = math.exp(np.mean(np.log([y for n, y in zip(ns, ys) if n == n0])))
    x = np.array([n0, max(ns)], dtype=float)
    for order in orders:
        ax.plot(x, y0 * (x / n0) ** GUIDE_POWERS[order], zorder=1, **GUIDE_STYLE[order])
    return True


ERROR_LABEL = r"relative error $\Vert O - O_\mathrm{ref}\Vert_F\ /\ \Vert O_\mathrm{ref}\Vert_F$"

GUIDE_HANDLES = [Line2D([], [], label="O(n) guide", **GUIDE_STYLE["n"]),
                 Line2D([], [], label="O(n²) guide", **GUIDE_STYLE["n2"])]


def guide_handles(orders=("n", "n2")):
    """The legend entries of the guides of `orders` (see guides)."""
    return [h for h, order in zip(GUIDE_HANDLES, GUIDE_POWERS) if order in orders]


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


def finish(fig, path, handles, title, legend_ax=None, notes=()):
    """Title, one shared legend, save, close. The legend goes into legend_ax (a spare cell of
    the grid, its axes hidden) when given, else below the panels (outside the layout, so the
    saved bounding box grows to hold it). `notes` are lines of text under the legend (entries
    too long for a legend column)."""
    # a title set before freeze_layout was placed by the layout: setting it again would move
    # it back to its default height, onto the panels' titles
    current = getattr(fig, "_suptitle", None)
    if current is None or current.get_text() != title:
        fig.suptitle(title, fontsize=10.5)
    legend = None
    if handles and legend_ax is not None:
        # as many columns as fit in the cell; a legend larger than the cell runs over its edge
        # (out of the layout, so that it never shrinks the panels) and the saved bounding box
        # grows to hold it
        legend_ax.set_axis_off()
        fig.canvas.draw()
        room = legend_ax.get_window_extent(fig.canvas.get_renderer()).width
        legend = legend_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, 1.0),
                                  ncol=legend_columns(fig, handles, room), frameon=False,
                                  handlelength=2.2, columnspacing=1.5, borderaxespad=0.0)
        legend.set_in_layout(False)
    elif handles:
        legend = fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                            ncol=legend_columns(fig, handles), frameon=False, handlelength=2.2,
                            columnspacing=1.5)
    if notes:
        top = 0.0
        if legend is not None:
            fig.canvas.draw()
            box = legend.get_window_extent(fig.canvas.get_renderer())
            top = fig.transFigure.inverted().transform((0, box.y0))[1]
        # wrapped to the figure's width (a character is about 0.55 of the font size wide)
        chars = int(fig.get_figwidth() * 72 / (0.55 * plt.rcParams["legend.fontsize"]))
        notes = ["\n".join(textwrap.wrap(t, chars, break_long_words=False)) for t in notes]
        fig.legend(handles=[Line2D([], [], linestyle="none", label=t) for t in notes],
                   loc="upper center", bbox_to_anchor=(0.5, min(top, 0.0)), ncol=1,
                   frameon=False, handlelength=0, handletextpad=0)
    extra = fig.get_default_bbox_extra_artists()  # the legend in a cell is out of the layout
    if legend is not None and legend not in extra:
        extra.append(legend)
    save_figure(fig, path, bbox_inches="tight", facecolor="white", bbox_extra_artists=extra)
    plt.close(fig)


def save_figure(fig, path, **kwargs):
    """fig.savefig(path, **kwargs) as a PNG written whole or not at all (atomic_write: a failed
    write, e.g. a full disk, leaves the previous figure and raises ResultsError naming it)."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", **kwargs))
    SAVED.add(os.path.abspath(path))


def legend_columns(fig, handles, room=None):
    """As many legend columns as fit in `room` display pixels (default: the figure's width),
    measured on the rendered labels:
    the legend fills its columns top to bottom, and each column is as wide as its widest label
    plus its line sample and spacing."""
    renderer = fig.canvas.get_renderer()
    size = plt.rcParams["legend.fontsize"]
    widths = []
    for h in handles:
        t = fig.text(0, 0, h.get_label(), fontsize=size)
        widths.append(t.get_window_extent(renderer).width)
        t.remove()
    pad = (2.2 + 0.8 + 1.5) * size * fig.dpi / 72.0  # handle, text pad, column spacing
    room = fig.get_figwidth() * fig.dpi if room is None else room
    for ncol in range(len(handles), 1, -1):
        # matplotlib's split: the first `large` columns hold one entry more
        rows, large = divmod(len(handles), ncol)
        total, i = 0.0, 0
        for k in range(ncol):
            size_k = rows + (1 if k < large else 0)
            if size_k:
                total += max(widths[i:i + size_k]) + pad
            i += size_k
        if total <= room:
            return ncol
    return 1


def pad_log_limits(ax, xs, ys):
    """Leaves room around the points of a log-log scatter (a single point included)."""
    if not xs:
        return
    for setter, vals in ((ax.set_xlim, xs), (ax.set_ylim, ys)):
        lo, hi = min(vals), max(vals)
        setter(lo / 2.0, hi * 2.0)


def jsonable(values):
    """Numbers as JSON can hold them: floats, None for NaN or infinity."""
    out = []
    for v in values:
        v = float(v)
        out.append(v if math.isfinite(v) else None)
    return out


def freeze_layout(fig):
    """Runs the figure's constrained layout once and keeps it, so that what is placed next in
    display coordinates (labels that avoid each other) stays where it was checked."""
    fig.canvas.draw()
    fig.set_layout_engine("none")


def _box_distance(box, x, y):
    """Distance from the point (x, y) to the box (x0, y0, x1, y1), 0 inside it."""
    dx = max(box[0] - x, 0.0, x - box[2])
    dy = max(box[1] - y, 0.0, y - box[3])
    return math.hypot(dx, dy)


def place_labels(ax, points, texts, avoid=(), fontsize=None, reaches=(1.0, 2.5)):
    """Puts each text next to its point (data coordinates) where its box overlaps no label
    placed before it, no point's marker and nothing in `avoid` (display-space boxes), and
    stays inside the axes: candidate offsets are tried in turn (right, left, above, below, the
    diagonals, then farther out: each of `reaches` times the marker's size). Call after
    freeze_layout. The labels are in `fontsize` (default: the legend's). Returns per point
    whether a label was placed; a caller lists the others in a legend."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    pt = fig.dpi / 72.0
    data = np.asarray(points, dtype=float).reshape(-1, 2)
    xy = ax.transData.transform(data)
    r = 4.5 * pt  # marker half-size
    taken = [(x - r, y - r, x + r, y + r) for x, y in xy] + list(avoid)
    size = plt.rcParams["legend.fontsize"] if fontsize is None else fontsize
    placed = []
    for (x, y), at, text in zip(xy, data, texts):
        probe = ax.text(0, 0, text, fontsize=size, transform=None)
        bb = probe.get_window_extent(renderer)
        probe.remove()
        w, h = bb.width, bb.height
        done = False
        for reach in reaches:
            d = r * reach + 2 * pt
            for dx, dy in ((d, -h / 2), (-d - w, -h / 2), (-w / 2, d), (-w / 2, -d - h),
                           (d, d * 0.5), (-d - w, d * 0.5), (d, -d * 0.5 - h),
                           (-d - w, -d * 0.5 - h)):
                box = (x + dx, y + dy, x + dx + w, y + dy + h)
                if box[0] < frame.x0 or box[2] > frame.x1 or box[1] < frame.y0 or \
                        box[3] > frame.y1:
                    continue
                if any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3]
                       for b in taken):
                    continue
                # a label must be nearer its own point than any other, or it names the wrong one
                own = _box_distance(box, x, y)
                if any(_box_distance(box, px, py) < own + 2 * pt for px, py in xy
                       if (px, py) != (x, y)):
                    continue
                ax.annotate(text, xy=tuple(at), xycoords="data", xytext=(dx / pt, dy / pt),
                            textcoords="offset points", fontsize=size, ha="left",
                            va="bottom", annotation_clip=False)
                taken.append(box)
                done = True
                break
            if done:
                break
        placed.append(done)
    return placed


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


def fmt_bytes(b):
    """A byte count in B, KiB, MiB or GiB, 3 significant digits."""
    if b is None or not np.isfinite(b):
        return "—"
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= size:
            return f"{b / size:.3g} {name}"
    return f"{b:.0f} B"


def unit(v, name):
    return f"{v:.1f} {name}" if isinstance(v, (int, float)) else "unknown"


def times(x):
    return "—" if not np.isfinite(x) else f"{x:.3g}×"


def remove_unsaved(paths):
    """Removes each of `paths` (figures of the script's own, from an earlier run) that this
    process has not written (save_figure), so that no stale figure outlives its data. Called
    last, once every other output is written: a run that fails leaves the earlier figures."""
    for path in paths:
        if os.path.abspath(path) not in SAVED and os.path.exists(path):
            os.remove(path)
