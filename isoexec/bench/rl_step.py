"""One RL step on one GPU, isoexec vs native: generation, scoring, and the policy update (forward + backward +
optimizer), with the generation either in the unified model's own loop (the harness) or in vLLM.

``python -m isoexec.bench.rl_step --config experiments/h200-rlstep.yaml --engine vllm --out results/h200-vllm/rl_step.csv``

Two engines (``--engine``):

- ``vllm``: each arm is a vLLM engine and the unified model as the trainer, in one worker process: the native arm
  generates with vLLM's own Qwen3-Next at its best settings (torch.compile, CUDA graphs, FlashAttention, its Triton
  GDN and fused MoE) and trains the unified model with stock kernels (SDPA, fla, cuBLAS); the isoexec arm generates
  with vLLM and the isoexec plugin (its decode CUDA graphs on) and trains with the Triton set. Both load one random
  checkpoint (:func:`make_checkpoint`) and compare what they loaded before the first step;
  after each update the weights go to the engine through ``RolloutEngine.sync_weights`` (the checked path: contract
  handshake, transfer, checksums on both sides; ``time/weight_sync``). This is the generation ratio to compare with
  a production engine. The two syncs are the checked paths, not a production transfer, and not the same work:
  native's reloads through vLLM and compares what the forward reads with a second model vLLM builds from the same
  tensors; isoexec's copies in place and compares checksums.
- ``harness``: generation through the unified model's own ``engine_step`` loop with either kernel set. Its
  "native" is that loop with stock kernels, not vLLM: its generation ratio says how the Triton set compares with
  stock kernels in this loop, not how IsoExec compares with a production engine.

The step (timing names of docs/design.md, Metrics): ``time/generation`` — ``P`` prompts, each sampled ``G`` times
(``rl.prompts_per_step`` x ``rl.group_size`` sequences) for ``rl.max_new_tokens`` tokens (fixed length, EOS
ignored, so both arms do the same work); ``time/score`` — the reward (a stand-in verifier: the share of even token
ids in the response) and the pre-update ``trainer_score`` logprobs of the response tokens;
``logprob_abs_diff_*`` / ``mismatch_count`` compare those trainer logprobs with the engine's logprobs of the
sampled tokens (docs/design.md, Metrics); ``time/train`` — GRPO (group-normalised advantages, token-level clipped
ratio loss) forward + backward over the same sequences in micro-batches of ``G`` sequences and one
:class:`~isoexec.trainer.optim.MasterAdamW` step; ``time/step`` — the sum of the phases (with vLLM the weight sync
included, as in :func:`isoexec.rl.loop.rl_step`). Both arms start from the
same random weights (seed 0) and the same prompts and sampling seeds; the arms run one after the other (one arm's
model, optimizer and engine in memory at a time), each with one untimed warm-up step of the same shapes
(compilation, autotuning, graph capture), then ``--steps`` timed steps.
The CSV has one row per (arm, step) and a ``median`` row per arm, plus the ratios isoexec/native.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from isoexec.bench.workers import Worker, WorkerError, engine_args, serve


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


def make_checkpoint(cfg, folder: Path) -> Path:
    """Random weights of ``cfg.model`` (:func:`build_model`, seed 0, on ``cfg.device``)
    saved as a Hugging Face checkpoint in ``folder`` (kept: a second run reuses it)."""
    if (folder / "model.safetensors").exists():
        return folder
    model = build_model(cfg, "isoexec").to("cpu")
    model.save_pretrained(folder)
    del model
    if torch.cuda.is_available():  # the engines and trainers of the run need this process's cached blocks
        gc.collect()
        torch.cuda.empty_cache()
    return folder


def _sample(lp: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]


def generate_local(model, prompts: list[torch.Tensor], group: int, new_tokens: int, seed: int):
    """Generation through the model's own engine path: every sample's prompt prefilled in one ``engine_step``, then
    ``new_tokens - 1`` decode steps, sampling from the full-vocabulary rows.

    Returns:
        ``(chunks, resp, roll)``: the ``B = len(prompts) * group`` prompts (each prompt ``group`` times, in order),
        ``resp`` ``[B, new_tokens]`` int64 sampled ids and ``roll`` ``[B, new_tokens]`` fp32, the engine's logprob of
        each sampled token (on the model's device).
    """
    dev = model.lm_head.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    caches = [model.new_cache() for _ in range(len(prompts) * group)]
    chunks = [p for p in prompts for _ in range(group)]
    lp = torch.cat(model.engine_step(caches, chunks, last_only=True))
    toks = [_sample(lp, gen)]
    roll = [lp.gather(1, toks[-1][:, None])[:, 0]]
    for _ in range(new_tokens - 1):
        lp = torch.cat(model.engine_step(caches, [t.view(1) for t in toks[-1]], last_only=True))
        toks.append(_sample(lp, gen))
        roll.append(lp.gather(1, toks[-1][:, None])[:, 0])
    return chunks, torch.stack(toks, 1), torch.stack(roll, 1).float()


def generate_engine(eng, prompts: list[torch.Tensor], group: int, new_tokens: int, seed: int, dev):
    """Generation through a vLLM :class:`~isoexec.engines.vllm_engine.RolloutEngine` (fixed length: EOS ignored), the
    same outputs as :func:`generate_local` (``resp`` and ``roll`` moved to ``dev``).

    Raises:
        RuntimeError: a response of another length than ``new_tokens``.
    """
    groups = eng.generate([p.tolist() for p in prompts], n=group, max_tokens=new_tokens, seed=seed, ignore_eos=True,
                          temperature=float(eng.kernels.temperature))  # the trainers' temperature, both modes
    comps = [c for g in groups for c in g]
    bad = [len(c.token_ids) for c in comps if len(c.token_ids) != new_tokens]
    if bad:
        raise RuntimeError(f"the engine returned responses of {sorted(set(bad))} tokens, asked for {new_tokens}")
    resp = torch.tensor([c.token_ids for c in comps], dtype=torch.long, device=dev)
    roll = torch.stack([c.logprobs for c in comps]).to(dev, torch.float32)
    return [p for p in prompts for _ in range(group)], resp, roll


def policy_update(model, opt, chunks: list[torch.Tensor], resp: torch.Tensor, roll: torch.Tensor, group: int,
                  clip=(0.2, 0.28)) -> dict:
    """Score (reward, group-normalised advantages, pre-update ``trainer_score`` logprobs of the response tokens,
    compared with the rollout's ``roll``) and train (GRPO token-level clipped loss, forward + backward per
    micro-batch of ``group`` sequences, one optimizer step) on :func:`generate_local`'s outputs.

    Returns:
        ``time/score``, ``time/train`` (s) and the step's numbers (module docstring).
    """
    dev = model.lm_head.weight.device
    B, new_tokens = resp.shape
    t1 = _sync_time()
    reward = (resp % 2 == 0).float().mean(1)
    r = reward.view(B // group, group)
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
    d = (old.float() - roll).abs()  # pre-update trainer logprob vs rollout logprob, per token
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
    return {"time/score": t2 - t1, "time/train": t3 - t2,
            "logprob_abs_diff_mean": float(d.mean()), "logprob_abs_diff_max": float(d.max()),
            "mismatch_count": int((d != 0).sum()), "reward_mean": float(reward.mean()), "loss": loss_sum,
            "grad_norm": grad_norm, "tokens_generated": B * new_tokens, "tokens_trained": sum(s.numel() for s in seqs)}


def rl_step(model, opt, prompts: list[torch.Tensor], group: int, new_tokens: int, seed: int, clip=(0.2, 0.28),
            engine=None) -> dict:
    """One step: :func:`generate_local` (``engine`` None) or :func:`generate_engine`, then :func:`policy_update`, and
    with an engine the weight sync (``RolloutEngine.sync_weights``, its checked path: contract handshake, transfer,
    checksums on both sides). Returns the phase times (s) and the step's numbers; ``time/step`` is their sum, as in
    :func:`isoexec.rl.loop.rl_step`."""
    from isoexec.trainer.base import sync_state

    t0 = _sync_time()
    if engine is None:
        chunks, resp, roll = generate_local(model, prompts, group, new_tokens, seed)
    else:
        chunks, resp, roll = generate_engine(engine, prompts, group, new_tokens, seed, model.lm_head.weight.device)
    t1 = _sync_time()
    row = {"time/generation": t1 - t0, **policy_update(model, opt, chunks, resp, roll, group, clip)}
    if engine is not None:
        t2 = _sync_time()
        engine.sync_weights(sync_state(model), model.contract() if engine.mode == "isoexec" else None)
        row["time/weight_sync"] = _sync_time() - t2
    row["time/step"] = sum(row[k] for k in ("time/generation", "time/score", "time/train", "time/weight_sync") if k in row)
    return row


def local_arm(cfg, kernel_set: str, prompts: list[torch.Tensor], rl, steps: int, log=print) -> list[dict]:
    """One kernel set on the harness: the model built in this process (:func:`build_model`), one untimed warm-up
    step (compilation, fla's autotuning), then ``steps`` timed :func:`rl_step` rows."""
    from isoexec.trainer.optim import MasterAdamW

    model = build_model(cfg, kernel_set)
    opt = MasterAdamW(model.named_parameters(), lr=rl.lr, max_grad_norm=rl.max_grad_norm)
    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rl_step(model, opt, prompts, rl.group_size, rl.max_new_tokens, seed=1000)
    log(f"{kernel_set}: warm-up step {time.perf_counter() - t0:.1f} s")
    rows = []
    for s in range(steps):
        r = rl_step(model, opt, prompts, rl.group_size, rl.max_new_tokens, seed=s)
        rows.append({"kernel_set": kernel_set, "engine": "harness", "step": s, **r,
                     "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None})
        log(json.dumps(rows[-1]))
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def rl_arm_main(conn: Any, config: str, checkpoint: str, mode: str, engine: dict[str, Any]) -> None:
    """Worker target: one arm of ``--engine vllm``, engine and trainer in this process: a
    :class:`~isoexec.engines.vllm_engine.RolloutEngine` of ``mode`` (settings ``engine``; built first, while the
    GPU's memory is free) and the unified model of ``mode``'s kernel set with :class:`~isoexec.trainer.optim.MasterAdamW`
    (the config's ``rl`` settings), both from ``checkpoint``. Before the first step, what the two loaded is
    compared (``weight_sync.check_weights_at_load``). Command: ``step`` (:func:`rl_step` with the engine:
    its row, plus the process's peak GPU memory in GiB).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    def build():
        from types import SimpleNamespace

        from isoexec.config import EngineSection, load_config
        from isoexec.engines.vllm_engine import RolloutEngine
        from isoexec.engines.weight_sync import check_weights_at_load, state_checksums
        from isoexec.model import UnifiedModel
        from isoexec.trainer.base import sync_state
        from isoexec.trainer.optim import MasterAdamW

        cfg = load_config(config)
        t0 = time.perf_counter()
        eng = RolloutEngine(checkpoint, mode, EngineSection(**engine), cfg.kernels, seed=0)
        t1 = time.perf_counter()
        model = UnifiedModel.from_pretrained(checkpoint, kernel_set=mode, kernels=cfg.kernels, device=cfg.device)
        opt = MasterAdamW(model.named_parameters(), lr=cfg.rl.lr, max_grad_norm=cfg.rl.max_grad_norm)
        at_load = check_weights_at_load(eng.load_checksums, state_checksums(sync_state(model)))
        return SimpleNamespace(engine=eng, model=model, opt=opt, start_report={
            "engine_start_s": t1 - t0, "trainer_load_s": time.perf_counter() - t1, "weights_at_load": at_load})

    def step(arm: Any, prompts: list[list[int]], group: int, new_tokens: int, seed: int) -> dict[str, Any]:
        dev = arm.model.lm_head.weight.device
        row = rl_step(arm.model, arm.opt, [torch.tensor(p, dtype=torch.long, device=dev) for p in prompts],
                      group, new_tokens, seed, engine=arm.engine)
        if torch.cuda.is_available():
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return row

    serve(conn, build, {"step": step})


def vllm_arm(config: str, cfg, kernel_set: str, checkpoint: str, prompts: list[torch.Tensor], rl, steps: int,
             log=print) -> tuple[list[dict], dict]:
    """One kernel set with vLLM as the engine: vLLM native (its own Qwen3-Next at its best settings, torch.compile
    and CUDA graphs) for ``native``, vLLM with the isoexec plugin for ``isoexec``, and the unified model of that
    kernel set as the trainer, both loaded from ``checkpoint`` in one worker process
    (:func:`rl_arm_main`); an untimed warm-up step, then ``steps`` timed rows.

    Returns:
        ``(rows, arm)``: the timed rows, and the arm's engine settings, start report (engine start, trainer load, the
        weights both sides loaded) and, if it failed, why (its rows so far are kept).
    """
    B = rl.prompts_per_step * rl.group_size
    settings = engine_args(cfg.device == "cuda", kernel_set, False, B, len(prompts[0]) + rl.max_new_tokens + 64,
                           kv_gib=2)
    w = Worker(f"rl-{kernel_set}", rl_arm_main, config, checkpoint, kernel_set, settings)
    rows, arm = [], {"engine_settings": settings}
    try:
        info = w.ready(1800)
        arm.update(info)
        log(json.dumps({"arm": kernel_set, "engine_settings": settings, **info}))
        plist = [p.tolist() for p in prompts]
        for s in [1000, *range(steps)]:
            r = w.call("step", timeout=1800, prompts=plist, group=rl.group_size, new_tokens=rl.max_new_tokens, seed=s)
            log(json.dumps({"arm": kernel_set, "seed": s, **r}))
            if s != 1000:
                rows.append({"kernel_set": kernel_set, "engine": f"vllm-{kernel_set}", "step": s, **r,
                             "engine_start_s": info["engine_start_s"]})
    except (WorkerError, OSError, EOFError) as e:  # the other arm still runs; the CSV keeps what this one measured
        arm["failed"] = f"{type(e).__name__}: {str(e)[-4000:]}"
        log(json.dumps({"arm": kernel_set, "failed": arm["failed"]}))
    finally:
        w.close()
    return rows, arm


def run(config: str, out: str | None, steps: int = 2, prompt_len: int = 128,
        sets: tuple[str, ...] = ("isoexec", "native"), new_tokens: int | None = None, engine: str = "harness",
        work: str = "/tmp/isoexec-rl-step", log=print) -> list[dict]:
    """Both kernel sets, one after the other, on the harness (``engine="harness"``: the unified model's own
    generation loop in both) or with vLLM as the engine (``engine="vllm"``: :func:`vllm_arm`; the random checkpoint
    of :func:`make_checkpoint` in ``work``); writes the CSV (``out``; None: ``runs/<experiment>/rl_step.csv``)
    and its provenance after every arm
    (an arm that fails keeps the other's rows) and returns the CSV's rows. ``new_tokens`` overrides
    ``rl.max_new_tokens`` (a shorter smoke run).

    Raises:
        ValueError: an ``engine`` other than "harness" or "vllm", no set, a set other than "isoexec" or "native", or
            ``steps``, ``prompt_len`` or ``new_tokens`` below 1, or ``device: cuda`` where torch sees no CUDA device.
    """
    from isoexec.config import check_device, load_config
    from isoexec.io import atomic_write_text, write_csv
    from isoexec.model.hf import hf_config
    from isoexec.provenance import provenance

    if engine not in ("harness", "vllm"):
        raise ValueError(f"--engine {engine!r}: expected 'harness' or 'vllm'")
    for name, value in (("--steps", steps), ("--prompt-len", prompt_len), ("--new-tokens", new_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name} {value}: must be >= 1")
    if not sets or any(ks not in ("isoexec", "native") for ks in sets):
        raise ValueError(f"--sets {','.join(sets)!r}: expected one or both of 'isoexec', 'native'")
    cfg = load_config(config)
    check_device(cfg, config)
    out = out or f"runs/{cfg.name}/rl_step.csv"
    rl = cfg.rl if new_tokens is None else cfg.rl.model_copy(update={"max_new_tokens": new_tokens})
    gen = torch.Generator().manual_seed(0)
    vocab = hf_config(cfg.model).vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen) for _ in range(rl.prompts_per_step)]
    ckpt = None
    if engine == "vllm":
        Path(work).mkdir(parents=True, exist_ok=True)
        ckpt = str(make_checkpoint(cfg, Path(work) / f"{cfg.name}-checkpoint"))
    rows, arms = [], {}
    for ks in sets:
        if engine == "harness":
            rows += local_arm(cfg, ks, prompts, rl, steps, log)
        else:
            got, arms[ks] = vllm_arm(config, cfg, ks, ckpt, prompts, rl, steps, log)
            rows += got
        table = summarize(rows, sets, engine, ckpt is not None, cfg, rl, prompt_len)  # written after every arm
        write_csv(out, table)
        atomic_write_text(str(out).removesuffix(".csv") + ".provenance.json", json.dumps(
            {"provenance": provenance(), "config": config, "steps": steps, "prompt_len": prompt_len, "engine": engine,
             "arms": arms, "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
             "kernels": cfg.kernels.model_dump(mode="json")}, indent=2, sort_keys=True, default=str) + "\n")
    return table


def summarize(rows: list[dict], sets, engine: str, synced: bool, cfg, rl, prompt_len: int) -> list[dict]:
    """The CSV's rows: ``rows`` (one per arm and timed step), a ``median`` row per arm and, with both arms, the ratios
    isoexec / native; every row with the setup in words."""
    keys = (["time/generation", "time/score", "time/train", "time/policy_training"] + (["time/weight_sync"] if synced else [])
            + ["time/step"])
    rows = [{**r, "time/policy_training": r["time/score"] + r["time/train"]} for r in rows]  # the blog's training time
    table, med = list(rows), {}
    for ks in sets:
        rs = [r for r in rows if r["kernel_set"] == ks]
        if not rs:
            continue
        med[ks] = {k: statistics.median(r[k] for r in rs) for k in keys}
        table.append({"kernel_set": ks, "engine": rs[0]["engine"], "step": "median", **med[ks]})
    if set(med) == {"isoexec", "native"}:
        table.append({"kernel_set": "isoexec/native", "engine": engine, "step": "ratio",
                      **{k: med["isoexec"][k] / med["native"][k] for k in keys}})
    m = cfg.model
    note = (f"{m.num_hidden_layers} layers (hidden {m.hidden_size}, {m.num_experts} experts top-{m.num_experts_per_tok}, "
            f"vocab {m.vocab_size}); {rl.prompts_per_step} prompts x {rl.group_size} samples, prompt {prompt_len}, "
            f"{rl.max_new_tokens} new tokens")
    return [{**r, "setup": note} for r in table]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--config", default="experiments/h200-rlstep.yaml")
    p.add_argument("--out", default=None, help="CSV path; provenance beside it (default: runs/<experiment>/rl_step.csv)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--sets", default="isoexec,native")
    p.add_argument("--new-tokens", type=int, default=None, help="override rl.max_new_tokens")
    p.add_argument("--engine", default="harness", choices=("harness", "vllm"),
                   help="generation through the unified model's own loop (harness) or through vLLM: vLLM native "
                        "for the native set, vLLM with the isoexec plugin for isoexec (default: %(default)s)")
    p.add_argument("--work", default="/tmp/isoexec-rl-step", help="folder for the checkpoint (--engine vllm)")
    a = p.parse_args()
    try:
        run(a.config, a.out, a.steps, a.prompt_len, sets=tuple(x for x in a.sets.split(",") if x),
            new_tokens=a.new_tokens, engine=a.engine, work=a.work)
    except (ValueError, FileNotFoundError) as e:  # load_config: a missing file is FileNotFoundError
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
