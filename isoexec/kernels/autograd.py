"""Bitwise forward, reference backward: the one autograd wrapper every isoexec kernel set uses.

IsoExec needs bitwise-identical forwards in every case (docs/design.md, The unified model); the backward "need not be
bitwise". A region whose bitwise kernel has no derivative of its own (a Triton GEMM, norm or attention
kernel; fla's GDN forward in the native set) is therefore wrapped so that its forward returns the
kernel's bits and its gradient is that of a differentiable reference computing the same function
(cuBLAS/torch math, transformers' chunked GDN). The CPR GDN has backwards of its own (C on the CPU,
Triton on sm90).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _RefGrad(torch.autograd.Function):
    """Forward: ``fwd(*tensors)``. Backward: autograd through ``ref(*tensors)`` on detached copies."""

    @staticmethod
    def forward(ctx, fwd, ref, *tensors):  # noqa: D102
        ctx.ref = ref
        ctx.save_for_backward(*tensors)
        return fwd(*tensors)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        need = ctx.needs_input_grad[2:]
        ins = [t.detach().requires_grad_(bool(n)) for t, n in zip(ctx.saved_tensors, need)]
        with torch.enable_grad():
            out = ctx.ref(*ins)
        idx = [i for i, n in enumerate(need) if n]
        gs = torch.autograd.grad(out, [ins[i] for i in idx], grad, allow_unused=True)
        res: list[torch.Tensor | None] = [None] * len(ins)
        for i, gv in zip(idx, gs):
            res[i] = gv
        return (None, None, *res)


def with_ref_grad(fwd: Callable[..., torch.Tensor], ref: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fwd(*tensors)``; under autograd its gradient is that of ``ref(*tensors)``.

    Args:
        fwd: the bitwise kernel (no autograd needed); returns one tensor.
        ref: a differentiable function of the same tensors computing the same value.
        tensors: the inputs (tensors only; bind other arguments in the closures). Integer tensors
            get no gradient.

    Returns:
        ``fwd(*tensors)`` exactly; with grad enabled and any input requiring grad, wrapped so that
        ``backward`` runs ``ref`` (recomputed from the saved inputs).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _RefGrad.apply(fwd, ref, *tensors)
    return fwd(*tensors)
