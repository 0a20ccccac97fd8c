#!/usr/bin/env bash
# Installs what is missing, builds, and runs the default sweep into results/default
# (or the directory given as the first argument). Extra arguments go to `attnbench sweep`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/default}
shift || true
bash scripts/build.sh
./build/attnbench sweep --out "$out" "$@"
