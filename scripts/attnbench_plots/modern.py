"""Long-context variants: the block-sparse softmax ones (local with attention sinks, moba, nsa)
and the linear ones with decay or a delta rule (retention, gla, deltanet), on the causal forward
rows of the timed input.

Per configuration and length n (the two largest of the run, at least 4096): each such spec's
time, its speed-up over causal `flash` on the same problem, and for a chunkwise linear form its
speed-up over its own step-by-step recurrence (the spec with form=recurrent and otherwise the
same parameters, when the run holds it). When results.csv holds causal forward rows of the sparse
ones (and of plain `local`, for the sinks' effect) on the trained model's inputs (`--input
trained:layer=L`), a second table gives, at the largest such n, per layer the mass they keep
(`mass_mean`) and their error against exact attention. No figure of its own: these variants are
drawn in every figure of the forward with the others.
"""

import math

import pandas as pd

from attnbench_results import FORWARD, format_seconds

from .anatomy import TRAINED_INPUT, fmt
from .style import NOISY_FOOTNOTE, _split_spec, code, fmt_sci, md_table, times, variant_info

SECTION = "Long-context variants: sinks, MoBA, NSA, retention, GLA, DeltaNet"
FORM = "form"
RECURRENT = "recurrent"
MIN_N = 4096  # the table's lengths: the two largest of the run from here up


def long_context(name):
    """The variant's registration says it is a long-context design (`attnbench list --json`,
    "long_context")."""
    return bool(variant_info(name).get("long_context"))


def is_linear(name):
    """A long-context variant that is linear attention with a decay or a delta rule (family
    "decay"): it has a chunkwise and a recurrent form."""
    return long_context(name) and variant_info(name).get("family") == "decay"


def is_sparse(name):
    """A long-context variant with softmax inside the keys it picks (moba, nsa)."""
    return long_context(name) and not is_linear(name)


def is_modern(spec):
    """Whether spec is one of this section's variants: a long-context one (moba, nsa, the linear
    ones), or local with sinks > 0."""
    name, params = _split_spec(spec)
    if name == "local":
        return any(k == "sinks" and v not in ("", "0") for k, v in params)
    return long_context(name)


def recurrent_twin(spec, specs):
    """The spec of `specs` that runs the same linear variant with the same parameters but
    form=recurrent; None for a spec that is itself recurrent or has no such twin."""
    name, params = _split_spec(spec)
    if not is_linear(name) or (FORM, RECURRENT) in params:
        return None
    want = {k: v for k, v in params if k != FORM}
    for other in specs:
        o_name, o_params = _split_spec(other)
        if o_name == name and (FORM, RECURRENT) in o_params and \
                {k: v for k, v in o_params if k != FORM} == want:
            return other
    return None


def is_sparse_or_local(spec):
    """Whether spec is one of the section's block-sparse softmax variants (moba, nsa, local
    with sinks) or plain local, the baseline of the sinks."""
    name = _split_spec(spec)[0]
    return is_sparse(name) or name == "local"


def trained_masses(df, label):
    """(table rows, layers, n) of the sparse variants' ok causal forward rows on the trained
    inputs at the largest n they share, or None: per spec (its label) and layer, mass_mean
    (mean over the rows) and rel_fro_error, as 'mass (error)'."""
    if "mass_mean" not in df.columns:
        return None
    rows = df[(df["status"] == "ok") & (df["pass"] == FORWARD) & (df["causal"] == 1)]
    rows = rows[[is_sparse_or_local(s) for s in rows["spec"]]]
    layer = rows["input"].astype(str).str.extract(TRAINED_INPUT)[0]
    rows = rows.assign(layer=pd.to_numeric(layer, errors="coerce"),
                       mass=pd.to_numeric(rows["mass_mean"], errors="coerce"),
                       err=pd.to_numeric(rows["rel_fro_error"], errors="coerce"))
    rows = rows[rows["layer"].notna()]
    if rows.empty or not any(is_modern(s) for s in rows["spec"]):
        return None
    n = max(rows["n"].unique())
    rows = rows[rows["n"] == n]
    layers = sorted(rows["layer"].astype(int).unique())
    mass = rows.groupby(["spec", "layer"])["mass"].mean()
    err = rows.groupby(["spec", "layer"])["err"].median()
    out = []
    for spec in dict.fromkeys(rows["spec"]):
        out.append([code(label(spec))] + [
            f"{fmt(mass.get((spec, float(l)), math.nan), 3)} "
            f"({fmt_sci(err.get((spec, float(l)), math.nan))})" for l in layers])
    return out, layers, int(n)


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
        "from it, and their tests hold them to their own float64 recurrence.\n")
    trained = trained_masses(ctx.df, ctx.styles.label)
    if trained is not None:
        rows, layers, n = trained
        ctx.md.append(
            f"\nOn the trained model's inputs (causal, n = {n}, every layer): the share of the "
            f"exact attention inside the keys each sparse variant attends (`mass_mean`, mean "
            f"over rows and heads; nsa's counts its selection and window keys, not the pooled "
            f"branch) and, in brackets, the relative error of its output against exact "
            f"attention. Plain `local` is the baseline of the sinks. nsa's error does not follow its "
            f"mass: its output is the sum of three branches weighted by independent gates in "
            f"(0, 1) (seeded stand-ins for the learned ones), not one softmax over its keys.\n\n")
        ctx.md.append(md_table(["variant"] + [f"layer {l}" for l in layers], rows))
