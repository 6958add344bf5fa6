"""RL data in DAPO-Math-17k's schema, through Hugging Face ``datasets``.

One row per problem, with DAPO-Math-17k's columns (``BytedTsinghua-SIA/DAPO-Math-17k``)::

    data_source   str   "math_dapo" there; "isoexec/arithmetic" for the embedded task
    prompt        list  chat format: [{"role": "user", "content": <instruction-wrapped problem>}]
    ability       str   "MATH"
    reward_model  dict  {"ground_truth": <answer as text>, "style": "rule-lighteval/MATH_v2"}
    extra_info    dict  {"index": ...}; the embedded task adds "solution" (the SFT target) and "split"

The prompt content wraps each problem in DAPO-Math-17k's fixed instruction (:func:`dapo_prompt`),
for the embedded task too, so prompts are as long as there (about 75 tokens with the task's
tokenizer: every prompt crosses the GDN chunk size C=64 and the 64-token attention block).

Sources (:func:`load_splits`): ``task.data_path`` None -> the embedded task of
:mod:`isoexec.rl.task`, generated as rows (:func:`embedded_rows`, a pure function of the task
config); otherwise that parquet file (a DAPO-Math-17k download, or what :func:`write_parquet`
wrote). Both go through the same :func:`examples` (schema check, then :class:`Example`).

Used by the plain loop (:mod:`isoexec.rl.loop`), the SFT warm start (:mod:`isoexec.rl.sft`) and a
skyrl-gym env (rows carry ``reward_model.ground_truth``; the reward is :mod:`isoexec.rl.reward`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoexec.config import TaskSection
from isoexec.rl.task import Problem, make_splits

DATA_SOURCE = "isoexec/arithmetic"
ABILITY = "MATH"
REWARD_STYLE = "rule-lighteval/MATH_v2"
INSTRUCTION_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
INSTRUCTION_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


def dapo_prompt(problem: str) -> str:
    """``problem`` wrapped in DAPO-Math-17k's instruction (the user message's content)."""
    return f"{INSTRUCTION_PREFIX}{problem}{INSTRUCTION_SUFFIX}"


@dataclass(frozen=True)
class Example:
    """One RL prompt as the loop uses it.

    Attributes:
        messages: the chat-format prompt (``[{"role", "content"}, ...]``), as in the row.
        ground_truth: ``reward_model.ground_truth`` (text; the reward rule normalizes it).
        solution: ``extra_info.solution`` (the SFT target response, no EOS), or None when the row
            has none (DAPO-Math-17k rows).
        index: ``extra_info.index`` as text (an integer for the embedded task, a UUID in DAPO-Math-17k).
    """

    messages: tuple[tuple[str, str], ...]
    ground_truth: str
    solution: str | None
    index: str

    def chat(self) -> list[dict[str, str]]:
        """``messages`` as the list of dicts that chat templates take."""
        return [{"role": r, "content": c} for r, c in self.messages]


def problem_row(problem: Problem, index: int, split: str) -> dict[str, Any]:
    """The DAPO-schema row of one embedded problem."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": dapo_prompt(problem.question)}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": str(problem.answer), "style": REWARD_STYLE},
        "extra_info": {"index": str(index), "split": split, "solution": problem.solution, "ops": problem.ops},
    }


def embedded_rows(task: TaskSection) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train_rows, eval_rows)`` of the embedded task in DAPO's schema, a pure function of ``task``
    (:func:`isoexec.rl.task.make_splits`, in split order)."""
    train, eval_ = make_splits(task)
    return ([problem_row(p, i, "train") for i, p in enumerate(train)],
            [problem_row(p, i, "eval") for i, p in enumerate(eval_)])


def write_parquet(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows to ``path`` as parquet through ``datasets``; returns the path.

    Raises:
        ValueError: a row misses a DAPO column (see :func:`check_row`).
    """
    import datasets

    for i, r in enumerate(rows):
        check_row(r, f"row {i}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list([dict(r) for r in rows]).to_parquet(str(path))
    return path


def load_parquet(path: str | Path):
    """A parquet file in DAPO-Math-17k's schema as a ``datasets.Dataset`` (columns checked).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a DAPO column is missing (names the file, the missing and the present columns).
    """
    import datasets

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task.data_path {str(path)!r} does not exist")
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    missing = [c for c in ("prompt", "reward_model") if c not in ds.column_names]
    if missing:
        raise ValueError(f"{path}: not in DAPO-Math-17k's schema: missing columns {missing}; it has {ds.column_names}")
    return ds


def check_row(row: Mapping[str, Any], where: str = "row") -> None:
    """Refuse a row that the loop cannot use.

    Raises:
        ValueError: ``prompt`` is not a non-empty list of ``{role, content}`` strings, or
            ``reward_model.ground_truth`` is missing or empty; the message names ``where`` and the value.
    """
    prompt = row.get("prompt")
    if not isinstance(prompt, (list, tuple)) or not prompt or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of {{role, content}} strings, got {prompt!r}")
    truth = (row.get("reward_model") or {}).get("ground_truth")
    if not isinstance(truth, str) or not truth.strip():
        raise ValueError(f"{where}: 'reward_model.ground_truth' must be a non-empty string, got {truth!r}")


def examples(rows: Iterable[Mapping[str, Any]]) -> list[Example]:
    """Rows (a ``datasets.Dataset`` or dicts) as :class:`Example` s, in order; each row is checked
    (:func:`check_row`)."""
    out = []
    for i, r in enumerate(rows):
        check_row(r, f"row {i}")
        extra = r.get("extra_info") or {}
        out.append(Example(
            messages=tuple((m["role"], m["content"]) for m in r["prompt"]),
            ground_truth=r["reward_model"]["ground_truth"],
            solution=extra.get("solution"),
            index=str(extra.get("index", i)),
        ))
    return out


def load_splits(task: TaskSection) -> tuple[list[Example], list[Example] | None]:
    """``(train, eval)`` examples of the experiment.

    ``task.data_path`` None: the embedded task's two splits (rows of :func:`embedded_rows` through a
    ``datasets.Dataset``, as a parquet of them would load). Otherwise the parquet's rows are the
    train split and there is no eval split (None).
    """
    import datasets

    if task.data_path is not None:
        return examples(load_parquet(task.data_path)), None
    train, eval_ = embedded_rows(task)
    return examples(datasets.Dataset.from_list(train)), examples(datasets.Dataset.from_list(eval_))


def prompt_token_ids(tok, example: Example) -> list[int]:
    """The prompt's token ids: the tokenizer's chat template applied to ``example.messages`` with the
    generation prompt (what the engine receives; SkyRL's generator does the same)."""
    ids = tok.apply_chat_template(example.chat(), add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)
