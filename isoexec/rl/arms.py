"""The arms of a paired run and the order the paired job runs them in.

An arm is a named way of training: each mode of ``rl.modes`` is an arm of its own name (``native``:
each side its framework's kernels; ``isoexec``: the unified model's kernels under the contract), and
each entry of the experiment's ``arms`` section is one more, the stack of its ``mode`` trained with
SkyRL's off-policy correction (``trainer.algorithm.off_policy_correction``: truncated importance
sampling of the trainer/rollout ratio, or sequence masking; SkyRL's ``apply_off_policy_correction``
in ``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py`` applies it inside the policy
loss). An arm's runs go to ``results/<exp>/rl/<arm>/seed<k>/``; the tables and figures have one row
or line per arm.

The paired job (:func:`seed_rounds`) runs every (arm, seed) in one process, seed after seed; within a
seed the arms alternate step by step (``rl.interleave: step``: step k of every arm, then step k+1, so that
a slow stretch of the machine lands on neighbouring steps of every arm) or run back to back (``run``).
The arms' order turns by one place from one seed to the next, so that no arm always goes first or last.
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


def seed_rounds(cfg: ExperimentConfig) -> list[tuple[int, list[Arm]]]:
    """Per seed of ``rl.seeds`` (in order), its arms in the order they run: :func:`arms` order turned left
    by i places for the i-th seed (three arms A, B, C and seeds 0, 1, 2: A B C, B C A, C A B).

    ``rl.interleave: run`` runs a seed's arms one after the other in this order; ``step`` runs step k of
    each in this order, then step k+1 (:mod:`isoexec.rl.skyrl.turns`).
    """
    all_arms = arms(cfg)
    out = []
    for i, seed in enumerate(cfg.rl.seeds):
        k = i % len(all_arms)
        out.append((seed, all_arms[k:] + all_arms[:k]))
    return out


def schedule(cfg: ExperimentConfig) -> list[tuple[Arm, int]]:
    """The (arm, seed) runs of the paired job in the order they start (:func:`seed_rounds`, flattened:
    A0 B0 C0, B1 C1 A1, C2 A2 B2)."""
    return [(a, seed) for seed, seed_arms in seed_rounds(cfg) for a in seed_arms]
