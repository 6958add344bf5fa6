"""The unified model's tokens/s on one CUDA device with the isoexec and native kernel sets (trainer scoring
with full-vocabulary logprobs, engine prefill, engine decode), beside the transformers Qwen3-Next model with
fla kernels where it runs: ``model_throughput.csv`` (``python -m isoexec.bench.gpu model``)."""

from __future__ import annotations

import json
import statistics
import time
import traceback

import torch


def _inputs(vocab: int, batch: int, seq_len: int, decode_seqs: int, prompt: int) -> tuple:
    """The tables' random tokens (seed 0, CPU int64): ``batch`` sequences of ``seq_len``, ``decode_seqs`` prompts of
    ``prompt``, the sequences packed (``[batch * seq_len]``) and their ``cu_seqlens``."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (seq_len,), generator=gen) for _ in range(batch)]
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen) for _ in range(decode_seqs)]
    return seqs, prompts, torch.cat(seqs), torch.tensor([0] + [seq_len] * batch).cumsum(0)


def _decode_steps(model, prompts: list, steps: int) -> tuple[float, torch.Tensor]:
    """The prompts' prefill (untimed), then ``steps`` decode steps of their last token: (seconds of the steps, the last
    step's ``[len(prompts), V]`` fp32 rows)."""
    caches = [model.new_cache() for _ in prompts]
    model.engine_step(caches, prompts, last_only=True)
    tok = [p[-1:] for p in prompts]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        lp = torch.cat(model.engine_step(caches, tok, last_only=True))
    torch.cuda.synchronize()
    return time.perf_counter() - t0, lp


def model_table(cfg, log=print, batch=8, seq_len=1024, decode_seqs=64, decode_steps=16, prompt=128) -> list[dict]:
    """Unified model tokens/s with isoexec vs native kernel sets, and transformers + fla where it runs."""
    from isoexec.model.build import random_model
    from isoexec.model.hf import hf_config

    vocab = cfg.model.vocab_size
    seqs, prompts, ids, cu = _inputs(vocab, batch, seq_len, decode_seqs, prompt)

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
            return _decode_steps(model, prompts, decode_steps)[0]

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


def before_rules(kernels):
    """``kernels`` (an ``isoexec.config.KernelSection``) with the leaf GEMM's launch rules of issue 37's filing (da43962):
    one pinned program for every leaf width and row count (``pik_loop: flat``, no ``pik_bfloat16_by_leaf_k``); every other
    constant as given. Same bits: the rules move none (``results/h200/leaf_gemm/``)."""
    tc = kernels.triton.model_copy(update={"pik_loop": "flat", "pik_bfloat16_by_leaf_k": ()})
    return kernels.model_copy(update={"triton": tc})


def _fwd_bwd(model, ids, cu, nxt) -> torch.Tensor:
    """``trainer_fwd_bwd``: full-vocabulary logprobs with grad of the packed ``ids`` (``cu`` their cu_seqlens), then
    the backward of the next tokens' (``nxt`` ``[N, 1]``) summed logprob; returns the lm_head's weight gradient."""
    model.zero_grad(set_to_none=True)
    model.trainer_logprobs(ids, cu, grad=True).gather(1, nxt).sum().backward()
    return model.lm_head.weight.grad


def model_before_after(cfg, log=print, batch=8, seq_len=1024, decode_seqs=256, decode_steps=16, prompt=128,
                       reps=3) -> list[dict]:
    """The whole model (``cfg.model``, random weights of :func:`isoexec.bench.rl_step.build_model`, seed 0) per case,
    the native kernel set (cuBLAS, SDPA, fla: the same model code, not vLLM) and the isoexec set with the leaf GEMM's
    launch rules of issue 37's filing (``before``, :func:`before_rules`) and of ``cfg`` (``after``).

    Cases (seconds per call, median of ``reps``): ``trainer_score`` (``batch`` x ``seq_len`` packed, full-vocabulary
    logprobs, no grad), ``trainer_fwd_bwd`` (the same with grad, then the backward of the sampled tokens' summed
    logprob: a trainer step's kernels without the optimizer, which is the same in every arm), ``engine_prefill``
    (``batch`` prompts of ``seq_len``), ``engine_decode`` (``decode_seqs`` sequences x ``decode_steps`` steps after
    ``prompt``-token prompts, the prefill untimed, eager; 256 sequences: the rows at which the decode rules differ)
    and ``engine_decode_graphs`` (the same under the isoexec set's CUDA graphs, as the
    vLLM plugin decodes; the native set has no slot kernels, so no graphs). ``before`` and ``after`` run on one model
    (its kernel set swapped), alternating rep by rep; native on a model of the same weights before them. Each row also
    says whether before and after gave the same bits (two wrapping int64 sums of the case's fp32 output's bit
    patterns, plain and weighted by position, computed on the device)."""
    from isoexec.bench.rl_step import build_model
    from isoexec.kernels import build_kernel_set

    vocab = cfg.model.vocab_size
    seqs, prompts, ids, cu = _inputs(vocab, batch, seq_len, decode_seqs, prompt)
    nxt = torch.cat([ids[1:], ids[:1]]).cuda()[:, None]

    def digest(t) -> str:  # on the device, in pieces: the outputs are GBs (trainer_score 8192 x 248320 fp32)
        bits = t.detach().float().contiguous().view(torch.int32).view(-1)
        plain = weighted = 0
        for a in range(0, bits.numel(), 1 << 26):
            b = bits[a:a + (1 << 26)].to(torch.int64)
            pos = torch.arange(a + 1, a + 1 + b.numel(), device=b.device, dtype=torch.int64)
            plain, weighted = plain + int(b.sum()), weighted + int((b * pos).sum())
        return f"{plain}:{weighted}"  # two sums of the bit patterns, plain and by position

    def cases(model, graphs: bool) -> dict:
        def score():
            return model.trainer_logprobs(ids, cu)

        def fwd_bwd():
            return _fwd_bwd(model, ids, cu, nxt)

        def prefill():
            return torch.cat(model.engine_step([model.new_cache() for _ in seqs], seqs, last_only=True))

        def decode():
            return _decode_steps(model, prompts, decode_steps)

        c = {"trainer_score": score, "trainer_fwd_bwd": fwd_bwd, "engine_prefill": prefill, "engine_decode": decode}
        if graphs:
            c["engine_decode_graphs"] = decode
        return c

    def timed(fn) -> tuple[float, str]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if isinstance(out, tuple):  # a case that times itself (decode: the steps without the prefill)
            dt, out = out
        return dt, digest(out)

    res: dict[str, dict[str, list]] = {}
    model = build_model(cfg, "native")
    for case, fn in cases(model, False).items():
        try:
            timed(fn)  # warm-up: JIT, autotuning, allocations
            res.setdefault(case, {})["native"] = [timed(fn) for _ in range(reps)]
            log(f"model native {case}: {res[case]['native']}")
        except Exception as e:  # e.g. out of memory: the other cases still run
            log(f"model native {case}: {type(e).__name__}: {str(e)[:300]}")
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    model = build_model(cfg, "isoexec")
    sets = {"after": model.kernels, "before": build_kernel_set("isoexec", cfg.device, before_rules(cfg.kernels))}

    graphs = {}

    def use(arm: str, case: str):  # the arm's kernel set, and its own decode graphs (captured with that set)
        model.kernels = sets[arm]
        model.decode_graphs = graphs.get(arm) if case == "engine_decode_graphs" else None
        if case == "engine_decode_graphs" and arm not in graphs:
            graphs[arm] = model.enable_decode_graphs(max_seqs=decode_seqs, max_len=prompt + decode_steps + 8,
                                                     sizes=[decode_seqs])

    for case in cases(model, True):
        try:
            for arm in ("after", "before"):
                use(arm, case)
                timed(cases(model, True)[case])  # warm-up (captures the graphs)
                res.setdefault(case, {})[arm] = []
            for _ in range(reps):
                for arm in ("after", "before"):
                    use(arm, case)
                    res[case][arm].append(timed(cases(model, True)[case]))
            log(f"model isoexec {case}: after {res[case]['after']} before {res[case]['before']}")
        except Exception as e:  # e.g. out of memory: the other cases still run
            log(f"model isoexec {case}: {type(e).__name__}: {str(e)[:300]}")
            res.setdefault(case, {}).pop("after", None)
            res[case].pop("before", None)
        torch.cuda.empty_cache()
    model.decode_graphs = None
    for arm, dg in graphs.items():  # replays vs eager steps: the graph rows ran under the graphs
        log(f"decode graphs {arm}: {dg.stats}")
    rows = []
    ntok = {"trainer_score": batch * seq_len, "trainer_fwd_bwd": batch * seq_len, "engine_prefill": batch * seq_len,
            "engine_decode": decode_seqs * decode_steps, "engine_decode_graphs": decode_seqs * decode_steps}
    nan = float("nan")
    for case, arms in res.items():
        med = {a: statistics.median(t for t, _ in v) for a, v in arms.items() if v}
        bits = {a: {d for _, d in v} for a, v in arms.items() if v}
        r = {"case": case, "tokens": ntok[case], **{f"{a}_s": med.get(a, nan) for a in ("native", "before", "after")}}
        r.update({"after_over_before": r["after_s"] / r["before_s"], "before_over_native": r["before_s"] / r["native_s"],
                  "after_over_native": r["after_s"] / r["native_s"],
                  "before_after_same_bits": bits["before"] == bits["after"] if "before" in bits and "after" in bits else None,
                  "isoexec_native_same_bits": bits["after"] == bits["native"] if "after" in bits and "native" in bits else None})
        if case == "engine_decode_graphs":
            r["graph_replays_eager_steps"] = "; ".join(f"{a} {dg.stats['replays']}/{dg.stats['eager_steps']}"
                                                      for a, dg in graphs.items())
        rows.append(r)
        log(json.dumps(r))
    return rows


def model_profile(cfg, log=print, batch=8, seq_len=1024, top=25) -> list[dict]:
    """Where the whole model's trainer time goes, per kernel set: ``trainer_score`` and ``trainer_fwd_bwd`` of
    :func:`model_before_after` (``batch`` x ``seq_len`` packed, random weights, seed 0) once each under
    ``torch.profiler`` after a warm-up call, on ``cfg.device`` (CUDA, or the CPU for a smoke run).

    Returns:
        Per (kernel set, case), the ``top`` operators and kernels by self time on the device (by self CPU time on a
        CPU run): ``set``, ``case``, ``op`` (torch's event name, cut to 80 characters), ``calls``, ``self_device_ms``
        and ``self_cpu_ms`` (milliseconds, summed over calls), and ``wall_ms``, the profiled call's wall time. The
        CPU time of Python-level loops shows in ``self_cpu_ms`` of their ops; a host-bound backward has a wall time
        well above its device time.
    """
    from torch.profiler import ProfilerActivity, profile

    from isoexec.bench.rl_step import build_model

    cuda = cfg.device == "cuda"
    rows = []
    for kernel_set in ("native", "isoexec"):
        model = build_model(cfg, kernel_set)
        _, _, ids, cu = _inputs(model.config.vocab_size, batch, seq_len, 1, 1)
        nxt = torch.cat([ids[1:], ids[:1]]).to(cfg.device)[:, None]

        cases = {"trainer_score": lambda: model.trainer_logprobs(ids, cu),
                 "trainer_fwd_bwd": lambda: _fwd_bwd(model, ids, cu, nxt)}  # this iteration's model and inputs
        for case, fn in cases.items():
            fn()  # warm-up: JIT, autotuning, allocations
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                fn()
                if cuda:
                    torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            ev = [(e.key, e.count, e.self_device_time_total / 1e3, e.self_cpu_time_total / 1e3) for e in prof.key_averages()]
            for key, calls, dev_ms, cpu_ms in sorted(ev, key=lambda e: -(e[2] if cuda else e[3]))[:top]:
                rows.append({"set": kernel_set, "case": case, "op": key[:80], "calls": calls, "self_device_ms": dev_ms,
                             "self_cpu_ms": cpu_ms, "wall_ms": wall})
                log(json.dumps(rows[-1]))
        del model
        if cuda:
            torch.cuda.empty_cache()
    return rows
