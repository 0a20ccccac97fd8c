#!/usr/bin/env bash
# Builds attnbench with AddressSanitizer and UBSan into build-asan/ and runs the whole test
# suite there. Any undefined behaviour stops the process (compiled with
# -fno-sanitize-recover=all, and halt_on_error below). Tests that cannot run under the
# sanitizers skip themselves and say why (tests/test_util.h: the allocation-count tests and
# the death tests that cap the address space). The Slurm test (label slurm,
# tests/scripts/slurm_test.sh) is left out: it exercises the scheduler, not the code, and runs
# in the plain build's suite.
#
# The compiler is clang++ where it is installed (scripts/deps.sh --dev), else g++; CXX chooses
# another. With clang, the same tree is also the clang build (warnings are errors, as with
# GCC) and, where libFuzzer links, the fuzzers' build: every object carries libFuzzer's
# coverage instrumentation as well (-DATTNBENCH_FUZZ=ON), so `scripts/fuzz.sh --build-dir
# build-asan` runs the fuzz targets without compiling the library a third time.
#
# Debug information is line tables only (RelWithDebInfo's -g overridden): reports keep their
# file:line stacks, and the build takes a third of the time full debug information takes.
#
# usage: scripts/sanitize_test.sh [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build-asan

bash scripts/deps.sh
cxx=${CXX:-}
if [[ -z $cxx ]]; then
  if command -v clang++ >/dev/null; then cxx=clang++; else cxx=g++; fi
fi
config=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNBENCH_SANITIZE=ON)
if "$cxx" --version 2>/dev/null | grep -q clang; then
  config+=("-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG")
  probe=$(mktemp -d)
  echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' \
    >"$probe/probe.cpp"
  if "$cxx" -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" \
    2>/dev/null; then
    config+=(-DATTNBENCH_FUZZ=ON)
  else
    echo "sanitize_test: $cxx cannot link libFuzzer; the fuzz targets are not built here" >&2
  fi
  rm -rf "$probe"
else
  config+=("-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")
fi
echo "sanitize_test: $("$cxx" --version | head -n 1), ${config[*]}" >&2
start=$(date +%s)
CXX=$cxx cmake -S . -B "$dir" "${config[@]}" >/dev/null
cmake --build "$dir" -j"$(nproc)"
built=$(date +%s)

export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# LeakSanitizer stops the world with ptrace-like machinery that some sandboxes and debuggers
# refuse ("LeakSanitizer has encountered a fatal error"); probe it once and leave it off
# where it cannot work, saying so.
leaks=1
probe=$(ASAN_OPTIONS=detect_leaks=1 "$dir/attnbench" list 2>&1 >/dev/null || true)
if grep -q "LeakSanitizer" <<<"$probe"; then
  leaks=0
  echo "sanitize_test: LeakSanitizer cannot run here; leak detection is off" >&2
fi
# allocator_may_return_null: an allocation too large for the machine throws std::bad_alloc
# (as it does without ASan) instead of ending the process.
export ASAN_OPTIONS=detect_leaks=$leaks:allocator_may_return_null=1:abort_on_error=0:check_initialization_order=1

status=0
ctest --test-dir "$dir" -j"$(nproc)" --output-on-failure --timeout 1500 -LE slurm "$@" ||
  status=$?
end=$(date +%s)
echo "sanitize_test: build $((built - start)) s, tests $((end - built)) s, exit $status" >&2
exit $status
