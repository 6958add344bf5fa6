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
        kv: attention layer index -> (K, V), each ``[position, Hkv, D]`` in the boundary dtype.
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
