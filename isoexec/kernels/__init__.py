"""Kernels per region (DESIGN §2): primitives, dense regions, attention, GDN, MoE, logprob, and the
kernel sets that bundle them (``isoexec`` and ``native``)."""

from isoexec.kernels.sets import KERNEL_SETS, IsoExecCPU, KernelImpl, KernelSet, NativeTorch, get_kernel_set

__all__ = ["KERNEL_SETS", "IsoExecCPU", "KernelImpl", "KernelSet", "NativeTorch", "get_kernel_set"]
