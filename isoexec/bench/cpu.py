"""``isoexec bench``: throughput of the unified model with the ``isoexec`` kernel set against the
``native`` set, measured side by side in one process (interleaved repeats, medians, ratios).

Cases: ``trainer_score`` (packed forward, no autograd), ``trainer_fwd`` (forward + backward),
``engine_prefill`` (whole prompts), ``engine_decode`` (one token per sequence per step from caches).
Writes ``model_throughput.csv`` and ``model_throughput.provenance.json`` under ``runs/<exp>/bench/`` (not
committed) or the ``--out-dir`` given; the committed reference is ``results/cpu-tiny/bench/``. When the
experiment trains with Megatron (``trainer.backend: megatron``), also the trainer-step and pik
row-parallel tables of :mod:`isoexec.bench.megatron_cpu` (``megatron_step.csv``, ``pik_row_parallel.csv``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import typer


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

    def decode():
        caches = [model.new_cache() for _ in prompts]
        model.engine_step(caches, prompts, last_only=True)
        tok = [p[-1:] for p in prompts]
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


def bench_command(
    config: str = typer.Option("experiments/cpu-tiny.yaml", help="experiment YAML (its model and kernels)"),
    repeats: int = typer.Option(5, min=1, help="timed repeats per case and kernel set (the median is reported)"),
    batch: int = typer.Option(8, min=1, help="sequences per trainer / prefill batch"),
    seq_len: int = typer.Option(128, min=1, help="tokens per sequence"),
    decode_seqs: int = typer.Option(16, min=1, help="sequences decoded together"),
    decode_steps: int = typer.Option(32, min=1, help="decode steps timed"),
    threads: int = typer.Option(1, min=1, help="torch intra-op threads"),
    out_dir: str = typer.Option(None, help="folder for model_throughput.csv and its provenance (default: "
                                           "runs/<exp>/bench/, not committed; pass results/<exp>/bench to "
                                           "replace the committed reference)"),
) -> None:
    """Tokens/s of isoexec vs native kernel sets on the experiment's model; prints and writes a CSV.

    On CUDA (device: cuda in the config) the Triton kernel set is required; a config that asks for it
    where it is not available fails with a clear message.
    """
    from isoexec.config import load_config
    from isoexec.io import atomic_write_text, write_csv
    from isoexec.model.build import random_model
    from isoexec.provenance import provenance

    torch.set_num_threads(threads)
    cfg = load_config(config)
    out = Path(out_dir) if out_dir else Path("runs") / cfg.name / "bench"
    if cfg.device == "cuda":  # Triton kernel set: kernel, CPR and model benchmarks on the GPU
        if not torch.cuda.is_available():
            raise ValueError(f"{config}: device: cuda needs a visible CUDA device; torch {torch.__version__} sees none")
        from isoexec.bench.gpu import gpu_bench_command

        return gpu_bench_command(config, str(out), "bench")
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
    if "megatron" in {cfg.trainer.backend_for(m) for m in cfg.rl.modes}:
        from isoexec.bench.megatron_cpu import megatron_bench

        for name, table in megatron_bench(cfg, out, repeats, batch, seq_len).items():
            atomic_write_text(out / f"{name}.provenance.json", prov)
            for r in table:
                typer.echo(f"{name}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
