#!/usr/bin/env bash
# Runs an attnbench sweep on a Slurm cluster as N shards: one command submits
#   1. (the default sweep only) prepare.sbatch: the trained model's inputs, once;
#   2. sweep_array.sbatch as a job array, `sbatch --array=0-(N-1)`: task i runs shard i/N of
#      the sweep into DIR/shard-i, with --threads the CPUs of the task (--cpus-per-task), pinned;
#   3. merge.sbatch with --dependency=afterok on the array: `attnbench merge` of the shards into
#      DIR/merged, then scripts/plot.py (DIR/merged/report.md, DIR/merged/plots).
# It prints the job ids and where the results land, and returns at once.
# With --quality it submits the whole quality suite (what scripts/sweep.sh --quality runs):
#   1. prepare.sbatch, as for the default sweep (the budget sweep's trained inputs, and the
#      corpus the language part reads);
#   2. the budget sweep (the options of scripts/quality_sweep.sh) as the array and merge above,
#      when scripts/quality_sweep.sh is there;
#   3. quality.sbatch recall as a job array of N tasks: task i runs shard i/N of the recall runs
#      into DIR/quality-shard-i;
#   4. quality.sbatch lm, one job after the prepare job: the language part into DIR/quality-lm;
#   5. quality.sbatch merge with --dependency=afterok on 2 to 4: `quality.py merge` of them
#      into DIR/merged/quality, then scripts/plot.py (DIR/merged/report.md).
#
# usage: scripts/slurm/submit.sh --shards N --out DIR [--quality] [--cpus-per-task C]
#          [--partition P] [--time T] [--tasks LIST] [--strict] [--allow-missing]
#          [--bin ATTNBENCH] [-- SWEEP OPTIONS...]
#   --shards N          the number of shards (array tasks), 1..10000
#   --out DIR           the results directory (created; on a file system every node sees)
#   --quality           the quality suite (above) instead of a sweep; no SWEEP OPTIONS
#   --cpus-per-task C   CPUs (and threads) of each shard (default 1)
#   --partition P       the Slurm partition (default: the cluster's default partition)
#   --time T            the time limit of each shard, and of the quality suite's lm job
#                       (sbatch --time; default: the partition's)
#   --tasks LIST        submit only these shards again (sbatch --array syntax: 3 or 1,4-5), and
#                       a new merge job after them (the earlier one, if still pending, is
#                       cancelled): a failed or cancelled shard resumes where it stopped; the
#                       sweep is the one DIR/sweep_options.txt holds unless given after --.
#                       With --quality: these shards of the recall array and the budget sweep,
#                       the lm job unless it is still queued or running, and new merge jobs
#   --strict            `attnbench merge --strict`: refuse shards run on different CPU models
#   --allow-missing     `attnbench merge --allow-missing`: merge although configurations miss
#   --bin ATTNBENCH     the attnbench binary (default: the installation's, or build/attnbench)
#   -- SWEEP OPTIONS    the sweep (options of `attnbench sweep` but --out, --resume, --shard and
#                       --threads); without them, the project's default sweep
#                       (scripts/default_sweep.sh, as scripts/sweep.sh runs it)
# The sweep's options are written to DIR/sweep_options.txt, one argument a line; submitting
# again into the same DIR must give the same sweep and N (the shards resume).
# Environment: SBATCH_* variables apply to every job as usual; ATTNBENCH_SBATCH_OPTIONS, extra
# sbatch options for every job (split at spaces), e.g. "--account=A --qos=Q".
set -euo pipefail
usage() {
  sed -n '/^# usage:/,/^# Environment/p' "$0" | sed '$d; s/^# \{0,1\}//'
}
die() { echo "submit.sh: $*" >&2; exit 2; }
need_value() { if [ $# -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value (see --help)"; fi; }

here=$(cd "$(dirname "$0")" && pwd)
scripts=$(cd "$here/.." && pwd)
shards="" out="" tasks="" cpus=1 partition="" time_limit="" bin="" merge_options=() quality=0
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --shards) need_value "$@"; shards=$2; shift 2 ;;
    --shards=*) shards=${1#*=}; shift ;;
    --out) need_value "$@"; out=$2; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --cpus-per-task | -c) need_value "$@"; cpus=$2; shift 2 ;;
    --cpus-per-task=*) cpus=${1#*=}; shift ;;
    --partition | -p) need_value "$@"; partition=$2; shift 2 ;;
    --partition=*) partition=${1#*=}; shift ;;
    --time | -t) need_value "$@"; time_limit=$2; shift 2 ;;
    --time=*) time_limit=${1#*=}; shift ;;
    --tasks) need_value "$@"; tasks=$2; shift 2 ;;
    --tasks=*) tasks=${1#*=}; shift ;;
    --bin) need_value "$@"; bin=$2; shift 2 ;;
    --bin=*) bin=${1#*=}; shift ;;
    --quality) quality=1; shift ;;
    --strict) merge_options+=(--strict); shift ;;
    --allow-missing) merge_options+=(--allow-missing); shift ;;
    --) shift; break ;;
    *) die "unknown argument '$1' (see --help; the sweep's options go after --)" ;;
  esac
done
sweep=("$@")

[ -n "$shards" ] || die "--shards N is required (see --help)"
if ! [[ $shards =~ ^[1-9][0-9]{0,4}$ ]] || ((shards > 10000)); then
  die "--shards must be an integer from 1 to 10000, not '$shards'"
fi
[ -n "$out" ] || die "--out DIR is required (see --help)"
if ! [[ $cpus =~ ^[1-9][0-9]{0,3}$ ]]; then
  die "--cpus-per-task must be an integer from 1 to 9999, not '$cpus'"
fi
[ -z "$partition" ] || [[ $partition =~ ^[A-Za-z0-9_.,-]+$ ]] ||
  die "--partition '$partition' is not a partition name"
[ -z "$tasks" ] || [[ $tasks =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]] ||
  die "--tasks must list shard ids like 3 or 1,4-5, not '$tasks'"
for t in ${tasks//[,-]/ }; do
  ((10#$t < shards)) || die "--tasks: $t is not a shard of $shards (ids run 0..$((shards - 1)))"
done
for a in "${sweep[@]}"; do
  case $a in
    --out | --out=* | --resume | --shard | --shard=* | --shard-plan* | --threads | --threads=*)
      die "the sweep options must not hold $a: submit.sh sets --out, --resume, --shard and --threads" ;;
    *$'\n'*) die "a sweep option holds a line break: '$a'" ;;
  esac
done
# --quality: the budget sweep of scripts/quality_sweep.sh (quality_budget_options), if there
run_sweep=1
if [ $quality = 1 ]; then
  [ ${#sweep[@]} -eq 0 ] || die "--quality runs the quality suite's own budget sweep" \
    "(scripts/quality_sweep.sh); it takes no sweep options after -- (got: ${sweep[*]})"
  for f in "$scripts/quality.py" "$scripts/quality_recall.sh" "$here/quality.sbatch"; do
    [ -f "$f" ] || die "--quality needs $f"
  done
  if [ -f "$scripts/quality_sweep.sh" ]; then
    # shellcheck source=/dev/null
    source "$scripts/quality_sweep.sh"
    # shellcheck disable=SC2154  # quality_sweep.sh defines it
    if ! declare -p quality_budget_options >/dev/null 2>&1 || [ ${#quality_budget_options[@]} = 0 ]; then
      die "$scripts/quality_sweep.sh defines no quality_budget_options (the budget sweep's options)"
    fi
    sweep=("${quality_budget_options[@]}")
  else
    run_sweep=0
  fi
fi
command -v sbatch >/dev/null || die "sbatch not found: this is not a Slurm submission host"

if [ -z "$bin" ]; then
  if [ -f "$scripts/installed_binary.txt" ]; then
    read -r bin <"$scripts/installed_binary.txt"
    [[ $bin == /* ]] || bin=$scripts/$bin
  else
    bin=$scripts/../build/attnbench
  fi
fi
[ -x "$bin" ] || die "no attnbench binary at $bin (build it with scripts/build.sh, or pass --bin)"
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")

# shellcheck source=scripts/default_sweep.sh
source "$scripts/default_sweep.sh"
if [ $quality = 0 ] && [ ${#sweep[@]} -eq 0 ] && [ -n "$tasks" ] && [ -f "$out/sweep_options.txt" ]; then
  mapfile -t sweep <"$out/sweep_options.txt"  # a resubmission: the sweep submitted before
fi
[ ${#sweep[@]} -gt 0 ] || [ $run_sweep = 0 ] || sweep=("${default_sweep_options[@]}")
default_sweep=0
[ $quality = 1 ] ||
  [ "$(printf '%s\n' "${sweep[@]}")" != "$(printf '%s\n' "${default_sweep_options[@]}")" ] ||
  default_sweep=1
mkdir -p "$out/logs" || die "cannot create $out/logs"
out=$(cd "$out" && pwd)
options_file=$out/sweep_options.txt
new_options=$(printf '%s\n' "${sweep[@]}")
if [ -f "$options_file" ] && [ $run_sweep = 1 ]; then
  [ "$(cat "$options_file")" = "$new_options" ] ||
    die "$out holds another sweep ($options_file); choose another --out"
fi
if [ -f "$out/shards.txt" ]; then
  [ "$(cat "$out/shards.txt")" = "$shards" ] ||
    die "$out holds $(cat "$out/shards.txt") shards, not $shards; choose another --out"
fi
# the sweep must parse before anything is submitted: its shard plan (the estimated cost of each
# shard, and their imbalance) runs nothing; it is the split the tasks compute, on their threads
plan="no sweep: scripts/quality_sweep.sh (the budget sweep) is not there"
if [ $run_sweep = 1 ] &&
  ! plan=$("$bin" sweep "${sweep[@]}" --shard-plan "$shards" --threads "$cpus" --out "$out" 2>&1); then
  # the trained inputs of the default sweep and of the quality suite's budget sweep are built
  # by the prepare job, before the shards
  if [ $((default_sweep + quality)) -gt 0 ] && [ -z "$tasks" ] &&
    grep -q 'trained inputs not found' <<<"$plan"; then
    plan="no shard plan yet: it needs the trained inputs, which the prepare job builds first"
  else
    die "attnbench rejects the sweep or --shard-plan:"$'\n'"$plan"
  fi
fi
[ $run_sweep = 0 ] || printf '%s\n' "$new_options" >"$options_file"
echo "$shards" >"$out/shards.txt"
printf '%s\n' "$plan" >"$out/shard_plan.txt"

export ATTNBENCH_RESULTS=$out ATTNBENCH_SHARDS=$shards ATTNBENCH_BIN=$bin
export ATTNBENCH_SCRIPTS=$scripts ATTNBENCH_SWEEP_OPTIONS=$options_file
export ATTNBENCH_DEFAULT_SWEEP=$default_sweep ATTNBENCH_MERGE_OPTIONS="${merge_options[*]}"
# the Python package attnbench of the build, for swap_eval.py after the default sweep
if [ -d "$scripts/../build/python/attnbench" ] && [ ! -f "$scripts/installed_binary.txt" ]; then
  PYTHONPATH="$(cd "$scripts/../build/python" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH
fi

common=(--parsable --export=ALL --chdir="$out")
[ -z "$partition" ] || common+=(--partition="$partition")
read -r -a extra <<<"${ATTNBENCH_SBATCH_OPTIONS:-}"
common+=("${extra[@]}")
job_id() { local id=${1%%;*}; [[ $id =~ ^[0-9]+$ ]] || die "sbatch answered '$1', not a job id"; echo "$id"; }

# a resubmission (--tasks): the last job of key KEY in DIR/jobs.txt (KEY=id lines) ...
earlier_job() { [ -f "$out/jobs.txt" ] && sed -n "s/^$1=//p" "$out/jobs.txt" | tail -n 1; }
# ... cancelled when still pending (an earlier merge job waits for shards that failed), ...
cancel_pending() {
  local id
  id=$(earlier_job "$1") || return 0
  if [ -n "$id" ] && squeue -h -j "$id" -t PENDING -o %i 2>/dev/null | grep -q .; then
    scancel "$id" && echo "cancelled the earlier $2 job $id"
  fi
}
# ... and the jobs of KEY still queued or running, as afterany dependencies of a new merge
still_queued() {
  local a
  [ -f "$out/jobs.txt" ] || return 0
  while read -r a; do
    if squeue -h -j "$a" -o %i 2>/dev/null | grep -q .; then printf ',afterany:%s' "$a"; fi
  done < <(sed -n "s/^$1=//p" "$out/jobs.txt")
}

prepare="" array="" merge="" array_dependency=()
if [ $((default_sweep + quality)) -gt 0 ] && [ -z "$tasks" ]; then
  prepare=$(sbatch "${common[@]}" --cpus-per-task="$cpus" --output="$out/logs/prepare-%j.out" \
    "$here/prepare.sbatch") || die "sbatch refused the prepare job"
  prepare=$(job_id "$prepare")
  array_dependency=(--dependency=afterok:"$prepare")
  echo "prepare job $prepare: the trained model's inputs (scripts/train_lm.py, capture_qkv.py)"
fi
shard_options=(--array="${tasks:-0-$((shards - 1))}" --cpus-per-task="$cpus")
[ -z "$time_limit" ] || shard_options+=(--time="$time_limit")
if [ $run_sweep = 1 ]; then
  array=$(sbatch "${common[@]}" "${array_dependency[@]}" "${shard_options[@]}" \
    --output="$out/logs/shard-%a-%A.out" "$here/sweep_array.sbatch") ||
    die "sbatch refused the job array"
  array=$(job_id "$array")
  [ -z "$tasks" ] || cancel_pending merge merge
  after=afterok:$array
  [ -z "$tasks" ] || after+=$(still_queued array)
  merge=$(sbatch "${common[@]}" --dependency="$after" --cpus-per-task=1 \
    --output="$out/logs/merge-%j.out" "$here/merge.sbatch") || die "sbatch refused the merge job"
  merge=$(job_id "$merge")
  printf 'array=%s\nmerge=%s\n' "$array" "$merge" >>"$out/jobs.txt"
fi

if [ $quality = 1 ]; then
  recall=$(sbatch "${common[@]}" "${shard_options[@]}" --job-name=attnbench-recall \
    --output="$out/logs/recall-%a-%A.out" "$here/quality.sbatch" recall) ||
    die "sbatch refused the recall job array"
  recall=$(job_id "$recall")
  # the language part is one job: a resubmission leaves one still queued or running alone (two
  # would contend for quality-lm) and submits it again otherwise (it resumes)
  lm=""
  if [ -n "$tasks" ]; then
    lm=$(earlier_job lm) || true
    if [ -n "$lm" ] && squeue -h -j "$lm" -o %i 2>/dev/null | grep -q .; then
      echo "lm job $lm of the earlier submission is still queued or running"
    else
      lm=""
    fi
  fi
  if [ -z "$lm" ]; then
    lm_options=(--cpus-per-task="$cpus")
    [ -z "$time_limit" ] || lm_options+=(--time="$time_limit")
    lm=$(sbatch "${common[@]}" "${array_dependency[@]}" "${lm_options[@]}" \
      --job-name=attnbench-lm --output="$out/logs/lm-%j.out" "$here/quality.sbatch" lm) ||
      die "sbatch refused the lm job"
    lm=$(job_id "$lm")
  fi
  [ -z "$tasks" ] || cancel_pending quality_merge "quality merge"
  after=afterok:$recall:$lm${merge:+:$merge}
  [ -z "$tasks" ] || after+=$(still_queued recall)
  quality_merge=$(sbatch "${common[@]}" --dependency="$after" --cpus-per-task=1 \
    --job-name=attnbench-quality-merge --output="$out/logs/quality-merge-%j.out" \
    "$here/quality.sbatch" merge) || die "sbatch refused the quality merge job"
  quality_merge=$(job_id "$quality_merge")
  printf 'recall=%s\nlm=%s\nquality_merge=%s\n' "$recall" "$lm" "$quality_merge" \
    >>"$out/jobs.txt"
fi

echo "$plan"
if [ $run_sweep = 1 ]; then
  echo "array job $array: shards ${tasks:-0-$((shards - 1))} of $shards (${cpus} CPU(s) each)" \
    "into $out/shard-<i>"
  echo "merge job $merge (after the array succeeds): $out/merged, report $out/merged/report.md"
fi
if [ $quality = 1 ]; then
  echo "recall array job $recall: shards ${tasks:-0-$((shards - 1))} of $shards of the recall" \
    "runs (${cpus} CPU(s) each) into $out/quality-shard-<i>"
  echo "lm job $lm: the base byte model and every variant swapped in and uptrained, into" \
    "$out/quality-lm"
  waits="the recall array and the lm job"
  [ -z "$merge" ] || waits="the budget sweep's merge, $waits"
  echo "quality merge job $quality_merge (after $waits succeed): $out/merged/quality, report" \
    "$out/merged/report.md"
  [ $run_sweep = 1 ] || echo "no budget sweep (scripts/quality_sweep.sh is not there): the" \
    "report needs $out/merged/results.csv, from a sweep merged there"
fi
again="--out $out --tasks <ids> [-- the same sweep options]"
[ $quality = 0 ] || again="--out $out --quality --tasks <ids>"
echo "logs: $out/logs; to run failed shards again (they resume): $0 --shards $shards $again"
ids=()
[ $run_sweep = 0 ] || ids+=("ARRAY_JOB_ID=$array" "MERGE_JOB_ID=$merge")
[ $quality = 0 ] || ids+=("RECALL_JOB_ID=$recall" "LM_JOB_ID=$lm" "QUALITY_MERGE_JOB_ID=$quality_merge")
echo "${ids[*]}"
