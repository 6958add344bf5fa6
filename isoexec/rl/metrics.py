"""Per-step RL metrics, defined exactly as docs/design.md, Metrics, and the atomic ``metrics.jsonl`` writer.

Notation: for each response token t of a step, ``lR_t`` is the logprob the rollout engine reported
for the sampled token and ``lT_t`` the pre-update trainer logprob (``trainer_score``) of the same
token, both float32; ``d_t = lT_t - lR_t``.

- ``tokens``: the token exposure N (response tokens in the step).
- ``mismatch_count``: tokens whose float32 bit patterns differ (``lT.view(int32) != lR.view(int32)``:
  ``-0.0`` vs ``0.0`` counts as a mismatch, two identical NaNs do not); ``mismatch_rate = count / N``.
- ``logprob_abs_diff_mean/std/max``: mean, population std (``correction=0``) and max of ``|d_t|``.
- ``k3_kl``: ``mean(exp(d) - d - 1)`` (Schulman's k3 estimator of KL(rollout || trainer) from
  rollout samples); exactly 0 when every ``d_t`` is 0.
- ``is_ratio_mean/min/max/std``: statistics of ``exp(d_t)`` = pi_trainer / mu_rollout (std: population).
- ``is_ratio_clip_frac``: fraction of tokens whose ``exp(d_t)`` lies outside the policy loss's clip
  range ``[1 - clip_low, 1 + clip_high]`` (:func:`is_ratio_clip_frac`): the share of the batch that
  a loss using the rollout logprobs as its old policy would clip before any update.
- ``tis_capped_frac``, ``correction_masked_frac``: what an arm's off-policy correction did
  (:func:`correction_metrics`; NaN for an arm without one).
- ``full_vocab_kl``: mean over sampled positions of ``sum_v p_R(v) (log p_R(v) - log p_T(v))``.
- ``entropy_mean``: mean over response positions of the trainer's full-vocabulary entropy.
- ``pass_at_k``: mean over prompts of the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` (n samples,
  c correct).

Exposure (:func:`exposure_metrics`), per step, in the engine's view of each sequence of ``P`` prompt
and ``R`` response tokens (it processes positions ``0..P+R-2``: prefill ``0..P-1``, decode
``P..P+R-2``; the last sampled token is never fed back): ``seqs``, ``prompt_tokens``, ``seq_len_max``
(``max(P + R)``), ``seqs_cross_chunk_prefill`` (``P > C``: the prefill's state pass spans more than
one GDN chunk), ``seqs_cross_chunk_decode`` (decode completes a chunk, so CPR's resync runs: some
``k*C - 1`` in ``[P, P+R-2]``), ``seqs_cross_chunk`` (either), ``seqs_multi_kv_block`` (the last
processed position ``P+R-2 >= kv_block``: its attention reads more than one KV block).

Reductions run in float64 on the float32 inputs, so they add no rounding of their own worth
mentioning. Empty inputs give NaN (written as JSON ``null``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from isoexec.io import atomic_write_text

NAN = float("nan")


def logprob_diff_metrics(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor) -> dict[str, float | int]:
    """Mismatch statistics between rollout and trainer logprobs of the same sampled tokens.

    Args:
        rollout_logprobs: ``[N]`` float32, ``lR_t`` as reported by the engine.
        trainer_logprobs: ``[N]`` float32, ``lT_t`` from the pre-update ``trainer_score``.

    Returns:
        ``tokens, mismatch_count, mismatch_rate, logprob_abs_diff_mean, logprob_abs_diff_std,
        logprob_abs_diff_max, k3_kl, is_ratio_mean, is_ratio_min, is_ratio_max, is_ratio_std``.
    """
    lR, lT = rollout_logprobs, trainer_logprobs
    if lR.shape != lT.shape or lR.dim() != 1:
        raise ValueError(f"expected two [N] tensors, got {tuple(lR.shape)} and {tuple(lT.shape)}")
    if lR.dtype != torch.float32 or lT.dtype != torch.float32:
        raise ValueError(f"logprobs must be float32 (bits are compared), got {lR.dtype} and {lT.dtype}")
    n = lR.numel()
    out: dict[str, float | int] = {"tokens": n}
    if n == 0:
        out.update(mismatch_count=0, mismatch_rate=NAN, logprob_abs_diff_mean=NAN, logprob_abs_diff_std=NAN,
                   logprob_abs_diff_max=NAN, k3_kl=NAN, is_ratio_mean=NAN, is_ratio_min=NAN, is_ratio_max=NAN,
                   is_ratio_std=NAN)
        return out
    mismatch = int((lT.contiguous().view(torch.int32) != lR.contiguous().view(torch.int32)).sum())
    d = lT.double() - lR.double()
    a = d.abs()
    r = torch.exp(d)
    out.update(
        mismatch_count=mismatch,
        mismatch_rate=mismatch / n,
        logprob_abs_diff_mean=float(a.mean()),
        logprob_abs_diff_std=float(a.std(correction=0)),
        logprob_abs_diff_max=float(a.max()),
        k3_kl=float((r - d - 1.0).mean()),
        is_ratio_mean=float(r.mean()),
        is_ratio_min=float(r.min()),
        is_ratio_max=float(r.max()),
        is_ratio_std=float(r.std(correction=0)),
    )
    return out


def is_ratio_clip_frac(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, clip_low: float,
                       clip_high: float) -> float:
    """Fraction of tokens whose ``exp(lT - lR)`` lies outside ``[1 - clip_low, 1 + clip_high]``.

    Args:
        rollout_logprobs, trainer_logprobs: ``[N]`` float32 (as :func:`logprob_diff_metrics`).
        clip_low, clip_high: the policy loss's clip bounds (``rl.clip_low``, ``rl.clip_high``).

    Returns:
        A float in [0, 1]; NaN when N = 0; exactly 0.0 when every ``d_t`` is 0.
    """
    if rollout_logprobs.numel() == 0:
        return NAN
    r = torch.exp(trainer_logprobs.double() - rollout_logprobs.double())
    return float(((r < 1.0 - clip_low) | (r > 1.0 + clip_high)).double().mean())


CORRECTION_METRICS = {
    "tis_capped_frac": ("tis_token_clip_high_ratio", "tis_seq_clip_high_ratio"),
    "correction_masked_frac": ("geo_sequence_mask_masked_ratio", "product_sequence_mask_masked_ratio"),
}
"""Row key -> the names SkyRL's off-policy correction reports it under (``off_policy_correction_utils.py``)."""


def correction_metrics(loss_metrics: dict[str, float]) -> dict[str, float]:
    """What an arm's off-policy correction did in a mini-batch, from its policy loss's metrics.

    Args:
        loss_metrics: the metrics SkyRL's policy loss returns (without a prefix).

    Returns:
        ``tis_capped_frac``: share of tokens (token TIS) or sequences (sequence TIS) whose TIS weight hit
        its cap; ``correction_masked_frac``: share of sequences dropped by sequence masking. NaN where the
        arm has no such correction (a mode's own arm: both).
    """
    return {key: next((float(loss_metrics[n]) for n in names if n in loss_metrics), NAN)
            for key, names in CORRECTION_METRICS.items()}


def exposure_metrics(prompt_lens: list[int], response_lens: list[int], chunk_size: int,
                     kv_block: int) -> dict[str, int]:
    """How many sequences of a step exercise GDN chunk boundaries and multi-block attention.

    Args:
        prompt_lens, response_lens: ``P`` and ``R`` (>= 1) of each of the step's sequences, same length.
        chunk_size: the GDN chunk size C (``kernels.chunk_size``).
        kv_block: the attention KV block (``kernels.kv_block``).

    Returns:
        ``seqs, prompt_tokens, seq_len_max, seqs_cross_chunk, seqs_cross_chunk_prefill,
        seqs_cross_chunk_decode, seqs_multi_kv_block`` as defined in the module docstring.

    Raises:
        ValueError: the lists differ in length, or a length is below 1.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(response_lens)} response lengths")
    if any(p < 1 for p in prompt_lens) or any(r < 1 for r in response_lens):
        raise ValueError("prompt and response lengths must be >= 1")
    c = chunk_size
    prefill = [p > c for p in prompt_lens]
    decode = [(p + r - 1) // c > p // c for p, r in zip(prompt_lens, response_lens)]
    return {
        "seqs": len(prompt_lens),
        "prompt_tokens": sum(prompt_lens),
        "seq_len_max": max((p + r for p, r in zip(prompt_lens, response_lens)), default=0),
        "seqs_cross_chunk": sum(a or b for a, b in zip(prefill, decode)),
        "seqs_cross_chunk_prefill": sum(prefill),
        "seqs_cross_chunk_decode": sum(decode),
        "seqs_multi_kv_block": sum(p + r - 2 >= kv_block for p, r in zip(prompt_lens, response_lens)),
    }


def full_vocab_kl(rollout_rows: torch.Tensor | None, trainer_rows: torch.Tensor) -> float:
    """Mean over positions of KL(rollout || trainer) over the whole vocabulary.

    Args:
        rollout_rows: ``[P, V]`` full-vocabulary logprobs from the engine at P positions, or None
            when the engine does not provide them (then NaN).
        trainer_rows: ``[P, V]`` trainer logprobs at the same positions.

    Tokens with rollout probability 0 (logprob ``-inf``) contribute 0.
    """
    if rollout_rows is None or rollout_rows.numel() == 0:
        return NAN
    if rollout_rows.shape != trainer_rows.shape:
        raise ValueError(f"row shapes differ: {tuple(rollout_rows.shape)} vs {tuple(trainer_rows.shape)}")
    lR, lT = rollout_rows.double(), trainer_rows.double()
    pR = lR.exp()
    terms = torch.where(pR > 0, pR * (lR - lT), torch.zeros_like(pR))
    return float(terms.sum(-1).mean())


def entropy_mean(logprob_rows: torch.Tensor) -> float:
    """Mean over rows of ``-sum_v p(v) log p(v)`` for ``[N, V]`` logprob rows (NaN when N = 0)."""
    if logprob_rows.numel() == 0:
        return NAN
    lp = logprob_rows.double()
    p = lp.exp()
    return float(-torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1).mean())


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)``.

    Args:
        n: samples drawn; c: correct samples (0 <= c <= n); k: 1 <= k <= n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(rewards: torch.Tensor, k: int) -> float:
    """Mean pass@k over prompts from ``[P, G]`` 0/1 rewards (G samples per prompt)."""
    if rewards.numel() == 0:
        return NAN
    g = rewards.shape[1]
    return sum(pass_at_k(g, int(row.sum()), k) for row in (rewards > 0.5)) / rewards.shape[0]


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # NaN / inf are not JSON: written as null (pandas reads NaN)
    return v


class MetricsLog:
    """``metrics.jsonl``: one JSON object per step, the whole file rewritten atomically each step.

    A crash never leaves a half-written line: the file on disk is always a complete earlier version.
    Starting a run truncates the file (``rows`` starts empty).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        atomic_write_text(self.path, "")

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append({k: _json_value(v) for k, v in row.items()})
        text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in self.rows)
        atomic_write_text(self.path, text)
