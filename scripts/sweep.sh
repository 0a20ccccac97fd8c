#!/usr/bin/env bash
# Installs what is missing, builds, runs the default sweep into results/default (or the
# directory given as the first argument), then draws its figures and report with
# scripts/plot.py (DIR/plots/*.png, DIR/report.md). Extra arguments go to `attnbench sweep`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/default}
shift || true
bash scripts/build.sh
# Without extra arguments: every variant, n = 256..8192, causal off and on.
if [ $# -eq 0 ]; then set -- --seq 256..8192 --causal both; fi
./build/attnbench sweep --out "$out" "$@"
/usr/bin/python3 scripts/plot.py "$out" --attnbench ./build/attnbench
