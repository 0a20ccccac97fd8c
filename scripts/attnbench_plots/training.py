"""Training: the rows of the training passes (`attnbench sweep --pass bwd,fwdbwd`).

  train_time_vs_n       median time of a forward and backward pass (pass fwdbwd) against n
  train_memory_vs_n     training memory against n: the peak heap of the fwdbwd pass, which
                        holds the saved state, with the saved state itself dashed
  grad_vs_fwd_error     per variant, the gradient error against the forward's error at one n
  train_speed_vs_error  fwdbwd time against the gradient error at one n, with the frontier

and the training table: per variant at the largest n with training rows, the time of each
pass, backward over forward, the saved bytes, the gradient error and the crossover length
against flash's fwdbwd time.

What the columns measure (harness/runner.cpp, run_one and time_passes): `peak_bytes` is the
largest heap above the level at the start of a repetition of the timed passes, inputs, output,
dO and the gradients excluded (allocated before). A fwdbwd pass runs the training forward,
which allocates the saved state and holds it, then the backward: its peak is the saved state
plus the larger of the forward's and the backward's working memory at that moment, i.e. the
training memory. A bwd row's peak leaves the saved state out (allocated before its timed
passes). `saved_bytes` is what the training forward still holds after it returned, measured
once before the timed passes.

The gradient error of a row is one number: the largest of grad_rel_err_q, _k and _v present
(each the relative Frobenius error of dQ, dK or dV against exact attention's gradient, in
float64, on the same inputs and dO). The largest, because a training step uses all three and
the reference norms that a combined norm would need are not in results.csv; a variant that
ignores an input by design (k for a shared-QK variant, whose dK is then 0 and its error 1)
is charged with it, and the tables name which gradient is the largest.
"""

import math

from matplotlib.lines import Line2D
from matplotlib.transforms import blended_transform_factory

from attnbench_results import (FORWARD, GRAD_ERROR_COLUMNS, KEY_COLUMNS, TRAIN_PASSES,
                               noisy, time_spread)

from .crossover import Crossing, baseline, ratio_series
from .error import (REFERENCE_COLOR, ZERO_ERROR, ZERO_STYLE, ErrorAxis, label_points,
                    pick_speed_error_n, speed_error_figure)
from .style import (ERROR_LABEL, MIB, NOISY_FOOTNOTE, code, finish, fmt_bytes, fmt_mib, fmt_n,
                    fmt_sci, jsonable, md_table, series, times)
from .time_memory import against_n, time_cell, time_table

BWD, FWDBWD = TRAIN_PASSES
FIGURES = ["train_time_vs_n", "train_memory_vs_n", "grad_vs_fwd_error", "train_speed_vs_error"]
# Columns computed per training row: the gradient error (the largest of the three), which
# gradient it is, and the forward error of the matching fwd row.
GRAD_ERROR, WORST, FWD_ERROR = "grad_error_", "worst_grad_", "fwd_error_"
GRAD_NAMES = {"grad_rel_err_q": "dQ", "grad_rel_err_k": "dK", "grad_rel_err_v": "dV"}
GRAD_LABEL = ("gradient error: the largest over dQ, dK, dV of\n"
              r"$\Vert dX - dX_\mathrm{ref}\Vert_F\ /\ \Vert dX_\mathrm{ref}\Vert_F$")
SAVED_STYLE = {"linestyle": (0, (2, 2)), "linewidth": 1.0, "markersize": 3.0,
               "markerfacecolor": "white"}
DIAGONAL_STYLE = {"color": "0.45", "linestyle": (0, (5, 3)), "linewidth": 1.0}

TRAIN_AXIS = ErrorAxis(
    "train_speed_vs_error", GRAD_ERROR, GRAD_LABEL, "gradient error", "zero gradient", False,
    "median time of forward + backward (s)", "Training time against gradient error",
    "Training: speed against gradient error",
    "The time of a forward and backward pass (pass fwdbwd) against the gradient error (the "
    "largest of the relative Frobenius errors of dQ, dK and dV against exact attention's). "
    "Lower left is better. A zero gradient has error 1 (the grey line): a variant at or above "
    "it beats doing nothing in no sense and is drawn pale. The frontier joins the variants "
    "below it that no other such variant beats in both time and gradient error.")


def with_errors(ctx, rows):
    """The training rows with the gradient error (GRAD_ERROR, NaN when none of the three was
    measured), which gradient it is (WORST) and the forward error of the matching fwd row
    (FWD_ERROR: the same spec and problem; NaN without one)."""
    grads = rows[GRAD_ERROR_COLUMNS]
    worst = grads.fillna(-1.0).idxmax(axis=1).map(GRAD_NAMES)
    out = rows.assign(**{GRAD_ERROR: grads.max(axis=1, skipna=True),
                         WORST: worst.where(grads.notna().any(axis=1), "")})
    keys = [c for c in KEY_COLUMNS if c != "pass"]
    fwd = ctx.ok[keys + ["rel_fro_error"]].drop_duplicates(keys, keep="last")
    merged = out.merge(fwd.rename(columns={"rel_fro_error": FWD_ERROR}), on=keys, how="left")
    merged.index = out.index
    return merged


def training_n(ctx, rows):
    """The n of the figures at one length: --n when the training rows have it, else (said in
    a note when --n names another) the rule of speed_vs_error on the training rows. Returns
    (n, how it was chosen)."""
    requested = ctx.args.n
    if requested is not None and (rows["n"] == requested).any():
        return requested, "chosen with --n"
    if requested is not None:
        ctx.note(f"training: no training row has n={requested} (--n); the training figures "
                 f"at one n use the default rule")
    return pick_speed_error_n(rows, None), \
        "the largest n at which more than half of the variants have a training row"


def section(ctx):
    if ctx.train_timed.empty:
        ctx.md.append("## Training\n")
        ctx.md.append("No training rows (`attnbench sweep --pass bwd,fwdbwd`)" +
                      (f" with input `{ctx.input}`" if not ctx.train.empty else "") +
                      " in these results, so there are no training figures or table.\n")
        return
    train = with_errors(ctx, ctx.train_timed)
    fwdbwd = train[train["pass"] == FWDBWD]
    if fwdbwd.empty:
        ctx.note("training: no ok fwdbwd row, so no training time and memory figures nor "
                 "training speed against gradient error (`sweep --pass fwdbwd` measures them)")
    else:
        with ctx.drawing(fwdbwd):
            time_figure(ctx)
            memory_figure(ctx)
    every = with_errors(ctx, ctx.train_timed_all)  # every scale, like speed_vs_error
    n, how = training_n(ctx, every[every["pass"] == FWDBWD] if not fwdbwd.empty else every)
    with ctx.drawing(every):
        gradient_figure(ctx, n, how)
    if not fwdbwd.empty:
        with ctx.drawing(every[every["pass"] == FWDBWD]):
            speed_error_figure(ctx, TRAIN_AXIS, n, how)
    table(ctx, train)


# --- time and memory against n ------------------------------------------------------------
def time_figure(ctx):
    against_n(ctx, "train_time_vs_n", "time_median_s", 1.0,
              "median time of forward + backward (s)",
              "Time per training pass (forward + backward)",
              "Training: time against sequence length",
              "Median wall-clock time of one forward and backward pass (`--pass fwdbwd`: the "
              "training forward, which keeps what the backward needs, then the backward from "
              "a given dO), with the conventions of the forward's figure: bars from the "
              "fastest to the slowest repetition, hollow markers for noisy rows, O(n) and "
              "O(n²) guides through the smallest n; in the tables, the factor after a time is "
              "its repetitions' spread and † marks a noisy row.",
              time_table)


def draw_saved(ctx, ax, sub, record):
    """Each spec's saved state (saved_bytes) in MiB, dashed in its colour; returns the
    legend entry."""
    for spec in ctx.styles.order:
        ns, ys = series(sub, spec, "saved_bytes")
        if len(ns):
            st = ctx.styles(spec, line=False)
            ax.plot(ns, ys / MIB, color=st["color"], marker=st["marker"], zorder=1.8,
                    **SAVED_STYLE)
            record.append({"spec": spec, "n": jsonable(ns), "saved": jsonable(ys / MIB)})
    return [Line2D([], [], color="0.3", marker="o", label="dashed: saved state (saved_bytes), "
                   "kept from the forward for the backward", **SAVED_STYLE)]


def memory_table(ctx, sub):
    text = ("Training memory (peak heap of the fwdbwd pass):\n\n" +
            ctx.table_by_n(sub, "peak_bytes", fmt_mib) +
            "\nof which the saved state (saved_bytes):\n\n" +
            ctx.table_by_n(sub, "saved_bytes", fmt_bytes))
    return text, False


def memory_figure(ctx):
    against_n(ctx, "train_memory_vs_n", "peak_bytes", MIB, "training memory (MiB)",
              "Training memory: peak heap of forward + backward",
              "Training: memory against sequence length",
              "Solid: the training memory, the peak heap of one forward and backward pass "
              "(the `peak_bytes` of the fwdbwd row) beyond what was allocated before it "
              "(inputs, output, dO and the gradients excluded). The training forward allocates "
              "the state it keeps for the backward and holds it until the backward is done, so "
              "this peak is the saved state plus the working memory of the forward or the "
              "backward, whichever is larger when the peak is reached. Dashed, in the same "
              "colour: the saved state alone (`saved_bytes`, what the training forward still "
              "holds after it returned); the gap between the two lines is the working memory. "
              "Variants with the same peak at every n are drawn side by side, a little apart "
              "along n.",
              memory_table, also=draw_saved)


# --- gradient error against forward error -------------------------------------------------
def gradient_points(ctx, sub):
    """Per spec of a panel at one n: (spec, forward error, gradient error, record). The
    gradient error is from its fwdbwd rows, else its bwd rows (the same checked backward);
    the forward error is that of the matching fwd rows, else the training rows' own (the
    error of the training forward's output, the same inputs)."""
    out = []
    for spec in ctx.styles.order:
        s = sub[(sub["spec"] == spec) & (sub[GRAD_ERROR] > 0)]
        for p in (FWDBWD, BWD):
            rows = s[s["pass"] == p]
            if not rows.empty:
                break
        if rows.empty:
            continue
        matched = rows[FWD_ERROR] > 0
        fwd = rows[FWD_ERROR] if matched.any() else rows["rel_fro_error"]
        fwd = fwd[fwd > 0]
        if fwd.empty:
            continue
        e_f, e_g = float(fwd.median()), float(rows[GRAD_ERROR].median())
        worst = rows.loc[rows[GRAD_ERROR].idxmax(), WORST]
        out.append((spec, e_f, e_g, {
            "spec": spec, "fwd_error": e_f, "grad_error": e_g, "pass": p, "worst": worst,
            "fwd_error_from": "fwd row" if matched.any() else "training row",
            "grad": {GRAD_NAMES[c]: jsonable([rows[c].median()])[0]
                     for c in GRAD_ERROR_COLUMNS}}))
    return out


def gradient_figure(ctx, n, how):
    name = "grad_vs_fwd_error"
    title = f"Gradient error against forward error at n = {fmt_n(n)} ({ctx.title_suffix()})"
    fig, cells = ctx.panels_at(n, title)
    panels, records, tables = [], [], []
    for ax, sub, panel_title in cells:
        pts = gradient_points(ctx, sub)
        for spec, x, y, _ in pts:
            ax.plot([x], [y], linestyle="none", markersize=6.5, label=ctx.styles.label(spec),
                    **ctx.styles(spec, line=False))
        values = [v for _, x, y, _ in pts for v in (x, y)] + [ZERO_ERROR]
        lo, hi = min(values) / 3.0, max(values) * 3.0
        ax.plot([lo, hi], [lo, hi], zorder=1, **DIAGONAL_STYLE)
        ax.axvline(ZERO_ERROR, zorder=1.5, **ZERO_STYLE)
        ax.axhline(ZERO_ERROR, zorder=1.5, **ZERO_STYLE)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(ERROR_LABEL)
        ax.set_ylabel(GRAD_LABEL)
        ax.set_title(panel_title)
        if not pts:
            ax.text(0.5, 0.5, f"no training row with an error at n = {fmt_n(n)}",
                    ha="center", va="center", transform=ax.transAxes, color="0.4")
        on_x = blended_transform_factory(ax.transData, ax.transAxes)
        on_y = blended_transform_factory(ax.transAxes, ax.transData)
        marks = [ax.text(ZERO_ERROR, 0.99, "zero output ", rotation=90, fontsize=7,
                         color=REFERENCE_COLOR, ha="left", va="top", transform=on_x),
                 ax.text(0.01, ZERO_ERROR, "zero gradient", fontsize=7, color=REFERENCE_COLOR,
                         ha="left", va="bottom", transform=on_y)]
        panels.append((ax, [(s, x, y) for s, x, y, _ in pts], marks))
        records.append({"title": panel_title, "diagonal": [lo, hi],
                        "points": [rec for _, _, _, rec in pts]})
        tables.append((panel_title, [
            [code(s), fmt_sci(x)] + [fmt_sci(rec["grad"][g] if rec["grad"][g] is not None
                                             else math.nan) for g in GRAD_NAMES.values()] +
            [f"{fmt_sci(y)} ({rec['worst']})", times(y / x)] for s, x, y, rec in pts]))
    in_legend = label_points(ctx, fig, panels, records)
    handles = [ctx.styles.handle(s, line=False) for s in ctx.styles.order if s in in_legend]
    handles.append(Line2D([], [], label="y = x: the gradient as good as the output",
                          **DIAGONAL_STYLE))
    handles.append(Line2D([], [], label="zero output / zero gradient (error 1)", **ZERO_STYLE))
    ctx.record(name, n=int(n), panels=records, legend=[h.get_label() for h in handles])
    finish(fig, ctx.fig_path(name), handles, title)
    ctx.md.append(f"## Training: gradient error against forward error at n = {fmt_n(n)}\n")
    ctx.embed(name, "gradient error against forward error")
    ctx.md.append(
        f"n = {n} ({how}). Does a variant that approximates the output well also approximate "
        f"the gradient? x: the relative Frobenius error of the forward's output (the matching "
        f"`fwd` row's `rel_fro_error`); y: the gradient error, the largest of the relative "
        f"Frobenius errors of dQ, dK and dV against exact attention's gradients in float64 on "
        f"the same inputs and dO (`grad_rel_err_q/k/v`; the largest because a training step "
        f"uses all three; the table names which). On the dashed diagonal the gradient is as "
        f"good as the output; above it, worse. A variant that ignores an input by design "
        f"(e.g. k for shared-QK attention) has that gradient 0, error 1.\n")
    for title_, rows in tables:
        ctx.md.append(f"\n{title_}:\n\n")
        ctx.md.append(md_table(["variant", "forward error", "dQ", "dK", "dV",
                                "gradient error (largest)", "gradient / forward"], rows))
    ctx.md.append("\n")


# --- the training table -------------------------------------------------------------------
def pass_cell(rows, status_rows):
    """The median time of a pass's ok rows with spread and †, else the status of its rows
    that were not measured, else "—". Returns (text, median, noisy)."""
    if not rows.empty:
        bad = bool(noisy(rows).any())
        t = float(rows["time_median_s"].median())
        return time_cell(t, float(time_spread(rows).max()), bad), t, bad
    if not status_rows.empty:
        return ", ".join(dict.fromkeys(status_rows["status"])), math.nan, False
    return "—", math.nan, False


def table(ctx, train):
    lay = ctx.layout
    ctx.md.append("## Training table\n")
    fwdbwd = train[train["pass"] == FWDBWD]
    with ctx.drawing(fwdbwd):
        flash = baseline(ctx, "flash", "training table") if not fwdbwd.empty else None
    every = ctx.of_scale(ctx.df[ctx.df["input"] == ctx.input])
    ctx.md.append(
        "Per variant at the largest n with training rows: the median time of the forward "
        "(`fwd`), of the backward alone from a saved forward (`bwd`) and of both (`fwdbwd`); "
        "bwd / fwd; the saved state (`saved_bytes`, what the training forward keeps for the "
        "backward); the gradient error (the largest of the relative errors of dQ, dK and dV, "
        "which one in brackets); and where its fwdbwd time drops below " +
        (f"`{flash}`'s" if flash else "flash's") + " fwdbwd time over the measured lengths "
        "(as in the crossover table: interpolated in log-log where it crosses, lengths with a "
        "noisy row not judged). A pass that was not measured shows its status (its rows are "
        "listed under \"Rows not plotted\").\n")
    marked = False
    for cfg in lay.configs:
        for causal in lay.causals:
            sub = lay.select(train, cfg, causal)
            if sub.empty:
                continue
            n = int(sub["n"].max())
            at = lay.select(every, cfg, causal)
            at = at[at["n"] == n]
            fwd = lay.select(ctx.timed, cfg, causal)
            fwd = fwd[fwd["n"] == n]
            panel_fb = lay.select(fwdbwd, cfg, causal)
            specs = [s for s in ctx.styles.order
                     if ((at["spec"] == s) & at["pass"].isin(TRAIN_PASSES)).any()]
            rows = []
            for spec in specs:
                mine = at[at["spec"] == spec]
                cells, t = [], {}
                for p, ok_rows in ((FORWARD, fwd), (BWD, sub), (FWDBWD, sub)):
                    ok = ok_rows[(ok_rows["spec"] == spec) & (ok_rows["n"] == n) &
                                 (ok_rows["pass"] == p)]
                    other = mine[(mine["pass"] == p) & (mine["status"] != "ok")]
                    text, t[p], bad = pass_cell(ok, other)
                    cells.append(text)
                    marked = marked or bad
                trained = sub[(sub["spec"] == spec) & (sub["n"] == n)]
                trained = trained.sort_values("pass", key=lambda c: c != FWDBWD)
                saved = trained["saved_bytes"].dropna()
                grads = trained[trained[GRAD_ERROR].notna()]
                grad = (f"{fmt_sci(grads[GRAD_ERROR].iloc[0])} ({grads[WORST].iloc[0]})"
                        if not grads.empty else "—")
                if flash is None:
                    cross = "— (no flash fwdbwd rows)"
                elif spec == flash:
                    cross = "— (the baseline)"
                elif not (panel_fb["spec"] == spec).any():
                    cross = "— (no fwdbwd row)"
                else:
                    cross = Crossing(*ratio_series(panel_fb, spec, flash)).text()
                    marked = marked or "†" in cross
                rows.append([code(spec)] + cells +
                            [times(t[BWD] / t[FORWARD]),
                             fmt_bytes(saved.iloc[0]) if not saved.empty else "—", grad, cross])
            ctx.md.append(f"\n{ctx.panel_title(cfg, causal)}, n = {fmt_n(n)}:\n\n")
            ctx.md.append(md_table(["variant", "fwd", "bwd", "fwdbwd", "bwd / fwd",
                                    "saved", "gradient error",
                                    "fwdbwd faster than " +
                                    (ctx.styles.label(flash) if flash else "flash")], rows))
    if marked:
        ctx.md.append("\n" + NOISY_FOOTNOTE + "\n")
    ctx.md.append("\n")
