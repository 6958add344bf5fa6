"""What the RL loop needs from a trainer policy and a rollout engine (structural types).

The loop (:mod:`isoexec.rl.loop`) is written against these Protocols only. Implementations:
trainers :class:`isoexec.trainer.hf_policy.HFPolicy` (native) and ``isoexec.model.UnifiedModel``
(isoexec); engines ``isoexec.engines.vllm_engine.RolloutEngine`` (through
:mod:`isoexec.rl.engine_adapter`) and :class:`isoexec.rl.local_engine.LocalEngine` (plain PyTorch,
for tests).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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
            position, or None when the engine does not provide full rows.
    """

    token_ids: list[int]
    logprobs: torch.Tensor
    full_logprobs: torch.Tensor | None = None


class Engine(Protocol):
    def generate(
        self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, seed: int, temperature: float
    ) -> list[list[Completion]]:
        """``n`` samples for each prompt (outer list: prompts in order; inner: the n samples)."""
        ...

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], trainer_contract: Any) -> None:
        """Load the trainer's weights (HF names, compute dtype); verify; ``trainer_contract`` None in native mode."""
        ...


class Policy(Protocol):
    def trainer_logprobs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, grad: bool) -> torch.Tensor:
        """``[T, V]`` float32 full-vocabulary logprobs of packed sequences; row t predicts token t+1."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters under their Hugging Face names."""
        ...

    def contract(self) -> Any:
        """The trainer's execution contract (None for the native trainer)."""
        ...
