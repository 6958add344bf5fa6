"""Batch-invariant mixture-of-experts regions on CPU (``moe.router``, ``moe.experts``,
``mlp.shared_expert``, ``moe.combine``), as in transformers' ``Qwen3NextSparseMoeBlock``: softmax
router, top-k, optional renormalisation, SwiGLU experts, sigmoid-gated shared expert.

Router, ``gate_proj`` and ``up_proj`` GEMMs are column-invariant (:func:`~isoexec.kernels.gemm.cpu.iso_linear`),
``down_proj`` is the pik leaf GEMM (:func:`iso_swiglu_partial`, the same function a tensor-parallel
trainer runs on its intermediate shard), routing is :func:`~isoexec.kernels.moe.routing.iso_route`,
expert outputs are kept per (token, routing rank) in fp32 and summed in routing order, then the gated
shared expert is added and the sum is rounded once to the boundary dtype.
"""

from __future__ import annotations

import torch

from isoexec.kernels.collectives.pik import pik_row_parallel_partial
from isoexec.kernels.gemm.cpu import iso_linear
from isoexec.kernels.moe.routing import iso_route, routing_order_sum
from isoexec.kernels.primitives import sigmoid, silu


def iso_router(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool, row_tile: int,
               col_tile: int):
    """Region ``moe.router``: ``x [N, H]`` (boundary dtype), ``router_w [E, H]``. Returns (weights
    ``[N, k]`` in ``x.dtype``, ids ``[N, k]`` int64); the logits are rounded to the boundary dtype as
    transformers' bf16 router linear does."""
    return iso_route(iso_linear(x, router_w, row_tile, col_tile), top_k, norm_topk_prob)


def iso_swiglu_partial(x, wg, wu, wd, tp: int, row_tile: int, col_tile: int, leaves: int) -> torch.Tensor:
    """One tensor-parallel rank's share of a SwiGLU MLP ``down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[N, H]`` (boundary dtype). wg, wu: ``[I/tp, H]`` the rank's rows of ``gate_proj`` /
            ``up_proj``. wd: ``[H, I/tp]`` the same slice of ``down_proj``'s input features.
        tp: the degree the intermediate dim is split into (1: the whole MLP).
        row_tile, col_tile, leaves: GEMM constants (:mod:`isoexec.kernels.gemm.cpu`).

    Returns:
        ``[N, H]`` fp32: the rank's pik subtree sum of ``down_proj`` (the product ``silu(g) * u`` is
        rounded to the boundary dtype first, as transformers). Combining the ``tp`` ranks' subtrees
        with :func:`~isoexec.kernels.collectives.pik.pik_tree_combine` in rank order gives the bits
        of ``tp=1``.
    """
    # gate and up as two GEMMs over the weights themselves (iso_linear keeps each one's converted copy and packed panels
    # between engine steps; a concatenated copy would be converted and packed again on every call)
    g, u = iso_linear(x, wg, row_tile, col_tile), iso_linear(x, wu, row_tile, col_tile)
    h = (silu(g.float()) * u.float()).to(x.dtype)
    return pik_row_parallel_partial(h, wd, tp, leaves, row_tile)


def iso_swiglu(x, wg, wu, wd, row_tile: int, col_tile: int, leaves: int) -> torch.Tensor:
    """SwiGLU MLP with column-invariant ``gate``/``up`` and the pik ``down`` (:func:`iso_swiglu_partial` at
    ``tp=1``). Returns ``[N, H]`` in ``x.dtype``."""
    return iso_swiglu_partial(x, wg, wu, wd, 1, row_tile, col_tile, leaves).to(x.dtype)


def iso_experts(x: torch.Tensor, ids: torch.Tensor, experts, row_tile: int, col_tile: int, leaves: int) -> torch.Tensor:
    """Region ``moe.experts``: each routed (token, rank) through its expert's SwiGLU, row by row.

    Args:
        x: ``[N, H]``. ids: ``[N, k]`` int64 expert ids. experts: per expert (gate ``[I, H]``,
            up ``[I, H]``, down ``[H, I]``).

    Returns:
        ``[N, k, H]`` fp32 expert outputs per (token, rank), each rounded to ``x.dtype`` (as
        :func:`iso_swiglu` returns it).
    """
    part = routed_swiglu_partial(x, ids, dict(enumerate(experts)), 1, row_tile, col_tile, leaves)
    return part.to(x.dtype).float()


def routed_swiglu_partial(x: torch.Tensor, ids: torch.Tensor, experts: dict, tp: int, row_tile: int, col_tile: int,
                          leaves: int) -> torch.Tensor:
    """:func:`iso_swiglu_partial` of every (token, rank) pair routed to one of ``experts``, all experts at once.

    The pairs are gathered expert-major (one gather); each expert's ``gate``/``up``/``down`` GEMMs run on
    its contiguous rows, the SiLU product on all rows in one pass (row-wise GEMMs and elementwise ops: the
    bits of one :func:`iso_swiglu_partial` call per expert).

    Args:
        x: ``[N, H]`` (boundary dtype). ids: ``[N, k]`` int64 expert ids. experts: expert id -> (gate
            ``[I/tp, H]``, up ``[I/tp, H]``, down ``[H, I/tp]``), this rank's shards; pairs routed to other
            experts stay 0. tp, row_tile, col_tile, leaves: as :func:`iso_swiglu_partial`.

    Returns:
        ``[N, k, H]`` fp32 pik subtree sums per (token, rank).
    """
    out = x.new_zeros((x.shape[0], ids.shape[1], x.shape[1]), dtype=torch.float32)
    routed = routed_by_expert(ids, set(experts))
    if not routed:
        return out
    eids = list(routed)
    tok, rank = (torch.cat([routed[e][i] for e in eids]) for i in (0, 1))
    sizes = [routed[e][0].numel() for e in eids]
    xs = x[tok].split(sizes)
    g = torch.cat([iso_linear(xe, experts[e][0], row_tile, col_tile) for xe, e in zip(xs, eids)])
    u = torch.cat([iso_linear(xe, experts[e][1], row_tile, col_tile) for xe, e in zip(xs, eids)])
    h = (silu(g.float()) * u.float()).to(x.dtype)
    sub = torch.cat([pik_row_parallel_partial(he, experts[e][2], tp, leaves, row_tile)
                     for he, e in zip(h.split(sizes), eids)])
    return out.index_put((tok, rank), sub)


def routed_by_expert(ids: torch.Tensor, experts=None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The (token, routing rank) pairs routed to each expert, tokens ascending (one sort for all experts).

    Args:
        ids: ``[N, k]`` int64 expert ids. experts: the expert ids to return (a set; default all).

    Returns:
        expert id -> (tokens ``[n_e]``, ranks ``[n_e]``) for each expert with at least one pair, in the
        order ``torch.nonzero(ids == e)`` gives them.
    """
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # expert-major; within an expert, (token, rank) ascending
    counts = torch.bincount(flat).tolist()
    k = ids.shape[1]
    out, start = {}, 0
    for e, n in enumerate(counts):
        if n and (experts is None or e in experts):
            sel = order[start : start + n]
            out[e] = (sel // k, sel % k)
        start += n
    return out


def iso_shared_expert(x: torch.Tensor, shared, gate_w: torch.Tensor, row_tile: int, col_tile: int,
                      leaves: int) -> torch.Tensor:
    """Region ``mlp.shared_expert``: ``sigmoid(x @ gate_w.T) * swiglu(x)`` in fp32, ``[N, H]``."""
    s = iso_swiglu(x, *shared, row_tile, col_tile, leaves).float()
    return shared_expert_gate(x, gate_w, row_tile, col_tile) * s


def shared_expert_gate(x: torch.Tensor, gate_w: torch.Tensor, row_tile: int, col_tile: int) -> torch.Tensor:
    """The shared expert's gate ``sigmoid(x @ gate_w.T)``, ``[N, 1]`` fp32 (``gate_w [1, H]``)."""
    return sigmoid(iso_linear(x, gate_w, row_tile, col_tile).float())


def iso_combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """Region ``moe.combine``: routing-order fp32 sum plus the gated shared expert, one rounding to ``dtype``."""
    return (routing_order_sum(y, weights) + shared).to(dtype)
