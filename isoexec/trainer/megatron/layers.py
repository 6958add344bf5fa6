"""The ``isoexec`` kernel set in Megatron's slots: same modules' parameters, our arithmetic.

Each class subclasses the Megatron module of its slot (so parameter names, shapes, tensor-parallel
attributes and the converter are shared with the ``native`` set) and replaces only ``forward`` by
calls into a :class:`~isoexec.kernels.KernelSet`, with the same operation order as the unified model
(:mod:`isoexec.model.qwen3_next`), so that a token's bits do not depend on TP, EP or SP:

* :class:`IsoColumnParallelLinear` (``attn.qkv_proj``, ``gdn.in_proj``, ``lm_head``): the region's
  kernel on the rank's output features; its GEMM computes each column by its own FMA chain, so a column
  has the same bits whichever shard (and position in it) holds it. Inputs gathered over the sequence (SP) or copied (TP) with
  Megatron's mappings; no arithmetic in the collective.
* :class:`IsoRowParallelLinear` (``attn.out_proj``, ``gdn.out_proj``): pik (docs/design.md, Parallel invariance (pik)): the rank's
  subtree of the region's ``leaves`` fixed leaves over the global K, then the upper tree levels after
  an all-gather (or the pik reduce-scatter under SP).
* :class:`IsoCoreAttention`, :class:`IsoSelfAttention`: RoPE, our blockwise attention per sequence,
  the sigmoid gate.
* :class:`IsoGatedDeltaNet`: conv1d, gating, l2norm, CPR GDN per sequence, gated norm.
* :class:`IsoMoELayer`: the deterministic router, expert SwiGLUs (column-invariant gate/up, pik down projection
  over the expert-TP ranks), expert outputs moved (never summed) between ranks and summed per token
  in routing order in fp32, the gated shared expert (pik over TP). The experts' and shared expert's
  ``linear_fc1`` / ``linear_fc2`` slots keep Megatron's modules as weight holders (same names and
  tensor-parallel attributes); their forward is not called.

The regions run the kernel set's own kernels; where a layout splits a region over ranks, the
kernel set's arch picks the split pieces (:class:`CpuShards`: the CPU kernels of
:mod:`isoexec.kernels.gemm.cpu`, :mod:`isoexec.kernels.moe.cpu` and :mod:`isoexec.kernels.collectives.pik`
over gloo; :class:`TritonShards`: the Triton leaf and grouped GEMMs of :mod:`isoexec.kernels.moe.triton`
and the Triton pik path :func:`isoexec.kernels.collectives.triton.pik_row_parallel_linear` over NCCL).
Constants come from the kernel set (its region entries or its section), so the unified model and this
trainer read the same numbers.

Backward is Megatron's usual one (gradients are not bitwise across layouts): identity through the pik
all-reduce, all-gather through the pik reduce-scatter, reduce-scatter through the gathers.

A padded batch's real lengths reach the sequence regions through the attention mask
(:func:`isoexec.trainer.megatron.compat.padding_lengths`).

Context parallelism (Megatron's ``context_parallel_size``; :mod:`isoexec.kernels.collectives.cp`): the
sequence dim ``s`` of every module is this rank's two load-balanced chunks (:func:`cp_slice`). Per-token
regions (projections, norms, gating, MoE, ``lm_head``) need nothing else; RoPE takes the absolute
positions; :class:`IsoCoreAttention` reads the CP-gathered K/V from position 0; :class:`IsoGatedDeltaNet`
takes each chunk's conv prefix and GDN state chain from the holders of the chunks before it. Backward:
the gathers' reduce-scatter and the chain's gradients sent back chunk to chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from isoexec.trainer.megatron import compat

compat.apply()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402

from isoexec.kernels import KernelSet  # noqa: E402
from isoexec.kernels.attention.rope import rope_cos_sin, rope_inv_freq  # noqa: E402
from isoexec.kernels.collectives.cp import ChainExchange, SequenceSlice  # noqa: E402
from isoexec.kernels.collectives.pik import pik_all_reduce, pik_reduce_scatter, pik_row_parallel_partial, pik_tree_combine  # noqa: E402
from isoexec.trainer.megatron.compat import DEVICE, padding_lengths  # noqa: E402
from isoexec.trainer.megatron.gated_attention import GatedSelfAttention  # noqa: E402


# -------------------------------------------------------------------------------- collectives
class _PikAllReduce(torch.autograd.Function):
    """Forward: :func:`pik_all_reduce` of per-rank subtree sums. Backward: identity (the output is
    replicated over the group, so each rank's partial receives the output's gradient)."""

    @staticmethod
    def forward(ctx, partial, group):  # noqa: D102
        return pik_all_reduce(partial, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad, None


class _PikReduceScatter(torch.autograd.Function):
    """Forward: :func:`pik_reduce_scatter` along dim 0 (SP). Backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx, partial, group):  # noqa: D102
        ctx.group = group
        return pik_reduce_scatter(partial, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=0), None


def pik_combine(partial: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Finish a pik tree over ``group`` with Megatron-style autograd: reduce-scatter the rows (SP) or
    all-reduce; identity for a group of one. ``partial``: ``[N, M]`` fp32 subtree sums."""
    if sequence_parallel:
        return _PikReduceScatter.apply(partial, group)
    if group.size() > 1:
        return _PikAllReduce.apply(partial, group)
    return partial


# --------------------------------------------------------------------------- split regions by arch
class CpuShards:
    """The pieces a layout splits over ranks, with the CPU ``isoexec`` kernels (arch ``cpu``).

    Every method returns fp32 pik subtree sums or rounded results with the kernel set's constants
    (``row_tile``, ``col_tile``, ``leaves`` of the region); see :class:`TritonShards` for the contract.
    """

    def __init__(self, kernels: KernelSet):
        self.kernels = kernels

    def row_parallel(self, x, w, region: str, group, sequence_parallel: bool) -> torch.Tensor:
        """Region ``region`` (``attn.out_proj`` / ``gdn.out_proj``) on this rank's K shard, finished over
        ``group``: ``x [M, K/tp]``, ``w [N, K/tp]`` -> ``[M(/tp), N]`` in ``x.dtype``."""
        c = self.kernels[region].constants
        partial = pik_row_parallel_partial(x, w, group.size(), c["leaves"], c["row_tile"])
        return pik_combine(partial, group, sequence_parallel).to(x.dtype)

    def swiglu_partial(self, x, wg, wu, wd, tp: int) -> torch.Tensor:
        """The shared expert's SwiGLU on a 1/``tp`` intermediate shard: ``[N, H]`` fp32 subtree sum."""
        from isoexec.kernels.moe.cpu import iso_swiglu_partial

        c = self.kernels["mlp.shared_expert"].constants
        return iso_swiglu_partial(x, wg, wu, wd, tp, c["row_tile"], c["col_tile"], c["leaves"])

    def shared_gate(self, x, gate_w) -> torch.Tensor:
        """``sigmoid(x @ gate_w.T)``, ``[N, 1]`` fp32."""
        from isoexec.kernels.moe.cpu import shared_expert_gate

        c = self.kernels["mlp.shared_expert"].constants
        return shared_expert_gate(x, gate_w, c["row_tile"], c["col_tile"])

    def experts_partial(self, x, ids, local_ids: list[int], weights, etp: int) -> torch.Tensor:
        """This rank's experts ``local_ids`` (shards ``weights`` = per expert (gate, up, down)) for the
        (token, slot) pairs routed to them: ``[N, k, H]`` fp32 subtree sums, zeros elsewhere."""
        from isoexec.kernels.moe.cpu import routed_swiglu_partial

        c = self.kernels["moe.experts"].constants
        return routed_swiglu_partial(x, ids, dict(zip(local_ids, weights)), etp, c["row_tile"], c["col_tile"],
                                     c["leaves"])

    def gdn_pieces(self, q, k, v, g, beta, piece: SequenceSlice, full: list[int]) -> torch.Tensor:
        """Region ``gdn.core`` on this CP rank's rows of the sequences of global lengths ``full`` (the
        inputs hold each sequence's real local rows, sequence after sequence, its local chunks in order):
        per local chunk :class:`~isoexec.kernels.gdn.cpu.CPRPieceFunction`, the chain exchanged with the
        holders of the neighbouring chunks (:class:`~isoexec.kernels.collectives.cp.ChainExchange`). Inputs
        as the region's (fp32); returns ``o [N, H, Dv]`` fp32 with the bits of the whole sequences' rows."""
        from isoexec.kernels.gdn.cpu import CPRPieceFunction

        counts = piece.chunk_lengths(full)  # [slot][sequence]
        offs, acc = [], 0  # each sequence's first row
        for i in range(len(full)):
            offs.append(acc)
            acc += sum(c[i] for c in counts)
        mailbox: dict = {}
        out = q.new_zeros(acc, v.shape[1], v.shape[2])
        for slot, n in enumerate(counts):
            present = [i for i, m in enumerate(n) if m]
            if not present:
                continue
            before = [sum(counts[j][i] for j in range(slot)) for i in present]
            rows = torch.cat([torch.arange(offs[i] + b, offs[i] + b + n[i], device=q.device)
                              for i, b in zip(present, before)])
            link = ChainExchange(ps.get_context_parallel_group(), piece, slot, [full[i] for i in present],
                                 self.kernels.chunk_size, q.device, mailbox)
            o = CPRPieceFunction.apply(q[rows], k[rows], v[rows], g[rows], beta[rows], [n[i] for i in present],
                                       self.kernels.chunk_size, link)
            link.wait()
            out = out.index_copy(0, rows, o)
        return out


class TritonShards(CpuShards):
    """The same pieces with the Triton ``isoexec`` kernels (arch ``sm90``), same contract: the G leaves
    and Triton tiles of the kernel set's section, so that each piece, finished over the ranks by the fixed
    tree, gives the single-GPU region's bits. Row-parallel regions run
    :func:`~isoexec.kernels.collectives.triton.pik_row_parallel_linear` (leaf GEMM of the rank's subtree,
    fp32 subtree sums moved by NCCL, fused combine and rounding)."""

    def __init__(self, kernels: KernelSet):
        super().__init__(kernels)
        self.cfg, self.leaves = kernels.section.triton, kernels.section.leaves

    def row_parallel(self, x, w, region: str, group, sequence_parallel: bool) -> torch.Tensor:  # noqa: D102
        from isoexec.kernels.collectives.triton import pik_row_parallel_linear_autograd

        return pik_row_parallel_linear_autograd(x, w, self.cfg, self.leaves, group, sequence_parallel)

    def swiglu_partial(self, x, wg, wu, wd, tp: int) -> torch.Tensor:  # noqa: D102
        from isoexec.kernels.moe.triton import swiglu_partial

        return swiglu_partial(x, wg, wu, wd, self.cfg, self.leaves // tp)

    def shared_gate(self, x, gate_w) -> torch.Tensor:  # noqa: D102
        from isoexec.kernels.moe.triton import shared_expert_gate

        return shared_expert_gate(x, gate_w, self.cfg)

    def experts_partial(self, x, ids, local_ids: list[int], weights, etp: int) -> torch.Tensor:  # noqa: D102
        from isoexec.kernels.moe.triton import experts_partial

        return experts_partial(x, ids, local_ids, weights, self.cfg, self.leaves // etp)

    def gdn_pieces(self, *args, **kw):  # noqa: D102
        raise NotImplementedError("context parallelism has no Triton CPR piece kernel: the sm90 set's topology "
                                  "claim has cp=1 only (the CPU set proves cp 1, 2, 4)")


def shards(kernels: KernelSet) -> CpuShards:
    """The split pieces of ``kernels`` by its arch (``cpu`` or ``sm90``).

    Raises:
        ValueError: another arch.
    """
    by_arch = {"cpu": CpuShards, "sm90": TritonShards}
    if kernels.arch not in by_arch:
        raise ValueError(f"kernel set arch={kernels.arch!r}; allowed: {sorted(by_arch)}")
    return by_arch[kernels.arch](kernels)


def _device() -> torch.device:
    """This process's device (:data:`~isoexec.trainer.megatron.compat.DEVICE`; on CUDA the current GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")


# ------------------------------------------------------------------------------------- linears
class IsoColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` whose GEMM is the kernel set's ``region`` on the rank's output features.

    Args: Megatron's (``input_size, output_size, config, init_method, ...``) plus ``kernels`` and
    ``region`` (``attn.qkv_proj``, ``gdn.in_proj`` or ``lm_head``; the latter returns fp32 logits).

    Forward: ``x [s(/tp), b, K]`` -> (``[s, b, M/tp]`` or, gathered, ``[s, b, M]``; None).
    """

    def __init__(self, *args, kernels: KernelSet, region: str, **kw):
        super().__init__(*args, **kw)
        self.gemm = kernels[region]

    @classmethod
    def replacing(cls, module: ColumnParallelLinear, kernels: KernelSet, region: str) -> "IsoColumnParallelLinear":
        """This class in ``module``'s place: same sizes, group, gather setting and parameter."""
        new = cls(module.input_size, module.output_size, config=module.config, init_method=module.config.init_method,
                  bias=False, gather_output=module.gather_output, tp_group=module.tp_group, kernels=kernels,
                  region=region)
        new.weight = module.weight
        return new

    def forward(self, input_, weight=None, runtime_gather_output=None):  # noqa: D102
        weight = self.weight if weight is None else weight
        x = input_
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, True, self.tp_group)
        elif self.tp_group.size() > 1:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        y = self.gemm(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], -1)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.tp_group.size() > 1:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y, None


class IsoRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` whose GEMM and reduction are pik with the kernel set's ``region`` constants
    (``attn.out_proj`` or ``gdn.out_proj``): bitwise the region's single-process result at any TP.

    Args: Megatron's plus ``kernels`` and ``region``. Forward: ``x [s, b, K/tp]`` -> (``[s(/tp), b, M]``, None).
    """

    def __init__(self, *args, kernels: KernelSet, region: str, **kw):
        super().__init__(*args, **kw)
        self.shards, self.region = shards(kernels), region

    def forward(self, input_):  # noqa: D102
        s = input_.shape
        x = input_.reshape(-1, s[-1])
        y = self.shards.row_parallel(x, self.weight, self.region, self.tp_group, self.sequence_parallel)
        return y.reshape(-1, *s[1:-1], y.shape[-1]), None


# ----------------------------------------------------------------------------------- attention
def _sequences(seq_len: int, lengths: list[int], device) -> list[torch.Tensor]:
    """Row indices (on ``device``) of each sequence's real tokens in the batch-major flattening ``[B * seq_len]``."""
    return [b * seq_len + torch.arange(n, device=device) for b, n in enumerate(lengths)]


def cp_slice(seq_len: int) -> SequenceSlice:
    """This rank's context-parallel chunks of a batch whose local sequence dim is ``seq_len``
    (Megatron's CP rank and degree; everything at CP 1)."""
    return SequenceSlice(ps.get_context_parallel_rank(), ps.get_context_parallel_world_size(), seq_len)


def keep_in_graph(out: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """``out`` plus zero times each of ``tensors`` (summed): on a CP rank whose slice holds no real token,
    a layer's output must still depend on what its CP all-gathers produced, so that their backward
    (a reduce-scatter every CP rank joins) runs on this rank too."""
    return out + sum(t.sum() for t in tensors) * 0.0


def _gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """``x [s, ...]`` all-gathered along dim 0 over the CP group (Megatron's mapping: the backward
    reduce-scatters the gradients to their owners)."""
    return gather_from_sequence_parallel_region(x, True, ps.get_context_parallel_group())


class IsoCoreAttention(MegatronModule):
    """Core attention slot (``DotProductAttention`` in ``native``): region ``attn.core`` per sequence.

    Args: Megatron's core-attention arguments (``config, layer_number, attn_mask_type, ...``; unused
    beyond the config) plus ``kernels``.

    Forward: ``query [s, b, np, d]`` (after RoPE), ``key``/``value [s, b, ng, d]``, ``attention_mask`` (the
    sequences' real lengths, :func:`~isoexec.trainer.megatron.compat.key_padding_mask`) -> ``[s, b, np * d]``,
    zeros at padded rows. Under context parallelism ``s`` is this rank's two chunks (:func:`cp_slice`): K
    and V are all-gathered over the CP group and put in sequence order, and each chunk's queries attend
    from their absolute positions, so the kernel visits the same ``kv_block`` blocks from position 0 as
    on one rank.
    """

    def __init__(self, config, *args, kernels: KernelSet, **kw):
        super().__init__(config=config)
        self.kernels = kernels

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # noqa: D102
        s, b, h, d = query.shape
        piece = cp_slice(s)
        if piece.degree > 1:  # every rank's K/V in sequence order: [L, b, ng, d]
            order = piece.gather_order(key.device)
            key, value = (_gather_sequence(t).index_select(0, order) for t in (key, value))
        full = padding_lengths(attention_mask)
        counts = piece.chunk_lengths(full)  # [slot][sequence]; their sum, per sequence, is a prefix of the rows
        lengths = piece.local_lengths(full)
        qb, kb, vb = (t.transpose(0, 1) for t in (query, key, value))  # [b, s (keys: L), heads, d]
        q = torch.cat([qb[i, :n] for i, n in enumerate(lengths)])
        starts = [g * piece.chunk for g in piece.chunks]
        # one query group per (sequence, local chunk), from the chunk's absolute start, over keys 0 ..
        kv = [(kb[i, : a + n[i]], vb[i, : a + n[i]]) for i in range(b) for a, n in zip(starts, counts)]
        o = self.kernels["attn.core"](q, kv, [a for _ in range(b) for a in starts],
                                      [n[i] for i in range(b) for n in counts])
        rows = torch.cat(_sequences(s, lengths, o.device))
        out = o.new_zeros((b * s, h, d)).index_copy(0, rows, o)
        if piece.degree > 1 and not q.shape[0]:  # a CP slice of padding only
            out = keep_in_graph(out, key, value)
        return out.view(b, s, h * d).transpose(0, 1)


class IsoSelfAttention(GatedSelfAttention):
    """Gated self-attention: Megatron's fused QKV split (our q/k norms), ``attn.rope``,
    :class:`IsoCoreAttention`, ``attn.gate``, pik output projection.

    Args: Megatron's ``SelfAttention`` arguments plus ``kernels`` and ``rope`` = (rotary fraction,
    base) of the partial RoPE (the ``isoexec`` model is built without Megatron's rotary embedding).
    """

    def __init__(self, *args, kernels: KernelSet, rope: tuple[float, float], **kw):
        super().__init__(*args, **kw)
        self.kernels = kernels
        self.inv_freq = rope_inv_freq(self.config.kv_channels, *rope)  # as the unified model

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):  # noqa: D102
        if inference_context is not None or inference_params is not None or packed_seq_params is not None:
            raise NotImplementedError("the isoexec Megatron attention runs padded training batches only")
        query, key, value, gate = self.get_query_key_value_tensors(hidden_states, None, output_gate=True)
        s, b = query.shape[:2]
        rope = self.kernels["attn.rope"]
        positions = cp_slice(s).positions(query.device).repeat_interleave(b)  # rows s-major
        cos, sin = rope_cos_sin(positions, self.inv_freq.to(query.device), query.dtype)
        query = rope(query.reshape(s * b, *query.shape[2:]), cos, sin).view(query.shape)
        key = rope(key.reshape(s * b, *key.shape[2:]), cos, sin).view(key.shape)
        o = self.core_attention(query, key, value, attention_mask)  # [s, b, np * d]
        o = self.kernels["attn.gate"](o.reshape(s * b, -1), gate.reshape(s * b, -1)).view(s, b, -1)
        return self.linear_proj(o)


# ---------------------------------------------------------------------------------------- GDN
class IsoGatedDeltaNet(GatedDeltaNet):
    """Megatron's ``GatedDeltaNet`` slot with the unified model's GDN arithmetic on this rank's heads.

    Args: Megatron's arguments plus ``kernels``. Forward: ``hidden_states [s(/tp), b, H]``,
    ``attention_mask`` (real lengths) -> (``[s(/tp), b, H]``, None); ``trainer_fwd`` (autograd enabled)
    runs the CPR GDN with the kernel set's backward (CPU: the C recurrence backward; sm90: the Triton
    chunkwise backward of :mod:`isoexec.kernels.gdn.triton_backward`).

    Under context parallelism (``s`` is this rank's two chunks, :func:`cp_slice`) each chunk's conv1d
    prefix is the last ``Kc - 1`` inputs before it (all-gathered over the CP group) and the GDN core runs
    :meth:`CpuShards.gdn_pieces`, which takes each chunk's fp32 state chain from the holder of the chunk
    before it and hands it on.
    """

    def __init__(self, *args, kernels: KernelSet, **kw):
        super().__init__(*args, **kw)
        self.kernels, self.shards = kernels, shards(kernels)

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **kwargs):  # noqa: D102
        if inference_context is not None or inference_params is not None or packed_seq_params is not None:
            raise NotImplementedError("the isoexec Megatron GDN runs padded training batches only")
        ks, tp = self.kernels, self.tp_size
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim / tp], per rank [q|k|v|z|b|a]
        s, b, _ = qkvzba.shape
        n, dtype = s * b, qkvzba.dtype
        piece = cp_slice(s)
        full = padding_lengths(attention_mask)
        local = piece.local_lengths(full)
        present = [i for i, m in enumerate(local) if m]  # sequences with tokens in this slice
        lengths = [local[i] for i in present]
        seq_rows = [r for r, m in zip(_sequences(s, local, qkvzba.device), local) if m]
        hk, hv = self.num_key_heads // tp, self.num_value_heads // tp
        dk, dv = self.key_head_dim, self.value_head_dim
        x = qkvzba.transpose(0, 1).reshape(n, -1)  # batch-major rows
        mixed, z, beta_in, alpha = torch.split(x, [2 * hk * dk + hv * dv, hv * dv, hv, hv], dim=-1)
        prefixes = self._conv_prefixes(mixed.view(b, s, -1), piece)  # [slot][sequence]
        if present:
            rows = torch.cat(seq_rows)
            # one conv piece per (sequence, local chunk) with tokens, from that chunk's prefix
            counts = piece.chunk_lengths(full)
            pieces, pre = [], []
            for i, r in zip(present, seq_rows):
                for j, part in enumerate(r.split([c[i] for c in counts])):
                    if part.numel():
                        pieces.append(mixed[part])
                        pre.append(prefixes[j][i])
            conv, _ = ks["gdn.conv1d"](pieces, self.conv1d.weight.squeeze(1), pre)
            mixed = mixed.new_zeros(mixed.shape).index_copy(0, rows, torch.cat(conv))
            q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
            g, beta = ks["gdn.gating"](alpha, beta_in, self.A_log, self.dt_bias)
            r = hv // hk
            q = ks["gdn.l2norm"](q.reshape(n, hk, dk)).repeat_interleave(r, dim=1)
            k = ks["gdn.l2norm"](k.reshape(n, hk, dk)).repeat_interleave(r, dim=1)
            v = v.reshape(n, hv, dv).float()
            args = (q[rows], k[rows], v[rows], g[rows], beta[rows], lengths)
            if piece.degree == 1:
                o, _ = ks["gdn.core"](*args, [None] * len(lengths), torch.is_grad_enabled())
            else:
                o = self.shards.gdn_pieces(*args[:5], piece, [full[i] for i in present])
            o = o.new_zeros((n, hv, dv)).index_copy(0, rows, o).to(dtype)
        else:  # a CP slice of padding only
            o = keep_in_graph(z.new_zeros(n, hv, dv), *(p for slot in prefixes for p in slot))
        o = ks["gdn.norm"](o.reshape(n * hv, dv), z.reshape(n * hv, dv), self.out_norm.weight, self.out_norm.eps)
        return self.out_proj(o.reshape(b, s, hv * dv).transpose(0, 1))

    def _conv_prefixes(self, mixed: torch.Tensor, piece: SequenceSlice) -> list[list[torch.Tensor]]:
        """Per local chunk and sequence the ``Kc - 1`` conv inputs before the chunk (``mixed [b, s, C]``):
        zeros at the sequence start, else the last inputs of the chunks before it, whichever ranks hold
        them (a CP all-gather of every chunk's last ``min(h, Kc - 1)`` rows; its backward returns the
        prefix gradients to their owners)."""
        b, s, c = mixed.shape
        kc1 = self.conv_kernel_dim - 1
        zeros = mixed.new_zeros(kc1, c)
        if piece.degree == 1:
            return [[zeros] * b]
        h, t = piece.chunk, min(piece.chunk, kc1)
        mine = torch.cat([mixed[:, j * h + h - t : (j + 1) * h] for j in range(len(piece.chunks))], dim=1)
        tails = _gather_sequence(mine.transpose(0, 1).contiguous())  # [cp * 2t, b, C]: rank, then slot
        ordered = torch.cat([tails[(q * len(piece.chunks) + j) * t :][:t]
                             for q, j in map(piece.owner, range(len(piece.chunks) * piece.degree))])  # chunk order
        return [[torch.cat([zeros, ordered[: g * t, i]])[-kc1:] for i in range(b)] for g in piece.chunks]


# ---------------------------------------------------------------------------------------- MoE
class IsoMoELayer(MoELayer):
    """Megatron's ``MoELayer`` slot (router, ``SequentialMLP`` experts, gated shared expert) with the
    unified model's MoE regions under any TP / EP / expert-TP / SP layout.

    Tokens are exchanged in the expert tensor-and-model-parallel group G (the ranks among which
    Megatron dispatches): every rank all-gathers G's tokens and expert ids, computes its experts
    (its expert-TP shard: :meth:`CpuShards.experts_partial`, the pik subtree of
    ``down_proj``) for the (token, slot) pairs routed to them, and all-gathers these partial outputs;
    each rank then finishes the pik tree of every slot over the owner's expert-TP ranks, rounds it to
    the boundary dtype, and the region ``moe.combine`` sums its own tokens' slots in routing order in
    fp32 with the gated shared expert. The collectives only move tensors.

    Args: Megatron's arguments plus ``kernels``. Construction all-gathers each G member's (EP rank,
    expert-TP rank) once (a collective). Forward: ``[s(/tp), b, H]`` -> (same shape, None).

    (megatron-core 0.16.1 ``transformer/transformer_layer.py`` line 351 passes ``pg_collection`` only to
    the exact ``MoELayer`` class and logs "Unknown MLP type" for a subclass; ``MoELayer`` then takes
    ``get_default_pg_collection()``, the same groups.)
    """

    def __init__(self, *args, kernels: KernelSet, **kw):
        super().__init__(*args, **kw)
        self.kernels, self.shards = kernels, shards(kernels)
        self.g_group = ps.get_expert_tensor_and_model_parallel_group()
        g = self.g_group.size()
        me = torch.tensor([ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()], device=_device())
        ids = [me]
        if g > 1:
            ids = [torch.empty_like(me) for _ in range(g)]
            dist.all_gather(ids, me, group=self.g_group)
        self.etp = ps.get_expert_tensor_parallel_world_size()
        table = torch.empty(ps.get_expert_model_parallel_world_size(), self.etp, dtype=torch.long)
        for j, (e, t) in enumerate(i.tolist() for i in ids):
            table[e, t] = j  # (EP rank, expert-TP rank) -> rank in G
        owner = table[torch.arange(self.config.num_moe_experts) // self.num_local_experts]  # [E, etp]
        self.owner = owner.to(_device())
        self.g_rank = dist.get_rank(self.g_group) if g > 1 else 0

    def _routed(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[n, k, H]`` fp32 expert outputs (rounded to the boundary dtype) of this rank's tokens."""
        g = self.g_group.size()
        n, k = ids.shape
        x_all, ids_all = x, ids
        if g > 1:
            x_all = gather_from_sequence_parallel_region(x, True, self.g_group)
            parts = [torch.empty_like(ids) for _ in range(g)]
            dist.all_gather(parts, ids.contiguous(), group=self.g_group)
            ids_all = torch.cat(parts)
        weights = [(*e.linear_fc1.weight.chunk(2, dim=0), e.linear_fc2.weight)  # per rank fc1 = [gate; up]
                   for e in self.experts.local_experts]
        part = self.shards.experts_partial(x_all, ids_all, list(self.local_expert_indices), weights, self.etp)
        if g > 1:
            part = gather_from_sequence_parallel_region(part, True, self.g_group)
        mine = part.view(g, -1, k, x.shape[1])[:, self.g_rank * n : (self.g_rank + 1) * n]  # [g, n, k, H]
        owners = self.owner[ids]  # [n, k, etp]: ranks in G holding each slot's expert shards
        pieces = [mine.gather(0, owners[None, :, :, r, None].expand(1, n, k, x.shape[1]))[0] for r in range(self.etp)]
        return pik_tree_combine(pieces).to(x.dtype).float()

    def _shared(self, hidden_states: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Region ``mlp.shared_expert`` on TP shards: ``[n, H]`` fp32 for this rank's rows."""
        se = self.shared_experts
        fc1, fc2 = se.linear_fc1, se.linear_fc2
        full = hidden_states
        if fc1.sequence_parallel:
            full = gather_from_sequence_parallel_region(full, True, fc1.tp_group)
        elif fc1.tp_group.size() > 1:
            full = copy_to_tensor_model_parallel_region(full, fc1.tp_group)
        wg, wu = fc1.weight.chunk(2, dim=0)
        sub = self.shards.swiglu_partial(full.reshape(-1, x.shape[1]), wg, wu, fc2.weight, fc2.tp_group.size())
        s = pik_combine(sub, fc2.tp_group, fc2.sequence_parallel).to(x.dtype).float()
        return self.shards.shared_gate(x, se.gate_weight) * s

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):  # noqa: D102
        ks = self.kernels
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = ks["moe.router"](x, self.router.weight, self.config.moe_router_topk,
                                        not self.config.moe_router_pre_softmax)
        out = ks["moe.combine"](self._routed(x, ids), weights, ids, self._shared(hidden_states, x), x.dtype)
        return out.reshape(shape), None
