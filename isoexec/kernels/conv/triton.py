"""Depthwise causal conv1d + SiLU in Triton (region ``gdn.conv1d``).

Output position t sums ``w[:, j] * x[t - Kc + 1 + j]`` for j = 0..Kc-1 in that order, in fp32 (taps
before the piece come from the cached prefix). Every piece of a call runs in ONE launch over the packed
layout of :mod:`isoexec.kernels.conv.layout` (an engine step's decode tokens and prefill chunks together;
one launch per piece before, 6,144 launches in one generate of ``results/h200-vllm``'s profile), and each
output element is the same operations in every case and batch, so prefill, chunked prefill and decode agree
bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from isoexec.kernels.autograd import with_ref_grad
from isoexec.kernels.conv.layout import check_inputs, pack
from isoexec.kernels.conv.native import native_conv_span


@triton.jit(do_not_specialize=["n", "CH"])
def _conv_kernel(ext_ptr, first_ptr, w_ptr, y_ptr, n, CH, KC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < n
    cm = c < CH
    m = tm[:, None] & cm[None, :]
    base = tl.load(first_ptr + t, mask=tm, other=0)  # int64: the row of output t's tap 0
    acc = tl.zeros((BT, BC), tl.float32)
    for j in tl.static_range(KC):
        xf = tl.load(ext_ptr + (base + j)[:, None] * CH + c[None, :], mask=m, other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + c * KC + j, mask=cm, other=0.0).to(tl.float32)
        if j == 0:
            acc = xf * wj[None, :]
        else:
            acc = acc + xf * wj[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + t.to(tl.int64)[:, None] * CH + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def _tap_rows(ext: torch.Tensor, first: torch.Tensor, w: torch.Tensor, block_t: int, block_c: int) -> torch.Tensor:
    """The kernel: conv + SiLU of output rows ``first`` (``[N]`` int64, on ext's device) of ``ext``; ``[N, C]``."""
    n, ch = first.numel(), ext.shape[1]
    y = ext.new_empty(n, ch)
    if n:
        _conv_kernel[(triton.cdiv(n, block_t), triton.cdiv(ch, block_c))](
            ext.contiguous(), first, w.contiguous(), y, n, ch, KC=w.shape[1], BT=block_t, BC=block_c, num_warps=4)
    return y


def causal_conv1d_pieces(pieces: list[torch.Tensor], w: torch.Tensor, prefixes: list[torch.Tensor], block_t: int,
                         block_c: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Causal conv1d + SiLU of every piece in one launch (the region's signature).

    Args:
        pieces: per sequence piece its new inputs ``[L_b, C]``; w: ``[C, Kc]``; prefixes: per piece its previous
            ``Kc-1`` inputs ``[Kc-1, C]``; block_t / block_c: output rows / channels per program
            (``kernels.triton.conv_block_t/_c``; they move no bit).

    Returns:
        (per piece ``[L_b, C]`` in the pieces' dtype, per piece its new prefix ``[Kc-1, C]``, detached). Under
        autograd the gradient is transformers' ``F.conv1d`` path (:func:`~isoexec.kernels.autograd.with_ref_grad`).

    Raises:
        ValueError: see :func:`~isoexec.kernels.conv.layout.check_inputs`.
    """
    dtype, _, kc = check_inputs(pieces, w, prefixes)
    packed = pack(pieces, prefixes, dtype, kc)
    # one copy to the device: each output row's tap-0 row, then each piece's new-prefix rows
    rows = torch.cat([packed.first, packed.tail.flatten()]).to(packed.ext.device)
    first, tail = rows[:packed.first.numel()], rows[packed.first.numel():]
    y = with_ref_grad(lambda e, ww: _tap_rows(e, first, ww, block_t, block_c),
                      lambda e, ww: torch.cat([native_conv_span(e[s:t], ww) for s, t in packed.spans]),
                      packed.ext, w)
    ys = list(y.split(packed.lengths))
    if kc == 1:
        return ys, list(prefixes)
    return ys, list(packed.ext.detach()[tail].view(len(pieces), kc - 1, -1).unbind(0))


def causal_conv1d_slots(x: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, block_t: int,
                        block_c: int) -> torch.Tensor:
    """One decode token per sequence with slot-addressed prefixes, no value-dependent host work (CUDA graph safe).

    Args:
        x: ``[B, C]`` the tokens' inputs. w: ``[C, Kc]`` (Kc > 1). pool: ``[S, Kc-1, C]`` in ``x.dtype``, slot s the
            previous ``Kc-1`` inputs of its sequence; updated in place (the token appended). slots: ``[B]`` int64.
        block_t, block_c: as :func:`causal_conv1d_pieces`.

    Returns:
        ``[B, C]``: the bits :func:`causal_conv1d_pieces` gives the same tokens (the same kernel over the same packed
        rows: each token's prefix then the token).

    Raises:
        ValueError: a pool of another dtype than ``x``, or Kc = 1 (no prefix).
    """
    B, ch = x.shape
    kc = w.shape[1]
    if pool.dtype != x.dtype or kc < 2:
        raise ValueError(f"causal_conv1d_slots: a {pool.dtype} pool for {x.dtype} inputs, Kc={kc}; need the inputs' "
                         "dtype and Kc > 1")
    ext = torch.cat([pool[slots], x[:, None]], dim=1)  # [B, Kc, C]: the packed layout of B pieces
    first = torch.arange(B, device=x.device) * kc
    y = _tap_rows(ext.view(B * kc, ch), first, w, block_t, block_c)
    pool[slots] = ext[:, 1:]
    return y


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, prefix: torch.Tensor, block_t: int, block_c: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One piece: x ``[L, C]``, w ``[C, Kc]``, prefix ``[Kc-1, C]`` -> (``[L, C]``, new prefix ``[Kc-1, C]``)."""
    ys, prefixes = causal_conv1d_pieces([x], w, [prefix], block_t, block_c)
    return ys[0], prefixes[0]
