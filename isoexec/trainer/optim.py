"""Mixed-precision AdamW with fp32 master weights, shared by both trainers.

The model's parameters stay in their compute dtype (bf16 for the checkpoints here); this optimizer
keeps an fp32 master copy of each, steps AdamW on the masters with the fp32-cast gradients, and
writes the rounded masters back into the model. The weights sent to the engine are therefore the
model's parameters themselves (``bf16(master)``), identical in both modes for identical updates.

Both trainers expose their parameters under the Hugging Face names (``named_parameters()``), so one
optimizer instance type updates the transformers model and the unified model alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


class MasterAdamW:
    """AdamW on fp32 master copies of ``named_params``, with global grad-norm clipping.

    Args:
        named_params: ``(name, parameter)`` pairs; parameters of any float dtype, ``requires_grad``.
        lr, betas, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay).
        max_grad_norm: clip the global L2 norm of the gradients to this value (<= 0: no clipping).
        grad_of: where a parameter's gradient lives (default ``p.grad``; Megatron keeps it in
            ``p.main_grad``).
        norm_of: the global L2 norm of ``{name: fp32 gradient}`` (default: of these tensors; a sharded
            trainer passes its collective over the parallel ranks).
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None] = lambda p: p.grad,
        norm_of: Callable[[dict[str, torch.Tensor]], float] | None = None,
    ):
        self.params = dict(named_params)
        self.grad_of, self.norm_of = grad_of, norm_of
        for p in self.params.values():
            p.requires_grad_(True)
        self.master = {n: p.detach().to(torch.float32).clone() for n, p in self.params.items()}
        self.opt = torch.optim.AdamW(
            list(self.master.values()), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )
        self.max_grad_norm = max_grad_norm
        self.updates = 0

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following updates (a schedule is the caller's business)."""
        for group in self.opt.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> float:
        """One update from the gradients accumulated on the model's parameters.

        Returns:
            The global gradient L2 norm before clipping (``nan``/``inf`` skips the update, which then
            does not count in ``updates``).
        """
        grads = {n: (g.to(torch.float32) if (g := self.grad_of(p)) is not None else None) for n, p in self.params.items()}
        present = {n: g for n, g in grads.items() if g is not None}
        norm = 0.0
        if self.norm_of is not None:
            norm = float(self.norm_of(present))
        elif present:
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present.values()])))
        if not math.isfinite(norm):
            self.zero_grad()
            return norm
        scale = min(1.0, self.max_grad_norm / (norm + 1e-6)) if self.max_grad_norm > 0 else 1.0
        for n, m in self.master.items():
            g = grads[n]
            m.grad = None if g is None else g * scale
        self.opt.step()
        self.updates += 1
        for n, p in self.params.items():
            p.copy_(self.master[n].to(p.dtype))
            self.master[n].grad = None
        self.zero_grad()
        return norm

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """The model's current parameters (compute dtype, HF names), detached: what the engine loads."""
        return {n: p.detach() for n, p in self.params.items()}


def warmup_lr(lr: float, warmup_updates: int, updates: int) -> float:
    """Learning rate of the next update under a linear warm-up: ``lr * min(1, (updates + 1) / warmup_updates)``.

    Args:
        lr: the peak learning rate (``rl.lr``).
        warmup_updates: updates to reach it (``rl.warmup_updates``; 0 or 1: no warm-up).
        updates: updates done so far (``MasterAdamW.updates``).
    """
    return lr * min(1.0, (updates + 1) / max(1, warmup_updates))

