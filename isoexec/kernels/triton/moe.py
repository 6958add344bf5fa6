"""Mixture-of-experts block on CUDA (regions ``moe.router``, ``moe.experts``, ``moe.combine``,
``mlp.shared_expert``), semantics of :func:`isoexec.kernels.moe.iso_moe`.

Triton: router, expert and shared-expert GEMMs (:mod:`.gemm`; experts as one grouped launch over
token rows sorted by expert). torch elementwise (position-invariant on CUDA): router softmax with
``exp`` and a fixed binary tree of adds, stable descending sort (ties to the lower expert id),
SwiGLU, the routing-order fp32 combine ``sum_r y_r * w_r`` (rank 0 first) and the sigmoid-gated
shared expert.
"""

from __future__ import annotations

import torch

from isoexec.kernels.moe import iso_route
from isoexec.kernels.primitives import sigmoid, silu
from isoexec.kernels.triton.gemm import grouped_linear, linear

_STACK_CACHE: dict = {}


def _stacked(experts, which: int) -> torch.Tensor:
    """``[E, N, K]`` stack of expert weights, cached while the weights are unchanged (same storage and version)."""
    ws = [e[which] for e in experts]
    key = (which, tuple((w.data_ptr(), w._version) for w in ws))
    hit = _STACK_CACHE.get(which)
    if hit is None or hit[0] != key:
        hit = (key, torch.stack([w.detach() for w in ws]))
        _STACK_CACHE[which] = hit
    return hit[1]


def _swiglu_dense(x, wg, wu, wd):
    h = (silu(linear(x, wg).float()) * linear(x, wu).float()).to(x.dtype)
    return linear(h, wd)


def moe(x, router_w, experts, shared, shared_gate_w, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """Batch-invariant MoE block. x ``[N, H]``; router_w ``[E, H]``; experts per expert (gate, up, down);
    shared (gate, up, down); shared_gate_w ``[1, H]``. Returns ``[N, H]`` in ``x.dtype``."""
    dtype = x.dtype
    n, hdim = x.shape
    E = len(experts)
    top_val, top_idx = iso_route(linear(x, router_w).float(), top_k, norm_topk_prob)
    top_val = top_val.to(dtype)
    flat = top_idx.reshape(-1)  # (token, rank) pairs in token-major order
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E).tolist()
    xs = x[order // top_k]
    wg, wu, wd = _stacked(experts, 0), _stacked(experts, 1), _stacked(experts, 2)
    gt = grouped_linear(xs, wg, counts)
    up = grouped_linear(xs, wu, counts)
    h = (silu(gt.float()) * up.float()).to(dtype)
    ye = grouped_linear(h, wd, counts)
    y = torch.empty((n * top_k, hdim), device=x.device, dtype=torch.float32)
    y[order] = ye.float()
    y = y.view(n, top_k, hdim)
    tv = top_val.float()
    out = y[:, 0] * tv[:, 0:1]
    for r in range(1, top_k):
        out = out + y[:, r] * tv[:, r : r + 1]
    s = _swiglu_dense(x, *shared).float()
    gate = sigmoid(linear(x, shared_gate_w).float())
    return (out + gate * s).to(dtype)


def moe_reference(x, router_w, experts, shared, shared_gate_w, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """Differentiable torch reference of :func:`moe` (cuBLAS GEMMs; used for the backward only)."""
    import torch.nn.functional as F

    dtype = x.dtype
    lin = lambda a, w: F.linear(a, w.to(a.dtype))  # noqa: E731
    probs = torch.softmax(lin(x, router_w).float(), dim=-1)
    top_val, top_idx = torch.sort(probs.detach(), dim=-1, descending=True, stable=True)
    top_idx = top_idx[:, :top_k]
    top_val = probs.gather(1, top_idx)
    if norm_topk_prob:
        top_val = top_val / top_val.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for eid, (wg, wu, wd) in enumerate(experts):
        tok, rank = torch.where(top_idx == eid)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = lin((torch.nn.functional.silu(lin(xe, wg).float()) * lin(xe, wu).float()).to(dtype), wd)
        out = out.index_add(0, tok, h.float() * top_val[tok, rank, None])
    g, u, d = shared
    s = lin((torch.nn.functional.silu(lin(x, g).float()) * lin(x, u).float()).to(dtype), d).float()
    return (out + torch.sigmoid(lin(x, shared_gate_w).float()) * s).to(dtype)
