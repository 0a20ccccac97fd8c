#!/usr/bin/env python3
"""Captures the q, k, v of every layer of the trained model (scripts/train_lm.py) on held-out
text, for `attnbench run/sweep --input trained[:layer=L]`.

Writes CACHE/trained/qkv/layer{L}.npz (float32 q, k, v [1, H, 4C, d]: rotary positions
applied, exactly what each layer's softmax sees) and CACHE/trained/qkv/meta.json (written
last: its presence means the capture is complete). The model is causal, so the first n
positions are what an n-token run computes; positions from C on are beyond the context the
model was trained on (meta.json's "context").

    /usr/bin/python3 scripts/capture_qkv.py [--cache DIR] [--length N] [--force]
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnbench_lm as lm  # noqa: E402

FORMAT = 1


def capture(model, tokens):
    """[(q, k, v)] per layer for tokens [1, n], float32 numpy [1, H, n, d]."""
    layers = []
    with torch.no_grad():
        model(tokens, None, layers)
    return [tuple(np.ascontiguousarray(t.numpy(), dtype=np.float32) for t in qkv)
            for qkv in layers]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="cache root (default: ATTNBENCH_CACHE, "
                    "$XDG_CACHE_HOME/attnbench or ~/.cache/attnbench)")
    ap.add_argument("--length", type=int, default=0, help="positions captured (default 4C)")
    ap.add_argument("--offset", type=int, default=-1,
                    help="first byte of the held-out text captured (default: after the "
                         "validation windows train_lm.py and swap_eval.py use, 64 C)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="capture even if meta.json exists")
    args = ap.parse_args(argv)
    root = args.cache or lm.cache_root()
    out = os.path.join(lm.trained_dir(root), "qkv")
    meta_path = os.path.join(out, "meta.json")
    ckpt_path = lm.checkpoint_path(root)
    sha = lm.sha256_file(ckpt_path) if os.path.exists(ckpt_path) else None
    if os.path.exists(meta_path) and not args.force:
        with open(meta_path) as f:
            old = json.load(f)
        if old.get("checkpoint") == sha:
            print(f"capture_qkv.py: {out} holds the capture of this checkpoint "
                  f"(--force captures again)")
            return 0
        print(f"capture_qkv.py: {out} was captured from another checkpoint; capturing again")
    torch.set_num_threads(args.threads)
    model, ckpt = lm.load_model(ckpt_path)
    cfg = model.cfg
    C = cfg["context"]
    length = args.length or 4 * C
    offset = 64 * C if args.offset < 0 else args.offset
    _, valid_path = lm.fetch_corpus(root)
    valid = lm.read_bytes(valid_path)
    if length < 1 or offset < 0 or offset + length > len(valid):
        raise SystemExit(f"capture_qkv.py: --offset {offset} and --length {length} must lie "
                         f"within the {len(valid)} held-out bytes")
    tokens = torch.from_numpy(valid[offset:offset + length].astype(np.int64))[None]
    layers = capture(model, tokens)
    os.makedirs(out, exist_ok=True)
    if os.path.exists(meta_path):
        os.remove(meta_path)
    for L, (q, k, v) in enumerate(layers):
        path = os.path.join(out, f"layer{L}.npz")
        with open(path + ".tmp", "wb") as f:
            np.savez(f, q=q, k=k, v=v)
        os.replace(path + ".tmp", path)
    text = valid[offset:offset + 200].tobytes().decode("latin-1")
    meta = {"format": FORMAT, "layers": cfg["layers"], "heads": cfg["heads"],
            "dim": cfg["head_dim"], "context": C, "length": length, "checkpoint": sha,
            "corpus": lm.CORPUS_PACKAGE, "offset": offset,
            "text": f"held-out Brown corpus bytes {offset}..{offset + length}: {text!r}...",
            "valid_bpb": ckpt.get("valid_bpb"), "positions": "rotary, applied to q and k"}
    lm.write_json(meta_path, meta)
    print(f"capture_qkv.py: {len(layers)} layers of q, k, v [1, {cfg['heads']}, {length}, "
          f"{cfg['head_dim']}] in {out}")
    return 0


if __name__ == "__main__":
    lm.script_main(main)
