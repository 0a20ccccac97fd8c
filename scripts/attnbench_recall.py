"""Multi-query associative recall (MQAR): the task, the small model trained on it, and one run.

The task (after Zoology's MQAR, Arora et al. 2023), from a seed. A sequence of n tokens holds
P key-value pairs at its start, `k1 v1 k2 v2 ... kP vP` (P distinct keys drawn from a key
vocabulary of KEYS tokens, each value drawn from a value vocabulary of VALUES tokens), then
filler tokens, then queries: every one of the last n/4 - 2P positions holds one of the P keys
(each key as often as the others, in a random order), and the target there is the value paired
with that key. Loss and accuracy count only the query positions. Every query is at least
3n/4 + 2 positions after its key (770 at n = 1024), so a mechanism that keeps only the last W
keys of a query cannot recall any of them when L W is shorter than that in a model of L layers
(two layers of a window W relay a key up to 2W positions: 512 for local's default 256).

Causal form: the model reads the sequence left to right and predicts the value at each query
position from what precedes it. Bidirectional form (`bidirectional=True`): every position sees
the whole sequence, and each pair takes one position at the start, its key's and its value's
embeddings summed there (token PAIR * (value + 1) + key; the first P positions), the queries as
in the causal form; the value of a queried key is only at its pair's position, never at the
query position, so the answer is never visible there either. A pair in one position makes the
lookup one hop (find the position that holds the key, read its value): with `k v` in two
positions and no causal order, a value cannot tell its own key (before it) from the next pair's
(after it) but by the sign of a rotary offset, and exact attention did not learn the two-hop
form within the budget (0.15 accuracy at n = 128, as the fixed-state mechanisms reach).

The model: token embeddings of width E, 2 pre-norm blocks, each attention (the variant through
attnbench.torch, its learned inputs produced by attnbench.torch.LearnedInputs from the block's
input) and an MLP of width 4E with GELU; E / 32 heads of dimension 32, rotary positions on q and
k (base 10000); a final norm and a linear read-out over the value vocabulary. Training: AdamW
(betas 0.9, 0.98, no weight decay), a linear warm-up over the first 10% of the steps then a
constant learning rate, gradients clipped at norm 1; each step draws a fresh batch of sequences
from the seed. The first half of the steps (the length warm-up) trains on sequences of
warmup_seq tokens (64; the same P pairs, every position after them a query, so queries sit
nearer their keys), n / warmup_seq times as many per step, the same tokens per step; the second
half on sequences of n. A model
learns the lookup first where it is easy to find (an attention spread evenly over 512 tokens
hides it for many steps) and then over the distance the setting asks for; a mechanism that
cannot reach that far (a local window) learns the short form and then fails the long one.
The budget (steps x batch x n tokens) is the same for every variant; accuracy is measured at n
only.
"""

import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnbench_lm import rotary

KEYS = 64      # key vocabulary: tokens 0 .. KEYS-1
VALUES = 64    # value vocabulary: tokens KEYS .. KEYS+VALUES-1
FILLER = KEYS + VALUES
VOCAB = KEYS + VALUES + 1
PAIR = 1000    # bidirectional form: a pair position holds PAIR * (value + 1) + key
HEAD_DIM = 32
IGNORE = -100  # the target of a position that is not a query


def query_count(n, pairs):
    """How many query positions a sequence of n tokens with `pairs` pairs has (the last n/4 -
    2P); raises ValueError when there is no room for them."""
    q = n // 4 - 2 * pairs
    if pairs < 1 or q < 1:
        raise ValueError(f"--seq {n} with --pairs {pairs}: the queries take the last n/4 - 2P "
                         f"positions, so n must exceed 8P (at least {8 * pairs + 4})")
    return q


def min_distance(n, pairs, bidirectional=False):
    """The smallest distance between a query and its key (the last key at 2P - 2, or at P - 1
    in the bidirectional form; the first query at n - query_count)."""
    last = pairs - 1 if bidirectional else 2 * pairs - 2
    return n - query_count(n, pairs) - last


def generate(rng, count, n, pairs, queries=None, bidirectional=False):
    """`count` MQAR sequences: (tokens [count, n] int64, targets [count, n] int64 with IGNORE
    off the query positions) drawn from the numpy Generator rng. `queries`: how many of the last
    positions are queries (default query_count; the warm-up's n - 2P leaves no filler).
    bidirectional: each pair in one position, PAIR * (value + 1) + key (the module's
    docstring)."""
    q = query_count(n, pairs) if queries is None else queries
    if not 1 <= q <= n - 2 * pairs:
        raise ValueError(f"{q} queries do not fit after {pairs} pairs in {n} tokens")
    tokens = np.full((count, n), FILLER, np.int64)
    targets = np.full((count, n), IGNORE, np.int64)
    rounds = -(-q // pairs)
    for b in range(count):
        keys = rng.choice(KEYS, pairs, replace=False)
        values = rng.integers(0, VALUES, pairs)
        if bidirectional:
            tokens[b, 0:pairs] = PAIR * (values + 1) + keys
        else:
            tokens[b, 0:2 * pairs:2] = keys
            tokens[b, 1:2 * pairs:2] = KEYS + values
        order = np.concatenate([rng.permutation(pairs) for _ in range(rounds)])[:q]
        tokens[b, n - q:] = keys[order]
        targets[b, n - q:] = values[order]
    return torch.from_numpy(tokens), torch.from_numpy(targets)


def data_rng(seed, stream):
    """The numpy Generator of one stream ("train" or "test") of a seed: the held-out sequences
    never share a draw with the training ones."""
    return np.random.default_rng([int(seed), {"train": 0, "test": 1}[stream]])


class Block(nn.Module):
    def __init__(self, width, variant, causal, max_length, seed, threads):
        super().__init__()
        import attnbench.torch
        self.heads = width // HEAD_DIM
        self.variant, self.causal, self.threads, self.seed = variant, causal, threads, seed
        self.ln1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.inputs = attnbench.torch.LearnedInputs(variant, width, self.heads, HEAD_DIM,
                                                    max_length=max_length, seed=seed)

    def forward(self, x):
        import attnbench.torch
        B, n, E = x.shape
        h = self.ln1(x)

        def heads(t):
            return t.view(B, n, self.heads, HEAD_DIM).transpose(1, 2)
        q = rotary(heads(self.q(h)), 10000.0).contiguous()
        k = rotary(heads(self.k(h)), 10000.0).contiguous()
        v = heads(self.v(h)).contiguous()
        o = attnbench.torch.attention(self.variant, q, k, v, causal=self.causal,
                                      seed=self.seed, threads=self.threads, **self.inputs(h))
        x = x + self.o(o.transpose(1, 2).reshape(B, n, E))
        return x + self.mlp(self.ln2(x))


class RecallModel(nn.Module):
    def __init__(self, width, variant, causal, max_length, seed=0, threads=0, layers=2):
        super().__init__()
        if width < HEAD_DIM or width % HEAD_DIM:
            raise ValueError(f"--width {width}: a positive multiple of the head dimension "
                             f"{HEAD_DIM}")
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width, variant, causal, max_length, seed * 100 + i,
                                          threads) for i in range(layers))
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, VALUES)

    def embedding(self, tokens):
        """The token embeddings; at a pair of the bidirectional form (a token >= PAIR) its key's
        embedding plus its value's."""
        pair = tokens >= PAIR
        if not pair.any():
            return self.embed(tokens)
        key = torch.where(pair, tokens % PAIR, tokens)
        value = torch.where(pair, KEYS + tokens // PAIR - 1, torch.zeros_like(tokens))
        return self.embed(key) + self.embed(value) * pair[..., None]

    def forward(self, tokens):
        x = self.embedding(tokens)
        for b in self.blocks:
            x = b(x)
        return self.out(self.ln(x))


def loss_and_hits(model, tokens, targets):
    """Mean cross-entropy over the query positions, and the number of them predicted right."""
    logits = model(tokens)
    flat, want = logits.reshape(-1, VALUES), targets.reshape(-1)
    loss = F.cross_entropy(flat, want, ignore_index=IGNORE)
    hits = ((flat.argmax(-1) == want) & (want != IGNORE)).sum().item()
    return loss, hits


def accuracy(model, n, pairs, seed, sequences, batch, bidirectional=False):
    """Accuracy on `sequences` held-out sequences of the seed's test stream."""
    rng = data_rng(seed, "test")
    hits = total = 0
    with torch.no_grad():
        for start in range(0, sequences, batch):
            tokens, targets = generate(rng, min(batch, sequences - start), n, pairs,
                                       bidirectional=bidirectional)
            hits += loss_and_hits(model, tokens, targets)[1]
            total += int((targets != IGNORE).sum())
    return hits / total


WARMUP_SEQ = 64


def warmup_length(n, pairs, warmup_seq=WARMUP_SEQ):
    """The length of the warm-up's sequences: warmup_seq when it divides n, is shorter than n
    and leaves at least as many queries as pairs' tokens after them; else n (no warm-up)."""
    if warmup_seq and warmup_seq < n and n % warmup_seq == 0 and warmup_seq > 4 * pairs:
        return warmup_seq
    return n


def train(variant, n, pairs, width, seed, steps, batch, lr, causal=True, threads=0,
          test_sequences=256, log=None, warmup_seq=WARMUP_SEQ):
    """Trains a RecallModel with `variant` for `steps` steps of `batch` sequences of n tokens
    (the first half with the length warm-up, see the module's docstring) and measures its
    held-out accuracy at n. Returns dict(accuracy, final_loss, train_s, tokens). Raises what the
    variant raises for a problem it cannot do (NotImplementedError, ValueError)."""
    torch.manual_seed(seed)
    model = RecallModel(width, variant, causal, n, seed=seed, threads=threads)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = data_rng(seed, "train")
    warmup = max(1, steps // 10)
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / warmup)
        short = warmup_length(n, pairs, warmup_seq)
        if step <= steps // 2 and short < n:
            tokens, targets = generate(rng, batch * (n // short), short, pairs,
                                       queries=short - 2 * pairs, bidirectional=not causal)
        else:
            tokens, targets = generate(rng, batch, n, pairs, bidirectional=not causal)
        loss, _ = loss_and_hits(model, tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"the training loss is {losses[-1]} at step {step}")
        if log is not None and (step % 50 == 0 or step == steps):
            log(step, losses[-1], time.perf_counter() - start)
    train_s = time.perf_counter() - start
    model.eval()
    acc = accuracy(model, n, pairs, seed, test_sequences, batch, bidirectional=not causal)
    # the mean of the last 10% of the steps: one batch's loss is noisy
    tail = losses[-max(1, steps // 10):]
    return dict(accuracy=acc, final_loss=float(np.mean(tail)), train_s=train_s,
                tokens=steps * batch * n)
