"""The arithmetic task: determinism, splits, answers, tokenizer, reward parsing."""

import random

import pytest

from isoexec.config import TaskSection
from isoexec.rl.task import answer_tokens, make_problem, make_splits, parse_answer, reward
from isoexec.rl.tokenizer import BOS, EOS, PAD, build_tokenizer, encode_prompt, load_tokenizer, vocab_list


def test_splits_are_a_pure_function_of_the_task_section():
    t = TaskSection(num_train_prompts=200, num_eval_prompts=20, seed=3)
    assert make_splits(t) == make_splits(t)
    assert make_splits(t) != make_splits(TaskSection(num_train_prompts=200, num_eval_prompts=20, seed=4))


def test_train_and_eval_splits_are_disjoint_and_sized():
    train, eval_ = make_splits(TaskSection(num_train_prompts=300, num_eval_prompts=30))
    assert len(train) == 300 and len(eval_) == 30
    assert not {p.prompt for p in train} & {p.prompt for p in eval_}
    assert len({p.prompt for p in train}) == 300


def test_answers_match_the_operands_in_the_prompt():
    rng = random.Random(0)
    for _ in range(300):
        p = make_problem(rng, 20)
        nums = [int(w) for w in p.prompt.split() if w.isdigit()]
        a, b = nums
        assert p.answer == {"add": a + b, "sub": a - b, "mul": a * b}[p.op]
        assert p.answer >= 0 and p.prompt.endswith("Answer :")


def test_every_prompt_token_is_in_the_vocabulary_and_vocab_is_padded_to_64():
    tok = build_tokenizer()
    assert len(tok) % 64 == 0 and len(vocab_list()) == len(tok)
    train, _ = make_splits(TaskSection(num_train_prompts=500, num_eval_prompts=10))
    for p in train:
        ids = encode_prompt(tok, p.prompt)
        assert ids[0] == tok.bos_token_id
        assert tok.unk_token_id not in ids
    assert tok.convert_tokens_to_ids([PAD, BOS, EOS]) == [0, 1, 2]


def test_numbers_are_tokenized_digit_by_digit():
    tok = build_tokenizer()
    ids = encode_prompt(tok, "Tom has 17 apples .")
    assert tok.convert_ids_to_tokens(ids) == [BOS, "Tom", "has", "1", "7", "apples", "."]


def test_tokenizer_round_trips_through_hf_format(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(str(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
    again = load_tokenizer(tmp_path)
    s = "Ann has 3 pens . How many pens ? Answer :"
    assert encode_prompt(again, s) == encode_prompt(tok, s)
    assert (again.eos_token_id, again.pad_token_id, again.bos_token_id) == (2, 0, 1)


@pytest.mark.parametrize("tokens,expected", [
    (["1", "2", EOS], 12),
    (["0", EOS], 0),
    (["-", "3", EOS], -3),
    (["7", EOS, "9", "9"], 7),            # everything after EOS is ignored
])
def test_parse_answer_accepts_well_formed_integers(tokens, expected):
    assert parse_answer(tokens, EOS) == expected


@pytest.mark.parametrize("tokens", [
    ["1", "2"],                   # no EOS: ran out of budget
    [EOS],                        # no digits
    ["apples", "1", EOS],         # a word before the number
    ["1", "apples", EOS],         # a word after the number
    ["0", "7", EOS],              # leading zero
    ["-", EOS],                   # sign only
    ["<pad>", "3", EOS],
    ["1", "2", "3", "4", "5", "6", "7", EOS],  # too long
    [],
])
def test_malformed_responses_get_reward_zero(tokens):
    assert parse_answer(tokens, EOS) is None
    assert reward(tokens, 0, EOS) == 0.0 and reward(tokens, 12, EOS) == 0.0


def test_reward_is_one_only_for_the_right_answer():
    assert reward(answer_tokens(12) + [EOS], 12, EOS) == 1.0
    assert reward(answer_tokens(13) + [EOS], 12, EOS) == 0.0
