"""Render an isoexec experiment into SkyRL's configuration (dot-path overrides -> ``SkyRLTrainConfig``).

One experiment YAML (``isoexec.config.ExperimentConfig``) describes both runs of a pair; this module
writes what SkyRL needs for one half (mode, seed) as SkyRL's own overrides, the form its entry point
takes on the command line (``key.path=value``), and builds the typed config with
``SkyRLTrainConfig.from_cli_overrides``. The mapping (``rl`` section -> SkyRL):

=============================  ================================================================
isoexec                        SkyRL
=============================  ================================================================
``advantage_estimator``        ``trainer.algorithm.advantage_estimator`` (``grpo``), ``grpo_norm_by_std``
                               = ``advantage_std_norm``
``policy_loss``, clips         ``policy_loss_type`` (``regular``), ``eps_clip_low`` / ``eps_clip_high``
``loss_reduction``             ``loss_reduction`` (``token_mean``: DAPO's token-level loss)
no KL term                     ``use_kl_loss=false``, ``use_kl_in_reward=false`` (no ref model)
``dynamic_sampling``           ``dynamic_sampling.type=filter`` (DAPO: resample past all-equal groups)
``prompts_per_step``           ``trainer.train_batch_size``
``mini_batches``               ``policy_mini_batch_size = prompts_per_step / mini_batches``
``group_size``                 ``generator.n_samples_per_prompt``
``max_new_tokens``             ``generator.sampling_params.max_generate_length``
``temperature``                ``sampling_params.temperature`` (= ``algorithm.temperature``)
``lr, weight_decay, ...``      ``trainer.policy.optimizer_config`` (constant schedule, no warm-up)
``trainer.backend/tp/ep``      ``trainer.strategy`` (``megatron`` with ``megatron_config`` tp / ep, else
                               ``fsdp``), ``placement.policy_num_gpus_per_node`` = the trainer's ranks
=============================  ================================================================

The whole experiment and the mode also travel to the trainer worker in
``trainer.policy.model_config_kwargs["isoexec"]`` (:mod:`isoexec.rl.skyrl.worker`), and to the
engine actor as its constructor argument, so every IsoExec setting reaches both sides; the contract
handshake at each weight sync checks that they agree.

Two renderings: :func:`local_overrides` (a paired-run half on this machine, run by
:mod:`isoexec.rl.skyrl.driver`) and :func:`recipe_overrides` (a GPU node, SkyRL's own entry point:
the native arm with SkyRL's stock Megatron worker, the isoexec arm with isoexec's worker through
:mod:`isoexec.rl.skyrl.recipe`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from isoexec.config import ExperimentConfig
from isoexec.rl.skyrl import check_recipe_inputs, compat

compat.install()  # before the first skyrl import (compat item 1)

from isoexec.rl.skyrl.env import ENV_ID  # noqa: E402
from isoexec.rl.skyrl.worker import SETTINGS_KEY  # noqa: E402

ENTRYPOINT_KEY = "trainer.override_entrypoint"
"""SkyRL's launcher key (``skyrl/train/entrypoints/main_base.py``, ``main``): the module whose ``main()`` runs
the experiment instead of SkyRL's own; read from the command line, not a config field."""

RECIPE_ENTRYPOINT = "isoexec.rl.skyrl.recipe"
"""The entry of the recipe's isoexec arm (isoexec's policy worker, the checked sync to SkyRL's servers)."""


def algorithm_overrides(exp: ExperimentConfig, data_parallel: int = 1) -> dict[str, Any]:
    """SkyRL's advantage estimator, policy loss and batch shape for the experiment's ``rl`` section.

    Args:
        exp: the experiment.
        data_parallel: the data-parallel size SkyRL's validation derives from the placement and
            strategy; each micro-batch is one mini-batch's share of one data-parallel rank.

    Raises:
        ValueError: ``rl.prompts_per_step`` is not a multiple of ``rl.mini_batches``, or a mini-batch's
            sequences do not split over ``data_parallel``.
    """
    rl = exp.rl
    if rl.prompts_per_step % rl.mini_batches:
        raise ValueError(f"rl.prompts_per_step={rl.prompts_per_step} must be a multiple of "
                         f"rl.mini_batches={rl.mini_batches} (SkyRL splits a step by whole prompts)")
    n_seq = rl.prompts_per_step * rl.group_size
    if (n_seq // rl.mini_batches) % data_parallel:
        raise ValueError(f"a mini-batch of {n_seq // rl.mini_batches} sequences (rl.prompts_per_step x group_size / "
                         f"mini_batches) does not split over SkyRL's data-parallel size {data_parallel}")
    return {
        "trainer.algorithm.advantage_estimator": rl.advantage_estimator,
        "trainer.algorithm.grpo_norm_by_std": rl.advantage_std_norm,
        "trainer.algorithm.policy_loss_type": rl.policy_loss,
        "trainer.algorithm.eps_clip_low": rl.clip_low,
        "trainer.algorithm.eps_clip_high": rl.clip_high,
        "trainer.algorithm.loss_reduction": rl.loss_reduction,
        "trainer.algorithm.use_kl_loss": False,
        "trainer.algorithm.use_kl_in_reward": False,
        "trainer.algorithm.use_entropy_loss": False,
        "trainer.algorithm.temperature": rl.temperature,
        "trainer.algorithm.dynamic_sampling.type": "filter" if rl.dynamic_sampling else None,
        "trainer.train_batch_size": rl.prompts_per_step,
        "trainer.policy_mini_batch_size": rl.prompts_per_step // rl.mini_batches,
        "trainer.micro_train_batch_size_per_gpu": n_seq // rl.mini_batches // data_parallel,
        "trainer.micro_forward_batch_size_per_gpu": n_seq // data_parallel,
        "trainer.update_epochs_per_batch": 1,
        "trainer.policy.optimizer_config.lr": rl.lr,
        "trainer.policy.optimizer_config.weight_decay": rl.weight_decay,
        "trainer.policy.optimizer_config.max_grad_norm": rl.max_grad_norm,
        "trainer.policy.optimizer_config.num_warmup_steps": rl.warmup_updates,
        "trainer.policy.optimizer_config.scheduler": "constant_with_warmup",
        "generator.n_samples_per_prompt": rl.group_size,
        "generator.sampling_params.max_generate_length": rl.max_new_tokens,
        "generator.sampling_params.temperature": rl.temperature,
        "generator.sampling_params.top_p": 1.0,
        "generator.sampling_params.top_k": -1,
        "generator.sampling_params.min_p": 0.0,
        "generator.sampling_params.logprobs": 1,
    }


def train_prompts(exp: ExperimentConfig) -> int:
    """The number of train prompts :func:`isoexec.rl.skyrl.env.write_train_data` writes for the experiment (the
    embedded task's train split, or the rows of ``task.data_path``, counted from its parquet metadata)."""
    if exp.task.data_path is None:
        from isoexec.rl.data import embedded_rows

        return len(embedded_rows(exp.task)[0])
    import pyarrow.parquet as pq

    return pq.ParquetFile(exp.task.data_path).metadata.num_rows


def epochs_for(steps: int, prompts: int, exp: ExperimentConfig) -> int:
    """``trainer.epochs``: the passes over ``prompts`` train prompts that ``steps`` RL steps can need.

    SkyRL stops at ``trainer.max_training_steps``; its "Total steps" log line counts the batches of
    ``trainer.epochs`` passes (``skyrl/train/utils/trainer_utils.py``, ``build_dataloader``). A step takes one
    batch of ``rl.prompts_per_step`` prompts, or with dynamic sampling up to SkyRL's
    ``dynamic_sampling.max_sample_batches`` (after that SkyRL stops the run).

    Raises:
        ValueError: fewer prompts than one batch.
    """
    from skyrl.train.config.config import DynamicSamplingConfig

    batches = prompts // exp.rl.prompts_per_step  # SkyRL's train loader drops the last partial batch
    if batches < 1:
        raise ValueError(f"the train data has {prompts} prompts, fewer than rl.prompts_per_step={exp.rl.prompts_per_step}")
    per_step = DynamicSamplingConfig().max_sample_batches if exp.rl.dynamic_sampling else 1
    return -(-steps * per_step // batches)


def trainer_overrides(exp: ExperimentConfig, mode: str) -> tuple[dict[str, Any], int]:
    """``trainer.strategy`` and placement of isoexec's policy worker for ``mode``, and SkyRL's data-parallel size.

    ``megatron``: SkyRL's own strategy name with the trainer's tp / ep / cp, so that SkyRL's validation counts
    the data-parallel size as world / (tp * cp) (the worker gives every rank the whole batch); else ``fsdp``,
    SkyRL's default name. Either way the worker class is isoexec's, and it starts the trainer's world size of
    ranks.
    """
    world = exp.trainer.world_size(mode)
    out: dict[str, Any] = {"trainer.placement.policy_num_nodes": 1, "trainer.placement.policy_num_gpus_per_node": world}
    if exp.trainer.backend_for(mode) == "megatron":
        out.update({"trainer.strategy": "megatron",
                    "trainer.policy.megatron_config.tensor_model_parallel_size": exp.trainer.tp,
                    "trainer.policy.megatron_config.expert_model_parallel_size": exp.trainer.ep,
                    "trainer.policy.megatron_config.context_parallel_size": exp.trainer.cp})
        return out, world // (exp.trainer.tp * exp.trainer.cp)
    return {**out, "trainer.strategy": "fsdp"}, world


def worker_settings(exp: ExperimentConfig, mode: str, threads: int = 1) -> dict[str, Any]:
    """``trainer.policy.model_config_kwargs``: the mode and the whole experiment for isoexec's policy worker."""
    return {SETTINGS_KEY: {"mode": mode, "experiment": exp.model_dump_json(), "threads": threads}}


def local_overrides(exp: ExperimentConfig, mode: str, seed: int, init_dir: str | Path, train_data: str | Path,
                    run_dir: str | Path, steps: int, threads: int = 1) -> dict[str, Any]:
    """Overrides for one paired-run half on this machine: isoexec's worker and engine, Ray local.

    Args:
        exp: the experiment.
        mode: ``"native"`` or ``"isoexec"``.
        seed: run seed (SkyRL's data order and the engine's sampling seeds).
        init_dir: the checkpoint both sides start from.
        train_data: the parquet written by :func:`isoexec.rl.skyrl.env.write_train_data`.
        run_dir: scratch directory for SkyRL's logs / exports (not the results directory).
        steps: RL steps (``trainer.max_training_steps``).
        threads: torch threads of the trainer process.
    """
    run_dir = Path(run_dir)
    e = exp.engine
    trainer, data_parallel = trainer_overrides(exp, mode)
    return {
        "data.train_data": [str(train_data)],
        "data.val_data": [],
        "data.dataloader.num_workers": 0,
        "trainer.policy.model.path": str(init_dir),
        "trainer.policy.model_config_kwargs": worker_settings(exp, mode, threads),
        **trainer,
        "trainer.placement.colocate_all": False,
        "trainer.placement.colocate_policy_ref": False,
        "trainer.critic.model.path": None,
        "trainer.seed": seed,
        "trainer.epochs": epochs_for(steps, train_prompts(exp), exp),
        "trainer.max_training_steps": steps,
        "trainer.resume_mode": "none",
        "trainer.ckpt_interval": 0,
        "trainer.hf_save_interval": -1,
        "trainer.eval_interval": 0,
        "trainer.eval_before_train": False,
        "trainer.logger": "console",
        "trainer.project_name": "isoexec",
        "trainer.run_name": f"{exp.name}-{mode}-seed{seed}",
        "trainer.ckpt_path": str(run_dir / "ckpt"),
        "trainer.export_path": str(run_dir / "export"),
        "trainer.log_path": str(run_dir / "logs"),
        "trainer.max_prompt_length": e.max_model_len,
        "trainer.flash_attn": False,
        "trainer.gradient_checkpointing": False,
        "trainer.use_expandable_segments": False,
        "trainer.enable_ray_gpu_monitor": False,
        "trainer.print_example_interval": 0,
        "trainer.num_logger_train_samples": 0,
        **algorithm_overrides(exp, data_parallel),
        "generator.batched": True,
        "generator.max_turns": 1,
        "generator.use_conversation_multi_turn": False,
        "generator.use_cache_salt": False,
        "generator.zero_reward_on_non_stop": False,
        "generator.apply_overlong_filtering": False,
        "generator.inference_engine.backend": "vllm",
        "generator.inference_engine.num_engines": e.num_engines,
        "generator.inference_engine.tensor_parallel_size": 1,
        "generator.inference_engine.model_dtype": exp.model.dtype,
        "generator.inference_engine.enable_prefix_caching": e.enable_prefix_caching,
        "generator.inference_engine.enable_chunked_prefill": e.enable_chunked_prefill,
        "generator.inference_engine.max_num_batched_tokens": e.max_num_batched_tokens,
        "generator.inference_engine.max_num_seqs": e.max_num_seqs,
        "generator.inference_engine.enforce_eager": True,
        "generator.inference_engine.enable_ray_prometheus_stats": False,
        "environment.env_class": ENV_ID,
        "environment.skyrl_gym.max_env_workers": 0,
    }


def build(overrides: dict[str, Any]):
    """SkyRL's typed config from dot-path overrides, validated by SkyRL's own ``validate_cfg``.

    Raises:
        ValueError / AssertionError: SkyRL refuses the configuration (its message).
    """
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg

    cfg = SkyRLTrainConfig.from_cli_overrides({k: v for k, v in overrides.items() if k != ENTRYPOINT_KEY})
    validate_cfg(cfg)
    return cfg


def recipe_overrides(exp: ExperimentConfig, mode: str) -> dict[str, Any]:
    """Overrides for SkyRL's own entry point on a GPU node (``experiments/*`` with a ``skyrl`` section).

    Both arms generate on SkyRL's vLLM servers and train with Megatron:

    - ``native``: SkyRL's stock Megatron policy worker (``trainer.strategy: megatron``, the ``skyrl``
      section's ``megatron_tp`` / ``megatron_ep`` on ``num_gpus``), vLLM's own model on
      ``inference_engines`` x ``inference_tp`` GPUs, logprobs of the sampled distribution;
    - ``isoexec``: isoexec's policy worker through :data:`RECIPE_ENTRYPOINT` (SkyRL's
      :data:`ENTRYPOINT_KEY`), the Megatron trainer of the ``trainer`` section (its layout checked against
      the isoexec kernel set's proven topology when the experiment loaded) on its world size of GPUs; one
      vLLM server per trainer GPU at TP 1 (the unified model is not sharded inside vLLM) building the
      isoexec architecture (``vllm.general_plugins`` entry point ``isoexec``, registered in every vLLM
      process) with the kernel section, raw-logit logprobs, the per-request sampling guard and the
      token-id renderer, exactly as :class:`isoexec.engines.vllm_engine.RolloutEngine` builds an in-process
      engine, and the worker extension whose weight update is the plugin's checked path
      (:mod:`isoexec.rl.skyrl.servers`).

    Raises:
        ValueError: the experiment has no ``skyrl`` section, ``mode`` is not native / isoexec, or the isoexec
            arm's trainer is not Megatron or needs more GPUs than ``skyrl.num_gpus``.
    """
    from isoexec.engines.requests import GUARD, RENDERER_MODE
    from isoexec.engines.vllm_plugin import ARCH, DEFAULT_FACTORY, REQUIRED_LOGPROBS_MODE
    from isoexec.rl.skyrl.servers import SERVER_EXTENSION

    check_recipe_inputs(exp, mode)
    s, e = exp.skyrl, exp.engine
    if mode == "native":
        arm: dict[str, Any] = {
            "trainer.strategy": "megatron",
            "trainer.policy.megatron_config.tensor_model_parallel_size": s.megatron_tp,
            "trainer.policy.megatron_config.expert_model_parallel_size": s.megatron_ep,
            "trainer.placement.policy_num_nodes": 1,
            "trainer.placement.policy_num_gpus_per_node": s.num_gpus,
            "generator.inference_engine.num_engines": s.inference_engines,
            "generator.inference_engine.tensor_parallel_size": s.inference_tp,
            "generator.inference_engine.engine_init_kwargs": {"logprobs_mode": "processed_logprobs",
                                                              **compat.server_engine_kwargs(exp.device)},
        }
    else:
        if exp.trainer.backend_for(mode) != "megatron":
            raise ValueError(f"the recipe's isoexec arm trains with isoexec's Megatron trainer; trainer.backend is "
                             f"{exp.trainer.backend_for(mode)!r} for isoexec: set it to megatron with trainer.tp / ep")
        trainer, _ = trainer_overrides(exp, mode)
        world = exp.trainer.world_size(mode)
        if world > s.num_gpus:
            raise ValueError(f"the isoexec trainer (tp={exp.trainer.tp}, ep={exp.trainer.ep}) needs {world} GPUs, "
                             f"skyrl.num_gpus={s.num_gpus}")
        arm = {
            ENTRYPOINT_KEY: RECIPE_ENTRYPOINT,
            **trainer,
            # else SkyRL exports NVTE_FUSED_ATTN=0 to its workers (prepare_runtime_environment), which megatron-core's
            # attention backend "auto" refuses at model build; isoexec's trainer picks its own attention
            "trainer.flash_attn": False,
            "trainer.policy.model_config_kwargs": worker_settings(exp, mode),
            "generator.inference_engine.num_engines": world,
            "generator.inference_engine.tensor_parallel_size": 1,
            # a TP 1 server needs no Ray workers; vLLM's CPU platform refuses Ray's executor
            "generator.inference_engine.distributed_executor_backend": "mp",
            "generator.inference_engine.enforce_eager": True,
            "generator.inference_engine.engine_init_kwargs": {
                "logprobs_mode": REQUIRED_LOGPROBS_MODE,
                "logits_processors": [GUARD],
                "tokenizer_mode": RENDERER_MODE,
                "worker_extension_cls": SERVER_EXTENSION,
                # SkyRL sets vLLM's weight-transfer engine for its own sync, which the plugin refuses (weights
                # would change outside the checked path); the isoexec arm syncs through SERVER_EXTENSION only
                "weight_transfer_config": None,
                **compat.server_engine_kwargs(exp.device),
                "hf_overrides": {"architectures": [ARCH], "isoexec_model_factory": DEFAULT_FACTORY,
                                 "isoexec_kernels": exp.kernels.model_dump(mode="json"),
                                 "isoexec_decode_graphs": exp.engine.isoexec_cuda_graphs}},
        }
    n_seq = exp.rl.prompts_per_step * exp.rl.group_size
    return {
        "data.train_data": [s.train_data],
        "data.val_data": [],
        "trainer.policy.model.path": s.model_path,
        "trainer.placement.colocate_all": s.colocate,
        "trainer.critic.model.path": None,
        "trainer.epochs": 1_000,
        "trainer.max_training_steps": exp.rl.steps,
        "trainer.seed": exp.rl.seeds[0],
        "trainer.resume_mode": "none",
        "trainer.ckpt_interval": 0,
        "trainer.eval_interval": 0,
        "trainer.eval_before_train": False,
        "trainer.logger": "console",
        "trainer.project_name": "isoexec",
        "trainer.run_name": f"{exp.name}-{mode}",
        "trainer.max_prompt_length": s.max_prompt_length,
        **algorithm_overrides(exp),
        "trainer.micro_train_batch_size_per_gpu": s.micro_batch_size,
        "trainer.micro_forward_batch_size_per_gpu": s.micro_batch_size,
        "generator.batched": False,
        "generator.max_turns": 1,
        "generator.use_cache_salt": False,
        "generator.inference_engine.backend": "vllm",
        "generator.inference_engine.model_dtype": exp.model.dtype,
        "generator.inference_engine.enable_prefix_caching": e.enable_prefix_caching,
        "generator.inference_engine.enable_chunked_prefill": e.enable_chunked_prefill,
        "generator.inference_engine.max_num_batched_tokens": e.max_num_batched_tokens,
        "generator.inference_engine.max_num_seqs": max(e.max_num_seqs, n_seq),
        "generator.inference_engine.gpu_memory_utilization": s.gpu_memory_utilization,
        "environment.env_class": s.env_class,
        **arm,
    }


RECIPE_ENV = {"SKYRL_PYTHONPATH_EXPORT": "1"}
"""Environment of a recipe launch: SkyRL then forwards PYTHONPATH to its Ray workers (its
``prepare_runtime_environment``), so isoexec, and with it the vLLM plugin's module, is importable in
SkyRL's vLLM server processes; vLLM loads the plugin there through the ``vllm.general_plugins``
entry point of the installed isoexec (or, with isoexec on PYTHONPATH only, of the distribution record
:mod:`isoexec.engines.plugin_record` writes). Below Python 3.12 the launch adds
:func:`isoexec.rl.skyrl.compat.launch_env` (compat item 1 in every process)."""


def launch_command(overrides: dict[str, Any], python: str = "python") -> list[str]:
    """SkyRL's entry point with the overrides as ``key=value`` arguments (its CLI form); the
    :data:`ENTRYPOINT_KEY` first and bare, as SkyRL's ``main`` reads it (the value after ``=`` is the module).
    """
    from skyrl.train.config.config import overrides_dict_to_dotlist

    rest = {k: v for k, v in overrides.items() if k != ENTRYPOINT_KEY}
    entry = [f"{ENTRYPOINT_KEY}={overrides[ENTRYPOINT_KEY]}"] if ENTRYPOINT_KEY in overrides else []
    return [python, "-m", "skyrl.train.entrypoints.main_base", *entry, *overrides_dict_to_dotlist(rest)]
