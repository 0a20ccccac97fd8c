#!/usr/bin/env bash
# scripts/slurm/submit.sh --quality without a cluster: sbatch, squeue and scancel are fakes on
# PATH that record their arguments and answer job ids, so that the jobs submit.sh submits (which
# script, which part, which array, which dependencies) are checked in a few seconds anywhere.
# Then scripts/slurm/quality.sbatch's errors, and its merge part on two hand-written shards.
# (tests/scripts/slurm_test.sh runs the sharded sweep on a real Slurm.)
#
# usage: tests/scripts/slurm_submit_test.sh ATTNBENCH
set -euo pipefail
bin=${1:?usage: slurm_submit_test.sh ATTNBENCH}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "slurm_submit_test: FAILED: $*" >&2; exit 1; }
[ -x "$bin" ] || fail "no attnbench binary at $bin"
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(SLURM|SBATCH|SRUN|SALLOC)_' || true)
unset ATTNBENCH_SBATCH_OPTIONS

# the fakes: sbatch appends "id<TAB>args" to $tmp/sbatch.log and prints the next id; squeue
# lists the ids of $tmp/queued; scancel records what it cancels
mkdir -p "$tmp/fake"
cat >"$tmp/fake/sbatch" <<'EOF'
#!/usr/bin/env bash
n=$(($(wc -l <"$FAKE_SLURM/sbatch.log" 2>/dev/null || echo 0) + 100))
printf '%s\t%s\n' "$n" "$*" >>"$FAKE_SLURM/sbatch.log"
echo "$n"
EOF
cat >"$tmp/fake/squeue" <<'EOF'
#!/usr/bin/env bash
job=""
while [ $# -gt 0 ]; do [ "$1" = -j ] && job=$2; shift; done
grep -qx "$job" "$FAKE_SLURM/queued" 2>/dev/null && echo "$job"
exit 0
EOF
cat >"$tmp/fake/scancel" <<'EOF'
#!/usr/bin/env bash
echo "$*" >>"$FAKE_SLURM/scancel.log"
EOF
chmod +x "$tmp/fake"/*
export FAKE_SLURM=$tmp PATH=$tmp/fake:$PATH
: >"$tmp/sbatch.log"

# a copy of scripts/, so that the test chooses whether scripts/quality_sweep.sh is there
cp -r "$root/scripts" "$tmp/scripts"
rm -f "$tmp/scripts/quality_sweep.sh" "$tmp/scripts/installed_binary.txt"
submit() { bash "$tmp/scripts/slurm/submit.sh" --bin "$bin" "$@"; }
# job ID: the arguments sbatch was given for job ID
job() { awk -F'\t' -v id="$1" '$1 == id { print $2 }' "$tmp/sbatch.log"; }
has() { grep -qF -- "$2" <<<"$1" || fail "expected '$2' in: $1"; }
hasnt() { ! grep -qF -- "$2" <<<"$1" || fail "did not expect '$2' in: $1"; }

# --- without scripts/quality_sweep.sh: prepare, the recall array, lm, the quality merge ---------
out=$tmp/q1
printed=$(submit --quality --shards 3 --out "$out" --cpus-per-task 2 --time 1:00:00)
echo "$printed" >&2
[ "$(wc -l <"$tmp/sbatch.log")" = 4 ] || fail "expected 4 jobs, got: $(cat "$tmp/sbatch.log")"
has "$(job 100)" "prepare.sbatch"
recall=$(job 101)
has "$recall" "--array=0-2"
has "$recall" "--cpus-per-task=2"
has "$recall" "--time=1:00:00"
has "$recall" "quality.sbatch recall"
hasnt "$recall" "--dependency"
lm=$(job 102)
has "$lm" "--dependency=afterok:100"
has "$lm" "quality.sbatch lm"
hasnt "$lm" "--array"
merge=$(job 103)
has "$merge" "--dependency=afterok:101:102 "
has "$merge" "quality.sbatch merge"
has "$printed" "RECALL_JOB_ID=101 LM_JOB_ID=102 QUALITY_MERGE_JOB_ID=103"
has "$printed" "no budget sweep"
hasnt "$printed" "ARRAY_JOB_ID"
[ "$(cat "$out/shards.txt")" = 3 ] || fail "shards.txt is not 3"
[ ! -e "$out/sweep_options.txt" ] || fail "sweep_options.txt written without a sweep"
grep -qx "quality_merge=103" "$out/jobs.txt" || fail "jobs.txt lacks quality_merge=103"

# a resubmission of shard 1 while the others run: the pending merge cancelled, the lm job
# still queued kept, the new merge after the earlier array too
printf '101\n102\n103\n' >"$tmp/queued"
printed=$(submit --quality --shards 3 --out "$out" --tasks 1)
has "$(job 104)" "--array=1"
hasnt "$(job 104)" "--dependency"
has "$(job 105)" "--dependency=afterok:104:102,afterany:101"
[ -z "$(job 106)" ] || fail "a sixth job was submitted: $(job 106)"
grep -qx "103" "$tmp/scancel.log" || fail "the earlier quality merge 103 was not cancelled"
has "$printed" "lm job 102 of the earlier submission is still queued or running"
rm -f "$tmp/queued"

# --- with scripts/quality_sweep.sh: the budget sweep's array and merge too -----------------------
cat >"$tmp/scripts/quality_sweep.sh" <<'EOF'
quality_budget_options=(--variant flash --variant local --seq 64,128 --heads 1 --dim 16 --reps 1)
EOF
: >"$tmp/sbatch.log"
out=$tmp/q2
printed=$(submit --quality --shards 2 --out "$out")
echo "$printed" >&2
[ "$(wc -l <"$tmp/sbatch.log")" = 6 ] || fail "expected 6 jobs, got: $(cat "$tmp/sbatch.log")"
has "$(job 100)" "prepare.sbatch"
has "$(job 101)" "--dependency=afterok:100"
has "$(job 101)" "sweep_array.sbatch"
has "$(job 102)" "--dependency=afterok:101 "
has "$(job 102)" "merge.sbatch"
has "$(job 103)" "quality.sbatch recall"
has "$(job 104)" "quality.sbatch lm"
has "$(job 105)" "--dependency=afterok:103:104:102 "
has "$(job 105)" "quality.sbatch merge"
has "$printed" "ARRAY_JOB_ID=101 MERGE_JOB_ID=102 RECALL_JOB_ID=103 LM_JOB_ID=104"
[ "$(cat "$out/sweep_options.txt")" = "$(printf '%s\n' --variant flash --variant local --seq \
  64,128 --heads 1 --dim 16 --reps 1)" ] || fail "sweep_options.txt is not the budget sweep"

# --- refusals ------------------------------------------------------------------------------------
: >"$tmp/sbatch.log"
if err=$(submit --quality --shards 2 --out "$tmp/q3" -- --variant flash 2>&1); then
  fail "--quality with sweep options was accepted"
fi
has "$err" "takes no sweep options after --"
if err=$(submit --quality --shards 3 --out "$out" 2>&1); then
  fail "another shard count in the same DIR was accepted"
fi
has "$err" "holds 2 shards, not 3"
[ ! -s "$tmp/sbatch.log" ] || fail "a refused submission submitted jobs: $(cat "$tmp/sbatch.log")"

# --- quality.sbatch: its errors, and the merge part on two hand-written shards -------------------
sb=$root/scripts/slurm/quality.sbatch
export ATTNBENCH_SCRIPTS=$root/scripts ATTNBENCH_RESULTS=$tmp/r ATTNBENCH_PYTHON=$py
if err=$(bash "$sb" 2>&1); then fail "quality.sbatch without a part was accepted"; fi
has "$err" "recall, lm or merge"
if err=$(ATTNBENCH_SHARDS=2 bash "$sb" merge 2>&1); then fail "a merge without shards ran"; fi
has "$err" "none of quality-shard-0..1 and quality-lm"
header=variant,spec,seq,pairs,width,seed,steps,tokens,train_s,accuracy,final_loss,status,message,mode,batch,lr,min_distance,threads
for i in 0 1; do
  mkdir -p "$tmp/r/quality-shard-$i/quality"
  {
    echo "$header"
    echo "flash,flash,32,4,32,$i,3,384,0.5,0.25,3.1,ok,,causal,4,0.003,10,1"
  } >"$tmp/r/quality-shard-$i/quality/recall.csv"
done
ATTNBENCH_SHARDS=2 bash "$sb" merge 2>"$tmp/merge.err" || { cat "$tmp/merge.err" >&2; fail "merge failed"; }
has "$(cat "$tmp/merge.err")" "plot.py needs"
[ "$(cut -d, -f6 "$tmp/r/merged/quality/recall.csv" | tail -n +2 | sort | tr '\n' ' ')" = "0 1 " ] ||
  fail "the merged recall.csv is not the two shards' rows: $(cat "$tmp/r/merged/quality/recall.csv")"
echo "slurm_submit_test: passed" >&2
