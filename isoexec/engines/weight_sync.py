"""Per-tensor checksums for trainer -> engine weight sync.

Both sides hash every tensor with :func:`tensor_checksum`; after a sync the engine's checksums for
every Hugging Face parameter name must equal the trainer's (:func:`verify_checksums`).
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """``sha256`` over ``dtype``, ``shape`` and the raw bytes of ``t`` (C-contiguous, on CPU).

    Args:
        t: any dense tensor (any dtype, bf16 included).

    Returns:
        ``"<dtype>:<shape>:<hex digest>"``, e.g. ``"torch.bfloat16:[4, 128]:9f2c..."``.
    """
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256()
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return f"{t.dtype}:{list(t.shape)}:{h.hexdigest()}"


def state_checksums(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """:func:`tensor_checksum` of every tensor, keyed by name."""
    items = named.items() if isinstance(named, Mapping) else named
    return {k: tensor_checksum(v) for k, v in items}


class WeightSyncError(RuntimeError):
    """Checksums after a sync differ from the trainer's (lists the names)."""


def verify_checksums(expected: Mapping[str, str], got: Mapping[str, str]) -> None:
    """Raise :class:`WeightSyncError` unless ``got[name] == expected[name]`` for every name in
    ``expected`` (names missing from ``got`` count as differing)."""
    bad = sorted(k for k, v in expected.items() if got.get(k) != v)
    if bad:
        raise WeightSyncError(f"{len(bad)} tensors differ after weight sync: {bad[:10]}")
