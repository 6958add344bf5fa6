"""The unified Qwen3-Next / Qwen3.5 text model: one definition for trainer and engine.

Architecture (transformers ``modeling_qwen3_next.py``; vLLM ``model_executor/models/qwen3_next.py``):
decoder layers of Gated DeltaNet (``linear_attention``) and gated full attention
(``full_attention``) per ``config.layer_types``, each followed by a sparse MoE block (top-k routed
experts + sigmoid-gated shared expert), zero-centred RMSNorm, partial RoPE, untied or tied lm_head.
Parameter names and shapes are the Hugging Face checkpoint's, so ``state_dict()`` loads into
``Qwen3NextForCausalLM`` and vLLM as is.

Every region runs through a :class:`~isoexec.kernels.KernelSet`. One forward serves all four cases:
a batch is a list of sequence pieces, each with its absolute start position and (engine cases) a
:class:`SequenceCache`. Row-wise regions (GEMMs, norms, MoE) see all rows at once; sequence regions
(attention, conv1d, GDN) see each piece with its cache.
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec.kernels import KernelSet
from isoexec.kernels.dense import apply_rope, rope_cos_sin
from isoexec.model.cache import SequenceCache


class _W(nn.Module):
    """A named weight holder (``<name>.weight``), so parameter names match the HF checkpoint."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _W(inter, hidden), _W(inter, hidden), _W(hidden, inter)

    def weights(self):
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight


class _MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.gate = _W(cfg.num_experts, h)
        self.experts = nn.ModuleList([_MLP(h, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])
        self.shared_expert = _MLP(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = _W(1, h)
        # Qwen3.5 always renormalises the top-k weights (no norm_topk_prob field)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, getattr(cfg, "norm_topk_prob", True)

    def forward(self, ks: KernelSet, x):
        return ks.moe(
            x, self.gate.weight, [e.weights() for e in self.experts], self.shared_expert.weights(),
            self.shared_expert_gate.weight, self.top_k, self.norm_topk_prob,
        )


class _DenseMLP(_MLP):
    def forward(self, ks: KernelSet, x):
        g, u, d = self.weights()
        from isoexec.kernels.primitives import silu

        h = (silu(ks.linear(x, g).float()) * ks.linear(x, u).float()).to(x.dtype)
        return ks.linear(h, d)


class _Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        h = cfg.hidden_size
        self.q_proj, self.k_proj = _W(self.hq * self.d * 2, h), _W(self.hkv * self.d, h)
        self.v_proj, self.o_proj = _W(self.hkv * self.d, h), _W(h, self.hq * self.d)
        self.q_norm, self.k_norm = _W(self.d), _W(self.d)
        self.eps = cfg.rms_norm_eps

    def forward(self, ks: KernelSet, x, batch: "_Batch"):
        n = x.shape[0]
        q, gate = ks.linear(x, self.q_proj.weight).view(n, self.hq, 2 * self.d).chunk(2, dim=-1)
        gate = gate.reshape(n, self.hq * self.d)
        q = ks.rms_norm(q, self.q_norm.weight, self.eps)
        k = ks.rms_norm(ks.linear(x, self.k_proj.weight).view(n, self.hkv, self.d), self.k_norm.weight, self.eps)
        v = ks.linear(x, self.v_proj.weight).view(n, self.hkv, self.d)
        q, k = apply_rope(q, *batch.rope), apply_rope(k, *batch.rope)
        kv = []
        for rows, cache in zip(batch.seq_rows, batch.caches):
            kb, vb = k[rows], v[rows]
            if cache is not None and self.layer_idx in cache.kv:
                pk, pv = cache.kv[self.layer_idx]
                kb, vb = torch.cat([pk, kb]), torch.cat([pv, vb])
            if cache is not None:
                cache.kv[self.layer_idx] = (kb.detach(), vb.detach())
            kv.append((kb, vb))
        o = ks.attention(q[batch.all_rows], kv, batch.starts, batch.lengths)
        o = batch.scatter(o, n)
        o = ks.sigmoid_gate(o.reshape(n, self.hq * self.d), gate)
        return ks.linear(o, self.o_proj.weight)


class _GatedDeltaNet(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kc = cfg.linear_conv_kernel_dim
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        h = cfg.hidden_size
        # Qwen3-Next fuses [q|k|v|z] and [b|a] per key-head group; Qwen3.5 keeps four projections.
        self.separate_proj = str(getattr(cfg, "model_type", "")).startswith("qwen3_5")
        if self.separate_proj:
            self.in_proj_qkv, self.in_proj_z = _W(2 * key_dim + value_dim, h), _W(value_dim, h)
            self.in_proj_b, self.in_proj_a = _W(self.hv, h), _W(self.hv, h)
        else:
            self.in_proj_qkvz = _W(2 * key_dim + 2 * value_dim, h)
            self.in_proj_ba = _W(2 * self.hv, h)
        self.conv1d = _W(self.conv_dim, 1, self.kc)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = _W(self.dv)
        self.out_proj = _W(h, value_dim)
        self.eps = cfg.rms_norm_eps

    def _split(self, qkvz, ba):
        """HF ``fix_query_key_value_ordering``: per key-head groups [q | k | v-group | z-group] and [b | a]."""
        n, r = qkvz.shape[0], self.hv // self.hk
        qkvz = qkvz.view(n, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = torch.split(ba.view(n, self.hk, 2 * r), [r, r], dim=-1)
        return q, k, v.reshape(n, self.hv, self.dv), z.reshape(n, self.hv, self.dv), b.reshape(n, self.hv), a.reshape(n, self.hv)

    def _project(self, ks: KernelSet, x):
        """(mixed q|k|v ``[N, conv_dim]``, z ``[N, Hv, Dv]``, b ``[N, Hv]``, a ``[N, Hv]``)."""
        n = x.shape[0]
        if self.separate_proj:
            z = ks.linear(x, self.in_proj_z.weight).view(n, self.hv, self.dv)
            return ks.linear(x, self.in_proj_qkv.weight), z, ks.linear(x, self.in_proj_b.weight), ks.linear(x, self.in_proj_a.weight)
        q, k, v, z, b, a = self._split(ks.linear(x, self.in_proj_qkvz.weight), ks.linear(x, self.in_proj_ba.weight))
        return torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1), z, b, a

    def forward(self, ks: KernelSet, x, batch: "_Batch"):
        n, dtype = x.shape[0], x.dtype
        mixed, z, b, a = self._project(ks, x)
        w = self.conv1d.weight.squeeze(1)
        conv_out = []
        for rows, cache in zip(batch.seq_rows, batch.caches):
            prefix = None if cache is None else cache.conv.get(self.layer_idx)
            if prefix is None:
                prefix = mixed.new_zeros(self.kc - 1, self.conv_dim)
            y, new_prefix = ks.conv1d(mixed[rows], w, prefix)
            if cache is not None:
                cache.conv[self.layer_idx] = new_prefix.detach()
            conv_out.append(y)
        mixed = batch.scatter(torch.cat(conv_out), n)
        key_dim = self.hk * self.dk
        q, k, v = torch.split(mixed, [key_dim, key_dim, self.hv * self.dv], dim=-1)
        g, beta = ks.gdn_gating(a, b, self.A_log, self.dt_bias)
        r = self.hv // self.hk
        q = ks.l2norm(q.reshape(n, self.hk, self.dk)).repeat_interleave(r, dim=1)
        k = ks.l2norm(k.reshape(n, self.hk, self.dk)).repeat_interleave(r, dim=1)
        v = v.reshape(n, self.hv, self.dv).float()
        idx = batch.all_rows
        states = [None if c is None else c.gdn.get(self.layer_idx) for c in batch.caches]
        o, new_states = ks.gdn(q[idx], k[idx], v[idx], g[idx], beta[idx], batch.lengths, states, batch.grad)
        for cache, st in zip(batch.caches, new_states):
            if cache is not None:
                cache.gdn[self.layer_idx] = st
        o = batch.scatter(o, n).to(dtype)
        o = ks.gated_rms_norm(o.reshape(n * self.hv, self.dv), z.reshape(n * self.hv, self.dv), self.norm.weight, self.eps)
        return ks.linear(o.reshape(n, self.hv * self.dv), self.out_proj.weight)


class _DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = _GatedDeltaNet(cfg, layer_idx)
        elif self.layer_type == "full_attention":
            self.self_attn = _Attention(cfg, layer_idx)
        else:
            raise ValueError(f"layer_types[{layer_idx}]={self.layer_type!r}; allowed: linear_attention, full_attention")
        mlp_only = layer_idx in (getattr(cfg, "mlp_only_layers", None) or [])
        sparse = cfg.num_experts > 0 and (layer_idx + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0
        self.mlp = _MoE(cfg) if (sparse and not mlp_only) else _DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm, self.post_attention_layernorm = _W(cfg.hidden_size), _W(cfg.hidden_size)
        self.eps = cfg.rms_norm_eps

    def forward(self, ks: KernelSet, x, batch: "_Batch"):
        h = ks.rms_norm(x, self.input_layernorm.weight, self.eps)
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        x = x + mixer(ks, h, batch)
        h = ks.rms_norm(x, self.post_attention_layernorm.weight, self.eps)
        return x + self.mlp(ks, h)


class _Backbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = _W(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([_DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = _W(cfg.hidden_size)


class _Batch:
    """Row bookkeeping of one forward: which of the N rows belong to which sequence piece."""

    def __init__(self, seq_rows, starts, caches, grad, n_rows, inv_freq, dtype):
        dev = inv_freq.device
        self.seq_rows = [r.to(dev) for r in seq_rows]
        self.starts, self.caches, self.grad = starts, caches, grad
        self.lengths = [int(r.numel()) for r in seq_rows]
        self.all_rows = torch.cat(self.seq_rows) if seq_rows else torch.zeros(0, dtype=torch.long, device=dev)
        positions = torch.zeros(n_rows, dtype=torch.long)
        for rows, s in zip(seq_rows, starts):
            positions[rows] = torch.arange(s, s + rows.numel())
        self.positions = positions.to(dev)
        self.rope = rope_cos_sin(self.positions, inv_freq, dtype)

    def scatter(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """Place per-sequence outputs (concatenated in sequence order) back at their rows; pad rows get 0."""
        out = packed.new_zeros((n, *packed.shape[1:]))
        return out.index_copy(0, self.all_rows, packed)


class UnifiedModel(nn.Module):
    """The unified model. Build with :meth:`from_pretrained` or ``UnifiedModel(hf_config, kernel_set)``.

    Args:
        config: a transformers ``Qwen3NextConfig`` or ``Qwen3_5MoeTextConfig`` (Qwen3.5's GDN keeps
            separate ``in_proj_qkv / z / b / a``; text-only positions make its M-RoPE plain RoPE).
        kernels: the :class:`~isoexec.kernels.KernelSet` every region runs through.
        dtype: parameter and boundary dtype (bf16 or fp32).
    """

    def __init__(self, config, kernels: KernelSet, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config, self.kernels = config, kernels
        self.model = _Backbone(config)
        self.lm_head = _W(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        att = next((m for m in self.modules() if isinstance(m, _Attention)), None)
        head_dim = att.d if att else getattr(config, "head_dim", 64)
        rp = getattr(config, "rope_parameters", None) or {}
        theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        rot = int(head_dim * factor)
        # fp32 RoPE frequencies, a plain attribute so that ``.to(dtype)`` never rounds them.
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        self.to(dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ------------------------------------------------------------------------------------- forward
    def _hidden(self, ids: torch.Tensor, batch: _Batch) -> torch.Tensor:
        x = self.model.embed_tokens.weight[ids]
        for layer in self.model.layers:
            x = layer(self.kernels, x, batch)
        return self.kernels.rms_norm(x, self.model.norm.weight, self.config.rms_norm_eps)

    def _logprobs(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.kernels.linear(h, self.lm_head.weight, out_dtype=torch.float32)
        return self.kernels.logprob(logits)

    def _run(self, ids, seq_rows, starts, caches, grad: bool, rows_out=None):
        dev = self.model.embed_tokens.weight.device
        batch = _Batch(seq_rows, starts, caches, grad, ids.numel(), self.inv_freq.to(dev), self.dtype)
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
            ValueError: cu_seqlens not starting at 0, not increasing, or not ending at T.
        """
        cu = [int(c) for c in cu_seqlens]
        if not cu or cu[0] != 0 or cu[-1] != input_ids.numel() or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to len(input_ids)={input_ids.numel()}, got {cu}")
        rows = [torch.arange(a, b) for a, b in zip(cu, cu[1:])]
        return self._run(input_ids, rows, [0] * len(rows), [None] * len(rows), grad)

    def trainer_logprobs_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """Same as :meth:`trainer_logprobs` for a right-padded ``[B, L]`` batch.

        Row-wise regions run over all ``B*L`` rows (pads included); attention, conv and GDN see each
        sequence's real tokens. Returns ``[B, L, V]`` fp32 (pad rows are meaningless).

        Raises:
            ValueError: the mask is not right-padded (ones then zeros) in some row.
        """
        B, L = input_ids.shape
        lens = attention_mask.long().sum(-1)
        expect = torch.arange(L)[None, :] < lens[:, None]
        if not torch.equal(attention_mask.bool(), expect):
            raise ValueError("attention_mask must be right-padded: ones then zeros in every row")
        rows = [b * L + torch.arange(int(n)) for b, n in enumerate(lens)]
        out = self._run(input_ids.reshape(-1), rows, [0] * B, [None] * B, grad)
        return out.view(B, L, -1)

    def new_cache(self) -> SequenceCache:
        """An empty per-sequence engine cache."""
        return SequenceCache()

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
            ValueError: mismatched lengths or an empty chunk.
        """
        if len(caches) != len(chunks):
            raise ValueError(f"{len(caches)} caches for {len(chunks)} chunks")
        if any(c.numel() == 0 for c in chunks):
            raise ValueError("every chunk needs at least one token")
        ids = torch.cat(chunks)
        rows, r0 = [], 0
        for c in chunks:
            rows.append(torch.arange(r0, r0 + c.numel()))
            r0 += c.numel()
        starts = [c.position for c in caches]
        rows_out = torch.stack([r[-1] for r in rows]) if last_only else None
        out = self._run(ids, rows, starts, caches, False, rows_out)
        for c, ch in zip(caches, chunks):
            c.position += ch.numel()
        if last_only:
            return list(out.unsqueeze(1).unbind(0))
        return list(out.split([c.numel() for c in chunks]))

    # ------------------------------------------------------------------------- checkpoints, contract
    @classmethod
    def from_pretrained(cls, path, kernel_set: str = "isoexec", kernels=None, device: str = "cpu", dtype: torch.dtype | None = None) -> "UnifiedModel":
        """Load a Hugging Face ``Qwen3NextForCausalLM`` checkpoint folder.

        Args:
            path: folder with ``config.json`` and ``*.safetensors``.
            kernel_set: "isoexec" or "native". kernels: an ``isoexec.config.KernelSection`` with the
                pinned constants (defaults if None). device: "cpu" or "cuda".
            dtype: parameter dtype; default the checkpoint's ``dtype``.

        Raises:
            FileNotFoundError / ValueError from :mod:`isoexec.model.checkpoint`; RuntimeError on missing
            or unexpected tensor names (strict load).
        """
        from isoexec.model.checkpoint import read_config, read_weights

        cfg = read_config(path)
        if dtype is None:
            dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.bfloat16
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        model = cls(cfg, kernel_set_from_section(kernel_set, kernels, device), dtype)
        sd = read_weights(path)
        if getattr(cfg, "tie_word_embeddings", False):
            sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
        model.load_state_dict(sd, strict=True)
        return model.to(device)

    def save_pretrained(self, path) -> None:
        """Write a Hugging Face checkpoint folder (``config.json`` + ``model.safetensors``) loadable by
        transformers and vLLM."""
        from isoexec.model.checkpoint import write_checkpoint

        cfg = self.config
        cfg.dtype = self.dtype
        sd = self.state_dict()
        if getattr(cfg, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        write_checkpoint(path, cfg, sd)

    def contract(self, deployment: dict | None = None):
        """The :class:`~isoexec.contract.ExecutionContract` of this model and kernel set (all four cases)."""
        import hashlib
        import json

        from isoexec.contract import CASES, Claims, CompositionEntry, ExecutionContract, TopologyClaim

        cfg = {k: v for k, v in sorted(self.config.to_dict().items()) if k not in _NON_SEMANTIC_CONFIG_KEYS}
        model = {
            "architecture": (self.config.architectures or ["Qwen3NextForCausalLM"])[0],
            "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest(),
            "param_dtype": str(self.dtype).replace("torch.", ""),
        }
        comp = [
            CompositionEntry(i.region, CASES, i.impl_id, i.version, i.arch, i.constants, i.proof)
            for i in self.kernels.composition(self.dtype)
        ]
        claims = Claims(
            topology={"tp": TopologyClaim(domain=(1,), pinned=1), "ep": TopologyClaim(domain=(1,), pinned=1),
                      "sp": TopologyClaim(domain=(1,), pinned=1)},
            state={
                "weight_sync": ("prefix_cache", "kv_cache", "gdn_state", "conv_state"),
                "preemption": ("kv_cache", "gdn_state", "conv_state"),
            },
            tolerances={"logprob_abs_diff": 0.0} if self.kernels.name == "isoexec" else {},
            engine={"enable_prefix_caching": False},
        )
        return ExecutionContract.build(model=model, cases=CASES, composition=comp, claims=claims,
                                       deployment=deployment or {"torch_num_threads": torch.get_num_threads()})


_NON_SEMANTIC_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "use_cache", "architectures", "_name_or_path",
                             "output_router_logits", "router_aux_loss_coef", "initializer_range"}


def kernel_set_from_section(name: str, section=None, device: str = "cpu") -> KernelSet:
    """Kernel set ``name`` with the constants of an ``isoexec.config.KernelSection`` (defaults if None)."""
    from isoexec.kernels import get_kernel_set

    consts = {}
    if section is not None:
        consts = dict(chunk_size=section.chunk_size, row_tile=section.row_tile, kv_block=section.kv_block,
                      vocab_block=section.vocab_block, temperature=section.temperature)
    return get_kernel_set(name, device, **consts)
