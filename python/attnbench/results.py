"""Results directories (`attnbench sweep --out DIR`) as pandas DataFrames.

    import attnbench.results
    df = attnbench.results.load("results/reference")
    df.attrs["meta"]["machine"]["gemm_gflops"]
    df[(df["pass"] == "fwd") & (df["status"] == "ok")].pivot_table(
        index="n", columns="spec", values="time_median_s")

The loader is the one scripts/plot.py and scripts/compare.py use (scripts/attnbench_results.py,
shipped in the package as _results): the file is checked, the key and timing columns are
typed (integers, floats, `causal` 0/1, masks as text), and columns later versions added are
filled in for files written before them. A directory that cannot be read raises
ResultsError (a ValueError) with a message saying what was found and what was expected.
"""

from . import _results


class ResultsError(ValueError):
    """A results directory that cannot be read; the message says why."""


def load(directory, need_ok=False):
    """results.csv of `directory` as a DataFrame, with meta.json (the machine, commit and
    command of the run) in df.attrs["meta"]. need_ok=True also refuses a file without any row
    of status ok."""
    try:
        df = _results.load_results(directory, need_ok=need_ok)
        df.attrs["meta"] = _results.load_meta(directory)
    except _results.ResultsError as e:
        raise ResultsError(str(e)) from None
    return df
