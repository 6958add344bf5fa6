"""The Megatron trainer's CPU benchmarks (gloo), side by side in one run: part of ``isoexec bench`` when
the experiment's ``trainer.backend`` is ``megatron`` (any mode).

* ``megatron_step.csv`` (:func:`step_times`): seconds per trainer step (``trainer_fwd`` + backward +
  optimizer step) of the ``native`` (Megatron's stock modules) and ``isoexec`` (our kernels, pik) sets
  at TP=1 and at the experiment's layout (``trainer.tp`` / ``ep`` / ``sp``), one launch of local gloo
  processes per world size; per step the slowest rank's time, the median over repeats.
* ``pik_row_parallel.csv`` (:func:`row_parallel_times`): each row-parallel region of the model
  (``attn.out_proj``, ``gdn.out_proj``, the shared expert's ``down_proj``) at trainer rows and at decode
  rows over TP=2 gloo ranks: pik (the rank's leaf subtree, all-gather of fp32 subtree sums, the fixed
  tree; :func:`isoexec.kernels.collectives.pik.pik_row_parallel_linear`) against Megatron's row-parallel
  path (local GEMM then ``all_reduce`` SUM), with the bitwise checks beside the times (pik at TP=2 equals
  :func:`~isoexec.kernels.collectives.pik.pik_linear` on the full tensors; the native TP=2 result
  against the full GEMM as the negative control).

* ``cp_step.csv`` (:func:`cp_step_times`, when ``trainer.cp > 1``): seconds per ``trainer_score`` and per
  trainer step of the isoexec set at the experiment's context-parallel layout against the same layout at
  CP 1, on one sequence of 4k, 8k and 16k tokens, with the bitwise check of the CP rows against CP 1's
  beside the times. The two layouts have different world sizes, so they run in alternating launches of
  local gloo processes (CP 1, CP n, CP 1, ...; one intra-op thread per rank), each launch warmed up on a
  short sequence first.

The first two run the two implementations interleaved in the same processes, so the ratios compare like
with like on a shared machine. The GPU counterparts (NCCL) are :mod:`isoexec.bench.megatron_gpu` and
:mod:`isoexec.bench.pik_gpu`.
"""

from __future__ import annotations

import statistics
import time

import torch

from isoexec.trainer.megatron.config import Layout


def _step_worker(rank, world, layouts, kernel_sets, hf_config, hf_state, kernels, dtype, batch, repeats):
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
        repeats: timed steps after one warm-up step (the first step pays lazy imports and allocations).

    Returns:
        One row per (layout, kernel set): ``layout``, ``kernel_set``, ``world_size``, ``step_s`` (the
        median over repeats of the slowest rank's time), ``tokens``.

    Raises:
        ValueError / ClaimViolation from :class:`~isoexec.trainer.megatron.trainer.MegatronTrainer`.
    """
    from isoexec.trainer.megatron.launch import run

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf_config.vocab_size, (batch_size * seq_len,), generator=g)
    cu = torch.arange(0, batch_size * seq_len + 1, seq_len)
    rows = []
    for world in sorted({lay.world_size for lay in layouts.values()}):
        group = [(n, lay) for n, lay in layouts.items() if lay.world_size == world]
        ranks = run(_step_worker, world, group, tuple(kernel_sets), hf_config, hf_state, kernels, dtype, (ids, cu),
                    repeats)
        for name, _ in group:
            for k in kernel_sets:
                slowest = sorted(max(r[(name, k)][i] for r in ranks) for i in range(repeats))
                rows.append({"layout": name, "kernel_set": k, "world_size": world,
                             "step_s": slowest[len(slowest) // 2], "tokens": batch_size * seq_len})
    return rows


def _cp_worker(rank, world, layout, hf_config, hf_state, kernels, dtype, sizes, keep_rows):
    from isoexec.trainer.megatron.launch import init_parallel
    from isoexec.trainer.megatron.trainer import MegatronTrainer

    init_parallel(layout)
    t = MegatronTrainer(hf_config, layout, "isoexec", kernels, dtype, lr=0.0)  # every step keeps the weights
    t.load_hf_state_dict(hf_state)
    out = {}
    for n in (64, *sizes):  # the first (64 tokens) is the launch's warm-up, not reported
        ids = torch.randint(0, hf_config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        cu = torch.tensor([0, n])
        t0 = time.perf_counter()
        with torch.no_grad():
            rows = t.trainer_logprobs(ids, cu, grad=False)
        t1 = time.perf_counter()
        lp = t.trainer_logprobs(ids, cu, grad=True)
        (-lp[torch.arange(n - 1), ids[1:]].mean()).backward()
        t.step()
        out[n] = {"score_s": t1 - t0, "step_s": time.perf_counter() - t1, "rows": rows if keep_rows and rank == 0 else None}
    return out


def cp_step_times(hf_config, hf_state: dict[str, torch.Tensor], layout: Layout, kernels=None,
                  dtype: torch.dtype = torch.bfloat16, sizes=(4096, 8192, 16384), repeats: int = 3) -> list[dict]:
    """Seconds per ``trainer_score`` and per trainer step (``trainer_fwd`` + backward + optimizer step) of the
    isoexec set at ``layout`` (``cp > 1``) and at the same layout with ``cp = 1``, one sequence per step.
    The optimizer runs at learning rate 0 (the same work; the weights stay those loaded), so every step
    of both layouts scores the same policy.

    Args:
        hf_config, hf_state: the model. layout: the context-parallel layout. kernels: ``KernelSection``.
        dtype: parameter dtype. sizes: sequence lengths (tokens). repeats: alternating launch pairs.

    Returns:
        One row per (tokens, layout): ``tokens``, ``layout``, ``cp``, ``world_size``, ``score_s`` and
        ``step_s`` (medians over the repeats of the slowest rank), ``step_ratio_over_cp1`` and
        ``score_ratio_over_cp1``, ``step_s_min`` / ``step_s_max`` (the spread over the repeats: other work
        on the machine takes cores from the CP ranks), ``rows_equal_cp1`` (the first repeat's
        trainer_score rows ``torch.equal`` to CP 1's), ``repeats``.

    Raises:
        ValueError: ``layout.cp == 1``; ValueError / ClaimViolation from the trainer.
    """
    import dataclasses

    from isoexec.trainer.megatron.launch import run

    if layout.cp == 1:
        raise ValueError(f"cp_step_times needs a context-parallel layout, got {layout}")
    pair = {"cp1": dataclasses.replace(layout, cp=1), "cp": layout}
    times = {k: {n: {"score_s": [], "step_s": []} for n in sizes} for k in pair}
    rows = {}
    for i in range(repeats):
        for k, lay in pair.items():
            ranks = run(_cp_worker, lay.world_size, lay, hf_config, hf_state, kernels, dtype, tuple(sizes), i == 0)
            for n in sizes:
                for key in ("score_s", "step_s"):
                    times[k][n][key].append(max(r[n][key] for r in ranks))
                if i == 0:
                    rows[(k, n)] = ranks[0][n]["rows"]
    out = []
    for n in sizes:
        med = {k: {key: statistics.median(v) for key, v in times[k][n].items()} for k in pair}
        for k, lay in pair.items():
            out.append({"tokens": n, "layout": lay.name, "cp": lay.cp, "world_size": lay.world_size,
                        "score_s": med[k]["score_s"], "step_s": med[k]["step_s"],
                        "score_ratio_over_cp1": med[k]["score_s"] / med["cp1"]["score_s"],
                        "step_ratio_over_cp1": med[k]["step_s"] / med["cp1"]["step_s"],
                        "step_s_min": min(times[k][n]["step_s"]), "step_s_max": max(times[k][n]["step_s"]),
                        "rows_equal_cp1": torch.equal(rows[(k, n)], rows[("cp1", n)]), "repeats": repeats})
    return out


def row_parallel_shapes(model, trainer_rows: int, decode_rows: int) -> list[tuple[str, int, int, int]]:
    """``(region, rows, K, N)`` of the model's row-parallel GEMMs (``model``: a ModelSection), each at
    ``trainer_rows`` and at ``decode_rows`` rows."""
    h = model.hidden_size
    regions = [("attn.out_proj", model.num_attention_heads * model.head_dim),
               ("gdn.out_proj", model.linear_num_value_heads * model.linear_value_head_dim),
               ("mlp.shared_expert(down)", model.shared_expert_intermediate_size)]
    return [(name, m, k, h) for name, k in regions for m in (trainer_rows, decode_rows)]


def _row_parallel_worker(rank, world, shapes, leaves, row_tile, dtype, repeats):
    import torch.distributed as dist

    from isoexec.kernels.collectives.pik import native_row_parallel_linear, pik_linear, pik_row_parallel_linear

    out = []
    for name, m, k, n in shapes:
        g = torch.Generator().manual_seed(m * 7919 + k)
        x, w = torch.randn(m, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        lo, hi = rank * k // world, (rank + 1) * k // world
        xs, ws = x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous()
        fns = {"pik": lambda: pik_row_parallel_linear(xs, ws, None, leaves, row_tile),
               "native": lambda: native_row_parallel_linear(xs, ws)}
        results = {key: fn() for key, fn in fns.items()}  # warm-up, kept for the checks
        times = {key: [] for key in fns}
        for _ in range(repeats):
            for key, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
        out.append({"pik_equal_tp1": torch.equal(results["pik"], pik_linear(x, w, leaves, row_tile)),
                    "native_equal_tp1": torch.equal(results["native"], x @ w.t()),
                    "native_max_abs_diff": (results["native"].float() - (x @ w.t()).float()).abs().max().item(),
                    **{f"{key}_s": v for key, v in times.items()}})
    return out


def row_parallel_times(shapes: list[tuple[str, int, int, int]], leaves: int, row_tile: int,
                       dtype: torch.dtype = torch.bfloat16, tp: int = 2, repeats: int = 20) -> list[dict]:
    """pik vs native row-parallel linear over ``tp`` local gloo ranks at ``shapes`` (:func:`row_parallel_shapes`).

    Returns:
        One row per shape: ``region, rows, K, N, tp, dtype``, ``pik_ms`` and ``native_ms`` (per call,
        median over repeats of the slowest rank, a barrier before each call), ``time_ratio_pik_over_native``,
        ``pik_tp_equal_tp1`` (every rank's pik result ``torch.equal`` to :func:`pik_linear` on the full
        tensors), ``native_tp_equal_tp1`` and ``native_max_abs_diff`` (the negative control against
        ``x @ w.T`` on the full tensors).

    Raises:
        ValueError from :func:`~isoexec.kernels.collectives.pik.pik_row_parallel_linear` (``leaves``
        not divisible by ``tp``, K not divisible by ``leaves``).
    """
    from isoexec.kernels.collectives.gloo import run_gloo

    ranks = run_gloo(_row_parallel_worker, tp, shapes, leaves, row_tile, dtype, repeats)
    rows = []
    for i, (name, m, k, n) in enumerate(shapes):
        per = [r[i] for r in ranks]
        ms = {key: 1e3 * statistics.median(max(p[f"{key}_s"][j] for p in per) for j in range(repeats))
              for key in ("pik", "native")}
        rows.append({"region": name, "rows": m, "K": k, "N": n, "tp": tp, "dtype": str(dtype).removeprefix("torch."),
                     "pik_ms": ms["pik"], "native_ms": ms["native"],
                     "time_ratio_pik_over_native": ms["pik"] / ms["native"],
                     "pik_tp_equal_tp1": all(p["pik_equal_tp1"] for p in per),
                     "native_tp_equal_tp1": all(p["native_equal_tp1"] for p in per),
                     "native_max_abs_diff": max(p["native_max_abs_diff"] for p in per)})
    return rows


def bench_model(cfg):
    """``(transformers config, HF-named weights)`` of ``cfg.model`` with random weights, through the on-disk
    checkpoint names as training loads them (:func:`isoexec.model.hf.build_checkpoint`)."""
    import tempfile

    from isoexec.model.hf import build_checkpoint, read_config, read_weights

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(f"{tmp}/init", cfg.model)
        return read_config(ckpt), read_weights(ckpt)


def megatron_bench(cfg, out, repeats: int, batch: int, seq_len: int) -> dict[str, list[dict]]:
    """The tables for experiment ``cfg`` (an ``ExperimentConfig``) written under ``out``.

    The model is ``cfg.model`` with random weights (:func:`bench_model`); the steps run ``batch`` sequences
    of ``seq_len`` tokens; the row-parallel GEMMs run at ``batch * seq_len`` trainer rows and ``batch``
    decode rows. A context-parallel layout (``trainer.cp > 1``, which the native set cannot run) is timed
    by :func:`cp_step_times` instead of in ``megatron_step``.

    Returns:
        ``{"megatron_step": rows, "pik_row_parallel": rows}`` (and ``"cp_step"`` under CP) as written to
        ``<out>/<name>.csv``.
    """
    from isoexec.io import write_csv

    hf_cfg, state = bench_model(cfg)
    layout = cfg.trainer.layout()
    layouts = {lay.name: lay for lay in (Layout(), layout if layout.cp == 1 else Layout())}
    tables = {
        "megatron_step": step_times(hf_cfg, state, layouts, kernels=cfg.kernels, batch_size=batch, seq_len=seq_len,
                                    repeats=repeats),
        "pik_row_parallel": row_parallel_times(row_parallel_shapes(cfg.model, batch * seq_len, batch),
                                               cfg.kernels.leaves, cfg.kernels.row_tile,
                                               tp=max(2, cfg.trainer.tp), repeats=max(repeats, 10)),
    }
    if layout.cp > 1:
        tables["cp_step"] = cp_step_times(hf_cfg, state, layout, cfg.kernels, repeats=repeats)
    for name, rows in tables.items():
        write_csv(out / f"{name}.csv", rows)
    return tables
