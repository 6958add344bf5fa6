"""Kernel sets: the implementation of every region for one execution policy (the one registry).

A :class:`KernelSet` is what the unified model calls; :meth:`KernelSet.composition` lists, per region,
the implementation id, version, arch and pinned constants that enter the execution contract.

* ``isoexec`` (``IsoExecCPU``): batch-, mode- and position-invariant CPU kernels (this package).
* ``native`` (``NativeTorch``): stock torch kernels as the Hugging Face model runs them; the negative
  control of every gate.
* ``isoexec`` on CUDA (``isoexec.kernels.triton``) registers itself here when importable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from isoexec.kernels import attention, dense, logprob, moe
from isoexec.kernels.gdn import cpr, native as gdn_native

@dataclass(frozen=True)
class KernelImpl:
    """One region's implementation as recorded in the contract."""

    region: str
    impl_id: str
    version: str
    arch: str
    constants: dict = field(default_factory=dict)
    proof: str = ""


class KernelSet:
    """Interface the model calls. Shapes: N rows (tokens), H heads, D head dim, V vocabulary."""

    name: str = ""
    arch: str = "cpu"

    def __init__(self, chunk_size: int = 64, row_tile: int = 16, kv_block: int = 64, vocab_block: int = 256, temperature: float = 1.0):
        if chunk_size < 1 or row_tile < 1 or kv_block < 1 or vocab_block < 1:
            raise ValueError(
                f"kernel constants must be >= 1, got chunk_size={chunk_size} row_tile={row_tile} "
                f"kv_block={kv_block} vocab_block={vocab_block}"
            )
        if vocab_block & (vocab_block - 1):
            raise ValueError(f"vocab_block must be a power of two, got {vocab_block}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.chunk_size, self.row_tile, self.kv_block, self.vocab_block = chunk_size, row_tile, kv_block, vocab_block
        self.temperature = float(temperature)

    # regions --------------------------------------------------------------------------------------
    def linear(self, x, w, out_dtype=None): raise NotImplementedError  # noqa: E704
    def rms_norm(self, x, w, eps): raise NotImplementedError  # noqa: E704
    def gated_rms_norm(self, x, z, w, eps): raise NotImplementedError  # noqa: E704
    def l2norm(self, x): raise NotImplementedError  # noqa: E704
    def sigmoid_gate(self, x, gate): raise NotImplementedError  # noqa: E704
    def conv1d(self, x, w, prefix): raise NotImplementedError  # noqa: E704
    def gdn_gating(self, a, b, A_log, dt_bias): raise NotImplementedError  # noqa: E704
    def attention(self, q, kv, starts, lengths): raise NotImplementedError  # noqa: E704
    def gdn(self, q, k, v, g, beta, lengths, states, grad): raise NotImplementedError  # noqa: E704
    def moe(self, x, router_w, experts, shared, shared_gate_w, top_k, norm_topk_prob): raise NotImplementedError  # noqa: E704
    def logprob(self, logits): raise NotImplementedError  # noqa: E704

    def composition(self, dtype: torch.dtype) -> list[KernelImpl]:
        """Per-region implementations and pinned constants for the contract."""
        raise NotImplementedError


class IsoExecCPU(KernelSet):
    """Batch- and mode-invariant CPU kernels (fp32 accumulation, fixed tiles, fixed trees)."""

    name = "isoexec"
    arch = "cpu"
    version = "1"

    def linear(self, x, w, out_dtype=None):
        return dense.iso_linear(x, w, self.row_tile, out_dtype)

    def rms_norm(self, x, w, eps):
        return dense.iso_rms_norm(x, w, eps)

    def gated_rms_norm(self, x, z, w, eps):
        return dense.iso_gated_rms_norm(x, z, w, eps)

    def l2norm(self, x):
        return dense.iso_l2norm(x)

    def sigmoid_gate(self, x, gate):
        return dense.iso_sigmoid_gate(x, gate)

    def conv1d(self, x, w, prefix):
        return dense.iso_causal_conv1d(x, w, prefix)

    def gdn_gating(self, a, b, A_log, dt_bias):
        from isoexec.kernels.primitives import sigmoid, softplus

        beta = sigmoid(b.float()).to(b.dtype).float()
        g = -torch.exp(A_log.float()) * softplus(a.float() + dt_bias.float())
        return g, beta

    def attention(self, q, kv, starts, lengths):
        return attention.iso_attention(q, kv, starts, lengths, self.row_tile, self.kv_block)

    def gdn(self, q, k, v, g, beta, lengths, states, grad):
        if grad:
            if any(s is not None for s in states):
                raise ValueError("trainer_fwd (grad=True) GDN starts from empty states")
            return cpr.CPRFunction.apply(q, k, v, g, beta, lengths, self.chunk_size), [None] * len(lengths)
        return cpr.cpr_gdn(q, k, v, g, beta, lengths, states, self.chunk_size)

    def moe(self, x, router_w, experts, shared, shared_gate_w, top_k, norm_topk_prob):
        return moe.iso_moe(x, router_w, experts, shared, shared_gate_w, top_k, norm_topk_prob, self.row_tile)

    def logprob(self, logits):
        return logprob.iso_logprob(logits, self.temperature, self.vocab_block)

    def composition(self, dtype):
        bd = str(dtype).replace("torch.", "")
        gemm = {"acc_dtype": "float32", "boundary_dtype": bd, "row_tile": self.row_tile, "split_k": 1}
        tree = {"reduction": "binary_tree_pow2", "acc_dtype": "float32"}
        impl = lambda region, iid, consts, proof: KernelImpl(region, iid, self.version, self.arch, consts, proof)  # noqa: E731
        return [
            impl("embed", "isoexec.cpu.embedding_gather", {"dtype": bd}, "gates:trainer_vs_engine"),
            impl("norm.rms", "isoexec.cpu.rms_norm", {**tree, "scale": "one_plus_w"}, "gates:batch_composition"),
            *[impl(r, "isoexec.cpu.tile_gemm", gemm, "tests/test_kernels_primitives.py::test_tile_mm_row_bits_independent_of_row_count_and_position")
              for r in ("attn.qkv_proj", "attn.out_proj", "gdn.in_proj", "gdn.out_proj")],
            impl("attn.rope", "isoexec.cpu.rope_elementwise", {"table_dtype": bd}, "gates:trainer_vs_engine"),
            impl("attn.core", "isoexec.cpu.blockwise_online_softmax",
                 {"kv_block": self.kv_block, "row_tile": self.row_tile, "acc_dtype": "float32", "block_order": "ascending"},
                 "gates:prefill_split"),
            impl("attn.gate", "isoexec.cpu.sigmoid_gate", {"math_dtype": "float32"}, "gates:trainer_vs_engine"),
            impl("gdn.conv1d", "isoexec.cpu.causal_conv1d", {"order": "tap_ascending", "acc_dtype": "float32"}, "gates:prefill_split"),
            impl("gdn.gating", "isoexec.cpu.gdn_gating", {"math_dtype": "float32"}, "gates:trainer_vs_engine"),
            impl("gdn.l2norm", "isoexec.cpu.l2norm", {**tree, "eps": 1e-6}, "gates:trainer_vs_engine"),
            impl("gdn.core", "isoexec.cpu.cpr_gated_delta_rule",
                 {"chunk_size": self.chunk_size, "state_dtype": "float32", "state_pass": "wy_ut_forward_subst",
                  "in_chunk": "recurrent", "decode_resync": True},
                 "gates:decode_chunk_boundaries"),
            impl("gdn.norm", "isoexec.cpu.gated_rms_norm", tree, "gates:trainer_vs_engine"),
            impl("moe.router", "isoexec.cpu.router_softmax_stable_topk", {**gemm, "ties": "lower_id"}, "gates:batch_composition"),
            impl("moe.experts", "isoexec.cpu.tile_gemm_swiglu", gemm, "gates:batch_composition"),
            impl("moe.combine", "isoexec.cpu.routing_order_sum", {"acc_dtype": "float32", "order": "routing_rank"}, "gates:batch_composition"),
            impl("mlp.shared_expert", "isoexec.cpu.tile_gemm_swiglu_sigmoid_gate", gemm, "gates:batch_composition"),
            impl("lm_head", "isoexec.cpu.tile_gemm", {**gemm, "out_dtype": "float32"}, "gates:trainer_vs_engine"),
            impl("logprob", "isoexec.cpu.blocked_log_softmax",
                 {"vocab_block": self.vocab_block, "temperature": self.temperature, "logits_dtype": "float32"},
                 "gates:trainer_vs_engine"),
        ]


class NativeTorch(KernelSet):
    """Stock torch kernels, as the Hugging Face model runs them on CPU (the negative control)."""

    name = "native"
    arch = "cpu"
    version = f"torch-{torch.__version__}"

    def linear(self, x, w, out_dtype=None):
        return dense.native_linear(x, w, out_dtype)

    def rms_norm(self, x, w, eps):
        return dense.native_rms_norm(x, w, eps)

    def gated_rms_norm(self, x, z, w, eps):
        return dense.native_gated_rms_norm(x, z, w, eps)

    def l2norm(self, x):
        return dense.native_l2norm(x)

    def sigmoid_gate(self, x, gate):
        return dense.native_sigmoid_gate(x, gate)

    def conv1d(self, x, w, prefix):
        return dense.native_causal_conv1d(x, w, prefix)

    def gdn_gating(self, a, b, A_log, dt_bias):
        beta = b.sigmoid().float()
        g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
        return g, beta

    def attention(self, q, kv, starts, lengths):
        return attention.native_attention(q, kv, starts, lengths)

    def gdn(self, q, k, v, g, beta, lengths, states, grad):
        return gdn_native.native_gdn(q, k, v, g, beta, lengths, states, self.chunk_size)

    def moe(self, x, router_w, experts, shared, shared_gate_w, top_k, norm_topk_prob):
        return moe.native_moe(x, router_w, experts, shared, shared_gate_w, top_k, norm_topk_prob)

    def logprob(self, logits):
        return logprob.native_logprob(logits, self.temperature)

    def composition(self, dtype):
        bd = str(dtype).replace("torch.", "")
        return [
            KernelImpl(r, f"native.torch.{r}", self.version, self.arch, {"dtype": bd}, "none")
            for r in ("embed", "norm.rms", "attn.qkv_proj", "attn.rope", "attn.core", "attn.gate", "attn.out_proj",
                      "gdn.in_proj", "gdn.conv1d", "gdn.gating", "gdn.l2norm", "gdn.core", "gdn.norm", "gdn.out_proj",
                      "moe.router", "moe.experts", "moe.combine", "mlp.shared_expert", "lm_head", "logprob")
        ]


KERNEL_SETS: dict[tuple[str, str], type[KernelSet]] = {("isoexec", "cpu"): IsoExecCPU, ("native", "cpu"): NativeTorch}


def get_kernel_set(name: str, device: str = "cpu", **constants) -> KernelSet:
    """Instantiate the kernel set ``name`` for ``device`` ("cpu" or "cuda").

    Raises:
        ValueError: unknown (name, device); the message lists the registered pairs.
    """
    if device == "cuda":
        try:  # the Triton set registers itself on import
            import isoexec.kernels.triton  # noqa: F401
        except ImportError:
            pass
    key = (name, device)
    if key not in KERNEL_SETS:
        raise ValueError(f"unknown kernel set {key!r}; registered: {sorted(KERNEL_SETS)}")
    return KERNEL_SETS[key](**constants)
