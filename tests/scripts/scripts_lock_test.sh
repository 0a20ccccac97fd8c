#!/usr/bin/env bash
# The scripts never lose results (issue 43): scripts/plot.py on a small results directory (a few
# rows of results/reference) holds the directory's lock (DIR/.attnbench.lock, the lock
# `attnbench sweep` takes) and writes every file whole or not at all.
#   - While another process holds the lock, plot.py is refused with one line naming it (pid,
#     host, command), exit code 2, and writes nothing; with an unreadable lock file it is still
#     refused, naming an unknown process; once the holder is gone a later run takes the lock.
#   - A write that fails (ENOSPC injected into the fsync of one file's temporary file) exits 2
#     naming that file, leaves the earlier file as it was and no temporary file behind, and
#     removes no earlier figure; results.csv and meta.json are never changed.
#   - With an attnbench binary that takes the lock (argument 1, optional), a sweep into the
#     directory the script holds is refused, naming the script.
# Also runs the unit tests of the lock and of the writes (tests/python/test_scripts_lock.py)
# when pytest is present.
set -euo pipefail
bin=${1:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=/usr/bin/python3
tmp=$(mktemp -d)
holder_pid=
cleanup() {
  if [ -n "$holder_pid" ]; then kill -9 "$holder_pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "scripts_lock_test: $*" >&2; exit 1; }

if "$py" -c "import pytest" 2>/dev/null; then
  "$py" -m pytest -q -p no:cacheprovider "$root/tests/python/test_scripts_lock.py" ||
    fail "tests/python/test_scripts_lock.py failed"
fi

# A small results directory: flash and full at n = 256 and 512 of the reference, with its meta.
d="$tmp/run"
mkdir -p "$d/plots"
"$py" - "$root/results/reference/results.csv" "$d/results.csv" <<'EOF'
import csv, sys
with open(sys.argv[1], newline="") as f:
    reader = csv.DictReader(f)
    rows = [r for r in reader
            if r["pass"] == "fwd" and r["input"] == "gaussian" and r["causal"] == "0"
            and r["scale"] == "1" and r["n"] in ("256", "512")
            and r["spec"] in ("full", "flash:block_q=64,block_k=256")]
    fields = reader.fieldnames
assert len(rows) == 4, len(rows)
with open(sys.argv[2], "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
EOF
cp "$root/results/reference/meta.json" "$d/"
# an earlier run's outputs: its report, a figure this run draws again and one it does not draw
echo "earlier report" >"$d/report.md"
echo "earlier time figure" >"$d/plots/time_vs_n.png"
echo "earlier layer figure" >"$d/plots/layer.png"
sums() { (cd "$d" && md5sum results.csv meta.json report.md plots/*.png); }
inputs() { (cd "$d" && md5sum results.csv meta.json); }
before_inputs=$(inputs)
before=$(sums)
no_temporaries() {
  local left
  left=$(find "$d" -name '*.tmp')
  [ -z "$left" ] || fail "$1: temporary files left behind: $left"
}

# A process holding the lock, as any writer does (attnbench_results.results_lock), with a
# command line to recognise.
cat >"$tmp/holder.py" <<EOF
import sys, time
sys.path.insert(0, "$root/scripts")
from attnbench_results import results_lock
with results_lock(sys.argv[1], "holder"):
    print("locked", flush=True)
    time.sleep(120)
EOF
# A process holding flock on the lock file after writing something that is not JSON into it.
cat >"$tmp/raw_holder.py" <<'EOF'
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, b"not json")
print("locked", flush=True)
time.sleep(120)
EOF
hold() {  # hold SCRIPT ARGS...: starts it and waits for its "locked"
  exec 3< <("$py" "$@")
  holder_pid=$!
  local line
  read -r -t 30 line <&3 || fail "the holder $1 did not take the lock"
  [ "$line" = locked ] || fail "the holder $1 said '$line'"
}
release() {
  kill -9 "$holder_pid"
  wait "$holder_pid" 2>/dev/null || true
  holder_pid=
  exec 3<&-
}
refused() {  # refused WHAT EXPECTED: plot.py must exit 2 with one line containing EXPECTED
  local code=0
  "$py" "$root/scripts/plot.py" "$d" >"$tmp/out" 2>"$tmp/err" || code=$?
  [ "$code" = 2 ] || fail "$1: plot.py exited $code, not 2: $(cat "$tmp/err")"
  [ "$(wc -l <"$tmp/err")" = 1 ] || fail "$1: not one line on stderr: $(cat "$tmp/err")"
  grep -qF -- "$2" "$tmp/err" || fail "$1: stderr lacks '$2': $(cat "$tmp/err")"
  [ "$(sums)" = "$before" ] || fail "$1: plot.py changed the directory although refused"
}

# --- a second writer is refused, naming the first ----------------------------------------------
hold "$tmp/holder.py" "$d" --pretend sweep
refused "held by a script" "plot.py: error: results directory '$d' is being written by another process (pid $holder_pid on $(hostname), started "
grep -qF -- ": $tmp/holder.py $d --pretend sweep); wait for it to finish or write elsewhere" \
  "$tmp/err" || fail "the refusal does not quote the holder's command: $(cat "$tmp/err")"
grep -qE "started [0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z: " "$tmp/err" ||
  fail "the refusal does not give the holder's start in UTC: $(cat "$tmp/err")"

# --- a sweep (the binary) is refused too, naming the script -----------------------------------
takes_lock() {  # whether the binary (or the libattnbench it loads) has the lock
  local f
  [ -n "$bin" ] || return 1
  for f in "$bin" $(ldd "$bin" 2>/dev/null | awk '/libattnbench/ {print $3}'); do
    grep -qaF ".attnbench.lock" "$f" && return 0
  done
  return 1
}
if takes_lock; then
  code=0
  "$bin" sweep --out "$d" --variant full --seq 128 --heads 1 --dim 16 --reps 1 \
    >/dev/null 2>"$tmp/sweep.err" || code=$?
  [ "$code" != 0 ] || fail "attnbench sweep wrote into a directory plot.py's lock holds"
  grep -qF "being written by another process (pid $holder_pid on $(hostname), started " \
    "$tmp/sweep.err" || fail "attnbench sweep's refusal does not name the holder: $(cat "$tmp/sweep.err")"
  [ "$(inputs)" = "$before_inputs" ] || fail "attnbench sweep changed a locked directory"
fi
release

# --- an unreadable lock file: still refused, the holder unknown --------------------------------
hold "$tmp/raw_holder.py" "$d/.attnbench.lock"
refused "unreadable lock file" "is being written by another process (an unknown process); wait for it to finish or write elsewhere"
release

# --- a failed write keeps the earlier file -------------------------------------------------------
# plot.py run with fsync failing (ENOSPC) for the temporary file of one output
cat >"$tmp/full_disk.py" <<'EOF'
import errno, os, runpy, sys
victim, script = sys.argv[1], sys.argv[2]
real = os.fsync
def fsync(fd):
    name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    if name.startswith("." + victim + ".") and name.endswith(".tmp"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(fd)
os.fsync = fsync
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
EOF
failed_write() {  # failed_write FILE: plot.py failing to write DIR/FILE exits 2 naming it
  local code=0
  "$py" "$tmp/full_disk.py" "$(basename "$1")" "$root/scripts/plot.py" "$d" \
    >/dev/null 2>"$tmp/err" || code=$?
  [ "$code" = 2 ] || fail "a failed write of $1: plot.py exited $code, not 2: $(cat "$tmp/err")"
  grep -qxF "plot.py: error: cannot write '$d/$1': No space left on device; the previous file is left as it was" \
    "$tmp/err" || fail "a failed write of $1: no error naming it: $(cat "$tmp/err")"
  no_temporaries "a failed write of $1"
  [ "$(inputs)" = "$before_inputs" ] || fail "a failed write of $1 changed results.csv or meta.json"
}
# the first figure: nothing changes (the lock was released when its holder was killed)
failed_write plots/time_vs_n.png
[ "$(sums)" = "$before" ] || fail "a failed write of the first figure changed the directory"
# the report, written after the figures: the earlier report and the stale figure are kept
failed_write report.md
[ "$(cat "$d/report.md")" = "earlier report" ] || fail "a failed write replaced report.md"
[ "$(cat "$d/plots/layer.png")" = "earlier layer figure" ] ||
  fail "a failed run removed an earlier figure (layer.png)"

# --- a later run succeeds ------------------------------------------------------------------------
"$py" "$root/scripts/plot.py" "$d" >/dev/null 2>"$tmp/err" ||
  fail "plot.py failed once the lock was free: $(cat "$tmp/err")"
grep -q "^# attnbench report" "$d/report.md" || fail "report.md was not written"
[ "$(head -c 8 "$d/plots/time_vs_n.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] ||
  fail "time_vs_n.png is not a PNG file"
[ ! -e "$d/plots/layer.png" ] || fail "the stale layer.png (no layer rows) was left"
[ "$(inputs)" = "$before_inputs" ] || fail "plot.py changed results.csv or meta.json"
no_temporaries "a successful run"
"$py" - "$d/.attnbench.lock" <<'EOF' || fail "the lock file does not name the last writer"
import json, sys
info = json.load(open(sys.argv[1]))
assert set(info) == {"pid", "host", "command", "started"}, info
assert info["command"].split()[0].endswith("plot.py"), info
EOF
echo "scripts_lock_test: ok"
