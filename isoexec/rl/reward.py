"""The reward: DAPO-Math's rule, from skyrl-gym's maintained implementation.

Rule (skyrl-gym 0.4.0, ``skyrl_gym/envs/aime/utils.py`` ``compute_score``, adapted there from
verl's ``math_dapo.py``): keep the response's last 300 characters; take the last match of the regex
``(?i)Answer\\s*:\\s*([^\\n<]+)`` (the text after ``Answer:`` up to a newline or ``<``); normalize it and
the ground truth the Minerva way (``normalize_final_answer``: spaces and units removed, ``\\boxed``,
``\\text`` stripped, thousands separators dropped); correct iff the two strings are equal. A
response without ``Answer:`` is wrong (``pred = "[INVALID]"``).

skyrl-gym scores +1.0 / -1.0 (DAPO's reward); :func:`reward` returns its accuracy as 1.0 / 0.0, so
that ``reward_mean`` reads as accuracy. GRPO's std-normalized advantages are the same for both
(an affine map of every reward in a group).

With the task's word-level tokenizer a response decodes to words separated by single spaces, special
tokens kept (:func:`response_text`), e.g. ``"7 + 5 = 1 2 . Answer : 1 2 <eos>"``: the answer is
``"1 2 "`` up to ``<eos>``, normalized to ``"12"``. The tokenizer has no newline, so everything
between the first ``Answer :`` and the EOS is the answer: ``"Answer : 1 2 . Answer : 3"`` is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence


def verify(response: str, ground_truth: str) -> tuple[bool, str]:
    """``(correct, pred)`` by DAPO-Math's rule (skyrl-gym's ``compute_score``).

    Args:
        response: the decoded response text.
        ground_truth: ``reward_model.ground_truth`` of the row.

    Returns:
        Whether the extracted answer equals the ground truth after normalization, and the
        normalized extracted answer (``"[INVALID]"`` when there is no ``Answer:``).
    """
    from skyrl_gym.envs.aime.utils import compute_score

    s = compute_score(response, ground_truth)
    return bool(s["acc"]), str(s["pred"])


def reward(response: str, ground_truth: str) -> float:
    """1.0 if ``response`` is correct for ``ground_truth`` by :func:`verify`, else 0.0."""
    return 1.0 if verify(response, ground_truth)[0] else 0.0


def response_text(tok, token_ids: Sequence[int]) -> str:
    """The text the rule reads: ``token_ids`` decoded with special tokens kept (an EOS ends the
    answer at its ``<``, as SkyRL's generator hands it to a skyrl-gym env)."""
    return tok.decode(list(token_ids), skip_special_tokens=False)
