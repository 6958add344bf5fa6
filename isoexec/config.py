"""Experiment configuration: one YAML file per experiment under ``experiments/``.

Validated at load with pydantic (``extra="forbid"``), so a typo fails at once with the key's name.
Each layer owns one section: ``model`` (architecture, Hugging Face ``Qwen3NextConfig`` fields),
``kernels`` (kernel set and its pinned constants), ``gates``, ``task``, ``sft``, ``rl``, ``engine``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """Architecture of the Qwen3-Next text model (field names as in transformers' ``Qwen3NextConfig``)."""

    vocab_size: int | None = Field(None, description="None: taken from the task's tokenizer (rounded up to 64)")
    hidden_size: int = 128
    num_hidden_layers: int = 4
    layer_types: list[Literal["linear_attention", "full_attention"]] | None = None
    full_attention_interval: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    init_std: float = 0.02


class KernelSection(_Section):
    """Kernel set and the constants it pins (all enter the contract's ``numerical_policy``)."""

    set: Literal["isoexec", "native"] = "isoexec"
    chunk_size: int = Field(64, description="CPR Gated DeltaNet chunk size C")
    row_tile: int = Field(16, description="rows per GEMM tile; every GEMM call has this many rows")
    kv_block: int = Field(64, description="attention KV block size in absolute positions")
    vocab_block: int = Field(256, description="vocabulary block of the logprob reduction")
    temperature: float = Field(1.0, description="policy temperature applied to logits before the softmax")


class GatesSection(_Section):
    dtypes: list[Literal["bfloat16", "float32"]] = ["bfloat16", "float32"]
    batch_sizes: list[int] = [1, 2, 4, 8, 16]
    micro_batch_sizes: list[int] = [1, 2, 4, 8]
    min_len: int = 8
    max_len: int = 200
    decode_steps: int = 200
    seed: int = 0


class TaskSection(_Section):
    """Procedurally generated arithmetic word problems with integer answers."""

    max_operand: int = 20
    num_train_prompts: int = 2000
    num_eval_prompts: int = 64
    seed: int = 0


class SFTSection(_Section):
    steps: int = 200
    batch_size: int = 32
    lr: float = 3e-3
    target_accuracy: tuple[float, float] = (0.10, 0.60)
    min_steps: int = Field(30, description="no early stop before this many steps")
    eval_every: int = Field(10, description="measure eval accuracy every this many steps (and at the end)")
    eval_samples: int = Field(4, description="sampled responses per eval prompt (at rl.temperature)")
    warmup_steps: int = Field(10, description="linear learning-rate warm-up")
    seed: int = Field(0, description="batch order of the SFT data and the eval sampling seed")


class RLSection(_Section):
    """GRPO with DAPO's choices: group size n, token-level loss, clip-higher, no KL term."""

    steps: int = 20
    seeds: list[int] = [0, 1]
    modes: list[Literal["native", "isoexec"]] = ["native", "isoexec"]
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    lr: float = 1e-4
    clip_low: float = 0.2
    clip_high: float = 0.28
    full_vocab_kl_positions: int = 32
    pass_k: int = 4
    advantage_std_norm: bool = Field(True, description="divide group advantages by the group's reward std")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal from the update")
    mini_batches: int = Field(1, description="optimizer updates per step (the batch split by groups); >1 makes clipping active")
    max_grad_norm: float = Field(1.0, description="global grad-norm clip (<= 0: none)")
    weight_decay: float = 0.0


class EngineSection(_Section):
    """vLLM engine settings (CPU build here)."""

    max_num_seqs: int = 64
    max_model_len: int = 512
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = False
    rollout_check_tokens: int = 2000
    num_kv_blocks_override: int | None = Field(
        None, description="vLLM num_gpu_blocks_override: a small KV block budget forces preemption"
    )
    rollout_check_full_vocab_every: int = Field(
        4, description="rollout-check: every k-th request returns full-vocabulary logprob rows"
    )


class ExperimentConfig(_Section):
    name: str
    device: Literal["cpu", "cuda"] = "cpu"
    results_dir: str | None = None
    model: ModelSection = ModelSection()
    kernels: KernelSection = KernelSection()
    gates: GatesSection = GatesSection()
    task: TaskSection = TaskSection()
    sft: SFTSection = SFTSection()
    rl: RLSection = RLSection()
    engine: EngineSection = EngineSection()

    @property
    def out_dir(self) -> Path:
        """``results/<name>/`` unless ``results_dir`` overrides it."""
        return Path(self.results_dir or f"results/{self.name}")


def load_config(path: str | Path) -> ExperimentConfig:
    """Load and validate an experiment YAML.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the YAML is malformed or a key is unknown / has a wrong type; the message names
            the file and every offending key.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment config {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at top level, got {type(raw).__name__}")
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"{path}: invalid experiment config:\n{e}") from None
