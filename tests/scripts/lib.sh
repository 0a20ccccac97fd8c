# The set-up the plot script tests share, sourced after `bin=$1`:
#   . "$(dirname "$0")/lib.sh" NAME
# sets root (the source tree), py (the system python with numpy, pandas and matplotlib), tmp (a
# directory removed on exit) and machine (the directory of the machine figures measured once per
# ctest run, ATTNBENCH_TEST_MACHINE_DIR, else tmp: the first sweep measures them there), and
# defines fail MESSAGE (prints "NAME: MESSAGE" to stderr, exits 1) and png FILE (fails unless
# FILE is a PNG file).
set -euo pipefail
test_name=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "$test_name: $*" >&2; exit 1; }
machine=${ATTNBENCH_TEST_MACHINE_DIR:-$tmp}
png() {
  [ "$(head -c 8 "$1" 2>/dev/null | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] ||
    fail "$1 is missing or not a PNG file"
}
# figures DIR NAME...: each DIR/plots/NAME.png is a PNG file that DIR/report.md embeds
figures() {
  local dir=$1 name
  shift
  for name in "$@"; do
    png "$dir/plots/$name.png"
    grep -qF "](plots/$name.png)" "$dir/report.md" || fail "$dir/report.md does not embed $name.png"
  done
}
# plot ARGS...: scripts/plot.py of the source tree
plot() { "$py" "$root/scripts/plot.py" "$@"; }
# same_drawing FIGURE A.json B.json: the two --debug-json files record the same FIGURE
same_drawing() {
  "$py" -c 'import json, sys
f, a, b = sys.argv[1:]
sys.exit(json.load(open(a))[f] != json.load(open(b))[f])' "$@"
}
