"""GPU gates and benchmarks of the Triton kernel set on one CUDA device.

``python -m isoexec.bench.gpu all --config experiments/h200.yaml --out-dir results/h200``
(``isoexec bench`` dispatches here when the config says ``device: cuda``) writes:

* ``gates.csv`` / ``contract.json``: the bitwise gate matrix of :mod:`isoexec.model.gates` run with
  the model on the GPU, isoexec (Triton) and native (cuBLAS / SDPA / fla) kernel sets.
* ``kernel_bench.csv``: each Triton kernel against its native counterpart at the model's shapes (median
  of ``triton.testing.do_bench``; decode-sized GEMMs from CUDA-graph replays over distinct weights), with
  the achieved fraction of the bf16 GEMM and copy ceilings measured in the same run; ``--extra-config``
  adds the GEMM and attention rows of another experiment's shapes.
* ``variants_<parts>.csv``: candidate launch constants (GEMM programs and tiles, leaf GEMM tiles and
  launches, attention tiles, CPR launches) measured side by side, each with its bitwise check.
* ``cpr_breakdown.csv``: CPR kernel time by kernel (torch.profiler).
* ``cpr_chunkwise.csv``: the chunkwise in-chunk candidate of issue 37 against today's CPR and fla (``cpr_chunkwise``).
* ``cpr_layer.csv``: the CPR Gated DeltaNet per-layer table (trainer 1x10240 forward and forward +
  backward, prefill 5x2048, decode 256 x 1) for native mixed, chunkwise everywhere, recurrent everywhere
  and CPR; ``cpr_backward.csv``: each strategy's forward + backward time and gradient error against the
  fp64 reference.
* ``cpr_qwen35.csv``: CPR and fla's chunk kernels at the Qwen3.5-35B-A3B GDN layer (1 x 8192), forward and
  forward + backward, timed by events and by CUDA-graph replay (``cpr_qwen35``).
* ``model_throughput.csv``: the unified model, isoexec vs native kernel sets, and the transformers
  model with fla kernels; ``model_before_after.csv``: the whole model per case (trainer_score, trainer
  forward + backward, engine prefill and decode, decode under CUDA graphs), native vs isoexec with the leaf
  GEMM's launch rules of issue 37's filing and of the config (``model_before_after``); ``model_profile.csv``: the
  top operators and kernels of the whole model's ``trainer_score`` and ``trainer_fwd_bwd`` per kernel set, by
  torch.profiler (``model_profile``).
* ``provenance.json``: code version, device, software, ceilings, the commands.

The tables live beside this entry, one module per measurement: :mod:`isoexec.bench.kernels_gpu`
(``kernel_bench.csv``, ``conv_pieces.csv``), :mod:`isoexec.bench.cpr_gpu` (``cpr_layer.csv``,
``cpr_backward.csv``, ``cpr_breakdown.csv``, ``cpr_chunkwise.csv``, ``cpr_qwen35.csv``), :mod:`isoexec.bench.model_gpu`
(``model_throughput.csv``, ``model_before_after.csv``, ``model_profile.csv``),
:mod:`isoexec.bench.variants_gpu` (``variants_<parts>.csv``); their timing and the ceilings in
:mod:`isoexec.bench.timing_gpu`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from isoexec.bench.cpr_gpu import cpr_backward_table, cpr_breakdown, cpr_chunkwise_table, cpr_qwen35_table, cpr_table
from isoexec.bench.kernels_gpu import conv_pieces_table, kernel_table
from isoexec.bench.model_gpu import model_before_after, model_profile, model_table
from isoexec.bench.timing_gpu import ceilings
from isoexec.bench.variants_gpu import variants


# ------------------------------------------------------------------------------------------ gates
def gpu_gates(cfg, out: Path, log=print) -> dict:
    """The gate matrix of :func:`isoexec.model.gates.run_gates` with the model on CUDA; writes gates.csv and contract.json."""
    from isoexec.model.gates import gate_matrix, write_gate_outputs

    t0 = time.time()
    results, contract = gate_matrix(cfg, log)
    write_gate_outputs(out, results, contract)
    summary = {}
    for r in results:
        s = summary.setdefault(f"{r.kernel_set}/{r.dtype}", {"equal": 0, "differ": 0})
        s["equal" if r.bitwise_equal else "differ"] += 1
    summary["seconds"] = round(time.time() - t0, 1)
    log(f"gates summary: {json.dumps(summary)}")
    return summary


# ----------------------------------------------------------------------------------------- entry
def gpu_configs(config: str, extra_configs: tuple[str, ...] = ()) -> tuple:
    """The experiment ``config`` (and ``extra_configs``) loaded and checked for this machine's GPU.

    Raises:
        FileNotFoundError: a config path that does not exist.
        ValueError: a config that does not load, whose ``device`` is not cuda, or ``device: cuda`` where torch sees no
            CUDA device.
    """
    from isoexec.config import check_device, load_config

    cfg = load_config(config)
    extra = [load_config(c) for c in extra_configs]
    if cfg.device != "cuda":
        raise ValueError(f"{config}: device: {cfg.device}; the GPU benchmarks need an experiment with device: cuda "
                         "(experiments/h200.yaml)")
    check_device(cfg, config)
    return cfg, extra


def gpu_bench_command(config: str = "experiments/h200.yaml", out_dir: str | None = None, what: str = "bench",
                      extra_configs: tuple[str, ...] = ()) -> None:
    """Run on a CUDA device; writes under ``out_dir`` (default results/<exp>).

    ``what``: ``variants`` (candidate launch constants side by side with their bitwise checks, for the
    deployment to pin in ``kernels.triton``), ``gates``, ``profile`` (CPR breakdown), ``kernels`` /
    ``cpr`` / ``model`` / ``conv`` (one benchmark table each; conv: ``conv_pieces.csv``), ``bench`` (the three), ``all`` (gates + bench).
    Every stage runs with the constants of the config it is given.

    Raises:
        ValueError: a config whose ``device`` is not cuda, or ``device: cuda`` where torch sees no CUDA device.
    """
    from isoexec.io import atomic_write_text, write_csv
    from isoexec.provenance import provenance

    cfg, extra = gpu_configs(config, extra_configs)
    out = Path(out_dir) if out_dir else cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    prov_path = out / "provenance.json"
    prov = json.loads(prov_path.read_text()) if prov_path.exists() else {}
    prov.update({"provenance": provenance(), "device_name": torch.cuda.get_device_name(0),
                 "capability": list(torch.cuda.get_device_capability(0)), "config": config})

    def log(s):
        print(s, flush=True)

    prov["kernels"] = cfg.kernels.model_dump(mode="json")
    if what == "profile":
        write_csv(out / "cpr_breakdown.csv", cpr_breakdown(cfg, log))
    if what == "variants":
        parts = tuple(os.environ.get("ISOEXEC_VARIANTS", "gemm leaf attention cpr moe").split())
        write_csv(out / f"variants_{'_'.join(parts)}.csv", variants(cfg, log, extra, parts))
    if what in ("gates", "all"):
        prov["gates"] = gpu_gates(cfg, out, log)
    tables = {"kernels": ("kernel_bench",), "cpr": ("cpr_layer", "cpr_backward"), "cpr_backward": ("cpr_backward",),
              "cpr_chunkwise": ("cpr_chunkwise",), "cpr_qwen35": ("cpr_qwen35",),
              "model_before_after": ("model_before_after",), "model_profile": ("model_profile",),
              "conv": ("conv_pieces",),
              "model": ("model_throughput",),
              "bench": ("kernel_bench", "cpr_layer", "model_throughput"), "all": ("kernel_bench", "cpr_layer", "model_throughput")}
    if what in tables:
        steps = prov.get("bench", {})
        ceil = ceilings()
        prov["ceilings"] = ceil
        log(f"ceilings: {ceil}")
        for name, fn in (("kernel_bench", lambda: kernel_table(cfg, ceil, log, extra)), ("cpr_layer", lambda: cpr_table(cfg, log)),
                         ("cpr_backward", lambda: cpr_backward_table(cfg, log)),
                         ("cpr_chunkwise", lambda: cpr_chunkwise_table(cfg, log)),
                         ("cpr_qwen35", lambda: cpr_qwen35_table(cfg, log)),
                         ("model_before_after", lambda: model_before_after(cfg, log)),
                         ("model_profile", lambda: model_profile(cfg, log)),
                         ("model_throughput", lambda: model_table(cfg, log)),
                         ("conv_pieces", lambda: conv_pieces_table(cfg, log))):
            if name not in tables[what]:
                continue
            t0 = time.time()
            try:
                rows = fn()
                write_csv(out / f"{name}.csv", rows)
                steps[name] = {"ok": True, "seconds": round(time.time() - t0, 1)}
            except Exception as e:
                traceback.print_exc()
                steps[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            log(f"{name}: {steps[name]}")
            # each table's own config and command (the stages of one job share this file; the top-level command is
            # the last stage's), written after every table: a stage cut by its time limit keeps the tables it wrote
            steps[name].update(config=config, command=prov["provenance"].get("command"))
            prov["bench"] = steps
            atomic_write_text(prov_path, json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n")
    atomic_write_text(prov_path, json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["variants", "gates", "profile", "kernels", "cpr", "cpr_backward", "cpr_chunkwise",
                                    "cpr_qwen35", "model", "model_before_after", "model_profile",
                                    "conv", "bench",
                                    "all"])
    p.add_argument("--config", default="experiments/h200.yaml")
    p.add_argument("--extra-config", action="append", default=[], help="another experiment whose shapes the GEMM and attention rows add")
    p.add_argument("--out-dir", default=None)
    a = p.parse_args()
    try:  # the input's refusal in one line; an error inside a stage keeps its traceback
        gpu_configs(a.config, tuple(a.extra_config))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    gpu_bench_command(a.config, a.out_dir, a.what, tuple(a.extra_config))
    sys.exit(0)
