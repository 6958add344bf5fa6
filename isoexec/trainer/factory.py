"""The trainer of a (backend, mode) pair: ``trainer.backend`` picks the implementation, the mode picks
its kernel set.

- ``hf``: :class:`isoexec.trainer.hf_policy.HFPolicy` (transformers ``Qwen3NextForCausalLM`` with its
  own kernels; native mode only), parameters in the checkpoint dtype.
- ``unified``: :class:`isoexec.model.UnifiedModel` with the ``native`` or ``isoexec`` kernel set and
  the experiment's kernel constants.
"""

from __future__ import annotations

from pathlib import Path

from isoexec.config import ExperimentConfig


def load_trainer(config: ExperimentConfig, mode: str, checkpoint: str | Path):
    """The trainer policy of ``mode`` loaded from ``checkpoint``.

    Raises:
        ValueError: an unknown mode, or a backend that cannot run the mode (naming both).
    """
    if mode not in ("native", "isoexec"):
        raise ValueError(f"mode must be 'native' or 'isoexec', got {mode!r}")
    backend = config.trainer.backend_for(mode)
    if backend == "hf":
        if mode != "native":
            raise ValueError(f"trainer.backend='hf' cannot run mode {mode!r} (transformers' own kernels only)")
        from isoexec.trainer.hf_policy import HFPolicy

        return HFPolicy.from_pretrained(checkpoint, temperature=config.kernels.temperature)
    if backend == "unified":
        from isoexec.model import UnifiedModel

        return UnifiedModel.from_pretrained(checkpoint, kernel_set=mode, kernels=config.kernels, device=config.device)
    raise ValueError(f"unknown trainer.backend={backend!r}; allowed: 'hf', 'unified'")
