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
* ``cpr_layer.csv``: the CPR Gated DeltaNet per-layer table (trainer 1x10240 forward and forward +
  backward, prefill 5x2048, decode 256 x 1) for native mixed, chunkwise everywhere, recurrent everywhere
  and CPR; ``cpr_backward.csv``: each strategy's forward + backward time and gradient error against the
  fp64 reference.
* ``model_throughput.csv``: the unified model, isoexec vs native kernel sets, and the transformers
  model with fla kernels.
* ``provenance.json``: code version, device, software, ceilings, the commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch


def _bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench: CUDA events, warm-up, L2 flush)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _device_ms(fn, reps: int = 20) -> float:
    """Milliseconds of GPU kernel time per call of ``fn``: the device time of every kernel and copy it
    launches (torch.profiler), summed, over ``reps`` calls after a warm-up. Unlike :func:`_bench`'s
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


def _bench_graph(fns, rounds: int = 2) -> float:
    """Milliseconds per call of the calls ``fns`` (run in turn, ``rounds`` times) replayed from one CUDA
    graph: the GPU time of launch-bound calls, as an engine that captures its decode step sees them.
    Pass several calls on distinct weights so that repeated replays do not run from L2."""
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
    return _bench(g.replay) / (rounds * len(fns))


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


# -------------------------------------------------------------------------------------- ceilings
def ceilings() -> dict:
    """Measured bf16 GEMM rate (8192^3, random data) and device copy bandwidth (1 GiB, read + write)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _bench(lambda: a @ b)
    src = torch.randn(256 * 1024 * 1024, device="cuda")
    dst = torch.empty_like(src)
    ms_c = _bench(lambda: dst.copy_(src))
    return {"gemm_bf16_tflops": 2 * n**3 / ms / 1e9, "copy_tb_s": 2 * src.numel() * 4 / ms_c / 1e9}


# ------------------------------------------------------------------------------------ kernel table
def kernel_table(cfg, ceil: dict, log=print, extra_models=()) -> list[dict]:
    """Each Triton kernel vs its native counterpart at the model's shapes (bf16 boundary); the GEMMs and
    attention prefill also at the shapes of ``extra_models`` (experiment configs, their own attention tiles)."""
    import torch.nn.functional as F

    from isoexec.kernels import build_kernel_set
    from isoexec.kernels.attention import triton as t_attn
    from isoexec.kernels.attention.native import native_attention
    from isoexec.kernels.conv import triton as t_conv
    from isoexec.kernels.conv.native import native_causal_conv1d
    from isoexec.kernels.gemm import triton as t_gemm
    from isoexec.kernels.logprob import triton as t_logprob
    from isoexec.kernels.norm import native as n_norm, triton as t_norm

    iso, nat = build_kernel_set("isoexec", "cuda", cfg.kernels), build_kernel_set("native", "cuda", cfg.kernels)
    tc = cfg.kernels.triton
    m = cfg.model
    dev, bf = "cuda", torch.bfloat16
    N = 10240
    rows = []
    gemm_peak, bw = ceil["gemm_bf16_tflops"], ceil["copy_tb_s"]

    def add(kernel, shape, iso_fn, nat_fn, flops=0.0, bytes_=0.0, native="", note=""):
        t_iso, t_nat = _bench(iso_fn), _bench(nat_fn)
        d_iso, d_nat = _device_ms(iso_fn), _device_ms(nat_fn)
        r = {"kernel": kernel, "shape": shape, "native": native, "isoexec_ms": t_iso, "native_ms": t_nat,
             "time_ratio_isoexec_over_native": t_iso / t_nat, "isoexec_device_ms": d_iso, "native_device_ms": d_nat,
             "device_time_ratio_isoexec_over_native": d_iso / d_nat}
        if flops:
            r["isoexec_tflops"] = flops / t_iso / 1e9
            r["isoexec_frac_gemm_ceiling"] = flops / t_iso / 1e9 / gemm_peak
            r["native_frac_gemm_ceiling"] = flops / t_nat / 1e9 / gemm_peak
        if bytes_:
            r["isoexec_tb_s"] = bytes_ / t_iso / 1e9
            r["isoexec_frac_copy_ceiling"] = bytes_ / t_iso / 1e9 / bw
            r["native_frac_copy_ceiling"] = bytes_ / t_nat / 1e9 / bw
        r["note"] = note
        rows.append(r)
        log(f"{kernel:28s} {shape:32s} iso {t_iso:8.4f} ms  native {t_nat:8.4f} ms  ratio {t_iso / t_nat:5.2f}  "
            f"device ratio {d_iso / d_nat:5.2f}")

    key_dim, value_dim = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    G = cfg.kernels.leaves

    def graph_row(kernel, M, k, n_out, iso, nat):
        xw = [(torch.randn(M, k, device=dev, dtype=bf), torch.randn(n_out, k, device=dev, dtype=bf) * 0.02)
              for _ in range(8)]  # 8 distinct weights: the replays do not run from L2
        t_iso = _bench_graph([lambda a=a, b=b: iso(a, b) for a, b in xw])
        t_nat = _bench_graph([lambda a=a, b=b: nat(a, b) for a, b in xw])
        fl, by = 2 * M * n_out * k, n_out * k * 2
        rows.append({"kernel": kernel, "shape": f"{M}x{k} @ {k}x{n_out}", "native": "cublas F.linear", "isoexec_ms": t_iso,
                     "native_ms": t_nat, "time_ratio_isoexec_over_native": t_iso / t_nat, "isoexec_tflops": fl / t_iso / 1e9,
                     "isoexec_tb_s": by / t_iso / 1e9, "isoexec_frac_copy_ceiling": by / t_iso / 1e9 / bw,
                     "native_frac_copy_ceiling": by / t_nat / 1e9 / bw,
                     "note": "decode: CUDA-graph replay of 16 calls over 8 distinct weights (GPU time, no launch overhead)"})
        log(f"{kernel:40s} M={M}: iso {t_iso:.4f} native {t_nat:.4f} ratio {t_iso / t_nat:.2f}")

    for tag, mm in [("", m), *[(f"[{ec.name}] ", ec.model) for ec in extra_models]]:
        kd, vd = mm.linear_num_key_heads * mm.linear_key_head_dim, mm.linear_num_value_heads * mm.linear_value_head_dim
        h = mm.hidden_size
        col = [("gdn.in_proj", 2 * kd + 2 * vd, h), ("attn.qkv_proj(q+gate)", 2 * mm.num_attention_heads * mm.head_dim, h),
               ("mlp.shared_expert(up)", mm.shared_expert_intermediate_size, h)]
        if not tag:
            col.append(("square 8192", 8192, 8192))
        for name, n_out, k in col:
            M = 8192 if name == "square 8192" else N
            x = torch.randn(M, k, device=dev, dtype=bf)
            w = torch.randn(n_out, k, device=dev, dtype=bf) * 0.02
            add(f"{tag}gemm {name}", f"{M}x{k} @ {k}x{n_out}", lambda: t_gemm.linear(x, w, tc), lambda: F.linear(x, w),
                flops=2 * M * n_out * k, native="cublas F.linear")
        for M in (256, 1):
            graph_row(f"{tag}gemm gdn.in_proj (decode)", M, h, 2 * kd + 2 * vd, lambda a, b: t_gemm.linear(a, b, tc), F.linear)
        # row-parallel regions: pik leaf GEMM (G leaves, TP=1) vs cuBLAS
        for name, k in (("gdn.out_proj", vd), ("attn.out_proj", mm.num_attention_heads * mm.head_dim),
                        ("mlp.shared_expert(down)", mm.shared_expert_intermediate_size)):
            x = torch.randn(N, k, device=dev, dtype=bf)
            w = torch.randn(h, k, device=dev, dtype=bf) * 0.02
            add(f"{tag}leaf gemm {name} (G={G})", f"{N}x{k} @ {k}x{h}", lambda: t_gemm.linear_leaves(x, w, tc, G),
                lambda: F.linear(x, w), flops=2 * N * h * k, native="cublas F.linear")
        for M in (256, 1):
            graph_row(f"{tag}leaf gemm gdn.out_proj (decode, G={G})", M, vd, h,
                      lambda a, b: t_gemm.linear_leaves(a, b, tc, G), F.linear)
        x = torch.randn(4096, h, device=dev, dtype=bf)
        w = torch.randn(mm.vocab_size, h, device=dev, dtype=bf) * 0.02
        add(f"{tag}gemm lm_head (fp32 out)", f"4096x{h} @ {h}x{mm.vocab_size}",
            lambda: t_gemm.linear(x, w, tc, torch.float32), lambda: F.linear(x, w).float(),
            flops=2 * 4096 * mm.vocab_size * h, native="cublas F.linear + .float()")
    E, I = m.num_experts, m.moe_intermediate_size
    counts = [N * m.num_experts_per_tok // E] * E
    xs = torch.randn(sum(counts), m.hidden_size, device=dev, dtype=bf)
    W = torch.randn(E, I, m.hidden_size, device=dev, dtype=bf) * 0.02

    def nat_grouped():
        r0 = 0
        for e, c in enumerate(counts):
            F.linear(xs[r0 : r0 + c], W[e])
            r0 += c

    counts_t = torch.tensor(counts, device=dev)
    add("grouped gemm moe.experts(up)", f"{E}x[{counts[0]}x{m.hidden_size} @ {m.hidden_size}x{I}]",
        lambda: t_gemm.grouped_linear(xs, W, counts_t, tc), nat_grouped, flops=2 * sum(counts) * I * m.hidden_size,
        native="cublas F.linear per expert")
    # row norms
    x = torch.randn(N, m.hidden_size, device=dev, dtype=bf)
    wn = torch.randn(m.hidden_size, device=dev, dtype=bf) * 0.1
    add("rms_norm", f"{N}x{m.hidden_size} bf16", lambda: t_norm.rms_norm(x, wn, 1e-6), lambda: n_norm.native_rms_norm(x, wn, 1e-6),
        bytes_=2 * x.numel() * 2, native="torch (HF Qwen3NextRMSNorm)")
    xg = torch.randn(N * m.linear_num_value_heads, m.linear_value_head_dim, device=dev, dtype=bf)
    zg = torch.randn_like(xg)
    wg = torch.randn(m.linear_value_head_dim, device=dev, dtype=bf)
    add("gated_rms_norm", f"{xg.shape[0]}x{xg.shape[1]} bf16", lambda: t_norm.gated_rms_norm(xg, zg, wg, 1e-6),
        lambda: n_norm.native_gated_rms_norm(xg, zg, wg, 1e-6), bytes_=3 * xg.numel() * 2, native="torch (HF RMSNormGated)")
    xl = torch.randn(N, m.linear_num_key_heads, m.linear_key_head_dim, device=dev, dtype=bf)
    add("l2norm", f"{N}x{m.linear_num_key_heads}x{m.linear_key_head_dim}", lambda: t_norm.l2norm(xl), lambda: n_norm.native_l2norm(xl),
        bytes_=xl.numel() * (2 + 4), native="torch (fla/HF l2norm)")
    # conv1d
    conv_dim = 2 * key_dim + value_dim
    xc = torch.randn(N, conv_dim, device=dev, dtype=bf)
    wc = torch.randn(conv_dim, m.linear_conv_kernel_dim, device=dev, dtype=bf)
    pc = torch.zeros(m.linear_conv_kernel_dim - 1, conv_dim, device=dev, dtype=bf)
    add("causal_conv1d+silu", f"{N}x{conv_dim}", lambda: t_conv.causal_conv1d(xc, wc, pc, tc.conv_block_t, tc.conv_block_c),
        lambda: native_causal_conv1d(xc, wc, pc),
        bytes_=2 * xc.numel() * 2, native="torch F.conv1d + silu")
    # attention
    hq, hkv, d = m.num_attention_heads, m.num_key_value_heads, m.head_dim
    lens = [2048] * 5
    q = torch.randn(sum(lens), hq, d, device=dev, dtype=bf)
    kv = [(torch.randn(n, hkv, d, device=dev, dtype=bf), torch.randn(n, hkv, d, device=dev, dtype=bf)) for n in lens]
    fl = sum(4 * n * n / 2 * d * hq for n in lens)
    add("attention prefill", f"5x2048 causal, {hq}q/{hkv}kv heads, d{d}",
        lambda: t_attn.attention(q, kv, [0] * 5, lens, cfg.kernels.kv_block, tc.attn_block_m, tc.attn_num_warps, tc.attn_num_stages),
        lambda: native_attention(q, kv, [0] * 5, lens), flops=fl, native="SDPA per sequence")
    for ec in extra_models:
        em, et = ec.model, ec.kernels.triton
        eq_ = torch.randn(sum(lens), em.num_attention_heads, em.head_dim, device=dev, dtype=bf)
        ekv = [(torch.randn(n, em.num_key_value_heads, em.head_dim, device=dev, dtype=bf),
                torch.randn(n, em.num_key_value_heads, em.head_dim, device=dev, dtype=bf)) for n in lens]
        add(f"[{ec.name}] attention prefill", f"5x2048 causal, {em.num_attention_heads}q/{em.num_key_value_heads}kv heads, d{em.head_dim}",
            lambda: t_attn.attention(eq_, ekv, [0] * 5, lens, ec.kernels.kv_block, et.attn_block_m, et.attn_num_warps, et.attn_num_stages),
            lambda: native_attention(eq_, ekv, [0] * 5, lens), native="SDPA per sequence",
            flops=sum(4 * n * n / 2 * em.head_dim * em.num_attention_heads for n in lens))
    B, L = 256, 2048
    qd = torch.randn(B, hq, d, device=dev, dtype=bf)
    kvd = [(torch.randn(L, hkv, d, device=dev, dtype=bf), torch.randn(L, hkv, d, device=dev, dtype=bf)) for _ in range(B)]
    add("attention decode", f"{B} seqs x 1 query, cache {L}", lambda: t_attn.attention(qd, kvd, [L - 1] * B, [1] * B, cfg.kernels.kv_block, tc.attn_block_m, tc.attn_num_warps, tc.attn_num_stages),
        lambda: native_attention(qd, kvd, [L - 1] * B, [1] * B), bytes_=B * L * hkv * d * 2 * 2, native="SDPA per sequence",
        note="both include packing the per-sequence caches (list interface)")
    # logprob
    lg = torch.randn(4096, m.vocab_size, device=dev) * 3
    tok = torch.randint(0, m.vocab_size, (4096, 1), device=dev)
    add("logprob (full vocab)", f"4096x{m.vocab_size} fp32", lambda: t_logprob.logprob(lg, 1.0, cfg.kernels.vocab_block),
        lambda: torch.log_softmax(lg / 1.0, dim=-1).gather(1, tok), bytes_=2 * lg.numel() * 4,
        native="log_softmax + gather", note="isoexec writes the full [N, V] logprob rows")
    # moe block
    Nm = 4096
    xm = torch.randn(Nm, m.hidden_size, device=dev, dtype=bf)
    rw = torch.randn(E, m.hidden_size, device=dev, dtype=bf) * 0.02
    ex = [tuple(torch.randn(*s, device=dev, dtype=bf) * 0.02 for s in ((I, m.hidden_size), (I, m.hidden_size), (m.hidden_size, I)))
          for _ in range(E)]
    S_ = m.shared_expert_intermediate_size
    sh = tuple(torch.randn(*s, device=dev, dtype=bf) * 0.02 for s in ((S_, m.hidden_size), (S_, m.hidden_size), (m.hidden_size, S_)))
    sg = torch.randn(1, m.hidden_size, device=dev, dtype=bf) * 0.02
    fl = 2 * Nm * m.hidden_size * (3 * I * m.num_experts_per_tok + 3 * S_)
    def moe(ks):
        w_, ids = ks["moe.router"](xm, rw, m.num_experts_per_tok, True)
        y = ks["moe.experts"](xm, ids, ex)
        return ks["moe.combine"](y, w_, ids, ks["mlp.shared_expert"](xm, sh, sg), xm.dtype)

    add("moe block", f"{Nm} tokens, {E} experts top-{m.num_experts_per_tok}", lambda: moe(iso), lambda: moe(nat),
        flops=fl, native="HF MoE (cuBLAS, index_add)")
    return rows


# ------------------------------------------------------------------------------------------- CPR
def conv_pieces_table(cfg, log=print) -> list[dict]:
    """``gdn.conv1d`` over many pieces at the model's conv width: one launch for every piece (the region's
    kernel) against one launch per piece (how it ran before), on the same inputs; both outputs must be equal
    bit for bit. Cases: decode steps of 32 and 256 sequences, and an engine step of 8 prefill chunks of 512
    rows beside 56 decode tokens."""
    from isoexec.kernels.conv import triton as t_conv

    m, tc = cfg.model, cfg.kernels.triton
    ch = 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim
    kc, dev, bf = m.linear_conv_kernel_dim, "cuda", torch.bfloat16
    w = torch.randn(ch, kc, device=dev, dtype=bf)
    rows = []
    for case, lengths in (("decode 32", [1] * 32), ("decode 256", [1] * 256), ("8 x 512 prefill + 56 decode", [512] * 8 + [1] * 56)):
        xs = [torch.randn(n, ch, device=dev, dtype=bf) for n in lengths]
        ps = [torch.randn(kc - 1, ch, device=dev, dtype=bf) for _ in lengths]
        one = lambda: t_conv.causal_conv1d_pieces(xs, w, ps, tc.conv_block_t, tc.conv_block_c)  # noqa: E731
        each = lambda: [t_conv.causal_conv1d(x, w, p, tc.conv_block_t, tc.conv_block_c) for x, p in zip(xs, ps)]  # noqa: E731
        (ya, pa), yb = one(), each()
        equal = all(torch.equal(a, b) for a, (b, _) in zip(ya, yb)) and all(torch.equal(a, b) for a, (_, b) in zip(pa, yb))
        t_one, t_each = _bench(one), _bench(each)
        r = {"case": case, "pieces": len(lengths), "rows": sum(lengths), "channels": ch, "one_launch_ms": t_one,
             "launch_per_piece_ms": t_each, "time_ratio_one_over_per_piece": t_one / t_each, "bitwise_equal": equal}
        log(json.dumps(r))
        rows.append(r)
    return rows


def gdn_inputs(T: int, H: int, dk: int = 128, dv: int = 128):
    """Random GDN inputs on CUDA for the benchmarks: q, k ``[T, H, dk]`` (l2-normalised), v ``[T, H, dv]``,
    g ``[T, H]`` (``0.1 * logsigmoid``, a mild decay), beta ``[T, H]`` in [0, 1); fp32."""
    import torch.nn.functional as F

    return (F.normalize(torch.randn(T, H, dk, device="cuda"), dim=-1), F.normalize(torch.randn(T, H, dk, device="cuda"), dim=-1),
            torch.randn(T, H, dv, device="cuda"), F.logsigmoid(torch.randn(T, H, device="cuda")) * 0.1,
            torch.rand(T, H, device="cuda"))


def cpr_table(cfg, log=print, hq=16, hv=32, dk=128, dv=128) -> list[dict]:
    """CPR per-layer latency (ms) for the blog's three stages and four strategies; q/k expanded to hv heads."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from isoexec.kernels.gdn import triton as t_gdn

    C, tc = cfg.kernels.chunk_size, cfg.kernels.triton
    dev = "cuda"
    H = hv

    def inputs(T):
        return gdn_inputs(T, H, dk, dv)

    def fla_chunk(q, k, v, g, b, lens, h0=None, bf16=True):
        cu = torch.tensor([0] + lens, device=dev).cumsum(0)
        cast = (lambda t: t.to(torch.bfloat16)) if bf16 else (lambda t: t)
        return chunk_gated_delta_rule(cast(q)[None], cast(k)[None], cast(v)[None], g=g[None], beta=cast(b)[None],
                                      initial_state=h0, output_final_state=True, cu_seqlens=cu)

    def fla_rec(q, k, v, g, b, lens, h0=None, bf16=True):
        cu = torch.tensor([0] + lens, device=dev).cumsum(0)
        cast = (lambda t: t.to(torch.bfloat16)) if bf16 else (lambda t: t)
        return fused_recurrent_gated_delta_rule(cast(q)[None], cast(k)[None], cast(v)[None], g=g[None], beta=cast(b)[None],
                                                initial_state=h0, output_final_state=True, cu_seqlens=cu)

    rows = []
    # trainer 1 x 10240 and prefill 5 x 2048
    for stage, lens in (("trainer_fwd 1x10240", [10240]), ("rollout_prefill 5x2048", [2048] * 5)):
        q, k, v, g, b = inputs(sum(lens))
        keep = stage.startswith("rollout")
        t = {
            "native_mixed": _bench(lambda: fla_chunk(q, k, v, g, b, lens)),
            "chunkwise_everywhere": _bench(lambda: fla_chunk(q, k, v, g, b, lens)),
            "recurrent_everywhere": _bench(lambda: fla_rec(q, k, v, g, b, lens), warmup=5, rep=30),
            "cpr": _bench(lambda: t_gdn.cpr_gdn(q, k, v, g, b, lens, [None] * len(lens), C, tc, keep_state=keep)),
        }
        rows.append({"stage": stage, **{f"{kk}_ms": vv for kk, vv in t.items()},
                     **{f"{kk}_ratio": vv / t["native_mixed"] for kk, vv in t.items()},
                     "note": "forward only (fla chunk backward refuses on Hopper with Triton 3.6); fla in bf16, CPR fp32 inputs"
                     if stage.startswith("trainer") else "CPR keeps decode states (pool slots, open-chunk buffers)"})
        log(json.dumps(rows[-1]))
    # trainer forward + backward (the blog's trainer row)
    q, k, v, g, b = inputs(10240)
    ms = {}
    for name, fn in _trainer_fwd_bwd(cfg, q, k, v, g, b, [10240], torch.randn_like(v)).items():
        try:
            ms[name] = _bench(fn, warmup=3, rep=20)
        except Exception as e:  # a path without a backward on this stack
            log(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            ms[name] = float("nan")
    rows.append({"stage": "trainer_fwd+bwd 1x10240", **{f"{kk}_ms": ms[kk] for kk in ms},
                 **{f"{kk}_ratio": ms[kk] / ms["native_mixed"] for kk in ms},
                 "note": "native mixed: fla chunk forward (bf16) + the gradient of the torch chunk reference (the fastest "
                         "correct backward here: fla's chunk backward refuses on Hopper with Triton < 3.7.1, fla issue "
                         "640); chunkwise everywhere: fla chunk forward + fla's own backward with that refusal lifted "
                         "(timing only, see cpr_backward.csv for its error); recurrent everywhere: fla fused_recurrent "
                         "forward + the torch chunk reference backward; CPR: CPR forward + the Triton chunkwise backward"})
    log(json.dumps(rows[-1]))
    # decode 256 seqs x 1 token, steady state; CPR amortised over a whole chunk (C steps incl. one resync)
    B = 256
    q, k, v, g, b = inputs(B)
    h0 = torch.randn(B, H, dk, dv, device=dev) * 0.01
    lens = [1] * B
    pq, pk, pv, pg, pb = inputs(B * 8)
    _, states = t_gdn.cpr_gdn(pq, pk, pv, pg, pb, [8] * B, [None] * B, C, tc, keep_state=True)

    def cpr_chunk_cycle():
        nonlocal states
        for _ in range(C):
            _, states = t_gdn.cpr_gdn(q, k, v, g, b, lens, states, C, tc, keep_state=True)

    def cpr_one():
        nonlocal states
        _, states = t_gdn.cpr_gdn(q, k, v, g, b, lens, states, C, tc, keep_state=True)

    t = {
        "native_mixed": _bench(lambda: fla_rec(q, k, v, g, b, lens, h0)),
        "chunkwise_everywhere": _bench(lambda: fla_chunk(q, k, v, g, b, lens, h0)),
        "recurrent_everywhere": _bench(lambda: fla_rec(q, k, v, g, b, lens, h0)),
        "cpr": _bench(cpr_chunk_cycle, warmup=2, rep=20) / C,
    }
    t_one = _bench(cpr_one)
    rows.append({"stage": f"rollout_decode {B}x1", **{f"{kk}_ms": vv for kk, vv in t.items()},
                 **{f"{kk}_ratio": vv / t["native_mixed"] for kk, vv in t.items()},
                 "note": f"CPR per token amortised over {C} steps incl. one resync; a step without resync {t_one:.4f} ms; "
                         "includes host-side slot bookkeeping"})
    log(json.dumps(rows[-1]))
    return rows


@contextlib.contextmanager
def _fla_gated_chunk_backward_unguarded():
    """Lift fla's refusal of its gated chunk backward for timing and error measurement in this process only.

    fla-core 0.6.0, ``fla/ops/common/chunk_o.py`` line 727 (``chunk_bwd_dqkwg``) raises on Hopper with Triton
    >= 3.4 and < 3.7.1 (fla issue 640: the compiled kernel gives wrong results). The benchmark times that
    backward anyway, as the chunkwise kernel a fixed Triton would run, and reports its gradient error beside."""
    import fla.ops.common.chunk_o as chunk_o

    old = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = old


def _trainer_fwd_bwd(cfg, q, k, v, g, b, lens, do) -> dict:
    """Callables running GDN forward + backward (``torch.autograd.grad`` of ``<o, do>``, returning the
    gradients of q, k, v, g, beta) per strategy of the CPR table; fla's q, k, v, beta cast to bf16 (as run)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from isoexec.kernels.autograd import with_ref_grad
    from isoexec.kernels.gdn.native import chunk_reference
    from isoexec.kernels.gdn.triton_backward import CPRTritonTrainerFunction

    C, tc = cfg.kernels.chunk_size, cfg.kernels.triton
    cu = torch.tensor([0] + lens, device=q.device).cumsum(0)
    def cast(x):
        return x.to(torch.bfloat16)

    def fla(fn):
        return lambda q_, k_, v_, g_, b_: fn(cast(q_)[None], cast(k_)[None], cast(v_)[None], g=g_[None],
                                             beta=cast(b_)[None], cu_seqlens=cu)[0][0].float()

    def run(fwd, unguarded=False):
        def go():
            ins = [x.detach().requires_grad_() for x in (q, k, v, g, b)]
            ctx = _fla_gated_chunk_backward_unguarded() if unguarded else contextlib.nullcontext()
            with ctx:
                return torch.autograd.grad(fwd(*ins), ins, do)
        return go

    ref = lambda *x: chunk_reference(lens, C, *x)  # noqa: E731
    return {
        "native_mixed": run(lambda *x: with_ref_grad(fla(chunk_gated_delta_rule), ref, *x)),
        "chunkwise_everywhere": run(fla(chunk_gated_delta_rule), unguarded=True),
        "recurrent_everywhere": run(lambda *x: with_ref_grad(fla(fused_recurrent_gated_delta_rule), ref, *x)),
        "cpr": run(lambda *x: CPRTritonTrainerFunction.apply(*x, lens, C, tc)),
    }


def cpr_backward_table(cfg, log=print, H=32) -> list[dict]:
    """The GDN backward per strategy: forward+backward time at trainer 1x10240 (h32, dims 128) and each
    gradient's error against the fp64 token-by-token reference at 1x1024 (h4): ``||grad - ref|| / ||ref||``,
    the largest over q, k, v, g, beta. As the strategies run in the table and the trainers: fla with bf16
    q, k, v, beta (so its error includes that rounding), CPR with fp32 inputs and tf32 dots."""
    from isoexec.kernels.gdn.reference import recurrent_reference

    small = gdn_inputs(1024, 4)
    do_small = torch.randn_like(small[2])
    ins = [x.detach().cpu().double().requires_grad_() for x in small]
    (recurrent_reference(*ins)[0] * do_small.cpu().double()).sum().backward()
    fns = _trainer_fwd_bwd(cfg, *small, [1024], do_small)
    big = gdn_inputs(10240, H)
    fns_big = _trainer_fwd_bwd(cfg, *big, [10240], torch.randn_like(big[2]))
    rows = []
    for name in fns:
        row = {"strategy": name, "shape": f"1x10240 h{H}", "fwd_bwd_ms": float("nan"), "grad_rel_err_max": float("nan"),
               "error": ""}
        try:
            grads = fns[name]()
            row["grad_rel_err_max"] = max(float((gr.double().cpu() - x.grad).norm() / x.grad.norm())
                                          for gr, x in zip(grads, ins))
            row["fwd_bwd_ms"] = _bench(fns_big[name], warmup=3, rep=20)
        except Exception as e:  # a strategy without a backward on this stack
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        log(json.dumps(row))
    for r in rows:
        r["fwd_bwd_ratio"] = r["fwd_bwd_ms"] / rows[0]["fwd_bwd_ms"]
    return rows


# ----------------------------------------------------------------------------------- model level
def model_table(cfg, log=print, batch=8, seq_len=1024, decode_seqs=64, decode_steps=16, prompt=128) -> list[dict]:
    """Unified model tokens/s with isoexec vs native kernel sets, and transformers + fla where it runs."""
    from isoexec.model.build import random_model
    from isoexec.model.hf import hf_config

    vocab = cfg.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (seq_len,), generator=gen) for _ in range(batch)]
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen) for _ in range(decode_seqs)]
    ids = torch.cat(seqs)
    cu = torch.tensor([0] + [seq_len] * batch).cumsum(0)

    def timed(fn, reps=3):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn()
            torch.cuda.synchronize()
            ts.append(r if isinstance(r, float) else time.perf_counter() - t0)
        return statistics.median(ts)

    res = {}
    for ks in ("isoexec", "native"):
        model = random_model(cfg.model, cfg.kernels, ks, vocab_size=vocab, device="cuda")

        def decode():
            caches = [model.new_cache() for _ in prompts]
            model.engine_step(caches, prompts, last_only=True)
            tok = [p[-1:] for p in prompts]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(decode_steps):
                model.engine_step(caches, tok, last_only=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        res[ks] = {
            "trainer_score": timed(lambda: model.trainer_logprobs(ids, cu)),
            "engine_prefill": timed(lambda: model.engine_step([model.new_cache() for _ in seqs], seqs, last_only=True)),
            "engine_decode": timed(decode),
        }
        log(f"model {ks}: {res[ks]}")
        torch.cuda.empty_cache()
    hf = {}
    try:
        from transformers import Qwen3NextForCausalLM

        src = random_model(cfg.model, cfg.kernels, "native", vocab_size=vocab, device="cuda")
        hcfg = hf_config(cfg.model, vocab)
        hmodel = Qwen3NextForCausalLM(hcfg).to("cuda", torch.bfloat16).eval()
        missing = hmodel.load_state_dict(src.state_dict(), strict=False)
        log(f"transformers model: missing {len(missing.missing_keys)} unexpected {len(missing.unexpected_keys)}")
        del src
        bids = ids.view(batch, seq_len).cuda()

        @torch.no_grad()
        def hf_score():
            logits = hmodel(input_ids=bids, logits_to_keep=0).logits
            return torch.log_softmax(logits.float(), -1)

        hf["trainer_score"] = timed(hf_score)

        @torch.no_grad()
        def hf_decode():
            pids = torch.stack(prompts).cuda()
            out = hmodel(input_ids=pids, use_cache=True, logits_to_keep=1)
            pkv = out.past_key_values
            tok = pids[:, -1:]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(decode_steps):
                out = hmodel(input_ids=tok, past_key_values=pkv, use_cache=True)
                pkv = out.past_key_values
                torch.log_softmax(out.logits[:, -1].float(), -1)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        hf["engine_decode"] = timed(hf_decode)
        hf["engine_prefill"] = hf["trainer_score"]
        log(f"transformers+fla: {hf}")
    except Exception as e:  # report, don't fail the run
        log(f"transformers+fla model not measured: {type(e).__name__}: {e}")
        traceback.print_exc()
    rows = []
    ntok = {"trainer_score": batch * seq_len, "engine_prefill": batch * seq_len, "engine_decode": decode_seqs * decode_steps}
    for case in ("trainer_score", "engine_prefill", "engine_decode"):
        r = {"case": case, "tokens": ntok[case], "isoexec_tok_s": ntok[case] / res["isoexec"][case],
             "native_tok_s": ntok[case] / res["native"][case],
             "time_ratio_isoexec_over_native": res["isoexec"][case] / res["native"][case]}
        if case in hf:
            r["hf_fla_tok_s"] = ntok[case] / hf[case]
            r["time_ratio_isoexec_over_hf_fla"] = res["isoexec"][case] / hf[case]
        r["note"] = {"trainer_score": f"{batch}x{seq_len} packed, full-vocab logprobs",
                     "engine_prefill": f"{batch}x{seq_len} prompts (hf: same forward as trainer_score)",
                     "engine_decode": f"{decode_seqs} seqs x {decode_steps} steps after {prompt}-token prompts"}[case]
        rows.append(r)
    return rows


# ------------------------------------------------------------------------------------ variants
def variants(cfg, log=print, extra_models=(), parts=("gemm", "leaf", "attention", "cpr", "moe")) -> list[dict]:
    """Measure candidate launch constants side by side (one row per (what, config, shape)), each with a
    bitwise check of its invariance: the deployment picks one and pins it in ``kernels.triton``.

    Column GEMM programs and tiles (fraction of cuBLAS throughput; decode rows by CUDA-graph replay),
    leaf GEMM tiles and the split launch, attention tiles (and ``kv_block``), CPR scan / chain / prep
    launches, and the native grouped-GEMM MoE against the per-expert loop."""
    import triton.testing

    dev, bf = "cuda", torch.bfloat16
    tc0, G = cfg.kernels.triton, cfg.kernels.leaves
    rows = []

    def bench(fn):
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))

    def rec(**r):
        rows.append(r)
        log(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}))

    models = [("h200", cfg.model), *[(ec.name, ec.model) for ec in extra_models]]
    col_shapes, leaf_shapes = [], []
    for tag, mm in models:
        kd, vd, h = (mm.linear_num_key_heads * mm.linear_key_head_dim, mm.linear_num_value_heads * mm.linear_value_head_dim,
                     mm.hidden_size)
        col_shapes += [(f"{tag} gdn.in_proj", 10240, h, 2 * kd + 2 * vd), (f"{tag} attn.q+gate", 10240, h, 2 * mm.num_attention_heads * mm.head_dim),
                       (f"{tag} shared(up)", 10240, h, mm.shared_expert_intermediate_size),
                       (f"{tag} gdn.in_proj decode", 256, h, 2 * kd + 2 * vd), (f"{tag} gdn.in_proj decode", 1, h, 2 * kd + 2 * vd)]
        leaf_shapes += [(f"{tag} gdn.out_proj", 10240, vd, h), (f"{tag} attn.out_proj", 10240, mm.num_attention_heads * mm.head_dim, h),
                        (f"{tag} shared(down)", 10240, mm.shared_expert_intermediate_size, h),
                        (f"{tag} gdn.out_proj decode", 256, vd, h), (f"{tag} gdn.out_proj decode", 1, vd, h)]

    def data(M, K, N):
        n = 8 if M <= 256 else 1
        return [(torch.randn(M, K, device=dev, dtype=bf), torch.randn(N, K, device=dev, dtype=bf) * K ** -0.5) for _ in range(n)]

    def timed(fn, xw):
        if len(xw) > 1:
            return _bench_graph([lambda a=a, b=b: fn(a, b) for a, b in xw])
        return bench(lambda: fn(*xw[0]))

    if "gemm" in parts:
        _variants_gemm(col_shapes, data, timed, tc0, rec)
    if "leaf" in parts:
        _variants_leaf(leaf_shapes, data, timed, tc0, G, rec)
    if "attention" in parts:
        _variants_attention(models, bench, rec)
    if "cpr" in parts:
        _variants_cpr(cfg, tc0, bench, rec, log)
    if "moe" in parts:
        _variants_moe(models, bench, rec)
    if "cpr_bwd" in parts:
        _variants_cpr_backward(cfg, tc0, rec)
    return rows


def _variants_gemm(col_shapes, data, timed, tc0, rec):
    import torch.nn.functional as F

    from isoexec.kernels.gemm import triton as t_gemm

    dev, bf = "cuda", torch.bfloat16
    cdata = {sh: data(*sh[1:]) for sh in col_shapes}
    cub = {sh: timed(F.linear, cdata[sh]) for sh in col_shapes}
    xi = torch.randn(513, 1024, device=dev, dtype=bf)
    wi = torch.randn(3072, 1024, device=dev, dtype=bf) * 0.03
    # equal_to_pinned: the candidate's outputs against the pinned program and tiles without row buckets, on
    # 1..513 rows and on every shape's data (the row buckets of gemm_bfloat16_by_rows rest on it; BK = 32 too)
    pinned = tc0.model_copy(update={"gemm_bfloat16_by_rows": ()})
    ref_i = t_gemm.linear(xi, wi, pinned)
    ref_sh = {sh: t_gemm.linear(*cdata[sh][0], pinned) for sh in col_shapes}
    cands = [("tiled", (128, 128, 64, 8, 3)), ("tiled", (128, 256, 64, 8, 3)), ("tiled", (128, 128, 64, 8, 4)),
             ("tiled", (128, 256, 64, 8, 4)), ("tiled", (64, 128, 64, 4, 4)), ("tiled", (128, 64, 64, 4, 4)),
             ("tiled", (64, 64, 64, 4, 4)), ("tiled", (64, 256, 64, 4, 3)), ("persistent_tma", (64, 128, 64, 4, 4)),
             ("persistent_tma", (128, 128, 64, 8, 3)), ("persistent_tma", (128, 256, 64, 8, 3)),
             ("persistent_tma", (128, 128, 64, 8, 4)), ("persistent_tma", (128, 256, 64, 8, 4)),
             ("tiled", (128, 128, 32, 8, 3)), ("persistent_tma", (128, 128, 32, 8, 4))]
    for prog, tiles in [*cands, ("pinned by rows", None)]:
        cand = tc0 if tiles is None else pinned.model_copy(update={"gemm_kernel": prog, "gemm_bfloat16": tiles})
        conf = prog if tiles is None else f"{prog} {','.join(map(str, tiles))}"
        try:
            ref = t_gemm.linear(xi[7:8], wi, cand)[0]
            ok = all(torch.equal(t_gemm.linear(xi[r], wi, cand)[7 - (r.start or 0)], ref)
                     for r in (slice(0, 8), slice(7, 300), slice(0, 513)))
            same = all(torch.equal(t_gemm.linear(xi[:m], wi, cand), ref_i[:m]) for m in (1, 3, 64, 65, 256, 513))
            for sh in col_shapes:
                t = timed(lambda a, b: t_gemm.linear(a, b, cand), cdata[sh])
                rec(what="gemm", config=conf, shape=f"{sh[0]} {sh[1]}x{sh[2]}@{sh[2]}x{sh[3]}", ms=t, ref_ms=cub[sh],
                    frac_of_ref_throughput=cub[sh] / t, bitwise_ok=ok,
                    equal_to_pinned=same and torch.equal(t_gemm.linear(*cdata[sh][0], cand), ref_sh[sh]))
        except Exception as e:  # a variant that does not compile or run is reported, not fatal
            rec(what="gemm", config=conf, error=f"{type(e).__name__}: {str(e)[:200]}")


def _variants_leaf(leaf_shapes, data, timed, tc0, G, rec):
    import torch.nn.functional as F

    from isoexec.kernels.gemm import triton as t_gemm

    dev, bf = "cuda", torch.bfloat16
    ldata = {sh: data(*sh[1:]) for sh in leaf_shapes}
    lcub = {sh: timed(F.linear, ldata[sh]) for sh in leaf_shapes}
    xl = torch.randn(300, 2048, device=dev, dtype=bf)
    wl = torch.randn(1024, 2048, device=dev, dtype=bf) * 0.02
    pinned = t_gemm.linear_leaves(xl, wl, tc0, G, split=False)
    cands = [((128, 64, 64, 8, 3), 8), ((64, 64, 64, 4, 4), 8), ((128, 64, 64, 8, 3), 4), ((128, 128, 64, 8, 3), 4),
             ((128, 128, 64, 8, 3), 2), ((128, 128, 64, 8, 4), 2), ((128, 256, 64, 8, 3), 2), ((128, 128, 64, 8, 3), 1)]
    for tiles, lpp in cands:
        cand = tc0.model_copy(update={"pik_gemm_bfloat16": tiles, "pik_program_leaves": lpp})
        conf = ",".join(map(str, tiles)) + f" leaves/program<={lpp}"
        try:
            full = t_gemm.linear_leaves(xl, wl, cand, G, split=False)
            same_as_pinned = bool(torch.equal(full, pinned))  # BK and the tree fix the bits; BM/BN, the launch should not
            ok = torch.equal(full, t_gemm.linear_leaves(xl, wl, cand, G, split=True))
            ok &= torch.equal(full[5], t_gemm.linear_leaves(xl[5:6], wl, cand, G, split=False)[0])
            for tp in (2, 4, 8):
                sv = 2048 // tp
                parts = torch.stack([t_gemm.linear_leaves_partial(xl[:, i * sv:(i + 1) * sv], wl[:, i * sv:(i + 1) * sv], cand, G // tp)
                                     for i in range(tp)])
                ok &= torch.equal(t_gemm.tree_combine(parts, bf), full)
            for sh in leaf_shapes:
                for split in ((None,) if sh[1] > 256 else (True, False)):
                    t = timed(lambda a, b: t_gemm.linear_leaves(a, b, cand, G, split=split), ldata[sh])
                    rec(what="leaf_gemm", config=f"{conf} split={split}", shape=f"{sh[0]} {sh[1]}x{sh[2]}@{sh[2]}x{sh[3]}", ms=t,
                        ref_ms=lcub[sh], frac_of_ref_throughput=lcub[sh] / t, bitwise_ok=bool(ok),
                        equal_pinned_tiles=same_as_pinned)
        except Exception as e:
            rec(what="leaf_gemm", config=conf, error=f"{type(e).__name__}: {str(e)[:200]}")


def _variants_attention(models, bench, rec):
    from isoexec.kernels.attention import triton as t_attn
    from isoexec.kernels.attention.native import native_attention

    dev, bf = "cuda", torch.bfloat16
    lens = [2048] * 5
    for tag, mm in models:
        hq, hkv, d = mm.num_attention_heads, mm.num_key_value_heads, mm.head_dim
        q = torch.randn(sum(lens), hq, d, device=dev, dtype=bf)
        kv = [(torch.randn(n, hkv, d, device=dev, dtype=bf), torch.randn(n, hkv, d, device=dev, dtype=bf)) for n in lens]
        t_ref = bench(lambda: native_attention(q, kv, [0] * 5, lens))
        for bm, kvb, nw, ns in ((64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                                (128, 128, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3)):
            conf = f"block_m={bm} kv_block={kvb} warps={nw} stages={ns}"
            try:
                L = 300
                qs, ks_, vs = q[:L], kv[0][0][:L], kv[0][1][:L]
                full = t_attn.attention(qs, [(ks_, vs)], [0], [L], kvb, bm, nw, ns)
                ok = all(torch.equal(t_attn.attention(qs[t:t + 1], [(ks_[:t + 1], vs[:t + 1])], [t], [1], kvb, bm, nw, ns)[0], full[t])
                         for t in (0, 63, 64, 127, 128, 200, L - 1))
                ok &= torch.equal(t_attn.attention(qs[100:170], [(ks_[:170], vs[:170])], [100], [70], kvb, bm, nw, ns), full[100:170])
                t = bench(lambda: t_attn.attention(q, kv, [0] * 5, lens, kvb, bm, nw, ns))
                rec(what="attention", config=conf, shape=f"{tag} 5x2048 {hq}q/{hkv}kv d{d}", ms=t, ref_ms=t_ref,
                    frac_of_ref_throughput=t_ref / t, bitwise_ok=bool(ok))
            except Exception as e:
                rec(what="attention", config=conf, shape=f"{tag} d{d}", error=f"{type(e).__name__}: {str(e)[:200]}")


def _variants_cpr(cfg, tc0, bench, rec, log):
    from isoexec.kernels.gdn import triton as t_gdn

    H, T, C = 32, 10240, cfg.kernels.chunk_size
    q, k, v, g, b = gdn_inputs(T, H)
    tc = tc0
    for names, opts in ((("gdn_scan_bv", "gdn_scan_warps"), ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4))),
                        (("gdn_chain_bv", "gdn_chain_warps"), ((32, 4), (16, 4), (16, 2), (64, 4))),
                        (("gdn_prep_warps",), ((4,), (8,), (2,)))):
        best = None
        for vals in opts:
            cand = tc.model_copy(update=dict(zip(names, vals)))
            conf = ",".join(f"{n}={x}" for n, x in zip(names, vals))
            try:
                o, _ = t_gdn.cpr_gdn(q[:200], k[:200], v[:200], g[:200], b[:200], [200], [None], C, cand, keep_state=False)
                outs, st = [], [None]
                for t0, t1 in ((0, 70), (70, 71), (71, 140), *[(i, i + 1) for i in range(140, 200)]):
                    ot, st = t_gdn.cpr_gdn(q[t0:t1], k[t0:t1], v[t0:t1], g[t0:t1], b[t0:t1], [t1 - t0], st, C, cand)
                    outs.append(ot)
                ok = torch.equal(torch.cat(outs), o)
                ms = bench(lambda: t_gdn.cpr_gdn(q, k, v, g, b, [T], [None], C, cand, keep_state=False))
                rec(what="cpr", config=conf, shape="trainer_fwd 1x10240 h32", ms=ms, bitwise_ok=bool(ok))
            except Exception as e:
                rec(what="cpr", config=conf, error=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            if best is None or ms < best[0]:
                best = (ms, vals)
        if best:
            tc = tc.model_copy(update=dict(zip(names, best[1])))
    log(f"cpr greedy choice: scan {tc.gdn_scan_bv}/{tc.gdn_scan_warps} chain {tc.gdn_chain_bv}/{tc.gdn_chain_warps} prep {tc.gdn_prep_warps}")
    # decode step (scan only) for the scan variants at the chosen chain/prep
    B = 256
    pq, pk, pv, pg, pb = (x[:B * 8] for x in (q, k, v, g, b))
    for sbv, sw in ((8, 1), (16, 1), (16, 2), (32, 2)):
        cand = tc.model_copy(update={"gdn_scan_bv": sbv, "gdn_scan_warps": sw})
        try:
            _, states = t_gdn.cpr_gdn(pq, pk, pv, pg, pb, [8] * B, [None] * B, C, cand)

            def step():
                nonlocal states
                _, states = t_gdn.cpr_gdn(q[:B], k[:B], v[:B], g[:B], b[:B], [1] * B, states, C, cand)

            rec(what="cpr_decode", config=f"gdn_scan_bv={sbv},gdn_scan_warps={sw}", shape="decode 256x1 h32 (one step)", ms=bench(step))
        except Exception as e:
            rec(what="cpr_decode", config=f"{sbv},{sw}", error=f"{type(e).__name__}: {str(e)[:200]}")


_CPR_BWD_CANDIDATE = r"""
import json, sys, torch, triton.testing
from isoexec.bench.gpu import gdn_inputs
from isoexec.config import TritonSection
from isoexec.kernels.gdn.reference import recurrent_reference
from isoexec.kernels.gdn.triton_backward import CPRTritonTrainerFunction
triton_section, C, T, H = json.loads(sys.argv[1])
tc = TritonSection(**triton_section)


def grads(x, do, lens):
    ins = [t.detach().requires_grad_() for t in x]
    return torch.autograd.grad(CPRTritonTrainerFunction.apply(*ins, lens, C, tc), ins, do)

torch.manual_seed(0)
small, lens = gdn_inputs(300, 2), [200, 100]
do = torch.randn_like(small[2])
got = grads(small, do, lens)
ins = [t.detach().cpu().double().requires_grad_() for t in small]
o = torch.cat([recurrent_reference(*(t[:200] for t in ins))[0], recurrent_reference(*(t[200:] for t in ins))[0]])
(o * do.cpu().double()).sum().backward()
err = max(float((a.double().cpu() - t.grad).norm() / t.grad.norm()) for a, t in zip(got, ins))
out = {"grad_rel_err_max": err}
if T:
    x = gdn_inputs(T, H)
    dob = torch.randn_like(x[2])
    out["ms"] = float(triton.testing.do_bench(lambda: grads(x, dob, [T]), warmup=5, rep=40, return_mode="median"))
print(json.dumps(out))
"""


def _variants_cpr_backward(cfg, tc0, rec):
    """The Triton CPR backward's launches (Dv block, warps, prep warps) at trainer 1x10240 h32: forward +
    backward time and the gradient error against the fp64 reference (two sequences, 300 tokens, h2). Each
    candidate runs in a subprocess, so that a launch that faults cannot take the others down; a faulting
    one is rerun with ``CUDA_LAUNCH_BLOCKING=1`` to name the kernel."""
    import re
    import subprocess

    for bv, warps, prep_warps in ((32, 4, 4), (32, 4, 8), (16, 4, 8), (32, 8, 4), (32, 8, 8)):
        update = {"gdn_bwd_bv": bv, "gdn_bwd_warps": warps, "gdn_bwd_prep_warps": prep_warps}
        conf = ",".join(f"{k}={v}" for k, v in update.items())
        tc = tc0.model_copy(update=update).model_dump(mode="json")
        C = cfg.kernels.chunk_size
        run = subprocess.run([sys.executable, "-c", _CPR_BWD_CANDIDATE, json.dumps([tc, C, 10240, 32])],
                             capture_output=True, text=True, timeout=300)
        if run.returncode == 0:
            rec(what="cpr_bwd", config=conf, shape="trainer_fwd+bwd 1x10240 h32", **json.loads(run.stdout.splitlines()[-1]))
            continue
        blocking = subprocess.run([sys.executable, "-c", _CPR_BWD_CANDIDATE, json.dumps([tc, C, 0, 0])],
                                  capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
        launches = re.findall(r"(_\w+)\[\(", blocking.stderr)
        rec(what="cpr_bwd", config=conf, error=(run.stderr.strip().splitlines() or ["?"])[-1][:200],
            faulting_launch=launches[-1] if launches else "", blocking_rc=blocking.returncode)


def _variants_moe(models, bench, rec):
    from isoexec.kernels.moe import native as n_moe

    dev, bf = "cuda", torch.bfloat16
    for tag, mm in models[1:] or models:
        E, I, h, kk = mm.num_experts, mm.moe_intermediate_size, mm.hidden_size, mm.num_experts_per_tok
        xm = torch.randn(4096, h, device=dev, dtype=bf)
        ids = torch.stack([torch.randperm(E, device=dev)[:kk] for _ in range(4096)])
        ex = [tuple(torch.randn(*s_, device=dev, dtype=bf) * 0.02 for s_ in ((I, h), (I, h), (h, I))) for _ in range(E)]
        try:
            yg, yl = n_moe.native_experts_grouped(xm, ids, ex), n_moe.native_experts(xm, ids, ex)
            rel = float((yg.float() - yl.float()).norm() / yl.float().norm())
            rec(what="native_moe", config="grouped_mm vs loop", shape=f"{tag} 4096 tok E{E} top{kk}",
                ms=bench(lambda: n_moe.native_experts_grouped(xm, ids, ex)), ref_ms=bench(lambda: n_moe.native_experts(xm, ids, ex)),
                rel_diff=rel)
            xg = xm.detach().requires_grad_(True)
            exg = [tuple(w.detach().requires_grad_(True) for w in e) for e in ex[:E]]
            n_moe.native_experts_grouped(xg, ids, exg).float().sum().backward()
            rec(what="native_moe", config="grouped_mm backward", shape=tag, grad_ok=bool(xg.grad is not None and exg[0][0].grad is not None))
        except Exception as e:
            rec(what="native_moe", config="grouped_mm", shape=tag, error=f"{type(e).__name__}: {str(e)[:300]}")


# ------------------------------------------------------------------------------------- profile
def cpr_breakdown(cfg, log=print, H=32) -> list[dict]:
    """Where CPR's time goes: CUDA kernel time by kernel (torch.profiler) for trainer 1x10240 (forward,
    and forward + the Triton backward), prefill 5x2048 and 64 decode steps of 256 sequences (one chunk
    cycle, one resync)."""
    from torch.profiler import ProfilerActivity, profile

    from isoexec.kernels.gdn import triton as t_gdn

    C, tc = cfg.kernels.chunk_size, cfg.kernels.triton

    def inputs(T):
        return gdn_inputs(T, H)

    rows = []
    a = inputs(10240)
    b = inputs(10240)
    d = inputs(256)
    _, states = t_gdn.cpr_gdn(*inputs(256 * 8), [8] * 256, [None] * 256, C, tc)

    def decode_cycle():
        nonlocal states
        for _ in range(C):
            _, states = t_gdn.cpr_gdn(*d, [1] * 256, states, C, tc)

    from isoexec.kernels.gdn.triton_backward import CPRTritonTrainerFunction

    do = torch.randn_like(a[2])

    def trainer_fwd_bwd():
        ins = [x.detach().requires_grad_() for x in a]
        torch.autograd.grad(CPRTritonTrainerFunction.apply(*ins, [10240], C, tc), ins, do)

    stages = {"trainer_fwd 1x10240": lambda: t_gdn.cpr_gdn(*a, [10240], [None], C, tc, keep_state=False),
              "trainer_fwd+bwd 1x10240": trainer_fwd_bwd,
              "rollout_prefill 5x2048": lambda: t_gdn.cpr_gdn(*b, [2048] * 5, [None] * 5, C, tc),
              f"rollout_decode 256x1 x{C} steps": decode_cycle}
    for stage, fn in stages.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        tot = {}
        for ev in prof.key_averages():
            dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if dt and ev.key and not ev.key.startswith(("aten::", "cuda")):  # device kernels and copies, not their callers
                tot[ev.key] = tot.get(ev.key, 0.0) + dt / 1e3
        for kname, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:12]:
            rows.append({"stage": stage, "kernel": kname[:60], "device_ms": ms, "wall_ms_profiled": wall})
            log(json.dumps(rows[-1]))
    return rows


# ----------------------------------------------------------------------------------------- entry
def gpu_bench_command(config: str = "experiments/h200.yaml", out_dir: str | None = None, what: str = "bench",
                      extra_configs: tuple[str, ...] = ()) -> None:
    """Run on a CUDA device; writes under ``out_dir`` (default results/<exp>).

    ``what``: ``variants`` (candidate launch constants side by side with their bitwise checks, for the
    deployment to pin in ``kernels.triton``), ``gates``, ``profile`` (CPR breakdown), ``kernels`` /
    ``cpr`` / ``model`` / ``conv`` (one benchmark table each; conv: ``conv_pieces.csv``), ``bench`` (the three), ``all`` (gates + bench).
    Every stage runs with the constants of the config it is given."""
    from isoexec.config import load_config
    from isoexec.io import atomic_write_text, write_csv
    from isoexec.provenance import provenance

    cfg = load_config(config)
    extra = [load_config(c) for c in extra_configs]
    if cfg.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"{config}: needs device: cuda and a visible CUDA device (torch.cuda.is_available()={torch.cuda.is_available()})")
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
        prov["bench"] = steps
    atomic_write_text(prov_path, json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["variants", "gates", "profile", "kernels", "cpr", "cpr_backward", "model", "conv", "bench",
                                    "all"])
    p.add_argument("--config", default="experiments/h200.yaml")
    p.add_argument("--extra-config", action="append", default=[], help="another experiment whose shapes the GEMM and attention rows add")
    p.add_argument("--out-dir", default=None)
    a = p.parse_args()
    gpu_bench_command(a.config, a.out_dir, a.what, tuple(a.extra_config))
    sys.exit(0)
