"""Tiny Qwen3-Next checkpoints: build the Hugging Face config from ``ModelSection``, initialize, save.

A checkpoint directory holds what both stacks load: ``config.json`` + ``model.safetensors``
(``Qwen3NextForCausalLM``, parameters in the config dtype, bf16 by default), ``generation_config.json``
and the task tokenizer (:mod:`isoexec.rl.tokenizer`). The native trainer (transformers), vLLM's
built-in model and the unified model all read this one directory.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3NextConfig

from isoexec.config import ModelSection

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def hf_config(model: ModelSection, tokenizer: PreTrainedTokenizerFast) -> Qwen3NextConfig:
    """The transformers ``Qwen3NextConfig`` for ``model`` with the tokenizer's special ids.

    Built by :func:`isoexec.model.build.hf_config`; ``vocab_size`` None means the tokenizer's size
    rounded up to a multiple of 64.
    """
    from isoexec.model.build import hf_config as base_config  # the project's one ModelSection -> HF mapping

    vocab = model.vocab_size or -(-len(tokenizer) // 64) * 64
    if vocab < len(tokenizer):
        raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    cfg = base_config(model, vocab)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return cfg


def save_checkpoint(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out: str | Path, dtype: torch.dtype
) -> Path:
    """Save ``model`` (a ``Qwen3NextForCausalLM``, any dtype) as a ``dtype`` HF checkpoint with the tokenizer.

    The model itself is left untouched (a rounded copy is written).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(dtype).save_pretrained(str(out))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def init_checkpoint(model: ModelSection, out: str | Path, seed: int = 0) -> Path:
    """Initialize a fresh ``Qwen3NextForCausalLM`` from ``model`` (std ``init_std``) and save it.

    Deterministic in ``seed`` (``torch.manual_seed`` before construction). Saved in
    ``model.dtype`` with the task tokenizer.
    """
    from transformers import Qwen3NextForCausalLM

    from isoexec.rl.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = hf_config(model, tok)
    torch.manual_seed(seed)
    net = Qwen3NextForCausalLM(cfg).float()
    return save_checkpoint(net, tok, out, DTYPES[model.dtype])
