# The options of attnbench's default sweep, for `source`: sets the bash array
# default_sweep_options (every option of `attnbench sweep` but --out and --resume). Sourced by
# scripts/sweep.sh (one process) and scripts/slurm/submit.sh (a Slurm job array of shards), so
# that both run the same sweep, after setting $bin to the attnbench binary; scripts/sweep.sh
# describes its sets of problems.
# shellcheck shell=bash disable=SC2034
trained_layers=trained:layer=0,trained:layer=1,trained:layer=2,trained:layer=3
# Which variants go into which set comes from their registrations (`$bin list --json`; $bin is
# the binary of the sweep, set by whoever sources this file):
#  - long_context: flash, every variant registered as a long-context design, and the further
#    settings they list (sweep_specs: e.g. the recurrent forms of the linear ones, the baseline
#    of their chunkwise forms);
#  - long_context_settings: those settings of a softmax (sparse pattern) variant, also run on
#    the trained inputs;
#  - bf16_variants: the variants with a bf16 path (`attnbench list`, column bf16).
_default_sweep_py=/usr/bin/python3
[ -x "$_default_sweep_py" ] || _default_sweep_py=python3
if ! _default_sweep_lists=$("$bin" list --json | "$_default_sweep_py" -c '
import json, sys
vs = json.load(sys.stdin)
def opts(specs):
    return " ".join("--variant " + s for s in specs)
lc = [v["name"] for v in vs if v.get("long_context") and not v.get("plugin")]
specs = [s for v in vs if not v.get("plugin") for s in v.get("sweep_specs", [])]
pattern = [s for v in vs if not v.get("plugin") and v.get("family") == "pattern"
           for s in v.get("sweep_specs", [])]
print(opts(["flash"] + lc + specs))
print(opts(pattern))
print(opts([v["name"] for v in vs if v.get("bf16") and not v.get("plugin")]))
'); then
  echo "default_sweep.sh: cannot read the variants from \`$bin list --json\`" >&2
  return 2 2>/dev/null || exit 2
fi
{ read -r long_context; read -r long_context_settings; read -r bf16_variants; } \
  <<<"$_default_sweep_lists"
default_sweep_options=(
  --seq 256..8192 --causal both
  --also='--seq 256..8192 --causal both --pass bwd,fwdbwd'
  --also='--seq 256..8192 --causal off --input local,clustered,lowrank --scale 1,2,4'
  --also='--seq 256..8192 --causal off --input gaussian --scale 2,4'
  --also="--seq 256..4096 --causal on --input $trained_layers"
  --also="$long_context --seq 256..16384 --causal on"
  --also="$long_context_settings --seq 256..4096 --causal on --input $trained_layers"
  --also='--seq 1024..65536 --causal on --pass decode'
  --also='--variant flash --seq 1024..65536 --causal on --pass decode --kv-heads 1,2,4'
  --also="$bf16_variants --seq 256..8192 --causal both --dtype bf16"
)
