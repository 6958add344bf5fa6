"""One RL step's sequences packed for the trainer (the in-process loop, :mod:`isoexec.rl.loop`).

:func:`build_batch` packs prompts and responses and records which rows of the ``[T, V]`` trainer
output score which response tokens; :meth:`Batch.padded` lays per-token values out as SkyRL's
right-padded ``[B, R]`` rows with a loss mask (the layout of SkyRL's advantage estimators and policy
losses, :mod:`isoexec.rl.skyrl.algorithm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isoexec.engines.base import Completion


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

    def padded(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``values`` ``[N]`` as right-padded rows, one per sequence.

        Returns:
            ``([B, R] values.dtype, [B, R] float32 mask)``; R is the longest response, padding holds 0
            (and keeps ``values``' autograd graph).
        """
        n_seq = len(self.cu_seqlens) - 1
        counts = self.seq_index.bincount(minlength=n_seq)
        first = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]])
        col = torch.arange(len(self.seq_index)) - first[self.seq_index]
        R = int(counts.max())
        flat = self.seq_index * R + col
        out = values.new_zeros(n_seq * R).index_put((flat,), values).view(n_seq, R)
        mask = torch.zeros(n_seq * R).index_put_((flat,), torch.ones(len(flat))).view(n_seq, R)
        return out, mask


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
