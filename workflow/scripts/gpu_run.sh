#!/usr/bin/env bash
# The one script the GPU node runs: carried wheels -> GPU tests -> gates -> benchmarks.
# Usage (repo root, CUDA machine): OUT=/some/dir bash workflow/scripts/gpu_run.sh [all|tune|gates|bench|test]...
# ("all" = test tune gates bench; "profile" = CPR kernel-time breakdown; several stages may be named).
# Writes $OUT/h200/{gates.csv,contract.json,kernel_bench.csv,cpr_layer.csv,model_throughput.csv,provenance.json}
# and $OUT/log.txt; copy $OUT/h200/* to results/h200/ to commit. Each stage has a time limit
# (T_TEST, T_GATES, T_BENCH seconds) so that a partial run still returns what it finished.
set -o pipefail
WHAT=" ${*:-all} "
has() { [[ "$WHAT" == *" all "* || "$WHAT" == *" $1 "* ]]; }
OUT=${OUT:-results}
mkdir -p "$OUT/h200"
if [ -d .whl ] && ! python3 -c "import fla, pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
CONFIG=${CONFIG:-experiments/h200.yaml}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  if has test; then
    timeout "${T_TEST:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py 2>&1 | tail -n 60
  fi
  if has tune; then
    timeout "${T_TUNE:-150}" python3 -m isoexec.bench.gpu tune --config "$CONFIG" --out-dir "$OUT/h200"
    echo "tune exit: $?"; [ -f "$OUT/h200/tuned.yaml" ] && CONFIG=$OUT/h200/tuned.yaml && cat "$CONFIG"
  fi
  if has gates; then
    timeout "${T_GATES:-300}" python3 -m isoexec.bench.gpu gates --config "$CONFIG" --out-dir "$OUT/h200"
    echo "gates exit: $?"
  fi
  if has profile; then
    timeout "${T_PROFILE:-120}" python3 -m isoexec.bench.gpu profile --config "$CONFIG" --out-dir "$OUT/h200"
  fi
  if has bench; then
    timeout "${T_BENCH:-300}" python3 -m isoexec.bench.gpu bench --config "$CONFIG" --out-dir "$OUT/h200"
    echo "bench exit: $?"
  fi
  date -u
} 2>&1 | tee "$OUT/log.txt"
