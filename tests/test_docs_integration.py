"""Every snippet of docs/integration.md marked `<!-- tested: GROUP -->` runs, on CPU, against a tiny checkpoint.

The snippets of one group run in order in one fresh Python process (a snippet may use the names an earlier
one of its group defined), after a preamble that gives them what the guide says they get: `checkpoint`, a
tiny Qwen3-Next checkpoint folder, and a working directory holding `experiments/` and, for the data group,
`data/dapo-math-17k/train.parquet` in DAPO-Math-17k's schema (written from the embedded task). A fresh
process per group: vLLM, Megatron and SkyRL each keep process-global state.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "integration.md"
MARK = re.compile(r"<!-- tested: (\w+) -->\n```python\n(.*?)\n```", re.S)

PREAMBLE = """
import os
for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "%(port)d",
             "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
    os.environ.setdefault(k, v)
from isoexec.config import ModelSection, TaskSection
from isoexec.model.hf import build_checkpoint
checkpoint = str(build_checkpoint("ckpt", ModelSection(), vocab_size=256))
if %(data)r:
    from isoexec.rl.data import embedded_rows, write_parquet
    write_parquet(embedded_rows(TaskSection(num_train_prompts=64))[0], "data/dapo-math-17k/train.parquet")
"""


def snippets() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for group, code in MARK.findall(GUIDE.read_text()):
        groups.setdefault(group, []).append(code)
    return groups


def test_the_guide_marks_its_snippets():
    """Every ```python block of the guide is marked for testing (none is left untried)."""
    text = GUIDE.read_text()
    assert text.count("```python") == sum(len(v) for v in snippets().values())
    assert set(snippets()) == {"vllm", "megatron", "skyrl", "data"}


NEEDS = {"vllm": "vllm", "megatron": "megatron.core", "skyrl": "skyrl", "data": "datasets"}


@pytest.mark.parametrize("group", sorted(NEEDS))
def test_integration_guide_snippets_run(group, tmp_path):
    pytest.importorskip(NEEDS[group], reason=f"{NEEDS[group]} is not installed")
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    code = PREAMBLE % {"port": 29500 + os.getpid() % 400, "data": group == "data"}
    code += "\n\n".join(snippets()[group]) + "\nprint('SNIPPETS OK')\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "SNIPPETS OK" in r.stdout, (r.stdout[-3000:], r.stderr[-5000:])
