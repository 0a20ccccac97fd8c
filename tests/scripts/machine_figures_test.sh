#!/usr/bin/env bash
# The machine figures the script tests share (fixture attnbench_machine, tests/CMakeLists.txt):
# every `attnbench sweep` measures the machine first (peak GEMM rate and bandwidth, several
# seconds) unless --machine-file names a file that holds this host's figures at its thread
# count. This test measures them once per ctest run, at 1 thread and at every core, into
# DIR/threads-1.json and DIR/threads-all.json (the files of an earlier run are removed first, so
# the figures are this run's), and checks that each file is read back rather than measured
# again. The script tests read them through ATTNBENCH_TEST_MACHINE_DIR=DIR (without it, each
# measures once for itself, into its temporary directory).
#   tests/scripts/machine_figures_test.sh path/to/attnbench DIR
set -euo pipefail
bin=$1
dir=$2
py=/usr/bin/python3
fail() { echo "machine_figures_test: $*" >&2; exit 1; }

rm -rf "$dir"
mkdir -p "$dir"
for t in 1 all; do
  threads=$([ "$t" = all ] && echo 0 || echo "$t")
  file="$dir/threads-$t.json"
  "$bin" machine --threads "$threads" --file "$file" >"$dir/threads-$t.txt" ||
    fail "attnbench machine --threads $threads --file $file failed"
  cat "$dir/threads-$t.txt"
  grep -q "^figures    measured, kept in $file at " "$dir/threads-$t.txt" ||
    fail "the figures at --threads $threads were not measured and kept in $file"
  "$py" - "$file" "$t" <<'EOF' || fail "$file does not hold usable machine figures"
import json, os, sys
m = json.load(open(sys.argv[1]))
assert m["gemm_gflops"] > 0 and m["bandwidth_gbs"] > 0, m
assert m["threads"] == 1 if sys.argv[2] == "1" else m["threads"] >= 1, m
assert m["host"] and m["cpu_model"], m
EOF
  # read back, not measured again
  "$bin" machine --threads "$threads" --file "$file" >"$dir/again.txt" ||
    fail "attnbench machine --file $file failed the second time"
  grep -q "^figures    read from $file at " "$dir/again.txt" ||
    fail "$file was not read back: $(cat "$dir/again.txt")"
done
rm -f "$dir/again.txt"
echo "machine_figures_test: ok"
