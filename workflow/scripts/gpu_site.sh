#!/usr/bin/env bash
# Build the GPU stack for a Hopper node without network (the lent H200: Python 3.12, torch 2.11.0+cu130,
# Triton 3.6, transformers 5.17, no vLLM / megatron-core / fla / pydantic) as one pre-unpacked Python site
# tree, compressed and split into parts that each travel in one device call beside the repository.
#
# Usage (repo root, any x86-64 machine with pip and network):
#   bash workflow/scripts/gpu_site.sh [OUTDIR=.gpu] [PART_MIB=56]
# Writes OUTDIR/site.tar.xz.aa, .ab, ... and OUTDIR/site.sha256 (of the whole site.tar.xz). On the node,
# workflow/scripts/gpu_node.sh joins, checks and unpacks them (see README, "GPU node").
#
# Contents: vLLM 0.26.0 (CUDA; it pins torch==2.11.0, the node's torch), the small wheels the node's image
# lacks for `import vllm` and an offline `vllm.LLM` (versions run on the node on 2026-12-04; xgrammar 0.2.8+
# needs apache-tvm-ffi >= 0.1.11, which clashes with vLLM 0.26's pin of 0.1.10), megatron-core 0.16.1 (the
# trainer), fla-core / flash-linear-attention 0.6.0 (native GDN), and isoexec's own wheel-less metadata is
# not needed (the node runs the repository copy on PYTHONPATH). Left out, as sm90 + bf16 never loads them:
# the FlashAttention 2 library (sm90 runs FlashAttention 3), the Rust server frontend, Blackwell-only
# kernels and deep_gemm builds for other Pythons. About 4 minutes on 2 cores, most of it xz -9.
set -euo pipefail
OUT=${1:-.gpu}; PART=${2:-56}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64
   --platform manylinux1_x86_64 --platform any"
python3 -m pip download -q $P -d "$W/whl" vllm==0.26.0 \
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
