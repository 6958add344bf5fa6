"""One RL step on one GPU, isoexec vs native kernel sets on the same harness: generation through the
unified model's engine path, scoring, and the policy update (forward + backward + optimizer).

"native" here is the unified model's own Python loops with stock kernels (SDPA, fla, cuBLAS), not vLLM:
its generation ratio says how the Triton set compares with stock kernels in this loop, not how IsoExec
compares with a production engine. ``isoexec.bench.vllm_gpu`` measures generation against vLLM's own engine.

``python -m isoexec.bench.rl_step --config experiments/h200-rlstep.yaml --out results/h200/rl_step.csv``

The step (timing names of docs/design.md, Metrics): ``time/generation`` — ``P`` prompts, each sampled ``G`` times
(``rl.prompts_per_step`` x ``rl.group_size`` sequences), prefilled in one engine step and decoded for
``rl.max_new_tokens`` tokens, sampling from the full-vocabulary logprob rows (fixed length, no stop
token, so both sets do the same work); ``time/score`` — the reward (a stand-in verifier: the share of
even token ids in the response) and the pre-update ``trainer_score`` logprobs of the response tokens;
``logprob_abs_diff_*`` / ``mismatch_count`` compare those trainer logprobs with the engine's logprobs of
the sampled tokens (docs/design.md, Metrics); ``time/train`` — GRPO (group-normalised advantages, token-level clipped ratio loss) forward + backward
over the same sequences in micro-batches of ``G`` sequences and one :class:`~isoexec.trainer.optim.MasterAdamW`
step; ``time/step`` — the sum. Engine and trainer are the same in-process model, so there is no weight
sync. Both kernel sets start from the same random weights (random init on the GPU, seed 0) and the same
prompts and sampling seeds; the sets run one after the other (one model and optimizer in memory at a
time), each with one warm-up step of the same shapes (compilation, fla's autotuning) that is left out,
then ``--steps`` timed steps.
The CSV has one row per (kernel set, step) and a ``median`` row per set, plus the ratios isoexec/native.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch


def _sync_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def build_model(cfg, kernel_set: str, seed: int = 0):
    """The unified model of ``cfg.model`` with ``kernel_set`` on ``cfg.device``, parameters drawn on that
    device (normal(0, init_std) matrices, HF-style norms and GDN decay parameters), deterministic in ``seed``."""
    from isoexec.kernels import build_kernel_set
    from isoexec.model.hf import hf_config
    from isoexec.model.unified import UnifiedModel

    dtype, dev = getattr(torch, cfg.model.dtype), cfg.device
    with torch.device(dev):
        model = UnifiedModel.from_config(hf_config(cfg.model), build_kernel_set(kernel_set, dev, cfg.kernels), dtype)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=dev).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, device=dev, generator=gen) * cfg.model.init_std)
    return model


def _sample(lp: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]


def rl_step(model, opt, prompts: list[torch.Tensor], group: int, new_tokens: int, seed: int, clip=(0.2, 0.28)) -> dict:
    """One step; returns the phase times (s) and a few sanity numbers."""
    dev = model.lm_head.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    B = len(prompts) * group
    t0 = _sync_time()
    # ---- generation: prefill every sample's prompt, then decode new_tokens - 1 steps
    caches = [model.new_cache() for _ in range(B)]
    chunks = [p for p in prompts for _ in range(group)]
    lp = torch.cat(model.engine_step(caches, chunks, last_only=True))
    toks = [_sample(lp, gen)]
    roll = [lp.gather(1, toks[-1][:, None])[:, 0]]  # the engine's logprob of each sampled token
    for _ in range(new_tokens - 1):
        lp = torch.cat(model.engine_step(caches, [t.view(1) for t in toks[-1]], last_only=True))
        toks.append(_sample(lp, gen))
        roll.append(lp.gather(1, toks[-1][:, None])[:, 0])
    del caches, lp
    t1 = _sync_time()
    # ---- score: reward, group-normalised advantages, pre-update logprobs of the response tokens
    resp = torch.stack(toks, 1)  # [B, R]
    reward = (resp % 2 == 0).float().mean(1)
    r = reward.view(len(prompts), group)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    seqs = [torch.cat([chunks[b].to(dev), resp[b]]) for b in range(B)]
    micro = [list(range(i, min(i + group, B))) for i in range(0, B, group)]

    def resp_logprobs(idx, grad):
        ids = torch.cat([seqs[b] for b in idx])
        lens = [seqs[b].numel() for b in idx]
        cu = torch.tensor([0] + lens).cumsum(0)
        full = model.trainer_logprobs(ids, cu, grad=grad)
        rows, tgt = [], []
        for j, b in enumerate(idx):
            p0 = int(cu[j]) + chunks[b].numel() - 1  # row predicting the first response token
            rows.append(torch.arange(p0, p0 + new_tokens, device=dev))
            tgt.append(resp[b])
        rows, tgt = torch.cat(rows), torch.cat(tgt)
        return full[rows, tgt].view(len(idx), new_tokens)

    with torch.no_grad():
        old = torch.cat([resp_logprobs(idx, False) for idx in micro])
    t2 = _sync_time()
    d = (old - torch.stack(roll, 1)).abs()  # pre-update trainer logprob vs rollout logprob, per token
    # ---- train: GRPO token-level clipped loss, forward + backward per micro-batch, one optimizer step
    n_tok = B * new_tokens
    loss_sum = 0.0
    for idx in micro:
        new = resp_logprobs(idx, True)
        ratio = torch.exp(new - old[idx])
        a = adv[idx][:, None]
        loss = -torch.minimum(ratio * a, ratio.clamp(1 - clip[0], 1 + clip[1]) * a).sum() / n_tok
        loss.backward()
        loss_sum += float(loss.detach())
        del new, ratio, loss
    grad_norm = opt.step()
    t3 = _sync_time()
    return {"time/generation": t1 - t0, "time/score": t2 - t1, "time/train": t3 - t2, "time/step": t3 - t0,
            "logprob_abs_diff_mean": float(d.mean()), "logprob_abs_diff_max": float(d.max()),
            "mismatch_count": int((d != 0).sum()), "reward_mean": float(reward.mean()), "loss": loss_sum,
            "grad_norm": grad_norm,
            "tokens_generated": B * new_tokens, "tokens_trained": sum(s.numel() for s in seqs)}


def run(config: str, out: str, steps: int = 2, prompt_len: int = 128,
        sets: tuple[str, ...] = ("isoexec", "native"), new_tokens: int | None = None, log=print) -> list[dict]:
    """Both kernel sets, one after the other; writes the CSV and returns its rows. ``new_tokens``
    overrides ``rl.max_new_tokens`` (a shorter smoke run)."""
    from isoexec.config import load_config
    from isoexec.io import write_csv
    from isoexec.trainer.optim import MasterAdamW

    cfg = load_config(config)
    rl = cfg.rl if new_tokens is None else cfg.rl.model_copy(update={"max_new_tokens": new_tokens})
    gen = torch.Generator().manual_seed(0)
    vocab = cfg.model.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen) for _ in range(rl.prompts_per_step)]
    rows = []
    for ks in sets:
        model = build_model(cfg, ks)
        opt = MasterAdamW(model.named_parameters(), lr=rl.lr, max_grad_norm=rl.max_grad_norm)
        cuda = cfg.device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        rl_step(model, opt, prompts, rl.group_size, rl.max_new_tokens, seed=1000)  # compile and autotune at these shapes
        log(f"{ks}: warm-up step {time.perf_counter() - t0:.1f} s")
        for s in range(steps):
            r = rl_step(model, opt, prompts, rl.group_size, rl.max_new_tokens, seed=s)
            r = {"kernel_set": ks, "step": s, **r, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
            log(json.dumps(r))
            rows.append(r)
        del model, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    keys = ["time/generation", "time/score", "time/train", "time/step"]
    med = {}
    for ks in sets:
        rs = [r for r in rows if r["kernel_set"] == ks]
        med[ks] = {k: statistics.median(r[k] for r in rs) for k in keys}
        rows.append({"kernel_set": ks, "step": "median", **med[ks]})
    if set(sets) == {"isoexec", "native"}:
        rows.append({"kernel_set": "isoexec/native", "step": "ratio",
                     **{k: med["isoexec"][k] / med["native"][k] for k in keys}})
        rows[-1]["time/policy_training"] = ((med["isoexec"]["time/score"] + med["isoexec"]["time/train"])
                                            / (med["native"]["time/score"] + med["native"]["time/train"]))
    m = cfg.model
    note = (f"{m.num_hidden_layers} layers (hidden {m.hidden_size}, {m.num_experts} experts top-{m.num_experts_per_tok}, "
            f"vocab {m.vocab_size}); {rl.prompts_per_step} prompts x {rl.group_size} samples, prompt {prompt_len}, "
            f"{rl.max_new_tokens} new tokens")
    for r in rows:
        r["setup"] = note
    write_csv(out, rows)
    from isoexec.io import atomic_write_text
    from isoexec.provenance import provenance

    atomic_write_text(str(out).removesuffix(".csv") + ".provenance.json", json.dumps(
        {"provenance": provenance(), "config": config, "steps": steps, "prompt_len": prompt_len,
         "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
         "kernels": cfg.kernels.model_dump(mode="json")}, indent=2, sort_keys=True, default=str) + "\n")
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/h200-rlstep.yaml")
    p.add_argument("--out", default="results/h200/rl_step.csv")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--sets", default="isoexec,native")
    p.add_argument("--new-tokens", type=int, default=None, help="override rl.max_new_tokens")
    a = p.parse_args()
    run(a.config, a.out, a.steps, a.prompt_len, sets=tuple(a.sets.split(",")), new_tokens=a.new_tokens)
