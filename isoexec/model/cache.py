"""Per-sequence engine state of the unified model (one object per request)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SequenceCache:
    """Everything a sequence carries between ``engine_prefill`` / ``engine_decode`` steps.

    Attributes:
        policy: fingerprint of the kernel set (implementations and constants) that built this cache;
            ``UnifiedModel.engine_step`` refuses a cache of another fingerprint.
        position: tokens consumed so far (the absolute position of the next token).
        kv: attention layer index -> (K, V) buffers ``[capacity, Hkv, D]`` in the boundary dtype, of
            which the first ``position`` rows are the sequence's keys and values (:func:`append_kv`).
        conv: GDN layer index -> the last ``Kc - 1`` conv inputs ``[Kc-1, conv_dim]``.
        gdn: GDN layer index -> the kernel set's state (for isoexec a ``CPRState``, which records its
            chunk size C: fp32 running and chunk-entry states plus the open chunk's inputs; the
            recurrent state for native).
        pools, slot: the :class:`~isoexec.model.graphs.SlotPools` whose slot ``slot`` holds this sequence's keys,
            values and conv prefixes at fixed addresses (what a CUDA-graph decode step reads), or None: buffers of
            its own.
    """

    policy: str | None = None
    position: int = 0
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    gdn: dict[int, object] = field(default_factory=dict)
    pools: Any = None
    slot: int = -1

    def reserve_kv(self, layer: int, n: int, like_k: torch.Tensor, like_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for ``n`` more keys/values of ``layer`` after the ``position`` cached rows (buffers grow by doubling,
        so a decode step copies nothing old).

        Returns:
            (K, V) buffers ``[capacity >= position + n, Hkv, D]`` (dtype and device of ``like_k`` / ``like_v``; a
            pooled sequence's: its slot of the pools, of the pools' capacity).

        Raises:
            ValueError: a pooled sequence longer than its pools' capacity.
        """
        end = self.position + n
        if self.pools is not None:
            return self.pools.kv_slot(layer, self.slot, end)
        kbuf, vbuf = self.kv[layer] if layer in self.kv else (like_k.new_empty((0, *like_k.shape[1:])),
                                                               like_v.new_empty((0, *like_v.shape[1:])))
        if kbuf.shape[0] < end:
            cap = max(end, 2 * kbuf.shape[0], 16)
            kbuf = torch.cat([kbuf[: self.position], kbuf.new_empty((cap - self.position, *kbuf.shape[1:]))])
            vbuf = torch.cat([vbuf[: self.position], vbuf.new_empty((cap - self.position, *vbuf.shape[1:]))])
            self.kv[layer] = (kbuf, vbuf)
        return kbuf, vbuf

    def set_conv(self, layer: int, prefix: torch.Tensor) -> None:
        """Keep ``prefix`` ``[Kc-1, C]`` as ``layer``'s conv prefix (copied into the slot of a pooled sequence)."""
        if self.pools is None:
            self.conv[layer] = prefix.detach()
        else:
            self.conv[layer] = self.pools.conv_slot(layer, self.slot).copy_(prefix)


def append_kv(caches: list[SequenceCache], layer: int, ks: list[torch.Tensor], vs: list[torch.Tensor]
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Append each sequence piece's keys/values ``[n_b, Hkv, D]`` of ``layer`` after its cache's ``position`` rows,
    all pieces in one fused copy (``torch._foreach_copy_``; 2B device-to-device copies per attention layer and step
    before: the H200 profiles of ``results/h200-vllm/08dd807`` list 84 device-to-device copies per forward before,
    too few to list after).

    Returns:
        per piece (K, V) ``[position_b + n_b, Hkv, D]``: views of every key and value of the sequence so far.
    """
    dst, src, out = [], [], []
    for c, k, v in zip(caches, ks, vs):
        kbuf, vbuf = c.reserve_kv(layer, k.shape[0], k, v)
        end = c.position + k.shape[0]
        dst += [kbuf[c.position : end], vbuf[c.position : end]]
        src += [k, v]
        out.append((kbuf[:end], vbuf[:end]))
    if dst:
        torch._foreach_copy_(dst, src)
    return out
