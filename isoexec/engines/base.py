"""What every rollout engine returns and offers (the RL loop and the rollout check are written
against these): :class:`Completion` and the :class:`Engine` protocol.

Implementations: :class:`isoexec.engines.vllm_engine.RolloutEngine` (vLLM, native or isoexec model)
and :class:`isoexec.engines.local.LocalEngine` (plain PyTorch sampling from a trainer policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Completion:
    """One sampled response.

    Attributes:
        token_ids: the sampled token ids, in order, EOS included when generated.
        logprobs: ``[R]`` float32, the engine's logprob of each sampled token (R = len(token_ids)).
        full_logprobs: ``[R, V]`` float32, the engine's full-vocabulary logprob row at each sampled
            position, or None when not requested / not provided.
        finish_reason: why sampling stopped (``"length"``, ``"stop"``) where the engine says.
    """

    token_ids: list[int]
    logprobs: torch.Tensor
    full_logprobs: torch.Tensor | None = None
    finish_reason: str | None = None


class Engine(Protocol):
    load_checksums: Mapping[str, str]
    """Checksums (HF names, ``weight_sync.tensor_checksum``) of the weights the engine holds after loading,
    compared with the trainer's before a paired run starts (``weight_sync.check_weights_at_load``)."""

    def generate(
        self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, seed: int, temperature: float
    ) -> list[list[Completion]]:
        """``n`` samples for each prompt (outer list: prompts in order; inner: the n samples)."""
        ...

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], trainer_contract: Any) -> Any:
        """Load the trainer's weights (HF names, compute dtype); verify; ``trainer_contract`` None in native mode."""
        ...
