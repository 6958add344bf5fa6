"""Batch-invariant full-vocabulary logprob on CPU (region ``logprob``): one function for every case
and both runtimes.

fp32 logits, temperature applied to the logits before the softmax (``z = x / T``), max by
``amax`` (exact), ``sum(exp(z - m))`` over fixed vocabulary blocks of ``vocab_block`` entries (fixed
tree inside a block, fixed tree across blocks), ``logp = (z - m) - log(sum)``. Every row's bits
depend on that row alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isoexec.kernels.primitives import tree_sum


def iso_logprob(logits: torch.Tensor, temperature: float, vocab_block: int) -> torch.Tensor:
    """Batch-invariant log-softmax.

    Args:
        logits: ``[N, V]`` (cast to fp32). temperature: > 0. vocab_block: entries per reduction block.

    Returns:
        ``[N, V]`` fp32 logprobs. Raises ValueError for a non-positive temperature.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    z = logits.float() / temperature
    m = z.amax(dim=-1, keepdim=True)
    zm = z - m
    e = torch.exp(zm)
    n, v = e.shape
    pad = (-v) % vocab_block
    if pad:
        e = F.pad(e, (0, pad))
    block_sums = tree_sum(e.reshape(n, -1, vocab_block), dim=-1)  # [N, nblocks]
    s = tree_sum(block_sums, dim=-1, keepdim=True)
    return zm - torch.log(s)
