"""Runs (arm, seed) of a paired experiment through SkyRL's ``RayPPOTrainer``, with Ray started locally.

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

- :class:`Session`: Ray and the :class:`Stack` s of a series of runs in one process (the paired job,
  :func:`run_paired`). A stack is one arm's engine actors and policy worker group, started by its first
  run and kept by the later ones (``rl.interleave: run``: one stack for every run; ``step``: one per arm,
  alive at once, the arms of a seed stepping in turns, :mod:`isoexec.rl.skyrl.turns`):
  each engine actor switches its engine only when the run's mode or engine settings differ
  (:meth:`~isoexec.rl.skyrl.engine_actor.EngineActor.restart`), and each worker rebuilds its trainer and
  optimizer from the run's checkpoint under the run's SkyRL config (:meth:`IsoExecPPOTrainer.reuse_models`).
  A run's start-up is then a trainer rebuild and, at a mode switch, an engine rebuild, instead of Ray,
  five processes and their imports (about 45 s per run on the 2-core CPU machines). Every run starts
  from the same state either way: the engines get the trainer's weights before the first step
  (SkyRL's initial sync) and reseed their sampler at every call, the trainer is rebuilt from the
  checkpoint with a new optimizer.

Timing names: ``time/generation`` = SkyRL ``generate``; ``time/score`` = ``fwd_logprobs_values_reward``
(the pre-update ``trainer_score``); ``time/train`` = ``compute_advantages_and_returns`` +
``train_critic_and_policy``; ``time/weight_sync`` = ``sync_weights`` (contract handshake, transfer,
checksums); ``time/step`` = SkyRL's ``step``. With dynamic sampling a step may generate several
times; SkyRL's timers then keep the last generation's time.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import tempfile
import time
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
from isoexec.rl.arms import Arm, find_arm, schedule, seed_rounds
from isoexec.rl.skyrl import compat

compat.install()  # before the first skyrl import (compat item 1)
compat.filter_sampling_keeps_sampling_on_uninformative_batches()  # compat item 4

import ray  # noqa: E402
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch  # noqa: E402
from skyrl.train.entrypoints.main_base import BasePPOExp  # noqa: E402
from skyrl.train.dataset import PromptDataset  # noqa: E402
from skyrl.train.trainer import RayPPOTrainer  # noqa: E402
from skyrl.train.utils.callbacks import TrainingCallback  # noqa: E402

from isoexec.rl.skyrl.client import IsoExecInferenceClient  # noqa: E402
from isoexec.rl.skyrl.engine_actor import EngineActor  # noqa: E402
from isoexec.rl.skyrl.env import register, write_train_data  # noqa: E402
from isoexec.rl.skyrl.render import build, local_overrides  # noqa: E402
from isoexec.rl.skyrl.turns import StepTurns, TurnCallback, run_in_turns  # noqa: E402
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

    def reuse_models(self, group) -> None:
        """What ``build_models`` does, on the policy worker group of an earlier run of the session.

        ``RayPPOTrainer.build_models`` always starts a new group (``PPORayActorGroup``, whose ranks import
        SkyRL, Megatron and torch in fresh processes); SkyRL has no call for taking a running one. Here each
        rank first takes this run's SkyRL config (:meth:`IsoExecPolicyWorker.isoexec_begin_run`: mode,
        algorithm, off-policy correction), then ``init_model`` rebuilds its trainer and optimizer from the
        checkpoint and the pad token is set, as ``build_models`` does; the dispatch is SkyRL's
        ``WorkerDispatch`` over the group. No critic, no reference model (as :meth:`IsoExecPPOExp.run`).
        """
        trainer_cfg = self.cfg.trainer
        group.cfg = trainer_cfg
        ray.get(group.async_run_ray_method("pass_through", "isoexec_begin_run", trainer_cfg))
        ray.get(group.async_init_model(trainer_cfg.policy.model.path))
        ray.get(group.async_run_ray_method("pass_through", "_set_pad_token_id", self.tokenizer.pad_token_id))
        self.policy_model, self.critic_model, self.ref_model = group, None, None
        self.dispatch = WorkerDispatch(cfg=self.cfg, policy_actor_group=group,
                                       inference_engine_client=self.inference_engine_client)


def kl_positions(n_tokens: int, k: int, seed: int, step: int) -> torch.Tensor:
    """The plain loop's ``full_vocab_kl`` positions for (seed, step)."""
    from isoexec.rl.loop import kl_positions as loop_positions

    return loop_positions(n_tokens, k, seed, step)


class MetricsCallback(TrainingCallback):
    """Writes one ``metrics.jsonl`` row per step (plain-loop names) from SkyRL's ``on_log`` payload."""

    def __init__(self, path: Path, arm: Arm, seed: int):
        self.log = metrics.MetricsLog(path)
        self.arm, self.seed = arm, seed

    def on_log(self, trainer, callback_input, control) -> None:
        logs = callback_input.logs
        row: dict[str, Any] = {"step": callback_input.global_step - 1, "arm": self.arm.name, "mode": self.arm.mode,
                               "seed": self.seed}
        row.update(trainer.isoexec_row)
        row["loss"] = logs.get("policy/final_loss", metrics.NAN)
        row["grad_norm"] = logs.get("policy/grad_norm", metrics.NAN)
        row["clip_frac"] = logs.get("policy/loss_metrics/clip_ratio", metrics.NAN)
        prefix = "policy/loss_metrics/"
        row.update(metrics.correction_metrics({k[len(prefix):]: v for k, v in logs.items() if k.startswith(prefix)}))
        for name, keys in TIMERS.items():
            row[name] = sum(float(logs.get(f"timing/{k}", 0.0)) for k in keys)
        self.log.append(row)
        log.info("%s seed %d step %d: reward %.3f mismatch %d/%d max|d| %.3g step %.2fs (gen %.2f score %.2f "
                 "train %.2f sync %.2f)", self.arm.name, self.seed, row["step"], row["reward_mean"],
                 row["mismatch_count"], row["tokens"], row["logprob_abs_diff_max"], row["time/step"],
                 row["time/generation"], row["time/score"], row["time/train"], row["time/weight_sync"])


class IsoExecPPOExp(BasePPOExp):
    """SkyRL experiment on isoexec's engine and trainer (see module docstring).

    Args:
        cfg: SkyRL config from :func:`isoexec.rl.skyrl.render.build`.
        exp, arm, seed: the isoexec experiment, the arm and the seed of this run.
        metrics_path: the ``metrics.jsonl`` to write.
        stack: the :class:`Stack` whose engine actors and worker group the run takes (or starts).
        engine_exp: the experiment as the engine sees it (default ``exp``; tests pass another one to
            check that the contract handshake refuses the run).
    """

    def __init__(self, cfg, exp: ExperimentConfig, arm: Arm, seed: int, metrics_path: Path, stack: "Stack",
                 engine_exp: ExperimentConfig | None = None,
                 on_load: Callable[[dict[str, Any]], None] | None = None):
        self.exp, self.arm, self.seed, self.metrics_path = exp, arm, seed, metrics_path
        self.stack = stack
        self.engine_exp = engine_exp or exp
        self.on_load = on_load
        super().__init__(cfg)

    def get_train_dataset(self) -> PromptDataset:
        return PromptDataset(datasets=self.cfg.data.train_data, tokenizer=self.tokenizer,
                             max_prompt_length=self.cfg.trainer.max_prompt_length, num_workers=1)

    def get_inference_client(self) -> IsoExecInferenceClient:
        """The stack's engine actors, (re)started for this run without waiting for them: they load while
        the trainer's workers start, and :meth:`prepare` waits for both before the first step."""
        path = self.cfg.trainer.policy.model.path
        actors = self.stack.engines(path, self.arm.mode, self.engine_exp, self.seed)
        return IsoExecInferenceClient(actors, path, path)

    def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client,
                    generator, colocate_pg) -> IsoExecPPOTrainer:
        return IsoExecPPOTrainer(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                                 eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                                 generator=generator, colocate_pg=colocate_pg, exp=self.exp, seed=self.seed)

    def prepare(self) -> IsoExecPPOTrainer:
        """Build (hooks + isoexec's worker, or the stack's group) up to the first step: the engines are up and
        hold the trainer's weights at load (checked). Returns the trainer (``self.trainer``); ``train()`` runs it."""
        register()
        tracker = self.get_tracker()
        client = self.get_inference_client()
        generator = self.get_generator(self.cfg, self.tokenizer, client)
        trainer = self.get_trainer(self.cfg, tracker, self.tokenizer, self.train_dataset, self.eval_dataset,
                                   client, generator, self.colocate_pg)
        self.metrics = MetricsCallback(self.metrics_path, self.arm, self.seed)
        trainer.add_callback(self.metrics)
        self.trainer = trainer
        if self.stack.group is None:
            trainer.build_models(ray.remote(IsoExecPolicyWorker), None, None)
            self.stack.group = trainer.policy_model
        else:
            trainer.reuse_models(self.stack.group)
        engines = self.stack.engines_ready()  # the engines are up (or an engine's error surfaces here)
        infos = trainer.policy_model.actor_infos  # every rank joins the gather; rank 0's copy is compared
        held = ray.get([a.handle.isoexec_load_checksums.remote() for a in infos])
        trained = next(h for a, h in zip(infos, held) if a.rank.is_collection_dp_rank())
        loaded = [check_weights_at_load(e["load_checksums"], trained) for e in engines]  # refused on any difference
        if self.on_load is not None:
            self.on_load({"engine": [x["engine"] for x in loaded], "trainer": loaded[0]["trainer"]})
        return trainer


class Stack:
    """The engine actors and the policy worker group that one arm's runs of a :class:`Session` take, one
    run at a time: started by the first run, kept by the later ones (see the module docstring).

    Args:
        world: trainer ranks of its worker group (every run on it trains on this many).
        threads: torch threads of the engine processes.
    """

    def __init__(self, world: int, threads: int = 1):
        self.world, self.threads = world, threads
        self.group = None  # SkyRL's PPORayActorGroup of IsoExecPolicyWorker, from the first run
        self._engines: list = []
        self._engine_key: tuple | None = None
        self._pending: list = []

    def engines(self, checkpoint: str, mode: str, engine_exp: ExperimentConfig, seed: int) -> list:
        """``engine.num_engines`` engine actors on ``checkpoint`` in ``mode`` for a run of ``seed``: the
        stack's, restarted (:meth:`EngineActor.restart`), or new ones where there are none or they run
        another checkpoint or another number of engines. Does not wait; :meth:`engines_ready` does."""
        n = engine_exp.engine.num_engines
        config_json = engine_exp.model_dump_json()
        if self._engine_key == (checkpoint, n):
            self._pending = [a.restart.remote(mode, config_json, seed) for a in self._engines]
        else:
            self._end_engines()
            self._engines = [ray.remote(num_cpus=0)(EngineActor).remote(
                checkpoint, mode, config_json, seed, True, self.threads, shard) for shard in range(n)]
            self._engine_key = (checkpoint, n)
            self._pending = []
        return list(self._engines)

    def engines_ready(self) -> list[dict[str, Any]]:
        """Wait until the engines started or restarted by :meth:`engines` are up (raises an engine's error);
        returns each engine's :meth:`EngineActor.info`. An engine kept from an earlier run reports the
        checksums of its load of the same checkpoint (the stack keeps engines only on one checkpoint);
        what it holds since is replaced by the run's first checked weight sync, before any generation."""
        pending, self._pending = self._pending, []
        ray.get(pending)
        return ray.get([a.info.remote() for a in self._engines])

    def _end_engines(self) -> None:
        for a in self._engines:
            ray.kill(a)
        self._engines, self._engine_key, self._pending = [], None, []

    def close(self) -> None:
        """End the engine actors and the worker group."""
        self._end_engines()
        if self.group is not None:
            for a in self.group._actor_handlers:
                ray.kill(a)
            self.group = None


class PreparedRun:
    """A run of a :class:`Session` built up to its first step (:meth:`Session.prepare`): :meth:`train`
    runs its steps, :meth:`finish` records its times and returns its rows; :meth:`close` (always) drops its
    scratch folder."""

    def __init__(self, exp: IsoExecPPOExp, prov: dict[str, Any], out_dir: Path, scratch: tempfile.TemporaryDirectory,
                 t0: float):
        self.exp, self.prov, self.out_dir, self.scratch, self.t0 = exp, prov, out_dir, scratch, t0

    def train(self) -> None:
        """SkyRL's training loop (``RayPPOTrainer.train``) of this run, in an event loop of its own."""
        asyncio.run(self.exp.trainer.train())

    def finish(self, waited_s: float = 0.0) -> list[dict[str, Any]]:
        """Write the provenance again with the run's ``wall_s``, ``waited_s`` (seconds it waited for the other
        arms' steps, ``rl.interleave: step``) and ``outside_steps_s`` (its own seconds outside its steps and
        the waits: start-up and the first weight sync); returns the metrics rows."""
        rows = self.exp.metrics.log.rows
        wall = time.perf_counter() - self.t0
        self.prov["run"].update(wall_s=wall, waited_s=waited_s,
                                outside_steps_s=wall - waited_s - sum(r["time/step"] for r in rows))
        atomic_write_json(self.out_dir / "provenance.json", self.prov)
        return rows

    def close(self) -> None:
        self.scratch.cleanup()


class Session:
    """Ray and the :class:`Stack` s (engine actors, policy worker group) shared by a series of runs in this process.

    Args:
        config: the experiment (its trainer world size per mode).
        modes: the mode of each stack the session may hold at once: one (a series of runs on one stack; its
            world size is the session's, :meth:`fits`) or one per arm (``rl.interleave: step``, every arm's
            stack alive and stepping in turns). Their trainer world sizes sum to Ray's logical GPUs.
        threads: torch threads of the engine and trainer processes.

    Starts Ray locally (``max(2, GPUs)`` CPUs, one GPU per trainer rank of every stack: logical on a CPU host,
    and on a CUDA host every actor sees the node's GPUs, :data:`~isoexec.rl.skyrl.compat.CUDA_ACTOR_ENV`;
    :mod:`~isoexec.rl.skyrl.compat`) unless Ray is already initialized; :meth:`close` ends the actors, and Ray
    if the session started it.
    """

    def __init__(self, config: ExperimentConfig, modes: str | list[str], threads: int = 1):
        modes = [modes] if isinstance(modes, str) else list(modes)
        self.world = config.trainer.world_size(modes[0])
        self.threads = threads
        self.trainer_gpus = sum(config.trainer.world_size(m) for m in modes)
        self.stacks: dict[str, Stack] = {}
        self.runs = 0  # runs started so far (each run's provenance records its index as session_run)
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                              "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "LD_PRELOAD")
                   if k in os.environ}
            if config.device == "cuda":
                env.update(compat.CUDA_ACTOR_ENV)
            n = self.trainer_gpus
            ray.init(**compat.ray_init_kwargs(num_cpus=max(2, n), num_trainer_gpus=n, env_vars=env))

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fits(self, config: ExperimentConfig, mode: str) -> bool:
        """Whether a run of ``mode`` can take this session's worker groups (same trainer world size)."""
        return config.trainer.world_size(mode) == self.world

    def stack(self, name: str, world: int) -> Stack:
        """The stack called ``name`` for runs on ``world`` trainer ranks (new if the session has none of that name).

        Raises:
            ValueError: the stack trains on another world size, or a new stack's ranks would exceed the
                trainer GPUs the session declared to Ray (its ``modes``).
        """
        if name not in self.stacks:
            used = sum(s.world for s in self.stacks.values())
            if used + world > self.trainer_gpus:
                raise ValueError(f"a stack of {world} trainer ranks ({name}) does not fit beside {used} ranks in a "
                                 f"session sized for {self.trainer_gpus}: run it in a session of its own")
            self.stacks[name] = Stack(world, self.threads)
        s = self.stacks[name]
        if s.world != world:
            raise ValueError(f"a run on {world} trainer ranks cannot take stack {name}, whose worker group has "
                             f"{s.world}: run it in a session of its own")
        return s

    def prepare(self, config: ExperimentConfig, arm: Arm, seed: int, init_dir: str | Path, out_dir: Path, steps: int,
                command: str | None = None, engine_config: ExperimentConfig | None = None, stack: str = "main",
                interleave: str = "run") -> PreparedRun:
        """Build the run (``arm``, ``seed``) of ``steps`` steps on stack ``stack`` up to its first step;
        writes ``out_dir/provenance.json`` (``run.interleave`` records ``interleave``).

        Raises:
            ValueError: the run's trainer world size is not the stack's (:meth:`stack`).
            isoexec.engines.weight_sync.WeightSyncError: an engine and the trainer hold different weights at
                load (``provenance.json`` records both sides' checksums when they agree, under ``weights_at_load``).
        """
        the_stack = self.stack(stack, config.trainer.world_size(arm.mode))
        out_dir.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.TemporaryDirectory(prefix="isoexec-skyrl-")
        try:
            data = write_train_data(config.task, Path(scratch.name) / "train.parquet")
            overrides = {**local_overrides(config, arm.mode, seed, init_dir, data, scratch.name, steps, self.threads),
                         **arm.skyrl_overrides(), "trainer.run_name": f"{config.name}-{arm.name}-seed{seed}"}
            cfg = build(overrides)
            prov = provenance(command)
            prov["run"] = {"arm": arm.name, "mode": arm.mode, "seed": seed, "init": str(init_dir), "steps": steps,
                           "driver": "skyrl", "engine": "EngineActor(RolloutEngine)",
                           "engines": config.engine.num_engines, "trainer": "IsoExecPolicyWorker",
                           "torch_num_threads": self.threads, "session_run": self.runs, "interleave": interleave}
            prov["skyrl_overrides"] = {k: v for k, v in overrides.items() if k != "trainer.policy.model_config_kwargs"}
            atomic_write_json(out_dir / "provenance.json", prov)
            self.runs += 1
            t0 = time.perf_counter()

            def weights_at_load(res: dict[str, Any]) -> None:  # the load-time weight handshake passed: record it
                prov["weights_at_load"] = res
                atomic_write_json(out_dir / "provenance.json", prov)

            exp = IsoExecPPOExp(cfg, config, arm, seed, out_dir / "metrics.jsonl", the_stack,
                                engine_exp=engine_config, on_load=weights_at_load)
            exp.prepare()
            return PreparedRun(exp, prov, out_dir, scratch, t0)
        except BaseException:
            scratch.cleanup()
            raise

    def run(self, config: ExperimentConfig, arm: Arm, seed: int, init_dir: str | Path, out_dir: Path, steps: int,
            command: str | None = None, engine_config: ExperimentConfig | None = None) -> list[dict[str, Any]]:
        """One run (``arm``, ``seed``) of ``steps`` steps on the session's one stack, alone; writes
        ``out_dir/{provenance.json,metrics.jsonl}`` (the provenance again at the end: :meth:`PreparedRun.finish`).

        Raises:
            ValueError, isoexec.engines.weight_sync.WeightSyncError: see :meth:`prepare`.
            isoexec.contract.ContractMismatch: isoexec mode, the engine's and the trainer's contracts
                differ (raised at the first weight sync, before training; surfaced through Ray).
        """
        run = self.prepare(config, arm, seed, init_dir, out_dir, steps, command, engine_config)
        try:
            run.train()
            return run.finish()
        finally:
            run.close()

    def run_seed_in_turns(self, config: ExperimentConfig, arms: list[Arm], seed: int, init_dir: str | Path,
                     rl_dir: Path, steps: int, command: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """The runs of ``arms`` for ``seed`` stepping in turns (``rl.interleave: step``; :mod:`~isoexec.rl.skyrl.turns`):
        step k of every arm in ``arms`` order, then step k+1. Each arm runs on the stack of its name, built
        one after the other up to the first step; each writes ``rl_dir/<arm>/seed<k>/``.

        Returns:
            ``arm name -> metrics rows``.

        Raises:
            the first failing arm's error (the other arms stop at their next turn); see :meth:`run`.
        """
        prepared: list[PreparedRun] = []
        try:
            for arm in arms:
                prepared.append(self.prepare(config, arm, seed, init_dir, rl_dir / arm.name / f"seed{seed}", steps,
                                             command, stack=arm.name, interleave="step"))
            turns = StepTurns([a.name for a in arms])
            for arm, run in zip(arms, prepared):
                run.exp.trainer.add_callback(TurnCallback(turns, arm.name))  # after MetricsCallback: rows first
            run_in_turns(turns, [run.train for run in prepared])
            return {arm.name: run.finish(turns.waited_s[arm.name]) for arm, run in zip(arms, prepared)}
        finally:
            for run in prepared:
                run.close()

    def close(self) -> None:
        """End every stack's engine actors and worker group, and Ray if the session started it."""
        for s in self.stacks.values():
            s.close()
        self.stacks = {}
        gc.collect()
        if self.started_ray:
            ray.shutdown()


def run_skyrl(config: ExperimentConfig, arm: str, seed: int, init_dir: str | Path, out_dir: str | Path,
              steps: int | None = None, command: str | None = None, threads: int = 1,
              engine_config: ExperimentConfig | None = None) -> list[dict[str, Any]]:
    """One run (arm, seed) through SkyRL in a :class:`Session` of its own; same outputs as
    :func:`isoexec.rl.loop.run_rl`.

    Writes ``out_dir/provenance.json`` (with the rendered SkyRL overrides) and ``out_dir/metrics.jsonl``.

    Args:
        arm: an arm of the experiment (:func:`isoexec.rl.arms.arms`).
        engine_config: the experiment as the engine sees it (default ``config``); differs only in
            tests of the handshake.

    Returns:
        The metrics rows.

    Raises:
        ValueError: ``arm`` is not an arm of the experiment.
        isoexec.contract.ContractMismatch, isoexec.engines.weight_sync.WeightSyncError: see :meth:`Session.run`.
    """
    the_arm = find_arm(config, arm)
    with Session(config, the_arm.mode, threads) as session:
        return session.run(config, the_arm, seed, init_dir, Path(out_dir), config.rl.steps if steps is None else steps,
                           command, engine_config)


def run_paired(config: ExperimentConfig, init_dir: str | Path, rl_dir: str | Path, steps: int | None = None,
               command: str | None = None, threads: int = 1) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Every (arm, seed) of the experiment in :func:`isoexec.rl.arms.schedule`'s order, in this process.

    ``rl.interleave``: ``step``: each seed's arms step in turns (:meth:`Session.run_seed_in_turns`), each on a
    stack of its own kept across seeds (one engine set and worker group per arm alive at once); ``run``:
    each seed's arms run one after the other, all on one stack (a run whose trainer world size differs
    from the session's starts a new session). Each run writes
    ``rl_dir/<arm>/seed<k>/{metrics.jsonl,provenance.json}``.

    Returns:
        ``(arm, seed) -> metrics rows``.
    """
    steps = config.rl.steps if steps is None else steps
    rl_dir = Path(rl_dir)
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    if config.interleave == "step":
        per_seed = seed_rounds(config)
        with Session(config, [a.mode for a in per_seed[0][1]], threads) as session:
            for seed, seed_arms in per_seed:
                for name, r in session.run_seed_in_turns(config, seed_arms, seed, init_dir, rl_dir, steps, command).items():
                    rows[(name, seed)] = r
        return rows
    session: Session | None = None
    try:
        for arm, seed in schedule(config):
            if session is None or not session.fits(config, arm.mode):
                if session is not None:
                    session.close()
                session = Session(config, arm.mode, threads)
            rows[(arm.name, seed)] = session.run(config, arm, seed, init_dir, rl_dir / arm.name / f"seed{seed}",
                                                 steps, command)
    finally:
        if session is not None:
            session.close()
    return rows
