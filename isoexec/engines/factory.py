"""The rollout engine of an experiment: ``engine.backend`` picks the implementation, the mode picks the
model it runs (vLLM's built-in model for native, the unified model with the contract for isoexec)."""

from __future__ import annotations

from pathlib import Path

from isoexec.config import ExperimentConfig


def load_engine(config: ExperimentConfig, mode: str, checkpoint: str | Path, seed: int = 0):
    """The engine of ``config.engine.backend`` in ``mode`` on ``checkpoint``.

    - ``vllm``: :class:`isoexec.engines.vllm_engine.RolloutEngine` returning full-vocabulary rows for
      every prompt (the RL loop's full-vocabulary KL samples positions from them).
    - ``local``: :class:`isoexec.engines.local.LocalEngine` over a second copy of the mode's trainer
      (:func:`isoexec.trainer.factory.load_trainer`); EOS from the checkpoint's config.

    Raises:
        ValueError: an unknown backend or mode.
    """
    backend = config.engine.backend
    if backend == "vllm":
        from isoexec.engines.vllm_engine import RolloutEngine, vllm_env_defaults

        vllm_env_defaults()
        return RolloutEngine(checkpoint, mode, config.engine, config.kernels, seed=seed, full_vocab_every=1)
    if backend == "local":
        from isoexec.engines.local import LocalEngine
        from isoexec.model.hf import read_config
        from isoexec.trainer.factory import load_trainer

        return LocalEngine(load_trainer(config, mode, checkpoint), int(read_config(checkpoint).eos_token_id))
    raise ValueError(f"unknown engine.backend={backend!r}; allowed: 'vllm', 'local'")
