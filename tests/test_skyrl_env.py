"""The task as a skyrl-gym env (DAPO-Math's rule, the loop's reward), and its DAPO-Math-schema data through
SkyRL's PromptDataset."""

import pytest

pytest.importorskip("skyrl_gym", reason="the skyrl extra is not installed")

import skyrl_gym  # noqa: E402

from isoexec.config import TaskSection  # noqa: E402
from isoexec.rl.data import prompt_token_ids, load_splits  # noqa: E402
from isoexec.rl.skyrl.env import ENV_ID, register, train_rows, write_train_data  # noqa: E402
from isoexec.rl.tokenizer import build_tokenizer  # noqa: E402

TASK = TaskSection(max_operand=5, max_total=9, num_operands=3, num_train_prompts=16, num_eval_prompts=4)


def _env(answer):
    register()
    return skyrl_gym.make(ENV_ID, env_config={}, extras={"reward_model": {"ground_truth": str(answer)}})


@pytest.mark.parametrize("text,reward", [
    ("7 + 5 = 1 2 . Answer : 1 2 <eos>", 1.0),  # the scratchpad, then the answer after "Answer :"
    ("Answer : 1 2", 1.0),                      # no EOS: the rule reads to the end
    ("7 + 5 = 1 3 . Answer : 1 3 <eos>", 0.0),  # wrong
    ("1 2 <eos>", 0.0),                         # no "Answer :": DAPO's rule finds no answer
    ("Answer : 1 2 . Answer : 3 <eos>", 0.0),   # no newline: everything after the first "Answer :" is the answer
])
def test_env_reward_is_dapo_maths_rule_as_in_the_loop(text, reward):
    from isoexec.rl.reward import reward as loop_reward

    assert _env(12).step(text)["reward"] == reward == loop_reward(text, "12")


def test_row_without_ground_truth_is_refused():
    register()
    with pytest.raises(ValueError, match="reward_model.ground_truth"):
        skyrl_gym.make(ENV_ID, env_config={}, extras={"reward_model": {"ground_truth": ""}})


def test_dapo_schema_data_loads_through_skyrl_prompt_dataset(tmp_path):
    from isoexec.rl.skyrl import compat

    compat.install()
    from skyrl.train.dataset import PromptDataset

    tok = build_tokenizer()
    path = write_train_data(TASK, tmp_path / "train.parquet")
    ds = PromptDataset(datasets=[str(path)], tokenizer=tok, max_prompt_length=512, num_workers=1)
    rows = train_rows(TASK)
    assert len(ds) == len(rows) == TASK.num_train_prompts
    messages, env_class, extras, _ = ds[3]
    assert env_class == ENV_ID and extras["data_source"] == rows[3]["data_source"]
    assert extras["reward_model"]["ground_truth"] == rows[3]["reward_model"]["ground_truth"]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == prompt_token_ids(tok, load_splits(TASK)[0][3])  # SkyRL's prompt is the loop's prompt
