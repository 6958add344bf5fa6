"""The in-process RL loop: one run (arm, seed) of a paired experiment, GRPO/DAPO on the task's DAPO-schema
data, without Ray.

The main job runs through SkyRL (``rl.driver: skyrl``, :mod:`isoexec.rl.skyrl.driver`); this loop is
the light driver of the tests and of side-by-side timings, for the ``hf`` and ``unified`` trainers
(one process) and without dynamic sampling (:class:`isoexec.config.ExperimentConfig` refuses both).

Each step, in this order (timed with ``time.perf_counter``):

1. ``time/generation``: the engine samples ``rl.group_size`` responses for each of the step's
   ``rl.prompts_per_step`` prompts. Data order and sampling seeds depend only on (task, seed, step),
   so native and isoexec runs of one seed see the same prompts and the same RNG seeds. Prompts are
   the rows' chat messages through the tokenizer's chat template (:mod:`isoexec.rl.data`); rewards
   are DAPO-Math's rule on the decoded responses (:mod:`isoexec.rl.reward`).
2. ``time/score``: the trainer's pre-update ``trainer_score`` (no grad) of every sequence gives the
   full-vocabulary rows at response positions, hence ``lT`` (and the entropy, full-vocab KL).
3. metrics of :mod:`isoexec.rl.metrics` (rollout ``lR`` vs trainer ``lT``, the rollout ratio's
   clip fraction, exposure counts, rewards).
4. ``time/train``: advantages, then ``rl.mini_batches`` optimizer updates, both SkyRL's
   (:mod:`isoexec.rl.skyrl.algorithm`: the estimator and policy loss named by the ``rl`` section, with
   its loss reduction), the loss ratio being ``exp(logp_new - lT)`` (the trainer's own old logprobs;
   the rollout ratio is a metric, and an arm with an off-policy correction hands it to SkyRL's loss,
   which reweights or masks by it); the learning rate rises linearly to ``rl.lr`` over the first
   ``rl.warmup_updates`` updates.
5. ``time/weight_sync``: the trainer's compute-dtype weights (bf16 rounded from the fp32 masters)
   go to the engine (isoexec: contract handshake, checksums).

``time/step`` covers 1-5. One JSON row per step is appended to ``metrics.jsonl`` (atomically, the
whole file rewritten), ``provenance.json`` is written at the start.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

from isoexec.config import ExperimentConfig
from isoexec.io import atomic_write_json
from isoexec.provenance import provenance
from isoexec.rl import metrics
from isoexec.rl.arms import Arm, find_arm
from isoexec.rl.batch import build_batch, token_logprobs
from isoexec.engines.base import Engine
from isoexec.engines.weight_sync import check_weights_at_load, state_checksums
from isoexec.rl.data import Example, load_splits, prompt_token_ids
from isoexec.rl.reward import reward, response_text
from isoexec.rl.tokenizer import load_tokenizer
from isoexec.trainer.optim import MasterAdamW, warmup_lr
from isoexec.trainer.base import Policy, sync_state

log = logging.getLogger(__name__)


def step_prompts(train: list[Example], seed: int, step: int, per_step: int) -> list[Example]:
    """The prompts of ``step``: consecutive slices of a seed-dependent permutation of the train split
    (re-shuffled with a new epoch seed when exhausted). Independent of the mode."""
    per_epoch = len(train) // per_step
    epoch, k = divmod(step, per_epoch)
    order = list(range(len(train)))
    random.Random(f"rl-order/{seed}/{epoch}").shuffle(order)
    return [train[i] for i in order[k * per_step : (k + 1) * per_step]]


def generation_seed(seed: int, step: int) -> int:
    """The engine's sampling seed for (run seed, step); the same in both modes."""
    return (seed * 1_000_003 + step * 7_919 + 17) % (2**31 - 1)


def kl_positions(n_tokens: int, k: int, seed: int, step: int) -> torch.Tensor:
    """``min(k, N)`` response-token indices for ``full_vocab_kl``, deterministic in (seed, step)."""
    g = torch.Generator().manual_seed(generation_seed(seed, step) + 1)
    return torch.randperm(n_tokens, generator=g)[: min(k, n_tokens)].sort().values


def rl_step(policy: Policy, engine: Engine, optimizer: MasterAdamW, tok, problems: list[Example],
            config: ExperimentConfig, seed: int, step: int, arm: Arm | None = None) -> dict[str, Any]:
    """One synchronous RL step; returns its metrics row (without ``step``/``arm``/``mode``/``seed``).

    ``arm``: its off-policy correction enters SkyRL's policy loss (None: none).
    """
    rl = config.rl
    t_step = time.perf_counter()

    # 1. generation
    t0 = time.perf_counter()
    prompts = [prompt_token_ids(tok, p) for p in problems]
    completions = engine.generate(prompts, rl.group_size, rl.max_new_tokens, generation_seed(seed, step),
                                  rl.temperature)
    t_gen = time.perf_counter() - t0
    rewards = torch.tensor(
        [[reward(response_text(tok, c.token_ids), p.ground_truth) for c in group]
         for p, group in zip(problems, completions)]
    )  # [P, G]
    batch = build_batch(prompts, completions)

    # 2. pre-update trainer_score
    t0 = time.perf_counter()
    with torch.no_grad():
        full = policy.trainer_logprobs(batch.input_ids, batch.cu_seqlens, grad=False)
        resp_rows = full[batch.score_rows]  # [N, V]
        lT = resp_rows.gather(1, batch.tokens[:, None]).squeeze(1)
    t_score = time.perf_counter() - t0

    # 3. metrics
    row: dict[str, Any] = metrics.logprob_diff_metrics(batch.rollout_logprobs, lT)
    row["is_ratio_clip_frac"] = metrics.is_ratio_clip_frac(batch.rollout_logprobs, lT, rl.clip_low, rl.clip_high)
    row.update(metrics.exposure_metrics(
        [len(p) for p, group in zip(prompts, completions) for _ in group],
        [len(c.token_ids) for group in completions for c in group],
        config.kernels.chunk_size, config.kernels.kv_block))
    pos = kl_positions(lT.numel(), rl.full_vocab_kl_positions, seed, step)
    row["full_vocab_kl"] = metrics.full_vocab_kl(
        None if batch.rollout_rows is None else batch.rollout_rows[pos], resp_rows[pos]
    )
    row["reward_mean"] = float(rewards.mean())
    row["pass_at_k"] = metrics.mean_pass_at_k(rewards, rl.pass_k)
    row["response_length_mean"] = float(batch.seq_index.bincount(minlength=rewards.numel()).double().mean())
    row["entropy_mean"] = metrics.entropy_mean(resp_rows)

    # 4. update (SkyRL's estimator and loss)
    t0 = time.perf_counter()
    # imported here: the engine actor imports this module's seeds and must never import skyrl
    from isoexec.rl.skyrl.algorithm import algorithm_config, policy_loss, sequence_advantages

    alg = algorithm_config(config, arm)
    adv = sequence_advantages(rewards, alg)  # [B] per sequence
    row["groups_used"] = len(problems)
    losses, norms, clip_fracs, corrections = [], [], [], []
    per_mb = len(problems) // rl.mini_batches  # contiguous slices of whole groups, as SkyRL's mini-batches
    for mb in range(rl.mini_batches):
        seqs = list(range(mb * per_mb * rl.group_size, (mb + 1) * per_mb * rl.group_size))
        sub = batch.select(seqs)
        old = lT[torch.cat([torch.nonzero(batch.seq_index == s).squeeze(1) for s in seqs])]
        new = token_logprobs(policy.trainer_logprobs(sub.input_ids, sub.cu_seqlens, grad=True), sub)
        (new_p, mask), (old_p, _) = sub.padded(new), sub.padded(old)
        adv_p, _ = sub.padded(adv[torch.tensor(seqs)][sub.seq_index])
        loss, stats = policy_loss(new_p, old_p, adv_p, mask, sub.padded(sub.rollout_logprobs)[0], alg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.set_lr(warmup_lr(rl.lr, rl.warmup_updates, optimizer.updates))
        norms.append(optimizer.step())
        losses.append(float(loss.detach()))
        clip_fracs.append(stats["clip_ratio"])
        corrections.append(metrics.correction_metrics(stats))
    t_train = time.perf_counter() - t0
    row["loss"] = sum(losses) / len(losses) if losses else 0.0
    row["grad_norm"] = sum(norms) / len(norms) if norms else 0.0
    row["clip_frac"] = sum(clip_fracs) / len(clip_fracs) if clip_fracs else 0.0
    row.update({k: sum(c[k] for c in corrections) / len(corrections) for k in metrics.CORRECTION_METRICS})

    # 5. weight sync
    t0 = time.perf_counter()
    engine.sync_weights(sync_state(policy), policy.contract())
    t_sync = time.perf_counter() - t0

    row.update({"time/generation": t_gen, "time/score": t_score, "time/train": t_train,
                "time/weight_sync": t_sync, "time/step": time.perf_counter() - t_step})
    return row


def run_rl(config: ExperimentConfig, arm: str, seed: int, init_dir: str | Path, out_dir: str | Path,
           steps: int | None = None, engine: Engine | None = None, policy: Policy | None = None,
           command: str | None = None) -> list[dict[str, Any]]:
    """One run of a paired experiment: ``steps`` (default ``rl.steps``) RL steps of ``arm`` from ``init_dir``.

    Args:
        arm: an arm of the experiment (:func:`isoexec.rl.arms.arms`: a mode, or an ``arms`` entry, which
            runs its mode's engine and trainer with its off-policy correction).
        engine, policy: injected implementations (tests); default the vLLM engine and the trainer of
            ``mode`` (:func:`isoexec.engines.factory.load_engine`, :func:`isoexec.trainer.factory.load_trainer`),
            both from ``init_dir``.
        command: recorded in ``provenance.json`` (default ``sys.argv``).

    Writes ``out_dir/metrics.jsonl`` (one row per step) and ``out_dir/provenance.json`` (with both sides'
    weight digests at load, ``weights_at_load``). Returns the rows.

    Raises:
        isoexec.engines.weight_sync.WeightSyncError: the engine and the trainer hold different weights at
            load (before any step), naming the tensors.
    """
    rl = config.rl
    the_arm = find_arm(config, arm)
    mode = the_arm.mode
    if mode == "isoexec" and rl.temperature != config.kernels.temperature:
        raise ValueError(f"rl.temperature={rl.temperature} differs from the contract's kernels.temperature="
                         f"{config.kernels.temperature}")
    if config.rl.dynamic_sampling:
        raise ValueError("rl.dynamic_sampling=true resamples prompts: only the SkyRL driver runs it (rl.driver: skyrl)")
    if policy is None and config.trainer.backend_for(mode) == "megatron":
        raise ValueError("trainer.backend='megatron' runs as a worker group under SkyRL (rl.driver: skyrl); "
                         "the in-process loop runs 'hf' and 'unified'")
    if rl.prompts_per_step % rl.mini_batches:
        raise ValueError(f"rl.prompts_per_step={rl.prompts_per_step} must be a multiple of rl.mini_batches="
                         f"{rl.mini_batches} (mini-batches of whole groups)")
    if not 1 <= rl.pass_k <= rl.group_size:
        raise ValueError(f"rl.pass_k={rl.pass_k} must be in [1, group_size={rl.group_size}]")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = load_tokenizer(init_dir)
    train, _ = load_splits(config.task)
    if policy is None:
        from isoexec.trainer.factory import load_trainer

        policy = load_trainer(config, mode, init_dir)
    optimizer = MasterAdamW(policy.named_parameters(), lr=rl.lr, weight_decay=rl.weight_decay,
                            max_grad_norm=rl.max_grad_norm)
    if engine is None:
        from isoexec.engines.factory import load_engine

        engine = load_engine(config, mode, init_dir, seed=seed)
    prov = provenance(command)
    prov["run"] = {"arm": arm, "mode": mode, "seed": seed, "init": str(init_dir), "steps": steps or rl.steps,
                   "engine": type(engine).__name__, "trainer": type(policy).__name__,
                   "torch_num_threads": torch.get_num_threads()}
    prov["weights_at_load"] = check_weights_at_load(engine.load_checksums, state_checksums(sync_state(policy)))
    atomic_write_json(out_dir / "provenance.json", prov)
    mlog = metrics.MetricsLog(out_dir / "metrics.jsonl")
    for step in range(steps if steps is not None else rl.steps):
        problems = step_prompts(train, seed, step, rl.prompts_per_step)
        row = rl_step(policy, engine, optimizer, tok, problems, config, seed, step, the_arm)
        mlog.append({"step": step, "arm": arm, "mode": mode, "seed": seed, **row})
        log.info("%s seed %d step %d: reward %.3f mismatch %d/%d max|d| %.3g crossing C %d/%d step %.2fs "
                 "(gen %.2f score %.2f train %.2f sync %.2f)", arm, seed, step, row["reward_mean"],
                 row["mismatch_count"], row["tokens"], row["logprob_abs_diff_max"], row["seqs_cross_chunk"],
                 row["seqs"], row["time/step"], row["time/generation"], row["time/score"], row["time/train"],
                 row["time/weight_sync"])
    return mlog.rows
