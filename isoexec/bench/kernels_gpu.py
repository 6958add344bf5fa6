"""Each Triton kernel against its native counterpart at the model's shapes (column, leaf and grouped GEMMs,
the lm_head, row norms, causal conv1d, attention prefill and decode, logprob, the MoE block), with the
achieved fraction of the measured bf16 GEMM and copy ceilings: ``kernel_bench.csv``
(``python -m isoexec.bench.gpu kernels``); and ``gdn.conv1d`` over many pieces, one launch for all of them
against one launch per piece, bit for bit: ``conv_pieces.csv`` (``python -m isoexec.bench.gpu conv``)."""

from __future__ import annotations

import json

import torch

from isoexec.bench.timing_gpu import bench, bench_graph, device_ms


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
        t_iso, t_nat = bench(iso_fn), bench(nat_fn)
        d_iso, d_nat = device_ms(iso_fn), device_ms(nat_fn)
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
        t_iso = bench_graph([lambda a=a, b=b: iso(a, b) for a, b in xw])
        t_nat = bench_graph([lambda a=a, b=b: nat(a, b) for a, b in xw])
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
        t_one, t_each = bench(one), bench(each)
        r = {"case": case, "pieces": len(lengths), "rows": sum(lengths), "channels": ch, "one_launch_ms": t_one,
             "launch_per_piece_ms": t_each, "time_ratio_one_over_per_piece": t_one / t_each, "bitwise_equal": equal}
        log(json.dumps(r))
        rows.append(r)
    return rows
