#!/usr/bin/env bash
# Fuzzes the parsers that take untrusted input with libFuzzer: the variant spec parser
# (fuzz_spec), the .npy reader (fuzz_npy), the .npz reader (fuzz_npz), the attention mask reader
# (fuzz_mask) and the results.csv readers of --resume and merge (fuzz_results), sources in
# tests/fuzz/. Builds them with clang (ASan + UBSan) into build-fuzz/, or in DIR with
# --build-dir DIR (a tree configured with -DATTNBENCH_FUZZ=ON, as scripts/sanitize_test.sh's
# build-asan/ is when clang links libFuzzer), then runs each target for SECONDS (default 60)
# on a copy of its seed corpus tests/fuzz/corpus/<target>/, printing libFuzzer's final stats
# (executions, coverage). Exits non-zero if any target crashes; the crashing input is left in
# <build>/fuzz-run/<target>/artifacts/.
#
#   bash scripts/fuzz.sh [--build-dir DIR] [SECONDS] [TARGET...]   e.g. bash scripts/fuzz.sh 600 npz
set -euo pipefail
cd "$(dirname "$0")/.."
build=""
if [[ ${1:-} == --build-dir ]]; then
  build=${2:?fuzz.sh: --build-dir needs a directory}
  shift 2
fi
seconds=${1:-60}
shift || true
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(spec npy npz mask results)
if ! [[ $seconds =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: SECONDS must be a positive integer, got '$seconds'" >&2
  exit 2
fi
for t in "${targets[@]}"; do
  if [[ ! -f tests/fuzz/fuzz_$t.cpp ]]; then
    echo "fuzz.sh: no fuzz target '$t'; targets: spec, npy, npz, mask, results" >&2
    exit 2
  fi
done

if [[ -n $build ]]; then
  if ! grep -q '^ATTNBENCH_FUZZ:BOOL=ON$' "$build/CMakeCache.txt" 2>/dev/null; then
    echo "fuzz.sh: '$build' is not a build tree configured with -DATTNBENCH_FUZZ=ON" >&2
    exit 2
  fi
else
  build=build-fuzz
  cxx=${CXX:-clang++}
  if ! command -v "$cxx" >/dev/null || ! "$cxx" --version 2>/dev/null | grep -q clang; then
    echo "fuzz.sh: clang++ not found; skipping the fuzzers (they need clang's libFuzzer:" \
         "apt-get install clang libclang-rt-14-dev)"
    exit 0
  fi
  probe=$(mktemp -d)
  trap 'rm -rf "$probe"' EXIT
  echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' \
    > "$probe/probe.cpp"
  if ! "$cxx" -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" 2>/dev/null; then
    echo "fuzz.sh: $cxx cannot link libFuzzer; skipping the fuzzers (apt-get install" \
         "libclang-rt-14-dev, or the libclang-rt-dev matching your clang)"
    exit 0
  fi
  CXX=$cxx cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNBENCH_FUZZ=ON \
    -DATTNBENCH_BUILD_TESTS=OFF >/dev/null
fi
cmake --build "$build" -j"$(nproc)" --target "${targets[@]/#/fuzz_}"

failed=()
for t in "${targets[@]}"; do
  run=$build/fuzz-run/$t
  rm -rf "$run"
  mkdir -p "$run/corpus" "$run/artifacts"
  cp tests/fuzz/corpus/$t/* "$run/corpus/"
  args=(-max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048
        -artifact_prefix="$run/artifacts/")
  [[ -f tests/fuzz/$t.dict ]] && args+=(-dict="tests/fuzz/$t.dict")
  echo "== fuzz_$t: ${seconds}s on $(ls "$run/corpus" | wc -l) seed inputs (log: $run/log)"
  status=0
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} \
    "$build/tests/fuzz/fuzz_$t" "${args[@]}" "$run/corpus" >"$run/log" 2>&1 || status=$?
  # the last status line (executions, cov: edges, ft: features, corpus) and the final stats
  grep -aE '^#[0-9]+' "$run/log" | tail -n 1 || true
  grep -aE '^stat::' "$run/log" || true
  if [[ $status -ne 0 ]]; then
    echo "fuzz_$t: CRASH (exit $status); input: $(ls "$run/artifacts"/* 2>/dev/null | head -n 1)"
    grep -aE 'ERROR: |SUMMARY: |runtime error|deadly signal|Test unit written' "$run/log" | head -n 20
    failed+=("$t")
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz.sh: crashes in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: no crashes in ${targets[*]} (${seconds}s each)"
