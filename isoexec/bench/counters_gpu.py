"""Hardware counters of the kernels issue 37 is about, read by Nsight Compute: launches each kernel once between
``cudaProfilerStart`` / ``cudaProfilerStop`` (after a warm-up launch that compiles it), for ``ncu
--profile-from-start off`` to profile (``workflow/scripts/gpu_counters.sh``):

- the leaf GEMM at h200-rlstep's ``gdn.out_proj`` trainer shape (10240 x 4096 @ 4096 x 2048, G = 8, leaves of 512):
  the configured launch, the Gluon program (``gluon_pipelined`` 128x128x64, 8 warps, 4 stages, two leaves per
  program, the top two levels in ``tree_combine`` or in the kernel) and cuBLAS ``F.linear``; the same at h200's
  ``attn.out_proj`` (10240 x 1024 @ 1024 x 1024, leaves of 128);
- CPR's forward at the Qwen3.5-35B-A3B GDN layer (1 x 8192, 32 heads, dims 128): ``_chunk_prep``, ``_state_chain``,
  ``_scan``.

Each launch runs in an NVTX range named after it (``ncu --print-nvtx-rename kernel``).
``python -m isoexec.bench.counters_gpu --summary counters_nvtx.csv[.gz]`` (pandas, no GPU) prints the metrics that
issue 37's READMEs quote, one row per kernel launch, as CSV (:func:`summary`).

Raises:
    ValueError: the config does not load or is not a CUDA experiment (:func:`isoexec.bench.gpu.gpu_configs`).
"""

from __future__ import annotations

import re
import sys


def launches(cfg_rl, cfg_h200) -> list[tuple[str, object]]:
    """(name, callable) of every launch to profile; each callable runs one kernel launch sequence."""
    import torch
    import torch.nn.functional as F

    from isoexec.bench.cpr_gpu import gdn_inputs
    from isoexec.config import LeafKBucket
    from isoexec.kernels.gdn import triton as t_gdn
    from isoexec.kernels.gemm import triton as t_gemm

    out = []
    for tag, cfg, (M, K, N) in (("rlstep gdn.out_proj", cfg_rl, (10240, 4096, 2048)),
                                ("h200 attn.out_proj", cfg_h200, (10240, 1024, 1024))):
        tc, G = cfg.kernels.triton, cfg.kernels.leaves
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        ref = t_gemm.linear_leaves(x, w, tc, G, split=False)
        out.append((f"{tag} configured", lambda x=x, w=w, tc=tc, G=G: t_gemm.linear_leaves(x, w, tc, G, split=False)))
        for top in ("combine", "in_kernel"):
            every = LeafKBucket(max_leaf_k=1 << 20, loop="gluon_pipelined", tiles=(128, 128, 64, 8, 4),
                                program_leaves=2, top=top, load="tma")
            gl = tc.model_copy(update={"pik_bfloat16_by_leaf_k": (every,)})
            if not torch.equal(ref, t_gemm.linear_leaves(x, w, gl, G, split=False)):
                raise RuntimeError(f"{tag}: the Gluon program's output (top {top}) differs from the configured "
                                   "launch's")
            out.append((f"{tag} gluon 128x128x64 8w4s lpp2 top {top}",
                        lambda x=x, w=w, gl=gl, G=G: t_gemm.linear_leaves(x, w, gl, G, split=False)))
        out.append((f"{tag} cublas", lambda x=x, w=w: F.linear(x, w)))
    C, tc = cfg_rl.kernels.chunk_size, cfg_rl.kernels.triton
    q, k, v, g, b = gdn_inputs(8192, 32)
    out.append(("cpr forward 1x8192 h32", lambda: t_gdn.cpr_gdn(q, k, v, g, b, [8192], [None], C, tc, keep_state=False)))
    return out


SUMMARY_METRICS = (
    ("Duration", "duration"), ("Compute (SM) Throughput", "sm_throughput_pct"),
    ("L2 Cache Throughput", "l2_throughput_pct"), ("DRAM Throughput", "dram_throughput_pct"),
    ("Registers Per Thread", "registers"), ("Local Memory Spilling Requests", "spill_requests"),
    ("Block Size", "block_threads"), ("Grid Size", "grid_blocks"), ("Waves Per SM", "waves_per_sm"),
    ("Achieved Occupancy", "achieved_occupancy_pct"), ("Issue Slots Busy", "issue_slots_busy_pct"),
    ("Eligible Warps Per Scheduler", "eligible_warps_per_scheduler"),
    ("Warp Cycles Per Issued Instruction", "warp_cycles_per_issued_instruction"))


# ncu's Duration units (2025 prints ns / us / ms, older releases nsecond / usecond / msecond), in microseconds
DURATION_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
               "second": 1e6}


def summary(path: str) -> list[dict]:
    """One row per kernel launch of an ``ncu --csv --page details --print-nvtx-rename kernel`` export (plain or
    gzipped): ``launch`` (NVTX range / kernel name), the metrics of :data:`SUMMARY_METRICS` as floats, ``duration_us``
    in microseconds whatever unit ncu printed, and ``bottleneck`` (ncu's SOLBottleneck rule, first sentence).

    Raises:
        ValueError: the file lacks the export's columns (``ID``, ``Kernel Name``, ``Metric Name``, ``Metric Value``),
            or a Duration in a unit not in :data:`DURATION_US`.
    """
    import pandas as pd

    d = pd.read_csv(path)
    need = {"ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value", "Rule Name", "Rule Description"}
    if not need <= set(d.columns):
        raise ValueError(f"{path}: not an ncu details export (columns {sorted(need - set(d.columns))} missing)")
    rows = []
    for (lid, name), g in d.groupby(["ID", "Kernel Name"], sort=True):
        r = {"launch": name}
        for metric, col in SUMMARY_METRICS:
            m = g[g["Metric Name"] == metric]
            if m.empty:
                continue
            v = float(str(m["Metric Value"].iloc[0]).replace(",", ""))
            if metric == "Duration":
                unit = str(m["Metric Unit"].iloc[0])
                if unit not in DURATION_US:
                    raise ValueError(f"{path}: launch {name}: Duration in '{unit}'; allowed: {', '.join(DURATION_US)}")
                col, v = "duration_us", v * DURATION_US[unit]
            r[col] = v
        sol = g[g["Rule Name"] == "SOLBottleneck"]["Rule Description"].dropna()
        r["bottleneck"] = re.split(r"\.\s|:\s", sol.iloc[0])[0] if not sol.empty else ""
        rows.append(r)
    return rows


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summary", metavar="CSV", help="summarise an ncu export instead of launching the kernels")
    a = p.parse_args(argv)
    if a.summary:
        import pandas as pd

        print(pd.DataFrame(summary(a.summary)).to_csv(index=False), end="")
        return 0
    import torch

    from isoexec.bench.gpu import gpu_configs

    cfg_rl, _ = gpu_configs("experiments/h200-rlstep.yaml")
    cfg_h200, _ = gpu_configs("experiments/h200.yaml")
    todo = launches(cfg_rl, cfg_h200)
    for _, fn in todo:  # compile and warm every launch outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in todo:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("counters_gpu: profiled " + "; ".join(n for n, _ in todo), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
