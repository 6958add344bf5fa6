"""Hugging Face interop in one place: the config builder, the declarative weight-name map, checkpoint
I/O and the tiny-checkpoint builder.

Supported checkpoints: ``Qwen3NextForCausalLM`` and the text model of ``Qwen3_5MoeForCausalLM`` /
``Qwen3_5MoeForConditionalGeneration``. A checkpoint folder holds ``config.json`` +
``*.safetensors`` (+ the tokenizer and ``generation_config.json`` when one is given), which
transformers, vLLM's built-in model and the unified model all load.

Names: on disk, transformers (5.x) and vLLM use per-expert names
(``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``), which are also the unified
model's parameter names; transformers' in-memory modules fuse them (``mlp.experts.gate_up_proj
[E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``; transformers ``conversion_mapping.py``,
"qwen2_moe"). :data:`HF_NAMES` maps either form, and a Qwen3.5 multimodal checkpoint's text model,
to the on-disk names (after vLLM's declarative ``WeightsMapper``,
``vllm/model_executor/models/utils.py``).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from isoexec.io import atomic_write_text

SUPPORTED_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_VOCAB_SIZE = 256
"""Vocabulary of a tiny checkpoint built without a tokenizer and without ``model.vocab_size``."""


@dataclass(frozen=True)
class WeightsMapper:
    """Declarative name map from a checkpoint's or an in-memory module's names to the on-disk names.

    Attributes:
        skip_prefixes: tensors dropped (multi-token-prediction heads, a vision tower).
        prefix_map: ``old prefix -> new prefix``, first match wins.
        split_fused_experts: split ``*.mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``
            into per-expert ``*.mlp.experts.{e}.{gate,up,down}_proj.weight`` (views, no copy).
    """

    skip_prefixes: tuple[str, ...] = ()
    prefix_map: dict[str, str] = field(default_factory=dict)
    split_fused_experts: bool = True

    _FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")

    def rename(self, name: str) -> str | None:
        """The name after :attr:`prefix_map`, or None for a skipped tensor (fused experts not split)."""
        if name.startswith(self.skip_prefixes):
            return None
        for old, new in self.prefix_map.items():
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def apply(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The mapped state dict (tensors not copied unless split)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            name = self.rename(name)
            if name is None:
                continue
            m = self._FUSED.match(name) if self.split_fused_experts else None
            if not m:
                out[name] = t
                continue
            prefix, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.{e}.up_proj.weight"] = up
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        return out


HF_NAMES = WeightsMapper(skip_prefixes=("mtp.", "model.visual."), prefix_map={"model.language_model.": "model."})
"""Every supported checkpoint and transformers' in-memory Qwen3-Next / Qwen3.5 modules -> on-disk names."""


# ------------------------------------------------------------------------------------------- config
def hf_config(section, vocab_size: int | None = None, tokenizer=None):
    """A transformers ``Qwen3NextConfig`` from an ``isoexec.config.ModelSection``.

    Args:
        section: the experiment's model section.
        vocab_size: overrides ``section.vocab_size``; with neither, the tokenizer's size rounded up to
            a multiple of 64, else :data:`DEFAULT_VOCAB_SIZE`.
        tokenizer: sets the bos / eos / pad ids (optional).

    Raises:
        ValueError: a vocabulary smaller than the tokenizer or below 1.
    """
    from transformers import Qwen3NextConfig

    vocab = vocab_size or section.vocab_size
    if not vocab:
        vocab = -(-len(tokenizer) // 64) * 64 if tokenizer is not None else DEFAULT_VOCAB_SIZE
    if vocab < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab}")
    if tokenizer is not None and vocab < len(tokenizer):
        raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    layer_types = section.layer_types or [
        "full_attention" if (i + 1) % section.full_attention_interval == 0 else "linear_attention"
        for i in range(section.num_hidden_layers)
    ]
    cfg = Qwen3NextConfig(
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
    if tokenizer is not None:
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = (
            tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return cfg


def section_mismatches(section, path: str | Path) -> list[str]:
    """The settings of an experiment's model section that the checkpoint at ``path`` has otherwise, as
    ``"name: experiment X, checkpoint Y"``; empty when they agree. Compared: every section field that the
    transformers config carries (``vocab_size`` only where the section sets it; ``init_std`` is not stored).

    Raises:
        FileNotFoundError, ValueError: from :func:`read_config`.
    """
    ckpt = read_config(path)
    want = hf_config(section, vocab_size=section.vocab_size or ckpt.vocab_size)
    missing = object()
    out = []
    for name in type(section).model_fields:
        a, b = getattr(want, name, missing), getattr(ckpt, name, missing)
        if a is not missing and b is not missing and a != b:
            out.append(f"{name}: experiment {a}, checkpoint {b}")
    return out


# ---------------------------------------------------------------------------------------- read/write
def read_config(path: str | Path):
    """The transformers config of a checkpoint folder (the text config of a Qwen3.5 multimodal one).

    Raises:
        FileNotFoundError: no ``config.json``. ValueError: an architecture other than the supported
            ones (the message names it and what is supported).
    """
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint folder)")
    archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES or a.startswith("IsoExec") for a in archs):
        raise ValueError(f"{path}: architectures {archs} not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
    cfg = AutoConfig.from_pretrained(path)
    if hasattr(cfg, "text_config") and "Qwen3_5MoeForConditionalGeneration" in archs:
        cfg = cfg.text_config
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    return cfg


def read_weights(path: str | Path, raw: bool = False) -> dict[str, torch.Tensor]:
    """All ``*.safetensors`` tensors of a checkpoint folder, in on-disk names (:data:`HF_NAMES`), or with
    ``raw`` the names as stored (what vLLM's loader reads).

    Raises:
        FileNotFoundError: the folder holds no ``.safetensors`` file.
    """
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd if raw else HF_NAMES.apply(sd)


TensorSpec = tuple[torch.dtype, tuple[int, ...]]
"""``(dtype, shape)`` of one tensor."""

_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def checkpoint_specs(path: str | Path) -> dict[str, TensorSpec]:
    """``name -> (dtype, shape)`` of a checkpoint folder's tensors, in on-disk names (:data:`HF_NAMES`),
    read from the ``*.safetensors`` headers only.

    Raises:
        FileNotFoundError: the folder holds no ``.safetensors`` file.
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights")
    meta = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                meta[k] = torch.empty(sl.get_shape(), dtype=_SAFETENSORS_DTYPES[sl.get_dtype()], device="meta")
    return {k: (v.dtype, tuple(v.shape)) for k, v in HF_NAMES.apply(meta).items()}


class CheckpointError(ValueError):
    """A checkpoint whose tensors contradict its config (the message names the tensors)."""


def config_dtype(cfg) -> torch.dtype:
    """The parameter dtype a checkpoint's config declares (``dtype`` / ``torch_dtype``), bf16 when it
    declares none (what every loader here then uses)."""
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.bfloat16
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def check_checkpoint(path: str | Path) -> None:
    """Refuse a checkpoint whose tensors contradict its config, before any side loads it.

    The tensor set a config implies is the unified model's parameter set for that config (built on the
    meta device, no weights), each tied tensor once. Every loader of the project calls this first (the
    unified model and so the isoexec engine, the Megatron and transformers trainers, the native
    engine), so that no side loads such a checkpoint its own way: e.g. ``tie_word_embeddings: true``
    with a stored ``lm_head.weight`` that differs from the embedding made a strict ``load_state_dict``
    copy both names into the one tied tensor (the head wins, the embedding is lost) while vLLM's
    built-in model kept the embedding and its own head.

    Args:
        path: a checkpoint folder (``config.json`` + ``*.safetensors``).

    Raises:
        CheckpointError: naming, with counts, tensors the config implies that the checkpoint lacks,
            tensors it holds that the config does not imply, tensors of another shape, floating tensors
            in another dtype than the config's ``dtype``, and, for a tied config, a stored
            ``lm_head.weight`` that differs from ``model.embed_tokens.weight`` (one equal to it is
            accepted: some savers store both).
        FileNotFoundError / ValueError: from :func:`read_config` and :func:`checkpoint_specs`.
    """
    from isoexec.model.unified import UnifiedModel

    cfg = read_config(path)
    dtype = config_dtype(cfg)
    on_disk = checkpoint_specs(path)
    with torch.device("meta"):
        skeleton = UnifiedModel.from_config(cfg, None, dtype)
    implied = {k: tuple(v.shape) for k, v in skeleton.named_parameters()}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    problems = []
    if tied and "lm_head.weight" in on_disk:
        head, embed = _read_tensors(path, ["lm_head.weight", "model.embed_tokens.weight"])
        if head.shape != embed.shape or not torch.equal(head, embed):
            diff = (head.float() - embed.float()).abs().max().item() if head.shape == embed.shape else "shape"
            problems.append(f"tie_word_embeddings=true but the stored lm_head.weight differs from "
                            f"model.embed_tokens.weight (max |diff| {diff}): loaders would disagree on which "
                            "one the tied tensor holds")
        on_disk = {k: v for k, v in on_disk.items() if k != "lm_head.weight"}
    missing = sorted(set(implied) - set(on_disk))
    extra = sorted(set(on_disk) - set(implied))
    shape = sorted(f"{k} {list(on_disk[k][1])} != {list(implied[k])}" for k in set(on_disk) & set(implied)
                   if on_disk[k][1] != implied[k])
    wrong_dtype = sorted(f"{k} {d}" for k, (d, _) in on_disk.items() if d.is_floating_point and d != dtype)
    problems += [f"{len(names)} {what}: {names[:5]}" for what, names in
                 (("missing", missing), ("not implied by the config", extra),
                  ("with another shape than the config implies", shape),
                  (f"in another dtype than the config's {dtype}", wrong_dtype)) if names]
    if problems:
        raise CheckpointError(f"{path}: checkpoint refused, its tensors contradict its config "
                              f"({len(implied)} tensors implied): {'; '.join(problems)}")


def _read_tensors(path: str | Path, names: list[str]) -> list[torch.Tensor]:
    """The named tensors (names after :data:`HF_NAMES`, not fused experts) from a checkpoint folder."""
    from safetensors import safe_open

    found = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if HF_NAMES.rename(k) in names:
                    found[HF_NAMES.rename(k)] = h.get_tensor(k)
    return [found[k] for k in names]


def write_checkpoint(path: str | Path, config, state_dict: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` (on-disk names; each file written atomically)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().clone() for k, v in HF_NAMES.apply(state_dict).items()}
    tmp = path / ".model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    atomic_write_text(path / "config.json", config.to_json_string())


def save_hf_model(model: torch.nn.Module, out: str | Path, dtype: torch.dtype, tokenizer=None) -> Path:
    """Save a transformers model as a ``dtype`` checkpoint (a rounded copy; ``model`` is untouched),
    with the tokenizer and its ``generation_config.json`` when ``tokenizer`` is given."""
    from transformers import GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(dtype).save_pretrained(str(out))
    if tokenizer is not None:
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    return out


def build_checkpoint(path: str | Path, section, *, vocab_size: int | None = None, seed: int = 0,
                     tokenizer=None) -> Path:
    """A randomly initialised ``Qwen3NextForCausalLM`` checkpoint (transformers' own init under
    ``torch.manual_seed(seed)``, in fp32, saved in ``section.dtype``), idempotent: an existing
    ``path/config.json`` + ``model.safetensors`` is kept.

    Args:
        path: folder to write. section: ``isoexec.config.ModelSection``.
        vocab_size, tokenizer: as :func:`hf_config`; the tokenizer is saved beside the weights.
    """
    from transformers import Qwen3NextForCausalLM

    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    cfg = hf_config(section, vocab_size, tokenizer)
    torch.manual_seed(seed)
    net = Qwen3NextForCausalLM(cfg).float()
    tmp = path.with_name(path.name + ".tmp")
    save_hf_model(net, tmp, DTYPES[section.dtype], tokenizer)
    if path.exists():
        for f in tmp.iterdir():
            f.replace(path / f.name)
        tmp.rmdir()
    else:
        tmp.replace(path)
    return path
