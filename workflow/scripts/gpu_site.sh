#!/usr/bin/env bash
# Build the GPU stack for a Hopper node without network (the lent H200: Python 3.12, torch 2.11.0+cu130,
# Triton 3.6, transformers 5.17, no vLLM / megatron-core / fla / pydantic) as one pre-unpacked Python site
# tree, compressed and split into parts that each travel in one device call beside the repository.
#
# Usage (repo root, any x86-64 machine with pip and network):
#   bash workflow/scripts/gpu_site.sh [OUTDIR=.gpu] [PART_MIB=40] [WHAT=all|site|rl]
# Writes OUTDIR/site.tar.xz.aa, .ab, ... and OUTDIR/site.sha256 (of the whole site.tar.xz), and (rl) the RL
# stack's wheels as OUTDIR/rl.tar.aa, ... and OUTDIR/rl.sha256. On the node, workflow/scripts/gpu_node.sh
# joins, checks and unpacks them (see README, "GPU node").
#
# Contents: vLLM 0.26.0 (CUDA; it pins torch==2.11.0, the node's torch), the small wheels the node's image
# lacks for `import vllm` and an offline `vllm.LLM` (versions run on the node on 2026-12-04; xgrammar 0.2.8+
# needs apache-tvm-ffi >= 0.1.11, which clashes with vLLM 0.26's pin of 0.1.10), megatron-core 0.16.1 (the
# trainer), fla-core / flash-linear-attention 0.6.0 (native GDN), and isoexec's own wheel-less metadata is
# not needed (the node runs the repository copy on PYTHONPATH). Left out, as sm90 + bf16 never loads them:
# the FlashAttention 2 library (sm90 runs FlashAttention 3), the Rust server frontend, Blackwell-only
# kernels and deep_gemm builds for other Pythons. About 4 minutes on 2 cores, most of it xz -9.
#
# The RL stack (rl): what `snakemake reproduce` with the SkyRL driver needs besides the site tree: skyrl and
# skyrl-gym 0.4.0 (installed without their dependencies: they pin transformers <= 5.16.1, and the node's
# 5.17 runs them, as 5.19 does on the CPU) and torchdata 0.11.0 (it pins its own torch), Ray 2.57.0, hydra/omegaconf, datasets, snakemake and their
# dependencies, as wheels (pure-Python sdists built here) that pip on the node installs offline into the
# user site, taking only what the image lacks. Ray's Java jars, RLlib and dashboard front end and PuLP's
# solver builds for other systems are dropped from their wheels (never loaded: no dashboard, greedy
# scheduling needs no solver binary on another OS).
set -euo pipefail
OUT=${1:-.gpu}; PART=${2:-40}; WHAT=${3:-all}
# a device call carries at most 64 MiB: one part plus the repository's tracked files (16 MiB late on 2026-12-04;
# 52 MiB parts stopped fitting as results/ grew, and 44 left no room to grow). Refuse a part size that leaves
# less than 4 MiB to spare.
[[ $PART =~ ^[0-9]+$ ]] || { echo "gpu_site: PART_MIB must be a whole number of MiB, got '$PART'"; exit 2; }
repo_mib=$(( ($(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) + 1048575) / 1048576 ))
(( PART + repo_mib + 4 <= 64 )) || { echo "gpu_site: a part of $PART MiB beside the repository's $repo_mib MiB leaves under 4 of the 64 MiB a device call carries; PART_MIB must be at most $((60 - repo_mib))"; exit 2; }
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64
   --platform manylinux1_x86_64 --platform any"
site() {
  python3 -m pip download -q --no-deps $P -d "$W/whl" vllm==0.26.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 cbor2==6.3.0 \
    pyzmq==27.3.0 msgspec==0.23.0 pybase64==1.5.1 cachetools==8.0.2 openai-harmony==0.0.8 openai==3.60.0 \
    httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 llguidance==1.7.6 \
    xgrammar==0.2.7 apache-tvm-ffi==0.1.10 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 \
    compressed-tensors==0.17.0 loguru==0.7.3 \
    megatron-core==0.16.1 fla-core==0.6.0 flash-linear-attention==0.6.0
  mkdir -p "$W/site"
  for w in "$W"/whl/*.whl; do (cd "$W/site" && unzip -q -o "$w"); done
  cd "$W/site"
  rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
  rm -rf vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm/include
  find . -name '__pycache__' -prune -exec rm -rf {} +
  cd "$W"
  tar -cf - site | xz -T2 -9 > site.tar.xz
  rm -f "$OUT"/site.tar.xz.*
  sha256sum site.tar.xz | sed 's# .*#  site.tar.xz#' > "$OUT/site.sha256"
  split -b "${PART}M" -a 2 site.tar.xz "$OUT/site.tar.xz."
  ls -la "$OUT"
}

# pyproject.toml's skyrl extra (torchdata without its torch pin: the node's torch), snakemake and datasets
# of its analysis extra, and isoexec's CLI dependencies; and what SkyRL's vLLM server imports beyond an offline
# vllm.LLM (vllm/entrypoints/openai/api_server.py and the routers it mounts: watchfiles, the SageMaker/LoRA
# routers' model-hosting-container-standards, prometheus-fastapi-instrumentator, python-json-logger) and
# SkyRL's weight-sync payload (zstandard): vLLM 0.26's and skyrl 0.4's requirements the node's image lacks
# (pip's report on the node, 2026-12-04; the recipe's first H200 launch stopped at `import watchfiles`)
RL_STACK="ray==2.57.0 jaxtyping==0.3.11 omegaconf==2.3.1 hydra-core==1.3.4 cloudpathlib==0.26.0 orjson==3.13.0
  vllm-router==0.1.14 loguru tqdm datasets==5.2.0 snakemake==9.27.1 typer rich pyyaml
  watchfiles==1.3.0 model-hosting-container-standards==0.1.16 prometheus-fastapi-instrumentator==8.1.0
  python-json-logger==4.2.0 zstandard==0.25.0 ijson==3.6.0"
rl() {
  mkdir -p "$W/rl/whl" "$W/rl/sdist"
  python3 -m pip wheel -q --no-deps -w "$W/rl/sdist" func_timeout==4.3.5 antlr4-python3-runtime==4.9.3 connection_pool==0.0.3
  python3 -m pip download -q $P --no-deps -d "$W/rl/whl" skyrl==0.4.0 skyrl-gym==0.4.0 torchdata==0.11.0
  python3 -m pip download -q $P --find-links "$W/rl/sdist" -d "$W/rl/whl" $RL_STACK
  cp "$W"/rl/sdist/*.whl "$W/rl/whl/"
  echo $RL_STACK > "$W/rl/whl/stack.txt"  # what gpu_node.sh installs
  # the image has numpy (torch, transformers) and the site tree pydantic: pip finds them installed
  rm -f "$W"/rl/whl/numpy-* "$W"/rl/whl/pydantic-* "$W"/rl/whl/pydantic_core-* "$W"/rl/whl/annotated_types-* \
    "$W"/rl/whl/typing_inspection-*
  python3 - "$W"/rl/whl/ray-*.whl "$W"/rl/whl/pulp-*.whl <<'PY'
import sys, zipfile, os
drop = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/build/", "pulp/solverdir/cbc/osx", "pulp/solverdir/cbc/win",
        "pulp/solverdir/cbc/linux/arm64", "pulp/solverdir/cbc/linux/i32")
for path in sys.argv[1:]:
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if item.filename.startswith(drop) or item.filename.endswith(".map"):
                continue
            data = zin.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l + b"\n" for l in data.splitlines() if not l.decode().split(",")[0].startswith(drop))
            zout.writestr(item, data)
    os.replace(tmp, path)
PY
  (cd "$W/rl" && tar -cf rl.tar whl)
  rm -f "$OUT"/rl.tar.*
  sha256sum "$W/rl/rl.tar" | sed 's# .*#  rl.tar#' > "$OUT/rl.sha256"
  split -b "${PART}M" -a 2 "$W/rl/rl.tar" "$OUT/rl.tar."
  ls -la "$OUT"
}

case "$WHAT" in
  all) site; rl ;;
  site) site ;;
  rl) rl ;;
  *) echo "gpu_site: WHAT must be all, site or rl, got $WHAT"; exit 2 ;;
esac
