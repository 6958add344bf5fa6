"""SkyRL's advantage estimator and policy loss for the in-process loop (:mod:`isoexec.rl.loop`).

The loop uses the same functions as the SkyRL driver, looked up by the experiment's names in SkyRL's
registries (``skyrl/backends/skyrl_train/utils/ppo_utils.py``: ``AdvantageEstimatorRegistry``,
``PolicyLossRegistry``), with SkyRL's ``AlgorithmConfig`` built from the same overrides the driver
renders (:func:`isoexec.rl.skyrl.render.algorithm_overrides`), and SkyRL's loss reduction applied
the way its trainer does (advantages pre-scaled per mini-batch by
``apply_loss_reduction_to_advantages_minibatch``, the loss then summed over masked tokens).
"""

from __future__ import annotations

import numpy as np
import torch

from isoexec.config import ExperimentConfig
from isoexec.rl.arms import Arm
from isoexec.rl.skyrl import compat

compat.install()  # before the first skyrl import (compat item 1)

from skyrl.backends.skyrl_train.utils.ppo_utils import (  # noqa: E402
    AdvantageEstimatorRegistry,
    PolicyLossRegistry,
    apply_loss_reduction_to_advantages_minibatch,
)
from skyrl.train.config.config import AlgorithmConfig  # noqa: E402

PREFIX = "trainer.algorithm."


def algorithm_config(exp: ExperimentConfig, arm: Arm | None = None) -> AlgorithmConfig:
    """SkyRL's ``AlgorithmConfig`` of the experiment and arm (the ``trainer.algorithm.*`` overrides the driver
    renders; ``arm``: its off-policy correction, :meth:`isoexec.rl.arms.Arm.skyrl_overrides`)."""
    from omegaconf import OmegaConf

    from isoexec.rl.skyrl.render import algorithm_overrides

    nested: dict = {}
    for key, value in {**algorithm_overrides(exp), **(arm.skyrl_overrides() if arm else {})}.items():
        if key.startswith(PREFIX):
            *parents, leaf = key[len(PREFIX):].split(".")
            d = nested
            for p in parents:
                d = d.setdefault(p, {})
            d[leaf] = value
    return AlgorithmConfig.from_dict_config(OmegaConf.create(nested))


def sequence_advantages(rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    """Per-response advantages from SkyRL's estimator ``cfg.advantage_estimator`` (outcome rewards).

    Args:
        rewards: ``[P, G]`` float, G responses for each of P prompts.
        cfg: from :func:`algorithm_config`.

    Returns:
        ``[P * G]`` float32, prompt-major (SkyRL's GRPO: ``(r - mean) / (sample std + 1e-6)`` per group).
    """
    P, G = rewards.shape
    est = AdvantageEstimatorRegistry.get(cfg.advantage_estimator)
    adv, _ = est(token_level_rewards=rewards.reshape(P * G, 1).float(), response_mask=torch.ones(P * G, 1),
                 index=np.repeat(np.arange(P), G), grpo_norm_by_std=cfg.grpo_norm_by_std, gamma=1.0, lambd=1.0,
                 values=None, config=cfg)
    return adv[:, 0].float()


def policy_loss(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                rollout: torch.Tensor, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """SkyRL's ``cfg.policy_loss_type`` over one mini-batch, reduced by ``cfg.loss_reduction``.

    Args:
        logp: ``[B, R]`` float32 current logprobs of the response tokens (autograd).
        old: ``[B, R]`` pre-update trainer logprobs; rollout: ``[B, R]`` the engine's.
        advantages: ``[B, R]`` each token's response advantage.
        mask: ``[B, R]`` float, 1 on response tokens.
        cfg: from :func:`algorithm_config`.

    Returns:
        ``(loss, metrics)`` as SkyRL's loss returns them (``metrics["clip_ratio"]`` for ``regular``; with an
        off-policy correction in ``cfg`` also its statistics, e.g. ``tis_token_clip_high_ratio``).
    """
    scaled = apply_loss_reduction_to_advantages_minibatch(advantages, mask, cfg.loss_reduction,
                                                          micro_batch_size=len(advantages), max_seq_len=mask.shape[1])
    return PolicyLossRegistry.get(cfg.policy_loss_type)(logp, old.detach(), scaled, config=cfg, loss_mask=mask,
                                                        rollout_logprobs=rollout)
