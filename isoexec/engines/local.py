"""A rollout engine in plain PyTorch: samples with any trainer policy, no KV cache, no vLLM.

The ``local`` engine backend (``engine.backend: local``): used by the SFT evaluation (accuracy of
the warm start), by the unit tests of the RL loop, and as a stand-in engine when vLLM is not wanted. Each new token is one full forward of every unfinished
sequence through ``policy.trainer_logprobs(..., grad=False)``; the sampled token's logprob and the
whole row are returned, so ``full_vocab_kl`` is available.

It is not a fast engine (quadratic in the response length), which is fine for responses of a few
tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from isoexec.engines.base import Completion
from isoexec.model.inputs import check_generate_args
from isoexec.trainer.base import Policy, sync_state


class LocalEngine:
    """Sample from ``policy`` (its own temperature; ``temperature=0`` in :meth:`generate` is greedy).

    Args:
        policy: anything with ``trainer_logprobs`` and ``named_parameters`` (HF names).
        eos_token_id: stops a sequence once sampled (kept as its last token).
    """

    def __init__(self, policy: Policy, eos_token_id: int):
        self.policy = policy
        self.eos_token_id = eos_token_id

    @property
    def load_checksums(self) -> dict[str, str]:
        """Checksums (HF names) of the weights this engine samples with (its policy's, as a sync sends them)."""
        from .weight_sync import state_checksums

        return state_checksums(sync_state(self.policy))

    @torch.no_grad()
    def generate(
        self, prompt_token_ids: list[list[int]], n: int, max_tokens: int, seed: int, temperature: float
    ) -> list[list[Completion]]:
        """``n`` samples per prompt, at most ``max_tokens`` each; deterministic in ``seed``.

        ``temperature`` must be 0 (greedy) or the policy's temperature (the logprobs already carry it).

        Raises:
            isoexec.model.inputs.InputError: no prompt, an empty prompt, ``n < 1`` or ``max_tokens < 1``;
                ids outside the vocabulary are refused by the policy's ``trainer_logprobs``.
        """
        check_generate_args(prompt_token_ids, n, max_tokens, None)
        pol_t = getattr(self.policy, "temperature", 1.0)
        if temperature != 0 and temperature != pol_t:
            raise ValueError(f"LocalEngine samples at the policy temperature {pol_t}, asked for {temperature}")
        gen = torch.Generator().manual_seed(int(seed))
        seqs = [list(p) for p in prompt_token_ids for _ in range(n)]
        resp: list[list[int]] = [[] for _ in seqs]
        lps: list[list[torch.Tensor]] = [[] for _ in seqs]
        rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for _ in range(max_tokens):
            if not active:
                break
            lens = torch.tensor([len(seqs[a]) for a in active])
            cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
            ids = torch.tensor([t for a in active for t in seqs[a]], dtype=torch.long)
            last = self.policy.trainer_logprobs(ids, cu, grad=False)[cu[1:] - 1]  # [A, V] float32
            if temperature == 0:
                tok = last.argmax(-1)
            else:
                tok = torch.multinomial(last.exp(), 1, generator=gen).squeeze(1)
            still = []
            for i, a in enumerate(active):
                t = int(tok[i])
                seqs[a].append(t)
                resp[a].append(t)
                lps[a].append(last[i, t])
                rows[a].append(last[i])
                if t != self.eos_token_id:
                    still.append(a)
            active = still
        comps = [Completion(resp[i], torch.stack(lps[i]), torch.stack(rows[i]),
                            "stop" if resp[i][-1] == self.eos_token_id else "length") for i in range(len(seqs))]
        return [comps[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    @torch.no_grad()
    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], trainer_contract: Any = None) -> None:
        """Copy the trainer's tensors (checkpoint names) into this engine's policy; every name must exist.

        :func:`isoexec.trainer.base.sync_state` of the engine's own policy gives views of its
        parameters under the same names, so copying into them updates the parameters in place.
        """
        targets = sync_state(self.policy)
        missing = sorted(set(targets) - set(state_dict))
        if missing:
            raise KeyError(f"weight sync lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for name, t in targets.items():
            t.copy_(state_dict[name])
