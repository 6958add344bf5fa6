"""Load the trainer of a mode, and the tensors a weight sync sends.

- ``native``: :class:`isoexec.trainer.hf_policy.HFPolicy` (transformers ``Qwen3NextForCausalLM``,
  parameters in the checkpoint dtype, logprobs ``log_softmax(logits.float() / T)``).
- ``isoexec``: ``isoexec.model.UnifiedModel.from_pretrained(path, kernel_set="isoexec",
  kernels=config.kernels)`` (the contract's temperature).

Both are updated by :class:`isoexec.trainer.optim.MasterAdamW` through ``named_parameters()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from isoexec.config import ExperimentConfig

Mode = Literal["native", "isoexec"]


def load_policy(mode: Mode, checkpoint: str | Path, config: ExperimentConfig):
    """The trainer of ``mode`` loaded from ``checkpoint`` (parameters in the checkpoint dtype)."""
    if mode == "native":
        from isoexec.trainer.hf_policy import HFPolicy

        return HFPolicy.from_pretrained(checkpoint, temperature=config.rl.temperature)
    if mode == "isoexec":
        from isoexec.model import UnifiedModel

        return UnifiedModel.from_pretrained(checkpoint, kernel_set="isoexec", kernels=config.kernels,
                                            device=config.device)
    raise ValueError(f"mode must be 'native' or 'isoexec', got {mode!r}")


def sync_state(policy) -> dict[str, torch.Tensor]:
    """The tensors to send to the engine, under checkpoint names, detached, in the compute dtype."""
    if hasattr(policy, "checkpoint_state_dict"):
        return policy.checkpoint_state_dict()
    return {n: p.detach() for n, p in policy.named_parameters()}
