"""The RL task as a skyrl-gym environment, and its training data for SkyRL's ``PromptDataset``.

- :class:`DapoMathEnv`, registered with ``skyrl_gym.register`` as :data:`ENV_ID` (:func:`register`):
  a single-turn ``BaseTextEnv`` whose ``step(action)`` scores the response text by DAPO-Math's rule
  (:func:`isoexec.rl.reward.reward`, skyrl-gym's ``compute_score`` reported as accuracy 1/0, the same
  reward as the in-process loop). SkyRL's generator hands the env the decoded response; isoexec's
  inference client decodes *with* special tokens (:mod:`isoexec.rl.skyrl.client`), as
  :func:`isoexec.rl.reward.response_text` does.
- :func:`write_train_data`: the experiment's train rows in DAPO-Math-17k's schema
  (:mod:`isoexec.rl.data`: the embedded task, or ``task.data_path``'s parquet) plus SkyRL's per-row
  ``env_class``, as parquet through ``datasets``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from isoexec.config import TaskSection
from isoexec.rl.data import check_row, embedded_rows, load_parquet, write_parquet
from isoexec.rl.reward import reward

ENV_ID = "isoexec_dapo_math"


class DapoMathEnv(BaseTextEnv):
    """One-turn math problem scored by DAPO-Math's rule.

    Args:
        env_config: unused (skyrl-gym passes the env's config section).
        extras: the data row's other columns; ``extras["reward_model"]["ground_truth"]`` is the answer
            text (DAPO-Math schema).

    Raises:
        ValueError: the row has no non-empty ``reward_model.ground_truth`` string.
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        truth = ((extras or {}).get("reward_model") or {}).get("ground_truth")
        if not isinstance(truth, str) or not truth.strip():
            raise ValueError(f"row needs reward_model.ground_truth as a non-empty string, got {truth!r}")
        self.ground_truth = truth

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Score ``action`` (the response text with special tokens)."""
        r = reward(action, self.ground_truth)
        return BaseTextEnvStepOutput(observations=[], reward=r, done=True, metadata={"ground_truth": self.ground_truth})


def register() -> None:
    """Register :data:`ENV_ID` in skyrl-gym's registry (idempotent; per process)."""
    import skyrl_gym

    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:DapoMathEnv")


def train_rows(task: TaskSection) -> list[dict[str, Any]]:
    """The train rows of ``task`` (embedded split, or every row of ``task.data_path``), each with
    ``env_class`` = :data:`ENV_ID`.

    Raises:
        ValueError: a row is not in DAPO-Math-17k's schema (:func:`isoexec.rl.data.check_row`).
    """
    rows = embedded_rows(task)[0] if task.data_path is None else [dict(r) for r in load_parquet(task.data_path)]
    for i, r in enumerate(rows):
        check_row(r, f"train row {i}")
    return [{**r, "env_class": ENV_ID} for r in rows]


def write_train_data(task: TaskSection, path: str | Path) -> Path:
    """Write :func:`train_rows` to ``path`` (parquet, through ``datasets``); returns the path."""
    return write_parquet(train_rows(task), path)
