"""Triton kernels for Hopper (sm90) and the CUDA kernel sets; importing this package registers
``("isoexec", "cuda")`` (:class:`IsoExecTriton`) and ``("native", "cuda")`` (:class:`NativeCUDA`)."""

from isoexec.kernels.triton.sets import IsoExecTriton, NativeCUDA

__all__ = ["IsoExecTriton", "NativeCUDA"]
