"""The embedded RL task: multi-step arithmetic word problems, solved with a short scratchpad.

A problem chains ``task.num_operands`` operands in ``[1, task.max_operand]`` through additions and
subtractions told as a story, e.g. (``num_operands=3``)::

    question: "Tom has 4 apples . Tom buys 5 more . Tom gives 3 to Ann . How many apples does Tom have now ?"
    solution: "4 + 5 = 9 . 9 - 3 = 6 . Answer : 6"
    answer:   6

The solution is the SFT target: one scratchpad step per operation, then DAPO-Math's final line
``Answer : N``. Every running total stays in ``[0, task.max_total]``; with the defaults (operands up
to 5, totals up to 9) every number is one digit, so a solution has ``6 * (num_operands - 1) + 4``
tokens with EOS (28 for 5 operands) and the arithmetic is a table of about a hundred one-digit facts
that a tiny model learns in a few hundred SFT steps. The question is wrapped into DAPO-Math-17k's instruction by :mod:`isoexec.rl.data`;
the reward is DAPO-Math's rule (:mod:`isoexec.rl.reward`).

Everything is a pure function of ``TaskSection`` (operand range, number of operands, split sizes,
seed): the same config gives the same problems in the same order on every machine. The eval split
is drawn first and its questions are excluded from the train split, so the two never share one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from isoexec.config import TaskSection

NAMES = ["Tom", "Ann", "Bob", "Eve", "Sam", "Mia", "Leo", "Zoe"]
OBJECTS = ["apples", "pears", "books", "coins", "cards", "pens", "eggs", "shells"]

# Story clauses. Placeholders: {n} the owner, {m} another name, {o} the object, {x} the operand.
# Words are separated by spaces and punctuation stands alone, as the word-level tokenizer splits them.
START = "{n} has {x} {o} ."
ADD = ["{n} buys {x} more .", "{m} gives {n} {x} more .", "{n} finds {x} more ."]
SUB = ["{n} gives {x} to {m} .", "{n} loses {x} of them .", "{n} sells {x} ."]
QUESTION = "How many {o} does {n} have now ?"
SOLUTION_WORDS = ["+", "-", "=", ".", "Answer", ":"]  # the scratchpad's own tokens besides numbers


@dataclass(frozen=True)
class Problem:
    """One word problem.

    Attributes:
        question: the story and question (no instruction wrapper, no BOS).
        answer: the integer result (>= 0).
        solution: the scratchpad response, ending in ``Answer : <answer>`` (no EOS).
        ops: the operations in order, one character each (``+`` or ``-``), e.g. ``"+-"``.
    """

    question: str
    answer: int
    solution: str
    ops: str


def template_texts() -> list[str]:
    """Every text the task can produce, with placeholders dropped (for the tokenizer's vocabulary)."""
    texts = [START, QUESTION, *ADD, *SUB, " ".join(SOLUTION_WORDS), " ".join(NAMES), " ".join(OBJECTS)]
    return [" ".join(w for w in t.split() if not w.startswith("{")) for t in texts]


def make_problem(rng: random.Random, max_operand: int, num_operands: int, max_total: int) -> Problem:
    """Draw one problem from ``rng``: names, object, operands in ``[1, max_operand]`` and operations.

    Each step draws an operand, then an operation among those that keep the running total in
    ``[0, max_total]`` (uniformly; a new operand when neither does).

    Raises:
        ValueError: ``max_total < max_operand`` (the first operand could exceed it).
    """
    if max_total < max_operand:
        raise ValueError(f"task.max_total={max_total} must be >= task.max_operand={max_operand}")
    n, m = rng.sample(NAMES, 2)
    o = rng.choice(OBJECTS)
    total = rng.randint(1, max_operand)
    clauses = [START.format(n=n, x=total, o=o)]
    steps, ops = [], []
    for _ in range(num_operands - 1):
        allowed: list[str] = []
        while not allowed:
            x = rng.randint(1, max_operand)
            allowed = [op for op, ok in (("+", total + x <= max_total), ("-", x <= total)) if ok]
        op = rng.choice(allowed)
        if op == "-":
            new, clause = total - x, rng.choice(SUB)
        else:
            new, clause = total + x, rng.choice(ADD)
        clauses.append(clause.format(n=n, m=m, x=x))
        steps.append(f"{total} {op} {x} = {new} .")
        ops.append(op)
        total = new
    clauses.append(QUESTION.format(n=n, o=o))
    return Problem(" ".join(clauses), total, " ".join([*steps, f"Answer : {total}"]), "".join(ops))


def _draw(rng: random.Random, count: int, task: TaskSection, exclude: set[str]) -> list[Problem]:
    out: list[Problem] = []
    seen = set(exclude)
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise ValueError(f"cannot draw {count} distinct problems with task.max_operand={task.max_operand} "
                             f"and task.num_operands={task.num_operands}")
        p = make_problem(rng, task.max_operand, task.num_operands, task.max_total)
        if p.question in seen:
            continue
        seen.add(p.question)
        out.append(p)
    return out


def make_splits(task: TaskSection) -> tuple[list[Problem], list[Problem]]:
    """Return ``(train, eval)`` problem lists, a pure function of ``task``.

    Eval is drawn first from ``Random(task.seed)`` and train continues the same stream, skipping any
    question already drawn, so the splits are disjoint and deterministic.

    Raises:
        ValueError: the operand range cannot give that many distinct questions.
    """
    rng = random.Random(task.seed)
    eval_ = _draw(rng, task.num_eval_prompts, task, set())
    train = _draw(rng, task.num_train_prompts, task, {p.question for p in eval_})
    return train, eval_
