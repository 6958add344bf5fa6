"""Per-sequence engine state of the unified model (one object per request)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceCache:
    """Everything a sequence carries between ``engine_prefill`` / ``engine_decode`` steps.

    Attributes:
        policy: fingerprint of the kernel set (implementations and constants) that built this cache;
            ``UnifiedModel.engine_step`` refuses a cache of another fingerprint.
        position: tokens consumed so far (the absolute position of the next token).
        kv: attention layer index -> (K, V) buffers ``[capacity, Hkv, D]`` in the boundary dtype, of
            which the first ``position`` rows are the sequence's keys and values (:meth:`append_kv`).
        conv: GDN layer index -> the last ``Kc - 1`` conv inputs ``[Kc-1, conv_dim]``.
        gdn: GDN layer index -> the kernel set's state (for isoexec a ``CPRState``, which records its
            chunk size C: fp32 running and chunk-entry states plus the open chunk's inputs; the
            recurrent state for native).
    """

    policy: str | None = None
    position: int = 0
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    gdn: dict[int, object] = field(default_factory=dict)

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values ``[n, Hkv, D]`` of ``layer`` after the ``position`` cached rows
        (buffers grow by doubling, so a decode step copies nothing old).

        Returns:
            (K, V) ``[position + n, Hkv, D]``: views of every key and value of the sequence so far.
        """
        end = self.position + k.shape[0]
        kbuf, vbuf = self.kv[layer] if layer in self.kv else (k.new_empty((0, *k.shape[1:])), v.new_empty((0, *v.shape[1:])))
        if kbuf.shape[0] < end:
            cap = max(end, 2 * kbuf.shape[0], 16)
            kbuf = torch.cat([kbuf[: self.position], k.new_empty((cap - self.position, *k.shape[1:]))])
            vbuf = torch.cat([vbuf[: self.position], v.new_empty((cap - self.position, *v.shape[1:]))])
            self.kv[layer] = (kbuf, vbuf)
        kbuf[self.position : end] = k
        vbuf[self.position : end] = v
        return kbuf[:end], vbuf[:end]
