"""Hugging Face checkpoint I/O for the unified model (``Qwen3NextForCausalLM`` and the text model of
``Qwen3_5MoeForCausalLM`` / ``Qwen3_5MoeForConditionalGeneration``).

On disk, transformers (5.x) and vLLM use per-expert names
(``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``); transformers' in-memory modules
fuse them (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``, see
transformers ``conversion_mapping.py``, "qwen2_moe"). :func:`to_checkpoint_names` maps either form
to the on-disk names, which are also the unified model's parameter names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from isoexec.io import atomic_write_text

SUPPORTED_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def to_checkpoint_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split transformers' fused expert tensors into per-expert on-disk names; drop ``mtp.*`` and the
    vision tower of a Qwen3.5 multimodal checkpoint, whose text model moves from
    ``model.language_model.*`` to ``model.*``.

    Other names pass through unchanged. Tensors are not copied unless split.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name.startswith(("mtp.", "model.visual.")):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        m = _FUSED.match(name)
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


def read_config(path: str | Path):
    """The transformers config of a checkpoint folder.

    Raises:
        FileNotFoundError: no ``config.json``. ValueError: an architecture other than
            the supported ones (the message names it and what is supported).
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
        cfg = cfg.text_config  # the text model of a Qwen3.5 multimodal checkpoint
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    return cfg


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All ``*.safetensors`` tensors of a checkpoint folder, in on-disk names.

    Raises:
        FileNotFoundError: the folder holds no ``.safetensors`` file.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return to_checkpoint_names(sd)


def write_checkpoint(path: str | Path, config, state_dict: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` (on-disk names; each file written atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().clone() for k, v in to_checkpoint_names(state_dict).items()}
    tmp = path / ".model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    atomic_write_text(path / "config.json", config.to_json_string())
