"""Layers shared by the Qwen3-Next family (transformers ``modeling_qwen3_next.py``; vLLM
``model_executor/models/qwen3_next.py``): gated full attention, Gated DeltaNet, the sparse MoE block,
the decoder layer and the backbone.

Parameter names and shapes are the Hugging Face checkpoint's. Every region (docs/design.md, Terms) runs
through the :class:`~isoexec.kernels.KernelSet` by its contract name (``ks["gdn.core"](...)``).
Row-wise regions (GEMMs, norms, MoE) see all N rows of a forward at once; sequence regions
(attention, conv1d, GDN) see each sequence piece with its cache (:class:`Batch`).

A family member chooses its Gated DeltaNet projections (:meth:`GatedDeltaNet.project`): Qwen3-Next
fuses them, Qwen3.5 keeps four.
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec.kernels import KernelSet
from isoexec.kernels.attention.rope import rope_cos_sin
from isoexec.model.cache import append_kv


class _EpochDict(dict):
    """A module's ``_parameters`` / ``_modules`` dict that counts its changes in :attr:`W.epoch`: every way torch
    replaces a parameter or a submodule (``setattr``, ``register_parameter``, ``load_state_dict(assign=True)``,
    ``.to()`` under overwrite-on-conversion, ``torch.func.functional_call``) goes through ``__setitem__``."""

    def __setitem__(self, key, value):
        W.epoch += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        W.epoch += 1
        super().__delitem__(key)


def count_changes(module: nn.Module, *names: str) -> None:
    """Make ``module``'s dicts ``names`` (``"_parameters"``, ``"_modules"``) :class:`_EpochDict`\\ s."""
    for name in names:
        if not isinstance(getattr(module, name), _EpochDict):
            object.__setattr__(module, name, _EpochDict(getattr(module, name)))


class W(nn.Module):
    """A named weight holder (``<name>.weight``), so parameter names match the HF checkpoint.

    :attr:`epoch` counts every replacement of a weight Parameter object or of an expert's submodule (see
    :class:`_EpochDict`; in a ``UnifiedModel``, of any module's parameter or submodule): a list of weight tensors built at one epoch holds the module's current Parameter objects
    while the epoch is the same (:meth:`SparseMoE.expert_weights`). Changes of a Parameter's values keep the
    objects; the kernel sets that cache derived tensors see them by the tensors' address and version (in-place
    updates: weight syncs, ``load_state_dict``, optimizer steps), not writes through ``.data``, which bypass the
    version counter (no isoexec path writes so)."""

    epoch = 0

    def __init__(self, *shape: int):
        super().__init__()
        count_changes(self, "_parameters")
        self.weight = nn.Parameter(torch.zeros(*shape))

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        W.epoch += 1  # a conversion sets the weight's ``.data`` (no dict change): lists built before are stale
        return out


class Batch:
    """Row bookkeeping of one forward: which of the N rows belong to which sequence piece.

    Args:
        seq_rows: per piece, its row indices ``[n_b]`` (int64). starts: per piece, the absolute
            position of its first row. caches: per piece a ``SequenceCache`` or None (trainer).
        grad: build the autograd graph (``trainer_fwd``). n_rows: N. inv_freq: RoPE frequencies
            (fp32, on the model's device). dtype: the boundary dtype (RoPE tables).
    """

    def __init__(self, seq_rows, starts, caches, grad, n_rows, inv_freq, dtype):
        dev = inv_freq.device
        self.starts, self.caches, self.grad = starts, caches, grad
        self.lengths = [int(r.numel()) for r in seq_rows]
        rows = torch.cat([r.cpu() for r in seq_rows]) if seq_rows else torch.zeros(0, dtype=torch.long)
        # the pieces are rows 0..N-1 in order (packed batches, engine steps): gathers and scatters are identities
        self.dense = sum(self.lengths) == n_rows and torch.equal(rows, torch.arange(n_rows))
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        first = torch.cumsum(lengths, 0) - lengths  # each piece's first index in all_rows
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(first, lengths)
        positions = torch.zeros(n_rows, dtype=torch.long)
        positions[rows] = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long), lengths) + within
        both = torch.cat([rows, positions]).to(dev)  # one copy to the device per forward
        self.all_rows, self.positions = both[: rows.numel()], both[rows.numel() :]
        self.rope = rope_cos_sin(self.positions, inv_freq, dtype)

    def pieces(self, *xs: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per tensor ``[N, ...]``, its rows of each sequence piece in order (one gather per tensor)."""
        return [tuple(self.gather(x).split(self.lengths)) for x in xs]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of every piece of ``x [N, ...]``, concatenated in sequence order (``x`` itself when dense)."""
        return x if self.dense else x[self.all_rows]

    def scatter(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """Place per-sequence outputs (concatenated in sequence order) back at their rows; pad rows get 0."""
        if self.dense:
            return packed
        out = packed.new_zeros((n, *packed.shape[1:]))
        return out.index_copy(0, self.all_rows, packed)


class SlotBatch:
    """Row bookkeeping of a decode step over slot-addressed state (:mod:`isoexec.model.graphs`): one token per
    sequence, rows in sequence order, every tensor on the device, so the forward holds no value-dependent host work
    and can be captured in a CUDA graph. Sequence regions run their kernel set's ``slots`` implementation.

    Args:
        pools: the :class:`~isoexec.model.graphs.SlotPools` (keys, values, conv prefixes by slot).
        slots: ``[B]`` int64, each row's slot of ``pools``. positions: ``[B]`` int64, each token's absolute position.
        gdn_slots: GDN layer index -> ``[B]`` int64, each row's GDN state slot. inv_freq, dtype: as :class:`Batch`.
    """

    def __init__(self, pools, slots, positions, gdn_slots, inv_freq, dtype):
        self.pools, self.slots, self.positions, self.gdn_slots = pools, slots, positions, gdn_slots
        self.rope = rope_cos_sin(positions, inv_freq, dtype)


class Expert(nn.Module):
    """A SwiGLU expert's three weights (``gate_proj``, ``up_proj`` ``[I, H]``; ``down_proj`` ``[H, I]``)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        count_changes(self, "_modules")
        self.gate_proj, self.up_proj, self.down_proj = W(inter, hidden), W(inter, hidden), W(hidden, inter)

    def weights(self):
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight


def _stack_after_load(module: "SparseMoE", incompatible_keys) -> None:
    module._stack_experts()


class ExpertWeights(list):
    """Per expert its (gate, up, down) weights (a list, what every ``moe.experts`` implementation takes), with
    ``stacks``: the three ``[E, N, K]`` tensors whose rows the weights are views of (gate, up ``[E, I, H]``; down
    ``[E, H, I]``), so a grouped kernel reads the parameters' own storage (no copy, and an in-place update of a
    weight is in what it reads). The stacks are for reading: write through the parameters (each keeps its own
    version counter, which the engine's weight checks read)."""

    def __init__(self, weights, stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        super().__init__(weights)
        self.stacks = stacks


class SparseMoE(nn.Module):
    """``moe.router`` -> ``moe.experts`` -> ``mlp.shared_expert`` -> ``moe.combine``.

    The experts' weights are held as rows of three stacks (:class:`ExpertWeights`): one copy of the weights in
    memory, in the layout the grouped kernels read, under the checkpoint's per-expert parameter names. A conversion
    of this module or one above it (``.to()``, ``.cuda()``, ``.half()``: each parameter converted on its own), a
    ``load_state_dict`` that replaces parameters (``assign=True``) and a copy (``copy.deepcopy``, unpickling) are
    stacked again. A parameter replaced or converted in another way (``setattr``, ``torch.func.functional_call``, a
    conversion of one expert or of the expert list) is not a row of the stacks: :meth:`expert_weights` then gives a
    plain list (the kernels stack a copy, as for any list of weights; the decode graphs step eagerly). A write
    through a parameter's ``.data`` (``p.data = t``, ``vector_to_parameters``) is not seen: unsupported, as for
    every cached derivative of a weight.
    """

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.gate = W(cfg.num_experts, h)
        self.experts = nn.ModuleList([Expert(h, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])
        count_changes(self.experts, "_modules")
        self.shared_expert = Expert(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = W(1, h)
        # Qwen3.5 always renormalises the top-k weights (its config has no norm_topk_prob field)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, getattr(cfg, "norm_topk_prob", True)
        self._expert_weights: tuple[int, list] = (-1, [])
        self._stack_experts()
        self.register_load_state_dict_post_hook(_stack_after_load)

    def _stack_experts(self) -> None:
        """Copy every expert weight into new stacks and make each weight Parameter (the same object) a view of its
        row, unless they already are; weights of one kind that differ in dtype, device or shape (a partial
        ``load_state_dict(assign=True)`` of another dtype) are left as they are (no silent cast): the kernels then
        get a list."""
        ws = [e.weights() for e in self.experts]
        if self._stacks_of(ws) is not None:
            return
        self._stacks, self._expert_weights = None, (-1, [])
        if any(len({(w[i].dtype, w[i].device, w[i].shape) for w in ws}) > 1 for i in range(3)):
            return
        with torch.no_grad():
            stacks = tuple(torch.stack([w[i].detach() for w in ws]) for i in range(3))
            for e, w in enumerate(ws):
                for i in range(3):
                    w[i].data = stacks[i][e]
        self._stacks = stacks
        W.epoch += 1  # storages moved: lists and captured graphs built before are stale

    def _stacks_of(self, ws) -> tuple | None:
        """The stacks if every weight of ``ws`` is its expert's row of them, else None."""
        stacks = getattr(self, "_stacks", None)
        if stacks is None:
            return None
        for i, s in enumerate(stacks):
            for e, w in enumerate(ws):
                r = s[e]
                if (w[i].data_ptr() != r.data_ptr() or w[i].shape != r.shape or w[i].dtype != r.dtype
                        or w[i].device != r.device or w[i].stride() != r.stride()):
                    return None
        return stacks

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._stack_experts()  # each weight was converted on its own (a no-op conversion keeps the stacks)
        return out

    def __setstate__(self, state):
        super().__setstate__(state)
        self._stacks = None  # a copy (``copy.deepcopy``, unpickling) holds its weights and stacks apart
        self._stack_experts()

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per expert its (gate, up, down) weights: an :class:`ExpertWeights` while they are rows of the stacks
        (else a plain list), rebuilt only when some weight Parameter or expert submodule was replaced
        (:attr:`W.epoch`); walking 3E submodule attributes every call cost a millisecond a layer at 256 experts."""
        if self._expert_weights[0] != W.epoch:
            ws = [e.weights() for e in self.experts]
            stacks = self._stacks_of(ws)
            self._expert_weights = (W.epoch, ws if stacks is None else ExpertWeights(ws, stacks))
        return self._expert_weights[1]

    def forward(self, ks: KernelSet, x):
        weights, ids = ks["moe.router"](x, self.gate.weight, self.top_k, self.norm_topk_prob)
        y = ks["moe.experts"](x, ids, self.expert_weights())
        shared = ks["mlp.shared_expert"](x, self.shared_expert.weights(), self.shared_expert_gate.weight)
        return ks["moe.combine"](y, weights, ids, shared, x.dtype)


class Attention(nn.Module):
    """Gated full attention: ``q|gate = qkv_proj``, q/k RMSNorm, partial RoPE, causal GQA attention
    over the sequence's cache, ``o * sigmoid(gate)``, ``out_proj``."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        h = cfg.hidden_size
        self.q_proj, self.k_proj = W(self.hq * self.d * 2, h), W(self.hkv * self.d, h)
        self.v_proj, self.o_proj = W(self.hkv * self.d, h), W(h, self.hq * self.d)
        self.q_norm, self.k_norm = W(self.d), W(self.d)
        self.eps = cfg.rms_norm_eps

    def forward(self, ks: KernelSet, x, batch: Batch):
        n, proj = x.shape[0], ks["attn.qkv_proj"]
        q, gate = proj(x, self.q_proj.weight).view(n, self.hq, 2 * self.d).chunk(2, dim=-1)
        gate = gate.reshape(n, self.hq * self.d)
        q = ks["norm.rms"](q, self.q_norm.weight, self.eps)
        k = ks["norm.rms"](proj(x, self.k_proj.weight).view(n, self.hkv, self.d), self.k_norm.weight, self.eps)
        v = proj(x, self.v_proj.weight).view(n, self.hkv, self.d)
        q, k = ks["attn.rope"](q, *batch.rope), ks["attn.rope"](k, *batch.rope)
        if isinstance(batch, SlotBatch):
            o = ks["attn.core"].slots(q, k, v, *batch.pools.kv_pools(self.layer_idx), batch.slots, batch.positions)
        else:
            o = self._core(ks, q, k, v, batch)
        o = ks["attn.gate"](o.reshape(n, self.hq * self.d), gate)
        return ks["attn.out_proj"](o, self.o_proj.weight)

    def _core(self, ks: KernelSet, q, k, v, batch: Batch):
        """``attn.core`` over each piece's cache (the new keys and values appended), ``[N, Hq, D]``."""
        n = q.shape[0]
        kv = list(zip(*batch.pieces(k, v)))
        cached = [i for i, c in enumerate(batch.caches) if c is not None]
        if cached:
            full = append_kv([batch.caches[i] for i in cached], self.layer_idx, [kv[i][0].detach() for i in cached],
                             [kv[i][1].detach() for i in cached])
            for i, pair in zip(cached, full):
                kv[i] = pair
        o = ks["attn.core"](batch.gather(q), kv, batch.starts, batch.lengths)
        return batch.scatter(o, n)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention: projections (family-specific, :meth:`project`), causal conv1d
    over ``q|k|v``, gating, l2-normalised q/k, the gated delta rule (``gdn.core``, with per-sequence
    state), gated RMSNorm, ``out_proj``."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kc = cfg.linear_conv_kernel_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.make_projections(cfg.hidden_size)  # registered first: the checkpoint's parameter order
        self.conv1d = W(self.conv_dim, 1, self.kc)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = W(self.dv)
        self.out_proj = W(cfg.hidden_size, self.value_dim)
        self.eps = cfg.rms_norm_eps

    def make_projections(self, hidden: int) -> None:
        """Register the input projection weights; family-specific."""
        raise NotImplementedError

    def project(self, ks: KernelSet, x):
        """(mixed q|k|v ``[N, conv_dim]``, z ``[N, Hv, Dv]``, b ``[N, Hv]``, a ``[N, Hv]``); family-specific."""
        raise NotImplementedError

    def _conv(self, ks: KernelSet, mixed, batch: Batch):
        """``gdn.conv1d`` of each piece from its cached prefix (the new prefix kept), ``[N, conv_dim]``."""
        zero = mixed.new_zeros(self.kc - 1, self.conv_dim)
        prefixes = [zero if c is None or self.layer_idx not in c.conv else c.conv[self.layer_idx] for c in batch.caches]
        conv_out, new_prefixes = ks["gdn.conv1d"](batch.pieces(mixed)[0], self.conv1d.weight.squeeze(1), prefixes)
        for cache, p in zip(batch.caches, new_prefixes):
            if cache is not None:
                cache.set_conv(self.layer_idx, p)
        return batch.scatter(torch.cat(conv_out), mixed.shape[0])

    def _core(self, ks: KernelSet, q, k, v, g, beta, batch: Batch):
        """``gdn.core`` of each piece from its cached state (the new state kept), ``[N, Hv, Dv]`` fp32."""
        states = [None if c is None else c.gdn.get(self.layer_idx) for c in batch.caches]
        o, new_states = ks["gdn.core"](*map(batch.gather, (q, k, v, g, beta)), batch.lengths, states, batch.grad)
        for cache, st in zip(batch.caches, new_states):
            if cache is not None:
                cache.gdn[self.layer_idx] = st
        return batch.scatter(o, q.shape[0])

    def forward(self, ks: KernelSet, x, batch: Batch):
        n, dtype = x.shape[0], x.dtype
        mixed, z, b, a = self.project(ks, x)
        slotted = isinstance(batch, SlotBatch)
        if slotted:
            mixed = ks["gdn.conv1d"].slots(mixed, self.conv1d.weight.squeeze(1), batch.pools.conv_pool(self.layer_idx),
                                           batch.slots)
        else:
            mixed = self._conv(ks, mixed, batch)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = ks["gdn.gating"](a, b, self.A_log, self.dt_bias)
        r = self.hv // self.hk
        # each key head's rows repeated r times (head h serves value heads h*r .. h*r + r - 1)
        q = ks["gdn.l2norm"](q.reshape(n, self.hk, self.dk))[:, :, None].expand(n, self.hk, r, self.dk).reshape(n, self.hv, self.dk)
        k = ks["gdn.l2norm"](k.reshape(n, self.hk, self.dk))[:, :, None].expand(n, self.hk, r, self.dk).reshape(n, self.hv, self.dk)
        v = v.reshape(n, self.hv, self.dv).float()
        if slotted:
            o = ks["gdn.core"].slots(q, k, v, g, beta, batch.gdn_slots[self.layer_idx], batch.positions)
        else:
            o = self._core(ks, q, k, v, g, beta, batch)
        o = o.to(dtype)
        o = ks["gdn.norm"](o.reshape(n * self.hv, self.dv), z.reshape(n * self.hv, self.dv), self.norm.weight, self.eps)
        return ks["gdn.out_proj"](o.reshape(n, self.value_dim), self.out_proj.weight)


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: ``x + mixer(norm(x))``, then ``x + moe(norm(x))``."""

    def __init__(self, cfg, layer_idx: int, gdn_class: type[GatedDeltaNet]):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = gdn_class(cfg, layer_idx)
        elif self.layer_type == "full_attention":
            self.self_attn = Attention(cfg, layer_idx)
        else:
            raise ValueError(f"layer_types[{layer_idx}]={self.layer_type!r}; allowed: linear_attention, full_attention")
        if layer_idx in (getattr(cfg, "mlp_only_layers", None) or []) or getattr(cfg, "decoder_sparse_step", 1) != 1:
            raise ValueError("dense MLP layers (mlp_only_layers, decoder_sparse_step != 1) are not supported: "
                             "every layer must be a sparse MoE layer")
        self.mlp = SparseMoE(cfg)
        self.input_layernorm, self.post_attention_layernorm = W(cfg.hidden_size), W(cfg.hidden_size)
        self.eps = cfg.rms_norm_eps

    def forward(self, ks: KernelSet, x, batch: Batch):
        h = ks["norm.rms"](x, self.input_layernorm.weight, self.eps)
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        x = x + mixer(ks, h, batch)
        h = ks["norm.rms"](x, self.post_attention_layernorm.weight, self.eps)
        return x + self.mlp(ks, h)


class Backbone(nn.Module):
    """``model.embed_tokens``, ``model.layers``, ``model.norm`` (the checkpoint's ``model.*``)."""

    def __init__(self, cfg, gdn_class: type[GatedDeltaNet]):
        super().__init__()
        self.embed_tokens = W(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, gdn_class) for i in range(cfg.num_hidden_layers)])
        self.norm = W(cfg.hidden_size)
