"""The Qwen3-Next hybrid as a Megatron layer spec, keyed by kernel set, and the model built from it.

Megatron-core 0.16.1 ships the hybrid pieces (``GatedDeltaNet``, ``SelfAttention`` with
``attention_output_gate`` and ``qk_layernorm``, ``MoELayer`` with a gated ``SharedExpertMLP``) but its
ready hybrid spec (``get_transformer_block_with_experimental_attention_variant_spec``) needs
Transformer Engine. This module assembles the same layer list from the public pieces with
``LocalSpecProvider``: per HF ``layer_types`` entry, a ``TransformerLayer`` whose ``self_attention``
slot holds ``GatedDeltaNet`` (``linear_attention``) or gated ``SelfAttention`` (``full_attention``),
followed by an MoE block, with zero-centred ``(1 + w)`` norms and partial RoPE.

Kernel sets fill the same slots with modules of the same parameter names, so one converter serves both:

* ``native``: Megatron's stock local modules (``ColumnParallelLinear``, ``RowParallelLinear`` with its
  all-reduce / reduce-scatter, ``DotProductAttention``, its MoE router, all-gather token dispatcher
  and ``SequentialMLP`` experts, its torch GDN), plus the
  :class:`~isoexec.trainer.megatron.gated_attention.GatedSelfAttention` fix and our
  :class:`~isoexec.trainer.megatron.norms.RMSNorm`.
* ``isoexec``: :mod:`isoexec.trainer.megatron.layers` (pik row-parallel GEMMs, column-invariant GEMMs, our
  attention, CPR GDN, routing-order MoE, blocked logprob) calling a :class:`~isoexec.kernels.KernelSet`.
"""

from __future__ import annotations

from isoexec.trainer.megatron import compat

compat.apply()

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add  # noqa: E402
from megatron.core.models.backends import LocalSpecProvider  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules  # noqa: E402
from megatron.core.transformer.attention import SelfAttentionSubmodules  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # noqa: E402
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: E402

from isoexec.trainer.megatron.gated_attention import GatedSelfAttention  # noqa: E402
from isoexec.trainer.megatron.norms import IsoRMSNorm, RMSNorm  # noqa: E402


def _norm(kernels, zero_centered: bool = True) -> ModuleSpec:
    if kernels is None:
        return ModuleSpec(module=RMSNorm, params={"zero_centered": zero_centered})
    return ModuleSpec(module=IsoRMSNorm, params={"zero_centered": zero_centered, "kernels": kernels})


def _linear(kind: str, kernels, region: str) -> ModuleSpec | type:
    """A column (``"col"``) or row (``"row"``) parallel linear slot: Megatron's local module, or ours
    running ``region`` of the kernel set."""
    local = LocalSpecProvider()
    if kernels is None:
        return local.column_parallel_linear() if kind == "col" else local.row_parallel_linear()
    from isoexec.trainer.megatron import layers

    module = layers.IsoColumnParallelLinear if kind == "col" else layers.IsoRowParallelLinear
    return ModuleSpec(module=module, params={"kernels": kernels, "region": region})


def layer_specs(hf_config, kernels=None) -> TransformerBlockSubmodules:
    """The decoder block spec of ``hf_config`` for a kernel set.

    Args:
        hf_config: transformers Qwen3-Next config (``layer_types`` decides GDN vs attention per layer).
        kernels: None for the ``native`` set (Megatron's stock modules), or the
            :class:`~isoexec.kernels.KernelSet` the ``isoexec`` modules call.

    Returns:
        ``TransformerBlockSubmodules`` with one ``TransformerLayer`` spec per layer and the final norm.

    Raises:
        ValueError: a layer type other than ``linear_attention`` / ``full_attention``.
    """
    local = LocalSpecProvider()
    if kernels is None:
        attn, gdn, moe, core, iso = GatedSelfAttention, GatedDeltaNet, MoELayer, local.core_attention(), {}
    else:
        from isoexec.trainer.megatron import layers

        attn, gdn, moe, iso = layers.IsoSelfAttention, layers.IsoGatedDeltaNet, layers.IsoMoELayer, {"kernels": kernels}
        core = ModuleSpec(module=layers.IsoCoreAttention, params=iso)
    # Expert and shared-expert linears: Megatron's local modules (the isoexec MoE reads their weights).
    mlp = MLPSubmodules(linear_fc1=local.column_parallel_linear(), linear_fc2=local.row_parallel_linear())
    moe_spec = ModuleSpec(
        module=moe,
        params=iso,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=local.grouped_mlp_modules(False, False)[0], submodules=mlp),
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=mlp),
        ),
    )
    mixers = {
        "linear_attention": ModuleSpec(
            module=gdn,
            params=iso,
            submodules=GatedDeltaNetSubmodules(in_proj=_linear("col", kernels, "gdn.in_proj"),
                                               out_norm=_norm(kernels, zero_centered=False),
                                               out_proj=_linear("row", kernels, "gdn.out_proj")),
        ),
        "full_attention": ModuleSpec(
            module=attn,
            params={"attn_mask_type": AttnMaskType.causal, **iso, **({"rope": rotary(hf_config)} if iso else {})},
            submodules=SelfAttentionSubmodules(linear_qkv=_linear("col", kernels, "attn.qkv_proj"), core_attention=core,
                                               linear_proj=_linear("row", kernels, "attn.out_proj"),
                                               q_layernorm=_norm(kernels), k_layernorm=_norm(kernels)),
        ),
    }
    layers = []
    for i, t in enumerate(hf_config.layer_types):
        if t not in mixers:
            raise ValueError(f"layer_types[{i}]={t!r}; allowed: {sorted(mixers)}")
        layers.append(ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=_norm(kernels), self_attention=mixers[t], self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=_norm(kernels), mlp=moe_spec, mlp_bda=get_bias_dropout_add,
            ),
        ))
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=_norm(kernels))


def rotary(hf_config) -> tuple[float, float]:
    """(rotary_percent, rotary_base) of ``hf_config`` (partial RoPE)."""
    rp = getattr(hf_config, "rope_parameters", None) or {}
    factor = rp.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    theta = rp.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return float(factor), float(theta)


def build_gpt_model(hf_config, config, kernels=None) -> GPTModel:
    """A Megatron ``GPTModel`` of the Qwen3-Next hybrid for this rank (uninitialised weights).

    Args:
        hf_config: transformers config. config: the ``TransformerConfig``
            (:func:`isoexec.trainer.megatron.config.transformer_config`).
        kernels: None (``native``) or the kernel set of the ``isoexec`` modules.

    Returns:
        ``GPTModel`` with untied embedding/output layer; the ``isoexec`` set replaces the output layer's
        module by :class:`~isoexec.trainer.megatron.layers.IsoColumnParallelLinear` (region ``lm_head``,
        same parameter: ``GPTModel`` builds its output layer itself, outside the spec).
    """
    percent, base = rotary(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_specs(hf_config, kernels),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope" if kernels is None else "none",
        rotary_percent=percent,
        rotary_base=base,
    )
    if kernels is not None:
        from isoexec.trainer.megatron.layers import IsoColumnParallelLinear

        model.output_layer = IsoColumnParallelLinear.replacing(model.output_layer, kernels, "lm_head")
    return model


__all__ = ["build_gpt_model", "layer_specs", "rotary"]
