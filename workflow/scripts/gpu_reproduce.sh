#!/usr/bin/env bash
# On the GPU node, as a gpu_node.sh job: the GPU stages of `snakemake reproduce` for one experiment: the model
# (init, SFT), gates and rollout check, then the RL runs seed by seed (every mode of a seed back to back).
# After each stage the experiment's results and logs are copied to $JOB_OUT, so a job stopped at the device's
# deadline still returns what is done. The report stage (tables, figures, notebook) reads only those files
# and runs on any machine (README, GPU node).
#
#   bash workflow/scripts/gpu_node.sh start bash workflow/scripts/gpu_reproduce.sh experiments/h200-rl.yaml [SEED...]
#
# SEED...: the seeds to run (default: the experiment's rl.seeds).
set -uo pipefail
exp=${1:?usage: gpu_reproduce.sh EXPERIMENT.yaml [SEED...]}; shift
read -r name seeds modes < <(python3 -c "
import sys
from isoexec.config import load_config
c = load_config(sys.argv[1])
print(c.name, ','.join(map(str, c.rl.seeds)), ','.join(c.rl.modes))" "$exp") || exit 2
[ $# -gt 0 ] && seeds=$(IFS=,; echo "$*")
R=results/$name
sm() { snakemake --cores all --keep-going "$@" --config experiment="$exp"; }
collect() { mkdir -p "${JOB_OUT:?}"; cp -r "$R" "logs/$name" "$JOB_OUT/" 2>/dev/null; date -u +"%FT%TZ collected" >> "$JOB_OUT/stages.log"; }
sm "$R/sft_metrics.json" "$R/gates.csv" "$R/rollout_check.json"; rc=$?; collect
for s in ${seeds//,/ }; do
  sm $(for m in ${modes//,/ }; do echo "$R/rl/$m/seed$s/metrics.jsonl"; done) || rc=$?
  collect
done
exit $rc
