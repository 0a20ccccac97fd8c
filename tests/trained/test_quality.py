"""scripts/quality.py: the recall task's generator, a tiny recall run (rows, resume, the
bidirectional form, refusals), a tiny language-model uptraining run, and --shard and merge.

    PYTHONPATH=build/python /usr/bin/python3 -m pytest -q tests/trained/test_quality.py
"""

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
attnbench = pytest.importorskip("attnbench")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)
import attnbench_recall as task  # noqa: E402
import quality  # noqa: E402
from attnbench_results import run_main  # noqa: E402


def quality_script(*args, check=True):
    """quality.py ARGS run in this process as its command line runs it (one torch import for
    the whole file): returncode, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_main(lambda: quality.main(list(args)), "quality.py")
        except SystemExit as e:
            code = e.code
            if isinstance(code, str):  # sys.exit(message): printed, exit status 1
                print(code, file=sys.stderr)
                code = 1
    r = types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(),
                              stderr=err.getvalue())
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_the_generator_pairs_keys_with_values_and_queries_earlier_keys():
    n, pairs = 128, 6
    tokens, targets = task.generate(task.data_rng(5, "train"), 8, n, pairs)
    assert tokens.shape == targets.shape == (8, n)
    q = task.query_count(n, pairs)
    assert q == n // 4 - 2 * pairs
    for row, want in zip(tokens.numpy(), targets.numpy()):
        keys, values = row[0:2 * pairs:2], row[1:2 * pairs:2] - task.KEYS
        assert len(set(keys)) == pairs and keys.max() < task.KEYS
        assert values.min() >= 0 and values.max() < task.VALUES
        assert (row[2 * pairs:n - q] == task.FILLER).all()
        paired = dict(zip(keys, values))
        for pos in range(n):
            if pos < n - q:
                assert want[pos] == task.IGNORE
                continue
            key = row[pos]
            assert key in paired, "a query asks for a key of its own sequence"
            assert want[pos] == paired[key], "the target is the value paired with the key"
            where = 2 * int(np.flatnonzero(keys == key)[0])
            assert pos - where >= task.min_distance(n, pairs)
        # every key is queried, as often as any other (within one)
        counts = np.bincount([list(keys).index(k) for k in row[n - q:]], minlength=pairs)
        assert counts.max() - counts.min() <= 1
    # the smallest distance is reached: the last key and the first query
    assert task.min_distance(n, pairs) == (n - q) - (2 * pairs - 2)
    # beyond what two layers of the default local window (256) relay
    assert task.min_distance(1024, 8) > 2 * 256


def test_the_bidirectional_form_holds_each_pair_in_one_position():
    """Pairs at the first P positions as PAIR * (value + 1) + key, the queries and targets as
    in the causal form; the model sums the key's and the value's embeddings there."""
    n, pairs = 128, 6
    tokens, targets = task.generate(task.data_rng(5, "train"), 8, n, pairs, bidirectional=True)
    q = task.query_count(n, pairs)
    for row, want in zip(tokens.numpy(), targets.numpy()):
        keys, values = row[:pairs] % task.PAIR, row[:pairs] // task.PAIR - 1
        assert (row[:pairs] >= task.PAIR).all() and len(set(keys)) == pairs
        assert keys.max() < task.KEYS and 0 <= values.min() and values.max() < task.VALUES
        assert (row[pairs:n - q] == task.FILLER).all() and (row[n - q:] < task.KEYS).all()
        paired = dict(zip(keys, values))
        assert (want[:n - q] == task.IGNORE).all()
        assert [paired[k] for k in row[n - q:]] == list(want[n - q:])
        last = max(np.flatnonzero(np.isin(keys, row[n - q:])))
        assert (n - q) - last >= task.min_distance(n, pairs, bidirectional=True)
    assert task.min_distance(n, pairs, bidirectional=True) == (n - q) - (pairs - 1)
    model = task.RecallModel(32, "flash", False, n)
    with torch.no_grad():
        x, table = model.embedding(tokens), model.embed.weight
        for b in range(2):
            for pos in (0, pairs - 1, pairs, n - 1):
                t = int(tokens[b, pos])
                want = table[t % task.PAIR] + table[task.KEYS + t // task.PAIR - 1] \
                    if t >= task.PAIR else table[t]
                assert torch.allclose(x[b, pos], want)
        assert model(tokens[:1]).shape == (1, n, task.VALUES)


def test_the_seed_fixes_the_data_and_the_streams_differ():
    a = task.generate(task.data_rng(3, "train"), 4, 64, 4)
    b = task.generate(task.data_rng(3, "train"), 4, 64, 4)
    c = task.generate(task.data_rng(4, "train"), 4, 64, 4)
    d = task.generate(task.data_rng(3, "test"), 4, 64, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])


def test_a_setting_without_room_for_queries_is_refused():
    with pytest.raises(ValueError, match="n must exceed 8P"):
        task.query_count(64, 8)
    r = quality_script("recall", "--variant", "flash", "--seq", "64", "--pairs", "8",
                       "--out", "/nonexistent-unused", check=False)
    assert r.returncode != 0 and "n must exceed 8P" in r.stderr


def test_training_is_reproducible_from_the_seed():
    runs = [task.train("flash", 64, 4, 32, 7, 3, 4, 3e-3, threads=1, test_sequences=8)
            for _ in range(2)]
    assert runs[0]["final_loss"] == runs[1]["final_loss"]
    assert runs[0]["accuracy"] == runs[1]["accuracy"]
    assert runs[0]["tokens"] == 3 * 4 * 64


def test_a_recall_run_writes_its_rows_and_resumes(tmp_path):
    out = str(tmp_path / "q")
    args = ["recall", "--variant", "flash", "--variant", "local:window=8", "--variant",
            "clustered", "--seq", "64", "--pairs", "4", "--seeds", "2", "--steps", "3",
            "--batch", "4", "--width", "32", "--threads", "1", "--out", out]
    r = quality_script(*args)
    assert "[6/6]" in r.stdout and "left" in r.stdout  # progress with an estimate
    path = os.path.join(out, "quality", "recall.csv")
    with open(path) as f:
        assert f.readline().strip().split(",") == quality.RECALL_COLUMNS
    rows = read(path)
    assert [(r["spec"], r["seed"]) for r in rows] == [
        ("flash", "0"), ("flash", "1"), ("local:window=8", "0"), ("local:window=8", "1"),
        ("clustered", "0"), ("clustered", "1")]
    for row in rows[:4]:
        assert row["status"] == "ok" and row["mode"] == "causal"
        assert row["tokens"] == str(3 * 4 * 64) and row["steps"] == "3"
        assert 0 <= float(row["accuracy"]) <= 1 and float(row["final_loss"]) > 0
        assert float(row["train_s"]) > 0
        assert row["min_distance"] == str(task.min_distance(64, 4))
    assert all(row["cpu"] == quality.cpu_model() for row in rows)
    for row in rows[4:]:  # cannot be causal: a row that says why
        assert row["status"] == "unsupported" and "cannot be causal" in row["message"]
        assert row["accuracy"] == ""
    before = open(path).read()
    r = quality_script(*args)
    assert "0 to train" in r.stdout and open(path).read() == before
    # a lost row is trained again, alone
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=quality.RECALL_COLUMNS)
        w.writeheader()
        w.writerows(rows[1:])
    r = quality_script(*args)
    assert "1 to train" in r.stdout
    again = read(path)
    assert len(again) == 6
    first = [x for x in again if x["spec"] == "flash" and x["seed"] == "0"][0]
    assert first["final_loss"] == rows[0]["final_loss"]  # the same seed, the same numbers
    # the bidirectional form runs the variants that cannot be causal, in rows of their own
    r = quality_script("recall", "--bidirectional", "--variant", "clustered", "--seq", "64",
                       "--pairs", "4", "--seeds", "1", "--steps", "2", "--batch", "4",
                       "--width", "32", "--threads", "1", "--out", out)
    rows = read(path)
    assert len(rows) == 7
    assert rows[-1]["spec"] == "clustered" and rows[-1]["mode"] == "bidirectional"
    assert rows[-1]["status"] == "ok", rows[-1]


def test_a_misspelt_variant_is_refused_before_anything_runs(tmp_path):
    # the script itself, from its command line
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "quality.py"), "recall",
                        "--variant", "flsh", "--out", str(tmp_path / "q")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "flsh" in r.stderr
    assert not os.path.exists(tmp_path / "q" / "quality" / "recall.csv")


def test_a_tiny_uptraining_run(tmp_path):
    """The base model (trained here for a few steps at context 64), two variants swapped in
    and uptrained, the rows' arithmetic."""
    cache = str(tmp_path / "cache")
    corpus = os.path.join(cache, "trained", "corpus")
    os.makedirs(corpus)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt"),
              "rb") as f:
        data = f.read()
    with open(os.path.join(corpus, "train.txt"), "wb") as f:
        f.write(data[:30000])
    with open(os.path.join(corpus, "valid.txt"), "wb") as f:
        f.write(data[30000:])
    out = str(tmp_path / "q")
    args = ["lm", "--variant", "local:window=8", "--variant", "gla", "--seeds", "2",
            "--seeded", "gla", "--steps", "2", "--context", "64", "--base-steps", "6",
            "--base-config", "layers=1,heads=2,head_dim=16,width=32,mlp=64", "--windows", "2",
            "--threads", "1", "--cache", cache, "--out", out]
    quality_script(*args)
    rows = read(os.path.join(out, "quality", "lm.csv"))
    assert [(r["spec"], r["seed"]) for r in rows] == [
        ("flash", "0"), ("flash", "1"), ("local:window=8", "0"), ("gla", "0"), ("gla", "1")]
    assert all(r["status"] == "ok" for r in rows), rows
    base = float(rows[0]["base_bpb"])
    flash = {r["seed"]: float(r["uptrain_bpb"]) for r in rows[:2]}
    for r in rows:
        assert float(r["base_bpb"]) == base and r["context"] == "64"
        assert r["uptrain_tokens"] == str(2 * 2 * 64)
        assert float(r["swap_delta"]) == pytest.approx(float(r["swap_bpb"]) - base, abs=2e-6)
        assert float(r["flash_uptrain_bpb"]) == flash[r["seed"]]
        assert float(r["uptrain_delta"]) == pytest.approx(
            float(r["uptrain_bpb"]) - flash[r["seed"]], abs=2e-6)
    assert abs(float(rows[0]["swap_delta"])) < 1e-4  # flash is the model's own attention
    gla = rows[3]
    assert float(gla["recovered"]) == pytest.approx(
        1 - float(gla["uptrain_delta"]) / float(gla["swap_delta"]), abs=1e-3)
    assert os.path.exists(os.path.join(out, "quality", "lm_train_log.csv"))
    assert all(r["cpu"] == quality.cpu_model() for r in rows)
    r = quality_script(*args)
    assert "0 run(s) to do" in r.stdout
    # --jobs 2: the same rows (numbers included) from two worker processes, flash's first
    two = str(tmp_path / "two")
    r = quality_script(*args[:-1], two, "--jobs", "2")
    assert "2 jobs of 1 thread(s)" in r.stdout
    jobs = read(os.path.join(two, "quality", "lm.csv"))
    assert sorted((x["spec"], x["seed"]) for x in jobs[:2]) == [("flash", "0"), ("flash", "1")]
    key = lambda r: (r["spec"], r["seed"])  # noqa: E731
    assert sorted(map(key, jobs)) == sorted(map(key, rows))
    mine = {key(x): x for x in jobs}
    for row in rows:
        for column in ("status", "swap_bpb", "uptrain_bpb", "flash_uptrain_bpb",
                       "uptrain_delta", "recovered", "checkpoint"):
            assert mine[key(row)][column] == row[column], (key(row), column)


def test_shards_split_the_runs_and_merge_gives_the_unsharded_rows(tmp_path):
    """--shard I/N runs the runs at an index I modulo N; two shards cover the unsharded run
    exactly, and `merge` of them gives its rows (but the training times)."""
    args = ["recall", "--variant", "flash", "--variant", "clustered", "--seq", "64", "--pairs",
            "4", "--seeds", "3", "--steps", "3", "--batch", "4", "--width", "32", "--threads",
            "1"]
    whole = str(tmp_path / "whole")
    quality_script(*args, "--out", whole)
    shards = [str(tmp_path / f"shard-{i}") for i in range(2)]
    for i, d in enumerate(shards):
        r = quality_script(*args, "--shard", f"{i}/2", "--out", d)
        assert f"shard {i}/2: 3 to train" in r.stdout
    key = lambda r: tuple(r[c] for c in quality.RECALL_KEY)  # noqa: E731
    rows = read(os.path.join(whole, "quality", "recall.csv"))
    parts = [read(os.path.join(d, "quality", "recall.csv")) for d in shards]
    # the ordered list of runs (per setting, variant, seed), every second one to each shard
    assert [key(r) for r in parts[0]] == [key(r) for r in rows[0::2]]
    assert [key(r) for r in parts[1]] == [key(r) for r in rows[1::2]]

    out = str(tmp_path / "merged")
    r = quality_script("merge", out, *shards)
    assert "6 rows" in r.stdout
    merged = read(os.path.join(out, "quality", "recall.csv"))
    untimed = lambda rs: sorted(tuple(sorted((c, v) for c, v in r.items()  # noqa: E731
                                             if c != "train_s")) for r in rs)
    assert untimed(merged) == untimed(rows)
    assert all(float(r["train_s"]) > 0 for r in merged if r["status"] == "ok")
    # the record of the runs that trained the rows: both shards' invocations, each once
    with open(os.path.join(out, "quality", "meta.json")) as f:
        commands = [r["command"] for r in json.load(f)["runs"]]
    assert len(commands) == 2 and all("--shard" in c for c in commands), commands

    # OUT's rows are kept (and come first), an ok row wins over a failed one, a repeated row is
    # kept once, and of two different ok rows of one key the first stays, with a warning
    columns = quality.RECALL_COLUMNS
    failed = dict(parts[0][0], status="failed", message="RuntimeError: x", accuracy="")
    extra = dict(parts[0][0], seed="9")
    other = dict(parts[1][0], accuracy="0.999")
    kept = [failed if key(r) == key(failed) else r for r in merged] + [extra]
    quality.write_rows(os.path.join(out, "quality", "recall.csv"), kept, columns)
    redo = tmp_path / "redo" / "quality"
    redo.mkdir(parents=True)
    quality.write_rows(str(redo / "recall.csv"), [other, parts[1][1]], columns)
    r = quality_script("merge", out, *shards, str(redo.parent))
    assert "warning" in r.stderr and f"seed={other['seed']}" in r.stderr, r.stderr
    again = {key(r): r for r in read(os.path.join(out, "quality", "recall.csv"))}
    assert len(again) == 7 and key(extra) in again
    assert again[key(failed)]["status"] == "ok"
    assert again[key(failed)]["accuracy"] == parts[0][0]["accuracy"]
    assert again[key(other)]["accuracy"] == parts[1][0]["accuracy"]


def test_jobs_train_the_same_rows_in_processes_of_their_own(tmp_path):
    """--jobs 2: the runs go to two worker processes and give the rows (numbers included) of
    the same runs trained one after the other; a refused run is a row as before."""
    args = ["recall", "--variant", "flash", "--variant", "clustered", "--variant",
            "local:window=8", "--seq", "64", "--pairs", "4", "--seeds", "1", "--steps", "2",
            "--batch", "4", "--width", "32", "--threads", "1"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    quality_script(*args, "--out", one)
    r = quality_script(*args, "--jobs", "2", "--out", two)
    assert "2 jobs of 1 thread(s)" in r.stdout and "[3/3]" in r.stdout
    key = lambda r: tuple(r[c] for c in quality.RECALL_KEY)  # noqa: E731
    rows = {key(r): r for r in read(os.path.join(one, "quality", "recall.csv"))}
    jobs = {key(r): r for r in read(os.path.join(two, "quality", "recall.csv"))}
    assert rows.keys() == jobs.keys() and len(rows) == 3
    for k, row in rows.items():
        for column in ("status", "message", "accuracy", "final_loss", "tokens", "threads"):
            assert jobs[k][column] == row[column], (k, column)
    assert sorted(r["status"] for r in rows.values()) == ["ok", "ok", "unsupported"]
    r = quality_script("recall", "--jobs", "0", "--out", two, check=False)
    assert r.returncode == 2 and "--jobs" in r.stderr


def test_bad_shards_and_merges_are_refused(tmp_path, capsys):
    for bad in ("2/2", "0/0", "1", "a/b", "0/2/4"):
        with pytest.raises(SystemExit) as e:
            quality.main(["recall", "--shard", bad, "--out", str(tmp_path / "q")])
        assert e.value.code == 2 and "expected I/N" in capsys.readouterr().err, bad
    with pytest.raises(SystemExit, match="is not a directory"):
        quality.main(["merge", str(tmp_path / "out"), str(tmp_path / "missing")])
    os.makedirs(tmp_path / "empty")
    with pytest.raises(SystemExit, match="holds quality/recall.csv or quality/lm.csv"):
        quality.main(["merge", str(tmp_path / "out"), str(tmp_path / "empty")])
    assert not os.path.exists(tmp_path / "out")


def test_an_lm_shard_runs_flash_of_the_seeds_it_compares_with():
    runs = [dict(spec=s, seed=k) for s in ("flash", "local", "gla") for k in (0, 1)]
    assert quality.lm_shard(runs, None) == runs
    # shard 0/4: flash 0 and gla 0 by index; shard 1/4: flash 1 and gla 1; shard 2/4: local 0,
    # and flash 0 before it; shard 3/4: local 1, and flash 1 before it
    spec_seed = lambda rs: [(r["spec"], r["seed"]) for r in rs]  # noqa: E731
    assert spec_seed(quality.lm_shard(runs, (0, 4))) == [("flash", 0), ("gla", 0)]
    assert spec_seed(quality.lm_shard(runs, (1, 4))) == [("flash", 1), ("gla", 1)]
    assert spec_seed(quality.lm_shard(runs, (2, 4))) == [("flash", 0), ("local", 0)]
    assert spec_seed(quality.lm_shard(runs, (3, 4))) == [("flash", 1), ("local", 1)]
    covered = [r for i in range(4) for r in quality.lm_shard(runs, (i, 4))]
    assert all(r in covered for r in runs)
