#!/usr/bin/env bash
# The report's Quality section on known numbers: a real short sweep (--pass fwd,fwdbwd,decode,
# causal, n = 256) whose rows are given known times and decode states, beside hand-written
# DIR/quality/recall.csv and lm.csv. The section must stand after the run header and before the
# speed sections, give each variant's recall accuracy as mean ± sd (seeds), the reason of an
# unsupported row, Δ bits per byte before and after uptraining, the speed over flash of every
# pass at the recall and language length, and draw recall_throughput.png from the same numbers;
# the error section below it is labelled a stress test of the input distribution. Broken
# quality files are notes, not failures, and the budget frontier is named only when it was
# drawn.
bin=$1
. "$(dirname "$0")/lib.sh" plot_quality_test

"$bin" sweep --out "$tmp/run" --variant flash --variant linear --variant local:window=32 \
  --seq 256 --causal on --pass fwd,fwdbwd,decode --reps 1 --min-time 0 --heads 1 --dim 16 \
  --threads 1 --machine-file "$machine/threads-1.json" 2>/dev/null || fail "the sweep failed"

# Known times (seconds) per pass: flash 2 ms, 6 ms, 4 µs; linear half, a third, a quarter of
# them (speed over flash 2, 3, 4); local twice flash's (0.5). Decode states: flash 32 KiB,
# linear 1 KiB, local 4 KiB.
"$py" - "$tmp/run/results.csv" <<'EOF'
import csv, sys
path = sys.argv[1]
rows = list(csv.DictReader(open(path)))
base = {"fwd": 2e-3, "fwdbwd": 6e-3, "decode": 4e-6}
speed = {"flash": {"fwd": 1, "fwdbwd": 1, "decode": 1},
         "linear": {"fwd": 2, "fwdbwd": 3, "decode": 4},
         "local": {"fwd": 0.5, "fwdbwd": 0.5, "decode": 0.5}}
state = {"flash": 32768, "linear": 1024, "local": 4096}
for r in rows:
    if r["status"] != "ok":
        sys.exit(f"plot_quality_test: row {r['spec']} {r['pass']} is {r['status']}")
    t = base[r["pass"]] / speed[r["variant"]][r["pass"]]
    for c in ("time_median_s", "time_min_s", "time_max_s"):
        r[c] = repr(t)
    r["noisy"] = "0"
    if r["pass"] == "decode":
        r["time_per_token_s"] = repr(t)
        r["state_bytes"] = str(state[r["variant"]])
with open(path, "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerows(rows)
EOF

# Recall: flash at n = 256 over three seeds (0.9, 1.0, 0.95: 0.95 ± 0.05) and at n = 128 over
# two, linear and local at n = 256 over two, linformer refused. train_s / tokens: flash 10 µs,
# linear 2 µs, local 5 µs per token. Language: local over two seeds (Δ after 0.1 and 0.2),
# linear over one, linformer refused.
mkdir -p "$tmp/run/quality"
cat >"$tmp/run/quality/recall.csv" <<'EOF'
variant,spec,seq,pairs,width,seed,steps,tokens,train_s,accuracy,final_loss,status,message,mode,batch,lr,min_distance,threads
flash,flash,128,8,64,0,400,819200,8.192,1.0,0.01,ok,,causal,16,0.003,66,2
flash,flash,128,8,64,1,400,819200,8.192,1.0,0.01,ok,,causal,16,0.003,66,2
flash,flash,256,8,64,0,400,1638400,16.384,0.9,0.1,ok,,causal,16,0.003,130,2
flash,flash,256,8,64,1,400,1638400,16.384,1.0,0.1,ok,,causal,16,0.003,130,2
flash,flash,256,8,64,2,400,1638400,16.384,0.95,0.1,ok,,causal,16,0.003,130,2
local,local:window=32,256,8,64,0,400,1638400,8.192,0.02,3.0,ok,,causal,16,0.003,130,2
local,local:window=32,256,8,64,1,400,1638400,8.192,0.04,3.0,ok,,causal,16,0.003,130,2
linear,linear,256,8,64,0,400,1638400,3.2768,0.3,2.0,ok,,causal,16,0.003,130,2
linear,linear,256,8,64,1,400,1638400,3.2768,0.5,2.0,ok,,causal,16,0.003,130,2
linformer,linformer,256,8,64,0,400,1638400,,,,unsupported,linformer cannot be causal (it attends every key),causal,16,0.003,130,2
EOF
cat >"$tmp/run/quality/lm.csv" <<'EOF'
variant,spec,seed,context,eval_windows,base_bpb,swap_bpb,swap_delta,uptrain_steps,uptrain_tokens,uptrain_bpb,flash_uptrain_bpb,uptrain_delta,recovered,uptrain_s,status,message
local,local:window=32,0,256,64,2.0,2.5,0.5,100,409600,2.1,2.0,0.1,0.8,50,ok,
local,local:window=32,1,256,64,2.0,2.5,0.5,100,409600,2.2,2.0,0.2,0.6,50,ok,
linear,linear,0,256,64,2.0,3.0,1.0,100,409600,2.5,2.0,0.5,0.5,50,ok,
linformer,linformer,0,256,64,2.0,,,100,409600,,,,,,unsupported,linformer cannot be causal
EOF

# scripts/plot.py's own command line in one process, drawing the Quality and error sections
# only (the report's order puts Quality first; plot_test.sh draws every section): the other
# figures cost seconds each and show nothing of this section.
PYTHONPATH="$root/scripts" "$py" - "$tmp/run" "$tmp/debug.json" >/dev/null 2>"$tmp/plot.err" <<'EOF' ||
import sys
from attnbench_plots import error, quality, report
if report.SECTIONS[0] is not quality.section:
    sys.exit("plot_quality_test: the Quality section is not the report's first after its header")
report.SECTIONS = [quality.section, error.error_vs_n]
sys.argv = ["plot.py", sys.argv[1], "--debug-json", sys.argv[2]]
import plot
sys.exit(plot.main())
EOF
  { cat "$tmp/plot.err" >&2; fail "plot.py failed"; }
figures "$tmp/run" recall_throughput
"$py" - "$tmp/run/report.md" "$tmp/debug.json" <<'EOF'
import json, re, sys
report = open(sys.argv[1]).read()
def fail(msg):
    sys.exit(f"plot_quality_test: {msg}")
heads = [l for l in report.splitlines() if l.startswith("## ")]
if heads[:3] != ["## Run", "## Quality",
                 "## Error against sequence length: a stress test of the input distribution"]:
    fail(f"the Quality section is not between the run header and the error section: {heads}")
m = re.search(r"\n## Quality\n(.*?)\n## ", report, re.S)
section = m.group(1)
def row(table, spec):
    for l in section.split(f"### {table}")[1].splitlines():
        if l.startswith(f"| `{spec}` |"):
            return [c.strip() for c in l.strip("|").split("|")][1:]
    fail(f"no row of {spec} in the {table} table")
for spec, want in {"flash": ["1.00 ± 0.00 (2)", "0.95 ± 0.05 (3)", "10 ± 0"],
                   "linear": ["", "0.40 ± 0.14 (2)", "2 ± 0"],
                   "local:window=32": ["", "0.03 ± 0.01 (2)", "5 ± 0"],
                   "linformer": ["", "unsupported [1]", ""]}.items():
    if row("Recall accuracy", spec) != want:
        fail(f"recall row of {spec}: {row('Recall accuracy', spec)}, expected {want}")
if "[1] linformer cannot be causal (it attends every key)" not in section:
    fail("the unsupported recall row's reason is not given")
order = [l.split("`")[1] for l in section.split("### Recall accuracy")[1].split("###")[0]
         .splitlines() if l.startswith("| `")]
if order != ["flash", "linear", "local:window=32", "linformer"]:
    fail(f"recall rows not exact first then by accuracy: {order}")
for spec, want in {"flash": ["", "", "", "1.00×", "1.00×", "1.00×"],
                   "linear": ["+1.000", "+0.500 (1 seed)", "50%", "2.00×", "3.00×", "4.00×"],
                   "local:window=32": ["+0.500 ± 0.000", "+0.150 ± 0.071 (2)", "70% ± 14%",
                                       "0.50×", "0.50×", "0.50×"],
                   "linformer": ["unsupported [1]", "", "", "—", "—", "—"]}.items():
    if row("Language and speed", spec) != want:
        fail(f"language row of {spec}: {row('Language and speed', spec)}, expected {want}")
if "at n = 256" not in section or "Seeds per variant and setting: 1 to 3" not in section:
    fail("the section does not state the speed's n or the seeds")
if "budget frontier" in section:
    fail("the section names a budget frontier that was not drawn")
if "not what it costs a model (the Quality section above measures that)" not in report:
    fail("the error section does not point to the Quality section above it")
fig = json.load(open(sys.argv[2]))["recall_throughput"]
got = {p["spec"]: (round(p["mean"], 6), p["lo"], p["hi"], p["state"], round(p["cost"], 6))
       for p in fig["points"]}
want = {"flash": (0.95, 0.9, 1.0, 32768.0, 10.0), "linear": (0.4, 0.3, 0.5, 1024.0, 2.0),
        "local:window=32": (0.03, 0.02, 0.04, 4096.0, 5.0)}
if got != want:
    fail(f"the figure drew {got}, expected {want}")
print("plot_quality_test: the Quality section and figure show the known numbers")
EOF

# Broken or absent quality files, and the budget frontier, without another plot.py run: the
# loader warns and leaves a file out, and the section names plots/frontier.png only when it
# exists and this run drew it (or the report does not manage it).
PYTHONPATH="$root/scripts" "$py" - "$tmp/broken" <<'EOF'
import os, sys
from attnbench_plots import quality, style
d = sys.argv[1]
os.makedirs(os.path.join(d, "quality"))
os.makedirs(os.path.join(d, "plots"))
class Ctx:
    def __init__(self):
        self.dir, self.md, self.problems, self.quality_at = d, ["a", "b"], [], None
    def note(self, text):
        self.problems.append(text)
    def fig_path(self, name):
        return os.path.join(d, "plots", name + ".png")
def fail(msg):
    sys.exit(f"plot_quality_test: {msg}")
ctx = Ctx()
open(os.path.join(d, "quality", "recall.csv"), "w").close()
open(os.path.join(d, "quality", "lm.csv"), "w").write("spec,seed,status\nlocal,0,ok\n")
quality.section(ctx)
if ctx.md != ["a", "b"] or len(ctx.problems) != 2 or "is empty" not in ctx.problems[0] or \
        "no column swap_delta, uptrain_delta" not in ctx.problems[1]:
    fail(f"broken files: {ctx.md} {ctx.problems}")
ctx.quality_at = 1
quality.frontier(ctx, ["frontier"])
if ctx.md != ["a", "b"]:
    fail("the frontier is named though no file exists")
open(ctx.fig_path("frontier"), "wb").write(b"png")
quality.frontier(ctx, ["frontier"])
if ctx.md != ["a", "b"]:
    fail("the frontier of an earlier run (not drawn by this one) is named")
quality.frontier(ctx, [])
if len(ctx.md) != 3 or "](plots/frontier.png)" not in ctx.md[1]:
    fail(f"the drawn frontier is not named at the end of the section: {ctx.md}")
EOF
echo "plot_quality_test: broken quality files are notes; the frontier is named when drawn"

# Rows of several processors: training times become multiples of flash's on the same processor
# and threads (NaN where flash has none there); rows of one processor stay in µs.
PYTHONPATH="$root/scripts" "$py" - <<'EOF'
import math, sys
import pandas as pd
from attnbench_plots import quality
def fail(msg):
    sys.exit(f"plot_quality_test: {msg}")
rows = pd.DataFrame({
    "spec": ["flash", "flash", "linear", "flash", "local:window=8", "local:window=8", "gla"],
    "cpu": ["A", "A", "A", "B", "B", "C", "A"], "threads": [1, 1, 1, 1, 1, 1, 1],
    "status": ["ok"] * 6 + ["failed"], "tokens": [1e6] * 7,
    "train_s": [10.0, 12.0, 5.5, 20.0, 10.0, 3.0, math.nan]})
cost, relative = quality.training_cost(rows)
want = [10 / 11, 12 / 11, 0.5, 1.0, 0.5]
if not relative or list(cost.index) != list(range(6)) or \
        [round(x, 9) for x in cost[:5]] != [round(x, 9) for x in want] or \
        not math.isnan(cost[5]):
    fail(f"training cost over processors: {list(cost)} (relative {relative})")
if quality.processors(rows) != ["A", "B", "C"]:
    fail(f"processors: {quality.processors(rows)}")
unnamed = rows.assign(cpu=["A", "", "A", "", "", "", "A"])
cost, relative = quality.training_cost(unnamed)
if not relative or quality.processors(unnamed) != ["not recorded", "A"]:
    fail(f"rows without a processor beside named ones: {quality.processors(unnamed)} "
         f"(relative {relative})")
cost, relative = quality.training_cost(rows[rows["cpu"] == "A"])
if relative or [round(x, 9) for x in cost] != [10.0, 12.0, 5.5]:
    fail(f"training cost on one processor: {list(cost)} (relative {relative})")
EOF
echo "plot_quality_test: training times of several processors are read against flash's on each"
