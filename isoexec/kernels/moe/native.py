"""Native mixture-of-experts regions: transformers' ``Qwen3NextSparseMoeBlock`` code path with stock
torch ops (``torch.topk``, bf16 expert GEMMs, ``index_add`` in expert order in the boundary dtype).
The negative control."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isoexec.kernels.gemm.native import native_linear


def native_router(x, router_w, top_k: int, norm_topk_prob: bool):
    """Region ``moe.router``: softmax in fp32, ``torch.topk``, optional renormalisation; weights in
    the logits dtype, ids ``[N, k]``."""
    logits = native_linear(x, router_w)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top_val, top_idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_val = top_val / top_val.sum(dim=-1, keepdim=True)
    return top_val.to(logits.dtype), top_idx


def _swiglu(x, wg, wu, wd):
    return native_linear(F.silu(native_linear(x, wg)) * native_linear(x, wu), wd)


def native_experts(x, ids, experts) -> torch.Tensor:
    """Region ``moe.experts``: ``[N, k, H]`` expert outputs in ``x.dtype`` (stock GEMMs per expert)."""
    y = x.new_zeros((x.shape[0], ids.shape[1], x.shape[1]))
    for eid, (wg, wu, wd) in enumerate(experts):
        tok, rank = torch.where(ids == eid)
        if tok.numel():
            y = y.index_put((tok, rank), _swiglu(x[tok], wg, wu, wd))
    return y


_STACKS: dict = {}


def _stack(experts, which: int, dtype) -> torch.Tensor:
    """``[E, ...]`` stack of one expert weight (transformers keeps the experts fused; the per-expert parameters here
    are its on-disk layout): under autograd a fresh stack (the gradient flows to the parameters); without, the stack
    the weights are rows of (:class:`~isoexec.model.layers.ExpertWeights`), else a copy cached while the weights are
    unchanged."""
    ws = [e[which] for e in experts]
    if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
        return torch.stack(ws).to(dtype)
    stacks = getattr(experts, "stacks", None)  # the unified model's experts are rows of their stacks
    if stacks is not None:
        return stacks[which].to(dtype)
    key = (which, tuple((w.data_ptr(), w._version) for w in ws))
    hit = _STACKS.get(which)
    if hit is None or hit[0] != key:
        hit = (key, torch.stack(ws).to(dtype))
        _STACKS[which] = hit
    return hit[1]


def native_experts_grouped(x, ids, experts) -> torch.Tensor:
    """Region ``moe.experts`` on CUDA as transformers 5 runs it (``use_grouped_mm``): the routed rows
    sorted by expert and three cuBLAS grouped GEMMs (``torch._grouped_mm``, one launch each over all
    experts), ``[N, k, H]`` in ``x.dtype``. Falls back to :func:`native_experts` where ``_grouped_mm``
    does not exist (CPU builds)."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda:
        return native_experts(x, ids, experts)
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    offs = torch.bincount(flat, minlength=len(experts)).cumsum(0).to(torch.int32)
    xs = x[order // k]
    wg, wu, wd = (_stack(experts, i, x.dtype) for i in range(3))  # [E, I, H], [E, I, H], [E, H, I]
    g = torch._grouped_mm(xs, wg.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(xs, wu.transpose(-2, -1), offs=offs)
    h = torch._grouped_mm(F.silu(g) * u, wd.transpose(-2, -1), offs=offs)
    y = torch.empty((n * k, x.shape[1]), device=x.device, dtype=x.dtype)
    y = y.index_copy(0, order, h)
    return y.view(n, k, x.shape[1])


def native_shared_expert(x, shared, gate_w) -> torch.Tensor:
    """Region ``mlp.shared_expert``: ``sigmoid(x @ gate_w.T) * swiglu(x)`` in ``x.dtype``."""
    return torch.sigmoid(native_linear(x, gate_w)) * _swiglu(x, *shared)


def native_combine(y, weights, ids, shared, dtype) -> torch.Tensor:
    """Region ``moe.combine``: ``index_add`` of the weighted expert outputs in ascending expert order
    in ``dtype`` (as transformers), then the shared expert."""
    out = torch.zeros((y.shape[0], y.shape[2]), dtype=dtype, device=y.device)
    for eid in torch.unique(ids).tolist():
        tok, rank = torch.where(ids == eid)
        out = out.index_add(0, tok, (y[tok, rank] * weights[tok, rank, None]).to(dtype))
    return out + shared
