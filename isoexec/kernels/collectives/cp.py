"""Context parallelism (CP): a sequence split over ranks, with the exchanges that let every rank
reproduce the bits of one rank.

Layout: **contiguous**. A right-padded batch ``[B, L]`` (``L`` a multiple of the CP degree) is cut along
the sequence into CP equal slices of ``s = L / cp`` positions; rank ``r`` holds positions ``[r s, (r+1) s)``
of every sequence (:class:`SequenceSlice`). Megatron's own CP for causal attention cuts the sequence
into ``2 cp`` chunks and gives rank ``r`` chunks ``r`` and ``2 cp - 1 - r`` to balance the attention
work; here the GDN layers (three of four) carry a sequential fp32 state chain through the sequence,
which a contiguous slice hands on once per rank in rank order (with the load-balanced chunks it would
cross every rank twice, down and back), and their work per token does not grow with the position.

What crosses ranks (torch.distributed point-to-point and all-gather only; any backend, any device):

* GDN chain (:class:`ChainExchange`, the :class:`~isoexec.kernels.gdn.cpu.ChainLink` of
  :class:`~isoexec.kernels.gdn.cpu.CPRPieceFunction`): rank ``r`` sends rank ``r + 1`` each continuing
  sequence's fp32 state entering the chunk that holds ``r + 1``'s first token and that chunk's earlier
  ``k | v | g | beta`` rows (fewer than C); the backward sends their gradients the other way.
* conv1d prefix and attention K/V: all-gathered over the CP group along the sequence (Megatron's
  ``gather_from_sequence_parallel_region``, whose backward reduce-scatters the gradients); a rank's
  queries then read keys ``0 ..`` its positions in the same absolute ``kv_block`` order as one rank.
* logits (:func:`gather_sequence_replicated`): all-gathered along the sequence, so every rank returns
  the whole ``[T, V]`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceSlice:
    """This rank's positions ``[start, start + size)`` of a right-padded batch under contiguous CP.

    Attributes:
        rank: CP rank. degree: CP degree. size: positions per rank (``L / degree``).
    """

    rank: int
    degree: int
    size: int

    @property
    def start(self) -> int:
        return self.rank * self.size

    @property
    def end(self) -> int:
        return self.start + self.size

    def local_lengths(self, lengths: list[int]) -> list[int]:
        """Real tokens of each sequence (global ``lengths``) in this slice."""
        return [min(max(n - self.start, 0), self.size) for n in lengths]

    def continues(self, lengths: list[int]) -> list[bool]:
        """Whether the next rank holds real tokens of each sequence."""
        return [n > self.end for n in lengths]


class ChainExchange:
    """The GDN chain between neighbouring CP ranks for the sequences this rank holds (one message per
    direction and layer: every sequence's tensors flattened into one fp32 buffer).

    Args:
        group: the CP process group (None: one rank, nothing moves).
        piece: this rank's :class:`SequenceSlice`.
        lengths: global real lengths of the sequences that have tokens on this rank, in batch order.
        chunk_size: the GDN chunk size C.
        device: where received tensors are placed.
    """

    def __init__(self, group, piece: SequenceSlice, lengths: list[int], chunk_size: int, device):
        self.group, self.piece, self.C, self.device = group, piece, chunk_size, device
        self.prev = piece.rank > 0  # every sequence with tokens here has earlier tokens on rank - 1
        self.next = piece.continues(lengths)
        self.n = len(lengths)
        self.sent_rows: list[int] = []
        self.pending: list = []

    def _recv(self, numel: int, peer: int) -> torch.Tensor:
        buf = torch.empty(numel, dtype=torch.float32, device=self.device)
        dist.recv(buf, group=self.group, group_src=peer)
        return buf

    def _send(self, tensors: list[torch.Tensor], peer: int) -> None:
        if tensors:
            flat = torch.cat([t.reshape(-1).float() for t in tensors])
            self.pending.append((dist.isend(flat, group=self.group, group_dst=peer), flat))

    def wait(self) -> None:
        """Complete the sends started so far (their buffers stay alive until then)."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    def _split(self, buf: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        return [t.view(s) for t, s in zip(buf.split(sizes), shapes)]

    def recv_state(self, h: int, dk: int, dv: int):  # noqa: D102 - ChainLink
        if not (self.prev and self.n):  # rank - 1 sends exactly when some sequence has tokens here
            return [None] * self.n
        p = self.piece.start % self.C
        shapes = [(h, dk, dv), (p, h * (dk + dv + 2))] * self.n
        parts = self._split(self._recv(sum(int(torch.Size(s).numel()) for s in shapes), self.piece.rank - 1), shapes)
        return [(parts[2 * i], parts[2 * i + 1]) for i in range(self.n)]

    def send_state(self, states) -> None:  # noqa: D102 - ChainLink
        out = [(s, rows) for (s, rows), nxt in zip(states, self.next) if nxt]
        self.sent_rows = [rows.shape[0] if nxt else 0 for (_, rows), nxt in zip(states, self.next)]
        self._send([t for pair in out for t in pair], self.piece.rank + 1)

    def recv_grad(self, h: int, dk: int, dv: int):  # noqa: D102 - ChainLink
        self.wait()
        if not any(self.next):
            return [None] * self.n
        shapes = [s for nxt, p in zip(self.next, self.sent_rows) if nxt for s in ((h, dk, dv), (p, h * (dk + dv + 2)))]
        parts = iter(self._split(self._recv(sum(int(torch.Size(s).numel()) for s in shapes), self.piece.rank + 1),
                                 shapes))
        return [(next(parts), next(parts)) if nxt else None for nxt in self.next]

    def send_grad(self, grads) -> None:  # noqa: D102 - ChainLink
        if self.prev:
            self._send([t for pair in grads for t in pair], self.piece.rank - 1)
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
    """``x`` (this rank's slice along ``dim``) all-gathered over the CP ``group`` in rank order.

    The backward keeps this rank's slice of the gradient and multiplies it by the CP degree: the same
    loss is computed on every rank from the gathered rows, and Megatron's ``DistributedDataParallel``
    averages the gradients over the data- and context-parallel ranks (its ``gradient_scaling_factor``
    ``1 / dp_cp``), so, as Megatron-LM's ``pretrain_gpt.py`` scales its per-rank loss by
    ``context_parallel_size``, the sum of the CP ranks' gradients is restored. Identity for one rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherReplicated.apply(x, group, dim)
