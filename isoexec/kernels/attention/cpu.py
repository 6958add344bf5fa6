"""Batch- and mode-invariant causal GQA attention on CPU (region ``attn.core``).

One call serves every case: sequence b contributes ``n_b`` queries at absolute positions
``start_b .. start_b + n_b - 1`` and attends to its keys ``0 .. start_b + n_b - 1`` (the cache plus
the new keys). ``trainer_fwd`` / ``engine_prefill`` have ``start_b = 0``; chunked prefill and
``engine_decode`` have ``start_b`` = tokens already cached.

isoexec (batch- and mode-invariant by construction): the C kernel ``attention.c`` computes each query
row on its own: keys are visited in fixed blocks of ``kv_block`` absolute positions, always from block
0 upwards up to the row's position, with one online-softmax update order (fp32; fixed ``fmaf`` chains
for the scores and the value sums). A row's bits depend only on its query, its position and its
sequence's keys, so the same query gets the same bits in prefill, chunked prefill and decode, alone or
in any batch. The gradient is the kernel's recomputation backward (``attention.c``, fp32, not
bitwise). Online softmax: Milakov & Gimelshein (2018); Dao et al., FlashAttention (2022).

The output gate of gated attention (region ``attn.gate``) is here too: ``x * sigmoid(gate)`` in fp32
with the position-invariant sigmoid.
"""

from __future__ import annotations

import ctypes
import math

import torch

from isoexec.kernels.native_build import c_ptr, kernel_library
from isoexec.kernels.primitives import sigmoid


def iso_attention(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    starts: list[int],
    lengths: list[int],
    kv_block: int,
) -> torch.Tensor:
    """Causal GQA attention with a fixed KV block size and one online-softmax order, per query row.

    Args:
        q: ``[N, Hq, D]`` queries (after norm and RoPE) of all sequences, concatenated in order.
        kv: per sequence ``(K, V)``, each ``[start_b + n_b, Hkv, D]`` (cache + new keys), bf16 or fp32
            (one dtype for all), any row stride.
        starts: per sequence, absolute position of its first query.
        lengths: per sequence, number of queries ``n_b`` (sum = N).
        kv_block: keys per block (absolute positions).

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``; scale ``1/sqrt(D)``. Differentiable (q, K and V).

    Raises:
        ValueError: lengths not summing to N or per-sequence lists of different lengths, a negative start
            or length, ``kv_block`` < 1, a sequence with fewer than ``start_b + n_b`` keys, K/V neither bf16
            nor fp32, mixed K/V dtypes or shapes, D or Hkv < 1, or Hq not a multiple of Hkv.
    """
    n_total, hq, d = q.shape
    if sum(lengths) != n_total or len(kv) != len(lengths) or len(starts) != len(lengths):
        raise ValueError(f"attn.core: {n_total} query rows, lengths summing to {sum(lengths)}, "
                         f"{len(kv)} K/V pairs, {len(starts)} starts, {len(lengths)} lengths")
    bad = [(s, n) for s, n in zip(starts, lengths) if s < 0 or n < 0]
    if bad or kv_block < 1:
        raise ValueError(f"attn.core: starts and lengths must be >= 0 (got start {bad[0][0]}, length {bad[0][1]})"
                         if bad else f"attn.core: kv_block must be >= 1, got {kv_block}")
    if n_total == 0:
        return q.new_zeros(q.shape)
    hkv = kv[0][0].shape[1]
    kv_dtype = kv[0][0].dtype
    if d < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"attn.core: need D >= 1 and Hq a multiple of Hkv >= 1, got D={d}, Hq={hq}, Hkv={hkv}")
    if kv_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"attn.core: K/V must be bf16 or fp32, got {kv_dtype}")
    for (k, v), s, n in zip(kv, starts, lengths):
        if k.shape != v.shape or k.shape[0] < s + n or k.shape[1:] != (hkv, d) or {k.dtype, v.dtype} != {kv_dtype}:
            raise ValueError(f"attn.core: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} of a sequence "
                             f"with {s} cached and {n} new tokens; need both [>= {s + n}, {hkv}, {d}] {kv_dtype}")
    flat = [t[: s + n] if _rows_ok(t) else t[: s + n].contiguous() for (k, v), s, n in zip(kv, starts, lengths)
            for t in (k, v)]
    qs = q.float() * (1.0 / math.sqrt(d))
    return _Attention.apply(qs, (list(starts), list(lengths), kv_block), *flat).to(q.dtype)


def _rows_ok(t: torch.Tensor) -> bool:
    """Each row's ``[Hkv, D]`` block is contiguous (any stride between rows)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


class _Attention(torch.autograd.Function):
    """``attention.c``: forward bits, and the recomputation backward (dq, dK, dV in fp32)."""

    @staticmethod
    def forward(ctx, qs, layout, *flat):  # noqa: D102
        starts, lengths, kv_block = layout
        n, hq, d = qs.shape
        qs = qs.contiguous()
        o = torch.empty(n, hq, d, dtype=torch.float32)
        m, l = torch.empty(n, hq, dtype=torch.float32), torch.empty(n, hq, dtype=torch.float32)
        arrays, args = _layout_args(flat, starts, lengths)  # arrays: what args point into, alive until return
        rc = _lib().isoexec_attention_fwd(c_ptr(qs), *args, ctypes.c_int64(hq), ctypes.c_int64(flat[0].shape[1]),
                                          ctypes.c_int64(d), ctypes.c_int64(kv_block), c_ptr(o), c_ptr(m), c_ptr(l))
        if rc != 0:
            raise MemoryError("attention.c could not allocate its buffers")
        ctx.save_for_backward(qs, o, m, l, *flat)
        ctx.layout = layout
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        qs, o, m, l, *flat = ctx.saved_tensors
        starts, lengths, _ = ctx.layout
        n, hq, d = qs.shape
        do = do.float().contiguous()
        dq = torch.empty_like(qs)
        grads = [torch.empty(t.shape, dtype=torch.float32) for t in flat]
        dk = torch.tensor([g.data_ptr() for g in grads[0::2]], dtype=torch.int64)
        dv = torch.tensor([g.data_ptr() for g in grads[1::2]], dtype=torch.int64)
        arrays, args = _layout_args(flat, starts, lengths)
        rc = _lib().isoexec_attention_bwd(c_ptr(qs), *args, ctypes.c_int64(hq), ctypes.c_int64(flat[0].shape[1]),
                                          ctypes.c_int64(d), c_ptr(o), c_ptr(do), c_ptr(m),
                                          c_ptr(l), c_ptr(dq), c_ptr(dk), c_ptr(dv))
        if rc != 0:
            raise MemoryError("attention.c could not allocate its buffers")
        return (dq, None, *(g.to(t.dtype) for g, t in zip(grads, flat)))


def _layout_args(flat: list[torch.Tensor], starts: list[int], lengths: list[int]) -> tuple[list, list]:
    """The kernel's sequence arguments (K and V pointers, K and V row strides, dtype flag, q row offsets,
    starts, lengths, count), with the int64 tensors they point into (keep them until the call returns)."""
    row0 = [0]
    for n in lengths[:-1]:
        row0.append(row0[-1] + n)
    arrays = [torch.tensor(x, dtype=torch.int64) for x in (
        [t.data_ptr() for t in flat[0::2]], [t.data_ptr() for t in flat[1::2]], [t.stride(0) for t in flat[0::2]],
        [t.stride(0) for t in flat[1::2]], row0, starts, lengths)]
    kp, vp, ks, vs, r0, st, ln = arrays
    bf16 = ctypes.c_int(int(flat[0].dtype == torch.bfloat16))
    return arrays, [*map(c_ptr, (kp, vp, ks, vs)), bf16, *map(c_ptr, (r0, st, ln)), ctypes.c_int64(len(lengths))]


def _lib() -> ctypes.CDLL:
    return kernel_library(__file__, "attention.c")


def iso_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Output gate of gated attention (region ``attn.gate``): ``x * sigmoid(gate)``, fp32 math."""
    return (x.float() * sigmoid(gate.float())).to(x.dtype)
