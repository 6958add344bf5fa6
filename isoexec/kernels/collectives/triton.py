"""pik row-parallel GEMM on CUDA over NCCL: the Triton leaf GEMM for the rank's subtree, the subtree
sums moved by the collective, the upper tree levels added in a fused combine-and-round kernel.

The algorithm of :func:`isoexec.kernels.collectives.pik.pik_row_parallel_linear` (docs/design.md, "Parallel
invariance (pik)") with GPU bits of its own: rank ``r`` of ``tp`` holds features ``[r*K/tp, (r+1)*K/tp)``
of ``x`` and ``w`` and owns leaves ``[r*G/tp, (r+1)*G/tp)`` of the G leaves over the global K. One launch of
:func:`isoexec.kernels.gemm.triton.linear_leaves_partial` reduces the rank's leaves in the tree order
(fp32); the collective moves the ``tp`` fp32 subtree sums, and
:func:`isoexec.kernels.gemm.triton.tree_combine` adds them in rank order by the same tree and rounds once
to the output dtype. Two ways to move them (same additions, same bits):

* ``all_gather``: every rank receives every subtree sum and combines all rows;
* ``reduce_scatter`` (default when ``tp`` divides M): an all-to-all sends each rank the subtree sums of
  its ``M/tp`` rows (the sequence-parallel reduce-scatter), each rank combines its rows and rounds them,
  and an all-gather of the rounded rows assembles the output: ``1.5 x`` the bytes of a bf16 ring
  all-reduce instead of ``2 x``.

The result is bitwise equal to :func:`isoexec.kernels.gemm.triton.linear_leaves` on the full tensors
(TP=1) for every ``tp`` dividing G.

:func:`native_row_parallel_linear` is the negative control (Megatron's row-parallel linear: cuBLAS on
the shard, NCCL ``all_reduce`` SUM in the activation dtype), whose bits change with ``tp``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from isoexec.kernels.gemm.triton import linear_leaves, linear_leaves_partial, tree_combine


def _degree_rank(group) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def pik_row_parallel_linear(x_shard: torch.Tensor, w_shard: torch.Tensor, cfg, leaves: int = 8, group=None,
                            out_dtype: torch.dtype | None = None, sequence_parallel: bool = False,
                            method: str | None = None) -> torch.Tensor:
    """Row-parallel ``x @ w.T`` (K sharded over TP ranks) whose bits do not depend on TP.

    Args:
        x_shard: ``[M, K/tp]`` (bf16 or fp32, CUDA). w_shard: ``[N, K/tp]`` (``nn.Linear`` layout).
        cfg: ``isoexec.config.TritonSection`` (leaf GEMM tiles).
        leaves: G over the global K (power of two in 1..8; contract constant ``kernels.leaves``).
        group: TP process group (None: the default group, or a single process = TP 1).
        out_dtype: output dtype (default ``x_shard.dtype``).
        sequence_parallel: return only rows ``[r*M/tp, (r+1)*M/tp)`` (reduce-scatter through an
            all-to-all of the fp32 row slices, then the same tree).
        method: ``"reduce_scatter"`` or ``"all_gather"`` (see the module docstring); None picks
            ``reduce_scatter`` when ``tp`` divides M. Not bit-relevant.

    Returns:
        ``[M, N]`` (or ``[M/tp, N]``) in ``out_dtype``, identical on every rank and equal to
        :func:`~isoexec.kernels.gemm.triton.linear_leaves` of the full tensors.

    Raises:
        ValueError: ``leaves`` not divisible by the TP degree, K/tp not divisible by G/tp, M not
            divisible by tp with ``sequence_parallel`` or ``method="reduce_scatter"``, or an unknown
            ``method`` (naming the values).
    """
    tp, rank = _degree_rank(group)
    od = out_dtype or x_shard.dtype
    if leaves % tp:
        raise ValueError(f"leaves={leaves} is not divisible by the TP degree tp={tp}: a rank must own a whole subtree")
    M, N = x_shard.shape[0], w_shard.shape[0]
    if method not in (None, "reduce_scatter", "all_gather"):
        raise ValueError(f"unknown method={method!r}; allowed: 'reduce_scatter', 'all_gather'")
    if tp == 1:
        return linear_leaves(x_shard, w_shard, cfg, leaves, od)
    if method is None:
        method = "reduce_scatter" if M % tp == 0 else "all_gather"
    if sequence_parallel or method == "reduce_scatter":
        if M % tp:
            raise ValueError(f"M={M} rows are not divisible by tp={tp} (sequence parallelism / reduce_scatter)")
        part = linear_leaves_partial(x_shard, w_shard, cfg, leaves // tp)
        recv = torch.empty((tp, M // tp, N), device=part.device, dtype=torch.float32)
        dist.all_to_all_single(recv, part.view(tp, M // tp, N), group=group)
        mine = tree_combine(recv, od)
        if sequence_parallel:
            return mine
        out = torch.empty((M, N), device=mine.device, dtype=od)
        dist.all_gather_into_tensor(out, mine, group=group)
        return out
    gathered = torch.empty((tp, M, N), device=x_shard.device, dtype=torch.float32)
    part = linear_leaves_partial(x_shard, w_shard, cfg, leaves // tp)
    dist.all_gather_into_tensor(gathered, part, group=group)
    return tree_combine(gathered, od)


def native_row_parallel_linear(x_shard: torch.Tensor, w_shard: torch.Tensor, group=None) -> torch.Tensor:
    """Negative control: cuBLAS ``x_shard @ w_shard.T`` in the activation dtype, then NCCL ``all_reduce``
    SUM (Megatron's ``RowParallelLinear``). Returns ``[M, N]`` in ``x_shard.dtype``."""
    tp, _ = _degree_rank(group)
    y = F.linear(x_shard, w_shard.to(x_shard.dtype))
    if tp > 1:
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


class _PikRowParallel(torch.autograd.Function):
    """Forward: :func:`pik_row_parallel_linear`. Backward (not bitwise, as Megatron's
    ``RowParallelLinear``): the output gradient, all-gathered along the rows under sequence
    parallelism, times the shard's weight and input (cuBLAS)."""

    @staticmethod
    def forward(ctx, x_shard, w_shard, cfg, leaves, group, sequence_parallel):  # noqa: D102
        ctx.save_for_backward(x_shard, w_shard)
        ctx.group, ctx.sp = group, sequence_parallel
        return pik_row_parallel_linear(x_shard, w_shard, cfg, leaves, group, sequence_parallel=sequence_parallel)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, w = ctx.saved_tensors
        tp, _ = _degree_rank(ctx.group)
        grad = grad.contiguous()
        if ctx.sp and tp > 1:
            full = torch.empty((grad.shape[0] * tp, *grad.shape[1:]), device=grad.device, dtype=grad.dtype)
            dist.all_gather_into_tensor(full, grad, group=ctx.group)
            grad = full
        gx = grad @ w.to(grad.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad.t() @ x.to(grad.dtype)).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None


def pik_row_parallel_linear_autograd(x_shard: torch.Tensor, w_shard: torch.Tensor, cfg, leaves: int, group,
                                     sequence_parallel: bool = False) -> torch.Tensor:
    """:func:`pik_row_parallel_linear` (output in ``x_shard.dtype``) with a gradient: the forward bits
    are pik's; the backward is the row-parallel linear's usual one (identity through the all-reduce,
    an all-gather of the rows through the sequence-parallel reduce-scatter), in the inputs' dtype.

    Args and returns: as :func:`pik_row_parallel_linear` (``x_shard [M, K/tp]``, ``w_shard [N, K/tp]``;
    ``[M, N]`` or ``[M/tp, N]``). Raises: as :func:`pik_row_parallel_linear`.
    """
    if torch.is_grad_enabled() and (x_shard.requires_grad or w_shard.requires_grad):
        return _PikRowParallel.apply(x_shard, w_shard, cfg, leaves, group, sequence_parallel)
    return pik_row_parallel_linear(x_shard, w_shard, cfg, leaves, group, sequence_parallel=sequence_parallel)
