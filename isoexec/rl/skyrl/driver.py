"""One paired-run half (mode, seed) through SkyRL's ``RayPPOTrainer``, with Ray started locally.

Pieces, all plugged into SkyRL's extension points (no SkyRL file is edited):

- ``BasePPOExp`` hooks (``skyrl/train/entrypoints/main_base.py``): :class:`IsoExecPPOExp` overrides
  ``get_train_dataset`` (the task's DAPO-schema parquet, one tokenizer process),
  ``get_inference_client`` (``engine.num_engines`` data-parallel vLLM engines, each in an
  :class:`~isoexec.rl.skyrl.engine_actor.EngineActor` at one torch thread, behind
  :class:`~isoexec.rl.skyrl.client.IsoExecInferenceClient`, which splits each batch into contiguous
  shards) and ``get_trainer``; its
  ``run`` composes the hooks as ``BasePPOExp._setup_trainer`` does, but hands
  ``RayPPOTrainer.build_models`` isoexec's policy worker (SkyRL's stock FSDP and Megatron workers
  need CUDA, and the FSDP module does not import without ``peft``) and no critic / reference. Before the
  first step it compares the weights every engine and the trainer hold at load
  (``weight_sync.check_weights_at_load``) and records both sides' digests in ``provenance.json``.
- ``SkyRLGymGenerator`` (batched, single turn) with the task registered in skyrl-gym
  (:mod:`isoexec.rl.skyrl.env`); SkyRL's GRPO estimator and ``regular`` (DAPO clip-higher) loss
  chosen by config (:mod:`isoexec.rl.skyrl.render`).
- :class:`IsoExecPPOTrainer`: ``RayPPOTrainer`` that also measures the metrics of docs/design.md (Metrics) at the
  points where SkyRL has the data (rewards after generation, rollout vs pre-update trainer logprobs
  after SkyRL's policy forward), and :class:`MetricsCallback` (a SkyRL ``TrainingCallback``) writing
  one ``metrics.jsonl`` row per step under the plain loop's names (:mod:`isoexec.rl.metrics`).

Timing names: ``time/generation`` = SkyRL ``generate``; ``time/score`` = ``fwd_logprobs_values_reward``
(the pre-update ``trainer_score``); ``time/train`` = ``compute_advantages_and_returns`` +
``train_critic_and_policy``; ``time/weight_sync`` = ``sync_weights`` (contract handshake, transfer,
checksums); ``time/step`` = SkyRL's ``step``. With dynamic sampling a step may generate several
times; SkyRL's timers then keep the last generation's time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from isoexec.config import ExperimentConfig
from isoexec.engines.weight_sync import check_weights_at_load
from isoexec.io import atomic_write_json
from isoexec.provenance import provenance
from isoexec.rl import metrics
from isoexec.rl.skyrl import compat

compat.install()  # before the first skyrl import (compat item 1)
compat.filter_sampling_keeps_sampling_on_uninformative_batches()  # compat item 4

import ray  # noqa: E402
from skyrl.train.entrypoints.main_base import BasePPOExp  # noqa: E402
from skyrl.train.dataset import PromptDataset  # noqa: E402
from skyrl.train.trainer import RayPPOTrainer  # noqa: E402
from skyrl.train.utils.callbacks import TrainingCallback  # noqa: E402

from isoexec.rl.skyrl.client import IsoExecInferenceClient  # noqa: E402
from isoexec.rl.skyrl.engine_actor import EngineActor  # noqa: E402
from isoexec.rl.skyrl.env import register, write_train_data  # noqa: E402
from isoexec.rl.skyrl.render import build, local_overrides  # noqa: E402
from isoexec.rl.skyrl.worker import IsoExecPolicyWorker  # noqa: E402

log = logging.getLogger(__name__)

TIMERS = {
    "time/generation": ("generate",),
    "time/score": ("fwd_logprobs_values_reward",),
    "time/train": ("compute_advantages_and_returns", "train_critic_and_policy"),
    "time/weight_sync": ("sync_weights",),
    "time/step": ("step",),
}


class IsoExecPPOTrainer(RayPPOTrainer):
    """``RayPPOTrainer`` that also computes the plain loop's per-step metrics (``self.isoexec_row``).

    Args:
        exp, seed: the experiment (``rl.pass_k``, ``rl.full_vocab_kl_positions``, clip range, ``kernels.chunk_size``
            and ``kv_block`` for the exposure counts) and run seed.
        kwargs: ``RayPPOTrainer``'s.
    """

    def __init__(self, *args, exp: ExperimentConfig, seed: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.exp, self.seed = exp, seed
        self.isoexec_row: dict[str, Any] = {}
        self._seqs: list[tuple[list[int], list[int]]] = []

    def postprocess_generator_output(self, generator_output, uids, *args, **kwargs):
        """Reward metrics per prompt group (before SkyRL turns rewards into per-token rewards)."""
        rewards = torch.tensor([float(r) for r in generator_output["rewards"]], dtype=torch.float64)
        groups = {u: i for i, u in enumerate(dict.fromkeys(uids))}
        g = self.cfg.generator.n_samples_per_prompt
        by_group = torch.zeros(len(groups), g, dtype=torch.float64)
        fill = [0] * len(groups)
        for u, r in zip(uids, rewards):
            by_group[groups[u], fill[groups[u]]] = r
            fill[groups[u]] += 1
        self.isoexec_row = {
            "reward_mean": float(rewards.mean()),
            "pass_at_k": metrics.mean_pass_at_k(by_group, self.exp.rl.pass_k),
            "response_length_mean": float(np.mean([len(r) for r in generator_output["response_ids"]])),
            "groups_used": len(groups),
        }
        self._seqs = list(zip(generator_output["prompt_token_ids"], generator_output["response_ids"]))
        return super().postprocess_generator_output(generator_output, uids, *args, **kwargs)

    def fwd_logprobs_values_reward(self, training_input):
        """SkyRL's forward, then rollout (``lR``) vs pre-update trainer (``lT``) metrics of every response token."""
        training_input = super().fwd_logprobs_values_reward(training_input)
        mask = training_input["response_mask"][: len(self._seqs)] > 0
        lR = training_input["rollout_logprobs"][: len(self._seqs)][mask].to(torch.float32)
        lT = training_input["action_log_probs"][: len(self._seqs)][mask].to(torch.float32)
        row = metrics.logprob_diff_metrics(lR, lT)
        rl = self.exp.rl
        row["is_ratio_clip_frac"] = metrics.is_ratio_clip_frac(lR, lT, rl.clip_low, rl.clip_high)
        row.update(metrics.exposure_metrics([len(p) for p, _ in self._seqs], [len(r) for _, r in self._seqs],
                                            self.exp.kernels.chunk_size, self.exp.kernels.kv_block))
        infos = self.policy_model.actor_infos  # every rank drains; the collection rank (rank 0) holds the rows
        kept = ray.get([a.handle.isoexec_drain_score.remote() for a in infos])
        trainer_rows = next(r for a, r in zip(infos, kept) if a.rank.is_collection_dp_rank())
        trainer_rows = trainer_rows[: len(self._seqs)][mask]  # [N, V]
        row["entropy_mean"] = metrics.entropy_mean(trainer_rows)
        engine_rows = self.inference_engine_client.full_rows(self._seqs)
        if any(r is None for r in engine_rows):
            row["full_vocab_kl"] = metrics.NAN
        else:
            pos = kl_positions(lT.numel(), self.exp.rl.full_vocab_kl_positions, self.seed, self.global_step - 1)
            rollout = torch.cat([torch.from_numpy(np.array(r, dtype=np.float32)) for r in engine_rows])
            row["full_vocab_kl"] = metrics.full_vocab_kl(rollout[pos], trainer_rows[pos])
        self.isoexec_row.update(row)
        return training_input


def kl_positions(n_tokens: int, k: int, seed: int, step: int) -> torch.Tensor:
    """The plain loop's ``full_vocab_kl`` positions for (seed, step)."""
    from isoexec.rl.loop import kl_positions as loop_positions

    return loop_positions(n_tokens, k, seed, step)


class MetricsCallback(TrainingCallback):
    """Writes one ``metrics.jsonl`` row per step (plain-loop names) from SkyRL's ``on_log`` payload."""

    def __init__(self, path: Path, mode: str, seed: int):
        self.log = metrics.MetricsLog(path)
        self.mode, self.seed = mode, seed

    def on_log(self, trainer, callback_input, control) -> None:
        logs = callback_input.logs
        row: dict[str, Any] = {"step": callback_input.global_step - 1, "mode": self.mode, "seed": self.seed}
        row.update(trainer.isoexec_row)
        row["loss"] = logs.get("policy/final_loss", metrics.NAN)
        row["grad_norm"] = logs.get("policy/grad_norm", metrics.NAN)
        row["clip_frac"] = logs.get("policy/loss_metrics/clip_ratio", metrics.NAN)
        for name, keys in TIMERS.items():
            row[name] = sum(float(logs.get(f"timing/{k}", 0.0)) for k in keys)
        self.log.append(row)
        log.info("%s seed %d step %d: reward %.3f mismatch %d/%d max|d| %.3g step %.2fs (gen %.2f score %.2f "
                 "train %.2f sync %.2f)", self.mode, self.seed, row["step"], row["reward_mean"],
                 row["mismatch_count"], row["tokens"], row["logprob_abs_diff_max"], row["time/step"],
                 row["time/generation"], row["time/score"], row["time/train"], row["time/weight_sync"])


class IsoExecPPOExp(BasePPOExp):
    """SkyRL experiment on isoexec's engine and trainer (see module docstring).

    Args:
        cfg: SkyRL config from :func:`isoexec.rl.skyrl.render.build`.
        exp, mode, seed: the isoexec experiment and the half of the pair.
        metrics_path: the ``metrics.jsonl`` to write.
        engine_exp: the experiment as the engine sees it (default ``exp``; tests pass another one to
            check that the contract handshake refuses the run).
        threads: torch threads of the engine process.
    """

    def __init__(self, cfg, exp: ExperimentConfig, mode: str, seed: int, metrics_path: Path,
                 engine_exp: ExperimentConfig | None = None, threads: int = 1,
                 on_load: Callable[[dict[str, Any]], None] | None = None):
        self.exp, self.mode, self.seed, self.metrics_path = exp, mode, seed, metrics_path
        self.engine_exp = engine_exp or exp
        self.threads = threads
        self.on_load = on_load
        super().__init__(cfg)

    def get_train_dataset(self) -> PromptDataset:
        return PromptDataset(datasets=self.cfg.data.train_data, tokenizer=self.tokenizer,
                             max_prompt_length=self.cfg.trainer.max_prompt_length, num_workers=1)

    def get_inference_client(self) -> IsoExecInferenceClient:
        """Starts the engine actors without waiting for them: they load while the trainer's workers
        start, and :meth:`run` waits for both before the first step."""
        path = self.cfg.trainer.policy.model.path
        actors = [ray.remote(num_cpus=0)(EngineActor).remote(
            path, self.mode, self.engine_exp.model_dump_json(), self.seed, True, self.threads, shard)
            for shard in range(self.exp.engine.num_engines)]
        return IsoExecInferenceClient(actors, path, path)

    def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client,
                    generator, colocate_pg) -> IsoExecPPOTrainer:
        return IsoExecPPOTrainer(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                                 eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                                 generator=generator, colocate_pg=colocate_pg, exp=self.exp, seed=self.seed)

    def run(self) -> IsoExecPPOTrainer:
        """Build (hooks + isoexec's worker) and train; returns the trainer."""
        register()
        tracker = self.get_tracker()
        client = self.get_inference_client()
        generator = self.get_generator(self.cfg, self.tokenizer, client)
        trainer = self.get_trainer(self.cfg, tracker, self.tokenizer, self.train_dataset, self.eval_dataset,
                                   client, generator, self.colocate_pg)
        self.metrics = MetricsCallback(self.metrics_path, self.mode, self.seed)
        trainer.add_callback(self.metrics)
        self.trainer = trainer
        trainer.build_models(ray.remote(IsoExecPolicyWorker), None, None)
        engines = ray.get([a.info.remote() for a in client.actors])  # the engines are up (or their error surfaces)
        infos = trainer.policy_model.actor_infos  # every rank joins the gather; rank 0's copy is compared
        held = ray.get([a.handle.isoexec_load_checksums.remote() for a in infos])
        trained = next(h for a, h in zip(infos, held) if a.rank.is_collection_dp_rank())
        loaded = [check_weights_at_load(e["load_checksums"], trained) for e in engines]  # refused on any difference
        if self.on_load is not None:
            self.on_load({"engine": [x["engine"] for x in loaded], "trainer": loaded[0]["trainer"]})
        asyncio.run(trainer.train())
        return trainer


def run_skyrl(config: ExperimentConfig, mode: str, seed: int, init_dir: str | Path, out_dir: str | Path,
              steps: int | None = None, command: str | None = None, threads: int = 1,
              engine_config: ExperimentConfig | None = None) -> list[dict[str, Any]]:
    """A paired-run half through SkyRL; same outputs as :func:`isoexec.rl.loop.run_rl`.

    Starts Ray locally (max(2, trainer ranks) CPUs, one GPU per trainer rank: logical on a CPU host, and on a
    CUDA host every actor sees the node's GPUs, :data:`~isoexec.rl.skyrl.compat.CUDA_ACTOR_ENV`) unless Ray is
    already initialized; the task's parquet lives in a temporary directory for the run.
    Writes ``out_dir/provenance.json`` (with the rendered SkyRL overrides) and ``out_dir/metrics.jsonl``.

    Args:
        engine_config: the experiment as the engine sees it (default ``config``); differs only in
            tests of the handshake.

    Returns:
        The metrics rows.

    Raises:
        isoexec.contract.ContractMismatch: isoexec mode, the engine's and the trainer's contracts
            differ (raised at the first weight sync, before training; surfaced through Ray).
        isoexec.engines.weight_sync.WeightSyncError: an engine and the trainer hold different weights at
            load (before the first step; ``provenance.json`` records both sides' checksums when they agree,
            under ``weights_at_load``).
    """
    if mode not in ("native", "isoexec"):
        raise ValueError(f"mode must be 'native' or 'isoexec', got {mode!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = config.rl.steps if steps is None else steps
    with tempfile.TemporaryDirectory(prefix="isoexec-skyrl-") as scratch:
        return _run(config, mode, seed, init_dir, out_dir, steps, command, threads, engine_config, Path(scratch))


def _run(config, mode, seed, init_dir, out_dir, steps, command, threads, engine_config, scratch: Path):
    data = write_train_data(config.task, scratch / "train.parquet")
    overrides = local_overrides(config, mode, seed, init_dir, data, scratch, steps, threads)
    cfg = build(overrides)
    prov = provenance(command)
    prov["run"] = {"mode": mode, "seed": seed, "init": str(init_dir), "steps": steps, "driver": "skyrl",
                   "engine": "EngineActor(RolloutEngine)", "engines": config.engine.num_engines,
                   "trainer": "IsoExecPolicyWorker",
                   "torch_num_threads": threads}
    prov["skyrl_overrides"] = {k: v for k, v in overrides.items() if k != "trainer.policy.model_config_kwargs"}
    atomic_write_json(out_dir / "provenance.json", prov)

    def weights_at_load(res: dict[str, Any]) -> None:  # the load-time weight handshake passed: record it
        prov["weights_at_load"] = res
        atomic_write_json(out_dir / "provenance.json", prov)

    started = not ray.is_initialized()
    if started:
        env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                          "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "LD_PRELOAD")
               if k in os.environ}
        if config.device == "cuda":
            env.update(compat.CUDA_ACTOR_ENV)
        world = config.trainer.world_size(mode)
        ray.init(**compat.ray_init_kwargs(num_cpus=max(2, world), num_trainer_gpus=world, env_vars=env))
    try:
        exp = IsoExecPPOExp(cfg, config, mode, seed, out_dir / "metrics.jsonl", engine_exp=engine_config,
                            threads=threads, on_load=weights_at_load)
        exp.run()
        rows = exp.metrics.log.rows
    finally:
        if started:
            ray.shutdown()
    return rows
