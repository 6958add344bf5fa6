"""``isoexec bench``: throughput of the unified model with the ``isoexec`` kernel set against the
``native`` set, measured side by side in one process (interleaved repeats, medians, ratios).

Cases: ``trainer_score`` (packed forward, no autograd), ``trainer_fwd`` (forward + backward),
``engine_prefill`` (whole prompts), ``engine_decode`` (one token per sequence per step from caches).
Writes ``model_throughput.csv`` and ``model_throughput.provenance.json`` under ``runs/<exp>/bench/`` (not
committed) or the ``--out-dir`` given; the committed reference is ``results/cpu-tiny/bench/``. When the
experiment trains with Megatron (``trainer.backend: megatron``), also the trainer-step and pik
row-parallel tables of :mod:`isoexec.bench.megatron_cpu` (``megatron_step.csv``, ``pik_row_parallel.csv``).

GEMM kernels: ``gemm_kernels.csv`` (:mod:`isoexec.bench.gemm_cpu`) times the isoexec fp32 chain GEMM, the
bf16 pair-chain GEMM and torch's bf16 linear at the model's shapes.

Where the time goes: ``region_times.csv`` splits ``trainer_score``, ``engine_prefill`` and
``engine_decode`` of both sets by kernel region (wall ms per case, medians over the repeats; every
region call timed, the model's glue between regions on the ``(outside regions)`` row).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import typer

from isoexec.settings import CONFIG_OPTION


def _cases(model, seqs, decode_seqs: int, decode_steps: int):
    vocab = model.config.vocab_size
    ids = torch.cat(seqs)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)

    def score():
        model.trainer_logprobs(ids, cu)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        lp = model.trainer_logprobs(ids, cu, grad=True)
        lp.gather(1, ids.roll(-1)[:, None]).sum().backward()

    def prefill():
        model.engine_step([model.new_cache() for _ in seqs], seqs, last_only=True)

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (16,), generator=gen) for _ in range(decode_seqs)]

    def decode(started=lambda: None):
        caches = [model.new_cache() for _ in prompts]
        model.engine_step(caches, prompts, last_only=True)
        tok = [p[-1:] for p in prompts]
        started()  # the timed part begins (region timers reset here)
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            model.engine_step(caches, tok, last_only=True)
        return time.perf_counter() - t0

    n = int(ids.numel())
    return {
        "trainer_score": (score, n),
        "trainer_fwd": (fwd_bwd, n),
        "engine_prefill": (prefill, n),
        "engine_decode": (decode, decode_seqs * decode_steps),
    }


def timed_kernel_set(ks):
    """A copy of kernel set ``ks`` whose every region call adds its wall time to ``totals[region]``
    (seconds); same impls, constants and fingerprint. Returns ``(kernel set, totals)``."""
    from isoexec.kernels.registry import KernelSet

    totals: dict[str, float] = defaultdict(float)

    def timed(region, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[region] += time.perf_counter() - t0
        return run

    impls = [dataclasses.replace(i, fn=timed(i.region, i.fn)) for i in ks.impls.values()]
    return KernelSet(ks.mode, ks.arch, impls, ks.section, ks.topology), totals


def region_breakdown(models: dict, cases: dict, repeats: int) -> list[dict]:
    """Per case (``trainer_score``, ``engine_prefill``, ``engine_decode``) and kernel region, the wall
    time of each set (ms, median over ``repeats`` interleaved runs after a warm-up).

    Args:
        models: kernel set name -> model. cases: name -> the :func:`_cases` of that model.

    Returns:
        rows ``case, region, native_ms, isoexec_ms, time_ratio_isoexec_over_native``; per case one
        row per region either set calls, then ``(outside regions)`` (case time minus the regions'
        sum: the model's glue) and ``(case)`` (the case time).
    """
    rows = []
    for case in ("trainer_score", "engine_prefill", "engine_decode"):
        per: dict[str, list[dict[str, float]]] = {"native": [], "isoexec": []}
        for rep in range(repeats + 1):
            for name, model in models.items():
                ks = model.kernels
                model.kernels, totals = timed_kernel_set(ks)
                try:
                    fn = cases[name][case][0]
                    if case == "engine_decode":  # times its decode loop itself, after the prefill
                        dt = fn(totals.clear)
                    else:
                        t0 = time.perf_counter()
                        fn()
                        dt = time.perf_counter() - t0
                finally:
                    model.kernels = ks
                if rep:  # rep 0 is the warm-up
                    per[name].append({**totals, "(outside regions)": dt - sum(totals.values()), "(case)": dt})
        names = sorted({r for runs in per.values() for run in runs for r in run if not r.startswith("(")})
        for region in names + ["(outside regions)", "(case)"]:
            med = {k: 1e3 * statistics.median(run.get(region, 0.0) for run in v) for k, v in per.items()}
            rows.append({"case": case, "region": region, "native_ms": med["native"], "isoexec_ms": med["isoexec"],
                         "time_ratio_isoexec_over_native": med["isoexec"] / med["native"] if med["native"] else None})
    return rows


def bench_command(
    config: Path = CONFIG_OPTION,
    repeats: int = typer.Option(5, min=1, help="timed repeats per case and kernel set (the median is reported)"),
    batch: int = typer.Option(8, min=1, help="sequences per trainer / prefill batch"),
    seq_len: int = typer.Option(128, min=1, help="tokens per sequence"),
    decode_seqs: int = typer.Option(16, min=1, help="sequences decoded together"),
    decode_steps: int = typer.Option(32, min=1, help="decode steps timed"),
    threads: int = typer.Option(1, min=1, help="torch intra-op threads"),
    out_dir: str = typer.Option(None, help="folder for model_throughput.csv and its provenance (default: "
                                           "runs/<exp>/bench/, not committed; pass results/<exp>/bench to "
                                           "replace the committed reference)"),
    what: str = typer.Option("all", help="CPU: all (every table) | cp-step (only cp_step.csv: the Megatron "
                                         "trainer at trainer.cp against CP 1 on 4k, 8k, 16k-token sequences)"),
) -> None:
    """Tokens/s of isoexec vs native kernel sets on the experiment's model; prints and writes a CSV.

    On CUDA (device: cuda in the config) the Triton kernel set is required; a config that asks for it
    where it is not available fails with a clear message.
    """
    from isoexec.config import check_device, load_config
    from isoexec.io import atomic_write_text, write_csv
    from isoexec.model.build import random_model
    from isoexec.provenance import provenance

    torch.set_num_threads(threads)
    cfg = load_config(config)
    out = Path(out_dir) if out_dir else Path("runs") / cfg.name / "bench"
    check_device(cfg, config)
    if cfg.device == "cuda":  # Triton kernel set: kernel, CPR and model benchmarks on the GPU
        from isoexec.bench.gpu import gpu_bench_command

        return gpu_bench_command(str(config), str(out), "bench")
    if what not in ("all", "cp-step"):
        raise ValueError(f"--what {what!r}; allowed on CPU: 'all', 'cp-step'")
    if what == "cp-step":
        return _cp_step(cfg, config, out, repeats)
    vocab = cfg.model.vocab_size or 256
    models = {ks: random_model(cfg.model, cfg.kernels, ks, vocab_size=vocab, device=cfg.device) for ks in ("isoexec", "native")}
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (seq_len,), generator=gen) for _ in range(batch)]
    cases = {ks: _cases(m, seqs, decode_seqs, decode_steps) for ks, m in models.items()}
    rows = []
    for case in ("trainer_score", "trainer_fwd", "engine_prefill", "engine_decode"):
        times = {"isoexec": [], "native": []}
        for ks in ("native", "isoexec"):
            cases[ks][case][0]()  # warm-up
        for _ in range(repeats):  # interleave the two sets so that machine drift hits both
            for ks in ("native", "isoexec"):
                fn, n = cases[ks][case]
                t0 = time.perf_counter()
                r = fn()
                times[ks].append(r if case == "engine_decode" else time.perf_counter() - t0)
        med = {ks: statistics.median(v) for ks, v in times.items()}
        n = cases["isoexec"][case][1]
        row = {"case": case, "tokens": n, "native_tok_s": n / med["native"], "isoexec_tok_s": n / med["isoexec"],
               "time_ratio_isoexec_over_native": med["isoexec"] / med["native"], "repeats": repeats}
        rows.append(row)
        typer.echo(f"{case:15s} native {row['native_tok_s']:9.1f} tok/s  isoexec {row['isoexec_tok_s']:9.1f} tok/s  "
                   f"time ratio {row['time_ratio_isoexec_over_native']:.2f}x")
    write_csv(out / "model_throughput.csv", rows)
    prov = json.dumps(provenance(), indent=2, sort_keys=True) + "\n"
    atomic_write_text(out / "model_throughput.provenance.json", prov)
    regions = region_breakdown(models, cases, repeats)
    write_csv(out / "region_times.csv", regions)
    atomic_write_text(out / "region_times.provenance.json", prov)
    for r in sorted((r for r in regions if r["case"] == "engine_decode"), key=lambda r: -r["isoexec_ms"])[:6]:
        typer.echo(f"engine_decode {r['region']:20s} native {r['native_ms']:8.2f} ms  isoexec {r['isoexec_ms']:8.2f} ms")
    from isoexec.bench.gemm_cpu import gemm_kernel_times

    gemms = gemm_kernel_times(cfg.model, {"trainer": batch * seq_len, "engine_decode": decode_seqs}, cfg.kernels.row_tile,
                              cfg.kernels.col_tile, repeats)
    write_csv(out / "gemm_kernels.csv", gemms)
    atomic_write_text(out / "gemm_kernels.provenance.json", prov)
    for r in gemms:
        typer.echo(f"gemm {r['case']:13s} {r['region']:24s} fp32 chain {r['fma_ms']:7.3f} ms  bf16 pairs "
                   f"{r['bf16_pairs_ms']:7.3f} ms  torch bf16 {r['torch_bf16_ms']:7.3f} ms")
    if "megatron" in {cfg.trainer.backend_for(m) for m in cfg.rl.modes}:
        from isoexec.bench.megatron_cpu import megatron_bench

        for name, table in megatron_bench(cfg, out, repeats, batch, seq_len).items():
            atomic_write_text(out / f"{name}.provenance.json", prov)
            for r in table:
                typer.echo(f"{name}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))


def _cp_step(cfg, config: str, out: Path, repeats: int) -> None:
    """``cp_step.csv`` alone (:func:`isoexec.bench.megatron_cpu.cp_step_times`) for the experiment's layout.

    Raises:
        ValueError: the experiment's isoexec mode does not train with Megatron at ``trainer.cp > 1``.
    """
    from isoexec.bench.megatron_cpu import bench_model, cp_step_times
    from isoexec.io import atomic_write_text, write_csv
    from isoexec.provenance import provenance

    if cfg.trainer.backend_for("isoexec") != "megatron" or cfg.trainer.cp == 1:
        raise ValueError(f"{config}: --what cp-step times trainer.backend megatron (isoexec mode) at trainer.cp > 1; "
                         f"this experiment has backend {cfg.trainer.backend_for('isoexec')!r}, cp={cfg.trainer.cp}")
    hf_cfg, state = bench_model(cfg)
    rows = cp_step_times(hf_cfg, state, cfg.trainer.layout(), cfg.kernels, repeats=repeats)
    write_csv(out / "cp_step.csv", rows)
    atomic_write_text(out / "cp_step.provenance.json", json.dumps(provenance(), indent=2, sort_keys=True) + "\n")
    for r in rows:
        typer.echo(f"cp_step tokens {r['tokens']:6d} {r['layout']:10s} score {r['score_s']:7.2f} s  step {r['step_s']:7.2f} s  "
                   f"step ratio over CP 1 {r['step_ratio_over_cp1']:.2f}  rows equal CP 1: {r['rows_equal_cp1']}")
