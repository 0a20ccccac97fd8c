"""The precision section: the bf16 rows (`sweep --dtype f32,bf16`) beside the float32 rows of
the same variant and problem, time and error."""

from attnbench_results import F32, KEY_COLUMNS, format_seconds

from .style import causal_name, code, md_table

# The columns that pair a bf16 row with its float32 row: its key but the precision.
PAIR = [c for c in KEY_COLUMNS if c != "dtype"]


def fmt_error(v):
    return "" if v != v else f"{v:.2e}"


def section(ctx):
    if ctx.bf16.empty:
        return
    ctx.md.append("## Precision: bf16 against float32\n")
    f32 = ctx.df[(ctx.df["status"] == "ok") & (ctx.df["dtype"] == F32)]
    joined = ctx.bf16.merge(f32, on=PAIR, how="left", suffixes=("", "_f32"))
    joined = joined.sort_values(["spec", "input", "causal", "n"], kind="stable")
    rows = []
    for _, r in joined.iterrows():
        t32 = r.get("time_median_s_f32")
        speed = "" if t32 != t32 else f"{t32 / r['time_median_s']:.2f}×"
        rows.append([code(r["spec"]), r["input"], causal_name(r["causal"]), int(r["n"]),
                     "" if t32 != t32 else format_seconds(t32), format_seconds(r["time_median_s"]),
                     speed, fmt_error(r.get("rel_fro_error_f32", float("nan"))),
                     fmt_error(r["rel_fro_error"]), fmt_error(r["rounded_input_error"])])
    ctx.md.append(
        "Each bf16 row beside the float32 row of the same variant and problem. The errors are "
        "against the float64 reference on the unrounded inputs; `rounding alone` is the "
        "float32 path's error on the same bf16-rounded inputs (`rounded_input_error`), so the "
        "rest of the bf16 error is the bf16 arithmetic's. A row's `notes` say which bf16 path "
        "ran.\n")
    ctx.md.append(md_table(["variant", "input", "causal", "n", "time f32", "time bf16",
                            "f32 / bf16", "error f32", "error bf16", "rounding alone"], rows))
