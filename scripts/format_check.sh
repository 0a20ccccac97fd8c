#!/usr/bin/env bash
# Checks every C++ file git tracks against the committed .clang-format (clang-format 14, as
# Debian ships it; scripts/deps.sh --dev installs it). Prints the files that differ and exits 1
# if there are any. With --fix, rewrites them in place instead.
set -euo pipefail
cd "$(dirname "$0")/.."
fmt=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$fmt" ]; then
  echo "format_check: clang-format not found; install it with: bash scripts/deps.sh --dev" >&2
  exit 2
fi
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.h.in' | grep -v '^tests/fuzz/corpus/')
if [ "${1:-}" = "--fix" ]; then
  "$fmt" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  if ! "$fmt" --dry-run --Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format_check: ${#bad[@]} of ${#files[@]} files differ from .clang-format:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "format_check: run 'bash scripts/format_check.sh --fix' to rewrite them" >&2
  exit 1
fi
echo "format_check: ${#files[@]} files match .clang-format"
