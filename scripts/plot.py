#!/usr/bin/python3
"""Figures and a markdown report from an attnbench results directory.

    scripts/plot.py DIR [--n N] [--input NAME] [--attnbench PATH] [--pattern-n N]
                        [--debug-json FILE]

Reads DIR/results.csv, DIR/meta.json and DIR/patterns/ (written by `attnbench sweep --out
DIR`) and writes DIR/plots/*.png and DIR/report.md:

  time_vs_n.png       median time against n, log-log, with O(n) and O(n^2) guides, min-max
                      bars of the repetitions and noisy rows hollow
  memory_vs_n.png     peak heap of the forward pass against n, coinciding lines side by side
  error_vs_n.png      relative Frobenius error against n, a panel per input distribution and
                      causal setting, with the errors of a zero output and the uniform average
  speed_vs_error.png  time against error at one n, with the Pareto frontier of the variants
                      that beat both references, points labelled where labels fit
  crossover.png       time relative to flash and to full against n; where each line crosses 1
                      is the variant's crossover length
  patterns.png        one head's attention pattern per pattern variant, as the sweep stored it
                      (DIR/patterns/*.npy)

With budget rows (scripts/quality_sweep.sh: a variant at several settings of its budget
parameter on the trained inputs at n = 4096), also:

  budget.png          per variant and budget parameter: time, error and mean cosine against
                      the setting, flash's time as a reference
  frontier.png        time against error, a point per setting labelled with it

and an "Error against budget" section in the report.

With training rows (`attnbench sweep --pass fwd,bwd,fwdbwd`), also:

  train_time_vs_n.png       median time of a forward and backward pass (pass fwdbwd) against n,
                            drawn as time_vs_n
  train_memory_vs_n.png     training memory: the peak heap of the fwdbwd pass (saved state plus
                            the working memory of forward or backward), the saved state dashed
  grad_vs_fwd_error.png     gradient error (the largest of dQ, dK, dV's relative errors) against
                            the forward's error at one n, with the diagonal y = x
  train_speed_vs_error.png  fwdbwd time against gradient error at one n, with the frontier

and a training table in the report (per variant at the largest n: fwd, bwd and fwdbwd time,
bwd/fwd, saved bytes, gradient error, the length from which its fwdbwd beats flash's).

With decode rows (`attnbench sweep --causal on --pass decode`, n the context), also:

  decode_latency_vs_n.png   time of one decode step (time_per_token_s) against the context,
                            log-log, drawn as time_vs_n with an O(n) guide; causal rows only
  decode_state_vs_n.png     the decode state per sequence (state_bytes) against the context

and a generation section in the report (the time per token of each variant at each context,
and per variant at the largest context: time per token, tokens/s, state per sequence, bytes
read per step, the share of the memory bandwidth, prefill time, and the context from which
its time per token stays below flash's). Every other figure and table draws the forward rows
(pass fwd) only; results without a pass column (an older attnbench) are all forward rows.

With DIR/quality/recall.csv or DIR/quality/lm.csv (scripts/quality.py), a Quality section
near the top of the report: per variant the recall accuracy at each setting and Δ bits per byte
before and after uptraining (mean ± sd over seeds), beside its speed over flash at the same n
(fwd, fwdbwd, decode), and

  recall_throughput.png     recall accuracy against the decode state per sequence and against
                            the training time per token

The error figures and tables on generated inputs follow it, as a stress test of the input
distribution.

Only rows with status "ok" are drawn; the others are listed at the end of the report. A
variant's colour and marker come from its name and its line style from its family, the same in
every figure of every run (attnbench_plots/style.py); legends name a spec by its non-default
parameters. Time, memory and crossover use one
input distribution (--input); they do not depend on the data for most variants, and mixing
inputs would draw several points per n. The figures are drawn by the attnbench_plots package
(one module per figure family).

plot.py writes only those files, each whole or not at all (a temporary file renamed over the
old one), holding the directory's lock (DIR/.attnbench.lock, the one `attnbench sweep` takes)
while it reads and writes: it refuses, naming the holder, a directory another process is
writing, and a write that fails (a full disk) leaves the earlier file and exits with status 2.
It never changes results.csv, meta.json or patterns/; figures of an earlier run that this run
does not draw are removed once everything else is written.

The attnbench binary (--attnbench) is run only for a results directory whose meta.json does
not describe every variant in it (one written by an earlier attnbench): `attnbench list
--json`, with the plugins meta.json records loaded.
"""

import argparse
import os

from attnbench_plots import report, style
from attnbench_plots.style import PROG, warn
from attnbench_results import load_meta, load_results, results_lock, run_main
from attnbench_variants import complete_variants, default_binary


def describe_variants(args, df, meta):
    """Completes meta["variants"] (parameters and defaults, for the legends' short labels) for
    every variant in the results, from the binary with the plugins meta.json records; a missing
    plugin or binary is a warning naming it, and only costs the short labels."""
    style.BINARY = args.attnbench or default_binary()
    if isinstance(meta, dict):
        names = list(dict.fromkeys(str(s).partition(":")[0] for s in df["spec"]))
        complete_variants(meta, names, args.attnbench or default_binary(), warn,
                          os.path.join(args.dir, "meta.json"))


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Figures (DIR/plots/*.png) and a markdown report (DIR/report.md) "
                               "from an attnbench results directory.")
    ap.add_argument("dir", metavar="DIR", help="results directory of `attnbench sweep --out DIR`")
    ap.add_argument("--n", type=int, default=None,
                    help="sequence length of the speed-vs-error figures and of the gradient "
                         "against forward error (default: the largest n at which more than "
                         "half of the variants have an ok row, of the training passes for the "
                         "training figures)")
    ap.add_argument("--input", default=None,
                    help="input distribution of the time, memory and crossover figures "
                         "(default: gaussian if present, else the first in the results)")
    ap.add_argument("--scale", type=float, default=None,
                    help="input scale of the time, memory and crossover figures when the "
                         "results hold several (default: 1 if present, else the smallest); "
                         "the speed-vs-error figure has a panel per scale")
    ap.add_argument("--attnbench", default=None, metavar="PATH",
                    help="attnbench binary asked for the variants meta.json does not describe "
                         "(results of an earlier attnbench), with the plugins meta.json records "
                         "(default: the binary installed with this script, or build/attnbench "
                         "of its source tree)")
    ap.add_argument("--pattern-n", type=int, default=None,
                    help="sequence length of the pattern gallery, among the stored patterns "
                         "(default: the length each pattern was stored at, the measured one "
                         "nearest 1024)")
    ap.add_argument("--debug-json", default=None, metavar="FILE",
                    help="also write what each figure drew (panels, lines, reference lines, "
                         "labels, marks) as JSON to FILE, for tests")
    args = ap.parse_args()
    if args.pattern_n is not None and args.pattern_n < 1:
        ap.error("--pattern-n must be positive")
    # the directory's lock for the whole run, as `attnbench sweep` takes it: the results are
    # read and the figures and report written while no other process writes there
    with results_lock(args.dir, PROG, create=False):
        df = load_results(args.dir)
        meta = load_meta(args.dir)
        describe_variants(args, df, meta)
        path = report.write(args, df, meta)
    print(f"{PROG}: wrote {path} and {os.path.join(args.dir, 'plots')}/*.png")
    return 0


if __name__ == "__main__":
    run_main(main, PROG)
