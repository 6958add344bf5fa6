"""The unified model's ``engine_decode`` step on one GPU, alone: milliseconds per step and where they go, for one or
more source trees side by side in one run.

``python -m isoexec.bench.engine_decode --config experiments/h200-rlstep.yaml --out-dir OUT [--tree before=/src/old]
[--graphs]``

No vLLM: the model of the config (random weights, :func:`isoexec.bench.rl_step.build_model`, seed 0, isoexec set)
prefills ``B`` prompts of ``--prompt-len`` random tokens, then decodes ``--steps`` tokens per sequence, sampling
from the full-vocabulary rows (one generator seed, so trees with the same bits sample the same tokens). What a
decode step costs here is what the plugin's ``engine_step`` costs inside vLLM, without vLLM's scheduler and sampler
(``isoexec.bench.vllm_gpu`` measures the whole engine against vLLM's own).

Each tree (``--tree NAME=PATH``, its ``isoexec`` package imported from PATH; ``this`` is this checkout) runs in a
process of its own; the trees alternate ``--reps`` times, so a drifting machine shows in both. Per (tree, rep,
batch) ``decode.csv`` records the milliseconds per decode step and the sha256 of every sampled token and of the
last step's fp32 rows: equal digests across trees say that a change kept the bits. ``provenance.json`` names each
tree by the sha256 of its ``isoexec`` package (:func:`tree_digest`). ``profile_<tree>.txt``: one
generate at the first batch size under cProfile (Python time by function) and torch.profiler (CUDA time and CPU
time per op, launches per step). ``provenance.json`` beside them.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def parse_tree(text: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, absolute path).

    Raises:
        ValueError: another form, or PATH without an ``isoexec`` package.
    """
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--tree {text!r}: expected NAME=PATH, e.g. before=/tmp/old")
    if not (Path(path) / "isoexec" / "__init__.py").exists():
        raise ValueError(f"--tree {text!r}: {path} holds no isoexec package")
    return name, str(Path(path).resolve())


def tree_digest(path: str) -> str:
    """sha256 of a tree's ``isoexec`` package: every file but caches and built libraries, by relative path, in order
    (what ``--tree`` measured, when the tree is not a git checkout)."""
    h = hashlib.sha256()
    root = Path(path) / "isoexec"
    for f in sorted(q for q in root.rglob("*") if q.is_file() and "__pycache__" not in q.parts and q.suffix != ".so"):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _worker(config: str, batches: list[int], steps: int, prompt_len: int, profile_out: str | None,
            graphs: bool = False) -> list[dict]:
    """In the tree's process: time ``steps`` decode steps at each batch size (after one untimed generate of the
    first; with ``graphs``, of each, which captures its CUDA graph), optionally profile one generate; returns one row
    per batch size."""
    import torch

    from isoexec.bench.rl_step import build_model
    from isoexec.config import load_config

    cfg = load_config(config)
    model = build_model(cfg, "isoexec")
    if graphs:
        model.enable_decode_graphs(max_seqs=max(batches), max_len=prompt_len + max(steps, 32) + 1)
    sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
    vocab = model.config.vocab_size

    def generate(B: int, n_steps: int, prof=None) -> tuple[float, list, torch.Tensor]:
        """Seconds per decode step, the sampled tokens and the last step's rows."""
        g = torch.Generator().manual_seed(B)
        caches = [model.new_cache() for _ in range(B)]
        chunks = [torch.randint(0, vocab, (prompt_len,), generator=g) for _ in range(B)]
        gen = torch.Generator(device=cfg.device).manual_seed(B)
        lp = torch.cat(model.engine_step(caches, chunks, last_only=True))  # engine_prefill, not timed
        tok = torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]
        toks = [tok]
        sync()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        for _ in range(n_steps):
            lp = torch.cat(model.engine_step(caches, [t.view(1) for t in tok], last_only=True))
            tok = torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]
            toks.append(tok)
        sync()
        if prof is not None:
            prof.disable()
        return (time.perf_counter() - t0) / n_steps, toks, lp

    for B in batches if graphs else batches[:1]:
        generate(B, 8)  # JIT compilation, first-touch allocations, graph capture
    rows = []
    for B in batches:
        dt, toks, lp = generate(B, steps)
        rows.append({"batch": B, "steps": steps, "ms_per_step": round(1e3 * dt, 3),
                     "tokens_sha256": hashlib.sha256(torch.stack(toks).cpu().numpy().tobytes()).hexdigest(),
                     "last_rows_sha256": hashlib.sha256(lp.contiguous().view(torch.int32).cpu().numpy().tobytes()).hexdigest()})
    if profile_out:  # not workers._profile: a tree measured here may predate any helper this file could import
        import cProfile
        import pstats

        from torch.profiler import ProfilerActivity, profile

        pr = cProfile.Profile()
        generate(batches[0], 32, prof=pr)
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumulative").print_stats(50)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            generate(batches[0], 16)
        ka = p.key_averages()
        text = (f"# cProfile, {batches[0]} sequences x 32 decode steps\n{s.getvalue()}\n"
                f"# torch.profiler, {batches[0]} sequences x 16 decode steps (and the untimed prefill)\n"
                + ka.table(sort_by="cuda_time_total", row_limit=40) + "\n\n" + ka.table(sort_by="cpu_time_total", row_limit=40)
                + "\n\n" + ka.table(sort_by="count", row_limit=25) + "\n")
        Path(profile_out).write_text(text)
    return rows


def run(config: str, out_dir: str, trees: list[tuple[str, str, bool]], batches: list[int], steps: int, prompt_len: int,
        reps: int, log=print) -> list[dict]:
    """Every tree ``reps`` times, alternating, each in its own process; writes ``decode.csv`` and returns its rows.

    Args:
        trees: (name, path, graphs): graphs runs the tree's decode steps under its CUDA graphs
            (``UnifiedModel.enable_decode_graphs``)."""
    from isoexec.io import write_csv
    from isoexec.provenance import provenance

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "provenance.json").write_text(json.dumps(
        {"provenance": provenance(), "config": config,
         "trees": {n: {"path": pth, "graphs": gr, "isoexec_sha256": tree_digest(pth)} for n, pth, gr in trees},
         "batches": batches, "steps": steps,
         "prompt_len": prompt_len, "reps": reps}, indent=2, sort_keys=True, default=str) + "\n")
    rows = []
    for rep in range(reps):
        for name, path, graphs in trees:
            args = {"config": config, "batches": batches, "steps": steps, "prompt_len": prompt_len,
                    "profile_out": str(out / f"profile_{name}.txt") if rep == 0 else None, "graphs": graphs}
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
            p = subprocess.run([sys.executable, __file__, "--worker", json.dumps(args)], env=env, capture_output=True,
                               text=True)
            if p.returncode:
                raise RuntimeError(f"tree {name} ({path}) failed:\n{p.stderr[-4000:]}")
            for r in json.loads(p.stdout.strip().splitlines()[-1]):
                rows.append({"tree": name, "rep": rep, "graphs": graphs, **r})
                log(json.dumps(rows[-1]))
            write_csv(out / "decode.csv", rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["--worker"]:  # a tree's process: its isoexec comes from PYTHONPATH
        sys.path.pop(0)  # this file's folder would shadow top-level modules
        a = json.loads(sys.argv[2])
        print(json.dumps(_worker(a["config"], a["batches"], a["steps"], a["prompt_len"], a["profile_out"],
                                 a.get("graphs", False))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="experiment YAML (device cuda)")
    p.add_argument("--out-dir", required=True, help="folder for decode.csv, profile_<tree>.txt, provenance.json")
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH, a source tree to compare (repeatable); "
                   "this checkout is always measured, as 'this'")
    p.add_argument("--graphs", action="store_true", help="also measure this checkout with its decode steps under CUDA "
                   "graphs, as 'this+graphs'")
    p.add_argument("--batches", default="32,256", help="comma-separated sequences per step (default: %(default)s)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    p.add_argument("--reps", type=int, default=2, help="alternations of the trees (default: %(default)s)")
    a = p.parse_args(argv)
    try:
        from isoexec.config import check_device, load_config

        check_device(load_config(a.config), a.config)  # before the out-dir and the trees' processes (a cpu config runs)
        trees = [parse_tree(t) for t in a.tree]
        batches = [int(b) for b in a.batches.split(",")]
        if min(batches) < 1 or a.steps < 1 or a.prompt_len < 1 or a.reps < 1:
            raise ValueError(f"--batches {a.batches}, --steps {a.steps}, --prompt-len {a.prompt_len}, --reps {a.reps}: "
                             "every value must be >= 1")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    root = str(Path(__file__).resolve().parents[2])
    mine = [("this", root, False)] + ([("this+graphs", root, True)] if a.graphs else [])
    run(a.config, a.out_dir, [(n, pth, False) for n, pth in trees] + mine, batches, a.steps, a.prompt_len, a.reps)


if __name__ == "__main__":
    main()
