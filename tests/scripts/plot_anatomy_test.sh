#!/usr/bin/env bash
# scripts/anatomy.py on a synthetic cache of captured q, k, v whose heads have known attention:
# a previous-token head (rotary-like codes that peak at the previous position), a uniform head
# (q = 0) and a sink head (key 0 scored a = 6, every other key 0: P[i, 0] = e^a / (e^a + i)),
# in two layers in different orders. Every measure in anatomy.csv is checked against its
# closed form (entropy, normalised entropy, window mass at every w written, w50, w90, sink
# mass, the mass inside local:window=16 and global:global=8), the figures are checked to be
# written and to draw those numbers, the report (scripts/plot.py on a short real sweep) gains
# the anatomy section with its tables, and results without trained/ get none. A missing or
# malformed cache is a one-line error naming the path and the scripts that build it.
bin=$1
. "$(dirname "$0")/lib.sh" plot_anatomy_test

# The cache: 2 layers, 3 heads, d = 8, context 128, 160 positions captured.
"$py" - "$tmp/cache/trained/qkv" <<'EOF'
import json, math, os, sys
import numpy as np
out = sys.argv[1]
os.makedirs(out)
H, L, D, C = 3, 160, 8, 128
pos = np.arange(L)
periods = np.array([256.0, 64.0, 16.0, 4.0])
def codes(p):  # [L, D]: cos and sin of p at 4 frequencies
    ang = 2 * np.pi * p[:, None] / periods[None, :]
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1).reshape(len(p), D)
c = 12.0
prev = (c * codes(pos - 1), c * codes(pos))             # q_i . k_j peaks at j = i - 1
uniform = (np.zeros((L, D)), np.ones((L, D)))          # every score 0
amp = math.sqrt(6.0 * math.sqrt(D))                     # key 0 scored 6, the others 0
sink_q = np.zeros((L, D)); sink_q[:, 0] = amp
sink_k = np.zeros((L, D)); sink_k[0, 0] = amp
sink = (sink_q, sink_k)
orders = [[prev, uniform, sink], [sink, prev, uniform]]
for layer, heads in enumerate(orders):
    q = np.stack([h[0] for h in heads])[None].astype(np.float32)
    k = np.stack([h[1] for h in heads])[None].astype(np.float32)
    v = np.ones_like(q)
    np.savez(os.path.join(out, f"layer{layer}.npz"), q=q, k=k, v=v)
json.dump({"format": 1, "layers": 2, "heads": H, "dim": D, "context": C, "length": L,
           "checkpoint": "0" * 64}, open(os.path.join(out, "meta.json"), "w"))
EOF

# A short real sweep to draw the report of: its local row gets the trained inputs' rows.
"$bin" sweep --out "$tmp/run" --variant flash --variant local:window=16 --seq 64 --causal on \
  --reps 1 --min-time 0 --heads 2 --dim 16 --threads 1 --machine-file "$machine/threads-1.json" \
  2>/dev/null || fail "the sweep failed"
cp -r "$tmp/run" "$tmp/plain"

anatomy() { "$py" "$root/scripts/anatomy.py" "$@"; }
ATTNBENCH_CACHE="$tmp/cache" anatomy --out "$tmp/run" --attnbench "$bin" \
  --pattern local:window=16 --pattern global:global=8 2>"$tmp/anatomy.err" >"$tmp/anatomy.out" ||
  { cat "$tmp/anatomy.err" >&2; fail "anatomy.py failed"; }
grep -q "wrote .*anatomy.csv (2 layers x 3 heads, n = 128)" "$tmp/anatomy.out" ||
  fail "anatomy.py says: $(cat "$tmp/anatomy.out")"
[ ! -s "$tmp/anatomy.err" ] || fail "anatomy.py said on stderr: $(cat "$tmp/anatomy.err")"
for name in anatomy_entropy anatomy_window_mass anatomy_sinks anatomy_patterns; do
  png "$tmp/run/plots/$name.png"
done

# Every number against its closed form. Row i sees i + 1 keys; the sink rows are i >= 64.
"$py" - "$tmp/run/trained/anatomy.csv" "$tmp/run/trained/anatomy.json" "$tmp/cache" <<'EOF' ||
import json, math, sys
import numpy as np
import pandas as pd
df = pd.read_csv(sys.argv[1])
info = json.load(open(sys.argv[2]))
n, start = 128, 64
i = np.arange(n)
z = np.load(sys.argv[3] + "/trained/qkv/layer0.npz")
a = float(z["q"][0, 2, 5, 0]) * float(z["k"][0, 2, 0, 0]) / math.sqrt(8)  # the sink's score
ea = math.exp(a)
def check(cond, what):
    if not cond:
        sys.exit(f"plot_anatomy_test: {what}")
check(list(df.columns) == ["layer", "head", "measure", "w", "s", "pattern", "value"],
      f"columns {list(df.columns)}")
check(info["n"] == n and info["context"] == 128 and info["sink_start"] == start and
      info["entropy_unit"] == "nats", f"anatomy.json: {info}")
# closed forms per kind of head, as functions of the row
def uniform_window(w): return np.minimum(w, i + 1) / (i + 1)
def sink_window(w):  # the w most recent keys hold key 0 iff w >= i + 1
    return np.where(w >= i + 1, 1.0, w / (ea + i))
Z = ea + i
kinds = {
    "uniform": {"entropy": np.log(i + 1), "window": uniform_window,
                "sink": lambda s: np.minimum(s, i + 1) / (i + 1),
                "local:window=16": np.minimum(i + 1, 17) / (i + 1),
                "global:global=8": np.where(i < 8, 1.0, 8 / (i + 1))},
    "sink": {"entropy": np.log(Z) - a * ea / Z, "window": sink_window,
             "sink": lambda s: np.where(i + 1 <= s, 1.0, (ea + s - 1) / Z),
             "local:window=16": np.where(i <= 16, 1.0, 17 / Z),
             "global:global=8": np.where(i < 8, 1.0, (ea + 7) / Z)},
    # all the mass on the previous token (row 0: on itself), up to e^-50
    "prev": {"entropy": np.zeros(n), "window": lambda w: np.where((w >= 2) | (i == 0), 1.0, 0.0),
             "sink": lambda s: (i - 1 < s).astype(float),
             "local:window=16": np.ones(n), "global:global=8": np.where(i <= 8, 1.0, 0.0)},
}
heads = {0: ["prev", "uniform", "sink"], 1: ["sink", "prev", "uniform"]}
def value(layer, head, measure, **sel):
    r = df[(df.layer == layer) & (df["head"] == head) & (df.measure == measure)]
    for c, v in sel.items():
        r = r[r[c] == v]
    check(len(r) == 1, f"{len(r)} rows of layer {layer} head {head} {measure} {sel}")
    return float(r["value"].iloc[0])
def close(got, want, what):
    check(abs(got - want) <= 1e-9, f"{what}: {got!r}, expected {want!r}")
ws = sorted(df.loc[df.measure == "window_mass", "w"].unique().astype(int))
check({1, 2, 3, 4, 16, 17, 64, 128} <= set(ws), f"window_mass written at w = {ws}")
for layer, kinds_of in heads.items():
    for head, kind in enumerate(kinds_of):
        f = kinds[kind]
        what = f"layer {layer} head {head} ({kind})"
        close(value(layer, head, "entropy"), f["entropy"].mean(), f"{what} entropy")
        close(value(layer, head, "entropy_norm"), (f["entropy"][1:] / np.log(i[1:] + 1)).mean(),
              f"{what} normalised entropy")
        curve = {}
        for w in ws:
            curve[w] = f["window"](w).mean()
            close(value(layer, head, "window_mass", w=w), curve[w], f"{what} window mass w={w}")
        full = np.array([f["window"](w).mean() for w in range(1, n + 1)])
        for m, share in (("w50", 0.5), ("w90", 0.9)):
            want = int(np.argmax(full >= share)) + 1
            check(value(layer, head, m) == want, f"{what} {m}: {value(layer, head, m)}, "
                  f"expected {want}")
        for s in (1, 4):
            close(value(layer, head, "sink_mass", s=s), f["sink"](s)[start:].mean(),
                  f"{what} sink mass s={s}")
        for spec in ("local:window=16", "global:global=8"):
            close(value(layer, head, "pattern_mass", pattern=spec), f[spec].mean(),
                  f"{what} mass inside {spec}")
# the ones the brief names: previous-token head, uniform head
close(value(0, 0, "window_mass", w=2), 1.0, "previous-token head: window mass at w = 2")
close(value(0, 0, "window_mass", w=1), 1.0 / n, "previous-token head: window mass at w = 1")
check(value(0, 0, "w50") == 2 and value(0, 0, "w90") == 2, "previous-token head: w50, w90 != 2")
close(value(0, 1, "entropy_norm"), 1.0, "uniform head: normalised entropy")
close(value(0, 1, "sink_mass", s=1), (1 / (i + 1))[start:].mean(), "uniform head: sink s=1")
dens = {p["spec"]: p for p in info["patterns"]}
pairs = n * (n + 1) / 2
close(dens["local:window=16"]["density"], np.minimum(i + 1, 17).sum() / pairs, "local density")
close(dens["global:global=8"]["density"], np.where(i < 8, i + 1, 8).sum() / pairs,
      "global density")
check(dens["local:window=16"]["window"] == 17 and dens["global:global=8"]["window"] is None,
      f"pattern windows: {dens}")
check(len(df) == 2 * 3 * (4 + len(ws) + 2 + 2), f"{len(df)} rows")
EOF
  fail "anatomy.csv does not hold the closed forms"

# The report: the sweep's local row also on the trained inputs of both layers at n = 128 (the
# context), with known mass_mean, and a row at another n that the table must not use.
"$py" - "$tmp/run/results.csv" <<'EOF'
import csv, sys
path = sys.argv[1]
rows = list(csv.DictReader(open(path)))
cols = list(rows[0])
if "mass_mean" not in cols:
    cols.append("mass_mean")
local = [r for r in rows if r["spec"].startswith("local") and r["status"] == "ok"][0]
for layer, n, mass in ((0, 128, 0.25), (0, 128, 0.75), (1, 128, 0.125), (1, 64, 0.9)):
    r = dict(local, input=f"trained:layer={layer}", n=str(n), m=str(n), mass_mean=repr(mass))
    rows.append(r)
with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
EOF
"$py" "$root/scripts/plot.py" "$tmp/run" --debug-json "$tmp/run.json" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed on results with trained/anatomy.csv"; }
! grep -q "anatomy" "$tmp/plot.err" || fail "plot.py said: $(grep anatomy "$tmp/plot.err")"
for name in anatomy_entropy anatomy_window_mass anatomy_sinks anatomy_patterns; do
  png "$tmp/run/plots/$name.png"
  grep -qF "](plots/$name.png)" "$tmp/run/report.md" || fail "report.md does not embed $name.png"
done
"$py" - "$tmp/run/report.md" "$tmp/run.json" "$tmp/run/trained/anatomy.csv" <<'EOF' ||
import json, sys
import pandas as pd
report = open(sys.argv[1], encoding="utf-8").read()
d = json.load(open(sys.argv[2]))
df = pd.read_csv(sys.argv[3])
def check(cond, what):
    if not cond:
        sys.exit(f"plot_anatomy_test: {what}")
head = "## Anatomy of a trained model's attention"
check(head in report, "report.md has no anatomy section")
check(report.index(head) > report.index("## Generation"), "the anatomy section is not after "
      "the decode section")
sec = report.split(head, 1)[1].split("\n## ", 1)[0]
def table(title):
    part = sec.split(f"### {title}", 1)
    check(len(part) == 2, f"no table '{title}'")
    lines = [l for l in part[1].split("###", 1)[0].splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return header, [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]
header, rows = table("Per layer and head")
check(header == ["layer", "head", "entropy (norm.)", "entropy (nats)", "w50", "w90", "sink s=1",
                 "sink s=4", "`local:window=16`", "`global:global=8`"], f"header {header}")
check(len(rows) == 6, f"{len(rows)} rows in the per-head table")
uniform = rows[1]  # layer 0 head 1
w = df[(df.layer == 0) & (df["head"] == 1)]
check(uniform[:4] == ["0", "1", "1.00", f"{w[w.measure == 'entropy'].value.iloc[0]:.2f}"],
      f"uniform head row {uniform}")
check(uniform[4] == str(int(w[w.measure == "w50"].value.iloc[0])) and
      uniform[5] == str(int(w[w.measure == "w90"].value.iloc[0])), f"w50/w90 cells {uniform}")
check(rows[0][4:6] == ["2", "2"], f"previous-token head: w50, w90 {rows[0][4:6]}")
header, fits = table("Which patterns fit which heads")
best = {(r[0], r[1]): r[2] for r in fits}
# the previous-token head keeps all of its mass in both; the sparser (local, 17 keys) wins
check(best[("0", "0")] == "`local:window=16`", f"best pattern of the previous-token head: {best}")
check(best[("0", "2")] == "`global:global=8`", f"best pattern of the sink head: {best}")
check("- Layer 0: the most mass is kept by " in sec and "- Layer 1: " in sec,
      "no sentence per layer")
check("head 2 puts at least 50% of the mass on the first key (sink)" in sec,
      "layer 0's sentence does not name the sink head")
check("head 0 attends mostly the previous token" in sec,
      "layer 0's sentence does not name the previous-token head")
header, swept = table("Mass kept by every pattern variant in the sweep")
check(header == ["variant", "layer 0", "layer 1"] and len(swept) == 1 and
      swept[0][1:] == ["0.500", "0.125"], f"sweep mass table {header} {swept}")
check("n = 128" in sec.split("### Mass kept", 1)[1], "sweep mass table not at n = 128")
win = d["anatomy_window_mass"]
check(win["windows"] == {"local:window=16": 17}, f"window lines {win['windows']}")
check(abs(win["lines"]["0/0"]["mass"][win["lines"]["0/0"]["w"].index(2)] - 1) < 1e-9,
      "the window figure does not draw the previous-token head's mass at w = 2")
check(len(d["anatomy_patterns"]["columns"]) == 6, "the pattern heatmap has not 6 columns")
check(abs(d["anatomy_entropy"]["values"][0][1] - 1) < 1e-9, "the entropy heatmap's uniform cell")
EOF
  fail "the report's anatomy section is not as expected"

# Results without trained/: no anatomy section, the figures of an earlier run removed.
rm -r "$tmp/run/trained"
"$py" "$root/scripts/plot.py" "$tmp/run" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed on results without trained/"; }
! grep -q "Anatomy" "$tmp/run/report.md" || fail "an anatomy section without trained/"
for name in anatomy_entropy anatomy_window_mass anatomy_sinks anatomy_patterns; do
  [ ! -e "$tmp/run/plots/$name.png" ] || fail "a stale $name.png was left"
done

# Without a binary: no pattern masses, a note, every other measure; --cache as the qkv
# directory and XDG_CACHE_HOME as the root find the same cache.
mkdir -p "$tmp/xdg" && cp -r "$tmp/cache" "$tmp/xdg/attnbench"
env -u ATTNBENCH_CACHE XDG_CACHE_HOME="$tmp/xdg" "$py" "$root/scripts/anatomy.py" \
  --out "$tmp/nobin" --attnbench "$tmp/none" 2>"$tmp/nobin.err" >/dev/null ||
  fail "anatomy.py failed without a binary: $(cat "$tmp/nobin.err")"
grep -q "no attnbench binary at $tmp/none" "$tmp/nobin.err" || fail "no note without a binary"
! grep -q pattern_mass "$tmp/nobin/trained/anatomy.csv" || fail "pattern masses without a binary"
[ ! -e "$tmp/nobin/plots/anatomy_patterns.png" ] || fail "a pattern figure without a binary"
png "$tmp/nobin/plots/anatomy_entropy.png"
anatomy --cache "$tmp/cache/trained/qkv" --out "$tmp/qkvdir" --attnbench "$tmp/none" \
  2>/dev/null >/dev/null || fail "anatomy.py failed with --cache naming the qkv directory"
cmp -s "$tmp/nobin/trained/anatomy.csv" "$tmp/qkvdir/trained/anatomy.csv" ||
  fail "the same cache found two ways gives two anatomy.csv"

# A missing or malformed cache: one line naming the path and the scripts that build it, exit 2.
expect_error() {  # expect_error PATTERN ARGS...: anatomy.py fails with exit 2 naming PATTERN
  local pattern=$1 status=0
  shift
  anatomy "$@" --out "$tmp/bad" --attnbench "$tmp/none" 2>"$tmp/bad.err" >/dev/null ||
    status=$?
  [ "$status" = 2 ] || fail "anatomy.py $*: exit status $status, expected 2"
  grep -qF "$pattern" "$tmp/bad.err" || fail "anatomy.py $*: '$(cat "$tmp/bad.err")' does not name $pattern"
  grep -q "scripts/train_lm.py .*scripts/capture_qkv.py" "$tmp/bad.err" ||
    fail "anatomy.py $*: the error does not name the scripts that build the cache"
  ! grep -q Traceback "$tmp/bad.err" || fail "anatomy.py $*: a traceback"
}
ATTNBENCH_CACHE="$tmp/nowhere" expect_error "$tmp/nowhere/trained/qkv: meta.json does not exist"
cp -r "$tmp/cache" "$tmp/broken"
"$py" -c 'import numpy as np, sys; np.savez(sys.argv[1], q=np.zeros((1, 3, 5, 8), np.float32))' \
  "$tmp/broken/trained/qkv/layer1.npz"
expect_error "layer1.npz: 'q' is float32 [1, 3, 5, 8], expected float32 [1, 3, 160, 8]" \
  --cache "$tmp/broken"
rm "$tmp/broken/trained/qkv/layer1.npz"
expect_error "layer1.npz does not exist" --cache "$tmp/broken"
echo '{"format": 1, "layers": 2}' >"$tmp/broken/trained/qkv/meta.json"
expect_error "'heads' is None" --cache "$tmp/broken"
echo '[1, 2]' >"$tmp/broken/trained/qkv/meta.json"
expect_error "meta.json' holds a JSON list; expected an object" --cache "$tmp/broken"
echo "plot_anatomy_test: ok"
