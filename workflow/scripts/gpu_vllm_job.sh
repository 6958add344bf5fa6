#!/usr/bin/env bash
# The vLLM-on-GPU job of results/h200-vllm/, on a node whose stack gpu_node.sh installed:
#   bash workflow/scripts/gpu_node.sh start bash workflow/scripts/gpu_vllm_job.sh
# 1. GPU tests of the decode graphs and the Triton kernels            -> $JOB_OUT/gpu_tests.log
# 2. isoexec.bench.vllm_gpu: engine start, generation cost against vLLM native, rollout check, profile
#                                                                      -> $JOB_OUT/<config name>/, vllm_gpu.log
# 3. isoexec.bench.rl_step --engine vllm: one RL step per arm, vLLM native vs vLLM + plugin
#                                                                      -> $JOB_OUT/rl_step.csv, rl_step.log
# 4. the leaf GEMM's loop shapes and tiles side by side with cuBLAS, each bitwise-checked (issue 37; after the vLLM
#    stages, so that it only takes device time they left)                    -> $JOB_OUT/leaf_variants/, leaf_variants.log
# 5. (chunkwise) issue 37's chunkwise in-chunk CPR candidate against today's CPR and fla, its decode rows checked
#    bit for bit (python -m isoexec.bench.gpu cpr_chunkwise)          -> $JOB_OUT/cpr_chunkwise/, cpr_chunkwise.log
# 6. (bench) the kernel tables of isoexec.bench.gpu named in BENCH (default "cpr_qwen35 model_before_after cpr", issue
#    37: CPR vs fla at the Qwen3.5 GDN layer by CUDA-graph replay; the whole model before / after the leaf GEMM's rules;
#    the CPR layer table; "gates": the bitwise gate matrix, at experiments/h200.yaml) at BENCH_CONFIG
#    (experiments/h200-rlstep.yaml), each T_BENCH s at most or T_BENCH_<table> for one
#    (model_before_after did not finish its isoexec arms in 280 s on an H100: results/h200/leaf_gemm/top_rows_0e1710b_h100)
#                                                              -> $JOB_OUT/bench/ (gates: $JOB_OUT/gates/), bench_<table>.log
# and every 5 s nvidia-smi's utilisation (gpu_util.csv) and the host's memory in MiB (host_mem.csv: a node lost while
# three scorers loaded, results/h200-vllm/571a25e-h100, logged only the GPU's). Settings: CONFIG (experiments/h200-rlstep.yaml), GEN (the
# generation shapes), DEADLINE (vllm_gpu's --deadline-s), RLSTEP_CONFIG and RLSTEP_ARGS (stage 3's experiment, CONFIG unless
# set, and further rl_step options, e.g. "--new-tokens 128": h200-rlstep's trainer does not fit an H100), T_TESTS / T_VLLM / T_RLSTEP / T_LEAF (time limits, s;
# T_LEAF=0 skips stage 4, ISOEXEC_LEAF_LOOPS="gluon_pipelined" limits its candidates to those loops; T_CHUNKWISE; T_BENCH), STAGES (which stages, in the order given: "tests vllm rlstep leaf chunkwise";
# with little device time left, e.g. "vllm rlstep tests leaf"). Exit status: the last failing stage's; every stage runs whatever the
# others did.
set -uo pipefail
O=${JOB_OUT:?run through gpu_node.sh start (JOB_OUT)}
CONFIG=${CONFIG:-experiments/h200-rlstep.yaml}
NAME=$(basename "$CONFIG" .yaml)
STAGES=${STAGES:-tests vllm rlstep leaf chunkwise}
for stage in $STAGES; do
  case $stage in tests|vllm|rlstep|leaf|chunkwise|bench) ;;
    *) echo "gpu_vllm_job: STAGES: unknown stage '$stage'; allowed: tests vllm rlstep leaf chunkwise bench"; exit 2 ;; esac
done
s=0
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$O/gpu_util.csv" 2>/dev/null &
{ echo "time,total_mib,used_mib,available_mib"
  while sleep 5; do free -m | awk -v t="$(date -u +%T)" '/^Mem:/ {print t "," $2 "," $3 "," $7}'; done; } > "$O/host_mem.csv" &
tests() {
  timeout "${T_TESTS:-220}" python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py tests/test_kernels_triton.py \
    > "$O/gpu_tests.log" 2>&1 || s=$?
  tail -n 3 "$O/gpu_tests.log"
}
vllm() {
  timeout "${T_VLLM:-780}" python3 -m isoexec.bench.vllm_gpu --config "$CONFIG" --out-dir "$O/$NAME" \
    --gen "${GEN:-32x128+128,256x128+512,32x128+1024}" --deadline-s "${DEADLINE:-540}" > "$O/vllm_gpu.log" 2>&1 || s=$?
  grep -o '"stage": "[a-z_]*"' "$O/vllm_gpu.log" | sort | uniq -c
}
rlstep() {  # the same --work as vllm_gpu's default: the random checkpoint is made once
  # shellcheck disable=SC2086 # RLSTEP_ARGS: options, split on purpose
  timeout "${T_RLSTEP:-840}" python3 -m isoexec.bench.rl_step --config "${RLSTEP_CONFIG:-$CONFIG}" --engine vllm \
    --out "$O/rl_step.csv" --work /tmp/isoexec-vllm-gpu ${RLSTEP_ARGS:-} > "$O/rl_step.log" 2>&1 || s=$?
  grep '^{' "$O/rl_step.log" | cut -c1-300
}
leaf() {
  [ "${T_LEAF:-300}" -gt 0 ] || return 0
  ISOEXEC_VARIANTS=leaf timeout "${T_LEAF:-300}" python3 -m isoexec.bench.gpu variants --config experiments/h200.yaml \
    --extra-config experiments/h200-rlstep.yaml --out-dir "$O/leaf_variants" > "$O/leaf_variants.log" 2>&1 || s=$?
  tail -n 3 "$O/leaf_variants.log"
}
chunkwise() {
  timeout "${T_CHUNKWISE:-240}" python3 -m isoexec.bench.gpu cpr_chunkwise --config experiments/h200.yaml \
    --out-dir "$O/cpr_chunkwise" > "$O/cpr_chunkwise.log" 2>&1 || s=$?
  # bench.gpu catches a table's exception (logged as "cpr_chunkwise: {'ok': False, ...}") and a failed row check is a
  # column of the logged row: either fails the stage
  grep -q "'ok': False\|\"decode_rows_equal\": false" "$O/cpr_chunkwise.log" && s=1
  tail -n 4 "$O/cpr_chunkwise.log"
}
bench() {
  for t in ${BENCH:-cpr_qwen35 model_before_after cpr}; do
    c=${BENCH_CONFIG:-experiments/h200-rlstep.yaml}; d=$O/bench
    [ "$t" = gates ] && { c=experiments/h200.yaml; d=$O/gates; }
    tb=T_BENCH_$t; tb=${!tb:-${T_BENCH:-300}}  # T_BENCH_<table> overrides T_BENCH for one table
    timeout "$tb" python3 -m isoexec.bench.gpu "$t" --config "$c" \
      --out-dir "$d" > "$O/bench_$t.log" 2>&1 || s=$?
    grep -q "'ok': False" "$O/bench_$t.log" && s=1
    tail -n 2 "$O/bench_$t.log" | cut -c1-300
  done
}
for stage in $STAGES; do echo "gpu_vllm_job: $stage ($(date -u +%T))"; $stage; done
kill %1 %2 2>/dev/null
exit $s
