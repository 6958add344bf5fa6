"""Kernels by region family (docs/design.md, The kernels), after flash-linear-attention's ``fla/ops/<op>/`` layout: each
family folder holds the CPU isoexec kernels (``cpu.py``), the Triton isoexec kernels (``triton.py``)
and the native controls (``native.py``) side by side, with a math reference where one exists
(``gdn/reference.py``). :mod:`isoexec.kernels.registry` maps every contract region to the
implementation that runs, with its constants; :mod:`isoexec.kernels.primitives` and
:mod:`isoexec.kernels.autograd` are the shared helpers; ``collectives/`` holds the parallel-invariant
(pik) GEMMs and combines.
"""

__all__ = ["Impl", "KernelSet", "build_kernel_set"]


def __getattr__(name: str):
    """The registry's names, imported on first use (the registry imports torch; ``isoexec.config``
    reads the torch-free :mod:`isoexec.kernels.topology` at load)."""
    if name in __all__:
        from isoexec.kernels import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'isoexec.kernels' has no attribute {name!r}")
