"""Batch-invariant mixture-of-experts regions on CPU (``moe.router``, ``moe.experts``,
``mlp.shared_expert``, ``moe.combine``), as in transformers' ``Qwen3NextSparseMoeBlock``: softmax
router, top-k, optional renormalisation, SwiGLU experts, sigmoid-gated shared expert.

Router and expert GEMMs are batch-invariant (:func:`~isoexec.kernels.gemm.cpu.iso_linear`), routing
is :func:`~isoexec.kernels.moe.routing.iso_route`, expert outputs are kept per (token, routing
rank) in fp32 and summed in routing order, then the gated shared expert is added and the sum is
rounded once to the boundary dtype.
"""

from __future__ import annotations

import torch

from isoexec.kernels.gemm.cpu import iso_linear
from isoexec.kernels.moe.routing import iso_route, routing_order_sum
from isoexec.kernels.primitives import sigmoid, silu


def iso_router(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool, row_tile: int):
    """Region ``moe.router``: ``x [N, H]`` (boundary dtype), ``router_w [E, H]``. Returns (weights
    ``[N, k]`` in ``x.dtype``, ids ``[N, k]`` int64); the logits are rounded to the boundary dtype as
    transformers' bf16 router linear does."""
    return iso_route(iso_linear(x, router_w, row_tile), top_k, norm_topk_prob)


def iso_swiglu(x, wg, wu, wd, row_tile: int) -> torch.Tensor:
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with batch-invariant GEMMs; the product is rounded
    to the boundary dtype before ``down`` (as transformers). Returns ``[N, H]`` in ``x.dtype``."""
    g = iso_linear(x, wg, row_tile)
    u = iso_linear(x, wu, row_tile)
    h = (silu(g.float()) * u.float()).to(x.dtype)
    return iso_linear(h, wd, row_tile)


def iso_experts(x: torch.Tensor, ids: torch.Tensor, experts, row_tile: int) -> torch.Tensor:
    """Region ``moe.experts``: each routed (token, rank) through its expert's SwiGLU, row by row.

    Args:
        x: ``[N, H]``. ids: ``[N, k]`` int64 expert ids. experts: per expert (gate ``[I, H]``,
            up ``[I, H]``, down ``[H, I]``).

    Returns:
        ``[N, k, H]`` fp32 expert outputs per (token, routing rank).
    """
    y = x.new_zeros((x.shape[0], ids.shape[1], x.shape[1]), dtype=torch.float32)
    for eid, (wg, wu, wd) in enumerate(experts):
        tok, rank = torch.nonzero(ids == eid, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = y.index_put((tok, rank), iso_swiglu(x[tok], wg, wu, wd, row_tile).float())
    return y


def iso_shared_expert(x: torch.Tensor, shared, gate_w: torch.Tensor, row_tile: int) -> torch.Tensor:
    """Region ``mlp.shared_expert``: ``sigmoid(x @ gate_w.T) * swiglu(x)`` in fp32, ``[N, H]``."""
    s = iso_swiglu(x, *shared, row_tile).float()
    return sigmoid(iso_linear(x, gate_w, row_tile).float()) * s


def iso_combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """Region ``moe.combine``: routing-order fp32 sum plus the gated shared expert, one rounding to ``dtype``."""
    return (routing_order_sum(y, weights) + shared).to(dtype)
