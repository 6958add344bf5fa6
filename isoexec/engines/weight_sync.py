"""Trainer -> engine weights: the same tensors on both sides, at load and after every sync.

Before any weight moves, the state must be a set of named tensors without duplicates
(:func:`named_tensors`) that covers the engine's whole parameter set, each tensor with the engine's
dtype and shape (:func:`check_state_covers`): a partial state would leave the engine on a mix of old
and new weights while the checksums of the tensors sent still agree. After the sync, both sides hash
every tensor with :func:`tensor_checksum`, and the engine's checksums of every Hugging Face parameter
name must equal the trainer's (:func:`verify_checksums`). At load, before a paired run starts, the
same compare runs on what each side loaded (:func:`check_weights_at_load`), so that no run starts
from weights the two sides read differently. Between two checked updates, :class:`WeightSentinel`
notices any in-place write or storage swap of the engine's tensors that bumps their version counter.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import torch

from isoexec.model.hf import TensorSpec

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


class WeightUpdateRefused(WeightSyncError):
    """A weight-update entry of vLLM that isoexec does not take (the message names the one it takes)."""


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


def verify_checksums(expected: Mapping[str, str], got: Mapping[str, str], when: str = "after weight sync") -> None:
    """Raise :class:`WeightSyncError` unless ``got`` and ``expected`` hold the same names with equal
    checksums: ``got`` is the engine's checksums of every parameter, so an engine tensor that the
    trainer did not send counts as differing, and so does a sent name the engine did not report."""
    bad = sorted(k for k in set(expected) | set(got) if got.get(k) != expected.get(k))
    if bad:
        raise WeightSyncError(f"{len(bad)} tensors differ {when} (or are on one side only): {bad[:10]}")


def checksums_digest(checksums: Mapping[str, str]) -> dict[str, object]:
    """``{"tensors": n, "sha256": ...}``: one digest over a side's per-tensor checksums (sorted by name), as a
    paired run's provenance records the weights each side held at load."""
    h = hashlib.sha256("\n".join(f"{k}={v}" for k, v in sorted(checksums.items())).encode())
    return {"tensors": len(checksums), "sha256": h.hexdigest()}


def check_weights_at_load(engine: Mapping[str, str], trainer: Mapping[str, str]) -> dict[str, dict]:
    """Refuse a paired run whose engine and trainer hold different weights at load.

    Args:
        engine: the engine's checksums of the weights it holds after loading (``RolloutEngine.load_checksums``).
        trainer: the trainer's, of what it loaded (:func:`state_checksums` of ``sync_state``), same naming.

    Returns:
        ``{"engine": checksums_digest(engine), "trainer": checksums_digest(trainer)}``, for the provenance.

    Raises:
        WeightSyncError: naming the tensors that differ or that one side lacks ("at load").
    """
    verify_checksums(trainer, engine, when="between the engine and the trainer at load")
    return {"engine": checksums_digest(engine), "trainer": checksums_digest(trainer)}


def named_tensors(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors of a state dict or of a sequence of ``(name, tensor)`` pairs, as a dict, refusing what a dict
    would hide or what is not a named tensor.

    Raises:
        WeightSyncError: a name that appears more than once (every duplicate named, detected before the
            pairs collapse into a dict), an item that is not a ``(str, Tensor)`` pair, or a value that is
            not a tensor (its type named).
    """
    items = state.items() if isinstance(state, Mapping) else state
    out: dict[str, torch.Tensor] = {}
    dup: list[str] = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightSyncError(f"weight sync refused before any weight moved: item {i} is {type(item).__name__} "
                                  f"{item!r:.60}, not a (name, tensor) pair")
        name, t = item
        if not isinstance(t, torch.Tensor):
            raise WeightSyncError(f"weight sync refused before any weight moved: {name} is a {type(t).__name__}, "
                                  "not a tensor")
        if name in out:
            dup.append(name)
        out[name] = t
    if dup:
        names = sorted(set(dup))
        raise WeightSyncError(f"weight sync refused before any weight moved: {len(names)} names appear more than "
                              f"once: {names[:10]} (a state sends each tensor once)")
    return out


class WeightSentinel:
    """Notices a write to, or a swap of, any of a model's tensors after a checked load or update.

    Records each tensor's storage pointer and version counter (``Tensor._version``, bumped by every
    in-place op on the tensor, ``copy_`` included). :meth:`changed` is cheap (no data read), so it can run
    before every forward. Writes through ``.data`` do not bump the counter (PyTorch keeps ``.data``
    outside autograd's accounting): those are caught by the full checksum compare that runs before every
    checked update and by ``checksums()``.
    """

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        self._items = [(k, t, t.data_ptr(), t._version) for k, t in named.items()]

    def changed(self) -> list[str]:
        """Names of the tensors written in place or given another storage since construction."""
        return [k for k, t, ptr, ver in self._items if t.data_ptr() != ptr or t._version != ver]
