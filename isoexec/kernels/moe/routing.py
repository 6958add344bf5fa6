"""Routing shared by every isoexec MoE implementation (CPU, Triton, expert-parallel pik): the
deterministic top-k router and the routing-order combine.

Semantics of transformers' ``Qwen3NextSparseMoeBlock`` (softmax router in fp32, top-k, optional
renormalisation); IsoExec rules (docs/design.md, The kernels, MoE): top-k by a stable descending sort, so ties go to
the lower expert id; each token sums its top-k expert outputs in routing order (rank 0 first) in
fp32, whichever device or rank computed each expert.
"""

from __future__ import annotations

import torch

from isoexec.kernels.primitives import tree_sum


def iso_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic router (region ``moe.router`` after its GEMM), row by row.

    Softmax in fp32 (``exp`` and a fixed tree sum), top-k by a stable descending sort (ties go to
    the lower expert id), optional renormalisation by a tree sum.

    Args:
        logits: ``[N, E]`` router logits (any float dtype; the weights come back in this dtype).
        top_k: experts per token (<= E). norm_topk_prob: renormalise the k weights to sum to 1.

    Returns:
        (weights ``[N, top_k]`` in ``logits.dtype``, expert ids ``[N, top_k]`` int64), rank 0 first.
    """
    lf = logits.float()
    e = torch.exp(lf - lf.amax(dim=-1, keepdim=True))
    probs = e / tree_sum(e, dim=-1, keepdim=True)
    top_val, top_idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    top_val, top_idx = top_val[:, :top_k], top_idx[:, :top_k]
    if norm_topk_prob:
        top_val = top_val / tree_sum(top_val, dim=-1, keepdim=True)
    return top_val.to(logits.dtype), top_idx


def routing_order_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's expert outputs in routing order, left to right in fp32:
    ``y[:, 0] * w[:, 0] + y[:, 1] * w[:, 1] + ...`` (region ``moe.combine``).

    Args:
        y: ``[N, k, H]`` expert outputs per (token, routing rank), any float dtype.
        weights: ``[N, k]`` routing weights (any float dtype; used as fp32).

    Returns:
        ``[N, H]`` fp32. Each element's additions depend only on ``k``, never on which rank or
        device computed an expert.
    """
    v = weights.float()
    out = y[:, 0].float() * v[:, 0:1]
    for r in range(1, y.shape[1]):
        out = out + y[:, r].float() * v[:, r : r + 1]
    return out
