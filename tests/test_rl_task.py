"""The embedded task, its DAPO-Math-17k-schema data path, the tokenizer and the DAPO-Math reward rule."""

import random

import pytest

from isoexec.config import TaskSection
from isoexec.rl.data import (
    INSTRUCTION_PREFIX,
    INSTRUCTION_SUFFIX,
    check_row,
    embedded_rows,
    examples,
    load_parquet,
    load_splits,
    prompt_token_ids,
    write_parquet,
)
from isoexec.rl.reward import response_text, reward, verify
from isoexec.rl.task import make_problem, make_splits
from isoexec.rl.tokenizer import BOS, EOS, PAD, build_tokenizer, encode_prompt, load_tokenizer, vocab_list

TASK = TaskSection(num_train_prompts=200, num_eval_prompts=20, num_operands=4, seed=3)


def test_splits_are_a_pure_function_of_the_task_section():
    assert make_splits(TASK) == make_splits(TASK)
    assert make_splits(TASK) != make_splits(TASK.model_copy(update={"seed": 4}))
    assert embedded_rows(TASK) == embedded_rows(TASK)


def test_train_and_eval_splits_are_disjoint_and_sized():
    train, eval_ = make_splits(TaskSection(num_train_prompts=300, num_eval_prompts=30))
    assert len(train) == 300 and len(eval_) == 30
    assert not {p.question for p in train} & {p.question for p in eval_}
    assert len({p.question for p in train}) == 300


@pytest.mark.parametrize("num_operands,max_operand,max_total", [(2, 9, 9), (3, 9, 30), (5, 5, 9)])
def test_the_scratchpad_recomputes_the_story_and_ends_in_the_answer(num_operands, max_operand, max_total):
    rng = random.Random(0)
    for _ in range(200):
        p = make_problem(rng, max_operand, num_operands, max_total)
        operands = [int(w) for w in p.question.split() if w.isdigit()]
        assert len(operands) == num_operands and len(p.ops) == num_operands - 1
        total = operands[0]
        steps = p.solution.split(" . ")
        for op, x, step in zip(p.ops, operands[1:], steps, strict=False):
            new = total + x if op == "+" else total - x
            assert step.rstrip(" .") == f"{total} {op} {x} = {new}"
            assert 0 <= new <= max_total and 1 <= x <= max_operand
            total = new
        assert p.answer == total and steps[-1] == f"Answer : {total}"


def test_a_total_bound_below_the_operand_range_is_refused():
    with pytest.raises(ValueError, match="task.max_total=4 must be >= task.max_operand=5"):
        make_problem(random.Random(0), 5, 3, 4)
    with pytest.raises(ValueError, match="task.max_total=4 < task.max_operand=5"):
        from isoexec.config import ExperimentConfig

        ExperimentConfig(name="x", task=TaskSection(max_operand=5, max_total=4))


def test_embedded_rows_are_in_dapo_math_schema():
    train, eval_ = embedded_rows(TASK)
    assert len(train) == 200 and len(eval_) == 20
    for r in train[:20]:
        assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        (msg,) = r["prompt"]
        assert msg["role"] == "user"
        assert msg["content"].startswith(INSTRUCTION_PREFIX) and msg["content"].endswith(INSTRUCTION_SUFFIX)
        assert r["reward_model"]["ground_truth"] == r["extra_info"]["solution"].rsplit(": ", 1)[1]
        check_row(r)


def test_embedded_task_and_its_parquet_load_to_the_same_examples(tmp_path):
    train_rows, _ = embedded_rows(TASK)
    path = write_parquet(train_rows, tmp_path / "train.parquet")
    from_file, eval_ = load_splits(TASK.model_copy(update={"data_path": str(path)}))
    in_memory, _ = load_splits(TASK)
    assert eval_ is None
    assert from_file == in_memory and len(from_file) == 200


def test_a_dapo_math_17k_parquet_loads_through_the_same_code(tmp_path):
    # Rows shaped like BytedTsinghua-SIA/DAPO-Math-17k (no solution; UUID index), written here.
    import datasets

    content = INSTRUCTION_PREFIX + "Find $x$ if $2x = 34$." + INSTRUCTION_SUFFIX
    rows = [{"data_source": "math_dapo", "prompt": [{"content": content, "role": "user"}], "ability": "MATH",
             "reward_model": {"ground_truth": "17", "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"}}] * 3
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "dapo.parquet"))
    train, eval_ = load_splits(TaskSection(data_path=str(tmp_path / "dapo.parquet")))
    assert eval_ is None and len(train) == 3
    ex = train[0]
    assert ex.chat() == [{"role": "user", "content": content}]
    assert ex.ground_truth == "17" and ex.solution is None and ex.index.startswith("9a9b6eb4")
    assert reward("x = 17 .\nAnswer: 17", ex.ground_truth) == 1.0


def test_a_parquet_outside_the_schema_is_refused_with_its_columns(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"question": "1+1", "answer": "2"}]).to_parquet(str(tmp_path / "x.parquet"))
    with pytest.raises(ValueError, match=r"missing columns \['prompt', 'reward_model'\]"):
        load_parquet(tmp_path / "x.parquet")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_parquet(tmp_path / "nope.parquet")
    with pytest.raises(ValueError, match="ground_truth"):
        examples([{"prompt": [{"role": "user", "content": "q"}], "reward_model": {"style": "rule"}}])
    with pytest.raises(ValueError, match="'prompt' must be"):
        examples([{"prompt": "plain text", "reward_model": {"ground_truth": "2"}}])


def test_every_prompt_and_solution_token_is_in_the_vocabulary_and_vocab_is_padded_to_64():
    tok = build_tokenizer()
    assert len(tok) % 64 == 0 and len(vocab_list()) == len(tok)
    train, _ = load_splits(TaskSection(num_train_prompts=300, num_eval_prompts=10, num_operands=5))
    for ex in train:
        ids = prompt_token_ids(tok, ex)
        sol = tok(ex.solution, add_special_tokens=False)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.unk_token_id not in ids and tok.unk_token_id not in sol
    assert tok.convert_tokens_to_ids([PAD, BOS, EOS]) == [0, 1, 2]


def test_chat_template_gives_the_plain_prompt_tokens():
    tok = build_tokenizer()
    train, _ = load_splits(TASK)
    for ex in train[:10]:
        assert prompt_token_ids(tok, ex) == encode_prompt(tok, ex.messages[0][1])


def test_numbers_are_tokenized_digit_by_digit():
    tok = build_tokenizer()
    ids = encode_prompt(tok, "Tom has 17 apples .")
    assert tok.convert_ids_to_tokens(ids) == [BOS, "Tom", "has", "1", "7", "apples", "."]


def test_tokenizer_round_trips_through_hf_format(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(str(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
    again = load_tokenizer(tmp_path)
    ex = load_splits(TASK)[0][0]
    assert prompt_token_ids(again, ex) == prompt_token_ids(tok, ex)
    assert (again.eos_token_id, again.pad_token_id, again.bos_token_id) == (2, 0, 1)


def _decoded(tok, text: str, eos: bool = True) -> str:
    ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
    return response_text(tok, ids)


@pytest.mark.parametrize("text,truth", [
    ("7 + 5 = 12 . Answer : 12", "12"),
    ("12 - 12 = 0 . Answer : 0", "0"),
    ("Answer : 9", "9"),
])
def test_reward_rule_accepts_the_right_answer(text, truth):
    tok = build_tokenizer()
    decoded = _decoded(tok, text)
    assert decoded.endswith(EOS)  # the EOS stays in the text; the rule stops at its "<"
    assert verify(decoded, truth) == (True, truth)
    assert reward(decoded, truth) == 1.0


@pytest.mark.parametrize("text,truth,pred", [
    ("7 + 5 = 12 . Answer : 13", "12", "13"),
    # the answer runs to the end of its line (the task's tokenizer has no newline: to EOS's "<")
    ("Answer : 105 . Answer : 3", "105", "105.Answer:3"),
    ("Answer : 1 2 apples", "12", "12apples"),   # words after the number: wrong
])
def test_reward_rule_rejects_a_wrong_answer(text, truth, pred):
    decoded = _decoded(build_tokenizer(), text)
    assert verify(decoded, truth) == (False, pred)
    assert reward(decoded, truth) == 0.0


@pytest.mark.parametrize("text", ["7 + 5 = 12 .", "12", "", "Answer", ": 12"])
def test_reward_rule_gives_zero_to_a_malformed_response(text):
    decoded = _decoded(build_tokenizer(), text)
    assert verify(decoded, "12") == (False, "[INVALID]")
    assert reward(decoded, "12") == 0.0
