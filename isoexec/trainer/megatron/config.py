"""Megatron ``TransformerConfig`` for a Hugging Face Qwen3-Next / Qwen3.5 MoE text config.

Field mapping (transformers ``Qwen3NextConfig`` -> megatron-core 0.16.1 ``TransformerConfig``):
``hidden_size``, ``num_hidden_layers -> num_layers``, ``num_attention_heads``,
``num_key_value_heads -> num_query_groups``, ``head_dim -> kv_channels``, ``rms_norm_eps ->
layernorm_epsilon``, ``linear_{num_key_heads,num_value_heads,key_head_dim,value_head_dim,
conv_kernel_dim}`` (same names), ``num_experts -> num_moe_experts``, ``num_experts_per_tok ->
moe_router_topk``, ``moe_intermediate_size -> moe_ffn_hidden_size``,
``shared_expert_intermediate_size -> moe_shared_expert_intermediate_size`` with the sigmoid shared
expert gate. Qwen3-Next's router (softmax over all experts, top-k, renormalise) equals Megatron's
``moe_router_pre_softmax=False`` (top-k of the logits, softmax over the k).

Every fusion and dropout is off. Megatron initialises the weights on the CPU (its initialisation
also marks the tensor-parallel attributes that the gradient reductions read); a checkpoint then
overwrites them through :mod:`isoexec.trainer.megatron.convert`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Layout:
    """A parallel layout of the Megatron trainer.

    Attributes:
        tp: tensor-parallel degree (attention/GDN heads, shared expert, vocabulary split over ranks).
        ep: expert-parallel degree (routed experts split over ranks).
        sp: sequence parallelism (the residual stream split over TP ranks along the sequence);
            Megatron's MoE needs it whenever tp > 1 in training, so ``sp=False`` is refused at tp > 1.
        etp: expert tensor-parallel degree (each routed expert's intermediate dim split over ranks);
            None means ``tp`` when ``ep == 1``, else 1.
        cp: context-parallel degree (each sequence split over ranks in contiguous slices,
            :mod:`isoexec.kernels.collectives.cp`; Megatron's ``context_parallel_size``).

    The world size is ``cp * max(tp, ep * etp)``; ranks that hold the same TP shard and CP slice are
    data-parallel replicas and receive the same batch.
    """

    tp: int = 1
    ep: int = 1
    sp: bool = False
    etp: int | None = None
    cp: int = 1

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else (self.tp if self.ep == 1 else 1)

    @property
    def world_size(self) -> int:
        return self.cp * max(self.tp, self.ep * self.expert_tp)

    @property
    def name(self) -> str:
        """Short name for tables: ``tp1``, ``tp2_sp``, ``ep2``, ``tp2_sp_ep2`` (``_etp<n>`` when set,
        ``_cp<n>`` for context parallelism)."""
        parts = [f"tp{self.tp}"] if self.tp > 1 or self.ep == 1 else []
        parts += ["sp"] if self.sp else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp is not None else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        return "_".join(parts)

    def degrees(self) -> dict[str, int]:
        """The degrees as :func:`isoexec.contract.check_topology` takes them: ``tp``, ``ep``, ``sp``
        (``tp`` under sequence parallelism, else 1), ``dp`` (replicas of each TP shard and CP slice)
        and ``cp``."""
        return {"tp": self.tp, "ep": self.ep, "sp": self.tp if self.sp else 1,
                "dp": self.world_size // (self.tp * self.cp), "cp": self.cp}

    def check(self) -> "Layout":
        """Raises ValueError naming the bad value: degrees not >= 1, sp without tp > 1 or tp > 1
        without sp, or a world size that the TP or expert grid does not divide."""
        for name, v in (("tp", self.tp), ("ep", self.ep), ("etp", self.expert_tp), ("cp", self.cp)):
            if v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        if self.tp > 1 and not self.sp:
            raise ValueError(f"tp={self.tp} > 1 needs sp=True (Megatron's MoE refuses TP without sequence parallelism in training)")
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1")
        w = self.world_size
        if w % self.tp or w % (self.ep * self.expert_tp):
            raise ValueError(f"world size {w} is not divisible by tp={self.tp} and ep*etp={self.ep * self.expert_tp}")
        return self


def layout_problems(c, layout: Layout) -> list[str]:
    """What ``layout`` cannot split in the architecture ``c``, one message per size.

    Args:
        c: anything with the Qwen3-Next size fields (transformers' config, or
            :class:`isoexec.config.ModelSection`, whose ``vocab_size`` may be None: then not checked).
        layout: the parallel layout.

    Returns:
        Messages naming each size and degree: heads, GDN heads, vocabulary and shared-expert width
        by ``tp``, experts by ``ep``, the expert width by the expert TP degree, and query groups vs ``tp``.
    """
    tp, etp = layout.tp, layout.expert_tp
    sizes = (("num_attention_heads", c.num_attention_heads, "tp", tp),
             ("linear_num_key_heads", c.linear_num_key_heads, "tp", tp),
             ("linear_num_value_heads", c.linear_num_value_heads, "tp", tp), ("vocab_size", c.vocab_size, "tp", tp),
             ("shared_expert_intermediate_size", c.shared_expert_intermediate_size, "tp", tp),
             ("num_experts", c.num_experts, "ep", layout.ep), ("moe_intermediate_size", c.moe_intermediate_size, "etp", etp))
    bad = [f"{name}={v} is not divisible by {deg_name}={deg}" for name, v, deg_name, deg in sizes
           if v is not None and v % deg]
    if c.num_key_value_heads % tp and tp % c.num_key_value_heads:
        bad.append(f"num_key_value_heads={c.num_key_value_heads} and tp={tp}: one must divide the other")
    return bad


def splittable_degrees(c, dim: str, up_to: int = 16) -> list[int]:
    """The degrees of ``dim`` (``"tp"`` or ``"ep"``) in 1..``up_to`` that split every size of ``c`` with
    the other dimension at 1 (:func:`layout_problems` empty); for error messages."""
    if dim not in ("tp", "ep"):
        raise ValueError(f"dim must be 'tp' or 'ep', got {dim!r}")
    layouts = {d: Layout(tp=d, sp=d > 1) if dim == "tp" else Layout(ep=d) for d in range(1, up_to + 1)}
    return [d for d, lay in layouts.items() if not layout_problems(c, lay)]


def transformer_config(hf_config, layout: Layout, dtype: torch.dtype):
    """The Megatron ``TransformerConfig`` of ``hf_config`` under ``layout``.

    Args:
        hf_config: transformers ``Qwen3NextConfig`` (or a Qwen3.5 MoE text config); every layer must
            be an MoE layer (``decoder_sparse_step == 1``, no ``mlp_only_layers``).
        layout: the parallel layout (checked).
        dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``).

    Raises:
        ValueError: dense MLP layers, a dtype other than fp32/bf16, or a size the layout does not divide
            (naming each: heads, GDN heads, vocabulary and shared-expert width by ``tp``, experts by
            ``ep``, the expert width by the expert TP degree).
    """
    layout.check()
    c = hf_config
    bad = layout_problems(c, layout)
    if bad:
        raise ValueError("layout " + str(layout) + ": " + "; ".join(bad))
    if getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1 or not c.num_experts:
        raise ValueError("the Megatron trainer builds MoE in every layer: need num_experts > 0, decoder_sparse_step=1, mlp_only_layers=[]")
    import torch
    import torch.nn.functional as F

    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim,
        ffn_hidden_size=c.shared_expert_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        qk_layernorm=True,
        attention_output_gate=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        linear_conv_kernel_dim=c.linear_conv_kernel_dim,
        linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim,
        linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads,
        num_moe_experts=c.num_experts,
        moe_router_topk=c.num_experts_per_tok,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        moe_shared_expert_gate=True,
        moe_router_pre_softmax=not getattr(c, "norm_topk_prob", True),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.sp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        context_parallel_size=layout.cp,
    )
