"""Tiny Hugging Face ``Qwen3NextForCausalLM`` checkpoints built offline from an experiment config.

Used by ``isoexec rollout-check`` and the engine tests when the pipeline has not produced a trained
checkpoint yet. The directory holds ``config.json`` + ``model.safetensors`` (transformers
``save_pretrained``), which both vLLM's built-in ``Qwen3NextForCausalLM`` and
``isoexec.model.UnifiedModel.from_pretrained`` load. No tokenizer: callers pass prompt token ids.
"""

from __future__ import annotations

from pathlib import Path

import torch

from isoexec.config import ModelSection

DEFAULT_VOCAB_SIZE = 256
"""Vocabulary used when ``ModelSection.vocab_size`` is None (the task tokenizer is not involved here)."""


def qwen3_next_config(model: ModelSection, vocab_size: int | None = None):
    """transformers ``Qwen3NextConfig`` with the fields of ``model``.

    Args:
        model: the experiment's ``model`` section.
        vocab_size: overrides ``model.vocab_size``; None and ``model.vocab_size`` None give
            ``DEFAULT_VOCAB_SIZE``.
    """
    from transformers import Qwen3NextConfig

    layer_types = model.layer_types or [
        "full_attention" if (i + 1) % model.full_attention_interval == 0 else "linear_attention"
        for i in range(model.num_hidden_layers)
    ]
    return Qwen3NextConfig(
        vocab_size=vocab_size or model.vocab_size or DEFAULT_VOCAB_SIZE,
        hidden_size=model.hidden_size,
        intermediate_size=model.moe_intermediate_size,
        num_hidden_layers=model.num_hidden_layers,
        layer_types=layer_types,
        full_attention_interval=model.full_attention_interval,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        partial_rotary_factor=model.partial_rotary_factor,
        rope_parameters={
            "rope_theta": model.rope_theta,
            "partial_rotary_factor": model.partial_rotary_factor,
            "rope_type": "default",
        },
        rms_norm_eps=model.rms_norm_eps,
        max_position_embeddings=model.max_position_embeddings,
        linear_num_key_heads=model.linear_num_key_heads,
        linear_num_value_heads=model.linear_num_value_heads,
        linear_key_head_dim=model.linear_key_head_dim,
        linear_value_head_dim=model.linear_value_head_dim,
        linear_conv_kernel_dim=model.linear_conv_kernel_dim,
        num_experts=model.num_experts,
        num_experts_per_tok=model.num_experts_per_tok,
        moe_intermediate_size=model.moe_intermediate_size,
        shared_expert_intermediate_size=model.shared_expert_intermediate_size,
        norm_topk_prob=model.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.init_std,
        architectures=["Qwen3NextForCausalLM"],
        dtype=model.dtype,
    )


def build_tiny_checkpoint(
    path: str | Path, model: ModelSection, *, vocab_size: int | None = None, seed: int = 0
) -> Path:
    """Write a randomly initialised ``Qwen3NextForCausalLM`` to ``path`` (idempotent).

    If ``path/config.json`` and ``path/model.safetensors`` already exist, nothing is written.
    Weights: transformers' own initialisation under ``torch.manual_seed(seed)``, cast to
    ``model.dtype`` (bf16 by default: vLLM's CPU GDN kernels accept bf16 only).

    Returns:
        ``path`` as a ``Path``.
    """
    from transformers import Qwen3NextForCausalLM

    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    cfg = qwen3_next_config(model, vocab_size)
    torch.manual_seed(seed)
    hf = Qwen3NextForCausalLM(cfg).to(getattr(torch, model.dtype))
    tmp = path.with_name(path.name + ".tmp")
    hf.save_pretrained(tmp, safe_serialization=True)
    tmp.replace(path) if not path.exists() else _move_into(tmp, path)
    return path


def _move_into(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        f.replace(dst / f.name)
    src.rmdir()
