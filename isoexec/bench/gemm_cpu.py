"""The CPU GEMM kernels side by side at the model's shapes (``gemm_kernels.csv``, part of ``isoexec bench``):
``fma_gemm`` (one fp32 FMA chain per output: the isoexec set's GEMM for an fp32 model, and before
2026-12-03 for every model), ``bf16_pair_gemm`` (the chain in k pairs as ``VDPBF16PS`` computes it: the
isoexec set's GEMM for a bf16 model) and ``torch.nn.functional.linear`` in bf16 (the native set's GEMM,
oneDNN; not batch-invariant). Weights are packed once before timing, as an engine's are between weight
syncs; the three run interleaved in one process, medians over the repeats."""

from __future__ import annotations

import statistics
import time

import torch


def model_gemm_shapes(model) -> list[tuple[str, int, int]]:
    """(region, K, M) of the model's GEMMs (``isoexec.config.ModelSection``): ``x [N, K] @ w [K, M]``."""
    kd, vd = model.linear_num_key_heads * model.linear_key_head_dim, model.linear_num_value_heads * model.linear_value_head_dim
    h = model.hidden_size
    return [("gdn.in_proj", h, 2 * kd + 2 * vd), ("gdn.out_proj", vd, h),
            ("attn.qkv_proj (q|gate)", h, 2 * model.num_attention_heads * model.head_dim),
            ("moe.experts gate_proj", h, model.moe_intermediate_size), ("moe.experts down_proj", model.moe_intermediate_size, h),
            ("lm_head", h, model.vocab_size or 256)]


def gemm_kernel_times(model, rows: dict[str, int], row_tile: int, col_tile: int, repeats: int = 5,
                      seed: int = 0) -> list[dict]:
    """Milliseconds per call of the three kernels for every model GEMM at each row count.

    Args:
        model: the experiment's model section. rows: case name -> N (e.g. trainer and decode rows).
        row_tile, col_tile: the isoexec GEMMs' cache tiles (contract constants). repeats: timed repeats.

    Returns:
        One row per (case, region): shape, ``fma_ms``, ``bf16_pairs_ms``, ``torch_bf16_ms``, the ratios
        ``bf16_pairs_over_fma`` and ``bf16_pairs_over_torch``, and ``simd`` (whether ``VDPBF16PS`` ran).
    """
    from isoexec.kernels.gemm.fma import bf16_pair_gemm, bf16_simd, fma_gemm, pin_panels

    gen = torch.Generator().manual_seed(seed)
    out = []
    for case, n in rows.items():
        for region, k, m in model_gemm_shapes(model):
            x = torch.randn(n, k, generator=gen).bfloat16()
            w = torch.randn(k, m, generator=gen).bfloat16()
            xf, wf, wl = x.float(), w.float(), w.t().contiguous()
            pin_panels(w)  # packed once, as tile_linear's copy of an engine's weight
            pin_panels(wf)
            fns = {"fma": lambda: fma_gemm(xf, wf, row_tile, col_tile),
                   "bf16_pairs": lambda: bf16_pair_gemm(x, w, row_tile, col_tile),
                   "torch_bf16": lambda: torch.nn.functional.linear(x, wl)}
            times = {name: [] for name in fns}
            for fn in fns.values():
                fn()  # warms the caches
            for _ in range(repeats):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            med = {name: 1e3 * statistics.median(v) for name, v in times.items()}
            out.append({"case": case, "region": region, "N": n, "K": k, "M": m, "fma_ms": med["fma"],
                        "bf16_pairs_ms": med["bf16_pairs"], "torch_bf16_ms": med["torch_bf16"],
                        "bf16_pairs_over_fma": med["bf16_pairs"] / med["fma"],
                        "bf16_pairs_over_torch": med["bf16_pairs"] / med["torch_bf16"], "simd": bf16_simd()})
    return out
