"""GRPO with DAPO's choices: group-relative advantages, token-level loss, clip-higher, no KL term.

- Advantages (:func:`group_advantages`): for the G samples of one prompt, ``A_i = r_i - mean(r)``,
  divided by ``std(r) + eps`` when ``std_norm`` (GRPO/DAPO); every token of a response gets its
  response's advantage.
- Policy loss (:func:`policy_loss`): PPO's clipped surrogate with asymmetric bounds
  ``clip(ratio, 1 - clip_low, 1 + clip_high)`` (DAPO clip-higher: 0.2 / 0.28), averaged over *all
  tokens of the batch* (token-level, not per sequence then per batch), with no KL penalty.
- The ratio is ``exp(logp_new - logp_old)`` where ``logp_old`` is the trainer's own pre-update
  ``trainer_score``; the rollout-vs-trainer ratio is only a metric (:mod:`isoexec.rl.metrics`).
- Dynamic sampling (optional, :func:`informative_groups`): groups whose rewards are all equal
  carry zero advantage; DAPO drops them from the batch.

:func:`build_batch` packs prompts and responses for the trainer and records which rows of the
``[T, V]`` trainer output score which response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isoexec.engines.base import Completion


def group_advantages(rewards: torch.Tensor, std_norm: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: ``[P, G]`` float, G samples for each of P prompts.
        std_norm: divide by the group's population std (+ ``eps``).

    Returns:
        ``[P, G]`` float32; exactly 0 for a group whose rewards are all equal.
    """
    r = rewards.double()
    a = r - r.mean(dim=1, keepdim=True)
    if std_norm:
        a = a / (r.std(dim=1, keepdim=True, correction=0) + eps)
    return a.float()


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[P]`` bool: groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    return (rewards != rewards[:, :1]).any(dim=1)


def policy_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped policy-gradient loss (DAPO), no KL term.

    Args:
        logp_new: ``[N]`` float32 logprobs of the sampled tokens under the current parameters (autograd).
        logp_old: ``[N]`` float32 pre-update trainer logprobs (no grad).
        advantages: ``[N]`` float32, each token's response advantage.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        mask: ``[N]`` bool, tokens that count (default all); the mean is over the masked tokens.

    Returns:
        ``(loss, stats)``: ``loss = sum_t max(-A_t r_t, -A_t clip(r_t)) / N_tokens``; stats has
        ``clip_frac`` (fraction of tokens where the clipped branch is taken and differs).
    """
    ratio = torch.exp(logp_new - logp_old.detach())
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg1 = -advantages * ratio
    pg2 = -advantages * clipped
    per_token = torch.maximum(pg1, pg2)
    if mask is None:
        mask = torch.ones_like(per_token, dtype=torch.bool)
    n = mask.sum().clamp_min(1)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        clip_frac = float(((pg2 > pg1) & mask).sum() / n)
    return loss, {"clip_frac": clip_frac}


@dataclass
class Batch:
    """Packed prompts + responses of one RL step.

    Attributes:
        input_ids: ``[T]`` long, every sequence (prompt then response) concatenated.
        cu_seqlens: ``[B+1]`` long.
        score_rows: ``[N]`` long, the row of the ``[T, V]`` trainer output that predicts each
            response token (the row of the token before it).
        tokens: ``[N]`` long, the response tokens.
        seq_index: ``[N]`` long, which sequence (0..B-1) each response token belongs to.
        rollout_logprobs: ``[N]`` float32, the engine's logprobs of the response tokens.
        rollout_rows: ``[N, V]`` float32 engine full-vocabulary rows, or None.
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    score_rows: torch.Tensor
    tokens: torch.Tensor
    seq_index: torch.Tensor
    rollout_logprobs: torch.Tensor
    rollout_rows: torch.Tensor | None

    def select(self, seqs: list[int]) -> Batch:
        """The sub-batch of sequences ``seqs`` (in that order), re-packed."""
        parts, lens, rows, toks, sidx, lps, frows = [], [], [], [], [], [], []
        offset = 0
        for new_i, b in enumerate(seqs):
            s, e = int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])
            parts.append(self.input_ids[s:e])
            lens.append(e - s)
            m = self.seq_index == b
            rows.append(self.score_rows[m] - s + offset)
            toks.append(self.tokens[m])
            sidx.append(torch.full((int(m.sum()),), new_i, dtype=torch.long))
            lps.append(self.rollout_logprobs[m])
            if self.rollout_rows is not None:
                frows.append(self.rollout_rows[m])
            offset += e - s
        return Batch(
            input_ids=torch.cat(parts),
            cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lens).cumsum(0)]),
            score_rows=torch.cat(rows),
            tokens=torch.cat(toks),
            seq_index=torch.cat(sidx),
            rollout_logprobs=torch.cat(lps),
            rollout_rows=torch.cat(frows) if self.rollout_rows is not None else None,
        )


def build_batch(prompt_token_ids: list[list[int]], completions: list[list[Completion]]) -> Batch:
    """Pack ``len(prompts) * n`` sequences (prompt-major, sample-minor order) for the trainer."""
    ids, lens, rows, toks, sidx, lps, frows = [], [], [], [], [], [], []
    have_rows = all(c.full_logprobs is not None for group in completions for c in group)
    offset, b = 0, 0
    for prompt, group in zip(prompt_token_ids, completions, strict=True):
        for c in group:
            r = len(c.token_ids)
            if r == 0:
                raise ValueError("the engine returned an empty response")
            if c.logprobs.shape != (r,):
                raise ValueError(f"{r} tokens but logprobs of shape {tuple(c.logprobs.shape)}")
            seq = list(prompt) + list(c.token_ids)
            ids.extend(seq)
            lens.append(len(seq))
            p = len(prompt)
            rows.append(torch.arange(offset + p - 1, offset + p - 1 + r))
            toks.append(torch.tensor(c.token_ids, dtype=torch.long))
            sidx.append(torch.full((r,), b, dtype=torch.long))
            lps.append(c.logprobs.to(torch.float32))
            if have_rows:
                frows.append(c.full_logprobs.to(torch.float32))
            offset += len(seq)
            b += 1
    return Batch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lens).cumsum(0)]),
        score_rows=torch.cat(rows),
        tokens=torch.cat(toks),
        seq_index=torch.cat(sidx),
        rollout_logprobs=torch.cat(lps),
        rollout_rows=torch.cat(frows) if have_rows else None,
    )


def token_logprobs(full: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[N]`` logprobs of the response tokens from the ``[T, V]`` trainer output."""
    return full[batch.score_rows].gather(1, batch.tokens[:, None]).squeeze(1)
