"""The arms of a paired run and the order the paired job runs them in.

An arm is a named way of training: each mode of ``rl.modes`` is an arm of its own name (``native``:
each side its framework's kernels; ``isoexec``: the unified model's kernels under the contract), and
each entry of the experiment's ``arms`` section is one more, the stack of its ``mode`` trained with
SkyRL's off-policy correction (``trainer.algorithm.off_policy_correction``: truncated importance
sampling of the trainer/rollout ratio, or sequence masking; SkyRL's ``apply_off_policy_correction``
in ``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py`` applies it inside the policy
loss). An arm's runs go to ``results/<exp>/rl/<arm>/seed<k>/``; the tables and figures have one row
or line per arm.

The paired job (:func:`schedule`) runs every (arm, seed) in one process, seed after seed, each seed's
arms back to back, so that a drift of the machine lands on every arm of a seed alike; the arms' order
turns by one place from one seed to the next, so that no arm always runs first or last.
"""

from __future__ import annotations

from dataclasses import dataclass

from isoexec.config import ExperimentConfig, OffPolicyCorrection

PREFIX = "trainer.algorithm.off_policy_correction."


@dataclass(frozen=True)
class Arm:
    """One arm: ``name`` (folder and table row), the ``mode`` whose stack it runs (``native`` |
    ``isoexec``) and its off-policy correction (None: the mode's own arm, no correction)."""

    name: str
    mode: str
    correction: OffPolicyCorrection | None = None

    def skyrl_overrides(self) -> dict[str, object]:
        """SkyRL's ``trainer.algorithm.off_policy_correction.*`` overrides of this arm: every field of
        the correction, or, for a mode's own arm, TIS and sequence masking off (SkyRL's defaults, written
        out so that the rendered config says it)."""
        if self.correction is None:
            return {f"{PREFIX}tis_ratio_type": None, f"{PREFIX}sequence_mask_metric": None}
        return {f"{PREFIX}{k}": v for k, v in self.correction.model_dump().items()}


def arms(cfg: ExperimentConfig) -> list[Arm]:
    """Every arm of the experiment: ``rl.modes`` in order, then the ``arms`` section in order."""
    return [Arm(m, m) for m in cfg.rl.modes] + [Arm(a.name, a.mode, a.off_policy_correction) for a in cfg.arms]


def arm_names(cfg: ExperimentConfig) -> list[str]:
    """The names of :func:`arms` (the folders under ``results/<exp>/rl/``)."""
    return [a.name for a in arms(cfg)]


def find_arm(cfg: ExperimentConfig, name: str) -> Arm:
    """The arm called ``name``.

    Raises:
        ValueError: no arm has that name (the message lists the experiment's arms).
    """
    for a in arms(cfg):
        if a.name == name:
            return a
    raise ValueError(f"arm {name!r} is not an arm of experiment {cfg.name!r}; its arms: {', '.join(arm_names(cfg))}")


def schedule(cfg: ExperimentConfig) -> list[tuple[Arm, int]]:
    """The (arm, seed) runs of the paired job in the order it runs them.

    Seeds in ``rl.seeds`` order; within the i-th seed every arm once, in :func:`arms` order turned
    left by i places (three arms A, B, C and seeds 0, 1, 2: A0 B0 C0, B1 C1 A1, C2 A2 B2).
    """
    all_arms = arms(cfg)
    out = []
    for i, seed in enumerate(cfg.rl.seeds):
        k = i % len(all_arms)
        out += [(a, seed) for a in all_arms[k:] + all_arms[:k]]
    return out
