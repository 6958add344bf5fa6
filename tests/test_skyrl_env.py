"""The arithmetic task as a skyrl-gym env, and its DAPO-Math-schema data through SkyRL's PromptDataset."""

import pytest

pytest.importorskip("skyrl_gym", reason="the skyrl extra is not installed")

import skyrl_gym  # noqa: E402

from isoexec.config import TaskSection  # noqa: E402
from isoexec.rl.skyrl.env import ENV_ID, register, train_rows, write_train_data  # noqa: E402
from isoexec.rl.tokenizer import build_tokenizer, encode_prompt  # noqa: E402

TASK = TaskSection(max_operand=9, num_train_prompts=16, num_eval_prompts=4)


def _env(answer):
    register()
    return skyrl_gym.make(ENV_ID, env_config={}, extras={"reward_model": {"ground_truth": str(answer)}})


@pytest.mark.parametrize("text,reward", [
    ("1 2 <eos>", 1.0),       # the integer, then EOS
    ("1 2", 0.0),             # no EOS: ran out of tokens
    ("1 3 <eos>", 0.0),       # wrong
    ("<pad> 1 2 <eos>", 0.0),  # a stray special token is malformed, as in the token-level rule
    ("0 1 2 <eos>", 0.0),     # leading zero
])
def test_env_reward_is_the_task_rule(text, reward):
    assert _env(12).step(text)["reward"] == reward


def test_row_without_integer_ground_truth_is_refused():
    register()
    with pytest.raises(ValueError, match="reward_model.ground_truth"):
        skyrl_gym.make(ENV_ID, env_config={}, extras={"reward_model": {"ground_truth": "twelve"}})


def test_dapo_schema_data_loads_through_skyrl_prompt_dataset(tmp_path):
    from isoexec.rl.skyrl import compat

    compat.install()
    from skyrl.train.dataset import PromptDataset

    tok = build_tokenizer()
    path = write_train_data(TASK, tmp_path / "train.parquet")
    ds = PromptDataset(datasets=[str(path)], tokenizer=tok, max_prompt_length=64, num_workers=1)
    rows = train_rows(TASK)
    assert len(ds) == len(rows) == TASK.num_train_prompts
    messages, env_class, extras, _ = ds[3]
    assert env_class == ENV_ID and extras["data_source"] == rows[3]["data_source"]
    assert extras["reward_model"]["ground_truth"] == rows[3]["reward_model"]["ground_truth"]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == encode_prompt(tok, messages[0]["content"])  # chat format reaches the model as plain prompts do
