#!/usr/bin/env bash
# On the GPU node (repository copy as the working directory): install the GPU stack brought as parts, run a
# job detached from the call that starts it, and collect its results into $OUT.
#
#   bash workflow/scripts/gpu_node.sh install          # park the carried parts (.gpu/site.tar.xz.*, rl.tar.*)
#                                                      # in /tmp/parts; once all of one are there (its sha256
#                                                      # matches), unpack the site tree to /tmp/site, then
#                                                      # pip-install the RL stack (once per machine); write
#                                                      # isoexec's entry points (vLLM plugin) into the site tree
#   bash workflow/scripts/gpu_node.sh start CMD...     # run CMD in the background in a snapshot of this copy
#                                                      # (/tmp/job/src), with the stack's environment; its
#                                                      # outputs go to /tmp/job/out (the job sees it as $JOB_OUT)
#   bash workflow/scripts/gpu_node.sh wait SECONDS     # wait for the job up to SECONDS, then pack /tmp/job/out
#                                                      # into $OUT/results.tar.gz and the log into $OUT/job.log
#   bash workflow/scripts/gpu_node.sh stop             # end a running job (its whole process session)
#   bash workflow/scripts/gpu_node.sh run CMD...       # CMD in the foreground, same environment
#
# The parts come from workflow/scripts/gpu_site.sh (on a machine with network); each travels in one device
# call (carry .gpu), the last one with `install` (and `start`). Files outside the repository copy stay on the
# node while it is kept between calls, and so does a detached job: a long job spans several calls, each
# `wait`ing and collecting what is done.
set -uo pipefail
USAGE="usage: gpu_node.sh install | start CMD... | wait SECONDS | stop | run CMD..."
[ $# -ge 1 ] || { echo "gpu_node: $USAGE"; exit 2; }
cmd=$1; shift
SITE=/tmp/site; PARTS=/tmp/parts; JOB=${GPU_NODE_JOB:-/tmp/job}  # GPU_NODE_JOB: for tests
stack_env() {
  export PYTHONPATH=${1:-$PWD}:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 TRITON_CACHE_AUTOTUNING=1 \
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # the commit shipped (this copy has no .git); written by the caller into .gpu/source_rev
  [ -f .gpu/source_rev ] && export ISOEXEC_SOURCE_REV=$(cat .gpu/source_rev)
  # the RL stack's scripts (snakemake) and an `isoexec` command for the workflow's rules (the copy is not
  # pip-installed: it runs from PYTHONPATH)
  mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -c "import sys; from isoexec.cli import app; sys.argv[0] = \\"isoexec\\"; app()" "$@"\n' > /tmp/bin/isoexec
  chmod +x /tmp/bin/isoexec; export PATH=/tmp/bin:$HOME/.local/bin:$PATH
  return 0
}
whole() {  # whole NAME: the parts of NAME (site.tar.xz, rl.tar) in $PARTS join to the brought site/rl.sha256
  local sum="$PARTS/${1%%.*}.sha256"
  [ -f "$sum" ] && ls "$PARTS/$1".?? > /dev/null 2>&1 || { echo "gpu_node: $1: no parts or sha256 yet"; return 1; }
  [ "$(cat "$PARTS/$1".?? | sha256sum | cut -c1-64)" = "$(cut -c1-64 "$sum")" ] && return 0
  echo "gpu_node: $1: parts so far ($(cd "$PARTS" && ls "$1".?? | tr '\n' ' ')) do not make it yet"; return 1
}
case "$cmd" in
  install)
    mkdir -p "$PARTS"
    for f in .gpu/site.tar.xz.* .gpu/site.sha256 .gpu/rl.tar.* .gpu/rl.sha256; do [ -f "$f" ] && cp "$f" "$PARTS/"; done
    if [ ! -f "$SITE/.complete" ] && whole site.tar.xz; then
      cat "$PARTS"/site.tar.xz.* | xz -d -T0 | tar -xf - -C /tmp && touch "$SITE/.complete" || exit 1
      stack_env
      python3 -c "import torch, vllm, megatron.core, fla, pydantic; print('gpu_node: vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
    fi
    if [ -f "$SITE/.complete" ] && [ ! -f "$SITE/.rl" ] && whole rl.tar; then
      # the RL stack: pip takes from the brought wheels only what the image (and the site tree) lacks, into
      # the image's Python environment; skyrl and skyrl-gym without their pins (see gpu_site.sh)
      mkdir -p /tmp/rl && cat "$PARTS"/rl.tar.* | tar -xf - -C /tmp/rl || exit 1
      stack_env
      pipi() { PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --find-links /tmp/rl/whl "$@"; }
      pipi --no-deps skyrl==0.4.0 skyrl-gym==0.4.0 func_timeout==4.3.5 torchdata==0.11.0 && \
        pipi $(tr '\n' ' ' < /tmp/rl/whl/stack.txt) || exit 1
      touch "$SITE/.rl"
      python3 -c "import ray, skyrl, datasets, snakemake; print('gpu_node: ray', ray.__version__, 'datasets', datasets.__version__)"
    fi
    # the copy runs from PYTHONPATH, not pip-installed: its entry points (the vLLM plugin that SkyRL's vLLM servers
    # need) as a distribution record in the site tree, which is on PYTHONPATH too (isoexec/engines/plugin_record.py)
    if [ -f "$SITE/.complete" ]; then stack_env; python3 -m isoexec.engines.plugin_record "$SITE" || exit 1; fi
    [ -f "$SITE/.complete" ] && echo "gpu_node: $SITE is installed"
    [ -f "$SITE/.rl" ] && echo "gpu_node: the RL stack is installed"
    ;;
  start)
    [ -f "$SITE/.complete" ] || { echo "gpu_node: install the stack first"; exit 1; }
    rm -rf "$JOB"; mkdir -p "$JOB/out"; cp -r "$PWD" "$JOB/src"
    (cd "$JOB/src" && stack_env "$JOB/src" && export JOB_OUT=$JOB/out && \
      setsid nohup bash -c "$*; echo \$? > $JOB/rc" > "$JOB/log" 2>&1 < /dev/null &)
    echo "gpu_node: started: $*"
    ;;
  wait)
    [[ ${1:-} =~ ^[0-9]+$ ]] || { echo "gpu_node: wait SECONDS: a whole number of seconds, got '${1:-}'"; exit 2; }
    # a machine released between calls comes back bare: say so at once instead of waiting for no job
    [ -d "$JOB" ] || { echo "gpu_node: no job on this machine (a fresh one: the last was released, its job lost)"; exit 1; }
    end=$((SECONDS + $1))
    while [ ! -f "$JOB/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    [ -f "$JOB/rc" ] && echo "gpu_node: job ended, exit $(cat $JOB/rc)" || echo "gpu_node: job still running"
    mkdir -p "${OUT:?}"; tar -czf "$OUT/results.tar.gz" -C "$JOB" out; cp "$JOB/log" "$OUT/job.log"
    tail -n 40 "$JOB/log"
    ;;
  stop)
    # the job runs in a session of its own (setsid): its leader is the shell that writes $JOB/rc
    sids=$(ps -eo sid=,args= | awk -v rc="$JOB/rc" 'index($0, rc) && !/awk/ {print $1}' | sort -u)
    for s in $sids; do pkill -9 -s "$s"; done
    sleep 2; echo "gpu_node: stopped sessions: ${sids:-none}"
    ;;
  run)
    stack_env; "$@"
    ;;
  *) echo "gpu_node: unknown command '$cmd'; $USAGE"; exit 2 ;;
esac
