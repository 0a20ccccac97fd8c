#!/usr/bin/env bash
# A disk that fills during a sweep: the sweep stops with a non-zero exit and a message naming the
# file and --resume; results.csv keeps every finished row whole, benchmark.json stays valid JSON;
# after space is freed, --resume finishes the sweep losing no row and measuring none twice.
#
# The disk is a small tmpfs mounted for the test: as root (as CI runs), else inside a user and
# mount namespace (unshare -Urm) where the system allows one; where neither can mount, the test
# is skipped (exit 77). The write-failure paths themselves are also unit-tested with a file-size
# limit (tests/harness/hostile_output_dir_test.cpp).
#   tests/scripts/disk_full_test.sh path/to/attnbench
set -euo pipefail
bin=$(realpath "$1")
if [ "$(id -u)" != 0 ] && [ -z "${ATTNBENCH_DISK_FULL_NS:-}" ] && unshare -Urm true 2>/dev/null; then
  exec env ATTNBENCH_DISK_FULL_NS=1 unshare -Urm bash "$0" "$bin"
fi
work=$(mktemp -d)
mnt=$work/disk
mkdir -p "$mnt"
mounted=0
cleanup() {
  if [ "$mounted" = 1 ]; then umount "$mnt" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# the machine figures are kept outside the small disk: measured once per ctest run (the test
# machine_figures, ATTNBENCH_TEST_MACHINE_DIR), else by this warm-up sweep
machine=${ATTNBENCH_TEST_MACHINE_DIR:-$work}/threads-1.json
"$bin" sweep --variant flash --seq 16 --heads 1 --dim 4 --reps 1 --min-time 0 --threads 1 \
  --out "$work/warm" --machine-file "$machine" >/dev/null 2>&1

args=(sweep --variant flash --variant local:window=4 --variant linear --variant performer
      --seq 16,24,32,40,48,56,64,72 --heads 1 --dim 4 --reps 1 --min-time 0 --threads 1
      --machine-file "$machine")
planned=32

if ! mount -t tmpfs -o size=4m tmpfs "$mnt" 2>/dev/null; then
  echo "disk_full_test: skipped: cannot mount a tmpfs here (not root, no user namespace)"
  exit 77
fi
mounted=1
# a filler file leaves 80 KiB free; deleting it is "freeing space"
head -c $((4096 * 1024 - 80 * 1024)) /dev/zero >"$mnt/filler"
how="a 4 MiB tmpfs with 80 KiB free"
set +e
"$bin" "${args[@]}" --out "$mnt/r" >"$work/full.out" 2>"$work/full.err"
rc=$?
set -e
echo "disk_full_test: the disk is $how; the first sweep exited $rc"
fail() {
  echo "disk_full_test: FAIL: $*"
  echo "--- stderr of the sweep on the full disk:"
  cat "$work/full.err"
  exit 1
}
[ "$rc" != 0 ] || fail "the sweep on a full disk exited 0"
grep -q "No space left on device" "$work/full.err" ||
  fail "no message naming the full disk"
grep -q -- "--resume" "$work/full.err" || fail "the message does not name --resume"

check_dir() {  # $1 = results directory; prints the data rows
  python3 - "$1" <<'EOF'
import csv, json, sys, os
d = sys.argv[1]
with open(os.path.join(d, "results.csv"), newline="") as f:
    text = f.read()
assert text.endswith("\n"), "results.csv ends in a torn line"
rows = list(csv.reader(text.splitlines()))
header = rows[0]
for r in rows[1:]:
    assert len(r) == len(header), f"torn row: {r}"
if os.path.exists(os.path.join(d, "benchmark.json")):
    with open(os.path.join(d, "benchmark.json")) as f:
        json.load(f)  # valid JSON, whatever happened
keys = [tuple(r[:header.index("pass") + 1]) for r in rows[1:]]
assert len(keys) == len(set(keys)), "a configuration was measured twice"
print(len(rows) - 1)
EOF
}
before=$(check_dir "$mnt/r") || fail "the directory left by the full disk is not whole"
cp "$mnt/r/results.csv" "$work/before.csv"
echo "disk_full_test: $before of $planned rows kept when the disk filled"
[ "$before" -lt "$planned" ] || fail "the disk never filled (all $planned rows written)"

# free space
rm "$mnt/filler"
"$bin" "${args[@]}" --out "$mnt/r" --resume >"$work/resume.out" 2>"$work/resume.err" ||
  { cat "$work/resume.err"; fail "--resume after freeing space failed"; }
after=$(check_dir "$mnt/r") || fail "the resumed directory is not whole"
[ "$after" = "$planned" ] || fail "$after rows after --resume, $planned planned"
# every row written before the disk filled is still there, unchanged
python3 - "$work/before.csv" "$mnt/r/results.csv" <<'EOF' || fail "a row of the first run was lost or changed"
import sys
before = open(sys.argv[1]).read().splitlines()[1:]
after = set(open(sys.argv[2]).read().splitlines()[1:])
missing = [r for r in before if r not in after]
assert not missing, missing
EOF
python3 - "$mnt/r/benchmark.json" "$planned" <<'EOF' || fail "benchmark.json lacks rows' runs"
import json, sys
b = json.load(open(sys.argv[1]))
assert len(b["benchmarks"]) > 0
EOF
echo "disk_full_test: ok ($before rows before the disk filled, $after after --resume)"
