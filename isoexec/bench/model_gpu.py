"""The unified model's tokens/s on one CUDA device with the isoexec and native kernel sets (trainer scoring
with full-vocabulary logprobs, engine prefill, engine decode), beside the transformers Qwen3-Next model with
fla kernels where it runs: ``model_throughput.csv`` (``python -m isoexec.bench.gpu model``)."""

from __future__ import annotations

import statistics
import time
import traceback

import torch


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
