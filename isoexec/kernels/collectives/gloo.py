"""Run a function on several local processes in one process group: gloo on the CPU (tests, ``isoexec
pik-check``, the CPU benchmarks of the parallel layouts), NCCL with one GPU per rank on CUDA (the rollout
check's Megatron trainer on a GPU node)."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Sequence

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_entry(rank: int, world_size: int, port: int, out_dir: str, fn, args, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_gloo(fn, world_size: int, *args, start_method: str = "forkserver", preload: Sequence[str] = (),
             backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes in one gloo group
    (127.0.0.1, a free port, one intra-op thread each) and return the per-rank results (loaded on the CPU).

    ``fn`` must be importable (module level) and return something ``torch.save`` can store. The
    default ``forkserver`` forks children from a clean server process that has pre-imported torch and
    this module once: a plain ``fork`` from a process whose OpenMP/MKL thread pools are running (any
    process that already ran torch ops, e.g. a test session) can deadlock the child, and ``spawn``
    re-imports the package in every child (seconds each on a small CPU). ``preload`` names further
    modules the fork server imports once; like the default list it takes effect only when this call
    starts the process's fork server (otherwise the children import them on first use).

    ``backend="nccl"`` (CUDA): rank r takes GPU ``r % device_count`` before joining an NCCL group. Use it with
    ``start_method="spawn"``: CUDA cannot be initialised again in a forked child, and a fork server that
    imported Megatron's or fla's modules has initialised it (fla asks for the device's capability at import).

    Raises:
        ValueError: ``backend`` is not ``"gloo"`` or ``"nccl"``.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_gloo: backend must be 'gloo' or 'nccl', got {backend!r}")
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", __name__, *preload])
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _gloo_entry, args=(world_size, _free_port(), d, fn, args, backend), nprocs=world_size, join=True,
            start_method=start_method,
        )
        return [torch.load(os.path.join(d, f"rank{r}.pt"), map_location="cpu") for r in range(world_size)]
