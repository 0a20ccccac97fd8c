"""The report: DIR/report.md with its run header, one section per figure family (each
drawing its figures into DIR/plots/) and the rows that could not be drawn."""

import os
import re

from attnbench_results import (DECODE, FORWARD, TRAIN_PASSES, atomic_write_json,
                               atomic_write_text, noisy, problem_label)

from . import (anatomy, budget, crossover, decode, error, layer, modern, patterns, precision,
               quality, style, time_memory, trained_model, training)
from .context import Context
from .style import code, md_table, unit

FIGURES = ["time_vs_n", "memory_vs_n", "error_vs_n", "speed_vs_error", "crossover", "layer",
           "patterns"] + (quality.FIGURES + budget.FIGURES + training.FIGURES +
                          decode.FIGURES + trained_model.FIGURES + anatomy.FIGURES)
PASSES = [FORWARD] + TRAIN_PASSES + [DECODE]
# The sections of the forward rows (pass fwd), drawn when there are any.
FORWARD_SECTIONS = [time_memory.time_vs_n, time_memory.memory_vs_n, error.error_vs_n,
                    error.speed_vs_error, budget.section, crossover.crossover_section,
                    time_memory.efficiency, layer.section, patterns.section, modern.section]
# The report's sections after its header, in order; each draws its own figures. Quality (what a
# variant costs a trained model, DIR/quality/) comes first, before the speed of the sweep.
SECTIONS = [quality.section] + FORWARD_SECTIONS + [
    precision.section, training.section, decode.section, trained_model.section, anatomy.section]


def header(ctx):
    meta = ctx.meta
    ctx.md.append(f"# attnbench report: {os.path.basename(os.path.abspath(ctx.dir))}\n")
    ctx.md.append("## Run\n")
    if meta is None:
        ctx.note(f"warning: {os.path.join(ctx.dir, 'meta.json')} does not exist; the "
                 f"report cannot name the machine or the commit")
        ctx.md.append("meta.json is missing: machine and commit unknown.\n")
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
            ("GEMM rate", unit(m.get("gemm_gflops"), "GFLOP/s")),
            ("memory bandwidth (triad)", unit(m.get("bandwidth_gbs"), "GB/s")),
            ("compiler, build", f"{meta.get('compiler', 'unknown')}, "
                                f"{meta.get('build_type', 'unknown')}"),
            ("attnbench", meta.get("attnbench_version", "unknown")),
        ]
        ctx.md.append(md_table(["", ""], rows))
    counts = ctx.df["status"].value_counts()
    n_noisy = int(noisy(ctx.all_ok).sum())
    passes = ctx.df["pass"].value_counts()
    ctx.md.append("\nRows: " + ", ".join(f"{v} {k}" for k, v in counts.items()) +
                  (" (" + ", ".join(f"{passes.get(p, 0)} of pass {p}" for p in PASSES) + ")"
                   if len(passes) > 1 or FORWARD not in passes else "") +
                  (f" ({n_noisy} of the ok rows noisy, marked † in the tables)" if n_noisy
                   else "") +
                  f". Variants: {len(ctx.styles.order)}. Every figure and table but the "
                  f"training and generation ones draws the forward rows (pass `fwd`); the "
                  f"generation ones draw the causal decode rows. Time, memory, crossover "
                  f"and the efficiency table use input `{ctx.input}`"
                  + (f" ({ctx.layout.fixed_label()})" if ctx.layout.fixed_label() else "")
                  + ".\n")
    stand_ins(ctx)


def stand_ins(ctx):
    """Which variants ran seeded stand-ins for their learned inputs (the stand_ins column):
    their error and time are those of the stand-in, not of the trained mechanism."""
    if "stand_ins" not in ctx.df.columns:
        return
    ok = ctx.df[(ctx.df["status"] == "ok") & ctx.df["stand_ins"].fillna("").astype(str).ne("")]
    if ok.empty:
        return
    by_spec = ok.groupby("spec")["stand_ins"].agg(lambda s: sorted(set(map(str, s))))
    parts = [f"{code(ctx.styles.label(spec))} "
             f"({', '.join('`' + x.replace('+', '`, `') + '`' for x in names)})"
             for spec, names in by_spec.items()]
    ctx.md.append("\nStand-ins: these rows computed seeded stand-ins for learned inputs the "
                  "variant takes (gates, decays, projections; `attnbench list` names them), "
                  "so their error and speed are those of the stand-in, not of a trained "
                  "mechanism: " + "; ".join(parts) + ". `--inputs` gives them.\n")


def not_ok(ctx):
    ctx.md.append("## Rows not plotted\n")
    bad = ctx.df[ctx.df["status"] != "ok"]
    if bad.empty:
        ctx.md.append("Every row has status ok.\n")
    else:
        cols = ["n", "m", "causal", "dim", "heads", "batch", "input", "pass"]
        rows = [[code(r["spec"]), problem_label(r, cols), r["status"], r["message"]]
                for _, r in bad.iterrows()]
        ctx.md.append(f"{len(bad)} row(s) without a measurement:\n\n")
        ctx.md.append(md_table(["variant", "problem", "status", "message"], rows))
    if ctx.problems:
        ctx.md.append("\n### Notes from plot.py\n\n" +
                      "".join(f"- {p}\n" for p in ctx.problems))


def write(args, df, meta):
    """Draws every figure of the results in args.dir and writes its report; returns the
    report's path. Every file is written whole or not at all (attnbench_results.atomic_write),
    and the figures of an earlier run this one does not draw are removed last, once the report
    is written: a run that fails (a full disk) leaves the earlier report and figures. The
    caller holds the directory's lock (attnbench_results.results_lock)."""
    ctx = Context(args, df, meta)
    os.makedirs(ctx.plots, exist_ok=True)
    style.SAVED.clear()
    header(ctx)
    if ctx.ok.empty:
        ctx.note("no ok row of pass fwd: the forward's figures and tables are not drawn")
    for draw in SECTIONS:
        if draw in FORWARD_SECTIONS and ctx.ok.empty:
            continue
        draw(ctx)
    # the Quality section names the budget frontier only once the sections have drawn it
    quality.frontier(ctx, FIGURES)
    not_ok(ctx)
    report = os.path.join(ctx.dir, "report.md")
    atomic_write_text(report, re.sub(r"\n{3,}", "\n\n", "\n".join(ctx.md)))
    if getattr(args, "debug_json", None):
        atomic_write_json(args.debug_json, ctx.debug, indent=1, ensure_ascii=False)
    style.remove_unsaved([ctx.fig_path(name) for name in FIGURES])
    return report
