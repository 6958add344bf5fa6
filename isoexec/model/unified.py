"""The unified model (docs/design.md): one definition for trainer and engine, the four cases of one forward.

A batch is a list of sequence pieces, each with its absolute start position and (engine cases) a
:class:`~isoexec.model.cache.SequenceCache`. ``trainer_logprobs`` (``trainer_fwd`` / ``trainer_score``)
runs packed or padded sequences from position 0; ``engine_step`` runs prefill chunks and decode
tokens of many sequences from their caches. Every region runs through the kernel set, so the same
token gets the same bits in every case when the set is ``isoexec``.

The family members (:mod:`isoexec.model.qwen3_next`, :mod:`isoexec.model.qwen3_5`) differ only in
their Gated DeltaNet projections; :meth:`UnifiedModel.from_config` picks one.
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec.kernels import KernelSet
from isoexec.kernels.attention.rope import rope_inv_freq
from isoexec.model.cache import SequenceCache
from isoexec.model.inputs import InputError, check_attention_mask, check_cu_seqlens, check_token_ids
from isoexec.model.layers import Attention, Backbone, Batch, GatedDeltaNet, W, count_changes


class UnifiedModel(nn.Module):
    """The unified model: one definition for trainer and engine. A family member (Qwen3-Next,
    Qwen3.5) sets :attr:`gdn_class`; build with :meth:`from_config` or :meth:`from_pretrained`, which
    pick the member from the config's ``model_type``.

    Args:
        config: a transformers ``Qwen3NextConfig`` or ``Qwen3_5MoeTextConfig`` (text-only positions make
            Qwen3.5's M-RoPE plain RoPE).
        kernels: the :class:`~isoexec.kernels.KernelSet` every region runs through.
        dtype: parameter and boundary dtype (bf16 or fp32).
    """

    gdn_class: type[GatedDeltaNet] = GatedDeltaNet
    model_types: tuple[str, ...] = ()

    def __init__(self, config, kernels: KernelSet, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config, self.kernels = config, kernels
        self.model = Backbone(config, self.gdn_class)
        self.lm_head = W(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        att = next((m for m in self.modules() if isinstance(m, Attention)), None)
        head_dim = att.d if att else getattr(config, "head_dim", 64)
        rp = getattr(config, "rope_parameters", None) or {}
        theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        # fp32 RoPE frequencies, a plain attribute so that ``.to(dtype)`` never rounds them.
        self.inv_freq = rope_inv_freq(head_dim, factor, theta)
        self._inv_freq_on = (self.inv_freq, self.inv_freq)  # (source, its copy on the parameters' device): :meth:`_run`
        self.decode_graphs = None  # :meth:`enable_decode_graphs`
        self.to(dtype)
        for m in self.modules():  # any replaced parameter or submodule bumps W.epoch (what the decode graphs check)
            count_changes(m, "_parameters", "_modules")

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ------------------------------------------------------------------------------------- forward
    def _hidden(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        ks = self.kernels
        x = ks["embed"](self.model.embed_tokens.weight, ids)
        for layer in self.model.layers:
            x = layer(ks, x, batch)
        return ks["norm.rms"](x, self.model.norm.weight, self.config.rms_norm_eps)

    def _logprobs(self, h: torch.Tensor) -> torch.Tensor:
        return self.kernels["logprob"](self.kernels["lm_head"](h, self.lm_head.weight))

    def inv_freq_on(self, dev: torch.device) -> torch.Tensor:
        """:attr:`inv_freq` on ``dev``: one copy per device, not one per forward."""
        src, on = self._inv_freq_on
        if src is not self.inv_freq or on.device != dev:
            self._inv_freq_on = (self.inv_freq, self.inv_freq.to(dev))
        return self._inv_freq_on[1]

    def _run(self, ids, seq_rows, starts, caches, grad: bool, rows_out=None):
        dev = self.model.embed_tokens.weight.device
        batch = Batch(seq_rows, starts, caches, grad, ids.numel(), self.inv_freq_on(dev), self.dtype)
        ids = ids.to(dev)
        with torch.set_grad_enabled(grad):
            h = self._hidden(ids, batch)
            if rows_out is not None:
                h = h[rows_out.to(h.device)]
            return self._logprobs(h)

    def trainer_logprobs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """Full-vocabulary logprobs of a packed (varlen) batch: ``trainer_fwd`` (grad) / ``trainer_score``.

        Args:
            input_ids: ``[T]`` int64, sequences concatenated.
            cu_seqlens: ``[B+1]`` int64 offsets (0, len_0, len_0+len_1, ...).
            grad: True builds the autograd graph (``trainer_fwd``).

        Returns:
            ``[T, V]`` fp32; row t is the distribution of the token following ``input_ids[t]``,
            with the contract's temperature applied.

        Raises:
            isoexec.model.inputs.InputError: an id outside ``[0, V)``; no sequence or an empty one;
                cu_seqlens not starting at 0, decreasing, or not ending at T.
        """
        cu = check_cu_seqlens(cu_seqlens, input_ids.numel())
        check_token_ids(input_ids, self.config.vocab_size)
        rows = [torch.arange(a, b) for a, b in zip(cu, cu[1:])]
        return self._run(input_ids, rows, [0] * len(rows), [None] * len(rows), grad)

    def trainer_logprobs_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """Same as :meth:`trainer_logprobs` for a right-padded ``[B, L]`` batch.

        Row-wise regions run over all ``B*L`` rows (pads included); attention, conv and GDN see each
        sequence's real tokens. Returns ``[B, L, V]`` fp32 (pad rows are meaningless).

        Raises:
            isoexec.model.inputs.InputError: an id outside ``[0, V)`` (pad positions included: every
                row is embedded); an empty batch or an all-zero mask row; a mask that is not
                right-padded (ones then zeros) in some row.
        """
        B, L = input_ids.shape
        lens = check_attention_mask(attention_mask)
        check_token_ids(input_ids, self.config.vocab_size)
        rows = [b * L + torch.arange(int(n)) for b, n in enumerate(lens)]
        out = self._run(input_ids.reshape(-1), rows, [0] * B, [None] * B, grad)
        return out.view(B, L, -1)

    def new_cache(self) -> SequenceCache:
        """An empty per-sequence engine cache, stamped with this kernel set's fingerprint (in a slot of the decode
        graphs' pools when :meth:`enable_decode_graphs` was called)."""
        if self.decode_graphs is not None:
            return self.decode_graphs.new_cache()
        return SequenceCache(policy=self.kernels.fingerprint)

    def enable_decode_graphs(self, max_seqs: int, max_len: int, sizes: list[int] | None = None):
        """Run :meth:`engine_step`'s decode steps of pooled sequences under CUDA graphs, same bits
        (:class:`~isoexec.model.graphs.DecodeGraphs`; caches made by :meth:`new_cache` from now on are pooled).

        Args:
            max_seqs: sequences held in the pools at once (more run eagerly). max_len: tokens per sequence.
            sizes: batch sizes to capture (default 1, 2, 4 and multiples of 8 up to ``max_seqs``).

        Returns:
            the :class:`~isoexec.model.graphs.DecodeGraphs` (its ``stats`` count replays and captures).

        Raises:
            ValueError: a model off CUDA or a kernel set without slot kernels (the isoexec CUDA set has them).
        """
        from isoexec.model.graphs import DecodeGraphs

        self.decode_graphs = DecodeGraphs(self, max_seqs, max_len, sizes)
        return self.decode_graphs

    @torch.no_grad()
    def engine_step(self, caches: list[SequenceCache], chunks: list[torch.Tensor], last_only: bool = False) -> list[torch.Tensor]:
        """One engine step: prefill chunks (``L_i > 1``) and decode tokens (``L_i == 1``) of many sequences.

        Args:
            caches: per sequence, its :class:`SequenceCache` (updated in place).
            chunks: per sequence, the new token ids ``[L_i]`` (int64), L_i >= 1.
            last_only: return only the last row per sequence (what sampling needs).

        Returns:
            per sequence ``[L_i, V]`` (or ``[1, V]``) fp32 full-vocabulary logprobs; row j predicts the
            token after ``chunks[i][j]``. Bits do not depend on the other sequences or on chunking.

        Raises:
            ValueError: mismatched lengths, a cache built under another kernel set or other
                constants (its ``policy`` fingerprint differs), or a pooled sequence that would exceed its pools'
                capacity (:meth:`enable_decode_graphs`; nothing of the step runs).
            isoexec.model.inputs.InputError: no chunk, an empty chunk, or an id outside ``[0, V)``.
        """
        if len(caches) != len(chunks):
            raise ValueError(f"{len(caches)} caches for {len(chunks)} chunks")
        fp = self.kernels.fingerprint
        foreign = [c.policy for c in caches if c.policy != fp]
        if foreign:
            raise ValueError(f"a sequence cache built under kernel-set fingerprint {foreign[0]} cannot continue under "
                             f"{fp} ({self.kernels.mode}/{self.kernels.arch}): start the sequence again")
        if not chunks or any(c.numel() == 0 for c in chunks):
            raise InputError("empty input: engine_step needs at least one chunk, each of at least one token")
        ids = torch.cat(chunks)
        check_token_ids(ids, self.config.vocab_size, "chunks (concatenated)")  # one check (one sync) per step
        lens = [c.numel() for c in chunks]
        for c, n in zip(caches, lens):  # before any layer runs: a refusal leaves every cache as it was
            if c.pools is not None:
                c.pools.check_fits(c.position + n)
        if self.decode_graphs is not None and self.decode_graphs.accepts(caches, lens):
            out = self.decode_graphs.step(caches, ids.to(self.model.embed_tokens.weight.device))
            for c in caches:
                c.position += 1
            return list(out.unsqueeze(1).unbind(0))
        rows = list(torch.arange(ids.numel()).split(lens))
        starts = [c.position for c in caches]
        rows_out = torch.cumsum(torch.tensor(lens), 0) - 1 if last_only else None
        out = self._run(ids, rows, starts, caches, False, rows_out)
        for c, n in zip(caches, lens):
            c.position += n
        if last_only:
            return list(out.unsqueeze(1).unbind(0))
        return list(out.split(lens))

    # ------------------------------------------------------------------------- checkpoints, contract
    @staticmethod
    def from_config(config, kernels: KernelSet, dtype: torch.dtype = torch.bfloat16) -> "UnifiedModel":
        """The family member for ``config.model_type`` (Qwen3-Next or Qwen3.5 MoE text).

        Raises:
            ValueError: a model type no family member handles (naming the supported ones).
        """
        from isoexec.model.qwen3_5 import Qwen3_5Model
        from isoexec.model.qwen3_next import Qwen3NextModel

        mt = str(getattr(config, "model_type", ""))
        for member in (Qwen3NextModel, Qwen3_5Model):
            if mt in member.model_types:
                return member(config, kernels, dtype)
        raise ValueError(f"model_type={mt!r} is not supported; supported: "
                         f"{list(Qwen3NextModel.model_types + Qwen3_5Model.model_types)}")

    @classmethod
    def from_pretrained(cls, path, kernel_set: str = "isoexec", kernels=None, device: str = "cpu", dtype: torch.dtype | None = None) -> "UnifiedModel":
        """Load a Hugging Face checkpoint folder (``Qwen3NextForCausalLM`` or a Qwen3.5 MoE text model).

        Args:
            path: folder with ``config.json`` and ``*.safetensors``.
            kernel_set: "isoexec" or "native". kernels: an ``isoexec.config.KernelSection`` with the
                pinned constants (defaults if None). device: "cpu" or "cuda".
            dtype: parameter dtype; default the checkpoint's ``dtype``.

        Raises:
            isoexec.model.hf.CheckpointError: tensors that contradict the config (missing, extra,
                another shape or dtype, a tied head that differs from the embedding).
            FileNotFoundError / ValueError from :mod:`isoexec.model.hf`.
        """
        from isoexec.kernels import build_kernel_set
        from isoexec.model.hf import check_checkpoint, config_dtype, read_config, read_weights

        check_checkpoint(path)
        cfg = read_config(path)
        dtype = dtype or config_dtype(cfg)
        model = UnifiedModel.from_config(cfg, build_kernel_set(kernel_set, device, kernels), dtype)
        sd = read_weights(path)
        if getattr(cfg, "tie_word_embeddings", False):
            sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
        model.load_state_dict(sd, strict=True)
        return model.to(device)

    def save_pretrained(self, path) -> None:
        """Write a Hugging Face checkpoint folder (``config.json`` + ``model.safetensors``) loadable by
        transformers and vLLM."""
        from isoexec.model.hf import write_checkpoint

        cfg = self.config
        cfg.dtype = self.dtype
        sd = self.state_dict()
        if getattr(cfg, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        write_checkpoint(path, cfg, sd)

    def contract(self, deployment: dict | None = None):
        """The :class:`~isoexec.contract.ExecutionContract` of this model and kernel set (all four cases)."""
        return build_contract(self.config, self.kernels, self.dtype, deployment)


def build_contract(config, kernels: KernelSet, dtype: torch.dtype, deployment: dict | None = None):
    """The execution contract of a model of ``config`` run by ``kernels`` with parameters in ``dtype``.

    One builder for the unified model and for trainers that run the same kernel set inside another
    framework (the Megatron trainer), so both sides produce the same ``numerical_policy``. The topology
    claim is the kernel set's proven domain (:attr:`KernelSet.topology`; a single-degree domain is
    pinned).
    """
    import hashlib
    import json

    from isoexec.contract import CASES, Claims, CompositionEntry, ExecutionContract, TopologyClaim

    cfg = {k: v for k, v in sorted(config.to_dict().items()) if k not in _NON_SEMANTIC_CONFIG_KEYS}
    model = {
        "architecture": (config.architectures or ["Qwen3NextForCausalLM"])[0],
        "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest(),
        "param_dtype": str(dtype).replace("torch.", ""),
    }
    comp = [
        CompositionEntry(i.region, CASES, i.impl_id, i.version, i.arch, i.constants_for(dtype), i.proof)
        for i in kernels.composition(dtype)
    ]
    topology = {dim: TopologyClaim(domain=dom, pinned=dom[0] if len(dom) == 1 else None)
                for dim, dom in kernels.topology.items()}
    claims = Claims(
        topology=topology,
        state={
            "weight_sync": ("prefix_cache", "kv_cache", "gdn_state", "conv_state"),
            "preemption": ("kv_cache", "gdn_state", "conv_state"),
        },
        tolerances={"logprob_abs_diff": 0.0} if kernels.name == "isoexec" else {},
        # what the engine runs with (isoexec.engines.options refuses other values at engine start)
        engine={"enable_prefix_caching": False, "quantization": "none", "kv_cache_dtype": "auto"},
    )
    return ExecutionContract.build(model=model, cases=CASES, composition=comp, claims=claims,
                                   deployment=deployment or {"torch_num_threads": torch.get_num_threads()})


_NON_SEMANTIC_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "use_cache", "architectures", "_name_or_path",
                             "output_router_logits", "router_aux_loss_coef", "initializer_range"}
