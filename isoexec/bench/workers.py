"""Rollout engines and trainers in processes of their own, driven over a pipe.

A GPU benchmark keeps several vLLM engines alive at once (vLLM native and the isoexec plugin, each with its
settings) so that their generate calls can alternate, and scores their samples with trainers that need the
memory back afterwards. Each runs in a ``spawn`` process (a vLLM in-process engine keeps process-global
state; CUDA cannot be forked) that builds its object, reports ``{"ok": True, ...}`` once, then answers
commands ``(name, kwargs)`` until ``"quit"``. A failing command answers ``{"ok": False, "error": traceback}``
and the process stays usable; :meth:`Worker.call` raises :class:`WorkerError` with that traceback.

Samples travel as files (``torch.save`` of plain lists and tensors), not through the pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch


class WorkerError(RuntimeError):
    """A worker's command (or its start) failed; the message holds the worker's traceback."""


class Worker:
    """A spawned process running ``target(conn, *args)`` (see the module docstring).

    Args:
        name: for messages. target: a module-level function (spawn pickles it by name). args: its arguments.
    """

    def __init__(self, name: str, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name)
        self.proc.start()
        child.close()
        self.info: dict[str, Any] | None = None

    def _recv(self, timeout: float | None) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise WorkerError(f"{self.name}: no answer within {timeout} s")
        try:
            msg = self.conn.recv()
        except EOFError as e:
            raise WorkerError(f"{self.name}: the process ended (exit code {self.proc.exitcode})") from e
        if not msg.pop("ok", False):
            raise WorkerError(f"{self.name}: {msg.get('error')}")
        return msg

    def ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the start report (once) and return it.

        Raises:
            WorkerError: the build failed (its traceback), the process died, or ``timeout`` s passed.
        """
        if self.info is None:
            self.info = self._recv(timeout)
        return self.info

    def submit(self, cmd: str, timeout: float | None = None, **kw: Any) -> None:
        """Start ``cmd`` with keyword arguments ``kw`` in the worker (after its start report); :meth:`result`
        waits for the answer, so that several workers can run commands at once."""
        self.ready(timeout)
        self.conn.send((cmd, kw))

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The answer to the last :meth:`submit`.

        Raises:
            WorkerError: the command failed (its traceback), the process died, or ``timeout`` s passed.
        """
        return self._recv(timeout)

    def call(self, cmd: str, timeout: float | None = None, **kw: Any) -> dict[str, Any]:
        """:meth:`submit` then :meth:`result`."""
        self.submit(cmd, timeout, **kw)
        return self.result(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Ask the worker to quit; terminate it if it does not within ``timeout`` s (best effort)."""
        if self.proc.is_alive():
            try:
                self.conn.send(("quit", {}))
                self.proc.join(timeout)
            except (OSError, BrokenPipeError):
                pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)


def serve(conn: Any, build: Callable[[], Any], handlers: dict[str, Callable[..., dict[str, Any]]]) -> None:
    """The worker side: ``build()`` the object (its seconds reported as ``start_s``, with the object's
    ``start_report`` dict if it has one), then answer commands."""
    t0 = time.perf_counter()
    try:
        obj = build()
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send({"ok": False, "error": traceback.format_exc()})
        return
    conn.send({"ok": True, "start_s": time.perf_counter() - t0, "pid": os.getpid(), **getattr(obj, "start_report", {})})
    while True:
        cmd, kw = conn.recv()
        if cmd == "quit":
            return
        try:
            conn.send({"ok": True, **handlers[cmd](obj, **kw)})
        except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
            conn.send({"ok": False, "error": traceback.format_exc()})


def _sync() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


# ------------------------------------------------------------------------------------------ engines
def _generate(eng: Any, prompts: list[list[int]], n: int, max_tokens: int, seed: int, full_vocab_every: int = 0,
              save: str | None = None) -> dict[str, Any]:
    """One timed ``RolloutEngine.generate`` (fixed length: EOS ignored); ``save``: the samples as a file."""
    t0 = _sync()
    groups = eng.generate(prompts, n=n, max_tokens=max_tokens, seed=seed, full_vocab_every=full_vocab_every,
                          ignore_eos=True)
    dt = _sync() - t0
    if save:
        torch.save({"mode": eng.mode, "prompts": prompts,
                    "samples": [[(c.token_ids, c.logprobs, c.full_logprobs) for c in g] for g in groups]}, save)
    return {"seconds": dt, "tokens": sum(len(c.token_ids) for g in groups for c in g),
            "sequences": sum(len(g) for g in groups)}


def _profile(eng: Any, prompts: list[list[int]], n: int, max_tokens: int, seed: int, out_prefix: str) -> dict[str, Any]:
    """Where one generate's time goes: ``<out_prefix>.cprofile.txt`` (Python, by cumulative time) from one
    run, ``<out_prefix>.torch.txt`` (torch.profiler's operator table, CPU and CUDA time) from a second."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    t0 = _sync()
    pr.enable()
    eng.generate(prompts, n=n, max_tokens=max_tokens, seed=seed, ignore_eos=True)
    pr.disable()
    wall = _sync() - t0
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(60)
    Path(out_prefix + ".cprofile.txt").write_text(buf.getvalue())
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        t1 = _sync()
        eng.generate(prompts, n=n, max_tokens=max_tokens, seed=seed, ignore_eos=True)
        wall2 = _sync() - t1
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    Path(out_prefix + ".torch.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=50))
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA) \
        if torch.cuda.is_available() else 0.0
    return {"seconds_cprofile": wall, "seconds_torch_profiler": wall2, "cuda_kernel_s": kernel_us / 1e6}


def engine_args(cuda: bool, mode: str, check: bool, max_seqs: int, max_len: int, kv_gib: int = 8) -> dict[str, Any]:
    """The ``EngineSection`` fields of one benchmark engine (:func:`engine_main`'s ``engine``): scheduler settings,
    the same for both modes but CUDA graphs (vLLM's own: native only; the plugin's decode graphs are on by default);
    ``check``: a 256-token budget and few KV blocks (preemption); ``kv_gib``: vLLM's KV cache on the GPU."""
    e = dict(max_num_seqs=max_seqs, max_model_len=max_len, enable_chunked_prefill=True,
             max_num_batched_tokens=256 if check else max(8192, max_len), enable_prefix_caching=False)
    if check:  # about a sixth of the check's tokens fit in the KV blocks: preemption and recompute
        e["num_kv_blocks_override"] = max(2 * max_len // 16, 1024 if cuda else 256)
    if cuda:
        e.update(gpu_memory_utilization=0.2 if check else 0.28, kv_cache_memory_bytes=(1 if check else kv_gib) * 2**30,
                 native_cuda_graphs=(mode == "native"), gdn_prefill_backend="triton")
    return e


def engine_main(conn: Any, checkpoint: str, mode: str, engine: dict[str, Any], kernels: dict[str, Any],
                seed: int) -> None:
    """Worker target: an in-process :class:`~isoexec.engines.vllm_engine.RolloutEngine` of ``mode``.

    Commands: ``generate`` (:func:`_generate`), ``profile`` (:func:`_profile`), ``cache_state``.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    def build():
        from isoexec.config import EngineSection, KernelSection
        from isoexec.engines.vllm_engine import RolloutEngine

        return RolloutEngine(checkpoint, mode, EngineSection(**engine), KernelSection(**kernels), seed=seed)

    serve(conn, build, {"generate": _generate, "profile": _profile,
                        "cache_state": lambda eng: eng.cache_state() if eng.mode == "isoexec" else {}})


# ----------------------------------------------------------------------------------------- trainers
def _load_trainer(config: str, checkpoint: str, backend: str, mode: str) -> Any:
    from isoexec.config import load_config

    cfg = load_config(config)
    if backend == "unified":
        from isoexec.model import UnifiedModel

        return UnifiedModel.from_pretrained(checkpoint, kernel_set=mode, kernels=cfg.kernels, device=cfg.device)
    if backend == "megatron":
        import socket

        from isoexec.trainer.megatron.launch import init_parallel
        from isoexec.trainer.megatron.trainer import MegatronTrainer

        with socket.socket() as s:  # a free port for this worker's own group of one
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        layout = cfg.trainer.layout()
        init_parallel(layout, rank=0, world_size=layout.world_size, init_method=f"tcp://127.0.0.1:{port}")
        return MegatronTrainer.from_pretrained(checkpoint, layout, kernel_set=mode, kernels=cfg.kernels)
    raise ValueError(f"backend must be 'unified' or 'megatron', got {backend!r}")


def _score(trainer: Any, files: list[str], chunk_size: int, kv_block: int, pack_tokens: int = 4096) -> dict[str, Any]:
    """Compare the engine's logprobs in ``files`` (:func:`_generate`'s samples) with this trainer's
    ``trainer_score`` rows, streamed in packs of about ``pack_tokens`` tokens (rows ``[T, V]`` fp32 never
    exceed one pack).

    Returns:
        :func:`isoexec.rl.metrics.logprob_diff_metrics` over every sampled token, the exposure
        (:func:`~isoexec.rl.metrics.exposure_metrics`), and over the positions with full-vocabulary engine
        rows: ``full_vocab_rows``, ``full_vocab_rows_equal`` (bit-identical fp32 rows), ``full_vocab_equal``
        (``torch.equal`` of all of them), ``full_vocab_max_abs_diff``, ``full_vocab_kl_mean``.
    """
    from isoexec.rl.metrics import exposure_metrics, full_vocab_kl, logprob_diff_metrics

    seqs = []  # (prompt, tokens, engine logprobs, engine full rows or None)
    for f in files:
        d = torch.load(f, weights_only=False)
        for p, group in zip(d["prompts"], d["samples"]):
            seqs.extend((p, toks, lps, full) for toks, lps, full in group)
    lR, lT, n_full, n_eq, all_eq, mx, kls = [], [], 0, 0, True, 0.0, []
    i = 0
    while i < len(seqs):
        pack = [seqs[i]]
        i += 1
        while i < len(seqs) and sum(len(p) + len(t) for p, t, _, _ in pack) + len(seqs[i][0]) + len(seqs[i][1]) <= pack_tokens:
            pack.append(seqs[i])
            i += 1
        ids = torch.tensor([x for p, t, _, _ in pack for x in (*p, *t)], dtype=torch.long)
        lens = [len(p) + len(t) for p, t, _, _ in pack]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long)
        with torch.no_grad():
            rows = trainer.trainer_logprobs(ids, cu, grad=False)
        for j, (p, t, lps, full) in enumerate(pack):
            idx = torch.arange(int(cu[j]) + len(p) - 1, int(cu[j]) + len(p) - 1 + len(t), device=rows.device)
            r = rows[idx]
            lT.append(r.gather(1, torch.tensor(t, dtype=torch.long, device=r.device)[:, None])[:, 0].float().cpu())
            lR.append(lps.float())
            if full is not None:
                e = full.to(r.device)
                n_full += len(t)
                n_eq += int((e.view(torch.int32) == r.view(torch.int32)).all(-1).sum())
                all_eq = all_eq and torch.equal(e, r)
                mx = max(mx, float((e.double() - r.double()).abs().max()))
                kls.append(full_vocab_kl(e.cpu(), r.cpu()) * len(t))
        del rows
    out = logprob_diff_metrics(torch.cat(lR), torch.cat(lT))
    out.update(exposure_metrics([len(p) for p, *_ in seqs], [len(t) for _, t, _, _ in seqs], chunk_size, kv_block))
    out.update(full_vocab_rows=n_full, full_vocab_rows_equal=n_eq, full_vocab_equal=bool(all_eq and n_full > 0),
               full_vocab_max_abs_diff=mx if n_full else float("nan"),
               full_vocab_kl_mean=sum(kls) / n_full if n_full else float("nan"))
    return out


def trainer_main(conn: Any, config: str, checkpoint: str, backend: str, mode: str) -> None:
    """Worker target: a ``trainer_score`` scorer (``backend`` ``unified`` or ``megatron`` at the config's
    layout, world size 1) of ``mode``'s kernel set. Command: ``score`` (:func:`_score`)."""
    serve(conn, lambda: _load_trainer(config, checkpoint, backend, mode), {"score": _score})
