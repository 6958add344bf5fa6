"""What the RL loop needs from a trainer (the :class:`Policy` protocol), and the tensors a weight
sync sends (:func:`sync_state`).

Implementations: :class:`isoexec.trainer.hf_policy.HFPolicy` (transformers) and
:class:`isoexec.model.UnifiedModel` (the unified model with the isoexec or native kernel set).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch


class Policy(Protocol):
    def trainer_logprobs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, grad: bool) -> torch.Tensor:
        """``[T, V]`` float32 full-vocabulary logprobs of packed sequences; row t predicts token t+1."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters under their Hugging Face names."""
        ...

    def contract(self) -> Any:
        """The trainer's execution contract (None for a trainer without one)."""
        ...


def sync_state(policy) -> dict[str, torch.Tensor]:
    """The tensors to send to the engine, under checkpoint names, detached, in the compute dtype."""
    if hasattr(policy, "checkpoint_state_dict"):
        return policy.checkpoint_state_dict()
    return {n: p.detach() for n, p in policy.named_parameters()}
