"""Long-context variants: the block-sparse softmax ones (local with attention sinks, moba, nsa)
and the linear ones with decay or a delta rule (retention, gla, deltanet), on the causal forward
rows of the timed input.

Per configuration and length n (the two largest of the run, at least 4096): each such spec's
time, its speed-up over causal `flash` on the same problem, and for a chunkwise linear form its
speed-up over its own step-by-step recurrence (the spec with form=recurrent and otherwise the
same parameters, when the run holds it). No figure of its own: these variants are drawn in every
figure of the forward with the others.
"""

import math

from attnbench_results import format_seconds

from .style import NOISY_FOOTNOTE, _split_spec, code, md_table, times

SECTION = "Long-context variants: sinks, MoBA, NSA, retention, GLA, DeltaNet"
SPARSE = ("moba", "nsa")
LINEAR = ("retention", "gla", "deltanet")
FORM = "form"
RECURRENT = "recurrent"
MIN_N = 4096  # the table's lengths: the two largest of the run from here up


def is_modern(spec):
    """Whether spec is one of this section's variants: moba, nsa, the linear ones, or local
    with sinks > 0."""
    name, params = _split_spec(spec)
    if name == "local":
        return any(k == "sinks" and v not in ("", "0") for k, v in params)
    return name in SPARSE + LINEAR


def recurrent_twin(spec, specs):
    """The spec of `specs` that runs the same linear variant with the same parameters but
    form=recurrent; None for a spec that is itself recurrent or has no such twin."""
    name, params = _split_spec(spec)
    if name not in LINEAR or (FORM, RECURRENT) in params:
        return None
    want = {k: v for k, v in params if k != FORM}
    for other in specs:
        o_name, o_params = _split_spec(other)
        if o_name == name and (FORM, RECURRENT) in o_params and \
                {k: v for k, v in o_params if k != FORM} == want:
            return other
    return None


def _median(rows, spec, n):
    s = rows[(rows["spec"] == spec) & (rows["n"] == n)]
    return (float(s["time_median_s"].median()), bool(s["noisy"].any())) if len(s) else \
        (math.nan, False)


def section(ctx):
    ctx.md.append(f"## {SECTION}\n")
    causal = ctx.timed[ctx.timed["causal"] == 1]
    specs = [s for s in ctx.styles.order if is_modern(s)]
    present = [s for s in specs if (causal["spec"] == s).any()]
    if not present:
        ctx.md.append("No causal forward rows of these variants in these results.\n")
        return
    flash = [s for s in ctx.styles.order
             if _split_spec(s)[0] == "flash" and not ctx.styles.changed(s)]
    lay = ctx.layout
    any_noisy = False
    for cfg in lay.configs:
        rows = lay.select(causal, cfg)
        mine = rows[rows["spec"].isin(present)]
        ns = sorted(n for n in mine["n"].unique() if n >= MIN_N)[-2:]
        if not ns:
            continue
        table = []
        for spec in present:
            twin = recurrent_twin(spec, ctx.styles.order)
            for n in ns:
                t, bad = _median(rows, spec, n)
                if math.isnan(t):
                    continue
                any_noisy |= bad
                t_flash = _median(rows, flash[0], n)[0] if flash else math.nan
                t_rec = _median(rows, twin, n)[0] if twin else math.nan
                table.append([code(ctx.styles.label(spec)), int(n),
                              format_seconds(t) + (" †" if bad else ""),
                              times(t_flash / t), times(t_rec / t) if twin else ""])
        if table:
            ctx.md.append(f"Causal, {lay.config_label(cfg)}, input `{ctx.input}`:\n\n")
            ctx.md.append(md_table(["variant", "n", "time", "speed-up over causal flash",
                                    "speed-up over its recurrence"], table))
            ctx.md.append("\n")
    if any_noisy:
        ctx.md.append(NOISY_FOOTNOTE + "\n")
    ctx.md.append(
        "moba and nsa attend a data-dependent subset of the keys with exact softmax (nsa adds "
        "a branch over mean-pooled key blocks and gates); retention, gla and deltanet are not "
        "softmax attention, so their error columns elsewhere measure how far their function is "
        "from it, and their tests hold them to their own float64 recurrence. The mass each "
        "sparse one keeps on a trained model's attention is in the anatomy section's table "
        "of every pattern variant.\n")
