"""Kernels by region family (DESIGN §2), after flash-linear-attention's ``fla/ops/<op>/`` layout: each
family folder holds the CPU isoexec kernels (``cpu.py``), the Triton isoexec kernels (``triton.py``)
and the native controls (``native.py``) side by side, with a math reference where one exists
(``gdn/reference.py``). :mod:`isoexec.kernels.registry` maps every contract region to the
implementation that runs, with its constants; :mod:`isoexec.kernels.primitives` and
:mod:`isoexec.kernels.autograd` are the shared helpers; ``collectives/`` holds the parallel-invariant
(pik) GEMMs and combines.
"""

from isoexec.kernels.registry import Impl, KernelSet, build_kernel_set

__all__ = ["Impl", "KernelSet", "build_kernel_set"]
