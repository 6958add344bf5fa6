"""The Megatron trainer on GPUs over NCCL: full-vocabulary logprobs bitwise across TP / SP / EP and equal
to the single-GPU engine path (``isoexec``), the native controls, and trainer step times per layout.

Two launches share a work folder (Megatron's groups span the whole world, so TP=1 runs in a world of one)::

    torchrun --nproc_per_node 1 -m isoexec.bench.megatron_gpu --phase single --work W --config experiments/h200.yaml
    torchrun --nproc_per_node 2 -m isoexec.bench.megatron_gpu --phase pair --work W --config experiments/h200.yaml \\
        --out results/h200x2/megatron.csv

``single`` (one GPU): a random model of the config (``isoexec.model.build.random_model``, HF names); the
unified model with the Triton set runs the batch as the engine does (each sequence prefilled in two
chunks, then its last four tokens decoded one by one, all sequences batched per step) and as
``trainer_score``; then the Megatron trainer at TP=1 with the ``isoexec`` set (our modules in Megatron's
slots, Triton kernels) and the ``native`` set (Megatron's local modules, fla GDN, its MoE) computes
``trainer_score`` and ``trainer_fwd`` on the same tokens. ``pair`` (two GPUs): the same trainers at
TP=2 with sequence parallelism, EP=2 and TP=2 x EP=2, compared with ``single``'s rows on every rank.
The batch crosses GDN chunk boundaries (C = ``kernels.chunk_size``) and attention KV blocks.

Outputs (``pair``, rank 0): ``--out`` (one row per comparison: ``equal`` is ``torch.equal`` of the
``[T, V]`` fp32 rows on every rank, with ``max_abs_diff`` and ``rows_differ``), ``<out>_step.csv``
(seconds per trainer step: ``trainer_fwd`` + backward + optimizer step, and per ``trainer_score``, the
median of ``--repeats`` steps after one warm-up, slowest rank; ratios TP=2/TP=1 and isoexec/native),
and ``<out>.provenance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

LENGTHS = (300, 131, 70)
"""Sequence lengths of the checked batch: 300 tokens cross four GDN chunks of 64 and four KV blocks of 64."""


def _batch(vocab: int, lengths=LENGTHS, seed: int = 1):
    ids = torch.randint(0, vocab, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    return ids, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def engine_rows(model, ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``[T, V]`` rows of the engine path: every sequence prefilled in two chunks (a third, then the rest
    but its last four tokens), then those four decoded one token per step, all sequences batched."""
    seqs = [ids[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    caches = [model.new_cache() for _ in seqs]
    plans = [[s[: len(s) // 3], s[len(s) // 3 : len(s) - 4], *s[len(s) - 4 :].split(1)] for s in seqs]
    rows = [[] for _ in seqs]
    for step in range(max(len(p) for p in plans)):
        live = [i for i, p in enumerate(plans) if step < len(p) and len(p[step])]
        outs = model.engine_step([caches[i] for i in live], [plans[i][step] for i in live])
        for i, o in zip(live, outs):
            rows[i].append(o)
    return torch.cat([torch.cat(r) for r in rows])


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_times(trainer, ids: torch.Tensor, cu: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds (this rank) of ``trainer_score`` and of one training step (``trainer_fwd`` +
    backward of the mean next-token NLL + optimizer step) after one warm-up of each."""
    out = {"score_s": [], "step_s": []}
    tgt = ids[1:].to(trainer.device)
    for _ in range(repeats + 1):
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            trainer.trainer_logprobs(ids, cu, grad=False)
        _sync()
        t1 = time.perf_counter()
        lp = trainer.trainer_logprobs(ids, cu, grad=True)
        (-lp[torch.arange(len(ids) - 1, device=lp.device), tgt].mean()).backward()
        trainer.step()
        _sync()
        out["score_s"].append(t1 - t0)
        out["step_s"].append(time.perf_counter() - t1)
    return {k: statistics.median(v[1:]) for k, v in out.items()}


def _slowest(x: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def compare(name: str, layout: str, kernel_set: str, case: str, reference: str, x: torch.Tensor,
            ref: torch.Tensor) -> dict:
    """One comparison row; ``equal`` / ``max_abs_diff`` / ``rows_differ`` over every rank of the group."""
    x, ref = x.float(), ref.to(x.device).float()
    eq = torch.tensor([int(torch.equal(x, ref))], device=x.device)
    diff = (x - ref).abs()
    mx = torch.tensor([float(diff.max())], device=x.device, dtype=torch.float64)
    nrows = torch.tensor([int((diff.amax(-1) > 0).sum())], device=x.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(eq, op=dist.ReduceOp.MIN)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        dist.all_reduce(nrows, op=dist.ReduceOp.MAX)
    return {"check": name, "layout": layout, "kernel_set": kernel_set, "case": case, "reference": reference,
            "equal": bool(eq.item()), "max_abs_diff": float(mx.item()), "rows_differ": int(nrows.item()),
            "rows": int(x.shape[0]), "vocab": int(x.shape[1])}


def _trainer_rows(trainer, ids, cu) -> dict[str, torch.Tensor]:
    score = trainer.trainer_logprobs(ids, cu, grad=False)
    fwd = trainer.trainer_logprobs(ids, cu, grad=True).detach()
    return {"trainer_score": score, "trainer_fwd": fwd}


def _free(*objs):
    del objs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def layouts(phase: str):
    """(name, Layout) pairs of a phase: ``single`` TP=1; ``pair`` TP=2 + SP, EP=2, TP=2 x EP=2."""
    from isoexec.trainer.megatron.config import Layout

    if phase == "single":
        return [("tp1", Layout())]
    return [("tp2_sp", Layout(tp=2, sp=True)), ("ep2", Layout(ep=2)), ("tp2_sp_ep2", Layout(tp=2, sp=True, ep=2))]


def run_phase(phase: str, hf_config, hf_state: dict, kernels, dtype: torch.dtype, work: Path, log=print,
              step_batch: tuple[int, int] = (4, 512), repeats: int = 3, unified_kernels=None) -> tuple[list[dict], list[dict]]:
    """One phase on this rank (the process group is joined by :func:`~isoexec.trainer.megatron.launch.init_parallel`).

    Args:
        phase: ``"single"`` (world of one: engine path, unified trainer rows, TP=1) or ``"pair"`` (world of
            two: TP=2 + SP, EP=2, TP=2 x EP=2 against ``single``'s rows read from ``work``).
        hf_config, hf_state: the model (transformers config, HF-named weights on the CPU).
        kernels: ``KernelSection`` (or an ``isoexec`` KernelSet, for checks) of the trainers.
        unified_kernels: the unified model's kernel set (``single``; default the ``isoexec`` set of
            this process's device).
        step_batch: (sequences, tokens each) of the timed steps (0 sequences: no timing).

    Returns:
        (comparison rows, step-time rows) of this phase.
    """
    from isoexec.kernels import build_kernel_set
    from isoexec.model import UnifiedModel
    from isoexec.trainer.megatron import compat
    from isoexec.trainer.megatron.launch import init_parallel
    from isoexec.trainer.megatron.trainer import MegatronTrainer

    ids, cu = _batch(hf_config.vocab_size)
    rows, times = [], []
    if phase == "single":
        uk = unified_kernels or build_kernel_set("isoexec", compat.DEVICE, kernels)
        model = UnifiedModel.from_config(hf_config, uk, dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in hf_state.items()}, strict=True)
        model = model.to(compat.DEVICE)
        ref = {"engine": engine_rows(model, ids, cu), "unified": model.trainer_logprobs(ids, cu)}
        rows.append(compare("unified_engine_vs_trainer", "1 GPU", "isoexec", "engine_step", "unified trainer_score",
                            ref["engine"], ref["unified"]))
        log(rows[-1])
        _free(model)
    else:
        ref = torch.load(work / "single.pt")
    g = torch.Generator().manual_seed(2)
    step_ids = torch.randint(0, hf_config.vocab_size, (step_batch[0] * step_batch[1],), generator=g)
    step_cu = torch.arange(0, step_ids.numel() + 1, step_batch[1]) if step_batch[0] else None
    for lname, layout in layouts(phase):
        init_parallel(layout)
        for kset in ("isoexec", "native"):
            if kset == "native" and lname == "tp2_sp_ep2":
                continue
            t = MegatronTrainer(hf_config, layout, kset, kernels, dtype)
            t.load_hf_state_dict(hf_state)
            out = _trainer_rows(t, ids, cu)
            for case, x in out.items():
                if kset == "isoexec":
                    rows.append(compare("trainer_vs_engine", lname, kset, case, "unified engine_step", x, ref["engine"]))
                if phase == "single":
                    ref[f"{kset}_tp1_{case}"] = x
                    if kset == "native":
                        rows.append(compare("native_vs_isoexec_engine", lname, kset, case, "unified engine_step", x,
                                            ref["engine"]))
                else:
                    rows.append(compare("layout_vs_tp1", lname, kset, case, f"{kset} tp1 {case}", x,
                                        ref[f"{kset}_tp1_{case}"]))
                log(rows[-1])
            if step_cu is not None and lname in ("tp1", "tp2_sp"):
                st = step_times(t, step_ids, step_cu, repeats)
                times.append({"layout": lname, "world_size": layout.world_size, "kernel_set": kset,
                              "score_s": _slowest(st["score_s"]), "step_s": _slowest(st["step_s"]),
                              "tokens": int(step_ids.numel()), "repeats": repeats})
                log(times[-1])
            _free(t, out)
    if phase == "single" and dist.get_rank() == 0:
        torch.save({k: v.cpu() for k, v in ref.items()}, work / "single.pt")
        (work / "single_rows.json").write_text(json.dumps({"rows": rows, "times": times}))
    return rows, times


def _ratios(times: list[dict]) -> list[dict]:
    by = {(r["layout"], r["kernel_set"]): r for r in times}
    for r in times:
        tp1, nat = by.get(("tp1", r["kernel_set"])), by.get((r["layout"], "native"))
        for k in ("score_s", "step_s"):
            r[f"{k}_over_tp1"] = r[k] / tp1[k] if tp1 else None
            r[f"{k}_isoexec_over_native"] = r[k] / nat[k] if (nat and r["kernel_set"] == "isoexec") else None
    return times


def main(argv=None) -> None:
    from isoexec.config import load_config
    from isoexec.model.build import random_model
    from isoexec.model.hf import hf_config as make_hf_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=("single", "pair"), required=True)
    p.add_argument("--config", default="experiments/h200.yaml")
    p.add_argument("--work", required=True, help="folder shared by the two phases")
    p.add_argument("--out", default="results/h200x2/megatron.csv")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-batch", default="4x512", help="sequences x tokens of the timed steps (0x0: no timing)")
    a = p.parse_args(argv)
    cfg = load_config(a.config)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, cfg.model.dtype)
    hcfg = make_hf_config(cfg.model)
    state = {k: v.detach().cpu() for k, v in random_model(cfg.model, cfg.kernels, "native", seed=0).state_dict().items()}
    rank = int(os.environ.get("RANK", "0"))
    log = (lambda r: print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)) \
        if rank == 0 else (lambda r: None)
    nb, nt = (int(v) for v in a.step_batch.split("x"))
    rows, times = run_phase(a.phase, hcfg, state, cfg.kernels, dtype, work, log, (nb, nt), a.repeats)
    if a.phase == "pair" and dist.get_rank() == 0:
        from isoexec.io import atomic_write_text, write_csv
        from isoexec.provenance import provenance

        single = json.loads((work / "single_rows.json").read_text())
        out = Path(a.out)
        write_csv(out, single["rows"] + rows)
        write_csv(out.with_name(out.stem + "_step.csv"), _ratios(single["times"] + times))
        atomic_write_text(str(out).removesuffix(".csv") + ".provenance.json", json.dumps(
            {"provenance": provenance(), "config": a.config, "lengths": list(LENGTHS), "step_batch": a.step_batch,
             "repeats": a.repeats, "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
             "kernels": cfg.kernels.model_dump(mode="json")}, indent=2, sort_keys=True, default=str) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
