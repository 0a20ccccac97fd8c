# The options of attnbench's default sweep, for `source`: sets the bash array
# default_sweep_options (every option of `attnbench sweep` but --out and --resume). Sourced by
# scripts/sweep.sh (one process) and scripts/slurm/submit.sh (a Slurm job array of shards), so
# that both run the same sweep; scripts/sweep.sh describes its sets of problems.
# shellcheck shell=bash disable=SC2034
trained_layers=trained:layer=0,trained:layer=1,trained:layer=2,trained:layer=3
# the settings of the long-context variants beside their defaults, and the recurrent forms of
# the linear ones (the baseline of their chunkwise forms)
long_context_settings="--variant local:sinks=4 --variant moba:chunk=128"
long_context="--variant flash --variant moba --variant nsa --variant retention --variant gla \
  --variant deltanet --variant deltanet:gated=true --variant retention:form=recurrent \
  --variant gla:form=recurrent --variant deltanet:form=recurrent $long_context_settings"
# the variants with a bf16 path (`attnbench list`, column bf16)
bf16_variants="--variant flash --variant local --variant bigbird --variant global \
  --variant longformer --variant strided --variant sparse_transformer"
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
