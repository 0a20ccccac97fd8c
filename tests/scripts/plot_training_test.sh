#!/usr/bin/env bash
# scripts/plot.py on a real short sweep with the training passes (--pass fwd,bwd,fwdbwd): the
# training figures and table are drawn from the training rows and every other figure from the
# forward rows only. The sweep's rows are then given known times, memory and errors that differ
# by pass (fwdbwd 10x and bwd 4x the forward's time, other errors on the training rows), so
# that a figure drawing the wrong pass, or mixing passes, draws other numbers than the checks
# compute from results.csv. Results without training rows, and older results without the pass
# column, draw no training figure and remove those of an earlier run.
bin=$1
. "$(dirname "$0")/lib.sh" plot_training_test

# reformer's training rows are turned into those of a variant without a backward pass (status
# unsupported, as the sweep writes them for one): they must be listed as rows not plotted
"$bin" sweep --out "$tmp/run" --variant flash --variant full --variant local:window=16,block=16 \
  --variant linear --variant reformer --seq 64,128,256 --causal both --heads 2 --dim 16 \
  --pass fwd,bwd,fwdbwd --reps 1 --min-time 0 --threads 1 \
  --machine-file "$machine/threads-1.json" 2>/dev/null ||
  fail "the sweep failed"

# Known numbers, per (spec, n, causal): fwdbwd = 10 x and bwd = 4 x the forward's time;
# linear's fwdbwd time 2, 1/2, 1/4 x flash's at n = 64, 128, 256 (crossing at n ≈ 91); the
# training rows' own rel_fro_error 3 x the forward's (the figures must take the fwd row's);
# the bwd rows' gradient errors twice the fwdbwd rows' (the figures take fwdbwd's); linear's
# dK error missing; peak memory fwd < bwd < fwdbwd; every row quiet.
"$py" - "$tmp/run/results.csv" <<'EOF'
import csv, sys
path = sys.argv[1]
rows = list(csv.DictReader(open(path)))
def key(r):
    return (r["spec"], r["n"], r["causal"])
fwd = {key(r): r for r in rows if r["pass"] == "fwd" and r["status"] == "ok"}
flash = {(r["n"], r["causal"]): r for r in fwd.values() if r["spec"].startswith("flash")}
for r in rows:
    r["noisy"] = "0"
    if r["spec"].startswith("reformer") and r["pass"] != "fwd":
        r["status"] = "unsupported"
        r["message"] = "reformer: no backward pass"
        for c in list(r):
            if c.startswith(("time_", "grad_rel_err_", "saved_")) or c in ("peak_bytes",):
                r[c] = ""
    if r["status"] != "ok":
        continue
    base = fwd[key(r)]
    t = float(base["time_median_s"])
    if r["spec"].startswith("linear") and r["pass"] == "fwdbwd":  # 10 x below, as flash's
        t = float(flash[(r["n"], r["causal"])]["time_median_s"]) * \
            {"64": 2.0, "128": 0.5, "256": 0.25}[r["n"]]
    factor = {"fwd": 1.0, "bwd": 4.0, "fwdbwd": 10.0}[r["pass"]]
    for c in ("time_median_s", "time_min_s", "time_max_s"):
        r[c] = repr(t * factor)
    r["time_spread"] = "1.0"
    peak = 4096.0 * int(r["n"]) * (1 + len(r["spec"]) % 3)
    r["peak_bytes"] = repr(peak * {"fwd": 1.0, "bwd": 2.0, "fwdbwd": 3.0}[r["pass"]])
    if r["pass"] != "fwd":
        r["rel_fro_error"] = repr(3 * float(base["rel_fro_error"]))
        if not r["saved_bytes"]:  # not measured (a sanitizer build)
            r["saved_bytes"] = repr(peak / 2)
    if r["pass"] == "bwd":
        for c in ("grad_rel_err_q", "grad_rel_err_k", "grad_rel_err_v"):
            r[c] = repr(2 * float(r[c]))
    if r["spec"].startswith("linear") and r["pass"] == "fwdbwd":
        r["grad_rel_err_k"] = ""
with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
EOF

plot "$tmp/run" --debug-json "$tmp/run.json" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed on results with training rows"; }
figures "$tmp/run" time_vs_n memory_vs_n error_vs_n speed_vs_error crossover train_time_vs_n \
  train_memory_vs_n grad_vs_fwd_error train_speed_vs_error

"$py" - "$tmp/run/results.csv" "$tmp/run.json" "$tmp/run/report.md" <<'EOF' ||
import csv, json, math, sys
rows = [r for r in csv.DictReader(open(sys.argv[1]))]
d = json.load(open(sys.argv[2]))
report = open(sys.argv[3], encoding="utf-8").read()
MIB = float(1 << 20)
ok = [r for r in rows if r["status"] == "ok"]
def check(cond, what):
    if not cond:
        sys.exit(f"plot_training_test: {what}")
def causal_of(title):
    return "0" if "non-causal" in title else "1"
def value(p, spec, n, causal, column):
    got = [float(r[column]) for r in ok if r["pass"] == p and r["spec"] == spec and
           r["n"] == str(int(n)) and r["causal"] == causal]
    check(len(got) == 1, f"{len(got)} ok {p} rows of {spec} n={n} causal={causal}")
    return got[0]
def same(a, b):
    return math.isclose(a, b, rel_tol=1e-9)
def lines_equal(fig, p, column, scale=1.0, key="y"):
    seen = 0
    for panel in d[fig]["panels"]:
        c = causal_of(panel["title"])
        for line in panel["lines"]:
            if key not in line:
                continue
            for n, y in zip(line["n"], line[key]):
                want = value(p, line["spec"], n, c, column) / scale
                check(same(y, want), f"{fig}: {line['spec']} at n={n:g}, {panel['title']}: "
                      f"{y} drawn, the {p} row has {want}")
                seen += 1
    check(seen > 0, f"{fig}: nothing drawn")
    return seen

# the forward's figures: the fwd rows and nothing else
drawn = lines_equal("time_vs_n", "fwd", "time_median_s")
check(drawn == len([r for r in ok if r["pass"] == "fwd"]),
      f"time_vs_n draws {drawn} points, there are "
      f"{len([r for r in ok if r['pass'] == 'fwd'])} ok fwd rows")
lines_equal("memory_vs_n", "fwd", "peak_bytes", MIB)
lines_equal("error_vs_n", "fwd", "rel_fro_error")
for panel in d["speed_vs_error"]["panels"]:
    for pt in panel["points"]:
        n = d["speed_vs_error"]["n"]
        check(same(pt["time"], value("fwd", pt["spec"], n, causal_of(panel["title"]),
                                     "time_median_s")), f"speed_vs_error: {pt}")
for panel in d["crossover"]["panels"]:
    c = causal_of(panel["title"].split(": ", 1)[1])
    for line in panel["lines"]:
        for n, ratio in zip(line["n"], line["ratio"]):
            want = value("fwd", line["spec"], n, c, "time_median_s") / \
                value("fwd", panel["baseline"], n, c, "time_median_s")
            check(same(ratio, want), f"crossover: {line['spec']} at n={n:g}: {ratio} != {want}")

# the training figures: fwdbwd rows (bwd rows only where there is no fwdbwd row)
drawn = lines_equal("train_time_vs_n", "fwdbwd", "time_median_s")
check(drawn == len([r for r in ok if r["pass"] == "fwdbwd"]),
      f"train_time_vs_n draws {drawn} points, not one per ok fwdbwd row")
lines_equal("train_memory_vs_n", "fwdbwd", "peak_bytes", MIB)
lines_equal("train_memory_vs_n", "fwdbwd", "saved_bytes", MIB, key="saved")
check(any("saved state" in e for e in d["train_memory_vs_n"]["legend"]),
      "train_memory_vs_n: the legend does not explain the dashed saved state")
def grad_error(spec, n, c):
    errs = [value("fwdbwd", spec, n, c, col) for col in
            ("grad_rel_err_q", "grad_rel_err_k", "grad_rel_err_v")
            if any(r[col] for r in ok if r["pass"] == "fwdbwd" and r["spec"] == spec and
                   r["n"] == str(int(n)) and r["causal"] == c)]
    return max(errs)
g = d["grad_vs_fwd_error"]
points = 0
for panel in g["panels"]:
    c = causal_of(panel["title"])
    for pt in panel["points"]:
        points += 1
        fwd = value("fwd", pt["spec"], g["n"], c, "rel_fro_error")
        check(same(pt["fwd_error"], fwd), f"grad_vs_fwd_error: forward error {pt} is not the "
              f"fwd row's {fwd}")
        check(same(pt["grad_error"], grad_error(pt["spec"], g["n"], c)),
              f"grad_vs_fwd_error: gradient error {pt} is not the largest of the fwdbwd row's")
        if pt["spec"].startswith("linear"):
            check(pt["grad"]["dK"] is None and pt["worst"] in ("dQ", "dV"),
                  f"grad_vs_fwd_error: linear's missing dK error: {pt}")
    lo, hi = panel["diagonal"]
    check(lo < min([p["fwd_error"] for p in panel["points"]] + [1]) and hi > 1,
          f"grad_vs_fwd_error: the diagonal does not span the points: {panel}")
check(points == 2 * 4, f"grad_vs_fwd_error: {points} points, expected flash, full, local and "
      f"linear in both causal settings (reformer's training rows are unsupported)")
s = d["train_speed_vs_error"]
check(s["n"] == g["n"] == 256, f"training figures at n={s['n']}, {g['n']}, expected 256")
for panel in s["panels"]:
    c = causal_of(panel["title"])
    for pt in panel["points"]:
        check(same(pt["time"], value("fwdbwd", pt["spec"], s["n"], c, "time_median_s")) and
              same(pt["error"], grad_error(pt["spec"], s["n"], c)), f"train_speed_vs_error: {pt}")
    check(panel["front"], f"train_speed_vs_error: no frontier in {panel['title']}")

# the report: the training table at the largest n, bwd / fwd = 4, linear crossing flash's
# fwdbwd time at n ≈ 91, reformer's training passes shown with their status and listed
check("## Training table" in report, "report.md has no training table")
table = report.split("## Training table", 1)[1].split("\n## ", 1)[0]
check(table.count("n = 256:") == 2, "the training table is not at n = 256 for both settings")
for line in table.splitlines():
    if line.startswith("| `linear"):
        cells = [x.strip() for x in line.strip("|").split("|")]
        check(cells[4] == "4×", f"training table: bwd / fwd of linear is {cells[4]}, not 4×")
        check(cells[7].startswith("≈ 91: faster from there on"),
              f"training table: linear's crossover against flash: {cells[7]}")
        check("(dK)" not in cells[6], f"training table: linear's missing dK named: {cells[6]}")
    if line.startswith("| `reformer"):
        check("unsupported" in line, f"training table: reformer's training status: {line}")
    if line.startswith("| `flash"):
        check("the baseline" in line, f"training table: flash row: {line}")
check(table.count("| `linear") == 2 and table.count("| `reformer") == 2,
      "training table: not one row of linear and of reformer per causal setting")
bad = [r for r in rows if r["status"] != "ok"]
listed = report.split("## Rows not plotted", 1)[1].count("\n| `")
check(bad and listed == len(bad), f"rows not plotted: {listed} listed, {len(bad)} not ok")
check("pass=bwd" in report and "pass=fwdbwd" in report,
      "rows not plotted do not name their pass")
EOF
  fail "the figures do not draw the passes they should"

# Older results, without the pass column nor the training columns, in a directory that holds
# an earlier run's training figures: those are removed, no training figures are drawn, the
# report says so, and every other figure is drawn from the rows as they are. (A forward-only
# sweep with the pass column is plot_test.sh's.)
dir="$tmp/old"
cp -r "$tmp/run" "$dir"
"$py" - "$dir/results.csv" <<'EOF'
import csv, sys
path = sys.argv[1]
rows = [r for r in csv.DictReader(open(path)) if r["pass"] == "fwd"]
cols = list(rows[0])
cols = [c for c in cols if c != "pass" and not c.startswith(("saved", "grad_"))]
with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
EOF
plot "$dir" --debug-json "$dir.json" 2>"$dir.err" ||
  { cat "$dir.err" >&2; fail "plot.py failed on older results"; }
for name in train_time_vs_n train_memory_vs_n grad_vs_fwd_error train_speed_vs_error; do
  [ ! -e "$dir/plots/$name.png" ] || fail "older results: a stale $name.png was left"
done
grep -qF "No training rows" "$dir/report.md" || fail "older results: no word on training"
same_drawing time_vs_n "$dir.json" "$tmp/run.json" ||
  fail "older results: time_vs_n differs from the run's"
echo "plot_training_test: ok"
