"""SkyRL's ``InferenceEngineInterface`` over isoexec's vLLM engine (:class:`~isoexec.rl.skyrl.engine_actor.EngineActor`).

The client is what SkyRL holds: ``SkyRLGymGenerator`` calls :meth:`IsoExecInferenceClient.generate`
(token in, token out, batched), and the policy workers' weight sync calls
:meth:`IsoExecInferenceClient.update_named_weights`. It is picklable (Ray actor handles and
plain settings), so the same client reaches the trainer's worker processes through SkyRL's
``init_weight_sync_state``.

With several engines (data parallel, ``engine.num_engines``) a batch's prompts are split into
contiguous shards, one per engine, generated concurrently and concatenated in prompt order; every
weight sync goes to every engine, and their checksums must agree. In isoexec mode the split moves no
bit of any logprob (batch invariance); which tokens are sampled depends on the shard's seed
(:func:`isoexec.rl.skyrl.engine_actor.shard_seed`).

Sampling parameters (SkyRL's vLLM dict, ``get_vllm_sampling_params``) are checked at this boundary:
the engine samples from the policy itself, so only ``top_p == 1``, ``top_k in {-1, 0}``,
``min_p == 0``, ``repetition_penalty == 1``, no ``stop`` strings and ``logprobs`` set are served,
anything else raises ``ValueError`` naming the key. ``min_tokens`` (SkyRL always sends 1) is
served as 0: masking EOS would sample from another distribution than the policy whose logprobs the
engine reports. ``skip_special_tokens`` is not honoured for the text handed to the environment:
responses are decoded *with* special tokens, so the task's reward rule sees the EOS
(:class:`isoexec.rl.skyrl.env.DapoMathEnv`).

Weight sync request (``update_named_weights``): ``{"safetensors": bytes, "contract": bytes | None}``,
the trainer's tensors under Hugging Face names and its contract (canonical JSON; None in native
mode). The engine runs the handshake before any weight moves.
"""

from __future__ import annotations

import asyncio
from typing import Any, Hashable

import ray
from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)

SERVED = {"top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
"""Sampling settings that must have exactly these values (absent keys take them)."""
IGNORED = {"min_tokens", "skip_special_tokens", "include_stop_str_in_output", "n"}


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``shards`` contiguous shards of ``n`` items, sizes differing by at most one
    (the first ``n % shards`` shards one larger); empty shards are left out."""
    base, extra = divmod(n, shards)
    bounds, start = [], 0
    for i in range(shards):
        stop = start + base + (i < extra)
        if stop > start:
            bounds.append((start, stop))
        start = stop
    return bounds


def check_sampling_params(params: dict[str, Any]) -> tuple[int, float]:
    """Validate SkyRL's per-batch vLLM sampling dict; return ``(max_tokens, temperature)``.

    Raises:
        ValueError: a setting the engine does not serve, naming the key, its value and what is allowed.
    """
    bad = []
    for k, want in SERVED.items():
        if k in params and params[k] is not None and float(params[k]) != want:
            bad.append(f"{k}={params[k]!r} (allowed: {want})")
    if params.get("top_k") not in (None, -1, 0):
        bad.append(f"top_k={params['top_k']!r} (allowed: -1 or 0, no top-k)")
    if params.get("stop"):
        bad.append(f"stop={params['stop']!r} (allowed: None; the engine stops at EOS only)")
    if params.get("logprobs") is None:
        bad.append("logprobs=None (allowed: an int; the run compares the engine's logprobs with the trainer's)")
    if params.get("n", 1) != 1:
        bad.append(f"n={params['n']!r} (allowed: 1; SkyRL repeats prompts instead)")
    if params.get("min_tokens", 0) not in (0, 1):
        bad.append(f"min_tokens={params['min_tokens']!r} (allowed: 0 or 1, served as 0)")
    known = set(SERVED) | IGNORED | {"top_k", "stop", "logprobs", "max_tokens", "temperature"}
    bad += [f"{k}={params[k]!r} (not served by the isoexec engine)" for k in sorted(set(params) - known)
            if params[k] is not None]
    if "max_tokens" not in params or "temperature" not in params:
        bad.append("max_tokens and temperature are required")
    if bad:
        raise ValueError("sampling parameters not served by isoexec's engine: " + "; ".join(bad))
    return int(params["max_tokens"]), float(params["temperature"])


class IsoExecInferenceClient(InferenceEngineInterface):
    """``InferenceEngineInterface`` over one or more :class:`EngineActor` s (Ray actor handles).

    Args:
        actors: handles of running ``EngineActor`` s, in shard order (``shard=i`` for the i-th).
        tokenizer_path: directory of the tokenizer (the checkpoint); loaded lazily, per process.
        model_name: what :attr:`model_name` reports (the checkpoint path).
    """

    def __init__(self, actors: list[Any], tokenizer_path: str, model_name: str):
        if not actors:
            raise ValueError("IsoExecInferenceClient needs at least one engine actor, got none")
        self.actors = list(actors)
        self.tokenizer_path = tokenizer_path
        self._model_name = model_name
        self._tokenizer = None
        self.weight_version = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None  # reloaded on demand in the receiving process
        return state

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from isoexec.rl.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        """Token-in, token-out generation of one sample per prompt (``prompt_token_ids`` only).

        Raises:
            ValueError: chat ``prompts`` instead of token ids, a ``cache_salt`` / multimodal /
                sample-support request, or sampling parameters the engine does not serve.
        """
        if input_batch.get("prompts") is not None or input_batch.get("prompt_token_ids") is None:
            raise ValueError("isoexec's engine takes prompt_token_ids (token in, token out), not chat prompts")
        for k in ("mm_features", "cache_salt", "routed_experts_prompt_starts"):
            if input_batch.get(k) is not None:
                raise ValueError(f"{k}={input_batch[k]!r} is not served by isoexec's engine (allowed: None)")
        if input_batch.get("return_sample_support"):
            raise ValueError("return_sample_support=True is not served by isoexec's engine")
        max_tokens, temperature = check_sampling_params(dict(input_batch.get("sampling_params") or {}))
        prompts = [list(map(int, p)) for p in input_batch["prompt_token_ids"]]
        outs = await asyncio.gather(*[actor.generate.remote(prompts[a:b], max_tokens, temperature)
                                      for actor, (a, b) in zip(self.actors, shard_bounds(len(prompts),
                                                                                         len(self.actors)))])
        response_ids = [r for o in outs for r in o["response_ids"]]
        return InferenceEngineOutput(
            responses=[self.tokenizer.decode(r, skip_special_tokens=False) for r in response_ids],
            response_ids=response_ids,
            stop_reasons=[r for o in outs for r in o["stop_reasons"]],
            response_logprobs=[r for o in outs for r in o["logprobs"]],
            prompt_logprobs=None,
            rollout_expert_indices=None,
            rollout_sample_support=None,
        )

    async def update_named_weights(self, request: dict[str, Any]):
        """Weight sync through the engine, contract handshake first (see module docstring).

        Returns:
            name -> checksum as reported by the engines after the sync.

        Raises:
            isoexec.engines.weight_sync.WeightSyncError: the engines report different checksums.
        """
        from isoexec.engines.weight_sync import WeightSyncError

        if set(request) != {"safetensors", "contract"}:
            raise ValueError(f"update_named_weights takes {{'safetensors', 'contract'}}, got keys {sorted(request)}")
        payload = ray.put(request["safetensors"])  # one copy in the object store for every engine
        sums = await asyncio.gather(*[a.update_weights.remote(payload, request["contract"]) for a in self.actors])
        differ = sorted(k for k in sums[0] if any(s.get(k) != sums[0][k] for s in sums[1:]))
        if differ or any(set(s) != set(sums[0]) for s in sums[1:]):
            raise WeightSyncError(f"engines report different checksums after the sync: {differ[:5]}")
        return sums[0]

    def full_rows(self, keys: list[tuple[list[int], list[int]]]) -> list:
        """Engine full-vocabulary rows of the last batch for ``(prompt ids, response ids)`` keys (blocking;
        each key from whichever engine generated it, None where none kept one)."""
        per_engine = ray.get([a.full_rows.remote(keys) for a in self.actors])
        return [next((rows[i] for rows in per_engine if rows[i] is not None), None) for i in range(len(keys))]

    def increment_weight_version(self) -> None:
        """Called by SkyRL after each weight sync; the version is recorded only (no prefix cache here)."""
        self.weight_version += 1

    async def get_world_size(self) -> tuple[int, int]:
        return len(self.actors), 1

    def get_endpoint_url(self) -> str:
        raise NotImplementedError("isoexec's engine has no HTTP endpoint (token in, token out through Ray)")

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("isoexec's engine serves token-in/token-out generate only")

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("isoexec's engine serves token-in/token-out generate only")

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("isoexec's engine serves token-in/token-out generate only")

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        raise NotImplementedError("LoRA is not part of the isoexec contract")

    # The engine is idle between batches and its weights change only through update_named_weights
    # (which drops every per-request cache), so the residency / pause calls have nothing to do.
    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def is_sleeping(self) -> bool:
        return False

    async def pause_generation(self) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        return None  # prefix caching is refused by the engine's contract check

    async def finish_session(self, session_id: Hashable) -> None:
        return None

    async def teardown(self) -> None:
        await asyncio.gather(*[a.shutdown.remote() for a in self.actors])
