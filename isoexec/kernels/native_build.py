"""Build and load the project's own C kernels (CPU): compiled once per machine with the system C
compiler into a cache folder, loaded with ``ctypes``.

The flags are part of a kernel's bits and are recorded in the contract by the kernel that uses them:
``-O3 -march=native`` (vector width may differ between machines; the kernels are written so that it
cannot change a result), ``-ffp-contract=off`` (the compiler fuses no multiply and add; a kernel's
fused multiply-adds are its explicit ``fmaf`` calls, one correctly rounded operation each), no
``-ffast-math``. Libraries are cached per source, flags, compiler version and CPU (``-march=native``
code must not run on another CPU).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c11")
"""Compiler flags of every C kernel (bit-relevant: recorded in the contract)."""


LDLIBS = ("-lm",)
"""Libraries linked into every C kernel (libm for ``fmaf``, ``expf``; linking moves no bit)."""


@cache
def _compiler_id(cc: str) -> str:
    """The compiler's path and first ``--version`` line."""
    r = subprocess.run([cc, "--version"], capture_output=True, text=True)
    return f"{cc} {r.stdout.splitlines()[0] if r.stdout else ''}"


@cache
def _cpu_id() -> str:
    """This CPU's model and feature flags (what ``-march=native`` compiles for), from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags", "cpu family", "model\t"))]
    return "\n".join(dict.fromkeys(keep))  # the first CPU's lines (all CPUs repeat them)


def cache_dir() -> Path:
    """Where built libraries are kept: ``~/.cache/isoexec``."""
    return Path.home() / ".cache" / "isoexec"


@cache
def load_c_kernel(source: str) -> ctypes.CDLL:
    """Compile ``source`` (a file path) to a shared library, keyed by its content and the flags, and load it.

    Raises:
        RuntimeError: no C compiler on PATH (names what was looked for) or the compiler failed
            (with its message).
    """
    src = Path(source)
    code = src.read_bytes()
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler on PATH (looked for cc, gcc): the isoexec CPU kernels need one")
    ident = " ".join(CFLAGS) + _compiler_id(cc) + _cpu_id()
    key = hashlib.sha256(code + ident.encode()).hexdigest()[:16]
    lib = cache_dir() / f"{src.stem}-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            r = subprocess.run([cc, *CFLAGS, str(src), "-o", str(out), *LDLIBS], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"compiling {src.name} with {cc} failed:\n{r.stderr}")
            os.replace(out, lib)  # atomic: concurrent builders leave one complete library
    return ctypes.CDLL(str(lib))


@cache
def kernel_library(anchor: str, relative: str) -> ctypes.CDLL:
    """The C kernel ``relative`` to the folder of the file ``anchor`` (a kernel module's ``__file__``),
    built and loaded by :func:`load_c_kernel`; looked up once per (anchor, relative)."""
    return load_c_kernel(str(Path(anchor).parent / relative))


def c_ptr(t) -> ctypes.c_void_p:
    """A tensor's data pointer as a ``ctypes`` argument (the caller keeps ``t`` alive during the call)."""
    return ctypes.c_void_p(t.data_ptr())
