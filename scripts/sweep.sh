#!/usr/bin/env bash
# Installs what is missing, builds, runs the default sweep into results/default (or the
# directory given as the first argument), then draws its figures and report with
# scripts/plot.py (DIR/plots/*.png, DIR/report.md). Extra arguments replace the default
# sweep and go to `attnbench sweep` as they are.
#
# The default sweep is one `attnbench sweep` of three sets of problems (the others given with
# --also, so that the progress line's ETA covers them all):
#   1. speed: every variant with its defaults, n = 256..8192, causal off and on, gaussian
#      inputs;
#   2. accuracy: every variant at n = 256..8192 without causal masking, on the other input
#      distributions (local, clustered, lowrank) and on gaussian inputs sharpened by
#      --scale 2 and 4, so that the error figure has a panel each. The float64 reference of
#      each problem is computed once and reused for every variant.
# Finished rows are kept: running the script again resumes where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/default}
shift || true
bash scripts/build.sh
if [ $# -eq 0 ]; then
  ./build/attnbench sweep --out "$out" --resume --seq 256..8192 --causal both \
    --also='--seq 256..8192 --causal off --input local,clustered,lowrank' \
    --also='--seq 256..8192 --causal off --input gaussian --scale 2,4'
else
  ./build/attnbench sweep --out "$out" "$@"
fi
/usr/bin/python3 scripts/plot.py "$out"
