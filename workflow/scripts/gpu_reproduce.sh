#!/usr/bin/env bash
# On the GPU node, as a gpu_node.sh job: the GPU stages of `snakemake reproduce` for one experiment: the model
# (init, SFT), gates and rollout check, then the paired RL runs (the rl_paired job: every arm and seed,
# interleaved). The experiment's results and logs are copied to $JOB_OUT after the first stage and every
# minute during the second (the runs write their metrics per step), so a job stopped at the device's deadline
# still returns what is done. The report stage (tables, figures, notebook) reads only those files and runs on
# any machine (README, GPU node).
#
#   bash workflow/scripts/gpu_node.sh start bash workflow/scripts/gpu_reproduce.sh experiments/h200-rl.yaml
set -uo pipefail
exp=${1:?usage: gpu_reproduce.sh EXPERIMENT.yaml}
name=$(python3 -c "import sys; from isoexec.config import load_config; print(load_config(sys.argv[1]).name)" "$exp") || exit 2
R=results/$name
sm() { snakemake --cores all --keep-going "$@" --config experiment="$exp"; }
collect() { mkdir -p "${JOB_OUT:?}"; cp -r "$R" "logs/$name" "$JOB_OUT/" 2>/dev/null; date -u +"%FT%TZ collected" >> "$JOB_OUT/stages.log"; }
sm "$R/sft_metrics.json" "$R/gates.csv" "$R/rollout_check.json"; rc=$?; collect
(while sleep 60; do collect; done) & ticker=$!
sm --until rl_paired || rc=$?
kill $ticker; collect
exit $rc
