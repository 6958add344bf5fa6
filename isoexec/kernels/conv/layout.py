"""The packed layout of the ``gdn.conv1d`` region's pieces, shared by its CPU and Triton kernels.

Every piece's prefix, then its new inputs, one after another: ``ext = [prefix_0 | x_0 | prefix_1 | x_1 | ...]``
(``[sum_b (Kc-1 + L_b), C]``). Output row r (rows numbered over all pieces in order) sums the ``Kc`` rows of
``ext`` from ``first[r]`` on, tap 0 first; a piece's new prefix is the last ``Kc-1`` rows of its span. So one
kernel launch covers every piece of an engine step, whatever mix of prefill chunks and decode tokens it holds,
and each output element is the same sequence of operations as when its piece runs alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_inputs(pieces: list[torch.Tensor], w: torch.Tensor, prefixes: list[torch.Tensor]) -> tuple[torch.dtype, int, int]:
    """The pieces' dtype, channels C and taps Kc of a ``gdn.conv1d`` call.

    Args:
        pieces: per sequence piece its new inputs ``[L_b, C]`` (boundary dtype).
        w: ``[C, Kc]`` conv weight (HF ``conv1d.weight.squeeze(1)``).
        prefixes: per piece the previous ``Kc-1`` inputs ``[Kc-1, C]`` (zeros at sequence start).

    Raises:
        ValueError: no piece, a weight that is not ``[C, Kc]``, or not one ``[Kc-1, C]`` prefix per piece.
    """
    if not pieces:
        raise ValueError("gdn.conv1d: no piece (an engine step or trainer batch has at least one)")
    dtype = pieces[0].dtype
    channels = pieces[0].shape[-1]
    kc = w.shape[1] if w.dim() == 2 else 0
    if w.dim() != 2 or w.shape[0] != channels:
        raise ValueError(f"gdn.conv1d: the weight must be [channels, taps] = [{channels}, Kc], got {tuple(w.shape)}")
    if len(prefixes) != len(pieces):
        raise ValueError(f"gdn.conv1d: {len(pieces)} pieces but {len(prefixes)} prefixes (one per piece)")
    for b, p in enumerate(prefixes):
        if tuple(p.shape) != (kc - 1, channels):
            raise ValueError(f"gdn.conv1d: prefix {b} has shape {tuple(p.shape)}, need ({kc - 1}, {channels}) (Kc-1 rows)")
    return dtype, channels, kc


@dataclass(frozen=True)
class Packed:
    """The pieces in the packed layout (module docstring).

    Attributes:
        ext: ``[sum_b (Kc-1 + L_b), C]`` in the pieces' dtype (prefixes cast to it).
        first: ``[N]`` int64 on the CPU, N = sum of L_b: the row of ``ext`` holding output row r's tap 0.
        tail: ``[B, Kc-1]`` int64 on the CPU: the rows of ``ext`` of each piece's new prefix.
        spans: per piece (start, end) of its rows in ``ext``.
        lengths: per piece L_b.
    """

    ext: torch.Tensor
    first: torch.Tensor
    tail: torch.Tensor
    spans: list[tuple[int, int]]
    lengths: list[int]


def pack(pieces: list[torch.Tensor], prefixes: list[torch.Tensor], dtype: torch.dtype, kc: int) -> Packed:
    """The pieces and their prefixes in the packed layout (one ``torch.cat``; index tensors on the CPU)."""
    parts = [t for x, p in zip(pieces, prefixes) for t in (p if p.dtype == dtype else p.to(dtype), x)]
    ext = torch.cat(parts, dim=0)
    lens = torch.tensor([x.shape[0] for x in pieces], dtype=torch.long)
    ends = torch.cumsum(lens + (kc - 1), 0)  # end of each piece's span in ext
    starts = ends - lens - (kc - 1)
    first = torch.arange(int(lens.sum())) + torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens)
    tail = (ends[:, None] - (kc - 1)) + torch.arange(kc - 1)[None, :]
    return Packed(ext, first, tail, list(zip(starts.tolist(), ends.tolist())), lens.tolist())
