# The options of attnbench's budget sweep, for `source`: sets the bash array
# quality_budget_options (every option of `attnbench sweep` but --out and --resume), after $bin
# is set to the attnbench binary, so that it runs as
#   "$bin" sweep --out DIR --resume "${quality_budget_options[@]}"
# into the results directory of the default sweep (scripts/default_sweep.sh; the rows they
# share, flash and every variant at its defaults on the same inputs, are kept, not run again).
# scripts/plot.py draws these rows in the report's "Error against budget" section
# (scripts/attnbench_plots/budget.py: budget.png and frontier.png).
#
# Each approximation runs at 4 to 6 settings of the parameter that sets how much work it does
# (its budget), from cheap to expensive around its default, all valid at n = 4096:
# quality_budget_sets below (a|b is attnbench's grid of specs). The problems: n = 4096, the
# shape of the trained model's heads (B = 1, H = 8, d = 64: the sweep's defaults), on the q, k
# and v the trained model's layers 0 and 1 produce (--input trained:layer=L). Causal where the
# variant can be (the model is causal); the variants whose registration says they cannot
# (`$bin list --json`, "causal": linformer, nystrom, clustered) run non-causal. flash runs
# both ways, the exact baseline of each. efficient has no budget parameter and is left out.
#
# Two of the model's four layers bound the cost: in the reference results layer 0 is the most
# local one (every window pattern has its smallest error there) and layer 1 the least (their
# largest), with layers 2 and 3 between them; all four would double the time for no new range.
#
# Cost: 79 specs (63 causal, 16 non-causal; flash in both), 158 rows on the 2 layers, of which
# 22 (causal flash and the 10 causal variants at their defaults, on both layers) are already
# in a default sweep's directory.
# `--shard-plan 1` estimates 219 s for the 158. Measured: six of the dearest rows (flash, local
# at window 32 and 1024, performer at 1024 features, nsa at sel_top 32, reformer at 8 hashes;
# H = 8, d = 64, n = 4096, the default timing of 3 repetitions of at least 0.1 s, with the error
# measurement) took 58 s on 2 cores under a load average of 7, where those rows ran about 4x
# slower than in the reference results: about 15 s on a quiet machine. So about 4 to 6 minutes
# for the whole set on 2 quiet cores.
# shellcheck shell=bash disable=SC2034,SC2154
quality_layers=trained:layer=0,trained:layer=1
quality_budget_sets=(
  'local:window=32|64|128|256|512|1024'
  'longformer:window=32|64|128|256|512'
  'bigbird:window_blocks=1|3|5|9'
  'bigbird:random_blocks=0|1|3|6'
  'performer:features=32|64|128|256|512|1024'
  'rfa:features=32|64|128|256|512'
  'linformer:proj=32|64|128|256|512'
  'nystrom:landmarks=16|32|64|128|256'
  'reformer:buckets=16|32|64|128|256'
  'reformer:hashes=1|2|4|8'
  'routing:clusters=4|8|16|32|64'
  'clustered:clusters=25|50|100|200|400'
  'moba:topk=1|2|3|4|6'
  'nsa:sel_top=4|8|16|32'
  'compressed:ratio=2|3|4|8|16'
  'sinkhorn:block=16|32|64|128|256'
)
_quality_sweep_py=/usr/bin/python3
[ -x "$_quality_sweep_py" ] || _quality_sweep_py=python3
# Splits the sets into those that run causal and those that cannot, from the registrations;
# a set that names a variant or parameter the binary does not register is an error here,
# before anything runs.
if ! _quality_sweep_lists=$("$bin" list --json | "$_quality_sweep_py" -c '
import json, sys
vs = {v["name"]: v for v in json.load(sys.stdin) if not v.get("plugin")}
causal, other = [], []
for s in sys.argv[1:]:
    name, _, params = s.partition(":")
    v = vs.get(name)
    if v is None:
        sys.exit(f"quality_sweep.sh: {s}: no variant {name}")
    known = {p["name"] for p in v.get("params", [])}
    for p in params.split(","):
        if p.partition("=")[0] not in known:
            sys.exit(f"quality_sweep.sh: {s}: {name} has no parameter {p.partition(chr(61))[0]}")
    (causal if v.get("causal") else other).append("--variant " + s)
print(" ".join(causal))
print(" ".join(other))
' "${quality_budget_sets[@]}"); then
  echo "quality_sweep.sh: the budget sets cannot be checked against \`$bin list --json\`" \
    "(above: why)" >&2
  return 2 2>/dev/null || exit 2
fi
{ read -r _quality_causal; read -r _quality_noncausal; } <<<"$_quality_sweep_lists"
read -r -a _quality_causal_words <<<"$_quality_causal"
quality_budget_options=(
  --variant flash "${_quality_causal_words[@]}" --seq 4096 --causal on --input "$quality_layers"
  --also="--variant flash $_quality_noncausal --seq 4096 --causal off --input $quality_layers"
)
