"""The trained-model scripts (scripts/attnbench_lm.py, train_lm.py, capture_qkv.py,
swap_eval.py) on a tiny model trained here for a few seconds, and the binary's
`--input trained` on what capture_qkv.py writes.

    PYTHONPATH=build/python ATTNBENCH_BIN=build/attnbench /usr/bin/python3 -m pytest -q \
        tests/trained
"""

import contextlib
import csv
import importlib
import io
import json
import math
import os
import subprocess
import sys
import types
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
attnbench = pytest.importorskip("attnbench")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)
import attnbench_lm as lm  # noqa: E402

TINY = dict(layers=2, heads=4, head_dim=16, width=64, mlp=128, context=64)
TINY_ARG = ",".join(f"{k}={v}" for k, v in TINY.items())
BIN = os.environ.get("ATTNBENCH_BIN", os.path.join(ROOT, "build", "attnbench"))


def text_bytes():
    """Real English text to train and evaluate on: tests/trained/corpus.txt, 40,000 bytes of
    an earlier README of attnbench, kept here so that what the tiny model learns (and so the
    margins below) does not change with the documentation."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt"), "rb") as f:
        data = f.read()
    assert len(data) == 40000, "tests/trained/corpus.txt should hold 40,000 bytes"
    return data


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache with a corpus (corpus.txt), a tiny model trained for 30 steps, and its capture
    of 3 C positions."""
    root = str(tmp_path_factory.mktemp("cache"))
    corpus = os.path.join(root, "trained", "corpus")
    os.makedirs(corpus)
    data = text_bytes()
    with open(os.path.join(corpus, "train.txt"), "wb") as f:
        f.write(data[:30000])
    with open(os.path.join(corpus, "valid.txt"), "wb") as f:
        f.write(data[30000:])
    # one thread: ctest runs another test beside this one, and two torch threads of a model
    # this small mostly wait for each other
    run_script("train_lm.py", "--cache", root, "--steps", "30", "--eval-every", "10",
               "--eval-windows", "2", "--batch", "4", "--lr", "3e-3", "--config", TINY_ARG,
               "--threads", "1")
    run_script("capture_qkv.py", "--cache", root, "--length", str(3 * TINY["context"]),
               "--offset", "0", "--threads", "1")
    return root


def run_script(name, *args, env=None, check=True):
    """scripts/NAME ARGS run in this process as its command line runs it (one torch import
    for the whole file), with os.environ replaced by env when given: returncode, stdout and
    stderr."""
    script = importlib.import_module(name[:-len(".py")])
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.ExitStack() as stack:
        if env is not None:
            stack.enter_context(mock.patch.dict(os.environ, env, clear=True))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            lm.script_main(lambda: script.main(list(args)))
        except SystemExit as e:
            code = e.code
            if isinstance(code, str):  # sys.exit(message): printed, exit status 1
                print(code, file=sys.stderr)
                code = 1
    r = types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_training_writes_a_model_that_learned(cache):
    model, ckpt = lm.load_model(lm.checkpoint_path(cache))
    assert model.cfg["context"] == TINY["context"] and ckpt["steps"] == 30
    with open(os.path.join(cache, "trained", "train_log.csv")) as f:
        log = list(csv.DictReader(f))
    assert [int(r["step"]) for r in log] == [0, 10, 20, 30]
    first, last = float(log[0]["valid_bpb"]), float(log[-1]["valid_bpb"])
    assert first > 7.0  # an untrained model is near uniform over 256 bytes (8 bits)
    assert last < first - 1.5, log  # 30 steps on repeated text learn the byte statistics
    assert math.isclose(ckpt["valid_bpb"], last)


def test_capture_format(cache):
    qkv = os.path.join(cache, "trained", "qkv")
    with open(os.path.join(qkv, "meta.json")) as f:
        meta = json.load(f)
    C = TINY["context"]
    assert meta["format"] == 1 and meta["layers"] == 2 and meta["heads"] == 4
    assert meta["dim"] == 16 and meta["context"] == C and meta["length"] == 3 * C
    assert meta["checkpoint"] == lm.sha256_file(lm.checkpoint_path(cache))
    model, _ = lm.load_model(lm.checkpoint_path(cache))
    tokens = torch.from_numpy(
        lm.read_bytes(os.path.join(cache, "trained", "corpus", "valid.txt"))[:3 * C]
        .astype(np.int64))[None]
    # each layer's file is what the layer's softmax sees: recompute q, k, v from the layer's
    # input, and check that a shorter run gives the prefix (the model is causal)
    x = model.embed(tokens)
    short = []
    with torch.no_grad():
        model(tokens[:, :40], None, short)
        for L, block in enumerate(model.blocks):
            z = np.load(os.path.join(qkv, f"layer{L}.npz"))
            assert sorted(z.files) == ["k", "q", "v"]
            q, k, v = block.qkv_heads(x)
            for name, want, got in zip("qkv", (q, k, v), (z["q"], z["k"], z["v"])):
                assert got.dtype == np.float32 and got.shape == (1, 4, 3 * C, 16), name
                np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(got[:, :, :40], short[L]["qkv".index(name)].numpy(),
                                           rtol=1e-4, atol=1e-5)
            x = block(x)


def test_rotary_positions_are_relative():
    # q_i . k_j after rotary depends on i - j only: the same vectors at shifted positions
    # give the same product
    rng = np.random.default_rng(1)
    a = torch.from_numpy(rng.standard_normal((1, 1, 1, 16)))
    b = torch.from_numpy(rng.standard_normal((1, 1, 1, 16)))
    seq_q = torch.zeros(1, 1, 12, 16, dtype=torch.float64)
    seq_k = torch.zeros(1, 1, 12, 16, dtype=torch.float64)
    seq_q[:, :, 5], seq_k[:, :, 2] = a[0, 0], b[0, 0]
    seq_q[:, :, 9], seq_k[:, :, 6] = a[0, 0], b[0, 0]
    rq, rk = lm.rotary(seq_q, 10000.0), lm.rotary(seq_k, 10000.0)
    d1 = (rq[0, 0, 5] * rk[0, 0, 2]).sum()
    d2 = (rq[0, 0, 9] * rk[0, 0, 6]).sum()
    d0 = (a * b).sum()
    assert abs(d1 - d2) < 1e-12 and abs(d1 - d0) > 1e-3


def test_flash_in_the_model_reproduces_exact_attention(cache):
    model, _ = lm.load_model(lm.checkpoint_path(cache))
    valid = lm.read_bytes(os.path.join(cache, "trained", "corpus", "valid.txt"))
    batches = list(lm.windows(valid, TINY["context"], 8).split(2))
    exact = lm.bits_per_byte(model, batches)
    for spec in ("flash", "full"):
        assert abs(lm.bits_per_byte(model, batches, spec) - exact) < 1e-4, spec
    # a variant that drops keys changes the loss: the comparison can tell them apart
    assert abs(lm.bits_per_byte(model, batches, "local:window=2") - exact) > 1e-3


def test_swap_eval_table(cache, tmp_path):
    out = str(tmp_path / "results")
    args = [out, "--cache", cache, "--windows", "2", "--variants",
            "flash,local:window=1,linformer,full", "--finetune-steps", "3", "--finetune-top", "1",
            "--threads", "1"]
    run_script("swap_eval.py", *args)
    with open(os.path.join(out, "trained", "swap.csv")) as f:
        rows = {r["spec"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"torch softmax", "flash", "local:window=1", "linformer", "full"}
    assert abs(float(rows["flash"]["delta_bpb"])) < 1e-4
    assert float(rows["flash"]["speedup"]) == 1.0
    # a window of one key (each byte sees itself) raises the loss of even so small a model;
    # wider windows can lower it on two windows of text (window 4: -5e-4 on one training text)
    assert float(rows["local:window=1"]["delta_bpb"]) > 1e-3
    assert rows["linformer"]["status"] == "unsupported"
    assert "causal" in rows["linformer"]["message"]
    for spec in ("flash", "full", "local:window=1"):
        assert float(rows[spec]["attention_s_per_token"]) > 0
    with open(os.path.join(out, "trained", "model.json")) as f:
        assert json.load(f)["checkpoint"] == lm.sha256_file(lm.checkpoint_path(cache))
    # fine-tuned: flash (the baseline) and the one variant that raised the loss
    assert float(rows["flash"]["ft_delta_bpb"]) == 0.0
    # three small steps move the model; whether they lower the held-out loss of so small a
    # model depends on its training text (corpus.txt), so only the move is checked
    ft = float(rows["flash"]["ft_bpb"])
    assert math.isfinite(ft) and ft != float(rows["flash"]["bpb"])
    assert abs(ft - float(rows["flash"]["bpb"])) < 0.5
    local = rows["local:window=1"]
    assert int(local["ft_steps"]) == 3
    assert math.isclose(float(local["recovered"]),
                        1 - float(local["ft_delta_bpb"]) / float(local["delta_bpb"]))
    assert rows["full"]["ft_bpb"] == ""
    # a second run on the same checkpoint and settings keeps the table; other settings do not
    r = run_script("swap_eval.py", *args)
    assert "is from this checkpoint" in r.stdout
    r = run_script("swap_eval.py", out, "--cache", cache, "--windows", "1", "--variants", "flash",
                   "--threads", "1")
    assert "is from this checkpoint" not in r.stdout


def test_missing_cache_is_a_clear_error(tmp_path):
    env = dict(os.environ, ATTNBENCH_CACHE=str(tmp_path / "none"), PATH="/nonexistent")
    r = run_script("capture_qkv.py", env=env, check=False)
    assert r.returncode == 2 and "no trained model" in r.stderr and "train_lm.py" in r.stderr
    r = run_script("train_lm.py", "--steps", "1", env=env, check=False)
    assert r.returncode == 2 and "npm is missing" in r.stderr


def test_detag():
    tagged = ("\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, and/cc "
              "1/2/cd-hl cups/nns ./.\n")
    assert lm.detag(tagged) == 'The jury said "no evidence", and 1/2 cups.\n'


def binary(*args, env):
    return subprocess.run([BIN, *args], capture_output=True, text=True, env=env)


@pytest.mark.skipif(not os.path.exists(BIN), reason="no attnbench binary (ATTNBENCH_BIN)")
def test_the_binary_reads_the_capture(cache, tmp_path):
    env = dict(os.environ, ATTNBENCH_CACHE=cache)
    out = tmp_path / "o.npy"
    r = binary("run", "--variant", "flash", "--input", "trained:layer=1", "--seq", "50",
               "--heads", "4", "--dim", "16", "--causal", "--output", str(out), env=env)
    assert r.returncode == 0, r.stderr
    z = np.load(os.path.join(cache, "trained", "qkv", "layer1.npz"))
    q, k, v = (torch.from_numpy(z[x][:, :, :50].astype(np.float64)) for x in "qkv")
    want = lm.exact_attention(q, k, v).numpy()
    np.testing.assert_allclose(np.load(out), want, rtol=1e-4, atol=1e-5)
    r = binary("run", "--variant", "flash", "--input", "trained", "--seq", "50", "--heads",
               "8", "--dim", "16", env=env)
    assert r.returncode != 0 and "heads" in r.stderr
    env["ATTNBENCH_CACHE"] = str(tmp_path / "empty")
    r = binary("run", "--variant", "flash", "--input", "trained", "--seq", "50", "--heads",
               "4", "--dim", "16", env=env)
    assert r.returncode != 0 and "capture_qkv.py" in r.stderr


@pytest.mark.parametrize("spec", ["gla", "deltanet:gated=true"])
def test_the_model_learns_a_variants_inputs(spec, tmp_path):
    """ByteLM.learn_inputs gives every layer projections for the variant's inputs; a few
    steps train them (finite, non-zero gradients; the parameters move), and a checkpoint
    holding them loads them back (load_model)."""
    torch.manual_seed(0)
    model = lm.ByteLM(TINY)
    new = model.learn_inputs(spec)
    assert model.inputs_variant == attnbench.Variant(spec).spec
    names = [n for n in model.state_dict() if ".inputs." in n]
    assert names and all(n.startswith("blocks.") for n in names)
    before = [p.detach().clone() for p in new]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.from_numpy(np.frombuffer(text_bytes()[:4 * 33], np.uint8).astype(np.int64))
    batch = data.reshape(4, 33)
    for _ in range(3):
        loss = model.loss(batch, spec)
        opt.zero_grad()
        loss.backward()
        for p in new:
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
        opt.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(new, before))
    # the inputs are used only for that variant: another spec runs its own stand-ins
    assert model.blocks[0].learned_inputs(model.embed(batch[:, :-1]), "flash") == {}
    path = str(tmp_path / "model.pt")
    torch.save({"config": model.cfg, "state": model.state_dict(),
                "inputs_variant": model.inputs_variant}, path)
    again, _ = lm.load_model(path)
    with torch.no_grad():
        assert torch.equal(again(batch[:, :-1], spec), model.eval()(batch[:, :-1], spec))
