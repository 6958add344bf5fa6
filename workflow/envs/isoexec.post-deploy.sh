#!/usr/bin/env bash
# Runs once inside the new conda environment (snakemake --sdm conda), from the workflow's working
# directory (the repository root): install this checkout as workflow/scripts/setup.sh does for .venv.
set -euo pipefail
python -m pip install -q -e ".[cpu,analysis]"
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
