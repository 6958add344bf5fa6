"""Declarative Hugging Face <-> Megatron weight converter for the Qwen3-Next hybrid.

megatron-core ships no converter (Megatron-Bridge needs Python 3.12 and Transformer Engine). Both
directions are driven by one table per layer type, read like vLLM's ``load_weights`` mapping:

* An HF tensor whose rows interleave per head (``q_proj``: per head ``[q | gate]``; GDN
  ``in_proj_qkvz``: per key head ``[q | k | v | z]``, ``in_proj_ba``: ``[b | a]``) is cut into named
  *logical* tensors (:class:`Fields`); a plain HF tensor is its own logical tensor.
* A Megatron tensor is, on TP rank r, the concatenation along ``dim`` of rank r's contiguous chunk
  of each listed logical tensor (:class:`Shard`): GDN ``in_proj`` per rank ``[q|k|v|z|b|a]``,
  experts ``linear_fc1`` per rank ``[gate; up]``, ``conv1d`` per rank ``[q|k|v]``. Attention
  ``linear_qkv`` is first regrouped per query group ``[q | gate | k | v]`` (:class:`Regroup`), then
  split in contiguous rows like any column-parallel weight.

A "full" Megatron state (:data:`FullState`) maps a Megatron parameter name to its list of TP shards
(one element when replicated); routed experts carry their *global* index
(``mlp.experts.local_experts.<e>``). :func:`rank_state` cuts one rank's local state from it and
:func:`gather_full_state` rebuilds it from every rank's local state. Every step only slices and
concatenates, so HF -> Megatron -> HF is bitwise the identity at every TP / EP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FullState = dict[str, list[torch.Tensor]]


# ------------------------------------------------------------------------------------ the pieces
@dataclass(frozen=True)
class Fields:
    """An HF tensor whose dim 0 is ``blocks`` repeats of named fields of the given row sizes."""

    hf: str
    blocks: int
    fields: tuple[tuple[str, int], ...]

    def split(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes = [s for _, s in self.fields]
        if t.shape[0] != self.blocks * sum(sizes):
            raise ValueError(f"{self.hf}: dim 0 is {t.shape[0]}, expected {self.blocks} x {sum(sizes)}")
        parts = t.reshape(self.blocks, sum(sizes), *t.shape[1:]).split(sizes, dim=1)
        return {n: p.reshape(self.blocks * s, *t.shape[1:]) for (n, s), p in zip(self.fields, parts)}

    def join(self, logical: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [logical[n].reshape(self.blocks, s, *logical[n].shape[1:]) for n, s in self.fields]
        t = torch.cat(parts, dim=1)
        return t.reshape(-1, *t.shape[2:])


@dataclass(frozen=True)
class Regroup:
    """A logical tensor ``name`` built by interleaving other logical tensors in ``blocks`` groups (rows)."""

    name: str
    blocks: int
    fields: tuple[tuple[str, int], ...]

    def as_fields(self) -> Fields:
        return Fields(self.name, self.blocks, self.fields)


@dataclass(frozen=True)
class Shard:
    """A Megatron tensor: on each rank, the concatenation along ``dim`` of that rank's chunk of each part.

    ``parts``: (logical tensor, its global size along ``dim``). ``dim`` None: replicated (one part,
    size unused). ``group``: ``"tp"`` (dense layers, vocabulary) or ``"etp"`` (routed experts, split over
    the expert tensor-parallel ranks).
    """

    megatron: str
    parts: tuple[tuple[str, int], ...]
    dim: int | None
    group: str = "tp"


def _rep(megatron: str, hf: str) -> Shard:
    return Shard(megatron, ((hf, 0),), None)


@dataclass(frozen=True)
class Table:
    """One layer type's mapping: HF tensors with interleaved fields, regrouped tensors, Megatron shards."""

    fields: tuple[Fields, ...]
    regroups: tuple[Regroup, ...]
    shards: tuple[Shard, ...]


# ------------------------------------------------------------------------------------ the tables
def _mlp(hf: str, mg: str, inter: int, group: str) -> list[Shard]:
    """SwiGLU MLP: fc1 per rank ``[gate; up]``, fc2 split along its input features."""
    return [Shard(f"{mg}.linear_fc1.weight", ((f"{hf}.gate_proj.weight", inter), (f"{hf}.up_proj.weight", inter)), 0, group),
            Shard(f"{mg}.linear_fc2.weight", ((f"{hf}.down_proj.weight", inter),), 1, group)]


def layer_table(cfg, layer_type: str) -> Table:
    """The mapping of one decoder layer of ``cfg`` (transformers Qwen3-Next config), names relative
    to ``model.layers.<i>.`` (HF) and ``decoder.layers.<i>.`` (Megatron); experts by global index.

    Raises:
        ValueError: a layer type other than ``linear_attention`` / ``full_attention``.
    """
    fields: list[Fields] = []
    regroups: list[Regroup] = []
    shards = [_rep("input_layernorm.weight", "input_layernorm.weight"),
              _rep("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    if layer_type == "linear_attention":
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        r = hv // hk
        p = "linear_attn."
        fields += [Fields(p + "in_proj_qkvz.weight", hk, (("q", dk), ("k", dk), ("v", r * dv), ("z", r * dv))),
                   Fields(p + "in_proj_ba.weight", hk, (("b", r), ("a", r))),
                   Fields(p + "conv1d.weight", 1, (("conv_q", hk * dk), ("conv_k", hk * dk), ("conv_v", hv * dv)))]
        shards += [Shard("self_attention.in_proj.weight",
                         (("q", hk * dk), ("k", hk * dk), ("v", hv * dv), ("z", hv * dv), ("b", hv), ("a", hv)), 0),
                   Shard("self_attention.conv1d.weight", (("conv_q", hk * dk), ("conv_k", hk * dk), ("conv_v", hv * dv)), 0),
                   Shard("self_attention.dt_bias", ((p + "dt_bias", hv),), 0),
                   Shard("self_attention.A_log", ((p + "A_log", hv),), 0),
                   _rep("self_attention.out_norm.weight", p + "norm.weight"),
                   Shard("self_attention.out_proj.weight", ((p + "out_proj.weight", hv * dv),), 1)]
    elif layer_type == "full_attention":
        hq, ng, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        p = "self_attn."
        fields += [Fields(p + "q_proj.weight", hq, (("q", d), ("gate", d)))]
        regroups += [Regroup("qkv", ng, (("q", hq // ng * d), ("gate", hq // ng * d), (p + "k_proj.weight", d),
                                         (p + "v_proj.weight", d)))]
        shards += [Shard("self_attention.linear_qkv.weight", (("qkv", (2 * hq + 2 * ng) * d),), 0),
                   Shard("self_attention.linear_proj.weight", ((p + "o_proj.weight", hq * d),), 1),
                   _rep("self_attention.q_layernorm.weight", p + "q_norm.weight"),
                   _rep("self_attention.k_layernorm.weight", p + "k_norm.weight")]
    else:
        raise ValueError(f"layer type {layer_type!r}; allowed: linear_attention, full_attention")
    shards += [_rep("mlp.router.weight", "mlp.gate.weight"),
               _rep("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight")]
    shards += _mlp("mlp.shared_expert", "mlp.shared_experts", cfg.shared_expert_intermediate_size, "tp")
    for e in range(cfg.num_experts):
        shards += _mlp(f"mlp.experts.{e}", f"mlp.experts.local_experts.{e}", cfg.moe_intermediate_size, "etp")
    return Table(tuple(fields), tuple(regroups), tuple(shards))


def _tables(cfg) -> list[tuple[str, str, Table]]:
    """(HF prefix, Megatron prefix, table) for every layer plus the embedding, final norm and lm_head.

    Raises:
        ValueError: a Qwen3.5 config (separate GDN projections; not mapped here).
    """
    if str(getattr(cfg, "model_type", "")).startswith("qwen3_5"):
        raise ValueError("the Megatron converter maps Qwen3-Next checkpoints (fused in_proj_qkvz / in_proj_ba); "
                         f"got model_type={cfg.model_type!r}")
    out = [(f"model.layers.{i}.", f"decoder.layers.{i}.", layer_table(cfg, t)) for i, t in enumerate(cfg.layer_types)]
    v = cfg.vocab_size
    top = Table((), (), (Shard("embedding.word_embeddings.weight", (("model.embed_tokens.weight", v),), 0),
                         _rep("decoder.final_layernorm.weight", "model.norm.weight"),
                         Shard("output_layer.weight", (("lm_head.weight", v),), 0)))
    return out + [("", "", top)]


# ----------------------------------------------------------------------------------- directions
def _chunk(t: torch.Tensor, n: int, dim: int, what: str) -> list[torch.Tensor]:
    if t.shape[dim] % n:
        raise ValueError(f"{what}: dim {dim} of size {t.shape[dim]} is not divisible by {n} ranks")
    return [c.contiguous() for c in t.chunk(n, dim=dim)]


def hf_to_full(hf: dict[str, torch.Tensor], cfg, tp: int, etp: int = 1) -> FullState:
    """HF state dict -> full Megatron state (every TP / expert-TP shard of every tensor).

    Args:
        hf: HF parameter names -> tensors (``Qwen3NextForCausalLM`` checkpoint names; untied lm_head).
        cfg: the transformers config. tp: TP degree. etp: expert TP degree.

    Returns:
        Megatron name -> list of shards (rank order; one element when replicated), experts by global index.

    Raises:
        KeyError: a missing HF tensor. ValueError: a dim not divisible by the degree, wrong field sizes.
    """
    full: FullState = {}
    deg = {"tp": tp, "etp": etp}
    for hp, mp, table in _tables(cfg):
        logical: dict[str, torch.Tensor] = {}
        for f in table.fields:
            logical.update(f.split(hf[hp + f.hf]))
        get = lambda n: logical[n] if n in logical else hf[hp + n]  # noqa: E731
        for rg in table.regroups:
            logical[rg.name] = rg.as_fields().join({n: get(n) for n, _ in rg.fields})
        for s in table.shards:
            if s.dim is None:
                full[mp + s.megatron] = [get(s.parts[0][0]).clone()]
                continue
            n = deg[s.group]
            chunks = [_chunk(get(p), n, s.dim, hp + p) for p, _ in s.parts]
            full[mp + s.megatron] = [torch.cat([c[r] for c in chunks], dim=s.dim) for r in range(n)]
    return full


def full_to_hf(full: FullState, cfg) -> dict[str, torch.Tensor]:
    """Full Megatron state -> HF state dict (the inverse of :func:`hf_to_full`, bitwise).

    Raises:
        KeyError: a missing Megatron tensor. ValueError: shard sizes that do not match the config.
    """
    hf: dict[str, torch.Tensor] = {}
    for hp, mp, table in _tables(cfg):
        logical: dict[str, torch.Tensor] = {}
        for s in table.shards:
            shards = full[mp + s.megatron]
            if s.dim is None:
                logical[s.parts[0][0]] = shards[0].clone()
                continue
            n = len(shards)
            sizes = [g // n for _, g in s.parts]
            if any(sh.shape[s.dim] != sum(sizes) for sh in shards):
                raise ValueError(f"{mp + s.megatron}: shards of {[tuple(sh.shape) for sh in shards]}, "
                                 f"expected {sum(sizes)} along dim {s.dim} per rank")
            pieces = [sh.split(sizes, dim=s.dim) for sh in shards]
            for j, (p, _) in enumerate(s.parts):
                logical[p] = torch.cat([pc[j] for pc in pieces], dim=s.dim)
        for rg in reversed(table.regroups):
            logical.update(rg.as_fields().split(logical.pop(rg.name)))
        for f in table.fields:
            hf[hp + f.hf] = f.join({n: logical.pop(n) for n, _ in f.fields})
        for n, t in logical.items():
            hf[hp + n] = t
    return hf


# ------------------------------------------------------------------------------- ranks and gathers
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def shard_table(cfg) -> dict[str, Shard]:
    """Megatron name (experts by global index) -> its :class:`Shard` rule, for every tensor."""
    return {mp + s.megatron: s for _, mp, table in _tables(cfg) for s in table.shards}


def rank_state(full: FullState, cfg, ep: int, tp_rank: int, ep_rank: int, etp_rank: int) -> dict[str, torch.Tensor]:
    """One rank's local Megatron state dict: its TP shard of dense tensors, its experts (renamed to
    local indices ``0 .. E/ep - 1``) at its expert-TP shard.

    Raises:
        ValueError: ``num_experts`` not divisible by ``ep``.
    """
    if cfg.num_experts % ep:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by ep={ep}")
    per = cfg.num_experts // ep
    table = shard_table(cfg)
    out = {}
    for name, shards in full.items():
        rank = etp_rank if table[name].group == "etp" else tp_rank
        m = _EXPERT.match(name)
        if m:
            e = int(m.group(2))
            if e // per != ep_rank:
                continue
            name = f"{m.group(1)}{e % per}{m.group(3)}"
        out[name] = shards[rank if len(shards) > 1 else 0]
    return out


def gather_full_state(local: dict[str, torch.Tensor], cfg, groups: dict[str, object]) -> FullState:
    """Rebuild the full Megatron state from every rank's local state (a collective: every rank calls it).

    Args:
        local: this rank's Megatron state dict (local expert indices), tensors detached.
        cfg: the transformers config.
        groups: process groups ``{"tp": ..., "etp": ..., "ep": ...}`` (None: a single process).

    Returns:
        The :data:`FullState` on every rank (dense shards all-gathered over TP, expert shards over
        expert TP, experts over EP and renamed to global indices).
    """
    import torch.distributed as dist

    def gather(t, group):
        n = dist.get_world_size(group) if group is not None else 1
        if n == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t.contiguous(), group=group)
        return out

    table = shard_table(cfg)
    ep_size = dist.get_world_size(groups["ep"]) if groups.get("ep") is not None else 1
    per = cfg.num_experts // ep_size
    full: FullState = {}
    for name, t in local.items():
        m = _EXPERT.match(name)
        if not m:
            rule = table[name]
            full[name] = gather(t, groups["tp"]) if rule.dim is not None else [t]
            continue
        shards = gather(t, groups["etp"])
        by_ep = [gather(s, groups["ep"]) for s in shards]  # [etp][ep]
        for q in range(ep_size):
            full[f"{m.group(1)}{q * per + int(m.group(2))}{m.group(3)}"] = [by_ep[r][q] for r in range(len(shards))]
    return full
