#!/usr/bin/env bash
# Two real short sweeps. The first must store its patterns (patterns/index.csv and the .npy
# files, the masks `attnbench pattern` exports); scripts/plot.py on it must write every figure
# and a report with every section without running any attnbench binary, drawing the pattern
# gallery from the stored files (and saying so when there are none); scripts/compare.py on both
# must join, flag and list rows; and both scripts must refuse unusable results directories
# with one line on stderr and exit code 2.
bin=$1
. "$(dirname "$0")/lib.sh" plot_test

common=(--seq 128,256,512 --causal both --heads 2 --dim 32 --reps 2 --min-time 0.002
  --machine-file "$machine/threads-all.json")
"$bin" sweep --out "$tmp/a" --variant full --variant flash --variant local:window=32 \
  --variant linear "${common[@]}" 2>/dev/null
"$bin" sweep --out "$tmp/b" --variant full --variant flash "${common[@]}" 2>/dev/null

# --- the patterns the sweep stored ------------------------------------------------------------
# One per (spec, causal) at the measured length nearest 1024 (512 here): local's two files, the
# others listed as having no pattern; each file is what `attnbench pattern` exports.
index="$tmp/a/patterns/index.csv"
[ -s "$index" ] || fail "the sweep wrote no $index"
"$py" - "$tmp/a" "$bin" "$tmp" <<'EOF'
import csv, os, subprocess, sys
import numpy as np
out, binary, tmp = sys.argv[1:]
def fail(msg):
    sys.exit(f"plot_test: {msg}")
rows = list(csv.DictReader(open(os.path.join(out, "patterns", "index.csv"))))
results = {tuple(r[c] for c in ("spec", "n", "causal", "input")): r
           for r in csv.DictReader(open(os.path.join(out, "results.csv")))}
groups = sorted((r["spec"], r["causal"]) for r in rows)
specs = ["flash:block_q=64,block_k=256", "full", "linear:eps=1e-06", "local:window=32,block=64"]
if groups != sorted((s, c) for s in specs for c in "01"):
    fail(f"index.csv does not hold one entry per spec and causal setting: {groups}")
files = sorted(f for f in os.listdir(os.path.join(out, "patterns")) if f.endswith(".npy"))
if files != sorted(r["file"] for r in rows if r["file"]) or len(files) != 2:
    fail(f"the .npy files {files} are not local's two, the ones index.csv lists")
for r in rows:
    if r["n"] != "512" or r["input"] != "gaussian":
        fail(f"a stored pattern is not at n=512 with gaussian inputs: {r}")
    row = results.get((r["spec"], r["n"], r["causal"], r["input"]))
    if row is None or row["status"] != "ok":
        fail(f"index.csv names a row that is not an ok row of results.csv: {r}")
    if not r["spec"].startswith("local"):
        if r["file"] or r["message"] != "no attention pattern":
            fail(f"{r['spec']} is not listed as having no attention pattern: {r}")
        continue
    ref = os.path.join(tmp, "ref.npy")
    cmd = [binary, "pattern", "--variant", r["spec"], "--seq", r["n"], "--dim", r["dim"],
           "--seed", r["seed"], "--input", r["input"], "--output", ref]
    if r["causal"] == "1":
        cmd.append("--causal")
    subprocess.run(cmd, check=True, capture_output=True)
    stored = np.load(os.path.join(out, "patterns", r["file"]))
    if stored.dtype != np.uint8 or not np.array_equal(stored, np.load(ref)):
        fail(f"{r['file']} differs from `attnbench pattern` on the same problem")
EOF

# --- plot.py -----------------------------------------------------------------------------------
# plot.py runs no binary: it runs from a copy of scripts/ whose repository has a build/attnbench
# that records any call, with the same stand-in first on PATH.
repo="$tmp/repo"
mkdir -p "$repo/build" "$tmp/fakebin"
cp -r "$root/scripts" "$repo/scripts"
printf '#!/bin/sh\ntouch "%s/binary-was-run"\nexit 1\n' "$tmp" >"$repo/build/attnbench"
chmod +x "$repo/build/attnbench"
cp "$repo/build/attnbench" "$tmp/fakebin/attnbench"
plot() { PATH="$tmp/fakebin:/usr/bin:/bin" "$py" "$repo/scripts/plot.py" "$@"; }
plot "$tmp/a" --debug-json "$tmp/a.json" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed on a real sweep"; }
[ ! -e "$tmp/binary-was-run" ] || fail "plot.py ran an attnbench binary"
figures "$tmp/a" time_vs_n memory_vs_n error_vs_n speed_vs_error crossover patterns
# a forward-only sweep: no training or generation figures, and the report says why
[ "$(ls "$tmp/a/plots" | wc -l)" -eq 6 ] || fail "plot.py drew more than six figures: $(ls "$tmp/a/plots")"
grep -qF "No training rows" "$tmp/a/report.md" || fail "report.md: no word on training rows"
grep -qF "No ok causal decode rows" "$tmp/a/report.md" || fail "report.md: no word on decode rows"
report="$tmp/a/report.md"
for section in "## Run" "## Time against sequence length" "## Peak memory against sequence length" \
  "## Error against sequence length" "## Speed against error at n = 512" "## Crossover lengths" \
  "## Efficiency relative to full (Long Range Arena style)" "## Attention patterns" \
  "## Rows not plotted"; do
  grep -qF -- "$section" "$report" || fail "report.md lacks the section '$section'"
done
commit=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["git_commit"])' \
  "$tmp/a/meta.json")
grep -qF "$commit" "$report" || fail "report.md does not name the commit $commit"
# every variant in the time table, the pattern variant in the gallery, the others named as
# having no pattern (on stderr too)
for spec in full "flash:block_q=64,block_k=256" "local:window=32,block=64" "linear:eps=1e-06"; do
  grep -qF "| \`$spec\` |" "$report" || fail "report.md has no table row for $spec"
done
grep -q "no attention pattern.*\`linear:eps=1e-06\`" "$report" ||
  fail "report.md does not say that linear has no attention pattern"
grep -q "^One head (head 0) of each pattern variant at n = 512, as the sweep measured it" \
  "$report" || fail "report.md does not describe the pattern gallery"
grep -q "no attention pattern.*local:window" "$report" "$tmp/plot.err" &&
  fail "local is said to have no attention pattern"
grep -q "no attention pattern.*linear" "$tmp/plot.err" ||
  fail "plot.py did not say on stderr that linear has no attention pattern"
"$py" - "$tmp/a.json" "$tmp/a/patterns" <<'EOF' || fail "the gallery does not draw local's files"
import json, os, sys
import numpy as np
tiles = json.load(open(sys.argv[1]))["patterns"]["tiles"]
stored = sorted(f for f in os.listdir(sys.argv[2]) if f.endswith(".npy"))
means = sorted(float(np.load(os.path.join(sys.argv[2], f)).mean()) for f in stored)
assert [t["spec"] for t in tiles] == ["local:window=32,block=64"] * 2, tiles
assert sorted(t["causal"] for t in tiles) == [0, 1], tiles
assert sorted(t["attended"] for t in tiles) == means and max(means) < 1, (tiles, means)
EOF
# the efficiency table: full is 1.00x of itself; lengths not measured are dashes
grep -qE '^\| `full` \| — \| — \| — \| — \|' "$report" ||
  fail "the efficiency table does not show '—' for full at lengths that were not measured"

# The checks below run on a copy holding only the rows at n=512 of full, local and linear
# (fewer lines to draw; full keeps the crossover figure); flash's two entries in its index name
# no row of it, which plot.py says. The gallery is drawn from the stored files: local's causal
# file becomes a mask of ones, drawn 100% attended; its non-causal file a float [3, 3] array,
# named as unusable while the other is drawn. (With --attnbench, which plot.py runs only when
# meta.json does not describe a variant of the results: here it describes them all, so a binary
# that does not exist goes unmentioned.)
p="$tmp/p"
cp -r "$tmp/a" "$p"
read -r ones_file bad_file < <("$py" - "$p" <<'EOF'
import csv, os, sys
import numpy as np
d = sys.argv[1]
rows = [r for r in csv.DictReader(open(os.path.join(d, "results.csv")))
        if r["n"] == "512" and r["spec"].split(":")[0] in ("full", "local", "linear")]
with open(os.path.join(d, "results.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
local = {r["causal"]: r["file"] for r in csv.DictReader(open(os.path.join(d, "patterns", "index.csv")))
         if r["spec"].startswith("local") and r["file"]}
ones, bad = (os.path.join(d, "patterns", local[c]) for c in ("1", "0"))
np.save(ones, np.ones_like(np.load(ones)))
np.save(bad, np.ones((3, 3)))
print(os.path.basename(ones), os.path.basename(bad))
EOF
)
[ -n "$bad_file" ] || fail "cannot find local's two pattern files in $index"
plot "$p" --attnbench "$tmp/no_such_attnbench" --debug-json "$tmp/p.json" 2>"$tmp/p.err" ||
  { cat "$tmp/p.err" >&2; fail "plot.py failed on a subset with changed pattern files"; }
grep -q "index.csv lists 2 pattern(s) whose row is not an ok row of results.csv" "$tmp/p.err" ||
  fail "no stderr message about index entries without their row: $(cat "$tmp/p.err")"
! grep -q "no_such_attnbench" "$tmp/p.err" ||
  fail "plot.py looked for a binary although meta.json describes every variant"
grep -q "stored pattern of local:window=32,block=64 .*is unusable.*$bad_file" "$tmp/p.err" ||
  fail "no stderr message naming the unusable pattern file: $(cat "$tmp/p.err")"
"$py" - "$tmp/p.json" <<'EOF' || fail "the gallery does not draw the stored files"
import json, sys
tiles = json.load(open(sys.argv[1]))["patterns"]["tiles"]
want = [{"spec": "local:window=32,block=64", "causal": 1, "n": 512, "shape": [512, 512],
         "attended": 1.0}]
assert tiles == want, tiles
EOF
png "$p/plots/patterns.png"

# --- what the figures draw (plot.py --debug-json) -------------------------------------------
# A copy of the first sweep with known timings, errors and memory: local noisy at n=128
# (non-causal), linear's peak memory equal to local's, local and linear crossing flash at the
# same n, linear's error above the zero output's at n=512, the uniform average's error 0.9 on
# every row, and the non-causal rows again as three more input distributions (five error panels).
f="$tmp/f"
cp -r "$tmp/a" "$f"
"$py" - "$f/results.csv" <<'EOF'
import csv, sys
path = sys.argv[1]
rows = [r for r in csv.DictReader(open(path)) if r["status"] == "ok"]
def is_(r, name):
    return r["spec"].split(":")[0] == name
def at(name, n, causal):
    return next(r for r in rows if is_(r, name) and r["n"] == str(n) and r["causal"] == causal
                and r["input"] == "gaussian")
for r in rows:
    r["uniform_error"] = "0.9"
    r["noisy"] = "0"
    r["time_spread"] = repr(float(r["time_max_s"]) / float(r["time_min_s"]))
for causal in "01":
    for n, ratio in ((128, 2.0), (256, 0.5), (512, 0.25)):
        t = float(at("flash", n, causal)["time_median_s"])
        for name in ("local", "linear"):
            r = at(name, n, causal)
            r["time_median_s"] = repr(t * ratio)
            r["time_min_s"] = repr(t * ratio * 0.99)
            r["time_max_s"] = repr(t * ratio * 1.01)
            r["time_spread"] = repr(1.01 / 0.99)
            if not at("local", n, causal)["peak_bytes"]:  # not measured (a sanitizer build)
                at("local", n, causal)["peak_bytes"] = str(4096 * n)
            at("linear", n, causal)["peak_bytes"] = at("local", n, causal)["peak_bytes"]
noisy = at("local", 128, "0")
noisy["noisy"] = "1"
noisy["time_max_s"] = repr(3 * float(noisy["time_min_s"]))
noisy["time_spread"] = repr(3.0)
at("linear", 512, "0")["rel_fro_error"] = "2.0"
extra = [dict(r, input=inp) for inp in ("local", "clustered", "lowrank") for r in rows
         if r["causal"] == "0" and r["input"] == "gaussian"]
with open(path, "w", newline="") as out:
    w = csv.DictWriter(out, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows + extra)
EOF
plot "$f" --debug-json "$tmp/f.json" 2>"$tmp/f.err" ||
  { cat "$tmp/f.err" >&2; fail "plot.py failed on the changed results"; }
"$py" - "$tmp/f.json" "$f/report.md" <<'EOF' || fail "the figures do not draw what they should"
import json, math, sys
d = json.load(open(sys.argv[1]))
report = open(sys.argv[2], encoding="utf-8").read()
LOCAL, LINEAR = "local:window=32,block=64", "linear:eps=1e-06"
FLASH, FULL = "flash:block_q=64,block_k=256", "full"
def check(ok, what):
    if not ok:
        sys.exit(f"plot_test: {what}")
# time: min-max bars around every point; local's noisy point hollow and said in the legend
t = d["time_vs_n"]
for p in t["panels"]:
    for line in p["lines"]:
        check(all(lo <= y <= hi for lo, y, hi in zip(line["lo"], line["y"], line["hi"])),
              f"time_vs_n: a bar does not span its point: {line}")
        want = [128.0] if line["spec"] == LOCAL and p["title"].startswith("non-causal") else []
        check(line["noisy_n"] == want, f"time_vs_n: noisy points {line['noisy_n']} of "
              f"{line['spec']} in {p['title']}, expected {want}")
check("hollow: noisy row" in t["legend"] and "bar: min–max of repetitions" in t["legend"],
      f"time_vs_n: the legend does not explain bars and hollow points: {t['legend']}")
# memory: local and linear coincide, are drawn apart, and the legend says so
m = d["memory_vs_n"]
for p in m["panels"]:
    check(any({LOCAL, LINEAR} <= set(g["specs"]) for g in p["coinciding"]),
          f"memory_vs_n: local and linear are not found to coincide in {p['title']}")
    xs = {l["spec"]: l["x"] for l in p["lines"]}
    check(all(a != b for a, b in zip(xs[LOCAL], xs[LINEAR])),
          f"memory_vs_n: coinciding lines drawn at the same n in {p['title']}")
check(any("local:window=32" in e and " = linear" in e for e in m["legend"]),
      f"memory_vs_n: the legend does not name the coinciding lines: {m['legend']}")
# error: a panel per input and causal setting with rows, none empty, the legend in the spare
# cell; the zero output and the uniform average in each; the y range holds all of them
e = d["error_vs_n"]
titles = sorted(p["title"].split(",")[0] + "," + p["title"].split(",")[1] for p in e["panels"])
check(len(e["panels"]) == 5, f"error_vs_n: {len(e['panels'])} panels, expected 5: {titles}")
check(all(p["lines"] for p in e["panels"]), "error_vs_n: an empty panel")
check(e["grid"] == {"columns": 3, "cells": 6, "legend_in_grid": True},
      f"error_vs_n: grid {e['grid']}, expected 3 columns with the legend in the sixth cell")
for p in e["panels"]:
    check(p["zero_output"] == 1.0, f"error_vs_n: no zero-output line in {p['title']}")
    check(p["uniform"] and p["uniform"]["y"] == [0.9] * 3,
          f"error_vs_n: no uniform-average line at 0.9 in {p['title']}: {p['uniform']}")
ys = [y for p in e["panels"] for l in p["lines"] for y in l["y"]]
lo, hi = e["ylim"]
check(lo <= min(ys) and hi >= 2.0 and lo >= min(ys) / 4 and hi <= max(ys + [1.0]) * 4,
      f"error_vs_n: y range {e['ylim']} is not the data's ({min(ys)}..{max(ys)}) and 1")
check("zero output (error 1)" in e["legend"], "error_vs_n: no zero output in the legend")
# speed against error at n=512: the front only through points below 0.9; linear (error 2)
# pale; every point labelled next to it or named in the legend
s = d["speed_vs_error"]
check(s["n"] == 512, f"speed_vs_error at n={s['n']}")
for p in s["panels"]:
    check(p["uniform"] == 0.9, f"speed_vs_error: uniform average {p['uniform']}")
    for pt in p["points"]:
        check(pt["beats"] == (pt["error"] < 0.9), f"speed_vs_error: wrong 'beats' for {pt}")
        check(not pt["on_front"] or pt["beats"], f"speed_vs_error: {pt} on the front")
        check(pt["label"] == "direct" or pt["text"] in s["legend"],
              f"speed_vs_error: {pt['spec']} neither labelled nor in the legend")
    check(p["front"], f"speed_vs_error: no front in {p['title']}")
check(any(pt["spec"] == LINEAR and not pt["beats"] for pt in s["panels"][0]["points"]),
      "speed_vs_error: linear with error 2 beats the zero output")
# crossover: no baseline against itself; local and linear cross flash at the same n, their
# marks are not drawn over each other
c = d["crossover"]
for p in c["panels"]:
    check(p["baseline"] not in [l["spec"] for l in p["lines"]],
          f"crossover: {p['baseline']} drawn against itself in {p['title']}")
    if p["title"].startswith("vs flash: causal"):  # local's noisy n=128 is non-causal
        marks = {mk["spec"]: mk for mk in p["marks"]}
        check(LOCAL in marks and LINEAR in marks, f"crossover: marks {p['marks']}")
        a, b = marks[LOCAL], marks[LINEAR]
        check(abs(math.log(a["n"] / b["n"])) < 1e-9 and a["y"] != b["y"],
              f"crossover: the marks of local and linear pile up: {a} {b}")
# report: spread and † in the time table, the footnote, statements from the data
check("| `local:window=32,block=64` | " in report and " ×3.00 †" in report,
      "report.md: the time table does not mark local's noisy row with its spread")
check("† noisy: the repetitions of this row spread" in report, "report.md: no † footnote")
check("slower again" not in report, "report.md still states a contradiction")
check("≈ 181: faster from there on" in report,
      "report.md: no crossover statement for linear vs flash at n ≈ 181")
check("judged at n = 256, 512; noisy, not judged: 128 †" in report,
      "report.md: local's noisy length is judged")
EOF
# Results without the uniform_error column (an older sweep) draw the zero output only; with
# several scales of the timed input (the default sweep's sharpened gaussian rows) time, memory
# and crossover show scale 1 only (or --scale), speed against error a panel per scale. On a
# copy of the first sweep's non-causal rows (fewer panels to draw).
g="$tmp/g"
cp -r "$tmp/a" "$g"
"$py" - "$g/results.csv" <<'EOF'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["causal"] == "0"]
cols = [c for c in rows[0] if c != "uniform_error"]
extra = [dict(r, scale="4") for r in rows]
with open(sys.argv[1], "w", newline="") as out:
    w = csv.DictWriter(out, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows + extra)
EOF
# --pattern-n picks among the stored lengths, and says which there are (g holds a's figures,
# patterns.png among them).
plot "$g" --pattern-n 128 --debug-json "$tmp/g.json" 2>"$tmp/len.err" ||
  fail "plot.py failed without uniform_error, with two scales and --pattern-n 128"
grep -q "no stored pattern has n=128 (stored lengths: 512)" "$tmp/len.err" ||
  fail "no stderr message about --pattern-n 128: $(cat "$tmp/len.err")"
[ ! -e "$g/plots/patterns.png" ] || fail "a stale patterns.png was left in place"
"$py" - "$tmp/g.json" <<'EOF' || fail "the figures without uniform_error or of two scales are wrong"
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["error_vs_n"]["panels"]:
    assert p["zero_output"] == 1.0 and p["uniform"] is None, p
assert "zero output (error 1)" in d["error_vs_n"]["legend"]
assert all(p["uniform"] is None for p in d["speed_vs_error"]["panels"])
assert any(p["front"] for p in d["speed_vs_error"]["panels"])
for fig in ("time_vs_n", "memory_vs_n", "crossover"):
    titles = [p["title"] for p in d[fig]["panels"]]
    assert titles and all("scale=1" in t for t in titles), (fig, titles)
titles = [p["title"] for p in d["speed_vs_error"]["panels"]]
assert any("scale=4" in t for t in titles) and any("scale=1" in t for t in titles), titles
EOF
# Results without stored patterns (an older sweep): the gallery is missing, the report and
# stderr say why, and every other figure is drawn (here at --scale 4).
rm -r "$g/patterns"
cp "$tmp/a/plots/patterns.png" "$g/plots/patterns.png"
plot "$g" --scale 4 --debug-json "$tmp/g.json" 2>"$tmp/nopat.err" ||
  fail "plot.py --scale 4 failed on results without patterns"
grep -q "patterns/index.csv does not exist" "$tmp/nopat.err" ||
  fail "no stderr message about the missing patterns"
grep -q "No pattern gallery: these results hold no stored patterns" "$g/report.md" ||
  fail "report.md does not say the pattern gallery is missing"
[ ! -e "$g/plots/patterns.png" ] || fail "a stale patterns.png was left in place"
for name in time_vs_n memory_vs_n error_vs_n speed_vs_error crossover; do
  [ -s "$g/plots/$name.png" ] || fail "$name.png is missing for results without patterns"
done
[ ! -e "$tmp/binary-was-run" ] || fail "plot.py ran an attnbench binary"
"$py" -c 'import json, sys
d = json.load(open(sys.argv[1]))
t = [p["title"] for p in d["time_vs_n"]["panels"]]
assert t and all("scale=4" in x for x in t), t' "$tmp/g.json" || fail "--scale 4 not drawn"
if plot "$g" --scale 3 2>"$tmp/s.err"; then fail "plot.py --scale 3 succeeded"; fi
grep -q "present: 1, 4" "$tmp/s.err" || fail "--scale 3's error does not list the scales"

# The crossover statements on their own: every case, noisy lengths left out.
PYTHONPATH="$root/scripts" "$py" - <<'EOF' || fail "crossover statements are wrong"
from attnbench_plots.crossover import Crossing
def says(ns, ratio, bad, text):
    got = Crossing(ns, ratio, bad).text()
    assert got == text, (got, text)
n = [256, 512, 1024, 2048]
says(n, [0.5, 0.5, 0.5, 0.5], None, "faster at every n (256–2K)")
says(n, [2, 2, 2, 2], None, "never in range (256–2K)")
says(n, [2, 0.5, 0.5, 0.5], None, "≈ 362: faster from there on (256–2K)")
says(n, [2, 0.5, 2, 0.5], None, "faster only at n ∈ {512, 2K} (256–2K)")
says(n, [2, 0.5, 2, 0.5], [0, 0, 1, 0],
     "≈ 362: faster from there on (judged at n = 256, 512, 2K; noisy, not judged: 1K †)")
says(n, [0.5, 0.5, 2, 0.5], [0, 0, 1, 0],
     "faster at every judged n (judged at n = 256, 512, 2K; noisy, not judged: 1K †)")
says(n[:2], [0.5, 2], [1, 1], "— (noisy at every n: 256, 512 †)")
says([], [], None, "— (no common n)")
EOF

# --- compare.py --------------------------------------------------------------------------------
"$py" "$root/scripts/compare.py" "$tmp/a" "$tmp/b" >"$tmp/cmp.txt" || fail "compare.py failed"
cat "$tmp/cmp.txt"
grep -q "B/A" "$tmp/cmp.txt" || fail "compare.py printed no table"
grep -q "^12 row(s) compared" "$tmp/cmp.txt" || fail "compare.py did not compare the 12 common rows"
grep -q "^Only in A (12):" "$tmp/cmp.txt" || fail "compare.py did not list the 12 rows only in A"
grep -q "^  linear:eps=1e-06 n=512,causal=1 (ok)" "$tmp/cmp.txt" ||
  fail "compare.py did not list linear at n=512 as only in A"
# B made slower by more than its own spread (every time times k, k at least twice the largest
# max/min ratio of any row): every row is flagged, and --fail-on-regression exits 1.
# The rows of "quiet" are b's marked not noisy (b itself may have been measured on a busy
# machine); "slow" also has its machine's GEMM rate divided by k, as a machine k times slower
# would measure it.
cp -r "$tmp/b" "$tmp/slow"
cp -r "$tmp/b" "$tmp/quiet"
"$py" - "$tmp/slow" "$tmp/quiet" <<'EOF'
import csv, json, sys
slow, quiet = sys.argv[1], sys.argv[2]
rows = list(csv.DictReader(open(slow + "/results.csv")))
k = max(3.0, 2 * max(float(r["time_max_s"]) / float(r["time_min_s"]) for r in rows))
def write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
for r in rows:
    r["noisy"] = "0"
write(quiet + "/results.csv", rows)
for r in rows:
    for c in ("time_median_s", "time_min_s", "time_max_s"):
        r[c] = repr(k * float(r[c]))
write(slow + "/results.csv", rows)
meta = json.load(open(slow + "/meta.json"))
meta["machine"]["gemm_gflops"] /= k
json.dump(meta, open(slow + "/meta.json", "w"))
# one row of slow marked noisy
rows[0]["noisy"] = "1"
write(slow + "/noisy.csv", rows)
EOF
"$py" "$root/scripts/compare.py" "$tmp/quiet" "$tmp/slow" >"$tmp/slow.txt" 2>"$tmp/slow.err" ||
  fail "compare.py failed"
[ "$(grep -c ' slower$' "$tmp/slow.txt")" -eq 12 ] || fail "not every slower row is flagged"
grep -q "^12 row(s) compared: 12 slower" "$tmp/slow.txt" || fail "wrong summary for slower rows"
grep -q "machine: GEMM .* GFLOP/s, bandwidth" "$tmp/slow.txt" ||
  fail "compare.py does not show the runs' machine figures"
grep -q "warning: the two runs measured GEMM rates" "$tmp/slow.err" ||
  fail "compare.py does not warn that the GEMM rates differ"
set +e
"$py" "$root/scripts/compare.py" --fail-on-regression "$tmp/quiet" "$tmp/slow" >/dev/null 2>&1
rc=$?
"$py" "$root/scripts/compare.py" --fail-on-regression "$tmp/slow" "$tmp/quiet" >/dev/null 2>&1
rc_faster=$?
set -e
[ "$rc" -eq 1 ] || fail "--fail-on-regression exited $rc on a regression, expected 1"
[ "$rc_faster" -eq 0 ] || fail "--fail-on-regression exited $rc_faster on a speed-up, expected 0"
# normalised by the GEMM rates, the k-times slower machine is no regression
"$py" "$root/scripts/compare.py" --normalize gemm --fail-on-regression "$tmp/quiet" "$tmp/slow" \
  >"$tmp/norm.txt" || fail "compare.py --normalize gemm called the slower machine a regression"
grep -q "^12 row(s) compared: 0 slower and 0 faster" "$tmp/norm.txt" ||
  fail "compare.py --normalize gemm: $(grep 'row(s) compared' "$tmp/norm.txt")"
# a noisy row is never called a regression
mv "$tmp/slow/noisy.csv" "$tmp/slow/results.csv"
"$py" "$root/scripts/compare.py" "$tmp/quiet" "$tmp/slow" >"$tmp/noisy.txt" ||
  fail "compare.py failed"
[ "$(grep -c ' slower$' "$tmp/noisy.txt")" -eq 11 ] || fail "a noisy row was judged"
[ "$(grep -c ' noisy$' "$tmp/noisy.txt")" -eq 1 ] || fail "the noisy row is not marked"
grep -q "1 noisy in either run (not judged)" "$tmp/noisy.txt" || fail "no noisy count"
# Two runs at different thread counts: nothing matches, and compare.py says why and how to
# match them; --ignore threads compares them row by row. --min-change defaults to the runs'
# typical spread: B = A x (1 + half of it), spans made disjoint, is within it; with
# --min-change 0 the spans alone judge it slower.
cp -r "$tmp/b" "$tmp/t1"
cp -r "$tmp/b" "$tmp/close"
"$py" - "$tmp/quiet" "$tmp/t1" "$tmp/close" <<'EOF'
import csv, statistics, sys
quiet, t1, close = sys.argv[1:]
rows = list(csv.DictReader(open(quiet + "/results.csv")))
def write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
write(t1 + "/results.csv", [dict(r, threads="7") for r in rows])
# every row of A spans +-10% of its median, of B +-1% of A's x 1.15: typical spreads 0.2 and
# 0.02, so --min-change defaults to 0.2 and 15% is within it, though the spans are disjoint
a, b = [], []
for r in rows:
    t = float(r["time_median_s"])
    a.append(dict(r, time_median_s=repr(t), time_min_s=repr(0.9 * t), time_max_s=repr(1.1 * t),
                  reps="5"))
    b.append(dict(r, time_median_s=repr(1.15 * t), time_min_s=repr(1.15 * 0.99 * t),
                  time_max_s=repr(1.15 * 1.01 * t), reps="5"))
write(quiet + "/spread.csv", a)
write(close + "/results.csv", b)
EOF
"$py" "$root/scripts/compare.py" "$tmp/quiet" "$tmp/t1" >"$tmp/t1.txt" || fail "compare.py failed"
grep -q "^No row is measured (status ok) in both runs: 12 row(s) are in A only and 12 in B only; 12 differ from a row of the other run only in threads (A: [0-9]*; B: 7): --ignore threads compares them across it.$" "$tmp/t1.txt" ||
  { cat "$tmp/t1.txt"; fail "compare.py does not say that threads keeps the runs apart"; }
"$py" "$root/scripts/compare.py" --ignore threads "$tmp/quiet" "$tmp/t1" >"$tmp/t1.txt" ||
  fail "compare.py --ignore threads failed"
grep -q "^12 row(s) compared" "$tmp/t1.txt" || fail "--ignore threads did not join the rows"
[ "$(grep -c ' [0-9]*->7 ' "$tmp/t1.txt")" -eq 12 ] || fail "--ignore threads does not show A's and B's threads"
rc=0
"$py" "$root/scripts/compare.py" --ignore thread "$tmp/quiet" "$tmp/t1" >/dev/null 2>"$tmp/t1.err" || rc=$?
[ "$rc" -eq 2 ] && grep -q "error: --ignore thread: not a problem column (did you mean threads?)" \
  "$tmp/t1.err" || fail "--ignore thread: exit $rc, $(cat "$tmp/t1.err")"
mv "$tmp/quiet/spread.csv" "$tmp/quiet/results.csv"
"$py" "$root/scripts/compare.py" "$tmp/quiet" "$tmp/close" >"$tmp/close.txt" || fail "compare.py failed"
grep -q "^--min-change 0.200: the runs' typical spread" "$tmp/close.txt" ||
  fail "--min-change does not default to the typical spread: $(grep min-change "$tmp/close.txt")"
grep -q "^12 row(s) compared: 0 slower and 0 faster beyond the measured spread, 12 within it" \
  "$tmp/close.txt" || fail "a change within the typical spread was judged"
"$py" "$root/scripts/compare.py" --min-change 0 "$tmp/quiet" "$tmp/close" >"$tmp/close.txt" ||
  fail "compare.py failed"
grep -q "^12 row(s) compared: 12 slower" "$tmp/close.txt" || fail "--min-change 0 did not judge by the spans"

# --- unusable results directories --------------------------------------------------------------
mkdir "$tmp/empty" "$tmp/header" "$tmp/nocol" "$tmp/nook"
head -1 "$tmp/a/results.csv" >"$tmp/header/results.csv"
# drop the rel_fro_error column
"$py" - "$tmp/a/results.csv" "$tmp/nocol/results.csv" "$tmp/nook/results.csv" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
cols = [c for c in rows[0] if c != "rel_fro_error"]
with open(sys.argv[2], "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
with open(sys.argv[3], "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(dict(r, status="error", message="boom") for r in rows)
EOF
# Every check of the shared loader (attnbench_results.load_results, which both scripts call
# first) in one process: each message names what is wrong. Then each script on one of the
# directories: exit code 2 and that one line on stderr, no traceback.
PYTHONPATH="$root/scripts" "$py" - "$tmp" <<'EOF' || fail "an unusable directory is not refused"
import sys
from attnbench_results import ResultsError, load_results
tmp = sys.argv[1]
for name, text in (("missing", "is not a directory"), ("empty", "results.csv' does not exist"),
                   ("header", "has a header but no rows"),
                   ("nocol", "lacks the column(s) rel_fro_error"), ("nook", "no row with status ok")):
    try:
        load_results(f"{tmp}/{name}")
    except ResultsError as e:
        assert text in str(e), (name, str(e))
    else:
        sys.exit(f"plot_test: load_results accepted {tmp}/{name}")
EOF
refused() {  # script, text the message must hold, arguments
  local script=$1 text=$2 rc=0
  shift 2
  "$py" "$root/scripts/$script" "$@" >"$tmp/out.txt" 2>"$tmp/err.txt" || rc=$?
  [ "$rc" -eq 2 ] || fail "$script $* exited $rc, expected 2"
  grep -q "Traceback" "$tmp/err.txt" && fail "$script $* printed a traceback"
  [ "$(wc -l <"$tmp/err.txt")" -eq 1 ] || fail "$script $*: expected one line on stderr"
  grep -q "^$script: error: .*$text" "$tmp/err.txt" ||
    fail "$script $*: message lacks '$text': $(cat "$tmp/err.txt")"
}
# --- the multi-head layer section ---------------------------------------------------------------
# layer rows (sweep --embed) get their figure, their time and share tables, and the length at
# which local makes the layer twice as fast as with full (or a plain "not in range")
"$bin" sweep --out "$tmp/layer" --variant full --variant local:window=8,block=8 --embed 32 \
  --heads 2 --seq 64,128,256 --reps 1 --min-time 0 --threads 1 \
  --machine-file "$machine/threads-1.json" 2>/dev/null
plot "$tmp/layer" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed on layer rows"; }
layer_report="$tmp/layer/report.md"
[ -s "$tmp/layer/plots/layer.png" ] || fail "plot.py drew no layer.png for layer rows"
for text in "## Multi-head layer" "](plots/layer.png)" "E=32, layer time:" \
  "E=32, attention share:" "| variant | layer 2× faster than full |"; do
  grep -qF -- "$text" "$layer_report" || fail "the layer section lacks '$text'"
done
twice='(≈ [0-9,]+: 2× faster from there on|2× faster (at every|only at)|never in range|— \(noisy)'
grep -qE '^\| `local:window=8,block=8` \| '"$twice" "$layer_report" ||
  fail "the layer section gives local no length at which the layer is twice as fast"
grep -qF "No multi-head layer rows" "$report" || fail "report.md without layer rows says nothing"

# --- one look per variant, whatever else a run holds ------------------------------------------
PYTHONPATH="$root/scripts" "$py" - "$tmp/a/meta.json" <<'EOF' || fail "styles are not stable"
import json, sys
from attnbench_plots.style import Styles
variants = json.load(open(sys.argv[1]))["variants"]
a = Styles(["full", "local:window=64,block=64", "linear:eps=1e-06"], variants)
b = Styles(["performer:features=64,orthogonal=true,kernel=softmax", "linear:eps=1e-06", "full", "plugin_x"], variants)
for spec in ("full", "linear:eps=1e-06"):
    assert a(spec) == b(spec), (spec, a(spec), b(spec))
assert b("plugin_x") == Styles(["plugin_x"])("plugin_x")
# the family sets the line style; another setting of a variant keeps its colour, not its marker
assert a("full")["linestyle"] != a("local:window=64,block=64")["linestyle"]
other = a("local:window=8,block=8")
assert other["color"] == a("local:window=64,block=64")["color"]
assert other["marker"] != a("local:window=64,block=64")["marker"]
# short labels: the parameters that differ from the defaults
assert a.label("local:window=256,block=64") == "local", a.label("local:window=256,block=64")
assert a.label("local:window=8,block=8") == "local:window=8,block=8"
assert a.label("linear:eps=1e-06") == "linear"
assert Styles(["x:a=1"]).label("x:a=1") == "x:a=1"
EOF

refused plot.py "lacks the column(s) rel_fro_error" "$tmp/nocol"
refused compare.py "no row with status ok" "$tmp/a" "$tmp/nook"
echo "plot_test: ok"
