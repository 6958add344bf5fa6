"""Build a randomly initialised unified model from an experiment's ``model`` section (no network)."""

from __future__ import annotations

import torch

from isoexec.model.qwen3_next import UnifiedModel, kernel_set_from_section


def hf_config(section, vocab_size: int | None = None):
    """A transformers ``Qwen3NextConfig`` from an ``isoexec.config.ModelSection``.

    Args:
        section: the experiment's model section. vocab_size: overrides ``section.vocab_size``.

    Raises:
        ValueError: no vocabulary size given anywhere.
    """
    from transformers import Qwen3NextConfig

    vocab = vocab_size or section.vocab_size
    if not vocab:
        raise ValueError("model.vocab_size is None: pass vocab_size (taken from the task's tokenizer)")
    if vocab < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab}")
    layer_types = section.layer_types or [
        "full_attention" if (i + 1) % section.full_attention_interval == 0 else "linear_attention"
        for i in range(section.num_hidden_layers)
    ]
    return Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=section.hidden_size,
        intermediate_size=section.shared_expert_intermediate_size,
        num_hidden_layers=section.num_hidden_layers,
        layer_types=layer_types,
        full_attention_interval=section.full_attention_interval,
        num_attention_heads=section.num_attention_heads,
        num_key_value_heads=section.num_key_value_heads,
        head_dim=section.head_dim,
        partial_rotary_factor=section.partial_rotary_factor,
        rope_parameters={"rope_type": "default", "rope_theta": section.rope_theta,
                         "partial_rotary_factor": section.partial_rotary_factor},
        rms_norm_eps=section.rms_norm_eps,
        max_position_embeddings=section.max_position_embeddings,
        linear_num_key_heads=section.linear_num_key_heads,
        linear_num_value_heads=section.linear_num_value_heads,
        linear_key_head_dim=section.linear_key_head_dim,
        linear_value_head_dim=section.linear_value_head_dim,
        linear_conv_kernel_dim=section.linear_conv_kernel_dim,
        num_experts=section.num_experts,
        num_experts_per_tok=section.num_experts_per_tok,
        moe_intermediate_size=section.moe_intermediate_size,
        shared_expert_intermediate_size=section.shared_expert_intermediate_size,
        norm_topk_prob=section.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=section.tie_word_embeddings,
        initializer_range=section.init_std,
        architectures=["Qwen3NextForCausalLM"],
        dtype=section.dtype,
    )


def random_model(section, kernels_section=None, kernel_set: str = "isoexec", vocab_size: int | None = None,
                 seed: int = 0, dtype: torch.dtype | None = None, device: str = "cpu") -> UnifiedModel:
    """A unified model with HF-style random init (normal(0, init_std) matrices, zero-centred norms,
    ``A_log = log U(1, 16)``, ``dt_bias = 1``), deterministic in ``seed``."""
    cfg = hf_config(section, vocab_size)
    dtype = dtype or getattr(torch, section.dtype)
    model = UnifiedModel(cfg, kernel_set_from_section(kernel_set, kernels_section, device), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * section.init_std)
    return model.to(dtype).to(device)
