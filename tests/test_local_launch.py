"""The local launcher of the Megatron trainer's ranks: gloo and fork-server children on the CPU, NCCL and
spawned children on CUDA (a fork server that imported Megatron and fla has initialised CUDA, and a forked
child cannot use it: the rollout check's first run on the H200 stopped there)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from isoexec.kernels.collectives import gloo  # noqa: E402
from isoexec.trainer.megatron import compat, launch  # noqa: E402


def _rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


@pytest.mark.parametrize("device, expected", [
    ("cpu", {"preload": launch.PRELOAD}),
    ("cuda", {"start_method": "spawn", "backend": "nccl"}),
])
def test_run_launches_nccl_in_spawned_children_on_cuda_and_gloo_through_the_fork_server_on_cpu(
        monkeypatch, device, expected):
    seen = {}
    monkeypatch.setattr(compat, "DEVICE", device)
    monkeypatch.setattr(gloo, "run_gloo", lambda fn, ws, *args, **kw: seen.update(kw) or [None] * ws)
    launch.run(_rank_and_size, 2)
    assert seen == expected


def test_run_gloo_runs_its_ranks_and_refuses_an_unknown_backend():
    assert gloo.run_gloo(_rank_and_size, 2) == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        gloo.run_gloo(_rank_and_size, 2, backend="mpi")
