"""Experiment configuration: one YAML file per experiment under ``experiments/``.

Validated at load with pydantic (``extra="forbid"``), so a typo fails at once with the key's name.
Each layer owns one section: ``model`` (architecture, Hugging Face ``Qwen3NextConfig`` fields),
``kernels`` (the constants pinned by the kernel sets), ``gates``, ``task``, ``sft``, ``rl``,
``trainer`` and ``engine`` (which backend runs each side; the mode picks the kernel set); ``arms``
adds arms to the paired runs beyond ``rl.modes`` (a mode's stack with SkyRL's off-policy correction).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _scalars_as_written(cls, data):
        """Refuse what pydantic's lax mode would convert: a boolean for a number (``true`` -> 1), a string for an
        integer (``'16'``) and anything but a boolean for a boolean (``'yes'``). Float fields keep accepting strings:
        PyYAML reads ``1e-6`` (no dot) as one."""
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            field = cls.model_fields.get(key)
            if field is None or value is None:
                continue
            ann = field.annotation
            kinds = {a for a in (get_args(ann) if get_origin(ann) in (Union, UnionType) else (ann,)) if a in (bool, int, float)}
            if not kinds:
                continue
            if kinds == {bool} and not isinstance(value, bool):
                raise ValueError(f"{key}={value!r}: expected true or false")
            if bool not in kinds and isinstance(value, bool):
                raise ValueError(f"{key}={value!r}: a boolean where a number is expected")
            if kinds == {int} and isinstance(value, str):
                raise ValueError(f"{key}={value!r}: a string where an integer is expected (write it unquoted)")
        return data


class ModelSection(_Section):
    """Architecture of the Qwen3-Next text model (field names as in transformers' ``Qwen3NextConfig``)."""

    vocab_size: int | None = Field(None, description="None: taken from the task's tokenizer (rounded up to 64)")
    hidden_size: PositiveInt = 128
    num_hidden_layers: PositiveInt = 4
    layer_types: list[Literal["linear_attention", "full_attention"]] | None = None
    full_attention_interval: PositiveInt = 4
    num_attention_heads: PositiveInt = 2
    num_key_value_heads: PositiveInt = 1
    head_dim: PositiveInt = 64
    partial_rotary_factor: float = 0.25
    rope_theta: PositiveFloat = 10000.0
    rms_norm_eps: PositiveFloat = 1e-6
    max_position_embeddings: PositiveInt = 4096
    linear_num_key_heads: PositiveInt = 2
    linear_num_value_heads: PositiveInt = 4
    linear_key_head_dim: PositiveInt = 128
    linear_value_head_dim: PositiveInt = 128
    linear_conv_kernel_dim: PositiveInt = 4
    num_experts: PositiveInt = 4
    num_experts_per_tok: PositiveInt = 2
    moe_intermediate_size: PositiveInt = 64
    shared_expert_intermediate_size: PositiveInt = 64
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    init_std: PositiveFloat = 0.02


class GemmRowBucket(_Section):
    """Column GEMMs of at most ``max_rows`` rows run this program with these tiles (see
    ``TritonSection.gemm_bfloat16_by_rows``)."""

    max_rows: PositiveInt
    program: Literal["tiled", "persistent_tma"]
    tiles: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt, PositiveInt] = Field(
        description="BM, BN, BK, num_warps, num_stages")


class LeafKBucket(_Section):
    """Leaf GEMM launches with leaves at most ``max_leaf_k`` features wide (and, with ``max_rows``, at most that many
    rows) run this loop with these tiles and loads, at most this many leaves per program, and add the top of the tree
    where ``top`` says (see ``TritonSection.pik_bfloat16_by_leaf_k``)."""

    max_leaf_k: PositiveInt
    max_rows: PositiveInt | None = Field(
        None, description="None: launches of more than pik_split_rows rows (the in-register tree); a number: dense "
        "launches of at most that many rows, whatever pik_split_rows says (decode; grouped expert launches keep "
        "pik_split_rows' choice)")
    loop: Literal["flat", "paired", "flat_paired", "gluon_pipelined"]
    tiles: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt, PositiveInt] = Field(
        description="BM, BN, BK, num_warps, num_stages; BK must be pik_gemm_bfloat16's")
    program_leaves: PositiveInt = Field(description="a power of two; 1 is the split launch (one leaf per program)")
    top: Literal["combine", "in_kernel"] = Field(
        "combine", description="a launch that leaves two or four subtree sums per output tile (leaves = 2 or 4 x "
        "program_leaves; other launches ignore it) adds them in tree_combine (a second kernel reading the fp32 planes) "
        "or in the leaf kernel itself (a right node's program spins until its left sibling's fp32 partial is "
        "released, relying on CUDA dispatching a grid's blocks in increasing order, as CUTLASS's serial split-K does); "
        "the same fp32 additions either way")
    load: Literal["pointer", "tma"] = Field(
        "pointer", description="operand tiles by masked pointer loads, or by TMA from host tensor descriptors (where "
        "the leaf width is a multiple of BK and the operands' rows and bases are 16-byte aligned; else pointer loads): "
        "the same values reach the same dots, so the same bits")


class TritonSection(_Section):
    """Launch constants of the Triton (sm90) kernel set. Every value is bit-relevant or pins the launch,
    enters the contract's composition, and comes only from here (``isoexec bench --what tune`` writes a
    YAML fragment of this section; nothing is read from environment variables)."""

    gemm_bfloat16: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt, PositiveInt] = Field(
        (128, 128, 64, 8, 3), description="bf16 GEMM tiles: BM, BN, BK, num_warps, num_stages")
    gemm_float32: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt, PositiveInt] = Field(
        (64, 64, 32, 4, 3), description="fp32 GEMM tiles (true fp32 dot, no tf32): BM, BN, BK, num_warps, num_stages")
    gemm_group_m: PositiveInt = Field(8, description="tile-order swizzle (which program computes which tile)")
    gemm_kernel: Literal["tiled", "persistent_tma"] = Field(
        "tiled", description="column GEMM program: one program per output tile with pointer loads, or a persistent "
        "grid over tiles with TMA loads (same tiles, same ascending K order)")
    gemm_bfloat16_by_rows: tuple[GemmRowBucket, ...] = Field(
        (), description="bf16/fp16 column GEMMs of few rows (decode): the first bucket, by ascending max_rows, that "
        "holds the GEMM's rows picks its program and tiles; more rows run gemm_kernel with gemm_bfloat16. Measured on "
        "the H200: no program or tile choice moves a bit (each output accumulates the same 16-wide tensor-core K "
        "steps in ascending order; results/h200/gemm_buckets/variants_gemm.csv checks every candidate, BK = 32 "
        "included, against the pinned tiles), and the gates check the pinned buckets on the model")
    pik_gemm_bfloat16: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt, PositiveInt] = Field(
        (128, 64, 64, 8, 3), description="bf16 leaf GEMM (row-parallel regions, pik) tiles: BM, BN, BK, num_warps, num_stages")
    pik_gemm_float32: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt, PositiveInt] = Field(
        (64, 64, 32, 4, 3), description="fp32 leaf GEMM tiles (true fp32 dot): BM, BN, BK, num_warps, num_stages")
    pik_split_rows: NonNegativeInt = Field(
        512, description="leaf GEMM launch: with at most this many rows, each leaf runs in its own program and a "
        "second kernel adds the leaf partials in the tree order; with more, one program reduces its leaves in "
        "registers. Same additions in the same order either way (not bit-relevant, so not in the contract)")
    pik_program_leaves: PositiveInt = Field(
        8, description="leaf GEMM with more rows than pik_split_rows: at most this many leaves per program (a "
        "power of two); fewer than G leaves per program keep fewer fp32 tile accumulators live (the pending tree "
        "nodes) and add the levels above in a second kernel through an fp32 buffer. Same additions in the same "
        "order (not bit-relevant, so not in the contract)")
    pik_loop: Literal["flat", "paired", "flat_paired", "gluon_pipelined"] = Field(
        "flat", description="leaf GEMM programs of several leaves: one K loop over all the leaves, two leaves at a "
        "time (two tensor-core chains in flight, the tree climbed after each pair), one K loop over the pairs' "
        "steps with two chains (flat_paired; isoexec/kernels/gemm/triton.py), or the Gluon program that climbs a "
        "leaf while the next leaf's first tensor-core step runs (gluon_pipelined: dense bf16/fp16 launches on "
        "Hopper that TMA can read, with BM >= 64, 4 or 8 warps, 2 or more stages; the paired loop for the others, "
        "with TMA loads for bf16/fp16; isoexec/kernels/gemm/gluon_leaf.py). "
        "Same additions in the same order (not bit-relevant, so not in the contract)")
    pik_bfloat16_by_leaf_k: tuple[LeafKBucket, ...] = Field(
        (), description="bf16/fp16 leaf GEMM launches by leaf width (K / leaves; the same at every TP) and rows: the "
        "first bucket with max_rows (ascending by max_rows, then max_leaf_k) that holds the launch's rows and leaf "
        "width, else, for more rows than pik_split_rows, the first bucket without max_rows (ascending max_leaf_k) that "
        "holds its leaf width, picks its loop, tiles, loads, leaves per program and top; other launches run pik_loop, "
        "pik_gemm_bfloat16 and pik_program_leaves (at most pik_split_rows rows: one leaf per program). BK is "
        "pik_gemm_bfloat16's: the K steps and the tree fix the bits, BM, BN, warps, stages, loop, loads, leaves "
        "per program and top move none (results/h200/leaf_gemm/ checks every candidate against the pinned tiles on the GPU)")
    attn_block_m: PositiveInt = Field(64, description="attention query rows per tile")
    attn_num_warps: PositiveInt = Field(8, description="attention warps per tile (fixes the row reductions' layout)")
    attn_num_stages: PositiveInt = Field(2, description="attention K/V software-pipelining depth")
    conv_block_t: PositiveInt = Field(16, description="causal conv1d positions per program")
    conv_block_c: PositiveInt = Field(128, description="causal conv1d channels per program")
    gdn_scan_bv: PositiveInt = Field(8, description="CPR scan: Dv columns per program")
    gdn_scan_warps: PositiveInt = 1
    gdn_chain_bv: PositiveInt = Field(32, description="CPR state chain: Dv columns per program")
    gdn_chain_warps: PositiveInt = 4
    gdn_prep_warps: PositiveInt = 4
    gdn_prep_split: bool = Field(False, description="CPR chunk prep: W (with KD and the decay total) and U in two "
                                 "launches instead of one, the same operations per output (the one-program prep "
                                 "spills on sm90: results/h200/counters_15762cc_h100)")
    gdn_dot_precision: Literal["tf32", "ieee"] = Field("tf32", description="state-pass dots (fp32 storage)")
    gdn_bwd_bv: PositiveInt = Field(32, description="CPR backward (trainer_fwd gradient): Dv columns per block. "
                                    "The backward is not bitwise, so not in the contract")
    gdn_bwd_warps: PositiveInt = Field(4, description="CPR backward: warps per program of its chain, dv and dq/dk "
                                       "kernels (not in the contract)")
    gdn_bwd_prep_warps: PositiveInt = Field(4, description="CPR backward: warps per program of its prep kernel "
                                            "(not in the contract)")

    @model_validator(mode="after")
    def _powers_of_two(self) -> "TritonSection":
        bad = [f"kernels.triton.{k}={v}" for k, v in self.model_dump().items()
               if k.endswith(("_bv", "_block_m", "_block_t", "_block_c", "_program_leaves", "_warps")) and v & (v - 1)]
        tiles = [(name, getattr(self, name)) for name in ("gemm_bfloat16", "gemm_float32", "pik_gemm_bfloat16",
                                                          "pik_gemm_float32")]
        tiles += [(f"gemm_bfloat16_by_rows[{i}]", b.tiles) for i, b in enumerate(self.gemm_bfloat16_by_rows)]
        tiles += [(f"pik_bfloat16_by_leaf_k[{i}]", b.tiles) for i, b in enumerate(self.pik_bfloat16_by_leaf_k)]
        for name, (bm, bn, bk, nw, _) in tiles:
            bad += [f"kernels.triton.{name} tile {t}" for t in (bm, bn, bk) if t < 16 or t & (t - 1)]
            bad += [f"kernels.triton.{name} num_warps {nw}"] * bool(nw & (nw - 1))
        for i, b in enumerate(self.pik_bfloat16_by_leaf_k):
            bad += [f"kernels.triton.pik_bfloat16_by_leaf_k[{i}].program_leaves={b.program_leaves}"] * bool(
                b.program_leaves & (b.program_leaves - 1))
        if bad:
            raise ValueError(f"must be powers of two (GEMM tiles >= 16; Triton's num_warps): {', '.join(bad)}")
        if self.gdn_bwd_warps >= 8 and self.gdn_bwd_bv < 32:
            raise ValueError(f"kernels.triton.gdn_bwd_warps={self.gdn_bwd_warps} with gdn_bwd_bv={self.gdn_bwd_bv}: "
                             "the CPR backward's _bwd_chain faults (illegal memory access) with 8 warps on 16-column "
                             "blocks on an H200 with Triton 3.6.0 (results/h200/cpr_backward/); use gdn_bwd_bv >= 32 "
                             "or gdn_bwd_warps = 4")
        rows = [b.max_rows for b in self.gemm_bfloat16_by_rows]
        if rows != sorted(set(rows)):
            raise ValueError(f"kernels.triton.gemm_bfloat16_by_rows: max_rows {rows} must be strictly ascending")
        widths = [b.max_leaf_k for b in self.pik_bfloat16_by_leaf_k if b.max_rows is None]
        if widths != sorted(set(widths)):
            raise ValueError(f"kernels.triton.pik_bfloat16_by_leaf_k: max_leaf_k {widths} of the buckets without max_rows "
                             "must be strictly ascending")
        by_rows = [(b.max_rows, b.max_leaf_k) for b in self.pik_bfloat16_by_leaf_k if b.max_rows is not None]
        if by_rows != sorted(set(by_rows)):
            raise ValueError(f"kernels.triton.pik_bfloat16_by_leaf_k: (max_rows, max_leaf_k) {by_rows} of the buckets "
                             "with max_rows must be strictly ascending")
        gluon = [(f"pik_bfloat16_by_leaf_k[{i}]", b.tiles, b.load) for i, b in enumerate(self.pik_bfloat16_by_leaf_k)
                 if b.loop == "gluon_pipelined"]
        gluon += [("pik_gemm_bfloat16", self.pik_gemm_bfloat16, "tma")] * (self.pik_loop == "gluon_pipelined")
        for name, (bm, _, _, nw, ns), load in gluon:  # the wgmma and TMA ring of isoexec/kernels/gemm/gluon_leaf.py
            if nw not in (4, 8) or bm < 64 or ns < 2 or load != "tma":
                raise ValueError(f"kernels.triton.{name}: loop gluon_pipelined with BM={bm}, num_warps={nw}, "
                                 f"num_stages={ns}, load={load}; allowed: BM >= 64, num_warps 4 or 8, num_stages >= 2 "
                                 "and load tma (a warp group's wgmma covers 64 rows; the program reads by TMA)")
        bk = [(i, b.tiles[2]) for i, b in enumerate(self.pik_bfloat16_by_leaf_k) if b.tiles[2] != self.pik_gemm_bfloat16[2]]
        if bk:
            raise ValueError(f"kernels.triton.pik_bfloat16_by_leaf_k[{bk[0][0]}].tiles BK={bk[0][1]} differs from "
                             f"pik_gemm_bfloat16's {self.pik_gemm_bfloat16[2]}; allowed: the same BK (BK sets the leaf's "
                             "K steps, i.e. the bits)")
        return self


class KernelSection(_Section):
    """Constants pinned by the kernel sets (all enter the contract's ``numerical_policy``).

    The kernel set itself follows the run's mode (``native`` | ``isoexec``) and the config's ``device``;
    the constants below are the only source of bit-relevant choices.
    """

    chunk_size: PositiveInt = Field(64, description="CPR Gated DeltaNet chunk size C")
    row_tile: PositiveInt = Field(16, description="CPU: rows per cache tile of the C GEMM (gemm/fma_gemm.c: one "
                                  "ascending FMA chain over K per output, so the tiles move no bit)")
    col_tile: PositiveInt = Field(16, description="CPU: output features per cache tile of the C GEMM (moves no bit); "
                                  "the unit of a column-parallel shard (pik_column_linear)")
    leaves: PositiveInt = Field(8, description="pik leaves over K of the row-parallel GEMMs (out_proj, down_proj); TP must divide it")
    kv_block: PositiveInt = Field(64, description="attention KV block size in absolute positions")
    vocab_block: PositiveInt = Field(256, description="vocabulary block of the logprob reduction")
    temperature: PositiveFloat = Field(1.0, description="policy temperature applied to logits before the softmax")
    triton: TritonSection = TritonSection()

    @model_validator(mode="after")
    def _checks(self) -> "KernelSection":
        if self.vocab_block & (self.vocab_block - 1):
            raise ValueError(f"kernels.vocab_block={self.vocab_block} must be a power of two")
        if self.leaves & (self.leaves - 1):
            raise ValueError(f"kernels.leaves={self.leaves} must be a power of two (fixed binary tree)")
        return self

    def check_device(self, device: str) -> None:
        """Refuse constants the kernels of ``device`` cannot run (the Triton set needs power-of-two
        ``chunk_size`` and ``kv_block`` of at least 16).

        Raises:
            ValueError: naming each offending key and the allowed values.
        """
        if device != "cuda":
            return
        bad = [f"kernels.{k}={v} (the Triton kernels need a power of two >= 16)"
               for k, v in (("chunk_size", self.chunk_size), ("kv_block", self.kv_block)) if v < 16 or v & (v - 1)]
        if bad:
            raise ValueError("; ".join(bad))


class GatesSection(_Section):
    dtypes: list[Literal["bfloat16", "float32"]] = ["bfloat16", "float32"]
    batch_sizes: list[int] = [1, 2, 4, 8, 16]
    micro_batch_sizes: list[int] = [1, 2, 4, 8]
    min_len: PositiveInt = 8
    max_len: PositiveInt = 200
    decode_steps: PositiveInt = 200
    seed: int = 0


class TaskSection(_Section):
    """The RL data: the embedded arithmetic task (:mod:`isoexec.rl.task`), or a parquet file in
    DAPO-Math-17k's schema (``data_path``); both reach the loop through :mod:`isoexec.rl.data`."""

    max_operand: PositiveInt = Field(5, description="operands are drawn from [1, max_operand]")
    max_total: PositiveInt = Field(9, description="every running total stays in [0, max_total]")
    num_operands: int = Field(5, ge=2, le=8, description="operands per problem (num_operands - 1 scratchpad steps)")
    num_train_prompts: PositiveInt = 2000
    num_eval_prompts: PositiveInt = 64
    seed: int = 0
    data_path: str | None = Field(
        None, description="RL train prompts from this parquet (DAPO-Math-17k schema) instead of the embedded task")


class SFTSection(_Section):
    steps: PositiveInt = Field(200, description="at most this many SFT steps (at least one: the metrics are measured "
                               "on the trained checkpoint)")
    batch_size: PositiveInt = 32
    lr: PositiveFloat = 3e-3
    target_accuracy: tuple[float, float] = Field(
        (0.10, 0.60), description="band of the expected eval accuracy (isoexec.rl.sft) at which SFT stops")
    min_steps: NonNegativeInt = Field(30, description="no early stop before this many steps")
    eval_every: PositiveInt = Field(10, description="measure the expected eval accuracy every this many steps (and at the end)")
    eval_samples: PositiveInt = Field(4, description="sampled responses per eval prompt for the final sampled accuracy")
    warmup_steps: NonNegativeInt = Field(10, description="linear learning-rate warm-up")
    seed: int = Field(0, description="batch order of the SFT data and the eval sampling seed")


class RLSection(_Section):
    """GRPO with DAPO's choices: group size n, token-level loss, clip-higher, no KL term, dynamic sampling.

    The advantage estimator, the policy loss and its reduction are SkyRL's (chosen by name from its
    registries, ``skyrl/backends/skyrl_train/utils/ppo_utils.py``); ``driver`` says who runs the step.
    """

    driver: Literal["skyrl", "loop"] = Field(
        "skyrl", description="skyrl: SkyRL's RayPPOTrainer (Ray started locally; isoexec.rl.skyrl); loop: the "
        "in-process loop (isoexec.rl.loop; hf / unified trainers, no dynamic sampling)")
    interleave: Literal["step", "run"] | None = Field(
        None, description="how `isoexec rl paired` alternates a seed's arms: step: step k of every arm, then step "
        "k+1 (each arm on engines and trainer workers of its own, alive at once; SkyRL driver only), so that a slow "
        "stretch of the machine lands on every arm alike; run: each arm's whole run, one after the other; unset: "
        "step under the SkyRL driver on cpu, run under the loop and on cuda (step there is unmeasured: every "
        "arm's engines and trainer on the node's GPUs at once)")
    steps: PositiveInt = Field(20, description="RL steps per run (at least one: every mode x seed is a run)")
    seeds: list[NonNegativeInt] = Field([0, 1], min_length=1)
    modes: list[Literal["native", "isoexec"]] = Field(["native", "isoexec"], min_length=1)
    prompts_per_step: PositiveInt = 8
    group_size: PositiveInt = 8
    max_new_tokens: PositiveInt = 16
    temperature: PositiveFloat = 1.0
    lr: PositiveFloat = 1e-4
    advantage_estimator: Literal["grpo", "rloo", "reinforce++", "maxrl"] = Field(
        "grpo", description="SkyRL's AdvantageEstimatorRegistry name (critic-free estimators only)")
    policy_loss: Literal["regular", "dual_clip", "gspo", "cispo", "sapo", "clip_cov", "kl_cov"] = Field(
        "regular", description="SkyRL's PolicyLossRegistry name; 'regular' is PPO's clipped surrogate, with "
        "clip_low / clip_high DAPO's clip-higher")
    loss_reduction: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="SkyRL's loss reduction; token_mean: over all tokens of the mini-batch (DAPO)")
    clip_low: NonNegativeFloat = 0.2
    clip_high: NonNegativeFloat = 0.28
    full_vocab_kl_positions: PositiveInt = 32
    pass_k: PositiveInt = 4
    advantage_std_norm: bool = Field(True, description="divide group advantages by the group's reward std")
    dynamic_sampling: bool = Field(False, description="DAPO's dynamic sampling (SkyRL 'filter'): groups whose "
                                   "rewards are all equal are dropped and more prompts sampled until the step "
                                   "has prompts_per_step informative groups (SkyRL driver only)")
    mini_batches: PositiveInt = Field(1, description="optimizer updates per step (the batch split by groups); >1 makes clipping active")
    max_grad_norm: float = Field(1.0, description="global grad-norm clip (<= 0: none)")
    warmup_updates: NonNegativeInt = Field(
        0, description="linear learning-rate warm-up over the first optimizer updates (Adam's moments settle first)")
    weight_decay: NonNegativeFloat = 0.0


Mode = Literal["native", "isoexec"]
TrainerBackend = Literal["hf", "unified", "megatron"]


class TrainerSection(_Section):
    """Which trainer implementation runs each mode (:func:`isoexec.trainer.factory.load_trainer`).

    ``backend``: one backend for both modes, or a mapping ``mode -> backend``. ``hf`` is transformers'
    ``Qwen3NextForCausalLM`` with its own kernels (native only); ``unified`` is the unified model with
    the mode's kernel set; ``megatron`` is megatron-core (:mod:`isoexec.trainer.megatron`) with the
    mode's kernel set on ``cp`` x ``max(tp, ep)`` ranks (one process each; gloo on CPU, NCCL on CUDA).
    """

    backend: TrainerBackend | dict[Mode, TrainerBackend] = Field(
        default_factory=lambda: {"native": "hf", "isoexec": "unified"})
    tp: PositiveInt = Field(1, description="megatron: tensor-parallel degree")
    ep: PositiveInt = Field(1, description="megatron: expert-parallel degree (routed experts over ranks)")
    sp: bool | None = Field(None, description="megatron: sequence parallelism; None: on exactly when tp > 1 "
                            "(Megatron's MoE needs it at tp > 1)")
    cp: PositiveInt = Field(1, description="megatron: context-parallel degree (each sequence split over cp ranks "
                            "in contiguous slices; isoexec set only, proven at 1, 2, 4 with tp 1 or 2)")

    def backend_for(self, mode: str) -> str:
        """The backend of ``mode``.

        Raises:
            ValueError: ``mode`` not in the mapping (naming the modes it covers).
        """
        if isinstance(self.backend, str):
            return self.backend
        if mode not in self.backend:
            raise ValueError(f"trainer.backend has no entry for mode {mode!r}; it covers {sorted(self.backend)}")
        return self.backend[mode]

    def layout(self):
        """The Megatron layout of ``tp``, ``ep``, ``sp``, ``cp`` (:class:`isoexec.trainer.megatron.config.Layout`)."""
        from isoexec.trainer.megatron.config import Layout

        return Layout(tp=self.tp, ep=self.ep, sp=self.tp > 1 if self.sp is None else self.sp, cp=self.cp)

    def world_size(self, mode: str) -> int:
        """Trainer processes of ``mode``: the layout's world size for ``megatron``, else 1."""
        return self.layout().world_size if self.backend_for(mode) == "megatron" else 1

    def megatron_problems(self, mode: str, device: str, model: "ModelSection") -> list[str]:
        """Why ``megatron`` cannot run ``mode`` with this layout (empty: it can): the device, the layout
        itself, sizes of ``model`` it does not divide, context parallelism in ``native`` mode, and, for
        ``isoexec``, degrees outside the kernel set's proven topology (the contract's claim and the degrees
        proven together with ``cp > 1``, :func:`isoexec.kernels.topology.topology_problems`)."""
        from isoexec.kernels.topology import topology_problems
        from isoexec.trainer.megatron.config import layout_problems, splittable_degrees

        if device not in ("cpu", "cuda"):
            return [f"trainer.backend='megatron' runs on cpu (gloo) or cuda (NCCL), not device={device!r}"]
        layout = self.layout()
        try:
            layout.check()
        except ValueError as e:
            return [f"trainer tp={self.tp} ep={self.ep} sp={self.sp} cp={self.cp}: {e}"]
        bad = [f"trainer layout {layout.name}: model.{p}" for p in layout_problems(model, layout)]
        if bad:
            bad.append(f"trainer layout {layout.name}: this model splits at tp in {splittable_degrees(model, 'tp')} "
                       f"(ep 1) and at ep in {splittable_degrees(model, 'ep')} (tp 1), of 1..16")
        if mode == "native" and self.cp > 1:
            bad.append(f"trainer.cp={self.cp}: megatron-core's local attention and GDN (the native set) have no "
                       "context parallelism without Transformer Engine; run mode native at cp=1 (e.g. "
                       "trainer.backend: {native: hf, isoexec: megatron}) or drop native from rl.modes")
        if mode == "isoexec":
            what = {"sp": "sequence-parallel degree (tp when sp is on) ", "dp": "data-parallel replicas "}
            bad += [f"trainer layout {layout.name}: {what.get(p.split('=')[0], '')}{p}"
                    for p in topology_problems(mode, device, layout.degrees())]
        return bad


class EngineSection(_Section):
    """Rollout engine settings: the backend (``vllm``: vLLM, CPU build here; ``local``: plain PyTorch
    sampling from a trainer policy, no KV cache) and vLLM's scheduler settings."""

    backend: Literal["vllm", "local"] = "vllm"
    max_num_seqs: PositiveInt = 64
    max_model_len: PositiveInt = 512
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: PositiveInt = 256
    enable_prefix_caching: bool = False
    rollout_check_tokens: PositiveInt = 2000
    num_kv_blocks_override: int | None = Field(
        None, description="vLLM num_gpu_blocks_override: a small KV block budget forces preemption"
    )
    rollout_check_full_vocab_every: PositiveInt = Field(
        4, description="rollout-check: every k-th request returns full-vocabulary logprob rows"
    )
    num_engines: PositiveInt = Field(
        1, description="SkyRL driver: data-parallel engine replicas, each a one-thread vLLM engine in its own "
        "Ray actor; a batch's prompts are split into contiguous shards, one per engine"
    )
    # GPU (vLLM CUDA) settings; vLLM's defaults where None
    native_cuda_graphs: bool = Field(
        False, description="native engine with vLLM's torch.compile + CUDA graphs (its best GPU settings); vLLM runs "
        "the isoexec model eager (its captured graph would replay the model's dummy forward)"
    )
    isoexec_cuda_graphs: bool = Field(
        True, description="on CUDA, the isoexec model replays its decode steps from its own CUDA graphs "
        "(isoexec.model.graphs; the eager step's bits)"
    )
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM gpu_memory_utilization")
    kv_cache_memory_bytes: PositiveInt | None = Field(
        None, description="vLLM kv_cache_memory_bytes: a fixed KV budget instead of one sized by profiling"
    )
    gdn_prefill_backend: Literal["triton", "flashinfer"] | None = Field(
        None, description="vLLM's GDN prefill kernels for the native engine on GPU (triton where FlashInfer is absent)"
    )


class OffPolicyCorrection(_Section):
    """SkyRL's off-policy correction (``trainer.algorithm.off_policy_correction``, SkyRL 0.4's
    ``OffPolicyCorrectionConfig``; field names and defaults are SkyRL's): the trainer reweights or masks
    each token's policy loss by the ratio ``exp(lT - lR)`` of its pre-update trainer logprob to the
    rollout engine's. Applied by SkyRL's own loss (``apply_off_policy_correction``), never by isoexec.
    """

    tis_ratio_type: Literal["token", "sequence"] | None = Field(
        "token", description="truncated importance sampling: token (each token's ratio, capped) or sequence "
        "(the product over the response, capped); None: no TIS")
    token_tis_ratio_clip_high: PositiveFloat = Field(2.0, description="cap of a token's TIS weight")
    sequence_tis_ratio_clip_high: PositiveFloat = Field(5.0, description="cap of a sequence's TIS weight")
    sequence_mask_metric: Literal["product", "geometric"] | None = Field(
        None, description="drop whole sequences whose product / geometric mean of ratios leaves the bounds below")
    product_mask_low: PositiveFloat = 0.5
    product_mask_high: PositiveFloat = 2.0
    geo_mask_low: PositiveFloat = 0.99
    geo_mask_high: PositiveFloat = 1.01


class ArmSection(_Section):
    """One more arm of the paired runs: the stack of ``mode`` (its engine, trainer and kernel set, run
    exactly as that mode's arm) trained with SkyRL's off-policy correction, which corrects the
    train-inference mismatch instead of removing it. Its runs go to ``results/<exp>/rl/<name>/seed<k>/``
    and its rows of the tables and figures carry ``name``.
    """

    name: str = Field(pattern=r"^[a-z][a-z0-9-]*$", description="folder and table name: lower-case letters, "
                      "digits and '-' (e.g. native-tis)")
    mode: Literal["native", "isoexec"] = Field("native", description="the stack the arm runs (one of rl.modes)")
    off_policy_correction: OffPolicyCorrection = OffPolicyCorrection()


class SkyRLSection(_Section):
    """A GPU-node run through SkyRL's own entry point (``isoexec rl skyrl-launch``; isoexec.rl.skyrl.render).

    SkyRL's vLLM servers generate. The native arm trains with SkyRL's stock Megatron worker at
    ``megatron_tp`` x ``megatron_ep`` on ``num_gpus`` GPUs, with ``inference_engines`` x ``inference_tp``
    GPUs of servers; the isoexec arm trains with isoexec's policy worker at the ``trainer`` section's
    layout, one isoexec server per trainer GPU. The ``rl`` section gives the algorithm.
    """

    model_path: str = Field(description="Hugging Face id or directory of the policy checkpoint")
    train_data: str = Field(description="parquet in SkyRL's prompt schema (prompt, env_class, reward_spec)")
    env_class: str = Field("aime", description="skyrl-gym env scoring the responses (aime: the DAPO-Math verifier)")
    num_gpus: PositiveInt = 8
    colocate: bool = Field(True, description="trainer and vLLM servers share the GPUs (SkyRL colocate_all)")
    megatron_tp: PositiveInt = Field(1, description="native arm: SkyRL's Megatron tensor-parallel degree")
    megatron_ep: PositiveInt = Field(1, description="native arm: SkyRL's Megatron expert-parallel degree")
    inference_engines: PositiveInt = Field(1, description="native arm: vLLM servers")
    inference_tp: PositiveInt = Field(8, description="native arm: tensor-parallel degree of each vLLM server")
    max_prompt_length: PositiveInt = 2048
    micro_batch_size: PositiveInt = 1
    gpu_memory_utilization: PositiveFloat = 0.6


class ExperimentConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="results/<name>/: letters, digits, _ . -")
    device: Literal["cpu", "cuda"] = "cpu"
    results_dir: str | None = None
    model: ModelSection = ModelSection()
    kernels: KernelSection = KernelSection()
    gates: GatesSection = GatesSection()
    task: TaskSection = TaskSection()
    sft: SFTSection = SFTSection()
    rl: RLSection = RLSection()
    trainer: TrainerSection = TrainerSection()
    engine: EngineSection = EngineSection()
    skyrl: SkyRLSection | None = None
    arms: list[ArmSection] = Field([], description="arms beyond rl.modes: a mode's stack with SkyRL's "
                                   "off-policy correction (isoexec.rl.arms)")

    @property
    def interleave(self) -> str:
        """``rl.interleave``, or its default: ``step`` under the SkyRL driver on cpu, else ``run``."""
        return self.rl.interleave or ("step" if self.rl.driver == "skyrl" and self.device == "cpu" else "run")

    @model_validator(mode="after")
    def _cross_checks(self) -> "ExperimentConfig":
        problems = []
        m = self.model
        if m.num_experts_per_tok > m.num_experts:
            problems.append(f"model.num_experts_per_tok={m.num_experts_per_tok} > model.num_experts={m.num_experts}")
        if m.num_attention_heads % m.num_key_value_heads:
            problems.append(f"model.num_attention_heads={m.num_attention_heads} is not a multiple of "
                            f"model.num_key_value_heads={m.num_key_value_heads}")
        if m.linear_num_value_heads % m.linear_num_key_heads:
            problems.append(f"model.linear_num_value_heads={m.linear_num_value_heads} is not a multiple of "
                            f"model.linear_num_key_heads={m.linear_num_key_heads}")
        try:
            self.kernels.check_device(self.device)
        except ValueError as e:
            problems.append(f"device={self.device}: {e}")
        if self.rl.temperature != self.kernels.temperature:
            problems.append(f"rl.temperature={self.rl.temperature} must equal kernels.temperature="
                            f"{self.kernels.temperature} (the contract pins the policy temperature; both modes sample at it)")
        per_mode: dict[str, list[str]] = {}  # a Megatron problem -> the modes it concerns
        megatron_modes = []
        for mode in self.rl.modes:
            try:
                backend = self.trainer.backend_for(mode)
            except ValueError as e:
                problems.append(str(e))
                continue
            if mode == "isoexec" and backend == "hf":
                problems.append("trainer.backend='hf' (transformers' own kernels) cannot run mode isoexec; "
                                "use 'unified' or 'megatron' for isoexec")
            if backend == "megatron":
                megatron_modes.append(mode)
                found = self.trainer.megatron_problems(mode, self.device, m)
                if self.rl.driver != "skyrl":
                    found.append(f"trainer.backend='megatron' runs as a worker group of "
                                 f"{self.trainer.world_size(mode)} ranks under SkyRL: set rl.driver: skyrl")
                for p in found:
                    per_mode.setdefault(p, []).append(mode)
        problems += [p if modes == megatron_modes else f"mode {', '.join(modes)}: {p}" for p, modes in per_mode.items()]
        if self.rl.driver == "skyrl" and self.engine.backend != "vllm":
            problems.append(f"rl.driver='skyrl' generates with the vLLM engine (engine.backend={self.engine.backend!r}); "
                            "use engine.backend: vllm or rl.driver: loop")
        if self.rl.driver == "loop" and self.rl.interleave == "step":
            problems.append("rl.interleave='step' runs the arms' SkyRL trainers in turns: only the SkyRL driver "
                            "runs it (rl.driver: skyrl), the loop runs whole runs (rl.interleave: run)")
        if self.rl.driver == "loop" and self.rl.dynamic_sampling:
            problems.append("rl.dynamic_sampling=true resamples prompts until the step is full: only the SkyRL "
                            "driver runs it (rl.driver: skyrl)")
        if self.task.max_total < self.task.max_operand:
            problems.append(f"task.max_total={self.task.max_total} < task.max_operand={self.task.max_operand}")
        if self.gates.max_len < self.gates.min_len:
            problems.append(f"gates.max_len={self.gates.max_len} < gates.min_len={self.gates.min_len}")
        # Settings one arm of a paired run cannot honour (README, "What isoexec mode refuses"); the
        # rollout check runs vLLM in both modes whatever engine.backend says.
        if m.tie_word_embeddings:
            problems.append("model.tie_word_embeddings=true cannot be honoured by the native arm: vLLM's "
                            "Qwen3NextForCausalLM does not tie lm_head to the embedding (a tied checkpoint has "
                            "no lm_head.weight, so the native engine would run an uninitialised head); set it to false")
        if self.engine.enable_prefix_caching:
            problems.append("engine.enable_prefix_caching=true cannot be honoured by the isoexec arm: a cached "
                            "prefix would start a request past position 0 without the model's per-request state; "
                            "set it to false")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _arm_checks(self) -> "ExperimentConfig":
        """The ``arms`` section against ``rl``: names unique and not a mode's, the stack one of ``rl.modes``,
        a correction that does something and that SkyRL applies with ``rl.policy_loss``."""
        problems = []
        names = [a.name for a in self.arms]
        for i, a in enumerate(self.arms):
            if a.name in self.rl.modes or a.name in ("native", "isoexec"):
                problems.append(f"arms[{i}].name={a.name!r} is a mode's name; give the arm its own (e.g. {a.mode}-tis)")
            elif names.count(a.name) > 1:
                problems.append(f"arms[{i}].name={a.name!r} is given twice")
            if a.mode not in self.rl.modes:
                problems.append(f"arms[{i}].mode={a.mode!r} is not one of rl.modes={self.rl.modes} (the arm is "
                                "compared with the run of its own stack)")
            c = a.off_policy_correction
            if c.tis_ratio_type is None and c.sequence_mask_metric is None:
                problems.append(f"arms[{i}].off_policy_correction: tis_ratio_type and sequence_mask_metric are both "
                                f"None, so the arm would run {a.mode!r} unchanged; set at least one")
        if self.arms and self.rl.policy_loss in ("clip_cov", "kl_cov"):
            problems.append(f"rl.policy_loss={self.rl.policy_loss!r}: SkyRL applies no off-policy correction with it "
                            "(skyrl/train/utils/utils.py, validate_cfg); the arms need another policy loss")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def out_dir(self) -> Path:
        """``results/<name>/`` unless ``results_dir`` overrides it."""
        return Path(self.results_dir or f"results/{self.name}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.load`` hook refusing a key given twice in one object (JSON would keep the last silently)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"duplicate key {twice[0]!r}")
    return dict(pairs)


def check_device(cfg: ExperimentConfig, source: str | Path) -> None:
    """Refuse an experiment whose ``device`` this machine does not have, before anything runs on it.

    Raises:
        ValueError: ``device: cuda`` where torch sees no CUDA device (the run would otherwise fall back to the
            CPU in some stages and fail in others, and its results would not be the experiment's).
    """
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{source}: device: cuda, but this machine has no CUDA device that torch can use "
                             "(torch.cuda.is_available() is False); run it on a GPU node (README, GPU node), "
                             "or use a config with device: cpu")


def load_config(path: str | Path) -> ExperimentConfig:
    """Load and validate an experiment YAML, or a settings record ``results/<exp>/experiment.json``
    (:mod:`isoexec.settings`; a ``.json`` file is read as JSON): a run can be repeated from its record.

    Raises:
        FileNotFoundError: the file does not exist (the message lists the YAML files of its folder).
        ValueError: the path is a folder, the YAML (JSON) is malformed, a key is duplicated or unknown,
            a value has a wrong type or is out of range, or sections contradict each other; the message
            names the file and every offending key.
    """
    path = Path(path)
    if path.is_dir():
        there = sorted(p.name for p in path.glob("*.yaml"))
        raise ValueError(f"experiment config {str(path)!r} is a folder; pass one YAML file"
                         + (f", e.g. {path / there[0]} ({path}/ holds {', '.join(there)})" if there else ""))
    if not path.is_file():
        folder = path.parent
        there = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
        hint = f"; {folder}/ holds {', '.join(there)}" if there else ""
        raise FileNotFoundError(f"experiment config {str(path)!r} does not exist{hint}")
    try:
        with path.open() as f:  # a stream: YAML errors name the file
            if path.suffix == ".json":
                raw = json.load(f, object_pairs_hook=_unique_keys)
            else:
                raw = yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    except ValueError as e:  # json.JSONDecodeError is one
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at top level, got {type(raw).__name__}")
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"{path}: invalid experiment config: {validation_summary(e)}") from None


def _section_fields(loc: tuple) -> list[str]:
    """Field names of the config section at ``loc`` (e.g. ``("engine",)``, or ``("kernels", "triton",
    "pik_bfloat16_by_leaf_k", 1)`` for an item of a tuple of sections); empty if it is not a section."""
    model: type[BaseModel] = ExperimentConfig
    item = False  # the previous part was a tuple of sections: this part is an index into it
    for part in loc:
        if item and isinstance(part, int):
            item = False
            continue
        ann = model.model_fields[part].annotation if isinstance(part, str) and part in model.model_fields else None
        args = get_args(ann)
        if get_origin(ann) is tuple and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            model, item = args[0], True
            continue
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [] if item else list(model.model_fields)


def validation_summary(e: ValidationError) -> str:
    """Every problem of a pydantic ``ValidationError`` on one line: ``key=value: what is allowed; ...``."""
    by_key: dict[str, list] = {}  # key -> [the given value shown, messages]
    for err in e.errors(include_url=False):
        # a union's members appear as extra location parts (``literal['hf',...]``): one key, its messages joined
        key = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        # a section's own check (a model validator) names its keys in its message: the section's input is not shown
        given = (f"={err['input']!r}" if key and err["type"] not in ("missing", "model_type", "dict_type")
                 and not isinstance(err["input"], dict) else "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            allowed = _section_fields(err["loc"][:-1])
            msg = "unknown key" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        shown, msgs = by_key.setdefault(key, ["", []])
        by_key[key][0] = shown or given
        if msg not in msgs:
            msgs.append(msg)
    return "; ".join(f"{key}{given}: {' or '.join(msgs)}" if key else " or ".join(msgs)
                     for key, (given, msgs) in by_key.items())
