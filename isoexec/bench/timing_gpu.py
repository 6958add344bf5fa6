"""Timing on one CUDA device for the GPU benchmarks: the median event-timed wall time of a call
(``triton.testing.do_bench``), its summed kernel time (torch.profiler), the time per call replayed from one
CUDA graph, and the device's measured bf16 GEMM rate and copy bandwidth. It writes no CSV of its own: the
tables of :mod:`isoexec.bench.kernels_gpu`, :mod:`isoexec.bench.cpr_gpu`, :mod:`isoexec.bench.variants_gpu` and
:mod:`isoexec.bench.pik_gpu` time with it, and the ceilings go to ``provenance.json`` and the ceiling fractions of
``kernel_bench.csv``."""

from __future__ import annotations

import torch


def bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench: CUDA events, warm-up, L2 flush)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def device_ms(fn, reps: int = 20) -> float:
    """Milliseconds of GPU kernel time per call of ``fn``: the device time of every kernel and copy it
    launches (torch.profiler), summed, over ``reps`` calls after a warm-up. Unlike :func:`bench`'s
    event-timed wall time it does not follow the host's speed, so calls that are host-bound (a list of
    per-sequence tensors packed in Python) compare by what they cost the GPU."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                   for e in prof.key_averages())
    return total_us / 1e3 / reps


def capture_graph(fns, rounds: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of the calls ``fns`` run in turn ``rounds`` times, captured after one warm-up call of each on
    a side stream (allocations and lazy initialisation done outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for f in fns:
                f()
    return g


def bench_graph(fns, rounds: int = 2) -> float:
    """Milliseconds per call of the calls ``fns`` (run in turn, ``rounds`` times) replayed from one CUDA
    graph: the GPU time of launch-bound calls, as an engine that captures its decode step sees them.
    Pass several calls on distinct weights so that repeated replays do not run from L2."""
    return bench(capture_graph(fns, rounds).replay) / (rounds * len(fns))


def ceilings() -> dict:
    """Measured bf16 GEMM rate (8192^3, random data) and device copy bandwidth (1 GiB, read + write)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    src = torch.randn(256 * 1024 * 1024, device="cuda")
    dst = torch.empty_like(src)
    ms_c = bench(lambda: dst.copy_(src))
    return {"gemm_bf16_tflops": 2 * n**3 / ms / 1e9, "copy_tb_s": 2 * src.numel() * 4 / ms_c / 1e9}
