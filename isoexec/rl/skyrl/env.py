"""The arithmetic task as a skyrl-gym environment, and its training data in DAPO-Math-17k's schema.

- :class:`ArithmeticEnv`, registered with ``skyrl_gym.register`` as :data:`ENV_ID` (:func:`register`):
  a single-turn ``BaseTextEnv`` whose ``step(action)`` scores the response text with the task's
  rule (:func:`isoexec.rl.task.reward`: exactly one integer, then EOS). SkyRL's generator hands the
  env the decoded response; isoexec's inference client decodes *with* special tokens
  (:mod:`isoexec.rl.skyrl.client`), so the EOS and any stray special token reach the rule and the
  reward is the same as the token-level reward of the plain loop.
- :func:`write_train_data`: the train split as parquet (``datasets``) in DAPO-Math-17k's columns:
  ``data_source``, ``prompt`` (chat format, one user message), ``reward_model`` (``style``,
  ``ground_truth``), ``env_class`` (SkyRL's per-row env id), ``extra_info`` (``index``, ``op``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from isoexec.config import TaskSection
from isoexec.rl.task import make_splits, reward
from isoexec.rl.tokenizer import EOS

ENV_ID = "isoexec_arithmetic"
DATA_SOURCE = "isoexec/arithmetic"


class ArithmeticEnv(BaseTextEnv):
    """One-turn arithmetic word problem.

    Args:
        env_config: unused (skyrl-gym passes the env's config section).
        extras: the data row's other columns; ``extras["reward_model"]["ground_truth"]`` is the
            integer answer as a string (DAPO-Math schema).

    Raises:
        ValueError: the row has no ``reward_model.ground_truth`` or it is not an integer.
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        truth = ((extras or {}).get("reward_model") or {}).get("ground_truth")
        try:
            self.answer = int(truth)
        except (TypeError, ValueError):
            raise ValueError(f"row needs reward_model.ground_truth as an integer string, got {truth!r}") from None

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Score ``action`` (the response text with special tokens, words separated by spaces)."""
        r = reward(action.split(), self.answer, EOS)
        return BaseTextEnvStepOutput(observations=[], reward=r, done=True, metadata={"answer": self.answer})


def register() -> None:
    """Register :data:`ENV_ID` in skyrl-gym's registry (idempotent; per process)."""
    import skyrl_gym

    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:ArithmeticEnv")


def train_rows(task: TaskSection) -> list[dict[str, Any]]:
    """The train split of ``task`` as DAPO-Math-schema rows, in split order."""
    train, _ = make_splits(task)
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.prompt}],
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "env_class": ENV_ID,
            "extra_info": {"index": i, "op": p.op},
        }
        for i, p in enumerate(train)
    ]


def write_train_data(task: TaskSection, path: str | Path) -> Path:
    """Write :func:`train_rows` to ``path`` (parquet, through ``datasets``); returns the path."""
    import datasets

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(train_rows(task)).to_parquet(str(path))
    return path
