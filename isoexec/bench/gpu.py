"""GPU gates and benchmarks of the Triton kernel set on one CUDA device.

``python -m isoexec.bench.gpu all --config experiments/h200.yaml --out-dir results/h200``
(``isoexec bench`` dispatches here when the config says ``device: cuda``) writes:

* ``gates.csv`` / ``contract.json``: the bitwise gate matrix of :mod:`isoexec.model.gates` run with
  the model on the GPU, isoexec (Triton) and native (cuBLAS / SDPA / fla) kernel sets.
* ``kernel_bench.csv``: each Triton kernel against its native counterpart at the model's shapes (median
  of ``triton.testing.do_bench``), with the achieved fraction of the bf16 GEMM and copy ceilings
  measured in the same run.
* ``cpr_layer.csv``: the CPR Gated DeltaNet per-layer table (trainer 1x10240, prefill 5x2048, decode
  256 x 1) for native mixed, chunkwise everywhere, recurrent everywhere and CPR.
* ``model_throughput.csv``: the unified model, isoexec vs native kernel sets, and the transformers
  model with fla kernels.
* ``provenance.json``: code version, device, software, ceilings, the commands.
"""

from __future__ import annotations

import json
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
def kernel_table(cfg, ceil: dict, log=print) -> list[dict]:
    """Each Triton kernel vs its native counterpart at the model's shapes (bf16 boundary)."""
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
        r = {"kernel": kernel, "shape": shape, "native": native, "isoexec_ms": t_iso, "native_ms": t_nat,
             "time_ratio_isoexec_over_native": t_iso / t_nat}
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
        log(f"{kernel:28s} {shape:32s} iso {t_iso:8.4f} ms  native {t_nat:8.4f} ms  ratio {t_iso / t_nat:5.2f}")

    key_dim, value_dim = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    gemms = [("gdn.in_proj", 2 * key_dim + 2 * value_dim, m.hidden_size), ("gdn.out_proj", m.hidden_size, value_dim),
             ("attn.qkv_proj(q)", 2 * m.num_attention_heads * m.head_dim, m.hidden_size),
             ("mlp.shared_expert(up)", m.shared_expert_intermediate_size, m.hidden_size), ("square 8192", 8192, 8192)]
    for name, n_out, k in gemms:
        M = 8192 if name == "square 8192" else N
        x = torch.randn(M, k, device=dev, dtype=bf)
        w = torch.randn(n_out, k, device=dev, dtype=bf) * 0.02
        add(f"gemm {name}", f"{M}x{k} @ {k}x{n_out}", lambda: t_gemm.linear(x, w, tc), lambda: F.linear(x, w),
            flops=2 * M * n_out * k, native="cublas F.linear")
    for M in (256, 1):
        x = torch.randn(M, m.hidden_size, device=dev, dtype=bf)
        w = torch.randn(2 * key_dim + 2 * value_dim, m.hidden_size, device=dev, dtype=bf)
        add("gemm gdn.in_proj (decode)", f"{M}x{m.hidden_size} @ {m.hidden_size}x{w.shape[0]}", lambda: t_gemm.linear(x, w, tc),
            lambda: F.linear(x, w), flops=2 * M * w.shape[0] * m.hidden_size, bytes_=w.numel() * 2, native="cublas F.linear")
    x = torch.randn(4096, m.hidden_size, device=dev, dtype=bf)
    w = torch.randn(m.vocab_size, m.hidden_size, device=dev, dtype=bf) * 0.02
    add("gemm lm_head (fp32 out)", f"4096x{m.hidden_size} @ {m.hidden_size}x{m.vocab_size}",
        lambda: t_gemm.linear(x, w, tc, torch.float32), lambda: F.linear(x, w).float(), flops=2 * 4096 * m.vocab_size * m.hidden_size,
        native="cublas F.linear + .float()")
    E, I = m.num_experts, m.moe_intermediate_size
    counts = [N * m.num_experts_per_tok // E] * E
    xs = torch.randn(sum(counts), m.hidden_size, device=dev, dtype=bf)
    W = torch.randn(E, I, m.hidden_size, device=dev, dtype=bf) * 0.02

    def nat_grouped():
        r0 = 0
        for e, c in enumerate(counts):
            F.linear(xs[r0 : r0 + c], W[e])
            r0 += c

    add("grouped gemm moe.experts(up)", f"{E}x[{counts[0]}x{m.hidden_size} @ {m.hidden_size}x{I}]",
        lambda: t_gemm.grouped_linear(xs, W, counts, tc), nat_grouped, flops=2 * sum(counts) * I * m.hidden_size,
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
    add("attention prefill", "5x2048 causal, 8q/2kv heads, d128", lambda: t_attn.attention(q, kv, [0] * 5, lens, cfg.kernels.kv_block, tc.attn_block_m),
        lambda: native_attention(q, kv, [0] * 5, lens), flops=fl, native="SDPA per sequence")
    B, L = 256, 2048
    qd = torch.randn(B, hq, d, device=dev, dtype=bf)
    kvd = [(torch.randn(L, hkv, d, device=dev, dtype=bf), torch.randn(L, hkv, d, device=dev, dtype=bf)) for _ in range(B)]
    add("attention decode", f"{B} seqs x 1 query, cache {L}", lambda: t_attn.attention(qd, kvd, [L - 1] * B, [1] * B, cfg.kernels.kv_block, tc.attn_block_m),
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
def cpr_table(cfg, log=print, hq=16, hv=32, dk=128, dv=128) -> list[dict]:
    """CPR per-layer latency (ms) for the blog's three stages and four strategies; q/k expanded to hv heads."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from isoexec.kernels.gdn import triton as t_gdn

    C, tc = cfg.kernels.chunk_size, cfg.kernels.triton
    dev = "cuda"
    H = hv

    def inputs(T):
        q = torch.nn.functional.normalize(torch.randn(T, H, dk, device=dev), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(T, H, dk, device=dev), dim=-1)
        v = torch.randn(T, H, dv, device=dev)
        g = torch.nn.functional.logsigmoid(torch.randn(T, H, device=dev)) * 0.1
        b = torch.rand(T, H, device=dev)
        return q, k, v, g, b

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


# ------------------------------------------------------------------------------------------ tune
def tune(cfg, log=print) -> tuple[list[dict], dict]:
    """Pick the deployment's fixed Triton constants once (never per call, never from M): bf16 GEMM
    tiles and the CPR launch constants, by the median time on the benchmark shapes.

    Returns:
        (rows, chosen ``kernels.triton`` fields): write the fields into the experiment YAML's
        ``kernels.triton`` section to pin them (the contract records them).
    """
    import torch.nn.functional as F

    from isoexec.kernels.gdn import triton as t_gdn
    from isoexec.kernels.gemm import triton as t_gemm

    rows, tc = [], cfg.kernels.triton
    shapes = [(8192, 8192, 8192), (10240, 6144, 1024), (10240, 1024, 2048)]
    xs = {s: (torch.randn(s[0], s[2], device="cuda", dtype=torch.bfloat16),
              torch.randn(s[1], s[2], device="cuda", dtype=torch.bfloat16)) for s in shapes}
    best = None
    for tiles in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)):
        cand = tc.model_copy(update={"gemm_bfloat16": tiles})
        try:
            ts = [_bench(lambda: t_gemm.linear(*xs[s], cand)) / _bench(lambda: F.linear(*xs[s])) for s in shapes]
        except Exception as e:  # e.g. out of shared memory
            log(f"gemm tiles {tiles}: {type(e).__name__}")
            continue
        score = statistics.geometric_mean(ts)
        rows.append({"what": "gemm_bf16", "config": ",".join(map(str, tiles)), "ratio_vs_cublas_geomean": score,
                     **{f"ratio_{s[0]}x{s[1]}x{s[2]}": t for s, t in zip(shapes, ts)}})
        log(json.dumps(rows[-1]))
        if best is None or score < best[0]:
            best = (score, tiles)
    tc = tc.model_copy(update={"gemm_bfloat16": best[1]})
    H, T, C = 32, 10240, cfg.kernels.chunk_size
    q = F.normalize(torch.randn(T, H, 128, device="cuda"), dim=-1)
    k = F.normalize(torch.randn(T, H, 128, device="cuda"), dim=-1)
    v = torch.randn(T, H, 128, device="cuda")
    g = F.logsigmoid(torch.randn(T, H, device="cuda")) * 0.1
    b = torch.rand(T, H, device="cuda")
    for names, variants in ((("gdn_scan_bv", "gdn_scan_warps"), ((8, 1), (16, 2), (32, 4), (64, 4))),
                            (("gdn_chain_bv", "gdn_chain_warps"), ((32, 4), (16, 4), (64, 8))),
                            (("gdn_prep_warps",), ((4,), (8,)))):
        best = None
        for vals in variants:
            cand = tc.model_copy(update=dict(zip(names, vals)))
            try:
                ms = _bench(lambda: t_gdn.cpr_gdn(q, k, v, g, b, [T], [None], C, cand, keep_state=False))
            except Exception as e:  # e.g. out of resources for this tile
                log(f"{names}={vals}: {type(e).__name__}")
                continue
            rows.append({"what": "cpr_trainer_fwd_1x10240_h32", "config": ",".join(f"{n}={v_}" for n, v_ in zip(names, vals)), "ms": ms})
            log(json.dumps(rows[-1]))
            if best is None or ms < best[0]:
                best = (ms, vals)
        tc = tc.model_copy(update=dict(zip(names, best[1])))
    chosen = tc.model_dump(mode="json")
    log(f"tuned kernels.triton: {chosen}")
    return rows, chosen


# ------------------------------------------------------------------------------------- profile
def cpr_breakdown(cfg, log=print, H=32) -> list[dict]:
    """Where CPR's time goes: CUDA kernel time by kernel (torch.profiler) for trainer 1x10240,
    prefill 5x2048 and 64 decode steps of 256 sequences (one chunk cycle, one resync)."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from isoexec.kernels.gdn import triton as t_gdn

    C, tc = cfg.kernels.chunk_size, cfg.kernels.triton

    def inputs(T):
        return (F.normalize(torch.randn(T, H, 128, device="cuda"), dim=-1), F.normalize(torch.randn(T, H, 128, device="cuda"), dim=-1),
                torch.randn(T, H, 128, device="cuda"), F.logsigmoid(torch.randn(T, H, device="cuda")) * 0.1,
                torch.rand(T, H, device="cuda"))

    rows = []
    a = inputs(10240)
    b = inputs(10240)
    d = inputs(256)
    _, states = t_gdn.cpr_gdn(*inputs(256 * 8), [8] * 256, [None] * 256, C, tc)

    def decode_cycle():
        nonlocal states
        for _ in range(C):
            _, states = t_gdn.cpr_gdn(*d, [1] * 256, states, C, tc)

    stages = {"trainer_fwd 1x10240": lambda: t_gdn.cpr_gdn(*a, [10240], [None], C, tc, keep_state=False),
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
        for kname, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:8]:
            rows.append({"stage": stage, "kernel": kname[:60], "device_ms": ms, "wall_ms_profiled": wall})
            log(json.dumps(rows[-1]))
    return rows


# ----------------------------------------------------------------------------------------- entry
def gpu_bench_command(config: str = "experiments/h200.yaml", out_dir: str | None = None, what: str = "bench") -> None:
    """Run on a CUDA device: ``what`` in {"tune", "gates", "bench", "all"}; writes under ``out_dir`` (default results/<exp>).

    ``tune`` picks the deployment's fixed Triton constants once and writes ``tuned.yaml``, the
    experiment config with those constants in ``kernels.triton`` (pass it as ``--config`` to the later
    stages, or copy the section into the experiment); gates and benchmarks run with the constants of
    the config they are given."""
    from isoexec.config import load_config
    from isoexec.io import atomic_write_text, write_csv
    from isoexec.provenance import provenance

    cfg = load_config(config)
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
    if what == "tune":
        import yaml

        rows, chosen = tune(cfg, log)
        write_csv(out / "tune.csv", rows)
        prov["tuned"] = chosen
        tuned = cfg.model_dump(mode="json", exclude_none=True)
        tuned["kernels"]["triton"] = chosen
        atomic_write_text(out / "tuned.yaml", yaml.safe_dump(tuned, sort_keys=False))
    if what == "profile":
        write_csv(out / "cpr_breakdown.csv", cpr_breakdown(cfg, log))
    if what in ("gates", "all"):
        prov["gates"] = gpu_gates(cfg, out, log)
    if what in ("bench", "all"):
        steps = {}
        ceil = ceilings()
        prov["ceilings"] = ceil
        log(f"ceilings: {ceil}")
        for name, fn in (("kernel_bench", lambda: kernel_table(cfg, ceil, log)), ("cpr_layer", lambda: cpr_table(cfg, log)),
                         ("model_throughput", lambda: model_table(cfg, log))):
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
    p.add_argument("what", choices=["tune", "gates", "bench", "profile", "all"])
    p.add_argument("--config", default="experiments/h200.yaml")
    p.add_argument("--out-dir", default=None)
    a = p.parse_args()
    gpu_bench_command(a.config, a.out_dir, a.what)
    sys.exit(0)
