"""The one registry: for each execution policy, every contract region mapped to the implementation
object that actually runs, with its pinned constants.

A :class:`KernelSet` is a mapping ``region -> Impl`` (all of :data:`isoexec.contract.REGIONS`). The
unified model calls regions by name (``ks["attn.qkv_proj"](x, w)``), so what runs and what the
contract's composition records (:meth:`KernelSet.composition`) are the same objects.

Sets (``mode``, ``device``):

* (``isoexec``, ``cpu``): batch-, mode- and position-invariant CPU kernels (``*/cpu.py``).
* (``native``, ``cpu``): stock torch kernels as the Hugging Face model runs them (``*/native.py``),
  the negative control of every gate.
* (``isoexec``, ``cuda``): Triton kernels for Hopper, arch ``sm90`` (``*/triton.py``); imported lazily.
* (``native``, ``cuda``): cuBLAS ``F.linear``, SDPA and fla's GDN kernels, the CUDA negative control.

Constants come only from the experiment config (:class:`isoexec.config.KernelSection`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from isoexec.contract import REGIONS
from isoexec.kernels.topology import ISOEXEC_CPU_TOPOLOGY, ISOEXEC_SM90_TOPOLOGY, SINGLE_RANK

GEMM_REGIONS = ("attn.qkv_proj", "attn.out_proj", "gdn.in_proj", "gdn.out_proj")
"""Projection GEMMs that share one implementation (``lm_head`` and the MoE GEMMs have their own entries)."""
ROW_PARALLEL_REGIONS = ("attn.out_proj", "gdn.out_proj")
"""Projections whose K is sharded under TP (Megatron's ``RowParallelLinear``): pik leaf GEMMs."""
COLUMN_PARALLEL_REGIONS = ("attn.qkv_proj", "gdn.in_proj")
"""Projections whose output features are sharded under TP (``ColumnParallelLinear``): column-invariant GEMMs on CPU."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Impl:
    """One region's implementation: what runs (``fn``) and what the contract records.

    Attributes:
        region: contract region (``"gdn.core"``).
        impl_id: implementation id (``"isoexec.cpu.cpr_gated_delta_rule"``).
        version, arch: recorded in the composition.
        constants: pinned constants (values JSON-able; floats as Python floats).
        proof: the gate or test that proves the region's invariance (``"none"`` for native).
        fn: the callable the model invokes.
        dtype_constants: constants that depend on the model's boundary dtype (``dtype -> dict``),
            merged into ``constants`` in the composition.
        slots: the same kernels for a decode step over slot-addressed state, CUDA-graph safe (sequence regions of
            the isoexec CUDA set; :class:`isoexec.model.layers.SlotBatch`), or None.
    """

    region: str
    impl_id: str
    version: str
    arch: str
    constants: Mapping[str, Any]
    proof: str
    fn: Callable = field(repr=False, compare=False)
    dtype_constants: Callable[[torch.dtype], Mapping[str, Any]] | None = field(default=None, repr=False, compare=False)
    slots: Callable | None = field(default=None, repr=False, compare=False)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def constants_for(self, dtype: torch.dtype) -> dict[str, Any]:
        """``constants`` plus the dtype-dependent ones for a model of boundary dtype ``dtype``."""
        extra = dict(self.dtype_constants(dtype)) if self.dtype_constants else {}
        return {**self.constants, **extra}


class KernelSet:
    """Every region of one execution policy.

    Args:
        mode: ``"isoexec"`` or ``"native"``. arch: ``"cpu"`` or ``"sm90"``.
        impls: one :class:`Impl` per region of :data:`~isoexec.contract.REGIONS`.
        section: the :class:`~isoexec.config.KernelSection` the impls were built from.
        topology: parallel dimension -> degrees under which the bits are proven invariant (the
            contract's topology claim); default one rank everywhere.

    Raises:
        ValueError: a region is missing, duplicated or unknown.
    """

    def __init__(self, mode: str, arch: str, impls: Iterable[Impl], section,
                 topology: Mapping[str, tuple[int, ...]] = SINGLE_RANK) -> None:
        self.mode, self.arch, self.section, self.topology = mode, arch, section, dict(topology)
        self.impls: dict[str, Impl] = {}
        for i in impls:
            if i.region in self.impls:
                raise ValueError(f"kernel set {mode}/{arch}: region {i.region!r} given twice")
            self.impls[i.region] = i
        missing, unknown = set(REGIONS) - set(self.impls), set(self.impls) - set(REGIONS)
        if missing or unknown:
            raise ValueError(f"kernel set {mode}/{arch}: missing regions {sorted(missing)}, unknown {sorted(unknown)}")
        self.fingerprint = hashlib.sha256(json.dumps(
            [(i.region, i.impl_id, i.version, i.arch, dict(i.constants)) for i in self.impls.values()],
            sort_keys=True, default=str).encode()).hexdigest()[:16]
        """Digest of every impl and constant: a cache built under one fingerprint refuses another."""

    # the attributes the model and the trainers read
    @property
    def name(self) -> str:
        return self.mode

    @property
    def chunk_size(self) -> int:
        return self.section.chunk_size

    @property
    def temperature(self) -> float:
        return float(self.section.temperature)

    def __getitem__(self, region: str) -> Impl:
        return self.impls[region]

    def composition(self, dtype: torch.dtype) -> list[Impl]:
        """The impls in :data:`REGIONS` order (use :meth:`Impl.constants_for` with ``dtype``)."""
        return [self.impls[r] for r in REGIONS]


# ------------------------------------------------------------------------------------- the sets
def _isoexec_cpu(k) -> list[Impl]:
    from isoexec.kernels.attention import cpu as attn, rope
    from isoexec.kernels.conv.cpu import iso_causal_conv1d
    from isoexec.kernels.gdn import cpu as gdn
    from isoexec.kernels.gemm.cpu import iso_linear, iso_row_linear
    from isoexec.kernels.gemm.fma import K_ORDER, K_ORDER_BF16_PAIRS
    from isoexec.kernels.logprob.cpu import iso_logprob
    from isoexec.kernels.moe import cpu as moe
    from isoexec.kernels.native_build import CFLAGS
    from isoexec.kernels.norm import cpu as norm

    def gdn_core(q, k_, v, g, beta, lengths, states, grad):
        if grad:
            if any(s is not None for s in states):
                raise ValueError("trainer_fwd (grad=True) GDN starts from empty states")
            return gdn.CPRTrainerFunction.apply(q, k_, v, g, beta, lengths, k.chunk_size), [None] * len(lengths)
        return gdn.cpr_gdn(q, k_, v, g, beta, lengths, states, k.chunk_size)

    V, A = "1", "cpu"
    fma = {"acc_dtype": "float32", "cflags": " ".join(CFLAGS)}  # the C GEMMs (gemm/bf16_gemm.c, gemm/fma_gemm.c)
    gemm = {**fma, "row_tile": k.row_tile, "col_tile": k.col_tile, "split_k": 1}
    pik = {**fma, "row_tile": k.row_tile, "leaves": k.leaves, "leaf_tree": "adjacent_pairs"}
    mlp = {**gemm, "leaves": k.leaves, "leaf_tree": "adjacent_pairs"}  # fused gate/up GEMM, pik down
    def bd(dt):  # a GEMM region's dtype constants: bf16 operands run bf16_gemm.c's pair chain, fp32 fma_gemm.c's
        pairs = dt == torch.bfloat16
        return {"boundary_dtype": _dtype_name(dt), "k_order": K_ORDER_BF16_PAIRS if pairs else K_ORDER,
                "gemm_source": "gemm/bf16_gemm.c" if pairs else "gemm/fma_gemm.c"}
    tree = {"reduction": "binary_tree_pow2", "acc_dtype": "float32"}
    norms = {**tree, "sqrt": norm.SQRT, "source": "norm/norms.c", "cflags": " ".join(CFLAGS)}
    col = partial(iso_linear, row_tile=k.row_tile, col_tile=k.col_tile)
    col_proof = "tests/test_kernels_primitives.py::test_tile_mm_column_bits_independent_of_position_neighbours_and_tiles"
    pik_proof = "tests/test_pik.py::test_pik_row_parallel_linear_is_bitwise_equal_across_tp_and_to_reference"
    return [
        Impl("embed", "isoexec.cpu.embedding_gather", V, A, {}, "gates:trainer_vs_engine", lambda table, ids: table[ids],
             lambda dt: {"dtype": _dtype_name(dt)}),
        Impl("norm.rms", "isoexec.cpu.rms_norm", V, A, {**norms, "scale": "one_plus_w"}, "gates:batch_composition",
             norm.iso_rms_norm),
        *[Impl(r, "isoexec.cpu.fma_gemm", V, A, gemm, col_proof, col, bd) for r in COLUMN_PARALLEL_REGIONS],
        *[Impl(r, "isoexec.cpu.pik_leaf_gemm", V, A, pik, pik_proof, partial(iso_row_linear, row_tile=k.row_tile,
                                                                               leaves=k.leaves), bd)
          for r in ROW_PARALLEL_REGIONS],
        Impl("attn.rope", "isoexec.cpu.rope_elementwise", V, A, {}, "gates:trainer_vs_engine", rope.apply_rope,
             lambda dt: {"table_dtype": _dtype_name(dt)}),
        Impl("attn.core", "isoexec.cpu.blockwise_online_softmax", V, A,
             {**fma, "kv_block": k.kv_block, "block_order": "ascending", "per_row": True,
              "score_order": "fmaf_chain_d_ascending", "value_order": "fmaf_chain_j_ascending",
              "source": "attention/attention.c"},
             "gates:prefill_split", partial(attn.iso_attention, kv_block=k.kv_block)),
        Impl("attn.gate", "isoexec.cpu.sigmoid_gate", V, A, {"math_dtype": "float32"}, "gates:trainer_vs_engine",
             attn.iso_sigmoid_gate),
        Impl("gdn.conv1d", "isoexec.cpu.causal_conv1d", V, A, {"order": "tap_ascending", "acc_dtype": "float32"},
             "gates:prefill_split", iso_causal_conv1d),
        Impl("gdn.gating", "isoexec.cpu.gdn_gating", V, A, {"math_dtype": "float32"}, "gates:trainer_vs_engine",
             gdn.iso_gating),
        Impl("gdn.l2norm", "isoexec.cpu.l2norm", V, A, {**norms, "eps": 1e-6}, "gates:trainer_vs_engine", norm.iso_l2norm),
        Impl("gdn.core", "isoexec.cpu.cpr_gated_delta_rule", V, A,
             {"chunk_size": k.chunk_size, "state_dtype": "float32", "state_pass": "wy_ut_forward_subst_c_m_ascending",
              "in_chunk": "recurrent_c_scan", "scan_order": "dk_ascending_fp32_no_fma",
              "cflags": " ".join(CFLAGS), "decode_resync": True}, "gates:decode_chunk_boundaries", gdn_core),
        Impl("gdn.norm", "isoexec.cpu.gated_rms_norm", V, A, norms, "gates:trainer_vs_engine", norm.iso_gated_rms_norm),
        Impl("moe.router", "isoexec.cpu.router_softmax_stable_topk", V, A, {**gemm, "ties": "lower_id"},
             "gates:batch_composition", partial(moe.iso_router, row_tile=k.row_tile, col_tile=k.col_tile), bd),
        Impl("moe.experts", "isoexec.cpu.fma_swiglu_pik_down", V, A, mlp, "gates:batch_composition",
             partial(moe.iso_experts, row_tile=k.row_tile, col_tile=k.col_tile, leaves=k.leaves), bd),
        Impl("moe.combine", "isoexec.cpu.routing_order_sum", V, A, {"acc_dtype": "float32", "order": "routing_rank"},
             "gates:batch_composition", moe.iso_combine),
        Impl("mlp.shared_expert", "isoexec.cpu.fma_swiglu_pik_down_sigmoid_gate", V, A, mlp,
             "gates:batch_composition",
             partial(moe.iso_shared_expert, row_tile=k.row_tile, col_tile=k.col_tile, leaves=k.leaves), bd),
        Impl("lm_head", "isoexec.cpu.fma_gemm", V, A, {**gemm, "out_dtype": "float32"}, "gates:trainer_vs_engine",
             partial(col, out_dtype=torch.float32), bd),
        Impl("logprob", "isoexec.cpu.blocked_log_softmax", V, A,
             {"vocab_block": k.vocab_block, "temperature": float(k.temperature), "logits_dtype": "float32"},
             "gates:trainer_vs_engine", partial(iso_logprob, temperature=k.temperature, vocab_block=k.vocab_block)),
    ]


def _native(k, device: str) -> list[Impl]:
    from isoexec.kernels.attention import native as attn, rope
    from isoexec.kernels.conv.native import native_causal_conv1d_pieces
    from isoexec.kernels.gdn import native as gdn
    from isoexec.kernels.gemm.native import native_linear
    from isoexec.kernels.logprob.native import native_logprob
    from isoexec.kernels.moe import native as moe
    from isoexec.kernels.norm import native as norm

    V, A = f"torch-{torch.__version__}", "cpu" if device == "cpu" else "sm90"
    if device == "cpu":
        gdn_id = "native.torch.gdn.core"

        def gdn_core(q, k_, v, g, beta, lengths, states, grad):  # noqa: ARG001 - autograd runs through it
            return gdn.native_gdn(q, k_, v, g, beta, lengths, states, k.chunk_size)
    else:
        from isoexec.kernels import autograd

        gdn_id = "native.fla.chunk+fused_recurrent"

        def gdn_core(q, k_, v, g, beta, lengths, states, grad):
            if grad:
                o = autograd.with_ref_grad(lambda *t: gdn.fla_gdn(*t, lengths, [None] * len(lengths))[0],
                                           lambda *t: gdn.chunk_reference(lengths, k.chunk_size, *t), q, k_, v, g, beta)
                return o, [None] * len(lengths)
            return gdn.fla_gdn(q, k_, v, g, beta, lengths, states)
    gemm_id = "native.torch.{}" if device == "cpu" else "native.cublas.f_linear"

    def impl(region, iid, fn):
        return Impl(region, iid, V, A, {}, "none", fn, lambda dt: {"dtype": _dtype_name(dt)})

    proj = lambda r: gemm_id.format(r)  # noqa: E731
    return [
        impl("embed", "native.torch.embed", lambda table, ids: table[ids]),
        impl("norm.rms", "native.torch.norm.rms", norm.native_rms_norm),
        *[impl(r, proj(r), native_linear) for r in GEMM_REGIONS],
        impl("attn.rope", "native.torch.attn.rope", rope.apply_rope),
        impl("attn.core", "native.torch.attn.core" if device == "cpu" else "native.torch.sdpa", attn.native_attention),
        impl("attn.gate", "native.torch.attn.gate", attn.native_sigmoid_gate),
        impl("gdn.conv1d", "native.torch.gdn.conv1d", native_causal_conv1d_pieces),
        impl("gdn.gating", "native.torch.gdn.gating", gdn.native_gating),
        impl("gdn.l2norm", "native.torch.gdn.l2norm", norm.native_l2norm),
        impl("gdn.core", gdn_id, gdn_core),
        impl("gdn.norm", "native.torch.gdn.norm", norm.native_gated_rms_norm),
        impl("moe.router", "native.torch.moe.router", moe.native_router),
        impl("moe.experts", "native.torch.moe.experts" if device == "cpu" else "native.cublas.grouped_mm_experts",
             moe.native_experts if device == "cpu" else moe.native_experts_grouped),
        impl("moe.combine", "native.torch.moe.combine", moe.native_combine),
        impl("mlp.shared_expert", "native.torch.mlp.shared_expert", moe.native_shared_expert),
        impl("lm_head", proj("lm_head"), partial(native_linear, out_dtype=torch.float32)),
        impl("logprob", "native.torch.logprob", partial(native_logprob, temperature=k.temperature)),
    ]


def _isoexec_sm90(k) -> list[Impl]:
    from isoexec.kernels.attention import cpu as attn_cpu, rope, triton as attn
    from isoexec.kernels.conv import triton as conv
    from isoexec.kernels.gdn import cpu as gdn_cpu, triton as gdn, triton_backward as gdn_bwd
    from isoexec.kernels.gemm import triton as gemm
    from isoexec.kernels.logprob import triton as logprob
    from isoexec.kernels.moe import cpu as moe_cpu, triton as moe
    from isoexec.kernels.norm import triton as norm

    t = k.triton

    def gdn_core(q, k_, v, g, beta, lengths, states, grad):
        if not grad:
            return gdn.cpr_gdn(q, k_, v, g, beta, lengths, states, k.chunk_size, t, keep_state=True)
        if any(s is not None for s in states):
            raise ValueError("trainer_fwd (grad=True) GDN starts from empty states")
        return gdn_bwd.CPRTritonTrainerFunction.apply(q, k_, v, g, beta, lengths, k.chunk_size, t), [None] * len(lengths)

    def gdn_slots(q, k_, v, g, beta, slots, positions):
        return gdn.decode_scan_slots(q, k_, v, g, beta, slots, positions,
                                     gdn.get_pool(k_.shape[1], k_.shape[2], v.shape[2], k.chunk_size, k_.device), t)

    V, A = "2", "sm90"
    acc = {"acc_dtype": "float32"}
    gemm_c = lambda dt: {"boundary_dtype": _dtype_name(dt), **gemm.constants(t, dt)}  # noqa: E731
    leaf_c = lambda dt: {"boundary_dtype": _dtype_name(dt), **gemm.leaf_constants(t, dt, k.leaves)}  # noqa: E731
    mlp_c = lambda dt: {**gemm_c(dt), **{f"down_{n}": v for n, v in gemm.leaf_constants(t, dt, k.leaves).items()}}  # noqa: E731
    row = {"reduction": "tl.sum_fixed_tile", "acc_dtype": "float32", "tile": "function_of_D_only"}
    ew = {"impl": "torch_elementwise_cuda", "math_dtype": "float32"}
    gemm_proof = "tests/test_kernels_triton.py"
    pik_proof = "tests/test_kernels_triton.py::test_leaf_gemm_bitwise_across_tp_subtrees_and_launches"
    return [
        Impl("embed", "isoexec.torch.embedding_gather", V, A, {"impl": "torch_elementwise_cuda"},
             "gates:trainer_vs_engine", lambda table, ids: table[ids], lambda dt: {"dtype": _dtype_name(dt)}),
        Impl("norm.rms", "isoexec.triton.rms_norm", V, A, {**row, "scale": "one_plus_w"}, "gates:batch_composition",
             norm.rms_norm_autograd),
        *[Impl(r, "isoexec.triton.gemm", V, A, acc, gemm_proof, partial(gemm.linear_autograd, cfg=t), gemm_c)
          for r in GEMM_REGIONS if r not in ROW_PARALLEL_REGIONS],
        *[Impl(r, "isoexec.triton.pik_leaf_gemm", V, A, acc, pik_proof,
               partial(gemm.linear_leaves_autograd, cfg=t, leaves=k.leaves), leaf_c) for r in ROW_PARALLEL_REGIONS],
        Impl("attn.rope", "isoexec.torch.rope_elementwise", V, A, ew, "gates:trainer_vs_engine", rope.apply_rope,
             lambda dt: {"table_dtype": _dtype_name(dt)}),
        Impl("attn.core", "isoexec.triton.blockwise_online_softmax", V, A,
             {"kv_block": k.kv_block, "tile_m": t.attn_block_m, "num_warps": t.attn_num_warps, "acc_dtype": "float32",
              "block_order": "ascending", "softmax": "exp2_scale_after_max", "fp_contraction": False,
              "split_kv": 1}, "gates:prefill_split",
             partial(attn.attention_autograd, kv_block=k.kv_block, block_m=t.attn_block_m, num_warps=t.attn_num_warps,
                     num_stages=t.attn_num_stages),
             lambda dt: {"p_dtype": _dtype_name(dt)},
             partial(attn.attention_slots, kv_block=k.kv_block, block_m=t.attn_block_m, num_warps=t.attn_num_warps,
                     num_stages=t.attn_num_stages)),
        Impl("attn.gate", "isoexec.torch.sigmoid_gate", V, A, ew, "gates:trainer_vs_engine", attn_cpu.iso_sigmoid_gate),
        Impl("gdn.conv1d", "isoexec.triton.causal_conv1d", V, A,
             {"order": "tap_ascending", "acc_dtype": "float32", "tile_t": t.conv_block_t, "tile_c": t.conv_block_c},
             "gates:prefill_split", partial(conv.causal_conv1d_pieces, block_t=t.conv_block_t, block_c=t.conv_block_c),
             slots=partial(conv.causal_conv1d_slots, block_t=t.conv_block_t, block_c=t.conv_block_c)),
        Impl("gdn.gating", "isoexec.torch.gdn_gating", V, A, ew, "gates:trainer_vs_engine", gdn_cpu.iso_gating),
        Impl("gdn.l2norm", "isoexec.triton.l2norm", V, A, {**row, "eps": 1e-6}, "gates:trainer_vs_engine",
             norm.l2norm_autograd),
        Impl("gdn.core", "isoexec.triton.cpr_gated_delta_rule", V, A, gdn.constants(k.chunk_size, t),
             "gates:decode_chunk_boundaries", gdn_core, slots=gdn_slots),
        Impl("gdn.norm", "isoexec.triton.gated_rms_norm", V, A, row, "gates:trainer_vs_engine",
             norm.gated_rms_norm_autograd),
        Impl("moe.router", "isoexec.triton.gemm+torch_softmax_tree_stable_sort", V, A, {**acc, "ties": "lower_id"},
             "gates:batch_composition", partial(moe.router, cfg=t), gemm_c),
        Impl("moe.experts", "isoexec.triton.grouped_gemm_swiglu_leaf_down", V, A, acc, "gates:batch_composition",
             partial(moe.experts, cfg=t, leaves=k.leaves), mlp_c),
        Impl("moe.combine", "isoexec.torch.routing_order_sum", V, A, {"acc_dtype": "float32", "order": "routing_rank"},
             "gates:batch_composition", moe_cpu.iso_combine),
        Impl("mlp.shared_expert", "isoexec.triton.gemm_swiglu_leaf_down_sigmoid_gate", V, A, acc,
             "gates:batch_composition", partial(moe.shared_expert, cfg=t, leaves=k.leaves), mlp_c),
        Impl("lm_head", "isoexec.triton.gemm", V, A, {**acc, "out_dtype": "float32"}, "gates:trainer_vs_engine",
             partial(gemm.linear_autograd, cfg=t, out_dtype=torch.float32), gemm_c),
        Impl("logprob", "isoexec.triton.online_blocked_log_softmax", V, A,
             {"vocab_block": k.vocab_block, "temperature": float(k.temperature), "logits_dtype": "float32",
              "block_order": "ascending"}, "gates:trainer_vs_engine",
             partial(logprob.logprob_autograd, temperature=k.temperature, vocab_block=k.vocab_block)),
    ]


def build_kernel_set(mode: str, device: str, section=None) -> KernelSet:
    """The kernel set of ``mode`` on ``device`` with the constants of ``section``.

    Args:
        mode: ``"isoexec"`` or ``"native"``.
        device: ``"cpu"`` or ``"cuda"`` (the Triton modules are imported only for ``isoexec`` on CUDA).
        section: an :class:`isoexec.config.KernelSection`; None takes its defaults.

    Raises:
        ValueError: unknown mode or device (naming the allowed values), or constants the device's
            kernels cannot run (:meth:`~isoexec.config.KernelSection.check_device`).
    """
    from isoexec.config import KernelSection

    section = section if section is not None else KernelSection()
    if mode not in ("isoexec", "native"):
        raise ValueError(f"unknown kernel set mode={mode!r}; allowed: 'isoexec', 'native'")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device={device!r}; allowed: 'cpu', 'cuda'")
    section.check_device(device)
    arch = "cpu" if device == "cpu" else "sm90"
    if mode == "native":
        return KernelSet(mode, arch, _native(section, device), section)
    if device == "cpu":
        return KernelSet(mode, arch, _isoexec_cpu(section), section, ISOEXEC_CPU_TOPOLOGY)
    return KernelSet(mode, arch, _isoexec_sm90(section), section, ISOEXEC_SM90_TOPOLOGY)
