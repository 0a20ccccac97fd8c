#!/usr/bin/env bash
# Two real short sweeps; scripts/plot.py on the first must write every figure and a report with
# every section, scripts/compare.py on both must join, flag and list rows; and both scripts
# must refuse unusable results directories with one line on stderr and exit code 2.
set -euo pipefail
bin=$1
root=$(cd "$(dirname "$0")/.." && pwd)
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "plot_test: $*" >&2; exit 1; }

common=(--seq 128,256,512 --causal both --heads 2 --dim 32 --reps 2 --min-time 0.002)
"$bin" sweep --out "$tmp/a" --variant full --variant flash --variant local:window=32 \
  --variant linear "${common[@]}" 2>/dev/null
"$bin" sweep --out "$tmp/b" --variant full --variant flash "${common[@]}" 2>/dev/null

# --- plot.py -----------------------------------------------------------------------------------
"$py" "$root/scripts/plot.py" "$tmp/a" --attnbench "$bin" --pattern-n 128 2>"$tmp/plot.err" ||
  { cat "$tmp/plot.err" >&2; fail "plot.py failed on a real sweep"; }
for name in time_vs_n memory_vs_n error_vs_n speed_vs_error crossover patterns; do
  png="$tmp/a/plots/$name.png"
  [ -s "$png" ] || fail "$png is missing or empty"
  [ "$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] ||
    fail "$png is not a PNG file"
  grep -qF "](plots/$name.png)" "$tmp/a/report.md" || fail "report.md does not embed $name.png"
done
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
grep -q "^One head (head 0) of each pattern variant at n = 128" "$report" ||
  fail "report.md does not describe the pattern gallery"
grep -q "no attention pattern.*local:window" "$report" "$tmp/plot.err" &&
  fail "local is said to have no attention pattern"
grep -q "no attention pattern.*linear" "$tmp/plot.err" ||
  fail "plot.py did not say on stderr that linear has no attention pattern"
# the efficiency table: full is 1.00x of itself; lengths not measured are dashes
grep -qE '^\| `full` \| — \| — \| — \| — \|' "$report" ||
  fail "the efficiency table does not show '—' for full at lengths that were not measured"

# Without the binary the gallery is missing, and the report and stderr say why.
"$py" "$root/scripts/plot.py" "$tmp/a" --attnbench "$tmp/no-such-attnbench" 2>"$tmp/nobin.err" ||
  fail "plot.py failed without the attnbench binary"
grep -q "no attnbench binary" "$tmp/nobin.err" || fail "no stderr message about the missing binary"
grep -q "No pattern gallery: no attnbench binary" "$report" ||
  fail "report.md does not say the pattern gallery is missing"
[ ! -e "$tmp/a/plots/patterns.png" ] || fail "a stale patterns.png was left in place"

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
cp -r "$tmp/b" "$tmp/slow"
"$py" - "$tmp/slow/results.csv" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
k = max(3.0, 2 * max(float(r["time_max_s"]) / float(r["time_min_s"]) for r in rows))
for r in rows:
    for c in ("time_median_s", "time_min_s", "time_max_s"):
        r[c] = repr(k * float(r[c]))
with open(sys.argv[1], "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
EOF
"$py" "$root/scripts/compare.py" "$tmp/b" "$tmp/slow" >"$tmp/slow.txt" || fail "compare.py failed"
[ "$(grep -c ' slower$' "$tmp/slow.txt")" -eq 12 ] || fail "not every slower row is flagged"
grep -q "^12 row(s) compared: 12 slower" "$tmp/slow.txt" || fail "wrong summary for slower rows"
set +e
"$py" "$root/scripts/compare.py" --fail-on-regression "$tmp/b" "$tmp/slow" >/dev/null 2>&1
rc=$?
"$py" "$root/scripts/compare.py" --fail-on-regression "$tmp/slow" "$tmp/b" >/dev/null 2>&1
rc_faster=$?
set -e
[ "$rc" -eq 1 ] || fail "--fail-on-regression exited $rc on a regression, expected 1"
[ "$rc_faster" -eq 0 ] || fail "--fail-on-regression exited $rc_faster on a speed-up, expected 0"

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
expect_error() {  # directory, text the message must hold
  local dir=$1 text=$2 script rc
  for script in plot.py compare.py; do
    if [ "$script" = plot.py ]; then args=("$dir"); else args=("$tmp/a" "$dir"); fi
    set +e
    "$py" "$root/scripts/$script" "${args[@]}" >"$tmp/out.txt" 2>"$tmp/err.txt"
    rc=$?
    set -e
    [ "$rc" -eq 2 ] || fail "$script on $dir exited $rc, expected 2"
    grep -q "Traceback" "$tmp/err.txt" && fail "$script on $dir printed a traceback"
    [ "$(wc -l <"$tmp/err.txt")" -eq 1 ] || fail "$script on $dir: expected one line on stderr"
    grep -q "^$script: error: .*$text" "$tmp/err.txt" ||
      fail "$script on $dir: message lacks '$text': $(cat "$tmp/err.txt")"
  done
}
expect_error "$tmp/missing" "is not a directory"
expect_error "$tmp/empty" "results.csv' does not exist"
expect_error "$tmp/header" "has a header but no rows"
expect_error "$tmp/nocol" "lacks the column(s) rel_fro_error"
expect_error "$tmp/nook" "no row with status ok"
echo "plot_test: ok"
