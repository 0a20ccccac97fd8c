"""Generation: the decode rows (`attnbench sweep --causal on --pass decode`), one step of
autoregressive generation at context n.

  decode_latency_vs_n  time of one decode step (time_per_token_s) against the context n
  decode_state_vs_n    the state a variant keeps per sequence (state_bytes) against n

and the decode table: per variant at the largest context, the time per token, tokens per
second, state per sequence, bytes read per step, the share of the memory bandwidth, the
prefill time and the smallest measured context from which its time per token stays below
flash's.

What the columns measure (harness/runner.cpp, decode_row): each repetition prefills n tokens
(timed apart, `prefill_s` the median), then times a few steps at contexts n, n + 1, ...;
`time_per_token_s` is the median time of one step, the row's `time_median_s`, whose
`time_min_s` and `time_max_s` are the fastest and slowest repetition's step. `state_bytes` is
the state per sequence after the prefill (the KV cache, a window's ring, the recurrent
matrices), `bytes_read_per_step` what one step reads of it for the whole batch, and
`bandwidth_fraction` those bytes per step's time over the machine's triad bandwidth.

Decoding is causal self-attention: only causal decode rows are drawn (the sweep refuses the
others as unsupported, and they are listed with the rows not plotted).
"""

import math

from attnbench_results import DECODE, format_seconds, noisy, time_spread

from .crossover import Crossing, baseline, ratio_series
from .style import NOISY_FOOTNOTE, code, fmt_bytes, fmt_n, md_table, warn
from .time_memory import against_n, time_cell, time_table

FIGURES = ["decode_latency_vs_n", "decode_state_vs_n"]
KIB = 1024.0
SECTION = "Generation: decode step against context"
CONTEXT_LABEL = "context n (tokens before the step)"


def per_token(rows):
    """The decode rows with their time columns read from time_per_token_s: time_median_s is
    the time per token and the repetitions' bars (time_min_s, time_max_s) keep their ratio to
    it, so that the time figure, the time tables and the crossover draw one step's time."""
    t = rows["time_per_token_s"]
    ratio = t / rows["time_median_s"].where(rows["time_median_s"] > 0)
    return rows.assign(time_median_s=t, time_min_s=rows["time_min_s"] * ratio,
                       time_max_s=rows["time_max_s"] * ratio)


def without_step(ctx):
    """The specs with causal decode rows of the timed input but none of them ok, each with the
    statuses of its rows, in the order of the specs."""
    rows = ctx.df[(ctx.df["pass"] == DECODE) & (ctx.df["causal"] == 1) &
                  (ctx.df["input"] == ctx.input)]
    out = []
    for spec in ctx.styles.order:
        mine = rows[rows["spec"] == spec]
        if not mine.empty and not (mine["status"] == "ok").any():
            out.append((spec, ", ".join(dict.fromkeys(mine["status"]))))
    return out


def section(ctx):
    ctx.md.append(f"## {SECTION}\n")
    if ctx.decode_timed.empty:
        text = ("no ok causal decode rows (`attnbench sweep --causal on --pass decode`)" +
                (f" with input `{ctx.input}`" if not ctx.decode.empty else "") +
                " in these results, so there are no decode figures or table")
        ctx.md.append(text[0].upper() + text[1:] + ".\n")
        warn(f"decode: {text}".replace("`", ""))
        return
    rows = per_token(ctx.decode_timed)
    ctx.md.append(
        "One step of autoregressive generation (`--pass decode`): the variant's state is built "
        "from a context of n tokens (the prefill), then each step appends one key and value "
        "per (batch, head) and attends one query at the next position. Here n is the context "
        "and every row is causal self-attention.\n")
    missing = without_step(ctx)
    if missing:
        ctx.md.append("Without a measured decode step (their rows are listed under \"Rows not "
                      "plotted\"): " + ", ".join(f"{code(s)} ({status})"
                                                  for s, status in missing) + ".\n")
    with ctx.drawing(rows):
        latency_figure(ctx)
        state_figure(ctx)
        table(ctx, rows)


# --- time per token and state against the context ------------------------------------------
def latency_figure(ctx):
    against_n(ctx, "decode_latency_vs_n", "time_median_s", 1.0, "time per token (s)",
              "Time of one decode step against the context",
              "Time per token against context",
              "Median wall-clock time of one decode step (`time_per_token_s`) at context n, "
              "log-log: bars from the fastest to the slowest repetition's step, hollow markers "
              "for noisy rows. The wide pale line is an O(n) guide through the smallest "
              "context: a step that reads a cache of every position grows along it, one whose "
              "state has a fixed size stays flat. In the tables, the factor after a time is "
              "its repetitions' spread and † marks a noisy row.",
              time_table, level=3, orders=("n",),
              xlabel=CONTEXT_LABEL)


def state_figure(ctx):
    against_n(ctx, "decode_state_vs_n", "state_bytes", KIB, "state per sequence (KiB)",
              "Decode state per sequence against the context",
              "State per sequence against context",
              "What the variant keeps per sequence (batch element) after the prefill of n "
              "tokens (`state_bytes`, in KiB), log-log: a KV cache grows with the context "
              "(the O(n) guide through the smallest context), a window's ring stops growing "
              "at the window, a recurrent state has one size at every context. Variants with "
              "the same state at every context are drawn side by side, a little apart along n, "
              "and named under the legend.",
              lambda ctx, sub: (ctx.table_by_n(sub, "state_bytes", fmt_bytes), False),
              level=3, orders=("n",),
              xlabel=CONTEXT_LABEL)


# --- the decode table ---------------------------------------------------------------------
def number(x, fmt):
    return fmt(x) if x is not None and math.isfinite(x) else "—"


def table(ctx, rows):
    """Per panel, a row per variant with ok decode rows at the panel's largest context."""
    lay = ctx.layout
    flash = baseline(ctx, "flash", "decode table")
    ctx.md.append("### Decode table at the largest context\n")
    ctx.md.append(
        "Per variant at the largest context with decode rows: the time of one step (with its "
        "repetitions' spread); the tokens the batch generates per second at that rate "
        "(`tokens_per_s`, B per step); the state per sequence after the prefill "
        "(`state_bytes`); the bytes of state one step reads for the whole batch "
        "(`bytes_read_per_step`); those bytes per step's time over the machine's memory "
        "bandwidth (`bandwidth_fraction`, the triad of meta.json; above 1 the state was "
        "served from the caches); the prefill of the n tokens (`prefill_s`); and the "
        "smallest measured context from which its time per token stays below " +
        (f"{code(flash)}'s" if flash else "flash's") + " "
        "decode time per token (\"faster at every n\" or \"never in range\" over the "
        "measured contexts; as in the crossover table, contexts with a noisy row are not "
        "judged). A variant without an ok row at that context shows the status of its row "
        "there.\n")
    every = ctx.of_scale(ctx.df[(ctx.df["pass"] == DECODE) & (ctx.df["input"] == ctx.input)])
    marked = False
    for cfg in lay.configs:
        for causal in lay.causals:
            sub = lay.select(rows, cfg, causal)
            if sub.empty:
                continue
            n = int(sub["n"].max())
            at = lay.select(every, cfg, causal)
            at = at[at["n"] == n]
            out = []
            for spec in [s for s in ctx.styles.order if (sub["spec"] == s).any()]:
                ok = sub[(sub["spec"] == spec) & (sub["n"] == n)]
                if ok.empty:
                    statuses = at[at["spec"] == spec]["status"]
                    out.append([code(spec), ", ".join(dict.fromkeys(statuses)) or "—"] +
                               ["—"] * 6)
                    continue
                bad = bool(noisy(ok).any())
                marked = marked or bad
                t = float(ok["time_median_s"].median())
                cell = {c: float(ok[c].median()) for c in
                        ["tokens_per_s", "state_bytes", "bytes_read_per_step",
                         "bandwidth_fraction", "prefill_s"]}
                if flash is None:
                    cross = "— (no flash decode rows)"
                elif spec == flash:
                    cross = "— (the baseline)"
                else:
                    cross = Crossing(*ratio_series(sub, spec, flash)).text(measured=True)
                    marked = marked or "†" in cross
                out.append([code(spec), time_cell(t, float(time_spread(ok).max()), bad),
                            number(cell["tokens_per_s"], lambda x: f"{x:,.0f}"),
                            fmt_bytes(cell["state_bytes"]),
                            fmt_bytes(cell["bytes_read_per_step"]),
                            number(cell["bandwidth_fraction"], lambda x: f"{x:.3g}"),
                            format_seconds(cell["prefill_s"]), cross])
            ctx.md.append(f"\n{ctx.panel_title(cfg, causal)}, context n = {fmt_n(n)}:\n\n")
            ctx.md.append(md_table(["variant", "time per token", "tokens/s",
                                    "state per sequence", "read per step",
                                    "of memory bandwidth", "prefill",
                                    "per token faster than " +
                                    (ctx.styles.label(flash) if flash else "flash") +
                                    " from context"], out))
    if marked:
        ctx.md.append("\n" + NOISY_FOOTNOTE + "\n")
    ctx.md.append("\n")
