"""Native logprob (region ``logprob``): ``torch.log_softmax`` of fp32 logits over the temperature,
whose reduction order ATen chooses from the shape and thread count."""

from __future__ import annotations

import torch


def native_logprob(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``torch.log_softmax`` of fp32 logits divided by the temperature."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)
