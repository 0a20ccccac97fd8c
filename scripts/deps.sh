#!/usr/bin/env bash
# Installs the Debian packages attnbench needs, if any are missing (as root, or through sudo).
# Usage: scripts/deps.sh [--dev]
set -euo pipefail

packages=(
  cmake g++ make pkg-config git
  libeigen3-dev libopenblas-openmp-dev libbenchmark-dev libfmt-dev nlohmann-json3-dev
  libcli11-dev libgtest-dev libzip-dev
  libbenchmark-tools python3 python3-scipy python3-matplotlib python3-pandas
  python3-numpy python3-torch
  python3-dev pybind11-dev python3-pybind11 python3-pytest
)

# --dev adds what the clang build, the sanitizer runs and the fuzzers need (scripts/clang_build.sh,
# scripts/sanitize_test.sh, scripts/fuzz.sh, scripts/format_check.sh): clang 14 with its sanitizer
# and libFuzzer runtimes, and clang-format.
if [ "${1:-}" = "--dev" ]; then
  packages+=(clang libclang-rt-14-dev clang-format)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "attnbench: installing ${missing[*]}" >&2
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "attnbench: missing packages (${missing[*]}) and not root; install them with apt-get" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
