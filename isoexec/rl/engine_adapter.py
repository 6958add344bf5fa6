"""Adapt ``isoexec.engines.vllm_engine.RolloutEngine`` to the RL loop's :class:`~isoexec.rl.interfaces.Engine`.

The engine returns a flat list of ``Sample`` (numpy arrays) ordered by (prompt, sample); the loop
wants, per prompt, the list of its n :class:`~isoexec.rl.interfaces.Completion` (torch float32).
Full-vocabulary rows are requested for every prompt (``full_vocab_every=1``): the vocabulary of the
embedded default is 64 tokens, so they cost little, and the loop samples positions from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from isoexec.config import ExperimentConfig
from isoexec.rl.interfaces import Completion


class VLLMEngine:
    """The vLLM rollout engine of ``mode`` on ``checkpoint`` (in-process ``vllm.LLM``).

    Args:
        full_vocab_every: passed to ``RolloutEngine.generate`` (1: full rows for every prompt; 0: none).
    """

    def __init__(self, checkpoint: str | Path, mode: str, config: ExperimentConfig, seed: int = 0,
                 full_vocab_every: int = 1):
        from isoexec.engines.vllm_engine import RolloutEngine, vllm_env_defaults

        vllm_env_defaults()
        self.engine = RolloutEngine(checkpoint, mode, config.engine, config.kernels, seed=seed)
        self.full_vocab_every = full_vocab_every
        self.last_sync: dict[str, Any] = {}

    def generate(self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, seed: int,
                 temperature: float) -> list[list[Completion]]:
        samples = self.engine.generate(prompt_token_ids, n=n, max_tokens=max_tokens, seed=seed,
                                       temperature=temperature, full_vocab_every=self.full_vocab_every)
        out: list[list[Completion]] = [[None] * n for _ in prompt_token_ids]  # type: ignore[list-item]
        for s in samples:
            rows = None if s.full_rows is None else torch.from_numpy(s.full_rows).to(torch.float32)
            out[s.prompt_index][s.sample_index] = Completion(
                list(s.token_ids), torch.from_numpy(s.logprobs).to(torch.float32), rows
            )
        if any(c is None for group in out for c in group):
            raise RuntimeError("the engine returned fewer samples than requested")
        if any(c.full_logprobs is None for group in out for c in group):
            for group in out:  # partial rows are of no use to the loop's position sampling
                for c in group:
                    c.full_logprobs = None
        return out

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], trainer_contract: Any) -> None:
        self.engine.sync_weights(state_dict, trainer_contract)

    def shutdown(self) -> None:
        self.engine.shutdown()
