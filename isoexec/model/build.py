"""Build a randomly initialised unified model from an experiment's ``model`` section (no network)."""

from __future__ import annotations

import torch

from isoexec.kernels import build_kernel_set
from isoexec.model.hf import hf_config
from isoexec.model.unified import UnifiedModel


def random_model(section, kernels_section=None, kernel_set: str = "isoexec", vocab_size: int | None = None,
                 seed: int = 0, dtype: torch.dtype | None = None, device: str = "cpu") -> UnifiedModel:
    """A unified model with HF-style random init (normal(0, init_std) matrices, zero-centred norms,
    ``A_log = log U(1, 16)``, ``dt_bias = 1``), deterministic in ``seed``.

    Args:
        section: ``isoexec.config.ModelSection``. kernels_section: ``KernelSection`` (defaults if None).
        kernel_set: ``"isoexec"`` or ``"native"``. vocab_size: as :func:`isoexec.model.hf.hf_config`.
        dtype: parameter dtype (default ``section.dtype``). device: ``"cpu"`` or ``"cuda"``.
    """
    cfg = hf_config(section, vocab_size)
    dtype = dtype or getattr(torch, section.dtype)
    model = UnifiedModel.from_config(cfg, build_kernel_set(kernel_set, device, kernels_section), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * section.init_std)
    return model.to(dtype).to(device)
