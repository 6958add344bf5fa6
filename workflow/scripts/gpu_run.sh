#!/usr/bin/env bash
# The one script the GPU node runs: carried wheels -> GPU tests, gates, benchmarks, pik over NCCL.
# Usage (repo root, CUDA machine): OUT=/some/dir bash workflow/scripts/gpu_run.sh [STAGE]...
# Stages: test gates variants profile kernels cpr model rlstep pik; "all" = test gates kernels cpr profile
# rlstep pik. pik runs first, one process per GPU (torchrun, NCCL), when there are at least two GPUs; then
# the timed stages (variants profile kernels cpr model rlstep) run one after another on GPU 0 while the
# correctness stages (test gates) run on GPU 1 (with one GPU: after the timed stages, on GPU 0).
# Writes $OUT/h200/{kernel_bench.csv,cpr_layer.csv,cpr_breakdown.csv,variants_*.csv,
# model_throughput.csv,rl_step.csv,provenance.json,tests.log,gates/{gates.csv,contract.json}}, $OUT/h200x2/pik.csv
# and $OUT/log.txt; copy them
# to results/h200/ and results/h200x2/ to commit. Each stage has a time limit (T_<STAGE> seconds).
set -o pipefail
WHAT=" ${*:-all} "
has() { [[ "$WHAT" == *" $1 "* || ( "$WHAT" == *" all "* && " test gates kernels cpr profile rlstep pik " == *" $1 "* ) ]]; }
OUT=${OUT:-results}
mkdir -p "$OUT/h200" "$OUT/h200x2"
if [ -d .whl ] && ! python3 -c "import fla, pydantic" 2>/dev/null; then
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

timed_stages() {
  for s in variants profile kernels cpr model; do
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
  else
    timed_stages
    check_stages 0
  fi
  date -u
} 2>&1 | tee "$OUT/log.txt"
