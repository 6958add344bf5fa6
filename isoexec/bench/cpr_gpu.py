"""The CPR Gated DeltaNet layer against fla's chunkwise and recurrent kernels: per-layer latency of native
mixed, chunkwise everywhere, recurrent everywhere and CPR for trainer 1x10240 (forward, and forward +
backward), prefill 5x2048 and decode 256 x 1 (``cpr_layer.csv``, ``python -m isoexec.bench.gpu cpr``); each
strategy's forward + backward time and gradient error against the fp64 reference (``cpr_backward.csv``,
``cpr`` / ``cpr_backward``); CPR and fla at the Qwen3.5-35B-A3B GDN layer, event- and CUDA-graph-timed
(``cpr_qwen35.csv``, ``cpr_qwen35``); CPR's kernel time by kernel (``cpr_breakdown.csv``, ``profile``); and issue 37's
chunkwise in-chunk candidate against today's CPR and fla (``cpr_chunkwise.csv``, ``cpr_chunkwise``).
:func:`gdn_inputs` makes the random GDN inputs these and the CPR variants of
:mod:`isoexec.bench.variants_gpu` run on."""

from __future__ import annotations

import contextlib
import json
import time

import torch

from isoexec.bench.timing_gpu import bench


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
            "native_mixed": bench(lambda: fla_chunk(q, k, v, g, b, lens)),
            "chunkwise_everywhere": bench(lambda: fla_chunk(q, k, v, g, b, lens)),
            "recurrent_everywhere": bench(lambda: fla_rec(q, k, v, g, b, lens), warmup=5, rep=30),
            "cpr": bench(lambda: t_gdn.cpr_gdn(q, k, v, g, b, lens, [None] * len(lens), C, tc, keep_state=keep)),
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
            ms[name] = bench(fn, warmup=3, rep=20)
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
        "native_mixed": bench(lambda: fla_rec(q, k, v, g, b, lens, h0)),
        "chunkwise_everywhere": bench(lambda: fla_chunk(q, k, v, g, b, lens, h0)),
        "recurrent_everywhere": bench(lambda: fla_rec(q, k, v, g, b, lens, h0)),
        "cpr": bench(cpr_chunk_cycle, warmup=2, rep=20) / C,
    }
    t_one = bench(cpr_one)
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
            row["fwd_bwd_ms"] = bench(fns_big[name], warmup=3, rep=20)
        except Exception as e:  # a strategy without a backward on this stack
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        log(json.dumps(row))
    for r in rows:
        r["fwd_bwd_ratio"] = r["fwd_bwd_ms"] / rows[0]["fwd_bwd_ms"]
    return rows


def cpr_qwen35_table(cfg, log=print, T=8192, hv=32, d=128) -> list[dict]:
    """CPR against fla's chunk kernels at the Qwen3.5-35B-A3B GDN layer (32 value heads, q/k expanded from 16, dims
    ``d``), one sequence of ``T`` tokens: forward and forward + backward (the backward of ``<o, do>``), each timed two
    ways side by side: ``triton.testing.do_bench`` (CUDA events around each call, L2 flushed) and the replay of one
    CUDA graph of the call (:func:`isoexec.bench.timing_gpu.bench_graph`), the timing of QwenLM/FlashQLA's published
    table, so that its figures compare. Each capture follows a warm-up call of the same strategy
    (:func:`isoexec.bench.timing_gpu.capture_graph`), which copies CPR's launch metadata to the device
    (:func:`isoexec.kernels.gdn.triton.device_meta`); a strategy that cannot be captured gets NaN there and its
    error. fla: bf16 q, k, v, beta made before the timed calls (forward, and forward + backward on bf16 leaf
    tensors with a bf16 output gradient), its chunk backward with the Hopper refusal lifted
    (:func:`_fla_gated_chunk_backward_unguarded`, timing only); CPR: fp32 inputs, the forward as the trainer calls it
    (``cpr_trainer``: ``keep_state=False``, no final state, as fla's call) and as prefill does (``cpr_prefill``: the
    state kept in a pool slot), the Triton chunkwise backward.

    Returns one row per (pass, strategy): ``ms_events``, ``ms_graph``, the ratios to fla's, and ``error``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from isoexec.bench.timing_gpu import bench_graph
    from isoexec.kernels.gdn import triton as t_gdn

    C, tc = cfg.kernels.chunk_size, cfg.kernels.triton
    q, k, v, g, b = gdn_inputs(T, hv, d, d)
    cu = torch.tensor([0, T], device="cuda")
    bf = [x.to(torch.bfloat16)[None] for x in (q, k, v)]
    fwd = {"fla_chunk": lambda: chunk_gated_delta_rule(*bf, g=g[None], beta=b.to(torch.bfloat16)[None], cu_seqlens=cu),
           "cpr_trainer": lambda: t_gdn.cpr_gdn(q, k, v, g, b, [T], [None], C, tc, keep_state=False),
           "cpr_prefill": lambda: t_gdn.cpr_gdn(q, k, v, g, b, [T], [None], C, tc)}
    do = torch.randn_like(v)
    cpr_fwd_bwd = _trainer_fwd_bwd(cfg, q, k, v, g, b, [T], do)["cpr"]
    bf_in, do_bf = [*bf, g[None], b.to(torch.bfloat16)[None]], do.to(torch.bfloat16)[None]

    def fla_fwd_bwd():  # on bf16 leaves made before the call: the timed work is fla's kernels
        ins = [x.detach().requires_grad_() for x in bf_in]
        with _fla_gated_chunk_backward_unguarded():
            o = chunk_gated_delta_rule(*ins[:3], g=ins[3], beta=ins[4], cu_seqlens=cu)[0]
            return torch.autograd.grad(o, ins, do_bf)

    passes = {"forward": fwd, "forward+backward": {"fla_chunk": fla_fwd_bwd, "cpr_trainer": cpr_fwd_bwd}}
    rows = []
    for name, fns in passes.items():
        got = {}
        for strat, fn in fns.items():
            row = {"pass": name, "strategy": strat, "shape": f"1x{T} h{hv} d{d}", "ms_events": float("nan"),
                   "ms_graph": float("nan"), "error": ""}
            try:
                row["ms_events"] = bench(fn, warmup=5, rep=30)
                row["ms_graph"] = bench_graph([fn], rounds=4)
            except Exception as e:  # not capturable (or no backward on this stack): recorded, the rest still runs
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            got[strat] = row
            rows.append(row)
        for row in got.values():
            row["events_ratio_to_fla"] = row["ms_events"] / got["fla_chunk"]["ms_events"]
            row["graph_ratio_to_fla"] = row["ms_graph"] / got["fla_chunk"]["ms_graph"]
            log(json.dumps(row))
    return rows


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


def cpr_chunkwise_table(cfg, log=print, H=32, dk=128, dv=128, stages=(("trainer_fwd", [10240]), ("rollout_prefill", [2048] * 5)),
                        B=256) -> list[dict]:
    """Issue 37's chunkwise in-chunk candidate (:mod:`isoexec.kernels.gdn.triton_chunkwise`) against today's CPR and
    fla, side by side (ms, medians of ``triton.testing.do_bench`` as ``cpr_layer.csv``: CPR's host metadata copies
    keep it out of a CUDA graph; ratios from the same run): trainer 1x10240 and
    prefill 5x2048 (both from zero states, no decode state kept, so both CPR paths do the same work), and one decode
    step of 256 sequences (today's: the scan over the running states; the candidate's: the prep over each open
    chunk's rows 0..t and its row of the in-chunk output, t spread over the chunk). Each row says whether the
    candidate's decode rows equal its trainer rows bit for bit (``decode_rows_equal``, at 4 positions of one chunk)
    and how far its outputs are from today's (``rel_diff_vs_cpr``). ``stages``: (name, sequence lengths) of the
    whole-chunk stages; ``B``: decode sequences."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from isoexec.kernels.gdn import triton as t_gdn
    from isoexec.kernels.gdn import triton_chunkwise as cw

    C, tc = cfg.kernels.chunk_size, cfg.kernels.triton
    rows = []
    for name, lens in stages:
        stage = f"{name} {len(lens)}x{lens[0]}"
        q, k, v, g, b = gdn_inputs(sum(lens), H, dk, dv)
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
        bf = [x.to(torch.bfloat16)[None] for x in (q, k, v)]
        cpr = lambda: t_gdn.cpr_gdn(q, k, v, g, b, lens, [None] * len(lens), C, tc, keep_state=False)  # noqa: E731
        cand = lambda: cw.chunkwise_forward(q, k, v, g, b, lens, C, tc)  # noqa: E731
        fla = lambda: chunk_gated_delta_rule(*bf, g=g[None], beta=b.to(torch.bfloat16)[None], cu_seqlens=cu)  # noqa: E731
        o_cpr, o_cand = cpr()[0], cand()
        t = {"cpr": bench(cpr), "chunkwise": bench(cand), "fla_chunk": bench(fla)}
        n = lens[0] // C - 1  # the first sequence's last chunk, seen as decode sees it at 4 positions
        _, _, E = cw._prep_and_chain(k, v, g, b, torch.tensor([[c * C, 0, 0] for c in range(n)], dtype=torch.int32,
                                     device="cuda"), torch.tensor([[0, n, -1, 0]], dtype=torch.int32, device="cuda"),
                                     n, C, tc)
        chunk = [x[n * C:(n + 1) * C] for x in (q, k, v, g, b)]
        ts = [0, C // 3, 2 * C // 3, C - 1]
        dec = cw.open_chunk_rows(*(torch.cat([x] * len(ts)) for x in chunk), E[n - 1:n].expand(len(ts), -1, -1, -1), ts,
                                 C, tc)
        rows.append({"stage": stage, **{f"{kk}_ms": vv for kk, vv in t.items()},
                     "chunkwise_vs_cpr": t["chunkwise"] / t["cpr"], "chunkwise_vs_fla": t["chunkwise"] / t["fla_chunk"],
                     "cpr_vs_fla": t["cpr"] / t["fla_chunk"],
                     "decode_rows_equal": bool(torch.equal(dec, o_cand[n * C + torch.tensor(ts, device="cuda")])),
                     "rel_diff_vs_cpr": float((o_cand - o_cpr).norm() / o_cpr.norm()),
                     "note": "fla in bf16 (as cpr_layer.csv), CPR and the candidate fp32 inputs"})
        log(json.dumps(rows[-1]))
    # one decode step of B sequences
    _, states = t_gdn.cpr_gdn(*gdn_inputs(B * 8, H, dk, dv), [8] * B, [None] * B, C, tc)
    d = gdn_inputs(B, H, dk, dv)
    ch = gdn_inputs(B * C, H, dk, dv)
    ent = torch.randn(B, H, dk, dv, device="cuda") * 0.1
    ts = [(8 + i) % C for i in range(B)]
    # today's step advances the states (a chunk completed in the timed steps runs its resync, 1 step in C)
    rec_step = lambda: t_gdn.cpr_gdn(*d, [1] * B, states, C, tc)  # noqa: E731
    cand_step = lambda: cw.open_chunk_rows(*ch, ent, ts, C, tc)  # noqa: E731
    hq = [x.to(torch.bfloat16)[:, None] for x in d[:3]]
    h0 = torch.zeros(B, H, dk, dv, device="cuda")
    fla_rec = lambda: fused_recurrent_gated_delta_rule(*hq, g=d[3][:, None], beta=d[4].to(torch.bfloat16)[:, None],  # noqa: E731
                                                       initial_state=h0, output_final_state=True)
    t = {"cpr": bench(rec_step, warmup=3, rep=20), "chunkwise": bench(cand_step, warmup=3, rep=20),
         "fla_recurrent": bench(fla_rec, warmup=3, rep=20)}
    rows.append({"stage": f"rollout_decode {B}x1", **{f"{kk}_ms": vv for kk, vv in t.items()},
                 "chunkwise_vs_cpr": t["chunkwise"] / t["cpr"], "chunkwise_vs_fla": t["chunkwise"] / t["fla_recurrent"],
                 "cpr_vs_fla": t["cpr"] / t["fla_recurrent"],
                 "note": "eager; the candidate's step includes the masking copies and the prep of every open chunk, "
                         "not the state pass of a chunk that completes (1 step in C)"})
    log(json.dumps(rows[-1]))
    return rows
