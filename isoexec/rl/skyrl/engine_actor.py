"""isoexec's vLLM rollout engine in its own process (a Ray actor), for SkyRL to drive.

This module imports nothing from ``skyrl``: SkyRL's entry points patch vLLM in-process when they are
imported (:mod:`isoexec.rl.skyrl.compat`, item 4), so the engine must live in a process that never
imports them. SkyRL talks to it through :class:`isoexec.rl.skyrl.client.IsoExecInferenceClient`.

:class:`EngineActor` wraps :class:`isoexec.engines.vllm_engine.RolloutEngine` (``native`` or
``isoexec``) and adds what a SkyRL run needs:

- one sampling seed per ``generate`` call, ``generation_seed(run seed, call index)`` (shifted per
  data-parallel shard, :func:`shard_seed`): the same sequence in both modes of a paired run (the
  plain loop seeds by step; here the call index is the step unless dynamic sampling asks for more
  batches);
- full-vocabulary rows of the sampled positions kept until fetched, keyed by the token content
  ``(prompt ids, response ids)``, for the ``full_vocab_kl`` metric (``keep_rows``);
- the weight sync with the contract handshake: :meth:`update_weights` hands the tensors and the
  trainer's contract to ``RolloutEngine.sync_weights`` (handshake before any weight moves);
- :meth:`restart`: the next run of a session (:class:`isoexec.rl.skyrl.driver.Session`) in the same
  process, the engine rebuilt only when its mode or settings change.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import numpy as np


def shard_seed(seed: int, call: int, shard: int) -> int:
    """Sampling seed of data-parallel engine ``shard`` for ``generate`` call ``call`` of run ``seed``.

    Shard 0 draws the plain loop's ``generation_seed(seed, call)``; shard ``i`` shifts it by
    ``i * 1_000_033`` (mod 2**31 - 1), so that shards holding copies of one prompt sample
    independently.
    """
    from isoexec.rl.loop import generation_seed

    return (generation_seed(seed, call) + shard * 1_000_033) % (2**31 - 1)


class EngineActor:
    """A ``RolloutEngine`` of ``mode`` on ``checkpoint`` (use as ``ray.remote(num_cpus=0)(EngineActor)``).

    Args:
        checkpoint: Hugging Face checkpoint directory (config, weights, tokenizer).
        mode: ``"native"`` or ``"isoexec"``.
        config_json: the experiment config (``ExperimentConfig.model_dump_json()``); its ``engine``
            and ``kernels`` sections configure the engine (isoexec: the engine's contract).
        seed: run seed (engine seed and per-call sampling seeds).
        keep_rows: keep full-vocabulary rows of the last ``generate`` (for ``full_vocab_kl``).
        threads: torch intra-op threads in this process.
        shard: index of this engine among the run's data-parallel engines (its sampling seeds,
            :func:`shard_seed`).
    """

    def __init__(self, checkpoint: str, mode: str, config_json: str, seed: int, keep_rows: bool, threads: int = 1,
                 shard: int = 0):
        import torch

        from isoexec.engines.vllm_engine import vllm_env_defaults

        torch.set_num_threads(threads)
        vllm_env_defaults()
        self.checkpoint, self.shard, self.keep_rows = checkpoint, shard, keep_rows
        self.engine = None
        self.restart(mode, config_json, seed)

    def restart(self, mode: str, config_json: str, seed: int) -> None:
        """Prepare for a new run (``mode``, experiment ``config_json``, ``seed``) on the same checkpoint.

        The engine is rebuilt when the mode, or the experiment's ``engine`` or ``kernels`` section, differs
        from the running engine's (the old one is shut down first: one in-process vLLM engine at a time,
        :meth:`isoexec.engines.vllm_engine.RolloutEngine.shutdown`); otherwise it is kept. Either way the
        call count starts again at 0 (the sampling seeds of :func:`shard_seed` depend only on the run seed
        and the call), the kept rows are dropped, and the run's first weight sync gives the engine the
        trainer's weights before any generation.
        """
        from isoexec.config import ExperimentConfig
        from isoexec.engines.vllm_engine import RolloutEngine

        cfg = ExperimentConfig.model_validate(json.loads(config_json))
        key = (mode, cfg.engine, cfg.kernels)
        if self.engine is None or key != self._engine_key:
            if self.engine is not None:
                self.engine.shutdown()
                self.engine = None
                gc.collect()
            self.engine = RolloutEngine(self.checkpoint, mode, cfg.engine, cfg.kernels, seed=seed)
            self._engine_key = key
        self.seed = seed
        self.calls = 0
        self.rows: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}

    def info(self) -> dict[str, Any]:
        """``mode``, ``vocab_size``, the engine contract (canonical JSON, None in native mode) and the
        checksums of the weights the engine held at load (``RolloutEngine.load_checksums``)."""
        from isoexec.contract import encode

        c = self.engine.contract
        return {"mode": self.engine.mode, "vocab_size": self.engine.vocab_size,
                "contract": None if c is None else encode(c), "load_checksums": self.engine.load_checksums}

    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int, temperature: float) -> dict[str, Any]:
        """One sample per prompt, all prompts submitted together.

        Returns:
            ``response_ids`` (lists of ints), ``logprobs`` (lists of float32 values as Python floats,
            exact), ``stop_reasons`` (``"stop"`` or ``"length"``), ``seed`` (the sampling seed used).
        """
        seed = shard_seed(self.seed, self.calls, self.shard)
        self.calls += 1
        groups = self.engine.generate(prompt_token_ids, n=1, max_tokens=max_tokens, seed=seed,
                                      temperature=temperature, full_vocab_every=1 if self.keep_rows else 0)
        samples = [group[0] for group in groups]  # one Completion per prompt (n=1)
        if self.keep_rows:
            for prompt, c in zip(prompt_token_ids, samples):
                self.rows[(tuple(prompt), tuple(c.token_ids))] = c.full_logprobs.numpy()
        return {
            "response_ids": [list(map(int, c.token_ids)) for c in samples],
            "logprobs": [c.logprobs.tolist() for c in samples],
            "stop_reasons": [c.finish_reason for c in samples],
            "seed": seed,
        }

    def full_rows(self, keys: list[tuple[list[int], list[int]]]) -> list[np.ndarray | None]:
        """The ``[R, V]`` float32 rows kept since the last call for each ``(prompt ids, response ids)``
        (None where none was kept), then forgets them all."""
        rows, self.rows = self.rows, {}
        return [rows.get((tuple(p), tuple(r))) for p, r in keys]

    def update_weights(self, payload: bytes, trainer_contract: bytes | None) -> dict[str, str]:
        """Weight sync: safetensors ``payload`` (HF names) after the contract handshake with
        ``trainer_contract`` (canonical JSON bytes; None in native mode).

        Raises:
            isoexec.contract.ContractMismatch: the trainer's contract differs (isoexec mode), before
                any weight moves.
            ValueError: isoexec mode without a trainer contract.
            isoexec.engines.weight_sync.WeightSyncError: checksums differ after the sync.
        """
        from safetensors.torch import load

        from isoexec.contract import decode

        contract = None if trainer_contract is None else decode(trainer_contract)
        return self.engine.sync_weights(load(payload), contract)

    def shutdown(self) -> None:
        self.engine.shutdown()
