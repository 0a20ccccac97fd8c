#!/usr/bin/env bash
# Installs what is missing, builds, runs the default sweep into results/default (or the
# directory given as the first argument), then draws its figures and report with
# scripts/plot.py (DIR/plots/*.png, DIR/report.md). Extra arguments replace the default
# sweep and go to `attnbench sweep` as they are.
#
# The default sweep is one `attnbench sweep` of the sets of problems below (all but the first
# given with --also, so that the progress line's ETA covers them all):
#   1. speed: every variant with its defaults, n = 256..8192, causal off and on, gaussian
#      inputs;
#   2. training: the same problems timing the backward alone (bwd, from a saved forward) and
#      the forward with the backward (fwdbwd), with each variant's gradient error against exact
#      attention's gradients, for the training figures and table of the report;
#   3. accuracy: every variant at n = 256..8192 without causal masking, on the other input
#      distributions (local, clustered, lowrank) at --scale 1, 2 and 4 and on gaussian inputs
#      at --scale 2 and 4, so that the error figure has a panel each. Sharper logits are where
#      the structured inputs separate the variants (on iid gaussian inputs every softmax row is
#      nearly flat at any scale a pattern can exploit). The float64 reference of each problem
#      is computed once and reused for every variant.
#   4. trained inputs: every variant, causal, n = 256..4096, on the q, k, v of each of the 4
#      layers of a small byte-level language model trained on the Brown corpus
#      (--input trained:layer=L; scripts/train_lm.py trains it and scripts/capture_qkv.py
#      captures them into the cache, ATTNBENCH_CACHE or ~/.cache/attnbench, when missing:
#      about 15 minutes once). n above the model's context C = 1024 is beyond what it was
#      trained on, and marked so in the rows' notes.
#   5. long contexts: flash and the long-context variants (moba, nsa, local with 4 attention
#      sinks, retention, gla, deltanet and gated deltanet, and the step-by-step recurrent forms
#      of the last three) causal up to n = 16384, and the non-default settings (sinks, moba's
#      short-context chunk) on the trained inputs too, for the mass they keep;
#   6. generation: one decode step (--pass decode) after a prefill of n = 1024..65536 tokens,
#      causal, for every variant (those without a decode step give unsupported rows), and for
#      flash with grouped-query heads (--kv-heads 1, 2 and 4 of the 8 heads: a KV cache of G
#      heads, each read once for its group);
#   7. precision: the variants with a bf16 path, n = 256..8192, causal off and on, in bfloat16
#      (--dtype bf16) beside their float32 rows of set 1, for the report's precision table.
# After the sweep, scripts/anatomy.py measures the trained model's heads (entropy, mass in a
# window, on the first tokens, in each pattern) and scripts/swap_eval.py puts every variant
# into the model in place of its attention (validation bits per byte; the 4 most harmful, and
# flash as the baseline, also fine-tuned 20 steps in place); both write DIR/trained/.
# Finished rows are kept: running the script again resumes where it stopped.
#
# Quality (scripts/quality.py; each part resumes where it stopped, and the models it trains
# are cached):
#   - the default sweep ends with a subset, about 30 minutes on 2 cores: multi-query
#     associative recall at its longer setting (n = 1024, every query farther from its key than
#     two layers of the default local window relay) for flash, local, linear, performer, gla, deltanet,
#     moba and nsa over 3 seeds (DIR/quality/recall.csv);
#   - `scripts/sweep.sh --quality [DIR]` runs the whole quality suite instead of the default
#     sweep, about 4 hours on 2 cores: recall for every causal variant at both settings and
#     for the others in the bidirectional form (with flash), recall against the budget of
#     local, performer and moba, every variant swapped into a byte model of context 2048 and
#     uptrained (DIR/quality/lm.csv, over 3 seeds for the subset above), and each
#     approximation swept over its budget parameter at n = 4096 on the trained inputs
#     (scripts/quality_sweep.sh, rows in DIR/results.csv).
#
# `scripts/sweep.sh --quick [DIR]` (default results/quick) runs `attnbench sweep --profile quick`
# instead: every variant at n = 512..4096, causal off and on, forward and forward+backward, one
# decode step at a context of 4096, and the trained inputs of layers 0 and 1 when the cache
# holds them (else the local and clustered inputs at scale 2), then the plots and report; about
# 7 minutes on 2 cores after the build (the sweep 407 s, 600 rows, on an AMD EPYC). Further
# arguments (--variant, --threads) go to the sweep.
#
# Installed (`cmake --install`, PREFIX/share/attnbench/scripts/sweep.sh) it builds nothing: it
# runs the installation's bin/attnbench (installed_binary.txt beside it says where that is), and
# the results directory is relative to the current directory. Plugins load as for attnbench
# itself (ATTNBENCH_PLUGINS, or --plugin among the extra arguments).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -f "$here/installed_binary.txt" ]; then
  read -r bin <"$here/installed_binary.txt"
  case $bin in
    /*) ;;
    *) bin=$here/$bin ;;
  esac
  [ -x "$bin" ] || { echo "sweep.sh: no attnbench binary at $bin (installed_binary.txt)" >&2; exit 2; }
  bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
else
  cd "$here/.."
  bash scripts/build.sh
  bin=./build/attnbench
fi
quality=0
quick=0
if [ "${1:-}" = --quality ]; then
  quality=1
  shift
elif [ "${1:-}" = --quick ]; then
  quick=1
  shift
fi
out=${1:-results/$([ $quick = 1 ] && echo quick || echo default)}
shift || true
py=/usr/bin/python3
[ -x "$py" ] || py=python3
# the Python package attnbench: the build's, or an installed one
if [ -d "$here/../build/python/attnbench" ] && [ ! -f "$here/installed_binary.txt" ]; then
  export PYTHONPATH="$(cd "$here/../build/python" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi
# the default sweep's options (default_sweep_options), shared with scripts/slurm/submit.sh
# shellcheck source=scripts/default_sweep.sh
source "$here/default_sweep.sh"
qpy=("$py" "$here/quality.py")
# the recall subset of the default sweep (quality_subset) and the recall against the budget
# (recall_budget), shared with scripts/slurm/quality.sbatch
# shellcheck source=scripts/quality_recall.sh
source "$here/quality_recall.sh"
# recall trains many small models: one process of one thread per core (at most 8) trains them
# faster than one process on every core
jobs=$(nproc 2>/dev/null || echo 1)
[ "$jobs" -le 8 ] || jobs=8
recall=("${qpy[@]}" recall --jobs "$jobs" --threads 1)
if [ $quality = 1 ]; then
  if [ $# -gt 0 ]; then
    echo "sweep.sh: --quality takes a results directory only (got: $*); scripts/quality.py" \
      "runs one part with options of its own" >&2
    exit 2
  fi
  if ! "$py" -c 'import torch, numpy, attnbench' 2>/dev/null; then
    echo "sweep.sh: the quality suite needs $py with torch and numpy and the attnbench Python" \
      "package (build with -DATTNBENCH_PYTHON=ON; scripts/deps.sh installs the rest)" >&2
    exit 2
  fi
  # shellcheck source=scripts/quality_sweep.sh
  source "$here/quality_sweep.sh"
  "$py" "$here/train_lm.py"
  "$py" "$here/capture_qkv.py"
  "$bin" sweep --out "$out" --resume "${quality_budget_options[@]}"
  "${recall[@]}" --out "$out"
  "${recall[@]}" --bidirectional --out "$out"
  "${recall[@]}" --seq 1024 "${recall_budget[@]/#/--variant=}" --out "$out"
  "${qpy[@]}" lm --jobs "$jobs" --threads 1 --out "$out"
elif [ $quick = 1 ]; then
  # the quick profile: extra arguments (--variant ..., --threads N) go to the sweep
  "$bin" sweep --out "$out" --resume --profile quick "$@"
elif [ $# -eq 0 ]; then
  # the trained model and its captured inputs (each step does nothing when its cache is current)
  if ! "$py" -c 'import torch, numpy' 2>/dev/null; then
    echo "sweep.sh: the trained-input set needs $py with torch and numpy (Debian packages" \
      "python3-torch and python3-numpy; scripts/deps.sh installs them)" >&2
    exit 2
  fi
  "$py" "$here/train_lm.py"
  "$py" "$here/capture_qkv.py"
  "$bin" sweep --out "$out" --resume "${default_sweep_options[@]}"
  "$py" "$here/anatomy.py" --out "$out"
  if "$py" -c 'import attnbench' 2>/dev/null; then
    "$py" "$here/swap_eval.py" "$out" --finetune-steps 20 --finetune-top 4
    "${recall[@]}" --seq 1024 "${quality_subset[@]/#/--variant=}" --out "$out"
  else
    echo "sweep.sh: the attnbench Python package is not importable, so the swap evaluation" \
      "(scripts/swap_eval.py) is left out; build with -DATTNBENCH_PYTHON=ON" >&2
  fi
else
  "$bin" sweep --out "$out" "$@"
fi
"$py" "$here/plot.py" "$out"
