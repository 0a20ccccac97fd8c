#!/usr/bin/env bash
# A sharded sweep on a real Slurm, on this one machine: installs Debian's slurm-wlm and munge
# when missing (apt-get, as root), writes a single-host slurm.conf for this machine into a
# temporary directory, starts munged, slurmctld and slurmd on loopback (their own key, socket,
# state, spool and free ports, so that they disturb no Slurm already here), submits a 4-task
# array of a small sweep through scripts/slurm/submit.sh, waits for its merge job, then runs the
# same sweep in one process and checks that the merged rows are the same configurations with
# identical errors, times and a host. It prints the wall clock of both and their ratio. A trap
# cancels its jobs and stops the daemons it started (by their pids), also on failure.
#
# It exits 77 (skipped; ctest shows why) when it cannot run a Slurm here: not root, no apt-get
# to install the packages, the daemons do not start, or an attnbench without `sweep --shard`.
#
# usage: tests/scripts/slurm_test.sh ATTNBENCH
#        (SLURM_TEST_TIMEOUT: seconds to wait for the jobs, 1200;
#        SLURM_TEST_SWEEP: the sweep's options in place of the small one, as one string)
set -euo pipefail
bin=${1:?usage: slurm_test.sh ATTNBENCH}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=/usr/bin/python3
timeout_s=${SLURM_TEST_TIMEOUT:-1200}
test_sweep=${SLURM_TEST_SWEEP:-}  # read before the SLURM_* variables are cleared below
skip() { echo "slurm_test: SKIPPED: $*" >&2; exit 77; }
fail() { echo "slurm_test: FAILED: $*" >&2; exit 1; }
log() { echo "slurm_test: $*" >&2; }

[ -x "$bin" ] || fail "no attnbench binary at $bin"
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
if ! "$bin" sweep --help 2>&1 | grep -q -- '--shard' || ! "$bin" merge --help >/dev/null 2>&1; then
  skip "$bin has no 'sweep --shard' or 'merge' (sharded sweeps are not built into it)"
fi
"$py" -c 'import pandas, matplotlib' 2>/dev/null ||
  skip "$py lacks pandas or matplotlib (scripts/deps.sh installs them)"

# --- Slurm and munge, from Debian's packages ---------------------------------------------------
[ "$(id -u)" -eq 0 ] || skip "not root: the test installs slurm-wlm and munge and starts" \
  "slurmd, which launches the jobs"
have_slurm() {
  command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged &&
    command -v munge
} >/dev/null
if ! have_slurm; then
  command -v apt-get >/dev/null || skip "slurm-wlm and munge are not installed and there is no apt-get"
  log "installing slurm-wlm and munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1; then
    apt-get update -qq >/dev/null 2>&1 || true
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 ||
      skip "apt-get could not install slurm-wlm and munge"
  fi
  have_slurm || skip "slurm-wlm and munge installed, but slurmctld, slurmd, sbatch or munged is missing"
fi

# No Slurm job or settings around this test leak into its cluster (ctest may itself run in a job).
while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(SLURM|SBATCH|SRUN|SALLOC)_' || true)

tmp=$(mktemp -d /tmp/attnbench-slurm.XXXXXX)
pids=()  # munged, slurmctld, slurmd, in the order started
cleanup() {
  local status=$?
  if [ -n "${SLURM_CONF:-}" ] && [ -f "$SLURM_CONF" ] && [ ${#pids[@]} -ge 2 ]; then
    # this cluster's jobs only (its slurm.conf): none may outlive its slurmd
    scancel --quiet --full --partition=debug 2>/dev/null || true
    for _ in $(seq 20); do
      [ -z "$(squeue -h -t RUNNING,COMPLETING 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
  done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    for _ in $(seq 50); do kill -0 "${pids[i]}" 2>/dev/null || break; sleep 0.1; done
    kill -9 "${pids[i]}" 2>/dev/null || true
  done
  rm -rf "$tmp"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# munged wants its socket's directory (and those above it) searchable by everyone, its key
# readable by its user alone
chmod 755 "$tmp"
mkdir -p "$tmp/run" "$tmp/key" "$tmp/state" "$tmp/spool" "$tmp/log"
chmod 700 "$tmp/key"
tail_logs() {
  local f
  for f in "$tmp"/log/*; do echo "--- $f" >&2; tail -n 15 "$f" >&2; done
}

# --- munged: its own key and socket ------------------------------------------------------------
if command -v mungekey >/dev/null; then
  mungekey --create --keyfile="$tmp/key/munge.key" >/dev/null 2>&1
else
  dd if=/dev/urandom of="$tmp/key/munge.key" bs=1024 count=1 status=none
fi
chmod 600 "$tmp/key/munge.key"
sock=$tmp/run/munge.socket
munged --foreground --key-file="$tmp/key/munge.key" --socket="$sock" \
  --pid-file="$tmp/run/munged.pid" --seed-file="$tmp/key/munged.seed" \
  --log-file="$tmp/log/munged.log" >"$tmp/log/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [ -S "$sock" ] && break; sleep 0.1; done
if ! munge -n -S "$sock" 2>/dev/null | unmunge -S "$sock" >/dev/null 2>&1; then
  tail_logs
  skip "munged did not start (or its credentials do not decode)"
fi

# --- slurm.conf for this machine ---------------------------------------------------------------
# The node line is what slurmd detects here (slurmd -C: CPUs, sockets, cores, threads, memory),
# so the node registers as configured. Ports: two free ones on loopback, not the default
# 6817/6818 an existing Slurm may hold.
node_line=$(slurmd -C 2>/dev/null | grep '^NodeName=' | head -n 1)
[ -n "$node_line" ] || skip "slurmd -C did not describe this machine"
node_line=${node_line%% UpTime=*}
node=${node_line#NodeName=}
node=${node%% *}
read -r ctld_port slurmd_port < <("$py" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
# Pinning: task/affinity binds each task to the cores Slurm gave it with sched_setaffinity; where
# that call is refused, task/none (the shards then run unpinned). The cgroup plugins
# (proctrack/cgroup, task/cgroup) are not used: a container's cgroup tree is rarely writable,
# and proctrack/linuxproc tracks a job's processes through /proc without cgroups.
task_plugin=task/affinity
"$py" -c 'import os; os.sched_setaffinity(0, os.sched_getaffinity(0))' 2>/dev/null ||
  task_plugin=task/none
export SLURM_CONF=$tmp/slurm.conf
cat >"$SLURM_CONF" <<EOF
# a one-machine Slurm for tests/scripts/slurm_test.sh: daemons on loopback, state under $tmp
ClusterName=attnbench-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/run/slurmctld.pid
SlurmdPidFile=$tmp/run/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=$task_plugin
# cores are the unit of allocation: 4 one-core tasks on 2 cores run 2 at a time
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# finished jobs stay visible to scontrol (there is no accounting to ask)
MinJobAge=600
ReturnToService=2
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -D -i -f "$SLURM_CONF" >"$tmp/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" -N "$node" >"$tmp/log/slurmd.out" 2>&1 &
pids+=($!)
state=""
for _ in $(seq 120); do
  state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { tail_logs; skip "a Slurm daemon (pid $p) exited at start"; }
  done
  sleep 0.5
done
if [ "$state" != idle ]; then
  tail_logs
  skip "the node $node did not become idle in 60 s (state '${state}')"
fi
log "Slurm up: node $node ($node_line), ports $ctld_port/$slurmd_port, $task_plugin"

# --- the sweep as a 4-task array, merged -------------------------------------------------------
sweep=(--variant flash --variant local --variant linear --seq "64,128,256" --causal both --heads 2
  --dim 16 --reps 1 --min-time 0)
# SLURM_TEST_SWEEP: other sweep options (one string, split at spaces), e.g. a sweep long enough
# that the ratio of the two wall clocks measures the scheduler rather than fixed costs
if [ -n "$test_sweep" ]; then
  read -r -a sweep <<<"$test_sweep"
fi
start=$(date +%s.%N)
submitted=$(bash "$root/scripts/slurm/submit.sh" --shards 4 --out "$tmp/array" --bin "$bin" \
  -- "${sweep[@]}") || fail "scripts/slurm/submit.sh failed"
echo "$submitted" >&2
array=$(sed -n 's/.*ARRAY_JOB_ID=\([0-9]*\).*/\1/p' <<<"$submitted")
merge=$(sed -n 's/.*MERGE_JOB_ID=\([0-9]*\).*/\1/p' <<<"$submitted")
if [ -z "$array" ] || [ -z "$merge" ]; then
  fail "submit.sh printed no ARRAY_JOB_ID and MERGE_JOB_ID"
fi

job_states() { scontrol -o show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
show_failure() {
  scontrol -o show job "$array" >&2 || true
  scontrol -o show job "$merge" >&2 || true
  local f
  for f in "$tmp"/array/logs/*; do echo "--- $f" >&2; tail -n 20 "$f" >&2; done
  tail_logs
}
deadline=$(($(date +%s) + timeout_s))
array_end=""
while :; do
  states=$(job_states "$array")
  if [ -z "$array_end" ] && [ -n "$states" ] && ! grep -qv '^COMPLETED$' <<<"$states"; then
    array_end=$(date +%s.%N)
  fi
  if grep -qE 'FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED' \
    <<<"$states"; then
    show_failure
    fail "a shard of the array $array ended $(grep -v COMPLETED <<<"$states" | sort -u | tr '\n' ' ')"
  fi
  merge_state=$(job_states "$merge")
  [ "$merge_state" = COMPLETED ] && break
  case $merge_state in
    PENDING | CONFIGURING | RUNNING | COMPLETING | "") ;;
    *) show_failure; fail "the merge job $merge ended $merge_state" ;;
  esac
  if [ "$(date +%s)" -ge "$deadline" ]; then
    show_failure
    fail "the array $array and merge $merge did not finish in $timeout_s s" \
      "(SLURM_TEST_TIMEOUT); array: $(tr '\n' ' ' <<<"$states")merge: $merge_state"
  fi
  sleep 0.5
done
end=$(date +%s.%N)
# each task's run time, as Slurm saw it (two run at a time on a 2-core machine)
scontrol -o show job "$array" | sed -n 's/.*JobId=\([0-9]*\) ArrayJobId=[0-9]* ArrayTaskId=\([0-9]*\).* RunTime=\([0-9:-]*\).*/slurm_test: shard \2 ran \3/p' |
  sort -k3,3n >&2
[ -s "$tmp/array/merged/report.md" ] || { show_failure; fail "the merge job wrote no merged/report.md"; }

# --- the same sweep in one process -------------------------------------------------------------
single_start=$(date +%s.%N)
"$bin" sweep --out "$tmp/single" "${sweep[@]}" 2>"$tmp/log/single.err" ||
  { tail -n 20 "$tmp/log/single.err" >&2; fail "the single-process sweep failed"; }
"$py" "$root/scripts/plot.py" "$tmp/single" >/dev/null 2>"$tmp/log/single_plot.err" ||
  { tail -n 20 "$tmp/log/single_plot.err" >&2; fail "scripts/plot.py failed on the single-process sweep"; }
single_end=$(date +%s.%N)

"$py" - "$tmp/array" "$tmp/single" <<'EOF'
import math, os, sys
import pandas as pd
array, single = sys.argv[1:]
def fail(msg):
    sys.exit(f"slurm_test: FAILED: {msg}")
def read(path):
    if not os.path.isfile(path):
        fail(f"no {path}")
    return pd.read_csv(path, dtype=str, keep_default_na=False)
merged = read(os.path.join(array, "merged", "results.csv"))
one = read(os.path.join(single, "results.csv"))
for i in range(4):
    shard = read(os.path.join(array, f"shard-{i}", "results.csv"))
    if shard.empty:
        fail(f"shard {i} wrote no rows")
# a configuration: every column that says what was run (the thread count is the shard's own)
key_columns = [c for c in ("spec", "variant", "batch", "heads", "kv_heads", "n", "m", "dim",
                           "embed", "causal", "score", "score_hidden", "input", "input_layer",
                           "input_source", "scale", "seed", "key_padding", "attn_mask", "pass")
               if c in one.columns]
for c in key_columns:
    if c not in merged.columns:
        fail(f"the merged results.csv lacks the column {c}")
if "host" not in merged.columns:
    fail("the merged results.csv has no host column")
if (merged["host"].str.strip() == "").any():
    fail("rows of the merged results.csv have an empty host")
keys = lambda df: [tuple(r) for r in df[key_columns].itertuples(index=False)]
duplicates = merged[merged.duplicated(key_columns, keep=False)]
if not duplicates.empty:
    fail(f"the merged results.csv repeats configurations:\n{duplicates[key_columns]}")
missing = set(keys(one)) - set(keys(merged))
extra = set(keys(merged)) - set(keys(one))
if missing or extra:
    fail(f"the merged configurations differ from the single-process run's: missing {sorted(missing)},"
         f" extra {sorted(extra)}")
error_columns = [c for c in ("status", "message", "rel_fro_error", "max_abs_error", "mean_cosine",
                             "error_rows", "error_rows_total", "mass_mean", "mass_min",
                             "uniform_error", "grad_rel_err_q", "grad_rel_err_k", "grad_rel_err_v")
                 if c in one.columns]
def same(a, b):
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return x == y or (math.isnan(x) and math.isnan(y))
m = merged.set_index(key_columns)
o = one.set_index(key_columns)
differ = []
for key in o.index:
    for c in error_columns:
        if c not in m.columns:
            fail(f"the merged results.csv lacks the column {c}")
        if not same(o.at[key, c], m.at[key, c]):
            differ.append(f"{key} {c}: single {o.at[key, c]!r}, merged {m.at[key, c]!r}")
if differ:
    fail("errors differ between the merged and the single-process rows:\n" + "\n".join(differ))
ok = merged[merged["status"] == "ok"]
if ok.empty:
    fail("the merged results.csv has no ok rows")
times = pd.to_numeric(ok["time_median_s"], errors="coerce")
if not (times > 0).all():
    fail(f"ok rows without a positive time_median_s:\n{ok[times.isna() | (times <= 0)][key_columns]}")
print(f"slurm_test: {len(merged)} merged rows ({len(ok)} ok) = the single-process run's "
      f"configurations, errors identical, times present, hosts {sorted(merged['host'].unique())}",
      file=sys.stderr)
EOF

"$py" - "$start" "${array_end:-$end}" "$end" "$single_start" "$single_end" <<'EOF'
import sys
start, array_end, end, single_start, single_end = map(float, sys.argv[1:])
slurm, single = end - start, single_end - single_start
print(f"slurm_test: 4-task array + merge + plot on Slurm {slurm:.1f} s (array {array_end - start:.1f} s),"
      f" one process sweep + plot {single:.1f} s: ratio {slurm / single:.2f} (target <= 1.1)",
      file=sys.stderr)
EOF
log "passed"
