"""SFT warm start: teacher-forced cross-entropy on correct answers until eval accuracy is in a band.

RL needs a policy that is sometimes right and sometimes wrong (a group whose rewards are all equal
has zero advantage). The warm start therefore stops as soon as the *sampled* eval accuracy (at
``rl.temperature``, ``sft.eval_samples`` samples per eval prompt, measured on the bf16-rounded weights
that the engine will load) lies inside ``sft.target_accuracy`` (10%..60% by default), after at least
``sft.min_steps`` steps; otherwise it runs ``sft.steps`` steps and records that it missed the band.

Training: the transformers model with fp32 weights, AdamW (linear warm-up, then constant), global
grad-norm clip 1.0; loss = mean NLL of the answer digits and ``<eos>`` (prompt tokens carry no loss).
Batches are drawn with replacement from the train split by ``Random(sft.seed)``.

Output: ``out/`` (bf16 HF checkpoint + tokenizer) and ``out/sft_metrics.json``.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

from isoexec.config import ExperimentConfig
from isoexec.io import atomic_write_json
from isoexec.model.hf import DTYPES, build_checkpoint, save_hf_model
from isoexec.provenance import provenance
from isoexec.engines.local import LocalEngine
from isoexec.rl.task import Problem, answer_tokens, make_splits, reward
from isoexec.rl.tokenizer import build_tokenizer, encode_prompt, load_tokenizer
from isoexec.trainer.hf_policy import HFPolicy

log = logging.getLogger(__name__)


def sft_batch(tok, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack ``<bos> prompt answer <eos>`` sequences.

    Returns:
        ``(input_ids [T], cu_seqlens [B+1], target_rows [M], targets [M])``: the loss is the NLL of
        ``targets`` under rows ``target_rows`` of the ``[T, V]`` logprobs (answer digits and EOS).
    """
    ids: list[int] = []
    lens, rows, targets = [], [], []
    for p in problems:
        prompt = encode_prompt(tok, p.prompt)
        ans = tok.convert_tokens_to_ids(answer_tokens(p.answer)) + [tok.eos_token_id]
        start = len(ids)
        ids.extend(prompt + ans)
        lens.append(len(prompt) + len(ans))
        rows.extend(range(start + len(prompt) - 1, start + len(prompt) - 1 + len(ans)))
        targets.extend(ans)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lens).cumsum(0)])
    return torch.tensor(ids), cu, torch.tensor(rows), torch.tensor(targets)


@torch.no_grad()
def evaluate(policy: HFPolicy, tok, problems: list[Problem], samples: int, temperature: float,
             max_tokens: int, seed: int) -> dict[str, float]:
    """Accuracy of ``policy`` on ``problems``: sampled (``samples`` per prompt) and greedy.

    The weights are rounded to bf16 first (a copy), as the rollout engine will see them.
    """
    bf16 = HFPolicy(copy.deepcopy(policy.model).to(torch.bfloat16), temperature=temperature)
    engine = LocalEngine(bf16, tok.eos_token_id)
    prompts = [encode_prompt(tok, p.prompt) for p in problems]

    def acc(groups) -> float:
        rs = [reward(tok.convert_ids_to_tokens(c.token_ids), p.answer, tok.eos_token)
              for p, g in zip(problems, groups) for c in g]
        return sum(rs) / len(rs)

    sampled = acc(engine.generate(prompts, samples, max_tokens, seed, temperature))
    greedy = acc(engine.generate(prompts, 1, max_tokens, seed, 0.0))
    return {"accuracy": sampled, "greedy_accuracy": greedy}


def run_sft(config: ExperimentConfig, init_dir: str | Path, out_dir: str | Path,
            steps: int | None = None) -> dict[str, Any]:
    """Warm-start the checkpoint in ``init_dir``; write ``out_dir`` and ``out_dir/sft_metrics.json``.

    Args:
        steps: overrides ``sft.steps`` (quick runs, tests).

    Returns:
        The metrics dict written to ``sft_metrics.json``: ``accuracy`` (sampled, the band's
        measure), ``greedy_accuracy``, ``in_band``, ``steps``, ``loss``, ``history`` (every
        evaluation), ``time_s``, ``provenance``.
    """
    t_start = time.perf_counter()
    sft, rl = config.sft, config.rl
    max_steps = sft.steps if steps is None else steps
    lo, hi = sft.target_accuracy
    torch.manual_seed(sft.seed)
    tok = load_tokenizer(init_dir)
    train, eval_ = make_splits(config.task)
    policy = HFPolicy.from_pretrained(init_dir, temperature=rl.temperature, dtype=torch.float32)
    params = [p for p in policy.model.parameters()]
    opt = torch.optim.AdamW(params, lr=sft.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, sft.warmup_steps)))
    rng = random.Random(sft.seed)
    history: list[dict[str, float]] = []
    result: dict[str, float] = {}
    step, loss_val = 0, float("nan")
    for step in range(1, max_steps + 1):
        ids, cu, rows, targets = sft_batch(tok, [rng.choice(train) for _ in range(sft.batch_size)])
        lp = policy.trainer_logprobs(ids, cu, grad=True)
        loss = -lp[rows].gather(1, targets[:, None]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_val = float(loss.detach())
        if step % sft.eval_every == 0 or step == max_steps:
            result = evaluate(policy, tok, eval_, sft.eval_samples, rl.temperature, rl.max_new_tokens, sft.seed)
            history.append({"step": step, "loss": loss_val, **result})
            log.info("sft step %d loss %.4f acc %.3f greedy %.3f", step, loss_val, result["accuracy"],
                     result["greedy_accuracy"])
            if step >= sft.min_steps and lo <= result["accuracy"] <= hi:
                break
    in_band = bool(result) and lo <= result["accuracy"] <= hi
    if not in_band:
        log.warning("SFT ended at step %d with accuracy %s outside the band [%s, %s]", step,
                    result.get("accuracy"), lo, hi)
    out_dir = Path(out_dir)
    save_hf_model(policy.model, out_dir, DTYPES[config.model.dtype], tok)
    metrics = {
        "accuracy": result.get("accuracy"),
        "greedy_accuracy": result.get("greedy_accuracy"),
        "target_accuracy": [lo, hi],
        "in_band": in_band,
        "steps": step,
        "loss": loss_val,
        "eval_prompts": len(eval_),
        "eval_samples": sft.eval_samples,
        "temperature": rl.temperature,
        "history": history,
        "time_s": time.perf_counter() - t_start,
        "provenance": provenance(),
    }
    atomic_write_json(out_dir / "sft_metrics.json", metrics)
    return metrics


def init_checkpoint(section, out: str | Path, seed: int = 0) -> Path:
    """The RL task's initial checkpoint: a fresh ``Qwen3NextForCausalLM`` of ``section`` (an
    ``isoexec.config.ModelSection``) with the task tokenizer (:func:`isoexec.model.hf.build_checkpoint`,
    deterministic in ``seed``)."""
    return build_checkpoint(out, section, seed=seed, tokenizer=build_tokenizer())
