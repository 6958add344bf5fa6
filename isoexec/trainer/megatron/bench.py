"""Timing of one Megatron trainer step (trainer_fwd + backward + optimizer step) per layout and kernel set.

:func:`step_times` launches one group of local gloo processes per world size and times, on every
rank, ``repeats`` steps after one warm-up step (the first step pays lazy imports and allocations);
the reported time of a step is the slowest rank's. Side by side in one run, so the ratios compare
like with like on a shared machine.
"""

from __future__ import annotations

import time

import torch

from isoexec.trainer.megatron.config import Layout


def _worker(rank, world, layouts, kernel_sets, hf_config, hf_state, kernels, dtype, batch, repeats):
    from isoexec.trainer.megatron.launch import init_parallel
    from isoexec.trainer.megatron.trainer import MegatronTrainer

    ids, cu = batch
    out = {}
    for name, layout in layouts:
        init_parallel(layout)
        trainers = {}
        for k in kernel_sets:
            trainers[k] = MegatronTrainer(hf_config, layout, k, kernels, dtype)
            trainers[k].load_hf_state_dict(hf_state)
        times = {k: [] for k in kernel_sets}
        for _ in range(repeats + 1):
            for k, t in trainers.items():
                t0 = time.perf_counter()
                lp = t.trainer_logprobs(ids, cu, grad=True)
                (-lp[torch.arange(len(ids) - 1), ids[1:]].mean()).backward()
                t.step()
                times[k].append(time.perf_counter() - t0)
        out.update({(name, k): v[1:] for k, v in times.items()})
    return out


def step_times(hf_config, hf_state: dict[str, torch.Tensor], layouts: dict[str, Layout],
               kernel_sets=("native", "isoexec"), kernels=None, dtype: torch.dtype = torch.bfloat16,
               batch_size: int = 8, seq_len: int = 64, repeats: int = 3, seed: int = 0) -> list[dict]:
    """Seconds per trainer step for every (layout, kernel set).

    Args:
        hf_config, hf_state: the model (transformers config and HF-named weights).
        layouts: name -> :class:`Layout`. kernel_sets: the sets to time. kernels: ``KernelSection``.
        dtype: parameter dtype. batch_size, seq_len: the packed batch (random tokens, equal lengths).
        repeats: timed steps after one warm-up step.

    Returns:
        One row per (layout, kernel set): ``layout``, ``kernel_set``, ``world_size``, ``step_s`` (the
        median over repeats of the slowest rank's time), ``tokens``.

    Raises:
        ValueError / ClaimViolation from :class:`~isoexec.trainer.megatron.trainer.MegatronTrainer`.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf_config.vocab_size, (batch_size * seq_len,), generator=g)
    cu = torch.arange(0, batch_size * seq_len + 1, seq_len)
    from isoexec.trainer.megatron.launch import run

    rows = []
    for world in sorted({lay.world_size for lay in layouts.values()}):
        group = [(n, lay) for n, lay in layouts.items() if lay.world_size == world]
        ranks = run(_worker, world, group, tuple(kernel_sets), hf_config, hf_state, kernels, dtype, (ids, cu), repeats)
        for name, _ in group:
            for k in kernel_sets:
                slowest = sorted(max(r[(name, k)][i] for r in ranks) for i in range(repeats))
                rows.append({"layout": name, "kernel_set": k, "world_size": world,
                             "step_s": slowest[len(slowest) // 2], "tokens": batch_size * seq_len})
    return rows
