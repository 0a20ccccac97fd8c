#!/usr/bin/env bash
# Builds attnbench with AddressSanitizer and UBSan (RelWithDebInfo, into build-asan/) and runs
# the whole test suite there. Any undefined behaviour stops the process (compiled with
# -fno-sanitize-recover=all, and halt_on_error below). Tests that cannot run under the
# sanitizers skip themselves and say why (tests/test_util.h: the allocation-count tests and
# the death tests that cap the address space). The Slurm test (label slurm, tests/slurm_test.sh)
# is left out: it exercises the scheduler, not the code, and runs in the plain build's suite.
#
# usage: scripts/sanitize_test.sh [BUILD_TYPE] [ctest args...]   (BUILD_TYPE: RelWithDebInfo)
set -euo pipefail
cd "$(dirname "$0")/.."
build_type=${1:-RelWithDebInfo}
shift || true
dir=build-asan
[[ $build_type == RelWithDebInfo ]] || dir=build-asan-$(echo "$build_type" | tr 'A-Z' 'a-z')

bash scripts/deps.sh
start=$(date +%s)
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE="$build_type" -DATTNBENCH_SANITIZE=ON >/dev/null
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
