#!/usr/bin/env bash
# Nsight Compute counters of issue 37's kernels (isoexec/bench/counters_gpu.py: the leaf GEMM, configured and Gluon,
# beside cuBLAS; CPR's forward kernels) on a GPU node whose stack gpu_node.sh installed:
#   bash workflow/scripts/gpu_node.sh run bash workflow/scripts/gpu_counters.sh OUTDIR
# -> OUTDIR/counters.ncu-rep (the report), counters.csv (one row per kernel launch and metric; counters_nvtx.csv: the
# same with each launch named by its NVTX range), counters.log, provenance.json. Clocks left alone (--clock-control none, the device
# notes' METHOD.md); ncu reads counters on the Firecracker machines only.
set -uo pipefail
O=${1:?usage: gpu_counters.sh OUTDIR}
mkdir -p "$O"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n1)
[ -n "$NCU" ] || { echo "gpu_counters: no ncu on this machine"; exit 1; }
"$NCU" --clock-control none --profile-from-start off --nvtx \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  -f -o "$O/counters" python3 -m isoexec.bench.counters_gpu > "$O/counters.log" 2>&1
s=$?
"$NCU" --import "$O/counters.ncu-rep" --csv --page details > "$O/counters.csv" 2>> "$O/counters.log" || s=$?
"$NCU" --import "$O/counters.ncu-rep" --csv --page details --print-nvtx-rename kernel > "$O/counters_nvtx.csv" \
  2>> "$O/counters.log" || s=$?
python3 - "$O/provenance.json" "$("$NCU" --version | tail -n 1)" <<'PY' || s=$?
import json, sys, torch
from isoexec.provenance import provenance
p = provenance("bash workflow/scripts/gpu_counters.sh OUTDIR")
p.update(device_name=torch.cuda.get_device_name(0), ncu=sys.argv[2])
open(sys.argv[1], "w").write(json.dumps(p, indent=2, sort_keys=True, default=str) + "\n")
PY
tail -n 5 "$O/counters.log"
exit $s
