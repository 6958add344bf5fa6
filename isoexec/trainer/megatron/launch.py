"""Process groups of the Megatron trainer, and a launcher of local CPU processes (gloo).

:func:`init_parallel` is the one entry point a rank calls (from a test, a benchmark, a ``torchrun``
process or a Ray actor): it joins ``torch.distributed`` if the caller has not (NCCL with one GPU per
process where CUDA exists, :data:`~isoexec.trainer.megatron.compat.DEVICE`; else gloo), then creates
Megatron's model-parallel groups for a :class:`~isoexec.trainer.megatron.config.Layout`. Nothing else is global: the groups live in
``torch.distributed`` and Megatron's ``parallel_state``, which :func:`shutdown` tears down.

:func:`run` starts ``world_size`` local processes in one group with
:func:`isoexec.kernels.collectives.gloo.run_gloo`: on the CPU gloo and fork server children (a plain fork after
OpenMP started deadlocks), with Megatron pre-imported in the fork server when it is started by this call; on
CUDA NCCL and spawned children.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from isoexec.trainer.megatron import compat
from isoexec.trainer.megatron.config import Layout

#: Modules the fork server imports once, so that each rank process starts with Megatron loaded.
PRELOAD = ("isoexec.trainer.megatron.spec", "isoexec.trainer.megatron.trainer")


def init_parallel(layout: Layout, rank: int | None = None, world_size: int | None = None,
                  init_method: str | None = None, backend: str | None = None) -> dict[str, object]:
    """Join the process group (if not yet) and create Megatron's groups for ``layout``.

    Args:
        layout: the parallel layout (checked).
        rank, world_size, init_method: passed to ``torch.distributed.init_process_group`` when the
            process has not joined a group yet (e.g. ``"tcp://host:port"``; None: torchrun's
            environment); ignored otherwise.
        backend: ``"gloo"`` or ``"nccl"``; None: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU. On CUDA the
            process takes GPU ``LOCAL_RANK`` (torchrun's variable; default the global rank modulo the
            GPU count) before joining.

    Returns:
        ``{"tp", "ep", "etp", "dp", "cp"}``: the process groups of this rank (Megatron's).

    Raises:
        ValueError: the world size differs from ``layout.world_size``, or the layout is invalid.
    """
    layout.check()
    compat.apply()
    if compat.DEVICE == "cuda":
        local = os.environ.get("LOCAL_RANK")
        r = rank if rank is not None else int(os.environ.get("RANK", "0"))
        torch.cuda.set_device(int(local) if local is not None else r % torch.cuda.device_count())
    if not dist.is_initialized():
        backend = backend or ("nccl" if compat.DEVICE == "cuda" else "gloo")
        dist.init_process_group(backend, init_method=init_method,
                                rank=-1 if rank is None else rank,
                                world_size=-1 if world_size is None else world_size)
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"world size {dist.get_world_size()} != layout world size {layout.world_size} ({layout})")
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        context_parallel_size=layout.cp,
        create_gloo_process_groups=False,
    )
    compat.init_rng_tracker()
    return groups()


def groups() -> dict[str, object]:
    """This rank's Megatron process groups: ``tp``, ``ep`` (experts), ``etp`` (expert TP), ``dp``, ``cp``
    (context parallel)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_group(), "ep": ps.get_expert_model_parallel_group(),
            "etp": ps.get_expert_tensor_parallel_group(), "dp": ps.get_data_parallel_group(),
            "cp": ps.get_context_parallel_group()}


def shutdown() -> None:
    """Destroy Megatron's groups (the ``torch.distributed`` group stays, owned by whoever created it)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def run(fn, world_size: int, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; the per-rank results.

    ``fn`` must be importable (module level) and return something ``torch.save`` stores; it calls
    :func:`init_parallel` itself (once per layout it builds; layouts of one world size can follow each
    other in one launch), so the same function runs under any launcher. One intra-op thread per process.
    On the CPU: gloo, fork-server children; on CUDA: NCCL, one GPU per rank, spawned children (a fork
    server with Megatron and fla imported has initialised CUDA, which a forked child cannot use).
    """
    from isoexec.kernels.collectives.gloo import run_gloo

    if compat.DEVICE == "cuda":
        return run_gloo(fn, world_size, *args, start_method="spawn", backend="nccl")
    return run_gloo(fn, world_size, *args, preload=PRELOAD)

