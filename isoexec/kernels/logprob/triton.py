"""Full-vocabulary logprob in Triton (region ``logprob``).

One program per row: fp32 logits divided by the temperature, one pass over fixed vocabulary blocks
of ``vocab_block`` entries from block 0 upwards with an online (max, sum) update
(``s = s * exp(m - m') + sum(exp(z - m'))``, block sums by ``tl.sum`` on a fixed tree), then a
second pass writes ``logp = (z - m) - log(s)``. The order depends on V and the block size only, so
a row's bits depend on that row alone.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from isoexec.kernels.autograd import with_ref_grad
from isoexec.kernels.logprob.native import native_logprob


@triton.jit(do_not_specialize=["V"])
def _logprob_kernel(x_ptr, y_ptr, V, inv_t, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * V
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        z = tl.load(x_ptr + base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    ls = tl.log(s)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        z = tl.load(x_ptr + base + offs, mask=offs < V, other=0.0).to(tl.float32) / temperature
        tl.store(y_ptr + base + offs, (z - m) - ls, mask=offs < V)


def logprob(logits: torch.Tensor, temperature: float, vocab_block: int) -> torch.Tensor:
    """Batch-invariant log-softmax of ``logits / temperature``.

    Args:
        logits: ``[N, V]`` (any float dtype, read as fp32). temperature: > 0. vocab_block: block size (power of 2).

    Returns:
        ``[N, V]`` fp32.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    x = logits.contiguous()
    n, v = x.shape
    y = torch.empty((n, v), device=x.device, dtype=torch.float32)
    if n:
        _logprob_kernel[(n,)](x, y, v, 1.0 / temperature, float(temperature), BLOCK=vocab_block,
                              num_warps=8 if vocab_block >= 2048 else 4)
    return y


def logprob_autograd(logits: torch.Tensor, temperature: float, vocab_block: int) -> torch.Tensor:
    """:func:`logprob` whose gradient is ``log_softmax``'s (:func:`isoexec.kernels.logprob.native.native_logprob`)."""
    return with_ref_grad(lambda z: logprob(z, temperature, vocab_block), partial(native_logprob, temperature=temperature),
                         logits)
