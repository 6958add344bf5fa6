"""pik on several GPUs over NCCL: the row-parallel leaf GEMM bitwise across TP, the native
row-parallel control, and their times at the model's row-parallel shapes.

Run on a node with two (or more) GPUs, one process per GPU::

    torchrun --nproc_per_node 2 -m isoexec.bench.pik_gpu --config experiments/h200.yaml \\
        --extra-config experiments/h200-rlstep.yaml --out results/h200x2/pik.csv

Per shape (``attn.out_proj``, ``gdn.out_proj``, shared-expert ``down_proj``; trainer rows and decode
rows) and dtype it writes one CSV row with:

* ``tp2_equal_tp1``: :func:`~isoexec.kernels.collectives.triton.pik_row_parallel_linear` over the
  process group equals :func:`~isoexec.kernels.gemm.triton.linear_leaves` on the full tensors
  (``torch.equal`` on every rank); ``sp_equal_tp1``: the sequence-parallel (reduce-scatter) path equals
  the same rows; ``tp4_equal_tp1`` / ``tp8_equal_tp1``: four and eight K shards reduced on one GPU by
  the same kernels (NCCL only moves bytes, so this is the arithmetic of TP 4 and 8);
  ``launches_equal``: the one-leaf-per-program launch equals the in-register tree.
* ``native_tp2_differs`` / ``native_max_abs_diff``: cuBLAS on the shard + NCCL ``all_reduce`` against
  cuBLAS on the full tensors.
* times (bf16): ``pik_tp2_ms`` (reduce-scatter path) and ``pik_allgather_ms`` vs ``native_tp2_ms``
  (the max over ranks of the per-rank median of CUDA event times, after a barrier, launches included),
  the same replayed from CUDA graphs (``*_graph_ms``: GPU time, as an engine that captures its decode
  step sees it), and ``pik_tp1_ms`` vs ``cublas_tp1_ms`` on one GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from isoexec.bench.timing_gpu import capture_graph


def _shapes(model, tag: str) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of the row-parallel GEMMs of ``model`` (a ModelSection), trainer and decode rows."""
    from isoexec.bench.megatron_cpu import row_parallel_shapes

    return [(f"{tag} {name}", m, k, n) for name, m, k, n in row_parallel_shapes(model, 10240, 256)]


def _time(fn, reps: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    med = torch.tensor([statistics.median(ts)], device="cuda")
    if dist.is_initialized():
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def _time_graph(fn, calls: int = 10) -> float:
    """Per-call milliseconds of ``calls`` calls of ``fn`` replayed from one CUDA graph (NCCL included);
    NaN when the capture fails."""
    try:
        return _time(capture_graph([fn], calls).replay, reps=10, warmup=2) / calls
    except Exception as e:  # report, do not fail the table
        print(f"graph capture failed: {type(e).__name__}: {e}", flush=True)
        return float("nan")


def run(configs: list[str], out: str) -> list[dict]:
    from isoexec.config import load_config
    from isoexec.io import write_csv
    from isoexec.kernels.collectives.triton import native_row_parallel_linear, pik_row_parallel_linear
    from isoexec.kernels.gemm.triton import linear_leaves, linear_leaves_partial, tree_combine

    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    cfgs = [load_config(c) for c in configs]
    tc, G = cfgs[0].kernels.triton, cfgs[0].kernels.leaves
    shapes = [s for c in cfgs for s in _shapes(c.model, c.name)]
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, M, K, N in shapes:
            gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{name}{M}".encode()))  # same data on every rank
            x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
            w = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen) * K ** -0.5
            s = K // tp
            xs, ws = x[:, rank * s:(rank + 1) * s].contiguous(), w[:, rank * s:(rank + 1) * s].contiguous()
            full = linear_leaves(x, w, tc, G)
            r = {"shape": name, "M": M, "K": K, "N": N, "dtype": str(dtype).replace("torch.", ""), "tp": tp, "leaves": G}
            pik = pik_row_parallel_linear(xs, ws, tc, G)
            r["tp2_equal_tp1"] = bool(torch.equal(pik, full))
            r["allgather_equal_tp1"] = bool(torch.equal(pik_row_parallel_linear(xs, ws, tc, G, method="all_gather"), full))
            sp = pik_row_parallel_linear(xs, ws, tc, G, sequence_parallel=True)
            r["sp_equal_tp1"] = bool(torch.equal(sp, full[rank * (M // tp):(rank + 1) * (M // tp)]))
            for v in (4, 8):
                sv = K // v
                parts = torch.stack([linear_leaves_partial(x[:, i * sv:(i + 1) * sv], w[:, i * sv:(i + 1) * sv], tc, G // v)
                                     for i in range(v)])
                r[f"tp{v}_equal_tp1"] = bool(torch.equal(tree_combine(parts, dtype), full))
            r["launches_equal"] = bool(torch.equal(linear_leaves(x, w, tc, G, split=True), linear_leaves(x, w, tc, G, split=False)))
            ref = (x.double() @ w.double().T)
            r["rel_err_vs_fp64"] = float((full.double() - ref).norm() / ref.norm())
            nat1 = F.linear(x, w)
            nat2 = native_row_parallel_linear(xs, ws)
            r["native_tp2_differs"] = not bool(torch.equal(nat1, nat2))
            r["native_max_abs_diff"] = float((nat1.float() - nat2.float()).abs().max())
            ok = torch.tensor([int(all(r[k] for k in ("tp2_equal_tp1", "allgather_equal_tp1", "sp_equal_tp1", "tp4_equal_tp1",
                                                      "tp8_equal_tp1", "launches_equal")))], device="cuda")
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            r["all_ranks_equal"] = bool(ok.item())
            if dtype == torch.bfloat16:
                r["pik_tp2_ms"] = _time(lambda: pik_row_parallel_linear(xs, ws, tc, G))
                r["pik_allgather_ms"] = _time(lambda: pik_row_parallel_linear(xs, ws, tc, G, method="all_gather"))
                r["native_tp2_ms"] = _time(lambda: native_row_parallel_linear(xs, ws))
                r["pik_over_native_tp2"] = r["pik_tp2_ms"] / r["native_tp2_ms"]
                r["pik_sp_ms"] = _time(lambda: pik_row_parallel_linear(xs, ws, tc, G, sequence_parallel=True))
                r["pik_tp1_ms"] = _time(lambda: linear_leaves(x, w, tc, G))
                r["cublas_tp1_ms"] = _time(lambda: F.linear(x, w))
                r["pik_over_cublas_tp1"] = r["pik_tp1_ms"] / r["cublas_tp1_ms"]
                parts_t = torch.empty((tp, M, N), device="cuda", dtype=torch.float32)
                r["leaf_partial_ms"] = _time(lambda: linear_leaves_partial(xs, ws, tc, G // tp, out=parts_t[rank]))
                r["all_gather_ms"] = _time(lambda: dist.all_gather_into_tensor(parts_t, parts_t[rank]))
                r["combine_ms"] = _time(lambda: tree_combine(parts_t, dtype))
            if rank == 0:
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            rows.append(r)
    if rank == 0:
        import json

        from isoexec.io import atomic_write_text
        from isoexec.provenance import provenance

        write_csv(out, rows)
        atomic_write_text(str(out).removesuffix(".csv") + ".provenance.json", json.dumps(
            {"provenance": provenance(), "configs": configs, "world_size": tp, "device_name": torch.cuda.get_device_name(0),
             "leaves": G, "kernels_triton": tc.model_dump(mode="json")}, indent=2, sort_keys=True, default=str) + "\n")
    # CUDA-graph replays last: a failed capture can poison the CUDA context, the table above is written
    for r in rows:
        if r["dtype"] != "bfloat16":
            continue
        gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{r['shape']}{r['M']}".encode()))
        x = torch.randn(r["M"], r["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(r["N"], r["K"], device="cuda", dtype=torch.bfloat16, generator=gen) * r["K"] ** -0.5
        s = r["K"] // tp
        xs, ws = x[:, rank * s:(rank + 1) * s].contiguous(), w[:, rank * s:(rank + 1) * s].contiguous()
        r["pik_tp2_graph_ms"] = _time_graph(lambda: pik_row_parallel_linear(xs, ws, tc, G))
        r["native_tp2_graph_ms"] = _time_graph(lambda: native_row_parallel_linear(xs, ws))
        r["pik_over_native_tp2_graph"] = r["pik_tp2_graph_ms"] / r["native_tp2_graph_ms"]
        if rank == 0:
            print(r["shape"], r["M"], "graph", round(r["pik_tp2_graph_ms"], 4), round(r["native_tp2_graph_ms"], 4), flush=True)
            write_csv(out, rows)
    dist.barrier()
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/h200.yaml")
    p.add_argument("--extra-config", action="append", default=[])
    p.add_argument("--out", default="results/h200x2/pik.csv")
    a = p.parse_args()
    if "RANK" not in os.environ:
        print("error: pik_gpu runs one process per GPU: start it with torchrun --nproc_per_node=<TP> "
              "-m isoexec.bench.pik_gpu (RANK is not set)", file=sys.stderr)
        raise SystemExit(2)
    run([a.config, *a.extra_config], a.out)
