"""RMSNorm modules for Megatron's norm slots (``input_layernorm``, ``pre_mlp_layernorm``,
``q_layernorm``, ``k_layernorm``, the GDN ``out_norm`` and the final norm).

Megatron's local norm (``WrappedTorchNorm``, ``torch.nn.RMSNorm``) computes in the input dtype and
has no ``(1 + w)`` scale; Qwen3-Next (transformers ``Qwen3NextRMSNorm``) normalises in fp32 and
scales by ``1 + w`` (zero-centred gamma), except the GDN output norm (``Qwen3NextRMSNormGated``),
which scales by ``w``. Both modules take Megatron's norm constructor arguments
(``config, hidden_size, eps``) and hold one parameter ``weight [hidden_size]``.

The weight is marked ``sequence_parallel`` when the config is: under sequence parallelism each TP
rank normalises its own rows, so Megatron's ``finalize_model_grads`` must all-reduce the norm
weights' gradients over TP (without the mark, TP=2 gradients were off by up to 98%).
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec.kernels import KernelSet


class RMSNorm(nn.Module):
    """transformers' Qwen3-Next RMSNorm with stock torch ops (the ``native`` set).

    Args:
        config: Megatron ``TransformerConfig`` (``params_dtype``, ``sequence_parallel``).
        hidden_size: D, the normalised dim. eps: added to the mean square.
        zero_centered: scale by ``1 + w`` (weight initialised to 0) instead of ``w`` (initialised to 1).

    Forward: ``x [..., D]`` -> same shape and dtype; fp32 math, ``torch.rsqrt`` and ``mean``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, zero_centered: bool = True):
        super().__init__()
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (y * (1.0 + self.weight.float())).type_as(x)
        return self.weight * y.to(x.dtype)


class IsoRMSNorm(RMSNorm):
    """The same norm through a kernel set's region ``norm.rms`` (the ``isoexec`` set).

    Args:
        kernels: the :class:`~isoexec.kernels.KernelSet` (passed as a ``ModuleSpec`` param).
        config, hidden_size, eps, zero_centered: as :class:`RMSNorm`. Only the zero-centred form runs
            here; the GDN output norm (``zero_centered=False``) is applied by the GDN module through the
            region ``gdn.norm`` and only holds its weight.

    Raises:
        RuntimeError: forward of a non-zero-centred instance.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, zero_centered: bool = True, *, kernels: KernelSet):
        super().__init__(config, hidden_size, eps, zero_centered)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            raise RuntimeError("the isoexec GDN output norm is the fused region gdn.norm; call that instead")
        return self.kernels["norm.rms"](x, self.weight, self.eps)
