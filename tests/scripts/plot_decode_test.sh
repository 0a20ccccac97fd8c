#!/usr/bin/env bash
# scripts/plot.py on a real short sweep with the decode pass (--pass fwd,decode, both causal
# settings): the generation figures and tables are drawn from the causal decode rows and every
# other figure from the forward rows only; routing, which has no decode step, gets no line and
# no table row. The sweep's decode rows are then given known numbers that differ from what
# they measured (time_per_token_s apart from time_median_s, and known tokens/s, state, bytes
# read, bandwidth fraction and prefill time), so that a figure or table that reads the wrong
# column or the wrong pass shows other numbers than the checks compute from results.csv.
# Results without decode rows, and older results without the pass and decode columns, draw no
# generation figure, remove those of an earlier run and say so on stderr.
bin=$1
. "$(dirname "$0")/lib.sh" plot_decode_test

"$bin" sweep --out "$tmp/run" --variant flash --variant linear --variant local:window=16 \
  --variant routing --seq 64,256,1024 --causal both --pass fwd,decode --reps 1 --min-time 0 \
  --heads 2 --dim 16 --threads 1 --machine-file "$machine/threads-1.json" 2>/dev/null ||
  fail "the sweep failed"

# Known numbers of the ok decode rows, per (spec, n): flash's time per token 1, 4, 16 µs at
# n = 64, 256, 1024; linear's 2, 1/2, 1/4 x flash's (faster from 256 on); local's 1/2 x
# flash's, its row at 256 noisy (judged at 64 and 1K only). time_median_s (and the bars) 3 x
# the time per token, which the figures must not draw. At n = 1024: linear's tokens_per_s
# 123456.7 and state_bytes 3 KiB (at every n), flash's bandwidth_fraction 0.875, local's
# prefill_s 2.5 ms and bytes_read_per_step 5 MiB.
"$py" - "$tmp/run/results.csv" <<'EOF'
import csv, sys
path = sys.argv[1]
rows = list(csv.DictReader(open(path)))
flash = {"64": 1e-6, "256": 4e-6, "1024": 16e-6}
factor = {"flash": {"64": 1.0, "256": 1.0, "1024": 1.0},
          "linear": {"64": 2.0, "256": 0.5, "1024": 0.25},
          "local": {"64": 0.5, "256": 0.5, "1024": 0.5}}
decoded = 0
for r in rows:
    r["noisy"] = "0"
    if r["pass"] == "fwd" and r["status"] == "ok" and not r["peak_bytes"]:
        # not measured (a sanitizer build): a known peak, so that the memory figure has its lines
        r["peak_bytes"] = repr(4096.0 * int(r["n"]) * (1 + len(r["spec"]) % 3))
    if r["pass"] != "decode" or r["status"] != "ok":
        continue
    assert r["causal"] == "1", f"an ok non-causal decode row: {r['spec']}"
    name, n = r["spec"].split(":")[0], r["n"]
    t = flash[n] * factor[name][n]
    r["time_per_token_s"] = repr(t)
    for c in ("time_median_s", "time_min_s", "time_max_s"):
        r[c] = repr(3 * t)
    r["time_spread"] = "1.0"
    if name == "local" and n == "256":
        r["noisy"] = "1"
    if name == "linear":
        r["state_bytes"] = "3072"
    if n == "1024":
        if name == "linear":
            r["tokens_per_s"] = "123456.7"
        if name == "flash":
            r["bandwidth_fraction"] = "0.875"
        if name == "local":
            r["prefill_s"] = "0.0025"
            r["bytes_read_per_step"] = repr(5.0 * (1 << 20))
    decoded += 1
assert decoded == 9, f"{decoded} ok decode rows, expected flash, linear and local at 3 lengths"
with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
EOF

plot "$tmp/run" --debug-json "$tmp/run.json" 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed on results with decode rows"; }
figures "$tmp/run" time_vs_n memory_vs_n error_vs_n speed_vs_error crossover decode_latency_vs_n \
  decode_state_vs_n
! grep -q "decode" "$tmp/plot.err" || fail "plot.py said on stderr: $(grep decode "$tmp/plot.err")"

"$py" - "$tmp/run/results.csv" "$tmp/run.json" "$tmp/run/report.md" <<'EOF' ||
import csv, json, math, sys
rows = [r for r in csv.DictReader(open(sys.argv[1]))]
d = json.load(open(sys.argv[2]))
report = open(sys.argv[3], encoding="utf-8").read()
MIB = float(1 << 20)
ok = [r for r in rows if r["status"] == "ok"]
def check(cond, what):
    if not cond:
        sys.exit(f"plot_decode_test: {what}")
def causal_of(title):
    return "0" if "non-causal" in title else "1"
def value(p, spec, n, causal, column):
    got = [float(r[column]) for r in ok if r["pass"] == p and r["spec"] == spec and
           r["n"] == str(int(n)) and r["causal"] == causal]
    check(len(got) == 1, f"{len(got)} ok {p} rows of {spec} n={n} causal={causal}")
    return got[0]
def same(a, b):
    return math.isclose(a, b, rel_tol=1e-9)
def lines_equal(fig, p, column, scale=1.0):
    seen, specs = 0, set()
    for panel in d[fig]["panels"]:
        c = causal_of(panel["title"])
        for line in panel["lines"]:
            specs.add(line["spec"].split(":")[0])
            for n, y in zip(line["n"], line["y"]):
                want = value(p, line["spec"], n, c, column) / scale
                check(same(y, want), f"{fig}: {line['spec']} at n={n:g}, {panel['title']}: "
                      f"{y} drawn, the {p} row's {column} is {want}")
                seen += 1
    return seen, specs

# the forward's figures: the fwd rows and nothing else
fwd_rows = len([r for r in ok if r["pass"] == "fwd"])
drawn, _ = lines_equal("time_vs_n", "fwd", "time_median_s")
check(drawn == fwd_rows, f"time_vs_n draws {drawn} points, there are {fwd_rows} ok fwd rows")
drawn, _ = lines_equal("memory_vs_n", "fwd", "peak_bytes", MIB)
check(drawn == fwd_rows, f"memory_vs_n draws {drawn} points, there are {fwd_rows} ok fwd rows")
lines_equal("error_vs_n", "fwd", "rel_fro_error")
for panel in d["crossover"]["panels"]:
    c = causal_of(panel["title"].split(": ", 1)[1])
    for line in panel["lines"]:
        for n, ratio in zip(line["n"], line["ratio"]):
            want = value("fwd", line["spec"], n, c, "time_median_s") / \
                value("fwd", panel["baseline"], n, c, "time_median_s")
            check(same(ratio, want), f"crossover: {line['spec']} at n={n:g}: {ratio} != {want}")

# the generation figures: one causal panel, a line per decoding variant, time_per_token_s
# (not time_median_s) and state_bytes in KiB
dec_rows = len([r for r in ok if r["pass"] == "decode"])
for fig, column, scale in (("decode_latency_vs_n", "time_per_token_s", 1.0),
                           ("decode_state_vs_n", "state_bytes", 1024.0)):
    titles = [p["title"] for p in d[fig]["panels"]]
    check(len(titles) == 1 and causal_of(titles[0]) == "1",
          f"{fig}: panels {titles}, expected one causal panel")
    drawn, specs = lines_equal(fig, "decode", column, scale)
    check(drawn == dec_rows, f"{fig} draws {drawn} points, there are {dec_rows} ok decode rows")
    check(specs == {"flash", "linear", "local"}, f"{fig}: lines of {sorted(specs)}")
lat = d["decode_latency_vs_n"]["panels"][0]["lines"]
for line in lat:
    want = [256.0] if line["spec"].startswith("local") else []
    check(line["noisy_n"] == want, f"decode_latency_vs_n: {line['spec']} hollow at "
          f"{line['noisy_n']}, expected {want}")
    for lo, y, hi in zip(line["lo"], line["y"], line["hi"]):
        check(same(lo, y) and same(hi, y), f"decode_latency_vs_n: {line['spec']} bar {lo}..{hi} "
              f"around {y}, expected none (every repetition the same)")
check("bar: min–max of repetitions" in d["decode_latency_vs_n"]["legend"] and
      "hollow: noisy row" in d["decode_latency_vs_n"]["legend"],
      f"decode_latency_vs_n legend: {d['decode_latency_vs_n']['legend']}")

# the report: the generation section, its tables and the known cells
check("## Generation: decode step against context" in report, "report.md has no decode section")
gen = report.split("## Generation: decode step against context", 1)[1].split("\n## ", 1)[0]
check("| `routing" not in gen, "the decode section has a row of routing, which does not decode")
check("`routing:" in gen.split("###", 1)[0] and "(unsupported)" in gen.split("###", 1)[0],
      "the decode section does not name routing as without a decode step")
def table_rows(text):
    out = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [x.strip() for x in line.strip("|").split("|")]
            name = cells[0].strip("`").split(":")[0]
            check(name not in out, f"two rows of {name} in one table: {line}")
            out[name] = cells
    return out
times = table_rows(gen.split("### Time per token against context", 1)[1].split("###", 1)[0])
check(set(times) == {"flash", "linear", "local"}, f"time per token table rows: {sorted(times)}")
want = {"flash": ["1 µs ×1.00", "4 µs ×1.00", "16 µs ×1.00"],
        "linear": ["2 µs ×1.00", "2 µs ×1.00", "4 µs ×1.00"],
        "local": ["0.5 µs ×1.00", "2 µs ×1.00 †", "8 µs ×1.00"]}
for name, cells in want.items():
    got = times[name][1:]
    check(got == cells, f"time per token table, {name}: {got}, expected {cells}")
table = gen.split("### Decode table at the largest context", 1)
check(len(table) == 2, "the decode section has no table at the largest context")
table = table[1]
check(table.count("context n = 1K:") == 1, "the decode table is not once at context 1K")
big = table_rows(table)
check(set(big) == {"flash", "linear", "local"}, f"decode table rows: {sorted(big)}")
header = [x.strip() for x in
          [l for l in table.splitlines() if l.startswith("| variant")][0].strip("|").split("|")]
col = {h: i for i, h in enumerate(header)}
cross = [h for h in header if h.startswith("per token faster than")][0]
expect = {
    ("flash", "time per token"): "16 µs ×1.00",
    ("flash", "of memory bandwidth"): "0.875",
    ("flash", cross): "— (the baseline)",
    ("linear", "time per token"): "4 µs ×1.00",
    ("linear", "tokens/s"): "123,457",
    ("linear", "state per sequence"): "3 KiB",
    ("linear", cross): "256: faster from there on (64–1K)",
    ("local", "time per token"): "8 µs ×1.00",
    ("local", "prefill"): "2.5 ms",
    ("local", "read per step"): "5 MiB",
    ("local", cross): "faster at every judged n (judged at n = 64, 1K; noisy, not judged: "
                      "256 †)",
}
for (name, h), text in expect.items():
    check(big[name][col[h]] == text, f"decode table, {name}, {h}: '{big[name][col[h]]}', "
          f"expected '{text}'")
check("† noisy" in gen, "the decode section marks a noisy row without the footnote")
bad = [r for r in rows if r["status"] != "ok"]
listed = report.split("## Rows not plotted", 1)[1].count("\n| `")
check(bad and listed == len(bad), f"rows not plotted: {listed} listed, {len(bad)} not ok")
check("pass=decode" in report, "rows not plotted do not name the decode pass")
EOF
  fail "the figures or tables do not draw the decode rows as they should"

# Older results, without the pass column nor the decode columns, in a directory that holds an
# earlier run's generation figures: those are removed, no generation figures are drawn, the
# report and stderr say so, and every other figure is drawn from the rows as they are. (A
# forward-only sweep with the pass column is plot_test.sh's.)
dir="$tmp/old"
cp -r "$tmp/run" "$dir"
"$py" - "$dir/results.csv" <<'EOF'
import csv, sys
path = sys.argv[1]
rows = [r for r in csv.DictReader(open(path)) if r["pass"] == "fwd"]
cols = list(rows[0])
decode = ("prefill_s", "time_per_token_s", "tokens_per_s", "state_bytes", "bytes_read_per_step",
          "bandwidth_fraction")
cols = [c for c in cols if c != "pass" and c not in decode]
with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
EOF
plot "$dir" --debug-json "$dir.json" 2>"$dir.err" ||
  { cat "$dir.err" >&2; fail "plot.py failed on older results"; }
! grep -q "Traceback" "$dir.err" || fail "older results: a traceback on stderr"
for name in decode_latency_vs_n decode_state_vs_n; do
  [ ! -e "$dir/plots/$name.png" ] || fail "older results: a stale $name.png was left"
done
grep -qF "No ok causal decode rows" "$dir/report.md" || fail "older results: no word on decode"
grep -q "decode: no ok causal decode rows" "$dir.err" ||
  fail "older results: stderr does not say there are no decode rows"
"$py" - "$dir.json" <<'EOF' || fail "older results: the debug JSON has generation figures"
import json, sys
d = json.load(open(sys.argv[1]))
sys.exit(1 if set(d) & {"decode_latency_vs_n", "decode_state_vs_n"} else 0)
EOF
same_drawing time_vs_n "$dir.json" "$tmp/run.json" ||
  fail "older results: time_vs_n differs from the run's"
echo "plot_decode_test: ok"
