"""Context parallelism (CP): a sequence split over ranks, with the exchanges that let every rank
reproduce the bits of one rank.

Layout: **Megatron's load-balanced chunks** (:class:`SequenceSlice`). A right-padded batch ``[B, L]``
(``L`` a multiple of ``2 cp``) is cut along the sequence into ``2 cp`` chunks of ``h = L / (2 cp)``
positions; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every sequence, in that order, as its
``2 h`` local rows (Megatron-LM's ``get_batch_on_this_cp_rank``). Causal attention's work grows with the
position, so a contiguous split would leave the last rank with ``(2 cp - 1) / cp^2`` of it (measured on
the CPU set at 16k tokens, CP 2: the second half's attention forward + backward took 8.8 s of the whole
sequence's 11.0 s); the paired chunks give every rank half of the early and half of the late work. The
GDN state chain then runs through the chunks in sequence order, 0, 1, ..., 2 cp - 1: up the ranks through
their first chunks and back down through their second ones (rank ``cp - 1`` holds chunks ``cp - 1`` and
``cp`` and passes it to itself). A rank's real tokens of a sequence are still a prefix of its local rows
(a sequence that reaches the second chunk fills the first).

What crosses ranks (torch.distributed point-to-point and all-gather only; any backend, any device):

* GDN chain (:class:`ChainExchange`, the :class:`~isoexec.kernels.gdn.cpu.ChainLink` of
  :class:`~isoexec.kernels.gdn.cpu.CPRPieceFunction`): the holder of chunk ``g`` sends the holder of chunk
  ``g + 1`` each continuing sequence's fp32 state entering the GDN chunk (of C tokens) that holds chunk
  ``g + 1``'s first position, and that GDN chunk's earlier ``k | v | g | beta`` rows (fewer than C); the
  backward sends their gradients the other way.
* conv1d prefix and attention K/V: all-gathered over the CP group (Megatron's
  ``gather_from_sequence_parallel_region``, whose backward reduce-scatters the gradients to their owners)
  and put in sequence order (:meth:`SequenceSlice.gather_order`); a rank's queries then read keys from
  position 0 in the same absolute ``kv_block`` order as one rank.
* logprob rows (:func:`gather_sequence_replicated`): all-gathered, so every rank returns the whole ``[T, V]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceSlice:
    """This rank's chunks of a right-padded batch under CP (the layout of the module docstring).

    Attributes:
        rank: CP rank. degree: CP degree. size: local positions per sequence (``L / degree``; even when
            ``degree > 1``).
    """

    rank: int
    degree: int
    size: int

    @property
    def chunk(self) -> int:
        """Positions per chunk: ``L / (2 cp)`` (``L`` at CP 1)."""
        return self.size // 2 if self.degree > 1 else self.size

    @property
    def chunks(self) -> list[int]:
        """The global chunk indices of this rank's local rows, in local order."""
        return [self.rank, 2 * self.degree - 1 - self.rank] if self.degree > 1 else [0]

    def owner(self, g: int) -> tuple[int, int]:
        """(CP rank, local slot) holding global chunk ``g``."""
        if self.degree == 1:
            return 0, 0
        return (g, 0) if g < self.degree else (2 * self.degree - 1 - g, 1)

    def positions(self, device=None) -> torch.Tensor:
        """``[size]`` int64: the absolute position of each local row."""
        h = self.chunk
        return torch.cat([torch.arange(g * h, (g + 1) * h, device=device) for g in self.chunks])

    def chunk_lengths(self, lengths: list[int]) -> list[list[int]]:
        """Per local chunk, the real tokens of each sequence (global ``lengths``) in it."""
        h = self.chunk
        return [[min(max(n - g * h, 0), h) for n in lengths] for g in self.chunks]

    def local_lengths(self, lengths: list[int]) -> list[int]:
        """Real tokens of each sequence on this rank: a prefix of its local rows."""
        return [sum(c) for c in zip(*self.chunk_lengths(lengths))]

    def gather_order(self, device=None) -> torch.Tensor:
        """``[L]`` int64: for each position, its row in the rank-major all-gather of every rank's local rows."""
        h = self.chunk
        rows = [q * self.size + j * h for q, j in map(self.owner, range(len(self.chunks) * self.degree))]
        return torch.cat([torch.arange(r, r + h, device=device) for r in rows])


class ChainExchange:
    """The GDN chain of one local chunk (``slot``) with the holders of the neighbouring chunks, for the
    sequences that have tokens in it (one message per direction and layer: every sequence's tensors
    flattened into one fp32 buffer; a neighbour on this rank takes the tensors from ``mailbox``).

    Args:
        group: the CP process group.
        piece: this rank's :class:`SequenceSlice`. slot: the local chunk (0 or 1).
        lengths: global real lengths of the sequences that have tokens in the chunk, in batch order.
        chunk_size: the GDN chunk size C.
        device: where received tensors are placed.
        mailbox: a dict shared by the two slots' exchanges of one layer call.
    """

    def __init__(self, group, piece: SequenceSlice, slot: int, lengths: list[int], chunk_size: int, device,
                 mailbox: dict):
        self.group, self.piece, self.C, self.device, self.mailbox = group, piece, chunk_size, device, mailbox
        g = piece.chunks[slot]
        self.start, self.end = g * piece.chunk, (g + 1) * piece.chunk
        self.prev = piece.owner(g - 1) if g > 0 else None
        self.next = piece.owner(g + 1) if g + 1 < len(piece.chunks) * piece.degree else None
        self.continues = [n > self.end for n in lengths]
        self.g, self.n = g, len(lengths)
        self.sent_rows: list[int] = []
        self.pending: list = []

    def _recv(self, shapes: list[tuple[int, ...]], peer: tuple[int, int], key: tuple) -> list[torch.Tensor]:
        if peer[0] == self.piece.rank:
            return self.mailbox.pop(key)
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        buf = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
        dist.recv(buf, group=self.group, group_src=peer[0], tag=key[0])
        return [t.view(s) for t, s in zip(buf.split(sizes), shapes)]

    def _send(self, tensors: list[torch.Tensor], peer: tuple[int, int], key: tuple) -> None:
        if peer[0] == self.piece.rank:
            self.mailbox[key] = [t.float() for t in tensors]
        elif tensors:
            flat = torch.cat([t.reshape(-1).float() for t in tensors])
            self.pending.append((dist.isend(flat, group=self.group, group_dst=peer[0], tag=key[0]), flat))

    def wait(self) -> None:
        """Complete the sends started so far (their buffers stay alive until then)."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    def recv_state(self, h: int, dk: int, dv: int):  # noqa: D102 - ChainLink
        if self.prev is None or not self.n:  # the previous chunk's holder sends exactly when some sequence reaches here
            return [None] * self.n
        shapes = [(h, dk, dv), (self.start % self.C, h * (dk + dv + 2))] * self.n
        parts = self._recv(shapes, self.prev, (0, self.g))
        return [(parts[2 * i], parts[2 * i + 1]) for i in range(self.n)]

    def send_state(self, states) -> None:  # noqa: D102 - ChainLink
        self.sent_rows = [rows.shape[0] if c else 0 for (_, rows), c in zip(states, self.continues)]
        if any(self.continues):
            self._send([t for (s, rows), c in zip(states, self.continues) if c for t in (s, rows)], self.next,
                       (0, self.g + 1))

    def recv_grad(self, h: int, dk: int, dv: int):  # noqa: D102 - ChainLink
        self.wait()
        if not any(self.continues):
            return [None] * self.n
        shapes = [s for c, p in zip(self.continues, self.sent_rows) if c for s in ((h, dk, dv), (p, h * (dk + dv + 2)))]
        parts = iter(self._recv(shapes, self.next, (1, self.g)))
        return [(next(parts), next(parts)) if c else None for c in self.continues]

    def send_grad(self, grads) -> None:  # noqa: D102 - ChainLink
        if self.prev is not None and self.n:
            self._send([t for pair in grads for t in pair], self.prev, (1, self.g - 1))
            self.wait()


class _GatherReplicated(torch.autograd.Function):
    """All-gather along ``dim`` over a group; backward: this rank's slice of the gradient times the group
    size (every rank computes the same loss from the gathered tensor)."""

    @staticmethod
    def forward(ctx, x, group, dim):  # noqa: D102
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=ctx.dim)[r] * n, None, None


def gather_sequence_replicated(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """``x`` (this rank's local rows along ``dim``) all-gathered over the CP ``group`` in rank order
    (:meth:`SequenceSlice.gather_order` puts them in sequence order).

    The backward keeps this rank's part of the gradient and multiplies it by the CP degree: the same
    loss is computed on every rank from the gathered rows, and Megatron's ``DistributedDataParallel``
    averages the gradients over the data- and context-parallel ranks (its ``gradient_scaling_factor``
    ``1 / dp_cp``), so, as Megatron-LM's ``pretrain_gpt.py`` scales its per-rank loss by
    ``context_parallel_size``, the sum of the CP ranks' gradients is restored. Identity for one rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherReplicated.apply(x, group, dim)
