#!/usr/bin/python3
"""Figures and a markdown report from an attnbench results directory.

    scripts/plot.py DIR [--n N] [--input NAME] [--attnbench PATH] [--pattern-n N]

Reads DIR/results.csv and DIR/meta.json (written by `attnbench sweep --out DIR`) and writes
DIR/plots/*.png and DIR/report.md:

  time_vs_n.png       median time against n, log-log, with O(n) and O(n^2) guides
  memory_vs_n.png     peak heap of the forward pass against n
  error_vs_n.png      relative Frobenius error against n, one column per input distribution
  speed_vs_error.png  time against error at one n, with the Pareto frontier
  crossover.png       time relative to flash and to full against n; where each line crosses 1
                      is the variant's crossover length
  patterns.png        one head's attention pattern per pattern variant (`attnbench pattern`)

Only rows with status "ok" are drawn; the others are listed at the end of the report. Every
variant spec keeps one colour and marker in every figure. Time, memory and crossover use one
input distribution (--input); they do not depend on the data for most variants, and mixing
inputs would draw several points per n.
"""

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import (FixedLocator, FuncFormatter, LogLocator, NullFormatter,  # noqa: E402
                               NullLocator)

from attnbench_results import (ResultsError, format_seconds, load_meta, load_results,  # noqa: E402
                               problem_label, run_main, spec_order)

PROG = "plot.py"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ["time_vs_n", "memory_vs_n", "error_vs_n", "speed_vs_error", "crossover", "patterns"]
LRA_LENGTHS = [1024, 2048, 4096, 8192]
MIB = float(1 << 20)

# tab10 and six darker colours; with 7 markers, (colour, marker) pairs repeat only after 112
# specs, and no two of the first 16 specs share a colour.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#393b79", "#637939", "#8c6d31",
           "#843c39", "#7b4173"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]

PANEL_W, PANEL_H = 5.0, 3.5  # inches; two panels side by side leave room for two legend columns
TILE_PIXELS = 256  # largest side of one pattern image in the gallery
DPI = 150

plt.rcParams.update({
    "font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9, "legend.fontsize": 8,
    "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.grid": True, "grid.alpha": 0.3,
    "grid.linewidth": 0.6, "axes.spines.top": False, "axes.spines.right": False,
    "lines.linewidth": 1.4, "lines.markersize": 4.5, "savefig.dpi": DPI,
})


def warn(msg):
    print(f"{PROG}: {msg}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Styles, panels, axes
# ---------------------------------------------------------------------------------------------

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


class Layout:
    """How rows are split into panels.

    A configuration is the tuple of problem columns other than n, m, causal and input: always
    dim and heads, plus batch, scale, seed or threads when the results hold several values of
    them. Columns with one value are shown once, in the figure title.
    """

    def __init__(self, df):
        self.cols = ["dim", "heads"] + [c for c in ["batch", "scale", "seed", "threads"]
                                        if df[c].nunique() > 1]
        self.fixed = [c for c in ["batch", "scale", "seed", "threads"] if c not in self.cols]
        self.configs = sorted({tuple(r) for r in df[self.cols].itertuples(index=False)})
        self.causals = sorted(df["causal"].unique())
        self.inputs = list(dict.fromkeys(df["input"]))
        self.fixed_values = {c: df[c].iloc[0] for c in self.fixed}

    SHORT = {"dim": "d", "heads": "H", "batch": "B", "scale": "scale", "seed": "seed",
             "threads": "threads"}

    def config_label(self, config):
        return ", ".join(f"{self.SHORT[c]}={_num(v)}" for c, v in zip(self.cols, config))

    def fixed_label(self):
        return ", ".join(f"{self.SHORT[c]}={_num(v)}" for c, v in self.fixed_values.items())

    def select(self, df, config, causal=None, input_=None):
        mask = np.ones(len(df), dtype=bool)
        for c, v in zip(self.cols, config):
            mask &= (df[c] == v).to_numpy()
        if causal is not None:
            mask &= (df["causal"] == causal).to_numpy()
        if input_ is not None:
            mask &= (df["input"] == input_).to_numpy()
        return df[mask]


def _num(v):
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


# ---------------------------------------------------------------------------------------------
# Derived numbers
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Markdown helpers
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# The report, section by section
# ---------------------------------------------------------------------------------------------

class Report:
    def __init__(self, args, df, meta):
        self.args = args
        self.dir = args.dir
        self.plots = os.path.join(self.dir, "plots")
        self.df = df
        self.meta = meta
        self.ok = df[df["status"] == "ok"].copy()
        self.styles = Styles(spec_order(df))
        self.layout = Layout(self.ok)
        inputs = self.layout.inputs
        if args.input is not None:
            if args.input not in inputs:
                raise ResultsError(f"--input {args.input}: no ok row has that input; present: "
                                   f"{', '.join(inputs)}")
            self.input = args.input
        else:
            self.input = "gaussian" if "gaussian" in inputs else inputs[0]
        self.timed = self.ok[self.ok["input"] == self.input]
        self.md = []
        self.problems = []  # what the report could not show, also said on stderr

    def note(self, text):
        warn(text)
        self.problems.append(text)

    def fig_path(self, name):
        return os.path.join(self.plots, name + ".png")

    def embed(self, name, alt):
        self.md.append(f"![{alt}](plots/{name}.png)\n")

    def title_suffix(self):
        fixed = self.layout.fixed_label()
        return f"input={self.input}" + (f", {fixed}" if fixed else "")

    def panels(self):
        """(row, col, config, causal) of the grid used by the n-axis figures."""
        lay = self.layout
        return [(r, c, cfg, causal) for r, cfg in enumerate(lay.configs)
                for c, causal in enumerate(lay.causals)]

    def panel_title(self, cfg, causal):
        return f"{causal_name(causal)}, {self.layout.config_label(cfg)}"

    # --- header -------------------------------------------------------------------------------
    def header(self):
        meta = self.meta
        self.md.append(f"# attnbench report: {os.path.basename(os.path.abspath(self.dir))}\n")
        self.md.append("## Run\n")
        if meta is None:
            self.note(f"warning: {os.path.join(self.dir, 'meta.json')} does not exist; the "
                      f"report cannot name the machine or the commit")
            self.md.append("meta.json is missing: machine and commit unknown.\n")
        else:
            m = meta.get("machine", {}) if isinstance(meta.get("machine"), dict) else {}
            rows = [
                ("commit", meta.get("git_commit", "unknown")),
                ("date (UTC)", meta.get("date", "unknown")),
                ("command" if not meta.get("earlier_command_lines") else "commands",
                 "<br>".join(f"`{c}`" for c in list(meta.get("earlier_command_lines") or [])
                             + [meta.get("command_line", "unknown")])),
                ("CPU", m.get("cpu_model", meta.get("cpu_model", "unknown"))),
                ("threads", meta.get("threads", m.get("threads", "unknown"))),
                ("GEMM rate", _unit(m.get("gemm_gflops"), "GFLOP/s")),
                ("memory bandwidth (triad)", _unit(m.get("bandwidth_gbs"), "GB/s")),
                ("compiler, build", f"{meta.get('compiler', 'unknown')}, "
                                    f"{meta.get('build_type', 'unknown')}"),
                ("attnbench", meta.get("attnbench_version", "unknown")),
            ]
            self.md.append(md_table(["", ""], rows))
        counts = self.df["status"].value_counts()
        self.md.append("\nRows: " + ", ".join(f"{v} {k}" for k, v in counts.items()) +
                       f". Variants: {len(self.styles.order)}. Time, memory, crossover and the "
                       f"efficiency table use input `{self.input}`"
                       + (f" ({self.layout.fixed_label()})" if self.layout.fixed_label() else "")
                       + ".\n")

    # --- time and memory against n ------------------------------------------------------------
    def table_by_n(self, sub, column, cell):
        """Markdown table of `column` (median per n, formatted by `cell`): a row per spec, a
        column per n of `sub`."""
        ns = sorted(sub["n"].unique())
        rows = []
        for spec in self.styles.order:
            s = sub[sub["spec"] == spec]
            if s.empty:
                continue
            by_n = s.groupby("n")[column].median()
            rows.append([code(spec)] + [cell(by_n.get(n, math.nan)) for n in ns])
        return md_table(["variant"] + [f"n={fmt_n(n)}" for n in ns], rows)

    def against_n(self, name, column, scale, ylabel, title, section, cell, explain):
        lay = self.layout
        fig, axes = new_grid(len(lay.configs), len(lay.causals), sharey=True)
        present, dropped, with_guides = set(), [], False
        for r, c, cfg, causal in self.panels():
            ax = axes[r][c]
            sub = lay.select(self.timed, cfg, causal)
            all_n, all_y = [], []
            for spec in self.styles.order:
                s = sub[sub["spec"] == spec]
                if (s[column].isna() | (s[column] <= 0)).any():
                    dropped.append(spec)
                ns, ys = series(sub, spec, column)
                if len(ns) == 0:
                    continue
                ys = ys / scale
                ax.plot(ns, ys, label=spec, **self.styles(spec))
                present.add(spec)
                all_n += list(ns)
                all_y += list(ys)
            with_guides = guides(ax, all_n, all_y) or with_guides
            ax.set_yscale("log")
            log2_n_axis(ax, sub["n"].unique())
            ax.set_title(self.panel_title(cfg, causal))
            if c == 0:
                ax.set_ylabel(ylabel)
            else:
                ax.tick_params(labelleft=True)
        handles = [self.styles.handle(s) for s in self.styles.order if s in present]
        finish(fig, self.fig_path(name), handles + (GUIDE_HANDLES if with_guides else []),
               f"{title} ({self.title_suffix()})")
        self.md.append(f"## {section}\n")
        self.embed(name, section)
        self.md.append(explain + "\n")
        if dropped:
            self.note(f"{name}: rows whose {column} is missing or not positive are left out of "
                      f"the log-scale figure (the table shows them) for: " +
                      ", ".join(dict.fromkeys(dropped)))
        for cfg in lay.configs:
            for causal in lay.causals:
                sub = lay.select(self.timed, cfg, causal)
                if sub.empty:
                    continue
                self.md.append(f"\n{self.panel_title(cfg, causal)}:\n\n")
                self.md.append(self.table_by_n(sub, column, cell))
        self.md.append("\n")

    # --- error against n ----------------------------------------------------------------------
    def error_vs_n(self):
        lay = self.layout
        rows_ = [(cfg, causal) for cfg in lay.configs for causal in lay.causals]
        # One panel per input distribution in a row; with a single input, the causal settings
        # go side by side instead.
        panels = [(cfg, causal, inp) for cfg, causal in rows_ for inp in lay.inputs
                  if not lay.select(self.ok, cfg, causal, inp).empty]
        ncol = len(lay.inputs) if len(lay.inputs) > 1 else len(lay.causals)
        ncol = max(1, min(ncol, len(panels)))
        fig, axes = new_grid(math.ceil(len(panels) / ncol), ncol, sharey=True)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        present, dropped = set(), []
        for i, (cfg, causal, inp) in enumerate(panels):
            ax = axes.flat[i]
            sub = lay.select(self.ok, cfg, causal, inp)
            for spec in self.styles.order:
                s = sub[sub["spec"] == spec]
                if s.empty:
                    continue
                if (s["rel_fro_error"].isna() | (s["rel_fro_error"] <= 0)).any():
                    dropped.append(spec)
                ns, ys = series(sub, spec, "rel_fro_error")
                if len(ns):
                    ax.plot(ns, ys, label=spec, **self.styles(spec))
                    present.add(spec)
            ax.set_yscale("log")
            log2_n_axis(ax, sub["n"].unique())
            ax.set_title(f"input={inp}, {self.panel_title(cfg, causal)}")
            if i % ncol == 0:
                ax.set_ylabel(ERROR_LABEL)
            else:
                ax.tick_params(labelleft=True)
        handles = [self.styles.handle(s) for s in self.styles.order if s in present]
        fixed = self.layout.fixed_label()
        finish(fig, self.fig_path("error_vs_n"), handles,
               "Error against the float64 reference" + (f" ({fixed})" if fixed else ""))
        self.md.append("## Error against sequence length\n")
        self.embed("error_vs_n", "error against n")
        self.md.append("Relative Frobenius error of the output against the double-precision "
                       "reference (on sampled rows where the full product is too large).\n")
        if dropped:
            self.note("error_vs_n: rows without a positive rel_fro_error are not drawn for: " +
                      ", ".join(dict.fromkeys(dropped)))
        for cfg, causal in rows_:
            for inp in lay.inputs:
                sub = lay.select(self.ok, cfg, causal, inp)
                if sub.empty:
                    continue
                self.md.append(f"\ninput={inp}, {self.panel_title(cfg, causal)}:\n\n")
                self.md.append(self.table_by_n(sub, "rel_fro_error", fmt_sci))
        self.md.append("\n")

    # --- speed against error ------------------------------------------------------------------
    def speed_vs_error(self):
        lay = self.layout
        n = pick_speed_error_n(self.timed, self.args.n)
        at_n = self.timed[self.timed["n"] == n]
        fig, axes = new_grid(len(lay.configs), len(lay.causals), sharey=False)
        present = set()
        tables = []
        for r, c, cfg, causal in self.panels():
            ax = axes[r][c]
            sub = lay.select(at_n, cfg, causal)
            pts, specs = [], []
            for spec in self.styles.order:
                s = sub[sub["spec"] == spec]
                s = s[(s["rel_fro_error"] > 0) & (s["time_median_s"] > 0)]
                if s.empty:
                    continue
                e, t = float(s["rel_fro_error"].median()), float(s["time_median_s"].median())
                pts.append((e, t))
                specs.append(spec)
                ax.plot([e], [t], linestyle="none", markersize=6.5, label=spec,
                        **self.styles(spec))
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
            ax.set_title(self.panel_title(cfg, causal))
            _pad_log_limits(ax, [p[0] for p in pts], [p[1] for p in pts])
            rows = [[code(s), format_seconds(p[1]), fmt_sci(p[0]), "yes" if i in front else ""]
                    for i, (s, p) in enumerate(zip(specs, pts))]
            tables.append((self.panel_title(cfg, causal), rows))
        handles = [self.styles.handle(s, line=False) for s in self.styles.order if s in present]
        handles.append(Line2D([], [], color="0.25", linewidth=1.0, marker="o", markersize=9,
                              markerfacecolor="none", markeredgewidth=0.8,
                              label="Pareto frontier (no variant both faster and more exact)"))
        finish(fig, self.fig_path("speed_vs_error"), handles,
               f"Time against error at n = {fmt_n(n)} ({self.title_suffix()})")
        self.md.append(f"## Speed against error at n = {fmt_n(n)}\n")
        self.embed("speed_vs_error", "speed against error")
        how = "chosen with --n" if self.args.n is not None else \
            "the largest n at which more than half of the variants have a measured row"
        self.md.append(f"n = {n} ({how}). Lower left is better; the frontier joins the variants "
                       f"that no other variant beats in both time and error.\n")
        for title, rows in tables:
            self.md.append(f"\n{title}:\n\n")
            self.md.append(md_table(["variant", "time", "rel. error", "on the frontier"], rows))
        self.md.append("\n")

    # --- crossover lengths --------------------------------------------------------------------
    def baselines(self):
        """The spec of `flash` and of `full` (the first of each name in the results)."""
        out = []
        for name in ["flash", "full"]:
            specs = [s for s in self.styles.order
                     if s.split(":")[0] == name and (self.timed["spec"] == s).any()]
            if not specs:
                self.note(f"crossover: no ok row of `{name}` with input {self.input}; no "
                          f"crossover lengths against {name}")
                continue
            if len(specs) > 1:
                self.note(f"crossover: several {name} specs; the baseline is {specs[0]}")
            out.append((name, specs[0]))
        return out

    def crossover_section(self):
        lay = self.layout
        bases = self.baselines()
        self.md.append("## Crossover lengths\n")
        if not bases:
            self.md.append("Neither `flash` nor `full` was measured, so there is no crossover.\n")
            _remove(self.fig_path("crossover"))
            return
        panels = [(cfg, causal) for cfg in lay.configs for causal in lay.causals]
        fig, axes = new_grid(len(panels), len(bases), sharey=False)
        present = set()
        table = {}  # (spec) -> {(panel, base): text}
        columns = []
        for r, (cfg, causal) in enumerate(panels):
            sub = lay.select(self.timed, cfg, causal)
            for c, (bname, bspec) in enumerate(bases):
                ax = axes[r][c]
                columns.append((self.panel_title(cfg, causal), bname))
                for spec in self.styles.order:
                    if spec == bspec or not (sub["spec"] == spec).any():
                        continue
                    ns, ratio = ratio_series(sub, spec, bspec)
                    kind, nx, again = crossover(ns, ratio)
                    table.setdefault(spec, {})[columns[-1]] = crossover_text(kind, nx, again, ns)
                    if len(ns) == 0:
                        continue
                    st = self.styles(spec)
                    ax.plot(ns, ratio, label=spec, **st)
                    present.add(spec)
                    if kind == "at":
                        ax.plot([nx], [1.0], linestyle="none", marker="|", markersize=14,
                                markeredgewidth=2, color=st["color"], zorder=3)
                ax.axhline(1.0, color="0.2", linewidth=1.0, zorder=1)
                ratio_axis(ax)
                log2_n_axis(ax, sub["n"].unique())
                ax.set_ylabel(f"time / time of {bname}")
                ax.set_title(f"vs {bname}: {self.panel_title(cfg, causal)}")
        handles = [self.styles.handle(s) for s in self.styles.order if s in present]
        handles.append(Line2D([], [], color="0.2", linestyle="none", marker="|", markersize=12,
                              markeredgewidth=2, label="crossover (interpolated in log-log)"))
        finish(fig, self.fig_path("crossover"), handles,
               f"Time relative to the baseline; below 1 = faster ({self.title_suffix()})")
        self.embed("crossover", "crossover")
        self.md.append("The smallest n at which each variant is faster than the baseline, "
                       "interpolated in log-log between the two measured lengths around the "
                       "crossing. \"faster at every n\" and \"never in range\" refer to the "
                       "measured lengths only.\n\n")
        header = ["variant"] + [f"vs {b}, {p}" for p, b in columns]
        rows = [[code(s)] + [table[s].get(col, "—") for col in columns]
                for s in self.styles.order if s in table]
        self.md.append(md_table(header, rows) + "\n")

    # --- Long Range Arena style efficiency table -----------------------------------------------
    def efficiency(self):
        lay = self.layout
        self.md.append("## Efficiency relative to full (Long Range Arena style)\n")
        full = [s for s in self.styles.order if s.split(":")[0] == "full"]
        if not full:
            self.note("efficiency table: no `full` rows, so nothing to be relative to")
            self.md.append("No `full` rows in these results, so there is no efficiency table.\n")
            return
        base = full[0]
        self.md.append(f"Speed = time of `{base}` / time of the variant (higher is faster); "
                       f"memory = peak heap of the variant / peak heap of `{base}` (lower is "
                       f"smaller). \"—\" = not measured (either the variant or `{base}`). "
                       f"Input `{self.input}`.\n")
        for cfg in lay.configs:
            for causal in lay.causals:
                sub = lay.select(self.timed, cfg, causal)
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
                for spec in self.styles.order:
                    if not (sub["spec"] == spec).any():
                        continue
                    speed = [get(base, n, "time_median_s") / get(spec, n, "time_median_s")
                             for n in LRA_LENGTHS]
                    mem = [get(spec, n, "peak_bytes") / get(base, n, "peak_bytes")
                           for n in LRA_LENGTHS]
                    rows.append([code(spec)] + [_times(x) for x in speed] +
                                [_times(x) for x in mem])
                header = (["variant"] + [f"speed {fmt_n(n)}" for n in LRA_LENGTHS] +
                          [f"memory {fmt_n(n)}" for n in LRA_LENGTHS])
                self.md.append(f"\n{self.panel_title(cfg, causal)}:\n\n")
                self.md.append(md_table(header, rows))
        self.md.append("\n")

    # --- pattern gallery ----------------------------------------------------------------------
    def patterns(self):
        self.md.append("## Attention patterns\n")
        path = self.fig_path("patterns")
        binary = self.args.attnbench
        n = self.args.pattern_n
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            self.note(f"patterns: no attnbench binary at {binary} (give one with --attnbench); "
                      f"no pattern gallery")
            self.md.append(f"No pattern gallery: no attnbench binary at `{binary}`.\n")
            return
        tiles, without, failed = [], {}, []
        with tempfile.TemporaryDirectory() as tmp:
            for i, spec in enumerate(self.styles.order):
                rows = self.ok[self.ok["spec"] == spec]
                if rows.empty:
                    continue
                for causal in sorted(rows["causal"].unique()):
                    r = rows[rows["causal"] == causal]
                    pref = r[r["input"] == self.input]
                    row = (pref if not pref.empty else r).iloc[0]
                    out = os.path.join(tmp, f"{i}_{causal}.npy")
                    cmd = [binary, "pattern", "--variant", spec, "--seq", str(n),
                           "--dim", str(int(row["dim"])), "--seed", str(int(row["seed"])),
                           "--input", str(row["input"]), "--output", out]
                    if int(row["m"]) != int(row["n"]):
                        cmd += ["--seq-k", str(max(1, round(n * int(row["m"]) / int(row["n"]))))]
                    if causal:
                        cmd.append("--causal")
                    p = subprocess.run(cmd, capture_output=True, text=True)
                    if p.returncode != 0:
                        msg = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
                        msg = msg.removeprefix("attnbench: error: ")
                        if "has no attention pattern" in msg:
                            without[spec] = msg
                            break
                        failed.append((spec, causal, msg))
                        continue
                    mask = np.load(out)
                    tiles.append((spec, int(causal), str(row["input"]), mask))
        if without:
            warn("patterns: no attention pattern (not drawn): " + ", ".join(without))
        for spec, causal, msg in failed:
            self.note(f"patterns: `attnbench pattern` failed for {spec} ({causal_name(causal)}):"
                      f" {msg}")
        if tiles:
            self.pattern_figure(tiles, path, n)
            self.embed("patterns", "attention patterns")
            self.md.append(f"One head (head 0) of each pattern variant at n = {n}, exported by "
                           f"`attnbench pattern`; black = attended pair (query row i, key column "
                           f"j). The percentage is the share of the n × m pairs attended. Above "
                           f"{TILE_PIXELS} positions a pixel stands for a square cell of pairs; its "
                           f"grey is the square root of the share of the cell's pairs attended "
                           f"(black: all of them).\n")
        else:
            _remove(path)
            self.md.append("No variant in these results has an attention pattern to draw.\n")
        if without:
            self.md.append("\nNot drawn, because the variant has no attention pattern (attnbench "
                           "says it \"does not restrict exact softmax attention to a set of "
                           "keys\"): " + ", ".join(code(s) for s in without) + ".\n")
        if failed:
            self.md.append("\n`attnbench pattern` failed for:\n\n" + md_table(
                ["variant", "causal", "message"],
                [[code(s), causal_name(c), m] for s, c, m in failed]))
        self.md.append("\n")

    def pattern_figure(self, tiles, path, n):
        # A tile is about TILE_PIXELS wide; larger patterns are shown in factor x factor cells
        # whose grey is the square root of the share of the cell's pairs attended: a dense
        # block is black, a scattered data-dependent pattern (hash buckets, clusters) shows as
        # grey rather than as solid black, and a single attended key column (strided
        # patterns) still stays visible (1/f of a cell -> grey sqrt(1/f)).
        factor = max(1, math.ceil(max(max(t[3].shape) for t in tiles) / TILE_PIXELS))
        ncol = min(6, len(tiles))
        nrow = math.ceil(len(tiles) / ncol)
        size = 1.9
        fig, axes = plt.subplots(nrow, ncol, figsize=(size * ncol, (size + 0.75) * nrow),
                                 squeeze=False, layout="constrained")
        for ax in axes.flat:
            ax.axis("off")
        for ax, (spec, causal, inp, mask) in zip(axes.flat, tiles):
            ax.axis("on")
            ax.grid(False)
            ax.imshow(np.sqrt(pool_share(mask, factor)), cmap="Greys", vmin=0, vmax=1,
                      interpolation="nearest", aspect="equal")
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ["top", "right", "bottom", "left"]:
                ax.spines[side].set_visible(True)
                ax.spines[side].set_color(self.styles(spec)["color"])
                ax.spines[side].set_linewidth(1.5)
            wrapped = "\n".join(textwrap.wrap(spec.replace(",", ", "), 30,
                                               break_long_words=False))
            share = 100.0 * mask.mean()
            ax.set_title(f"{wrapped}\n{causal_name(causal)}, {share:.1f}% attended",
                         fontsize=7, linespacing=1.15)
        cell = (f"; one pixel = {factor} × {factor} pairs, grey = √(share attended)"
                if factor > 1 else "")
        fig.suptitle(f"Attention patterns, head 0, n = {fmt_n(n)} (black = attended; rows "
                     f"queries, columns keys{cell})", fontsize=10.5)
        fig.savefig(path, bbox_inches="tight", facecolor="white")
        plt.close(fig)

    # --- rows not drawn -----------------------------------------------------------------------
    def not_ok(self):
        self.md.append("## Rows not plotted\n")
        bad = self.df[self.df["status"] != "ok"]
        if bad.empty:
            self.md.append("Every row has status ok.\n")
        else:
            cols = ["n", "m", "causal", "dim", "heads", "batch", "input"]
            rows = [[code(r["spec"]), problem_label(r, cols), r["status"], r["message"]]
                    for _, r in bad.iterrows()]
            self.md.append(f"{len(bad)} row(s) without a measurement:\n\n")
            self.md.append(md_table(["variant", "problem", "status", "message"], rows))
        if self.problems:
            self.md.append("\n### Notes from plot.py\n\n" +
                           "".join(f"- {p}\n" for p in self.problems))

    def write(self):
        os.makedirs(self.plots, exist_ok=True)
        for name in FIGURES:
            _remove(self.fig_path(name))
        self.header()
        self.against_n("time_vs_n", "time_median_s", 1.0, "median time (s)",
                       "Time per forward pass", "Time against sequence length",
                       format_seconds,
                       "Median wall-clock time of one forward pass over the repetitions. The "
                       "dashed and dotted grey lines are O(n) and O(n²) guides through the "
                       "smallest n.")
        self.against_n("memory_vs_n", "peak_bytes", MIB,
                       "peak heap of the forward pass (MiB)", "Peak memory",
                       "Peak memory against sequence length", fmt_mib,
                       "Peak heap allocated during a forward pass beyond what was allocated "
                       "before it (inputs and output excluded), in MiB. Variants with the same "
                       "workspace draw coinciding lines, of which only the last is visible; the "
                       "tables hold every value.")
        self.error_vs_n()
        self.speed_vs_error()
        self.crossover_section()
        self.efficiency()
        self.patterns()
        self.not_ok()
        report = os.path.join(self.dir, "report.md")
        with open(report, "w", encoding="utf-8") as f:
            f.write(re.sub(r"\n{3,}", "\n\n", "\n".join(self.md)))
        return report


def pool_share(mask, f):
    """Share of attended pairs in each f x f cell of a 0/1 mask (partial last cells count
    the pairs they hold)."""
    if f == 1:
        return mask.astype(float)
    n, m = mask.shape
    rows, cols = math.ceil(n / f) * f, math.ceil(m / f) * f
    padded = np.zeros((rows, cols))
    count = np.zeros((rows, cols))
    padded[:n, :m] = mask
    count[:n, :m] = 1
    shape = (rows // f, f, cols // f, f)
    return padded.reshape(shape).sum(axis=(1, 3)) / count.reshape(shape).sum(axis=(1, 3))


def _unit(v, unit):
    return f"{v:.1f} {unit}" if isinstance(v, (int, float)) else "unknown"


def _times(x):
    return "—" if not np.isfinite(x) else f"{x:.3g}×"


def _remove(path):
    if os.path.exists(path):
        os.remove(path)


def _pad_log_limits(ax, xs, ys):
    """Leaves room around the points of a log-log scatter (a single point included)."""
    if not xs:
        return
    for setter, vals in ((ax.set_xlim, xs), (ax.set_ylim, ys)):
        lo, hi = min(vals), max(vals)
        setter(lo / 2.0, hi * 2.0)


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Figures (DIR/plots/*.png) and a markdown report (DIR/report.md) "
                               "from an attnbench results directory.")
    ap.add_argument("dir", metavar="DIR", help="results directory of `attnbench sweep --out DIR`")
    ap.add_argument("--n", type=int, default=None,
                    help="sequence length of the speed-vs-error figure (default: the largest n "
                         "at which more than half of the variants have an ok row)")
    ap.add_argument("--input", default=None,
                    help="input distribution of the time, memory and crossover figures "
                         "(default: gaussian if present, else the first in the results)")
    ap.add_argument("--attnbench", default=os.path.join(REPO, "build", "attnbench"),
                    help="attnbench binary for the pattern gallery (default: %(default)s)")
    ap.add_argument("--pattern-n", type=int, default=1024,
                    help="sequence length of the pattern gallery (default: %(default)s)")
    args = ap.parse_args()
    if args.pattern_n < 1:
        ap.error("--pattern-n must be positive")
    df = load_results(args.dir)
    meta = load_meta(args.dir)
    report = Report(args, df, meta).write()
    print(f"{PROG}: wrote {report} and {os.path.join(args.dir, 'plots')}/*.png")
    return 0


if __name__ == "__main__":
    run_main(main, PROG)
