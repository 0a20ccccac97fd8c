"""attnbench.results.load: results directories as typed DataFrames with their meta.json."""
import os

import pandas as pd
import pytest

import attnbench.results

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "..", "results", "reference")
# Columns an older results.csv lacks, dropped from the reference to make one.
NEWER_INPUT_COLUMNS = ("input_source", "input_layer")


def test_loads_the_reference_with_typed_columns_and_meta():
    df = attnbench.results.load(REFERENCE)
    assert len(df) > 100
    for c in ("batch", "heads", "kv_heads", "n", "m", "dim", "causal", "seed", "threads"):
        assert pd.api.types.is_integer_dtype(df[c]), c
    for c in ("time_median_s", "peak_bytes", "rel_fro_error", "time_per_token_s"):
        assert pd.api.types.is_float_dtype(df[c]), c
    assert set(df["pass"]) >= {"fwd", "bwd", "fwdbwd", "decode"}
    assert (df.loc[df["status"] == "ok", "time_median_s"] > 0).all()
    meta = df.attrs["meta"]
    assert meta["machine"]["gemm_gflops"] > 0 and meta["git_commit"]


def test_an_older_file_gains_the_added_columns(tmp_path):
    df = pd.read_csv(os.path.join(REFERENCE, "results.csv"))
    old = df[df["pass"] == "fwd"].drop(columns=["kv_heads", "pass", "embed"])
    old = old[~old["input"].astype(str).str.startswith("trained")]
    old = old.drop(columns=[c for c in NEWER_INPUT_COLUMNS if c in old.columns])
    old.to_csv(tmp_path / "results.csv", index=False)
    got = attnbench.results.load(str(tmp_path))
    assert (got["kv_heads"] == got["heads"]).all()
    assert (got["pass"] == "fwd").all() and (got["embed"] == 0).all()
    # written before input_source and input_layer: generated inputs, no layer
    assert (got["input_source"] == "generated").all() and got["input_layer"].isna().all()
    assert got.attrs["meta"] is None  # no meta.json


def test_an_older_file_of_an_inputs_file_is_of_source_file(tmp_path):
    df = pd.read_csv(os.path.join(REFERENCE, "results.csv")).head(3)
    df = df.drop(columns=[c for c in NEWER_INPUT_COLUMNS if c in df.columns])
    df["input"] = ["file", "gaussian", "file"]
    df.to_csv(tmp_path / "results.csv", index=False)
    got = attnbench.results.load(str(tmp_path))
    assert list(got["input_source"]) == ["file", "generated", "file"]


def test_bad_directories_raise_value_errors(tmp_path):
    with pytest.raises(attnbench.results.ResultsError, match="is not a directory"):
        attnbench.results.load(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="results.csv"):
        attnbench.results.load(str(tmp_path))
    (tmp_path / "results.csv").write_text("spec,batch\nflash,1\n")
    with pytest.raises(ValueError, match="column"):
        attnbench.results.load(str(tmp_path))
