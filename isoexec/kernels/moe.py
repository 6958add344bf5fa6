"""Mixture-of-experts block (regions ``moe.router``, ``moe.experts``, ``moe.combine``,
``mlp.shared_expert``) as in transformers' ``Qwen3NextSparseMoeBlock``: softmax router in fp32,
top-k, optional renormalisation, SwiGLU experts, sigmoid-gated shared expert.

isoexec: router and expert GEMMs are batch-invariant (:func:`iso_linear`), top-k is a stable
descending sort (ties go to the lower expert id), and each token's output is summed in routing order
(rank 0 first) in fp32, then the gated shared expert is added, then one rounding to the boundary
dtype. native: HF's code path (``torch.topk``, ``index_add_`` in expert order, bf16 sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isoexec.kernels.dense import iso_linear, native_linear
from isoexec.kernels.primitives import sigmoid, silu, tree_sum


def iso_moe(
    x: torch.Tensor,
    router_w: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    shared_gate_w: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    row_tile: int,
) -> torch.Tensor:
    """Batch-invariant MoE block.

    Args:
        x: ``[N, H]`` (boundary dtype). router_w: ``[E, H]``.
        experts: per expert (gate_proj ``[I, H]``, up_proj ``[I, H]``, down_proj ``[H, I]``).
        shared: the shared expert's (gate, up, down). shared_gate_w: ``[1, H]``.

    Returns:
        ``[N, H]`` in ``x.dtype``.
    """
    dtype = x.dtype
    logits = iso_linear(x, router_w, row_tile)  # [N, E] boundary dtype, as HF's bf16 router linear
    top_val, top_idx = iso_route(logits, top_k, norm_topk_prob)
    # Expert outputs per (token, rank), each row computed independently of the others.
    y = x.new_zeros((x.shape[0], top_k, x.shape[1]), dtype=torch.float32)
    for eid, (wg, wu, wd) in enumerate(experts):
        tok, rank = torch.nonzero(top_idx == eid, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = _iso_swiglu(x[tok], wg, wu, wd, row_tile)
        y = y.index_put((tok, rank), h.float())
    out = y[:, 0] * top_val[:, 0:1].float()
    for r in range(1, top_k):
        out = out + y[:, r] * top_val[:, r : r + 1].float()
    s = _iso_swiglu(x, *shared, row_tile).float()
    gate = sigmoid(iso_linear(x, shared_gate_w, row_tile).float())
    return (out + gate * s).to(dtype)


def iso_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic router (region ``moe.router`` after its GEMM), row by row.

    Softmax in fp32 (``exp`` and a fixed tree sum), top-k by a stable descending sort (ties go to
    the lower expert id), optional renormalisation by a tree sum.

    Args:
        logits: ``[N, E]`` router logits (any float dtype; the weights come back in this dtype).

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


def _iso_swiglu(x, wg, wu, wd, row_tile):
    g = iso_linear(x, wg, row_tile)
    u = iso_linear(x, wu, row_tile)
    h = (silu(g.float()) * u.float()).to(x.dtype)
    return iso_linear(h, wd, row_tile)


def native_moe(x, router_w, experts, shared, shared_gate_w, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """HF ``Qwen3NextSparseMoeBlock`` math with stock torch ops (same arguments as :func:`iso_moe`)."""
    logits = native_linear(x, router_w)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top_val, top_idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_val = top_val / top_val.sum(dim=-1, keepdim=True)
    top_val = top_val.to(logits.dtype)
    out = torch.zeros_like(x)
    for eid, (wg, wu, wd) in enumerate(experts):
        tok, rank = torch.where(top_idx == eid)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = native_linear(F.silu(native_linear(xe, wg)) * native_linear(xe, wu), wd)
        out = out.index_add(0, tok, (h * top_val[tok, rank, None]).to(out.dtype))
    wg, wu, wd = shared
    s = native_linear(F.silu(native_linear(x, wg)) * native_linear(x, wu), wd)
    return out + torch.sigmoid(native_linear(x, shared_gate_w)) * s
