#!/usr/bin/env bash
# The report's long-context section on a real short sweep (causal, n = 2048 and 4096): moba,
# local with sinks, retention in both forms, gla without its recurrent form, and flash. Their
# rows are given known times, so the section's speed-ups over causal flash and over the
# recurrent form are checked against numbers computed here: the table lists only these specs
# (not flash, not local without sinks), at n >= 4096 only, and gives a recurrence speed-up only
# where the run holds the twin with form=recurrent. Copies of some rows on trained inputs (known
# mass and error) check the trained-input mass table. Results without these variants say so.
# A copy with known rows at several settings of local's window and moba's topk on the trained
# inputs checks the "Error against budget" section: its series, their means over the layers,
# the frontier's setting labels and the report's table (and that one setting per variant draws
# neither budget figure).
bin=$1
. "$(dirname "$0")/lib.sh" plot_modern_test

"$bin" sweep --out "$tmp/run" --variant flash --variant local:window=16 \
  --variant local:window=16,sinks=4 --variant moba:chunk=256 --variant retention \
  --variant retention:form=recurrent --variant gla --seq 2048,4096 --causal on --reps 1 \
  --min-time 0 --heads 1 --dim 16 --threads 1 --machine-file "$machine/threads-1.json" \
  2>/dev/null || fail "the sweep failed"

# Known times: flash 1 s at n = 4096; the others a fixed fraction of it.
"$py" - "$tmp/run/results.csv" <<'EOF'
import csv, sys
path = sys.argv[1]
rows = list(csv.DictReader(open(path)))
frac = {"flash": 1.0, "local": 0.5, "moba": 0.25, "retention": 0.02, "gla": 0.04}
for r in rows:
    if r["status"] != "ok":
        sys.exit(f"plot_modern_test: a row is not ok: {r['spec']} n={r['n']} {r['message']}")
    f = frac[r["variant"]]
    if "form=recurrent" in r["spec"]:
        f = 0.1
    if "sinks=4" in r["spec"]:
        f = 0.125
    t = f * (1.0 if r["n"] == "4096" else 0.25)
    for c in ("time_median_s", "time_min_s", "time_max_s"):
        r[c] = repr(t)
    r["noisy"] = "0"
# Rows on the trained model's inputs (two layers), with known masses and errors: copies of the
# n = 4096 rows of moba, local and flash (flash must stay out of the mass table).
mass = {"moba": (0.9, 0.6), "local": (0.7, 0.5), "flash": (1.0, 1.0)}
for r in [r for r in rows if r["n"] == "4096" and r["variant"] in mass
          and "form=" not in r["spec"]]:
    for layer in (0, 1):
        t = dict(r)
        t["input"] = f"trained:layer={layer}"
        m = mass[r["variant"]][layer] + (0.05 if "sinks=4" in r["spec"] else 0.0)
        t["mass_mean"] = repr(m)
        t["rel_fro_error"] = repr(round(1 - m, 4))
        rows.append(t)
with open(path, "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerows(rows)
EOF

"$py" "$root/scripts/plot.py" "$tmp/run" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed"; }
# gla ran with the seeded stand-in of its log decay g (no --inputs): the report says so, and
# names no variant that takes no learned input
stand=$(grep "^Stand-ins: " "$tmp/run/report.md" || true)
[ -n "$stand" ] || fail "the report does not say which rows ran stand-ins"
case "$stand" in *'`gla` (`g`)'*) ;; *) fail "the stand-ins line does not name gla's g: $stand" ;; esac
case "$stand" in *'`flash'* | *'`retention'*) fail "the stand-ins line names $stand" ;; esac
"$py" - "$tmp/run/report.md" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
def fail(msg):
    sys.exit(f"plot_modern_test: {msg}")
m = re.search(r"^## Long-context variants[^\n]*\n(.*?)(?=^## )", text, re.S | re.M)
if not m:
    fail("the report has no long-context section")
speed = m.group(1).split("On the trained model's inputs")[0]
rows = [l for l in speed.splitlines() if l.startswith("| `")]
cells = {tuple(c.strip() for c in l.strip("|").split("|")[:2]): [c.strip() for c in
         l.strip("|").split("|")] for l in rows}
# (label, n) -> (speed-up over flash, speed-up over the recurrence)
want = {("`moba:chunk=256`", "4096"): ("4×", ""),
        ("`local:window=16,sinks=4`", "4096"): ("8×", ""),
        ("`retention`", "4096"): ("50×", "5×"),
        ("`retention:form=recurrent`", "4096"): ("10×", ""),
        ("`gla`", "4096"): ("25×", "")}
if set(cells) != set(want):
    fail(f"the table's rows are {sorted(cells)}, expected {sorted(want)}")
for key, (flash, rec) in want.items():
    got = cells[key]
    if got[3] != flash or got[4] != rec:
        fail(f"{key}: speed-ups {got[3:5]}, expected {flash!r}, {rec!r}")
# The trained-input table: mass (error) per layer at n = 4096, the sparse variants and plain
# local only.
t = re.search(r"On the trained model's inputs \(causal, n = 4096, every layer\).*?\n\n"
              r"(\| variant \| layer 0 \| layer 1 \|\n\|[-|]+\|\n(?:\|[^\n]*\n)+)",
              m.group(1), re.S)
if not t:
    fail("the section has no trained-input mass table at n = 4096 with layers 0 and 1")
got = {l.split("|")[1].strip(): [c.strip() for c in l.strip("|").split("|")[1:]]
       for l in t.group(1).splitlines()[2:]}
want = {"`moba:chunk=256`": ["0.900 (1.00e-01)", "0.600 (4.00e-01)"],
        "`local:window=16`": ["0.700 (3.00e-01)", "0.500 (5.00e-01)"],
        "`local:window=16,sinks=4`": ["0.750 (2.50e-01)", "0.550 (4.50e-01)"]}
if got != want:
    fail(f"the trained-input table is {got}, expected {want}")
EOF

# --- error against budget ------------------------------------------------------------------
# The run above holds one setting per variant on the trained inputs: no budget series, so
# neither budget figure nor section.
for f in budget frontier; do
  [ ! -e "$tmp/run/plots/$f.png" ] || fail "$f.png drawn without budget rows"
done
! grep -q "^## Error against budget" "$tmp/run/report.md" ||
  fail "the report has a budget section without budget rows"
# A copy whose trained rows at n = 4096 gain settings with known figures on layers 0 and 1:
# local over window 8, 16, 32, 64 and moba over topk 1, 2, 3 (causal), and a non-causal local
# window series beside a non-causal flash. Each point must be the mean over the two layers.
cp -r "$tmp/run" "$tmp/budget"
"$py" - "$tmp/budget/results.csv" "$tmp/budget/want.json" <<'EOF'
import csv, json, sys
path, want_path = sys.argv[1:]
rows = list(csv.DictReader(open(path)))
def fail(msg):
    sys.exit(f"plot_modern_test: {msg}")
base = {r["variant"]: r for r in rows if r["n"] == "4096" and r["input"] == "trained:layer=0"
        and r["causal"] == "1" and "sinks=4" not in r["spec"]}
if set(base) != {"flash", "local", "moba"}:
    fail(f"the trained rows at n = 4096 are of {sorted(base)}")
new, want = [], []
def add(variant, spec, causal, layer, t, e, c):
    r = dict(base[variant])
    r.update(spec=spec, causal=str(causal), input=f"trained:layer={layer}", time_median_s=repr(t),
             time_min_s=repr(t), time_max_s=repr(t), rel_fro_error=repr(e), mean_cosine=repr(c))
    new.append(r)
# layer 1 is twice as hard as layer 0 (error) and a bit slower (time)
for causal in (1, 0):
    add("flash", base["flash"]["spec"], causal, 0, 1.0, 1e-7, 1.0)
    add("flash", base["flash"]["spec"], causal, 1, 1.2, 1e-7, 1.0)
    values = (8, 16, 32, 64) if causal else (16, 128)
    for w in values:
        e0, t0 = 0.8 * 8 / w, 0.01 * w / 8
        for layer, k in ((0, 1.0), (1, 2.0)):
            add("local", f"local:window={w},block=64", causal, layer, t0 * (1 + 0.2 * layer),
                e0 * k, 1 - e0 * k / 4)
    want.append({"variant": "local", "param": "window", "causal": causal,
                 "values": list(values),
                 "error": [0.8 * 8 / w * 1.5 for w in values],
                 "time": [0.01 * w / 8 * 1.1 for w in values],
                 "cosine": [1 - 0.8 * 8 / w * 1.5 / 4 for w in values],
                 "flash_time": 1.1})
for k in (1, 2, 3):
    for layer in (0, 1):
        add("moba", f"moba:chunk=256,topk={k},block=64", 1, layer, 0.1 * k, 0.3 / k,
            0.9 + 0.02 * k)
want.insert(1, {"variant": "moba", "param": "topk", "causal": 1, "values": [1, 2, 3],
                "error": [0.3 / k for k in (1, 2, 3)], "time": [0.1 * k for k in (1, 2, 3)],
                "cosine": [0.9 + 0.02 * k for k in (1, 2, 3)], "flash_time": 1.1})
# a row at another n and one on gaussian inputs: never budget rows
for n, inp in (("2048", "trained:layer=0"), ("4096", "gaussian")):
    r = dict(new[-1])
    r.update(spec="moba:chunk=256,topk=7,block=64", n=n, m=n, input=inp)
    new.append(r)
rows = [r for r in rows if tuple(r[c] for c in ("spec", "causal", "input", "n")) not in
        {tuple(r[c] for c in ("spec", "causal", "input", "n")) for r in new}] + new
with open(path, "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerows(rows)
json.dump(want, open(want_path, "w"))
EOF
"$py" "$root/scripts/plot.py" "$tmp/budget" --debug-json "$tmp/budget.json" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed on budget rows"; }
figures "$tmp/budget" budget frontier
"$py" - "$tmp/budget.json" "$tmp/budget/want.json" "$tmp/budget/report.md" <<'EOF'
import json, math, re, sys
got, want, report = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
def fail(msg):
    sys.exit(f"plot_modern_test: {msg}")
series = got["budget"]["series"]
keys = [(s["variant"], s["param"], s["causal"]) for s in series]
if keys != [(w["variant"], w["param"], w["causal"]) for w in want]:
    fail(f"the budget series are {keys}, expected "
         f"{[(w['variant'], w['param'], w['causal']) for w in want]}")
for s, w in zip(series, want):
    if s["values"] != w["values"] or s["layers"] != ["trained:layer=0", "trained:layer=1"]:
        fail(f"{s['label']}: values {s['values']} on {s['layers']}, expected {w['values']}")
    for c in ("error", "time", "cosine"):
        if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(s[c], w[c])):
            fail(f"{s['label']}: {c} {s[c]}, expected {w[c]} (means over layers 0 and 1)")
    if not math.isclose(s["flash_time"], w["flash_time"], rel_tol=1e-9):
        fail(f"{s['label']}: flash's time {s['flash_time']}, expected {w['flash_time']}")
# the frontier: a panel per causal setting (causal first), every setting labelled with
# parameter=value, as a label beside its point or named under the figure
fr = got["frontier"]
if [p["causal"] for p in fr["panels"]] != [1, 0]:
    fail(f"the frontier's panels are {[p['causal'] for p in fr['panels']]}, expected [1, 0]")
texts = [pt["text"] for p in fr["panels"] for s in p["series"] for pt in s["points"]]
if texts != ["window=8", "window=16", "window=32", "window=64", "topk=1", "topk=2", "topk=3",
             "window=16", "window=128"]:
    fail(f"the frontier's labels are {texts}")
missing = [f"{s['variant']} {pt['text']}" for p in fr["panels"] for s in p["series"]
           for pt in s["points"] if pt["label"] != "direct"]
if fr["legend"][:2] != ["local: window", "moba: topk (chunk=256)"] or \
        fr["legend"].count("local: window") != 1:
    fail(f"the frontier's legend {fr['legend']} does not name each series once")
if missing != fr["unlabelled"]:
    fail(f"unlabelled points {missing} are not those named under the figure {fr['unlabelled']}")
text = open(report).read()
m = re.search(r"^## Error against budget\n(.*?)(?=^## )", text, re.S | re.M)
if not m:
    fail("the report has no budget section")
if text.index("## Error against budget") < text.index("## Speed against error"):
    fail("the budget section comes before the speed against error section")
body = m.group(1)
for line in ("| `local: window` | causal | 8, 16, 32, 64 | 1.50e-01 – 1.20e+00 |",
             "| `moba: topk (chunk=256)` | causal | 1, 2, 3 | 1.00e-01 – 3.00e-01 |",
             "| `local: window` | non-causal | 16, 128 |"):
    if line not in body:
        fail(f"the budget table lacks {line!r}:\n{body}")
EOF

# Results without any of these variants: the section says so.
"$bin" sweep --out "$tmp/plain" --variant flash --seq 256 --causal on --reps 1 --min-time 0 \
  --heads 1 --dim 16 --threads 1 --machine-file "$machine/threads-1.json" 2>/dev/null ||
  fail "the second sweep failed"
"$py" "$root/scripts/plot.py" "$tmp/plain" 2>/dev/null || fail "plot.py failed on plain results"
grep -q "No causal forward rows of these variants" "$tmp/plain/report.md" ||
  fail "the section does not say that the results hold none of its variants"
echo "plot_modern_test: ok"
