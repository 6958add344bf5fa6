"""Trainer -> engine weight sync: completeness before, per-tensor checksums after.

Before any weight moves, the state dict must cover the engine's whole parameter set, each tensor
with the engine's dtype and shape (:func:`check_state_covers`): a partial state would leave the
engine on a mix of old and new weights while the checksums of the tensors sent still agree. After
the sync, both sides hash every tensor with :func:`tensor_checksum`, and the engine's checksums of
every Hugging Face parameter name must equal the trainer's (:func:`verify_checksums`).
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import torch

TensorSpec = tuple[torch.dtype, tuple[int, ...]]
"""``(dtype, shape)`` of one tensor."""

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
    """A state dict that does not cover the engine's parameters, or checksums after a sync that differ
    from the trainer's (the message lists the names)."""


def tensor_specs(named: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """``name -> (dtype, shape)`` of every tensor."""
    return {k: (v.dtype, tuple(v.shape)) for k, v in named.items()}


def check_state_covers(state: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec], *,
                       require_all: bool = True) -> None:
    """Refuse a state dict that is not exactly the engine's parameter set (call before moving any weight).

    Args:
        state: the tensors to sync, Hugging Face names.
        specs: the engine's parameters, ``name -> (dtype, shape)`` (:func:`tensor_specs`,
            ``isoexec.model.hf.checkpoint_specs``).
        require_all: an engine name missing from ``state`` is refused (default True).

    Raises:
        WeightSyncError: listing, with counts, the engine's names the state lacks, names the engine
            does not have, and tensors whose shape or dtype differs from the engine's (no silent casts).
    """
    missing = sorted(set(specs) - set(state)) if require_all else []
    extra = sorted(set(state) - set(specs))
    shape = sorted(f"{k} {list(state[k].shape)} != engine {list(specs[k][1])}" for k in set(state) & set(specs)
                   if tuple(state[k].shape) != specs[k][1])
    dtype = sorted(f"{k} {state[k].dtype} != engine {specs[k][0]}" for k in set(state) & set(specs)
                   if state[k].dtype != specs[k][0])
    problems = [f"{len(names)} {what}: {names[:5]}" for what, names in
                (("missing", missing), ("not in the engine", extra), ("with another shape", shape),
                 ("with another dtype", dtype)) if names]
    if problems:
        raise WeightSyncError(f"weight sync refused before any weight moved: the state must hold the engine's "
                              f"{len(specs)} tensors exactly; {'; '.join(problems)}")


def verify_checksums(expected: Mapping[str, str], got: Mapping[str, str]) -> None:
    """Raise :class:`WeightSyncError` unless ``got`` and ``expected`` hold the same names with equal
    checksums: ``got`` is the engine's checksums of every parameter, so an engine tensor that the
    trainer did not send counts as differing, and so does a sent name the engine did not report."""
    bad = sorted(k for k in set(expected) | set(got) if got.get(k) != expected.get(k))
    if bad:
        raise WeightSyncError(f"{len(bad)} tensors differ after weight sync (or are on one side only): {bad[:10]}")
