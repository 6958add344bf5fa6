#!/usr/bin/env bash
# The one script the GPU node runs: carried wheels -> GPU tests, gates, benchmarks, pik over NCCL.
# Usage (repo root, CUDA machine): OUT=/some/dir bash workflow/scripts/gpu_run.sh [STAGE]...
# Stages: test gates variants profile kernels cpr cpr_backward cpr_chunkwise model conv rlstep pik megatron; "all" = test gates kernels cpr
# profile rlstep pik megatron. pik runs first, one process per GPU (torchrun, NCCL), when there are at least
# two GPUs; then the timed stages (variants profile kernels cpr model rlstep, then the one-GPU phase of
# megatron) run one after another on GPU 0 while the correctness stages (test gates) run on GPU 1 (with one
# GPU: after the timed stages, on GPU 0); last, megatron's two-GPU phase (torchrun, NCCL: the Megatron
# trainer at TP=2 + SP, EP=2, TP=2 x EP=2 against the one-GPU phase's TP=1 and engine rows).
# Writes $OUT/h200/{kernel_bench.csv,cpr_layer.csv,cpr_breakdown.csv,cpr_chunkwise.csv,variants_*.csv,
# model_throughput.csv,rl_step.csv,provenance.json,tests.log,gates/{gates.csv,contract.json}},
# $OUT/h200x2/{pik.csv,megatron.csv,megatron_step.csv,megatron_tests.log,*.provenance.json} and $OUT/log.txt; copy them
# to results/h200/ and results/h200x2/ to commit. Each stage has a time limit (T_<STAGE> seconds; megatron:
# T_MEGATRON1 and T_MEGATRON2 for its two phases).
set -o pipefail
WHAT=" ${*:-all} "
has() { [[ "$WHAT" == *" $1 "* || ( "$WHAT" == *" all "* && " test gates kernels cpr profile rlstep pik megatron " == *" $1 "* ) ]]; }
OUT=${OUT:-results}
mkdir -p "$OUT/h200" "$OUT/h200x2"
if [ -d .whl ] && ! python3 -c "import fla, pydantic, megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# NVLink multicast stays off (a program using it can take the host's shared GPUs down)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CONFIG=${CONFIG:-experiments/h200.yaml}
RLCONFIG=${RLCONFIG:-experiments/h200-rlstep.yaml}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
B="python3 -m isoexec.bench.gpu"
MEGATRON_WORK=$(mktemp -d)
M="-m isoexec.bench.megatron_gpu --config $CONFIG --work $MEGATRON_WORK"

timed_stages() {
  for s in variants profile kernels cpr cpr_backward cpr_chunkwise model conv; do
    if has $s; then
      CUDA_VISIBLE_DEVICES=0 timeout "$(eval echo \${T_${s^^}:-300})" $B $s --config "$CONFIG" --extra-config "$RLCONFIG" \
        --out-dir "$OUT/h200"
      echo "$s exit: $?"
    fi
  done
  if has rlstep; then
    CUDA_VISIBLE_DEVICES=0 timeout "${T_RLSTEP:-300}" python3 -m isoexec.bench.rl_step --config "$RLCONFIG" \
      --out "$OUT/h200/rl_step.csv" ${RL_ARGS:-}
    echo "rlstep exit: $?"
  fi
  if has megatron && [ "$NGPU" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout "${T_MEGATRON1:-240}" python3 -m torch.distributed.run --standalone --nproc_per_node 1 $M --phase single
    echo "megatron single exit: $?"
  fi
}

check_stages() {
  local dev=$1
  if has test; then
    CUDA_VISIBLE_DEVICES=$dev timeout "${T_TEST:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
      > "$OUT/h200/tests.log" 2>&1
    echo "test exit: $? ($(tail -n 1 "$OUT/h200/tests.log"))"
  fi
  if has gates; then
    CUDA_VISIBLE_DEVICES=$dev timeout "${T_GATES:-300}" $B gates --config "$CONFIG" --out-dir "$OUT/h200/gates"
    echo "gates exit: $?"
  fi
  if has megatron; then
    CUDA_VISIBLE_DEVICES=$dev timeout "${T_MTEST:-120}" python3 -m pytest -q -p no:cacheprovider \
      tests/test_trainer_megatron_gpu.py tests/test_trainer_megatron_compat.py > "$OUT/h200x2/megatron_tests.log" 2>&1
    echo "megatron tests exit: $? ($(tail -n 1 "$OUT/h200x2/megatron_tests.log"))"
  fi
}

{
  date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  if has pik && [ "$NGPU" -ge 2 ]; then
    timeout "${T_PIK:-240}" python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" -m isoexec.bench.pik_gpu \
      --config "$CONFIG" --extra-config "$RLCONFIG" --out "$OUT/h200x2/pik.csv"
    echo "pik exit: $?"
  fi
  if [ "$NGPU" -ge 2 ]; then
    check_stages 1 &
    CHECKS=$!
    timed_stages
    wait $CHECKS
    if has megatron; then
      timeout "${T_MEGATRON2:-300}" python3 -m torch.distributed.run --standalone --nproc_per_node 2 $M --phase pair \
        --out "$OUT/h200x2/megatron.csv"
      echo "megatron pair exit: $?"
    fi
  else
    timed_stages
    check_stages 0
  fi
  date -u
} 2>&1 | tee "$OUT/log.txt"
