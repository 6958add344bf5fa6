"""The RL task: procedurally generated arithmetic word problems with integer answers.

A problem is a short English prompt ending in ``Answer:`` and an integer truth, e.g.
``"Tom has 7 apples and buys 5 more . How many apples does Tom have now ? Answer :"`` -> ``12``.
The policy must answer with the digits of the integer followed by the end-of-sequence token:
``"1 2 <eos>"`` (numbers are tokenized digit by digit, see :mod:`isoexec.rl.tokenizer`).

Everything is a pure function of ``TaskSection`` (operand range, split sizes, seed): the same config
gives the same problems in the same order on every machine. The eval split is drawn first and its
prompts are excluded from the train split, so the two never share a prompt.

Reward (:func:`reward`): 1.0 if the response, cut at the first EOS, is exactly one integer (an
optional ``-`` then one or more digits) equal to the truth; 0.0 otherwise, including every malformed
response (no EOS within the token budget, a non-digit token, no digits, a leading zero such as
``0 7``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from isoexec.config import TaskSection

NAMES = ["Tom", "Ann", "Bob", "Eve", "Sam", "Mia", "Leo", "Zoe"]
OBJECTS = ["apples", "pears", "books", "coins", "cards", "pens", "eggs", "shells"]

# (operation, template). Placeholders: {n} name, {m} second name, {o} object, {a} {b} operands.
# Words are separated by spaces and punctuation stands alone so that the word-level tokenizer sees
# exactly the same tokens as the vocabulary lists below.
TEMPLATES: list[tuple[str, str]] = [
    ("add", "{n} has {a} {o} and buys {b} more . How many {o} does {n} have now ? Answer :"),
    ("add", "{n} has {a} {o} . {m} has {b} {o} . How many {o} do they have together ? Answer :"),
    ("sub", "{n} has {a} {o} and gives away {b} . How many {o} are left ? Answer :"),
    ("sub", "{n} had {a} {o} and lost {b} of them . How many {o} does {n} have now ? Answer :"),
    ("mul", "{n} buys {a} bags with {b} {o} in each bag . How many {o} in total ? Answer :"),
]
MUL_MAX = 6  # operands of ``mul`` problems stay small (answers up to 36)


@dataclass(frozen=True)
class Problem:
    """One word problem: ``prompt`` (text, no BOS), ``answer`` (int), ``op`` (``add|sub|mul``)."""

    prompt: str
    answer: int
    op: str


def template_words() -> list[str]:
    """Every word or punctuation token the templates, names and objects can produce (sorted)."""
    words: set[str] = set(NAMES) | set(OBJECTS)
    for _, t in TEMPLATES:
        for w in t.split():
            if not w.startswith("{"):
                words.add(w)
    return sorted(words)


def make_problem(rng: random.Random, max_operand: int) -> Problem:
    """Draw one problem from ``rng`` (template, names, object, operands)."""
    op, template = TEMPLATES[rng.randrange(len(TEMPLATES))]
    n, m = rng.sample(NAMES, 2)
    o = rng.choice(OBJECTS)
    if op == "mul":
        a, b = rng.randint(2, min(MUL_MAX, max_operand)), rng.randint(2, min(MUL_MAX, max_operand))
        answer = a * b
    else:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "sub":
            a, b = max(a, b), min(a, b)  # answers stay non-negative
            answer = a - b
        else:
            answer = a + b
    return Problem(template.format(n=n, m=m, o=o, a=a, b=b), answer, op)


def _draw(rng: random.Random, count: int, max_operand: int, exclude: set[str]) -> list[Problem]:
    out: list[Problem] = []
    seen = set(exclude)
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise ValueError(f"cannot draw {count} distinct problems with max_operand={max_operand}")
        p = make_problem(rng, max_operand)
        if p.prompt in seen:
            continue
        seen.add(p.prompt)
        out.append(p)
    return out


def make_splits(task: TaskSection) -> tuple[list[Problem], list[Problem]]:
    """Return ``(train, eval)`` problem lists, a pure function of ``task``.

    Eval is drawn first from ``Random(task.seed)`` and train continues the same stream, skipping any
    prompt already drawn, so the splits are disjoint and deterministic.
    """
    rng = random.Random(task.seed)
    eval_ = _draw(rng, task.num_eval_prompts, task.max_operand, set())
    train = _draw(rng, task.num_train_prompts, task.max_operand, {p.prompt for p in eval_})
    return train, eval_


def parse_answer(tokens: list[str], eos_token: str) -> int | None:
    """Parse the integer answer from response tokens (strings); ``None`` when malformed.

    Args:
        tokens: the response tokens as strings, in order (the engine's sampled ids converted with
            the tokenizer), possibly running past the end-of-sequence token.
        eos_token: the end marker. The response is cut at its first occurrence; a response without
            it (ran out of the token budget) is malformed.

    Returns:
        The integer if the tokens before EOS are an optional ``-`` and then 1 to 6 single digits,
        without a leading zero (``0`` itself is fine); ``None`` otherwise.
    """
    if eos_token not in tokens:
        return None
    body = tokens[: tokens.index(eos_token)]
    sign = 1
    if body and body[0] == "-":
        sign, body = -1, body[1:]
    if not 1 <= len(body) <= 6 or not all(len(t) == 1 and t.isdigit() for t in body):
        return None
    if len(body) > 1 and body[0] == "0":
        return None
    return sign * int("".join(body))


def reward(tokens: list[str], answer: int, eos_token: str) -> float:
    """1.0 if ``parse_answer(tokens)`` equals ``answer``, else 0.0 (malformed responses give 0.0)."""
    parsed = parse_answer(tokens, eos_token)
    return 1.0 if parsed is not None and parsed == answer else 0.0


def answer_tokens(answer: int) -> list[str]:
    """The target response tokens for SFT, without EOS: ``12 -> ["1", "2"]``, ``-3 -> ["-", "3"]``."""
    s = str(answer)
    return list(s)
