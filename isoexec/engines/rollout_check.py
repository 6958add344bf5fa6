"""``isoexec rollout-check``: vLLM rollout logprobs against the trainer's recompute, per mode.

For each mode (``native``, ``isoexec``): sample at least ``engine.rollout_check_tokens`` response
tokens through vLLM from prompts of mixed lengths submitted together (continuous batching and
chunked prefill as configured), then recompute every sampled token's logprob with the mode's trainer
of ``trainer.backend`` (``trainer_score``; ``hf``: transformers ``Qwen3NextForCausalLM`` with
``log_softmax(logits.float() / T)``, ``unified``: ``UnifiedModel.trainer_logprobs``, ``megatron``: the
Megatron trainer on its TP/EP/SP layout's local gloo ranks), and compare bits. Every
``engine.rollout_check_full_vocab_every``-th request also returns full-vocabulary rows (vLLM
``logprobs=V``), compared row by row with the trainer's rows.

Prints one JSON object per mode (``mode, tokens, mismatch_count, mismatch_rate,
logprob_abs_diff_mean/std/max, full_vocab_rows, full_vocab_rows_equal, full_vocab_kl_mean, ...``)
and writes ``results/<exp>/rollout_check.json`` atomically with provenance.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer

from isoexec.config import ExperimentConfig, check_device, load_config
from isoexec.engines.base import Completion
from isoexec.settings import CONFIG_OPTION

MAX_TOKENS = 32
"""Response length per request."""


def make_prompts(num: int, vocab_size: int, max_len: int, seed: int) -> list[list[int]]:
    """``num`` random prompts with lengths spread over [4, max_len] (mixed short and long)."""
    g = np.random.default_rng(seed)
    lens = np.linspace(4, max_len, num).astype(int)
    g.shuffle(lens)
    return [g.integers(1, vocab_size, size=int(n)).tolist() for n in lens]


def trainer_rows(trainer: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Full-vocabulary ``trainer_score`` rows ``[len-1, V]`` per sequence (row t predicts token t+1).

    Sequences are scored one per call (packing is the trainer's business, not this check's).
    """
    out = []
    for s in sequences:
        ids = torch.tensor(s, dtype=torch.long)
        cu = torch.tensor([0, len(s)], dtype=torch.long)
        with torch.no_grad():
            rows = trainer.trainer_logprobs(ids, cu, grad=False)
        out.append(rows[:-1].float())
    return out


def _held_and_rows(trainer: Any, sequences: list[list[int]]) -> tuple[dict[str, str], list[torch.Tensor]]:
    """The trainer's weight checksums at load (HF names, as a sync sends them), then its rows."""
    from isoexec.trainer.base import sync_state

    from .weight_sync import state_checksums

    return state_checksums(sync_state(trainer)), trainer_rows(trainer, sequences)


def _megatron_rows(rank: int, world_size: int, cfg: ExperimentConfig, mode: str, checkpoint: str,
                   sequences: list[list[int]]) -> tuple[dict[str, str], list[torch.Tensor]] | None:
    """One rank of the Megatron trainer group: load ``checkpoint``, gather its weights' checksums and score
    ``sequences`` (rank 0 returns both, the others None)."""
    from isoexec.trainer.factory import load_trainer

    res = _held_and_rows(load_trainer(cfg, mode, checkpoint), sequences)
    return res if rank == 0 else None


def score(cfg: ExperimentConfig, mode: str, checkpoint: Path, sequences: list[list[int]],
          model_factory: str | None = None) -> tuple[dict[str, str], list[torch.Tensor]]:
    """The checksums of the weights ``mode``'s trainer loaded, and its ``trainer_score`` rows of ``sequences``
    (:func:`trainer_rows`).

    ``trainer.backend: megatron`` runs on the layout's ``world_size`` local gloo ranks
    (:func:`isoexec.trainer.megatron.launch.run`), as in training; the other backends in this process. A
    ``model_factory`` (tests: a stand-in model) is the isoexec trainer.
    """
    if model_factory is not None and mode == "isoexec":
        from .vllm_plugin import resolve

        return _held_and_rows(resolve(model_factory).from_pretrained(checkpoint, kernel_set="isoexec",
                                                                     kernels=cfg.kernels), sequences)
    if cfg.trainer.backend_for(mode) == "megatron":
        from isoexec.trainer.megatron.launch import run

        return run(_megatron_rows, cfg.trainer.layout().world_size, cfg, mode, str(checkpoint), sequences)[0]
    from isoexec.trainer.factory import load_trainer

    return _held_and_rows(load_trainer(cfg, mode, checkpoint), sequences)


def compare(mode: str, completions: list[list[Completion]], prompts: list[list[int]], trainer: Any = None,
            rows: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """Metrics of docs/design.md (Metrics) for engine vs trainer logprobs of the sampled tokens.

    Args:
        completions: per prompt its samples (as :meth:`RolloutEngine.generate` returns them).
        prompts: the prompt token ids. trainer: anything with ``trainer_logprobs``, which scores them.
        rows: instead of ``trainer``, the rows already scored (:func:`score`: ``[len-1, V]`` fp32 per
            ``prompt + sample``, in that order).

    Raises:
        ValueError: neither or both of ``trainer`` and ``rows``.
    """
    if (trainer is None) == (rows is None):
        raise ValueError("compare needs exactly one of trainer (to score) or rows (already scored)")
    samples = [(p, c) for p, group in zip(prompts, completions) for c in group]
    if rows is None:
        rows = trainer_rows(trainer, [p + c.token_ids for p, c in samples])
    lr, lt, full_eq, full_n, kls = [], [], 0, 0, []
    for (prompt, c), r in zip(samples, rows):
        p = len(prompt)
        idx = torch.arange(p - 1, p - 1 + len(c.token_ids))
        tok = torch.tensor(c.token_ids, dtype=torch.long)
        lt.append(r[idx, tok].numpy())
        lr.append(c.logprobs.numpy())
        if c.full_logprobs is not None:
            tr = r[idx].numpy()
            er = c.full_logprobs.numpy()
            full_n += len(er)
            full_eq += int(sum(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(er, tr)))
            pe = np.exp(er.astype(np.float64))
            kls.extend(np.sum(pe * (er.astype(np.float64) - tr.astype(np.float64)), axis=-1).tolist())
    lr_ = np.concatenate(lr).astype(np.float32)
    lt_ = np.concatenate(lt).astype(np.float32)
    d = lt_.astype(np.float64) - lr_.astype(np.float64)
    ad = np.abs(d)
    mism = int(np.sum(lr_.view(np.uint32) != lt_.view(np.uint32)))
    return {
        "mode": mode,
        "tokens": int(lr_.size),
        "requests": len(samples),
        "mismatch_count": mism,
        "mismatch_rate": mism / max(1, lr_.size),
        "logprob_abs_diff_mean": float(ad.mean()),
        "logprob_abs_diff_std": float(ad.std()),
        "logprob_abs_diff_max": float(ad.max()),
        "k3_kl": float(np.mean(np.exp(d) - d - 1)),
        "full_vocab_rows": full_n,
        "full_vocab_rows_equal": full_eq,
        "full_vocab_kl_mean": float(np.mean(kls)) if kls else None,
    }


def run_mode(
    cfg: ExperimentConfig,
    mode: str,
    checkpoint: Path,
    *,
    model_factory: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Sample through vLLM in ``mode`` and compare with that mode's trainer. Returns the metrics, with both
    sides' weight digests at load (``weights_at_load``).

    Raises:
        isoexec.engines.weight_sync.WeightSyncError: the engine and the trainer loaded different weights.
    """
    from .vllm_engine import RolloutEngine
    from .weight_sync import check_weights_at_load

    e = cfg.engine
    t0 = time.perf_counter()
    engine = RolloutEngine(checkpoint, mode, e, cfg.kernels, seed=seed, model_factory=model_factory)
    try:
        V = engine.vocab_size
        num = max(1, math.ceil(e.rollout_check_tokens / MAX_TOKENS))
        max_len = max(4, min(e.max_model_len - MAX_TOKENS, 2 * e.max_num_batched_tokens))
        prompts = make_prompts(num, V, max_len, seed)
        t1 = time.perf_counter()
        samples = engine.generate(
            prompts, n=1, max_tokens=MAX_TOKENS, seed=seed, temperature=cfg.kernels.temperature,
            full_vocab_every=e.rollout_check_full_vocab_every, ignore_eos=True,
        )
        gen_s = time.perf_counter() - t1
        routing = engine.cache_state() if mode == "isoexec" else None
        engine_held = engine.load_checksums
    finally:
        engine.shutdown()
    seqs = [p + c.token_ids for p, group in zip(prompts, samples) for c in group]
    trainer_held, rows = score(cfg, mode, checkpoint, seqs, model_factory)
    weights_at_load = check_weights_at_load(engine_held, trainer_held)  # refused on any difference
    res = compare(mode, samples, prompts, rows=rows)
    if res["tokens"] < e.rollout_check_tokens:
        raise RuntimeError(f"{mode}: sampled {res['tokens']} response tokens, fewer than "
                           f"engine.rollout_check_tokens={e.rollout_check_tokens}")
    res.update(
        prompt_len_min=min(map(len, prompts)),
        prompt_len_max=max(map(len, prompts)),
        engine={k: getattr(e, k) for k in ("max_num_seqs", "max_model_len", "enable_chunked_prefill", "max_num_batched_tokens", "enable_prefix_caching", "num_kv_blocks_override")},
        temperature=cfg.kernels.temperature,
        trainer={"backend": cfg.trainer.backend_for(mode),
                 "layout": cfg.trainer.layout().name if cfg.trainer.backend_for(mode) == "megatron" else None},
        generation_s=round(gen_s, 3),
        total_s=round(time.perf_counter() - t0, 3),
        weights_at_load=weights_at_load,
    )
    if routing is not None:
        res["routing"] = routing
    return res


def default_checkpoint(cfg: ExperimentConfig) -> Path:
    """``runs/<exp>/model/init`` if the pipeline made it, else a random-init tiny checkpoint."""
    from isoexec.model.hf import build_checkpoint

    init = Path(f"runs/{cfg.name}/model/init")
    if (init / "config.json").is_file():
        return init
    return build_checkpoint(Path(f"runs/{cfg.name}/model/rollout_check_init"), cfg.model)


def rollout_check_command(
    config: Path = CONFIG_OPTION,
    checkpoint: str = typer.Option(None, "--checkpoint", help="HF checkpoint dir (default: runs/<exp>/model/init, else a random init)"),
    modes: str = typer.Option("native,isoexec", "--modes", help="comma-separated modes: native, isoexec"),
    model_factory: str = typer.Option(None, "--model-factory", help="isoexec: module:Class with from_pretrained (default isoexec.model:UnifiedModel)"),
    out: Path = typer.Option(None, "--out", metavar="FILE", help="the JSON file to write (default: "
                             "runs/<exp>/rollout_check.json, not committed; reproduce writes results/<exp>/rollout_check.json)"),
) -> None:
    """Engine (vLLM) vs trainer logprobs on sampled rollouts, per mode; one JSON line per mode."""
    from .vllm_engine import vllm_env_defaults

    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    if not chosen or set(chosen) - {"native", "isoexec"}:
        raise typer.BadParameter(f"{modes!r}: expected comma-separated modes from native, isoexec", param_hint="--modes")
    vllm_env_defaults()
    cfg = load_config(config)
    check_device(cfg, config)
    ckpt = Path(checkpoint) if checkpoint else default_checkpoint(cfg)
    results = []
    for mode in chosen:
        res = run_mode(cfg, mode, ckpt, model_factory=model_factory)
        print(json.dumps(res), flush=True)
        results.append(res)
    from isoexec.io import atomic_write_json
    from isoexec.provenance import provenance

    atomic_write_json(
        out or Path("runs") / cfg.name / "rollout_check.json",
        {"config": str(config), "checkpoint": str(ckpt), "results": results, "provenance": provenance()},
    )
