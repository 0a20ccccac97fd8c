#!/usr/bin/env bash
# Builds attnbench (library, binary, tests) with clang++ into build-clang/ (Release, warnings
# are errors as with GCC) and runs its tests but the Slurm test (label slurm, run by
# scripts/test.sh in the GCC build). Exits 0 with a message where clang++ is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang++ >/dev/null; then
  echo "clang_build.sh: clang++ not found; skipping the clang build (apt-get install clang)"
  exit 0
fi
CXX=clang++ cmake -S . -B build-clang -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-clang -j"$(nproc)"
ctest --test-dir build-clang -j"$(nproc)" --output-on-failure -LE slurm
