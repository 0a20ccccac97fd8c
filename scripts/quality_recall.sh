# The recall runs of the quality suite (scripts/quality.py recall), shared by scripts/sweep.sh
# and scripts/slurm/quality.sbatch; sourced, it defines two arrays:
#   quality_subset  the variants of the default sweep's recall subset (at n = 1024, 3 seeds)
#   recall_budget   recall against the budget: local's window, performer's features, moba's
#                   top k (of chunks of 64 at n = 1024)
# The whole suite runs recall for every causal variant at both settings (quality.py's
# defaults), for the others in the bidirectional form (--bidirectional), and recall_budget at
# --seq 1024.
# shellcheck shell=bash disable=SC2034,SC2054
quality_subset=(flash local linear performer gla deltanet moba nsa)
recall_budget=(local:window=256 local:window=384 local:window=448 local:window=512
               performer:features=16 performer:features=32 performer:features=64
               performer:features=128 moba:chunk=64,topk=1 moba:chunk=64,topk=2
               moba:chunk=64,topk=4 moba:chunk=64,topk=8)
