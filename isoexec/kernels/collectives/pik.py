"""Parallel-invariant kernels (pik): tensor-, sequence- and expert-parallel GEMM and combine whose bits
do not depend on the parallel degree.

Source: docs/design.md, "Parallel invariance (pik)" (the IsoExec pik rule) and "The experiments" (logits bitwise
equal across TP/EP/SP layouts with pik; native differs). This module is the reference built on
``torch.distributed`` (gloo on CPU, NCCL on CUDA) and the batch-invariant primitives of
:mod:`isoexec.kernels.primitives`.

The rule, per parallel dimension:

* **Row-parallel linear (TP, K sharded)**: K is split into ``leaves`` (G, default 8) fixed contiguous
  leaves by *global* K index. Each leaf's partial product is one FMA chain over the leaf's features
  per output (:func:`~isoexec.kernels.primitives.tile_mm`, fp32), which does not depend on TP. The G
  leaf partials are combined by one fixed binary tree that pairs adjacent nodes
  (``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))``). TP rank ``r`` owns the whole subtree of leaves
  ``[r*G/tp, (r+1)*G/tp)`` and reduces it locally in that order; the collective only moves the
  per-rank subtree sums (all-gather), and every rank finishes the upper levels of the same tree.
  Elementwise fp32 adds are exact per element, so every TP in the domain (powers of two dividing G:
  1, 2, 4, 8 for G = 8) adds the same numbers in the same order.
* **Column-parallel linear (TP, M sharded)**: ``tile_mm`` computes every output column by its own
  FMA chain over K, so a rank's slice of output features has the bits of the same columns of the full
  product (``tests/test_pik.py``; MKL's ``torch.mm`` does not: it picks another kernel for narrow
  outputs, the negative control there). The shards stay whole ``col_tile`` blocks (the API's check).
* **Sequence parallelism (SP)**: reduce-scatter reuses the same tree: each rank receives every rank's
  partial for its row slice (all-to-all of partial results) and adds them in the fixed tree order, so
  reduce-scatter == all-reduce then slice, bit for bit.
* **Expert parallelism (EP)**: expert outputs are moved, never summed, by the collective; each token
  sums its top-k expert outputs in routing order (rank 0 of the routing first) in fp32, whichever EP
  rank owns each expert — :func:`isoexec.kernels.moe.routing.routing_order_sum`, as the single-process MoE.

The ``native_*`` functions are the negative controls (local GEMM then ``all_reduce`` SUM; per-rank
partial MoE sums then ``all_reduce``): their bits change with the degree.

Process groups: ``group=None`` means the default group when ``torch.distributed`` is initialised, and a
single process (degree 1, no collective) otherwise. Every rank of the group must call a collective
function with the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from isoexec.kernels.moe.routing import routing_order_sum
from isoexec.kernels.primitives import tile_linear

__all__ = [
    "native_expert_parallel_combine",
    "native_row_parallel_linear",
    "pik_all_reduce",
    "pik_column_linear",
    "pik_column_parallel_linear",
    "pik_degrees",
    "pik_expert_parallel_combine",
    "pik_linear",
    "pik_reduce_scatter",
    "pik_row_parallel_linear",
    "pik_row_parallel_partial",
    "pik_tree_combine",
]


# ------------------------------------------------------------------------------------------ helpers
def _degree_rank(group) -> tuple[int, int]:
    """(degree, rank) of ``group``; (1, 0) when ``group`` is None and no process group exists."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def pik_degrees(leaves: int = 8) -> tuple[int, ...]:
    """Parallel degrees under which a ``leaves``-leaf row-parallel GEMM is invariant: the powers of
    two that divide ``leaves`` (``(1, 2, 4, 8)`` for 8). Use as ``TopologyClaim(domain=...)`` for ``tp``.

    Raises:
        ValueError: ``leaves`` is not a power of two >= 1.
    """
    if not _is_pow2(leaves):
        raise ValueError(f"leaves must be a power of two >= 1, got leaves={leaves}")
    return tuple(2**i for i in range(leaves.bit_length()))


def _check_leaves(leaves: int, tp: int) -> int:
    if not _is_pow2(leaves):
        raise ValueError(f"leaves must be a power of two >= 1 (fixed binary tree), got leaves={leaves}")
    if leaves % tp != 0:
        raise ValueError(
            f"leaves={leaves} is not divisible by the TP degree tp={tp}: a rank must own a whole "
            f"subtree; allowed tp: {list(pik_degrees(leaves))}"
        )
    return leaves // tp


def pik_tree_combine(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum ``parts`` by the fixed binary tree that pairs adjacent nodes: ``(p0+p1), (p2+p3), ...``,
    then pairs of pairs, until one node is left.

    Args:
        parts: a power-of-two number (>= 1) of tensors of one shape and dtype (fp32 partials).

    Returns:
        The sum, same shape and dtype. The addition order depends only on ``len(parts)``; a subtree
        over a contiguous, aligned range of ``parts`` is reduced exactly as in the whole tree.

    Raises:
        ValueError: ``len(parts)`` is not a power of two.
    """
    nodes = list(parts)
    if not _is_pow2(len(nodes)):
        raise ValueError(f"pik_tree_combine needs a power-of-two number of parts, got {len(nodes)}")
    while len(nodes) > 1:
        nodes = [nodes[i] + nodes[i + 1] for i in range(0, len(nodes), 2)]
    return nodes[0]


def _all_gather(t: torch.Tensor, group, tp: int) -> list[torch.Tensor]:
    if tp == 1:
        return [t]
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(out, t, group=group)
    return out


# ------------------------------------------------------------------------------- row-parallel (TP)
def pik_row_parallel_partial(
    x_shard: torch.Tensor, w_shard: torch.Tensor, tp: int, leaves: int = 8, row_tile: int = 16
) -> torch.Tensor:
    """One TP rank's subtree sum of a row-parallel GEMM (no communication).

    Args:
        x_shard: ``[N, K/tp]`` the rank's contiguous slice of the input features (bf16 or fp32).
        w_shard: ``[M, K/tp]`` the same slice of the weight, Hugging Face ``nn.Linear`` layout.
        tp: the TP degree (a power of two dividing ``leaves``).
        leaves: G, fixed leaves over the global K (contract constant; default 8).
        row_tile: rows per cache tile of the GEMM (contract constant ``row_tile``; moves no bit).

    Returns:
        ``[N, M]`` fp32: the sum of the rank's ``leaves/tp`` leaf partials in fixed tree order
        (:func:`pik_tree_combine`'s tree), in one call of the C GEMM (``tile_mm`` with ``leaves``):
        each leaf's partial is one FMA chain over its ``K/leaves`` features, whatever ``tp`` is.

    Raises:
        ValueError: ``leaves`` not a power of two, ``leaves % tp != 0``, mismatched K, or ``K/tp`` not
            divisible by ``leaves/tp``.
    """
    per_rank = _check_leaves(leaves, tp)
    if x_shard.dim() != 2 or w_shard.dim() != 2 or x_shard.shape[1] != w_shard.shape[1]:
        raise ValueError(
            f"x_shard [N, K/tp] and w_shard [M, K/tp] must share K/tp, got {tuple(x_shard.shape)} and "
            f"{tuple(w_shard.shape)}"
        )
    k_local = x_shard.shape[1]
    if k_local % per_rank != 0:
        raise ValueError(
            f"local K={k_local} is not divisible by leaves/tp={per_rank} (leaves={leaves}, tp={tp}); "
            f"the global K must be divisible by leaves"
        )
    return tile_linear(x_shard, w_shard, row_tile, leaves=per_rank)


def pik_all_reduce(partial: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce of per-rank subtree sums in the fixed tree order (all-gather, then
    :func:`pik_tree_combine` over the ranks in rank order on every rank).

    Args:
        partial: the rank's fp32 partial, same shape on every rank.
        group: process group (None: default group, or a single process).

    Returns:
        The tree sum, identical on every rank, same shape and dtype as ``partial``.
    """
    tp, _ = _degree_rank(group)
    return pik_tree_combine(_all_gather(partial, group, tp))


def pik_reduce_scatter(partial: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter along dim 0 (sequence parallelism) with the pik tree: bitwise equal to
    ``pik_all_reduce(partial)`` sliced to this rank's rows.

    Each rank sends row slice ``s`` of its partial to rank ``s`` (all-to-all; only partial results
    move) and adds the ``tp`` received slices in the fixed tree order. Elementwise adds do not depend
    on the other elements, so adding slices equals slicing the sum.

    Args:
        partial: ``[N, ...]`` fp32 partial; N divisible by the group size.
        group: process group (None: default group, or a single process).

    Returns:
        ``[N/tp, ...]``: rows ``[rank*N/tp, (rank+1)*N/tp)`` of the tree sum.

    Raises:
        ValueError: N is not divisible by the group size (naming both).
    """
    tp, _ = _degree_rank(group)
    n = partial.shape[0]
    if n % tp != 0:
        raise ValueError(f"sequence length N={n} is not divisible by the SP degree sp={tp}")
    if tp == 1:
        return partial
    chunks = [c.contiguous() for c in partial.split(n // tp, dim=0)]
    recv = [torch.empty_like(chunks[0]) for _ in range(tp)]
    dist.all_to_all(recv, chunks, group=group)
    return pik_tree_combine(recv)


def pik_row_parallel_linear(
    x_shard: torch.Tensor,
    w_shard: torch.Tensor,
    group=None,
    leaves: int = 8,
    row_tile: int = 16,
    out_dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Row-parallel ``x @ w.T`` (K sharded over TP ranks) whose bits do not depend on TP.

    Rank ``r`` of ``tp`` ranks holds features ``[r*K/tp, (r+1)*K/tp)`` of ``x`` and ``w``. It reduces its
    own subtree of leaves (:func:`pik_row_parallel_partial`); the subtree sums are all-gathered (or,
    with ``sequence_parallel``, reduce-scattered along the rows) and the upper tree levels finished in
    the fixed order; one rounding to ``out_dtype`` at the end. Bitwise equal to :func:`pik_linear` on
    the full tensors for every ``tp`` in :func:`pik_degrees` (``leaves``).

    Args:
        x_shard: ``[N, K/tp]`` (bf16 or fp32). w_shard: ``[M, K/tp]`` (HF ``nn.Linear`` layout).
        group: TP process group (None: default group, or a single process = TP 1).
        leaves: G, fixed contiguous leaves over the global K (power of two; default 8; docs/design.md, Parallel invariance (pik)).
        row_tile: rows per cache tile of the GEMM (contract constant; moves no bit).
        out_dtype: output dtype; default ``x_shard.dtype`` (``torch.float32`` keeps the accumulator).
        sequence_parallel: return only this rank's rows ``[r*N/tp, (r+1)*N/tp)`` (reduce-scatter).

    Returns:
        ``[N, M]`` (or ``[N/tp, M]`` with ``sequence_parallel``) in ``out_dtype``, identical on all ranks.

    Raises:
        ValueError: ``leaves % tp != 0`` or ``leaves`` not a power of two (naming both values), K not
            divisible by ``leaves``, mismatched shapes, or N not divisible by tp with ``sequence_parallel``.
    """
    tp, _ = _degree_rank(group)
    partial = pik_row_parallel_partial(x_shard, w_shard, tp, leaves, row_tile)
    y = pik_reduce_scatter(partial, group) if sequence_parallel else pik_all_reduce(partial, group)
    return y.to(out_dtype or x_shard.dtype)


def pik_linear(
    x: torch.Tensor, w: torch.Tensor, leaves: int = 8, row_tile: int = 16, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Single-process reference of :func:`pik_row_parallel_linear` (TP = 1): ``x @ w.T`` as G leaf GEMMs
    combined by the fixed tree. Not bitwise equal to :func:`~isoexec.kernels.gemm.cpu.iso_linear` (one
    GEMM over all of K): ``leaves`` is a bit-relevant contract constant.

    Args:
        x: ``[N, K]``. w: ``[M, K]``. leaves, row_tile, out_dtype: as in :func:`pik_row_parallel_linear`.

    Returns:
        ``[N, M]`` in ``out_dtype`` (default ``x.dtype``); batch-invariant (row i depends only on ``x[i]``).
    """
    return pik_tree_combine([pik_row_parallel_partial(x, w, 1, leaves, row_tile)]).to(out_dtype or x.dtype)


def native_row_parallel_linear(x_shard: torch.Tensor, w_shard: torch.Tensor, group=None) -> torch.Tensor:
    """Negative control: Megatron-style row-parallel linear, local ``x_shard @ w_shard.T`` then
    ``dist.all_reduce`` SUM. The reduction order changes with TP, so the bits do.

    Args:
        x_shard: ``[N, K/tp]``. w_shard: ``[M, K/tp]``. group: as in :func:`pik_row_parallel_linear`.

    Returns:
        ``[N, M]`` in the inputs' dtype.
    """
    tp, _ = _degree_rank(group)
    y = x_shard @ w_shard.t()
    if tp > 1:
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


# ---------------------------------------------------------------------------- column-parallel (TP)
def pik_column_linear(
    x: torch.Tensor, w: torch.Tensor, col_tile: int = 16, row_tile: int = 16, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x @ w.T`` in fp32 accumulation by :func:`~isoexec.kernels.primitives.tile_mm`: the bits of an
    output column depend only on its weight column, so any shard of whole ``col_tile`` blocks
    reproduces the same columns.

    Args:
        x: ``[N, K]`` (bf16 or fp32). w: ``[M, K]`` (HF layout), ``M % col_tile == 0``.
        col_tile: output features per shard unit and cache tile (contract constant). row_tile: rows per
            cache tile.
        out_dtype: default ``x.dtype``.

    Returns:
        ``[N, M]`` in ``out_dtype``.

    Raises:
        ValueError: M not divisible by ``col_tile`` (naming both).
    """
    m = w.shape[0]
    if col_tile < 1 or m % col_tile != 0:
        raise ValueError(f"output features M={m} are not divisible by col_tile={col_tile}")
    return tile_linear(x, w, row_tile, col_tile).to(out_dtype or x.dtype)


def pik_column_parallel_linear(
    x: torch.Tensor,
    w_shard: torch.Tensor,
    group=None,
    col_tile: int = 16,
    row_tile: int = 16,
    gather_output: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Column-parallel ``x @ w.T`` (output features M sharded over TP ranks), bitwise equal to the
    matching columns of :func:`pik_column_linear` on the full weight for every TP whose shard
    ``M/tp`` is a multiple of ``col_tile``. No reduction; the optional gather only moves columns.

    Args:
        x: ``[N, K]`` replicated on every rank. w_shard: ``[M/tp, K]``, rank r's rows
            ``[r*M/tp, (r+1)*M/tp)`` of the weight. group: TP group (None: default, or single process).
        col_tile, row_tile, out_dtype: as in :func:`pik_column_linear`.
        gather_output: all-gather the shards into ``[N, M]`` (else return ``[N, M/tp]``).

    Raises:
        ValueError: ``M/tp`` not divisible by ``col_tile``.
    """
    tp, _ = _degree_rank(group)
    y = pik_column_linear(x, w_shard, col_tile, row_tile, out_dtype)
    return torch.cat(_all_gather(y, group, tp), dim=1) if gather_output else y


# ------------------------------------------------------------------------------ expert parallel (EP)
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def _owned(num_experts: int, ep: int, rank: int) -> range:
    if num_experts % ep != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP degree ep={ep}")
    per = num_experts // ep
    return range(rank * per, (rank + 1) * per)


def pik_expert_parallel_combine(
    x: torch.Tensor,
    top_idx: torch.Tensor,
    top_val: torch.Tensor,
    expert_fn: ExpertFn,
    num_experts: int,
    group=None,
) -> torch.Tensor:
    """Routed-expert sum of an MoE block under expert parallelism, combined in routing order.

    EP rank ``r`` owns experts ``[r*E/ep, (r+1)*E/ep)`` and computes ``expert_fn`` for the (token, slot)
    pairs routed to them. The slot outputs are all-gathered and each slot is *selected* from its
    owner rank (no arithmetic in the collective); then every token adds its slots in routing order,
    ``out = y0*v0 + y1*v1 + ...`` left to right in fp32 (:func:`~isoexec.kernels.moe.routing.routing_order_sum`). The
    result is therefore the same for every EP degree. (A GPU version would dispatch with all-to-all;
    the combine order is what matters.)

    Args:
        x: ``[N, H]`` tokens, replicated on every EP rank (boundary dtype).
        top_idx: ``[N, k]`` int64 expert ids in routing order (rank 0 first).
        top_val: ``[N, k]`` routing weights (any float dtype; used as fp32).
        expert_fn: ``(expert_id, rows [n, H]) -> [n, H]``, batch-invariant (e.g. the isoexec SwiGLU);
            called only for the rank's own experts.
        num_experts: E, divisible by the EP degree.
        group: EP process group (None: default group, or a single process).

    Returns:
        ``[N, H]`` fp32 routed sum (the caller adds the shared expert and rounds).

    Raises:
        ValueError: ``num_experts % ep != 0`` (naming both).
    """
    ep, rank = _degree_rank(group)
    own = _owned(num_experts, ep, rank)
    n, k = top_idx.shape
    y = torch.zeros((n, k, x.shape[1]), dtype=torch.float32)
    for eid in own:
        tok, slot = torch.nonzero(top_idx == eid, as_tuple=True)
        if tok.numel():
            y[tok, slot] = expert_fn(eid, x[tok]).float()
    if ep > 1:
        owner = torch.div(top_idx, num_experts // ep, rounding_mode="floor")  # [N, k]
        stacked = torch.stack(_all_gather(y, group, ep))  # [ep, N, k, H]
        idx = owner[None, :, :, None].expand(1, n, k, x.shape[1])
        y = stacked.gather(0, idx)[0]
    return routing_order_sum(y, top_val)


def native_expert_parallel_combine(
    x: torch.Tensor,
    top_idx: torch.Tensor,
    top_val: torch.Tensor,
    expert_fn: ExpertFn,
    num_experts: int,
    group=None,
) -> torch.Tensor:
    """Negative control: each EP rank sums its own experts' weighted outputs in expert order
    (``index_add_``, as HF's MoE loop), then ``dist.all_reduce`` SUM across ranks. Same arguments
    and return as :func:`pik_expert_parallel_combine`; the bits change with the EP degree."""
    ep, rank = _degree_rank(group)
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32)
    v = top_val.float()
    for eid in _owned(num_experts, ep, rank):
        tok, slot = torch.nonzero(top_idx == eid, as_tuple=True)
        if tok.numel():
            out.index_add_(0, tok, expert_fn(eid, x[tok]).float() * v[tok, slot, None])
    if ep > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
