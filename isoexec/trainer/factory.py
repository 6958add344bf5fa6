"""The trainer of a (backend, mode) pair: ``trainer.backend`` picks the implementation, the mode picks
its kernel set.

- ``hf``: :class:`isoexec.trainer.hf_policy.HFPolicy` (transformers ``Qwen3NextForCausalLM`` with its
  own kernels; native mode only), parameters in the checkpoint dtype.
- ``unified``: :class:`isoexec.model.UnifiedModel` with the ``native`` or ``isoexec`` kernel set and
  the experiment's kernel constants.
- ``megatron``: this rank's :class:`isoexec.trainer.megatron.trainer.MegatronTrainer` on the layout of
  ``trainer.tp`` / ``ep`` / ``sp`` (kernel set of the mode, AdamW settings of ``rl``); every rank of the
  group calls it (SkyRL's worker group, :class:`isoexec.rl.skyrl.worker.IsoExecPolicyWorker`).
"""

from __future__ import annotations

from pathlib import Path

from isoexec.config import ExperimentConfig


def load_trainer(config: ExperimentConfig, mode: str, checkpoint: str | Path):
    """The trainer policy of ``mode`` loaded from ``checkpoint``.

    Raises:
        ValueError: an unknown mode, a backend that cannot run the mode (naming both), or ``megatron``
            in a process that has not joined a ``torch.distributed`` group of the layout's world size.
        isoexec.contract.ClaimViolation: ``megatron`` in isoexec mode on a layout outside the contract's
            topology claim.
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
    if backend == "megatron":
        import torch.distributed as dist

        from isoexec.trainer.megatron.launch import init_parallel
        from isoexec.trainer.megatron.trainer import MegatronTrainer

        layout = config.trainer.layout()
        if not dist.is_initialized():
            raise ValueError(f"trainer.backend='megatron' ({layout}) is built on each of {layout.world_size} "
                             "ranks of a torch.distributed group: run it through the SkyRL driver "
                             "(rl.driver: skyrl), which starts the ranks")
        init_parallel(layout)
        rl = config.rl
        return MegatronTrainer.from_pretrained(checkpoint, layout, kernel_set=mode, kernels=config.kernels, lr=rl.lr,
                                               weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm)
    raise ValueError(f"unknown trainer.backend={backend!r}; allowed: 'hf', 'unified', 'megatron'")
