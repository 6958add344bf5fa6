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
and the value isoexec mode allows. Which fields are refused is ``isoexec.engines.options.SAMPLING_OPTIONS``,
the classification of every ``SamplingParams`` field. The native engine runs :class:`NativeRequestGuard`,
which refuses only the fields a vLLM bug makes wrong in both modes (``logprob_token_ids``).

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.renderers.hf import HfRenderer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from isoexec.model.inputs import check_token_ids

GUARD = "isoexec.engines.requests:IsoExecRequestGuard"
"""The guard's qualified name, as passed in vLLM's ``logits_processors`` engine argument."""

NATIVE_GUARD = "isoexec.engines.requests:NativeRequestGuard"
"""The native engine's guard (fields refused in both modes)."""

RENDERER_MODE = "isoexec"
"""vLLM renderer mode (engine argument ``tokenizer_mode``) registered for :class:`IsoExecRenderer`."""


class RequestRefused(VLLMValidationError):
    """A request setting that isoexec mode does not cover (the message names each one and its allowed value)."""


def check_sampling_params(params: Any, mode: str = "isoexec") -> None:
    """Refuse a request whose sampling settings ``mode`` does not cover (``isoexec.engines.options.SAMPLING_OPTIONS``).

    Args:
        params: the request's ``vllm.SamplingParams``.
        mode: ``"isoexec"`` (every refused field) or ``"native"`` (the fields refused in both modes: a vLLM
            bug, e.g. ``logprob_token_ids``).

    Raises:
        RequestRefused: names every refused setting with its value, the allowed values and why, e.g.
            ``"isoexec mode refuses this request: top_k=5 (allowed: 0 or -1; reshapes ...)"``.
    """
    from .options import sampling_violations

    bad = sampling_violations(params, mode)
    if bad:
        listed = "; ".join(f"{k}={v!r} (allowed: {opt.allowed_text()}; {opt.why})" for k, v, opt in bad)
        raise RequestRefused(
            f"{mode} mode refuses this request: {listed}." + (
                " The engine returns the policy's own logprob rows and must sample from them unmodified."
                if mode == "isoexec" else ""),
            parameter=bad[0][0], value=bad[0][1],
        )


def refuse_keywords(api: str, given: Mapping[str, Any], accepted: Sequence[str]) -> None:
    """Refuse keywords that ``api`` does not take, naming each with the value it would need.

    Raises:
        RequestRefused: for each keyword: a sampling setting isoexec mode refuses, with the values it is
            fixed at (the engine samples the policy unmodified in both modes), or "not a setting"; plus the
            accepted keywords.
    """
    if not given:
        return
    from .options import REFUSED, SAMPLING_OPTIONS

    def what(k: str) -> str:
        opt = SAMPLING_OPTIONS.get(k)
        return f"fixed at {opt.allowed_text()}" if opt is not None and opt.kind == REFUSED else "not a setting"

    parts = [f"{k}={v!r} ({what(k)})" for k, v in given.items()]
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

    mode = "isoexec"

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        check_sampling_params(sampling_params, cls.mode)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for _, params, _, _ in batch_update.added:
                check_sampling_params(params, self.mode)


class NativeRequestGuard(IsoExecRequestGuard):
    """The same check for the native engine, limited to the fields refused in both modes (vLLM bugs that
    would make the negative control silently wrong, e.g. ``logprob_token_ids``); ``apply`` is the identity,
    so the native engine's rows are vLLM's own."""

    mode = "native"


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
        """Refuse a prompt at admission: ids that are not integers or lie outside ``[0, V)``, or an engine of
        this process that computes with weights changed since their last check
        (``isoexec.engines.engine_weights.check_admission``).

        Raises:
            isoexec.model.inputs.InputError: naming the first bad id, its position and V.
            isoexec.engines.weight_sync.WeightSyncError: the engine's weights changed outside the checked path.
        """
        from .engine_weights import check_admission

        check_token_ids(token_ids, self.model_config.get_vocab_size(), parameter or "prompt_token_ids")
        check_admission(self.model_config)

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
