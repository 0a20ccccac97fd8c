#!/usr/bin/env bash
# Two short sweeps, then Google Benchmark's own compare.py on their benchmark.json files:
# the JSON attnbench writes must be what that tool reads.
set -euo pipefail
bin=$1
compare=${2:-/usr/share/benchmark/compare.py}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the machine figures every sweep starts with: measured once per ctest run (the test
# machine_figures, ATTNBENCH_TEST_MACHINE_DIR), else by this script's first sweep
machine=${ATTNBENCH_TEST_MACHINE_DIR:-$tmp}
for run in a b; do
  "$bin" sweep --variant full --variant flash --seq 32,64 --heads 2 --dim 16 --reps 2 \
    --min-time 0.01 --out "$tmp/$run" --machine-file "$machine/threads-all.json" \
    2>/dev/null
done
/usr/bin/python3 "$compare" benchmarks "$tmp/a/benchmark.json" "$tmp/b/benchmark.json" >"$tmp/out.txt"
cat "$tmp/out.txt"
# one comparison line per benchmark name (2 variants x 2 lengths), for the median aggregate too
for name in "full/B=1,H=2,n=32" "flash:block_q" "n=64,m=64"; do
  grep -q "$name" "$tmp/out.txt" || { echo "compare.py output lacks $name" >&2; exit 1; }
done
grep -q "_median" "$tmp/out.txt" || { echo "compare.py output lacks the median aggregate" >&2; exit 1; }
