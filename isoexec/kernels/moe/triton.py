"""Mixture-of-experts regions on CUDA (``moe.router``, ``moe.experts``, ``mlp.shared_expert``,
``moe.combine``), the semantics of :mod:`isoexec.kernels.moe.cpu` with GPU bits of their own.

Triton: router, expert and shared-expert GEMMs (:mod:`isoexec.kernels.gemm.triton`; the experts as
one grouped launch over token rows sorted by expert; the ``down_proj`` GEMMs, row-parallel under TP,
as leaf GEMMs so that a TP-sharded trainer reproduces their bits). torch elementwise (position-invariant on
CUDA): the router softmax of :func:`~isoexec.kernels.moe.routing.iso_route`, SwiGLU, the
routing-order fp32 combine and the sigmoid gate of the shared expert.
"""

from __future__ import annotations

import weakref

import torch

from isoexec.kernels.autograd import with_ref_grad
from isoexec.kernels.gemm.triton import (
    grouped_linear,
    grouped_linear_leaves,
    linear_autograd,
    linear_leaves_autograd,
    linear_leaves_partial,
)
from isoexec.kernels.moe.routing import iso_route
from isoexec.kernels.primitives import sigmoid, silu

_STACK_CACHE: dict[int, tuple] = {}
"""One entry per layer: ``id`` of its first expert weight -> (weak reference to it, the storage address and the
version of every expert weight in order, the three ``[E, N, K]`` stacks)."""


def expert_stacks(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``[E, N, K]`` stacks of one layer's expert weights (gate, up, down).

    The unified model's experts are rows of their stacks (:class:`~isoexec.model.layers.ExpertWeights`): those
    stacks, no copy. Any other list of weights (a test's, a trainer's own modules) gets copies, cached per layer
    while every weight is the same tensor (storage address); an in-place update of any of them (its version counter
    moves) restacks into the same stack tensors; a weight at another address gives new stacks. An entry goes when its
    model does. A write through ``.data`` bypasses the version counter and is not seen (no isoexec path writes so).
    The key is two flat lists over the layer's 3E tensors: at 256 experts the check took 0.45 ms a call on the H200
    host of ``results/h200-vllm/08dd807`` (cProfile), O(E) every call."""
    stacks = getattr(experts, "stacks", None)
    if stacks is not None:
        return stacks
    flat = [w for e in experts for w in e]
    ptrs, versions = list(map(torch.Tensor.data_ptr, flat)), [w._version for w in flat]
    hit = _STACK_CACHE.get(id(flat[0]))
    if hit is not None and hit[0]() is flat[0] and hit[1] == ptrs:
        if hit[2] != versions:  # new values in the same tensors: restack in place
            for i, s in enumerate(hit[3]):
                with torch.inference_mode(s.is_inference()):
                    torch.stack([w.detach() for w in flat[i::3]], out=s)
            hit = (hit[0], ptrs, versions, hit[3])
            _STACK_CACHE[id(flat[0])] = hit
        return hit[3]
    for k in [k for k, v in _STACK_CACHE.items() if v[0]() is None]:
        del _STACK_CACHE[k]
    stacks = tuple(torch.stack([w.detach() for w in flat[i::3]]) for i in range(3))
    _STACK_CACHE[id(flat[0])] = (weakref.ref(flat[0]), ptrs, versions, stacks)
    return stacks


def router(x, router_w, top_k: int, norm_topk_prob: bool, cfg):
    """Region ``moe.router``: Triton GEMM (logits rounded to ``x.dtype``), then :func:`iso_route`.
    Returns (weights ``[N, k]`` in ``x.dtype``, ids ``[N, k]`` int64)."""
    top_val, top_idx = iso_route(linear_autograd(x, router_w, cfg).float(), top_k, norm_topk_prob)
    return top_val.to(x.dtype), top_idx


def experts(x, ids, expert_weights, cfg, leaves: int) -> torch.Tensor:
    """Region ``moe.experts``: grouped SwiGLU over (token, rank) rows sorted by expert (stable), one
    launch per GEMM, ``down_proj`` as ``leaves`` leaf GEMMs. Returns ``[N, k, H]`` fp32; its gradient
    is :func:`experts_reference`'s."""
    if not torch.is_grad_enabled():  # engine steps, trainer_score: no autograd wrapper over 3E tensors
        return _experts(x, ids, expert_weights, cfg, leaves)
    flat_w = [w for e in expert_weights for w in e]
    ne = len(expert_weights)

    def unflat(f):
        return [tuple(f[3 * i : 3 * i + 3]) for i in range(ne)]

    # the forward reads the stacks the weights are rows of (the same values), else copies of the inputs
    stacked = getattr(expert_weights, "stacks", None) is not None
    return with_ref_grad(lambda xx, *f: _experts(xx, ids, expert_weights if stacked else unflat(f), cfg, leaves),
                         lambda xx, *f: experts_reference(xx, ids, unflat(f)), x, *flat_w)


def _expert_counts(sorted_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert, ``[n_experts]`` int32 on the ids' device, of ascending expert ids ``sorted_ids`` ``[R]``
    (integer, R < 2**31): the differences of the experts' first positions, found by a search. No host sync
    (CUDA-graph capturable), unlike ``torch.bincount``, which on CUDA reads the ids' min and max on the host;
    int32, the grouped GEMMs' tile-table dtype (no cast there)."""
    experts = torch.arange(n_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts, out_int32=True).diff()


def _experts(x, ids, expert_weights, cfg, leaves: int) -> torch.Tensor:
    n, hdim = x.shape
    top_k = ids.shape[1]
    flat = ids.reshape(-1)  # (token, rank) pairs in token-major order
    srt = torch.sort(flat, stable=True)
    order = srt.indices
    counts = _expert_counts(srt.values, len(expert_weights))
    xs = x[order // top_k]
    wg, wu, wd = expert_stacks(expert_weights)
    h = (silu(grouped_linear(xs, wg, counts, cfg).float()) * grouped_linear(xs, wu, counts, cfg).float()).to(x.dtype)
    y = torch.empty((n * top_k, hdim), device=x.device, dtype=torch.float32)
    y[order] = grouped_linear_leaves(h, wd, counts, cfg, leaves).float()
    return y.view(n, top_k, hdim)


def shared_expert(x, shared, gate_w, cfg, leaves: int) -> torch.Tensor:
    """Region ``mlp.shared_expert``: ``sigmoid(x @ gate_w.T) * swiglu(x)`` in fp32, ``[N, H]``; ``down_proj``
    as ``leaves`` leaf GEMMs."""
    wg, wu, wd = shared
    h = (silu(linear_autograd(x, wg, cfg).float()) * linear_autograd(x, wu, cfg).float()).to(x.dtype)
    return sigmoid(linear_autograd(x, gate_w, cfg).float()) * linear_leaves_autograd(h, wd, cfg, leaves).float()


def swiglu_partial(x, wg, wu, wd, cfg, leaves_local: int) -> torch.Tensor:
    """One tensor-parallel rank's share of the shared expert's SwiGLU ``down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[N, H]`` (boundary dtype, CUDA). wg, wu: ``[I/tp, H]`` the rank's rows of ``gate_proj`` /
            ``up_proj``. wd: ``[H, I/tp]`` the same slice of ``down_proj``'s input features.
        cfg: ``isoexec.config.TritonSection``. leaves_local: G/tp, the ``down_proj`` leaves of this rank.

    Returns:
        ``[N, H]`` fp32: the rank's pik subtree sum of ``down_proj`` (``silu(g) * u`` rounded to the boundary
        dtype first, as :func:`shared_expert`); the ``tp`` ranks' sums added by the fixed tree and rounded
        give :func:`shared_expert`'s ``down_proj`` bits. Gradient: ``F.linear``'s.
    """
    import torch.nn.functional as F

    h = (silu(linear_autograd(x, wg, cfg).float()) * linear_autograd(x, wu, cfg).float()).to(x.dtype)
    return with_ref_grad(lambda a, b: linear_leaves_partial(a, b, cfg, leaves_local),
                         lambda a, b: F.linear(a, b.to(a.dtype)).float(), h, wd)


def shared_expert_gate(x, gate_w, cfg) -> torch.Tensor:
    """The shared expert's gate ``sigmoid(x @ gate_w.T)``, ``[N, 1]`` fp32 (``gate_w [1, H]``), as :func:`shared_expert`."""
    return sigmoid(linear_autograd(x, gate_w, cfg).float())


def experts_partial(x, ids, local_ids: list[int], expert_weights, cfg, leaves_local: int) -> torch.Tensor:
    """Region ``moe.experts`` on one expert-parallel / expert-TP rank: its experts' shards only.

    Args:
        x: ``[N, H]`` (boundary dtype, CUDA). ids: ``[N, k]`` int64 global expert ids.
        local_ids: the global ids of this rank's experts. expert_weights: per local expert, the rank's
            shards (gate ``[I/etp, H]``, up ``[I/etp, H]``, down ``[H, I/etp]``).
        cfg: ``isoexec.config.TritonSection``. leaves_local: G/etp, the ``down_proj`` leaves of this rank.

    Returns:
        ``[N, k, H]`` fp32: for each (token, slot) routed to a local expert, the rank's pik subtree sum of
        that expert's ``down_proj`` (the same grouped launches as :func:`experts`, restricted to the
        local experts); zeros elsewhere. With ``etp = 1`` each routed slot rounded to ``x.dtype`` is
        :func:`experts`'s bits. Gradient: a per-expert cuBLAS reference's.
    """
    flat_w = [w for e in expert_weights for w in e]
    ne = len(expert_weights)

    def unflat(f):
        return [tuple(f[3 * i : 3 * i + 3]) for i in range(ne)]

    return with_ref_grad(lambda xx, *f: _experts_partial(xx, ids, local_ids, unflat(f), cfg, leaves_local),
                         lambda xx, *f: _experts_partial_reference(xx, ids, local_ids, unflat(f)), x, *flat_w)


def _experts_partial(x, ids, local_ids, expert_weights, cfg, leaves_local: int) -> torch.Tensor:
    n, hdim = x.shape
    top_k = ids.shape[1]
    y = torch.zeros((n * top_k, hdim), device=x.device, dtype=torch.float32)
    if not expert_weights or not ids.numel():
        return y.view(n, top_k, hdim)
    local = torch.full((max(max(local_ids), int(ids.max())) + 1,), -1, dtype=torch.long, device=ids.device)
    local[torch.tensor(local_ids, device=ids.device)] = torch.arange(len(local_ids), device=ids.device)
    slot = local[ids.reshape(-1)]  # local expert of each (token, rank) pair, -1 elsewhere
    mine = torch.nonzero(slot >= 0).squeeze(1)
    srt = torch.sort(slot[mine], stable=True)
    order = mine[srt.indices]
    counts = _expert_counts(srt.values, len(expert_weights))
    xs = x[order // top_k]
    wg, wu, wd = (torch.stack([e[i].detach() for e in expert_weights]) for i in range(3))
    h = (silu(grouped_linear(xs, wg, counts, cfg).float()) * grouped_linear(xs, wu, counts, cfg).float()).to(x.dtype)
    y[order] = linear_leaves_partial(h, wd, cfg, leaves_local, counts=counts)
    return y.view(n, top_k, hdim)


def _experts_partial_reference(x, ids, local_ids, expert_weights) -> torch.Tensor:
    import torch.nn.functional as F

    lin = lambda a, w: F.linear(a, w.to(a.dtype))  # noqa: E731
    y = torch.zeros((x.shape[0], ids.shape[1], x.shape[1]), device=x.device, dtype=torch.float32)
    for eid, (wg, wu, wd) in zip(local_ids, expert_weights):
        tok, rank = torch.where(ids == eid)
        if tok.numel():
            h = (F.silu(lin(x[tok], wg).float()) * lin(x[tok], wu).float()).to(x.dtype)
            y = y.index_put((tok, rank), lin(h, wd).float())
    return y


def experts_reference(x, ids, expert_weights) -> torch.Tensor:
    """Differentiable torch reference of :func:`experts` (cuBLAS GEMMs; for the backward only): the
    grouped GEMMs of :func:`isoexec.kernels.moe.native.native_experts_grouped` where they exist."""
    import torch.nn.functional as F

    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        from isoexec.kernels.moe.native import native_experts_grouped

        return native_experts_grouped(x, ids, expert_weights).float()

    lin = lambda a, w: F.linear(a, w.to(a.dtype))  # noqa: E731
    y = torch.zeros((x.shape[0], ids.shape[1], x.shape[1]), device=x.device, dtype=torch.float32)
    for eid, (wg, wu, wd) in enumerate(expert_weights):
        tok, rank = torch.where(ids == eid)
        if tok.numel():
            h = (F.silu(lin(x[tok], wg).float()) * lin(x[tok], wu).float()).to(x.dtype)
            y = y.index_put((tok, rank), lin(h, wd).float())
    return y
