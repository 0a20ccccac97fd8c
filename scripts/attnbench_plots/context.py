"""What every figure family reads: the results, how they split into panels, the input the
timed figures use, and the report being written (markdown and the notes said on stderr)."""

import contextlib
import math
import os

import numpy as np

from attnbench_results import (BF16, DECODE, F32, FORWARD, TRAIN_PASSES, ResultsError,
                               spec_order)

from .style import Styles, causal_name, code, fmt_n, md_table, new_grid, num, warn


class Layout:
    """How rows are split into panels.

    A configuration is the tuple of problem columns other than n, m, causal and input: always
    dim and heads, plus kv_heads (grouped-query rows), embed (layer rows), batch, scale, seed or
    threads when the results hold several values of them. Columns with one value are shown once,
    in the figure title.
    """

    def __init__(self, df):
        # Multi-head layer rows (embed > 0) get panels of their own, apart from plain attention.
        self.cols = ["dim", "heads"] + [c for c in ["kv_heads", "embed", "batch", "scale", "seed",
                                                    "threads"] if df[c].nunique() > 1]
        self.fixed = [c for c in ["batch", "scale", "seed", "threads"] if c not in self.cols]
        self.configs = sorted({tuple(r) for r in df[self.cols].itertuples(index=False)})
        self.causals = sorted(df["causal"].unique())
        self.inputs = list(dict.fromkeys(df["input"]))
        self.fixed_values = {c: df[c].iloc[0] for c in self.fixed}

    SHORT = {"dim": "d", "heads": "H", "kv_heads": "G", "embed": "E", "batch": "B", "scale": "scale", "seed": "seed",
             "threads": "threads"}

    def config_label(self, config):
        return ", ".join(f"{self.SHORT[c]}={num(v)}" for c, v in zip(self.cols, config))

    def fixed_label(self):
        return ", ".join(f"{self.SHORT[c]}={num(v)}" for c, v in self.fixed_values.items())

    def select(self, df, config, causal=None, input_=None):
        mask = np.ones(len(df), dtype=bool)
        for c, v in zip(self.cols, config):
            mask &= (df[c] == v).to_numpy()
        if causal is not None:
            mask &= (df["causal"] == causal).to_numpy()
        if input_ is not None:
            mask &= (df["input"] == input_).to_numpy()
        return df[mask]


class Context:
    """The results directory being drawn and the report being written."""

    def __init__(self, args, df, meta):
        self.args = args
        self.dir = args.dir
        self.plots = os.path.join(self.dir, "plots")
        self.df = df
        self.meta = meta
        ok_any = df[df["status"] == "ok"]
        # Every figure and the tables but the precision one draw float32 rows; the precision
        # section (precision.py) compares the bf16 rows with them.
        self.bf16 = ok_any[ok_any["dtype"] == BF16].copy()
        all_ok = ok_any[ok_any["dtype"] == F32].copy()
        # Every figure and table draws the forward rows (pass fwd, every row of a file written
        # before the column), except the training section (training.py), which draws the rows
        # of the training passes, and the generation section (decode.py), which draws the
        # causal decode rows: mixing passes would draw several times per point.
        self.all_ok = all_ok
        self.ok = all_ok[all_ok["pass"] == FORWARD]
        self.train = all_ok[all_ok["pass"].isin(TRAIN_PASSES)]
        self.decode = all_ok[(all_ok["pass"] == DECODE) & (all_ok["causal"] == 1)]
        self.styles = Styles(spec_order(df),
                             meta.get("variants") if isinstance(meta, dict) else None)
        self.layout = Layout(all_ok)
        inputs = self.layout.inputs
        if args.input is not None:
            if args.input not in inputs:
                raise ResultsError(f"--input {args.input}: no ok row has that input; present: "
                                   f"{', '.join(inputs)}")
            self.input = args.input
        else:
            self.input = "gaussian" if "gaussian" in inputs else inputs[0]
        # every scale of the timed input (speed against error, where sharper inputs change
        # the error), and one scale for the figures of time and memory, which do not depend
        # on it: 1 when present, else the smallest (--scale chooses)
        self.timed_all = self.ok[self.ok["input"] == self.input]
        timed_any = all_ok[all_ok["input"] == self.input]
        scales = sorted(timed_any["scale"].unique()) if "scale" in all_ok.columns else []
        self.scale = None
        if getattr(args, "scale", None) is not None:
            if args.scale not in scales:
                raise ResultsError(f"--scale {args.scale:g}: no ok row of input {self.input} "
                                   f"has that scale; present: "
                                   f"{', '.join(f'{x:g}' for x in scales)}")
            self.scale = args.scale
        elif len(scales) > 1:
            self.scale = 1.0 if 1.0 in scales else scales[0]
        self.timed = self.of_scale(self.timed_all)
        # the training rows of the timed input, every scale and the one of self.timed
        self.train_timed_all = self.train[self.train["input"] == self.input]
        self.train_timed = self.of_scale(self.train_timed_all)
        # the decode rows of the timed input, at the scale of self.timed
        self.decode_timed = self.of_scale(self.decode[self.decode["input"] == self.input])
        self.md = []
        self.problems = []  # what the report could not show, also said on stderr
        # What each figure drew, by figure name (panels, lines, reference lines, labels):
        # written as JSON with --debug-json so that tests check the figures' content.
        self.debug = {}

    def of_scale(self, rows):
        """The rows of the scale the time and memory figures use (all of them when the results
        hold one scale)."""
        return rows if self.scale is None else rows[rows["scale"] == self.scale]

    def note(self, text):
        warn(text)
        self.problems.append(text)

    def record(self, figure, **items):
        """Adds items to what `figure` is recorded to have drawn (see --debug-json)."""
        self.debug.setdefault(figure, {}).update(items)

    def fig_path(self, name):
        return os.path.join(self.plots, name + ".png")

    def embed(self, name, alt):
        self.md.append(f"![{alt}](plots/{name}.png)\n")

    def title_suffix(self):
        fixed = self.layout.fixed_label()
        return f"input={self.input}" + (f", {fixed}" if fixed else "")

    @contextlib.contextmanager
    def every_scale(self):
        """Within it, the timed rows (and so panels() and grid()) hold every scale."""
        with self.drawing(self.timed_all):
            yield

    @contextlib.contextmanager
    def drawing(self, rows):
        """Within it, the timed rows (and so panels(), grid() and the figures drawn from them)
        are `rows`: the training and decode sections draw the figures of the forward from their
        own rows."""
        kept = self.timed
        self.timed = rows
        try:
            yield
        finally:
            self.timed = kept

    def panels(self):
        """(row, col, config, causal) of the grid used by the n-axis figures of the timed
        input: a row per configuration and a column per causal setting that it has rows of,
        only the cells that have rows (grid() hides the others)."""
        configs, causals = self.timed_shape()
        return [(r, c, cfg, causal) for r, cfg in enumerate(configs)
                for c, causal in enumerate(causals)
                if not self.layout.select(self.timed, cfg, causal).empty]

    def timed_shape(self):
        """The configurations and causal settings that have rows of the timed input."""
        lay = self.layout
        configs = [cfg for cfg in lay.configs if not lay.select(self.timed, cfg).empty]
        causals = [c for c in lay.causals if (self.timed["causal"] == c).any()]
        return configs, causals

    def grid(self, sharey=False):
        """The figure and axes grid of panels(), the cells without rows hidden."""
        configs, causals = self.timed_shape()
        fig, axes = new_grid(len(configs), len(causals), sharey=sharey)
        used = {(r, c) for r, c, _, _ in self.panels()}
        for r in range(len(configs)):
            for c in range(len(causals)):
                if (r, c) not in used:
                    axes[r][c].set_visible(False)
        return fig, axes

    def panels_at(self, n, title):
        """The figure of grid() titled `title`, and per panel of panels() (its axes, its timed
        rows at length n, its title): the figures at one n."""
        at_n = self.timed[self.timed["n"] == n]
        fig, axes = self.grid(sharey=False)
        fig.suptitle(title, fontsize=10.5)
        return fig, [(axes[r][c], self.layout.select(at_n, cfg, causal),
                      self.panel_title(cfg, causal)) for r, c, cfg, causal in self.panels()]

    def panel_title(self, cfg, causal):
        return f"{causal_name(causal)}, {self.layout.config_label(cfg)}"

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
