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
from isoexec.model.build import hf_config

DEFAULT_VOCAB_SIZE = 256
"""Vocabulary used when ``ModelSection.vocab_size`` is None (the task tokenizer is not involved here)."""


def qwen3_next_config(model: ModelSection, vocab_size: int | None = None):
    """transformers ``Qwen3NextConfig`` of ``model`` (``DEFAULT_VOCAB_SIZE`` when no vocabulary is given)."""
    return hf_config(model, vocab_size or model.vocab_size or DEFAULT_VOCAB_SIZE)


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
