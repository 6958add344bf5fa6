"""SFT warm start: teacher-forced cross-entropy on scratchpad solutions until eval accuracy is in a band.

RL needs a policy that is sometimes right and sometimes wrong (a group whose rewards are all equal
has zero advantage). The warm start therefore stops as soon as the eval split's *expected* accuracy
lies inside ``sft.target_accuracy``, after at least ``sft.min_steps`` steps; otherwise it runs
``sft.steps`` steps and records that it missed the band. Expected accuracy (:func:`expected_accuracy`)
is the mean over eval prompts of the probability that sampling at ``rl.temperature`` reproduces the
reference solution exactly, ``exp(sum_t logp(solution_t))`` (EOS included), from one teacher-forced
forward of the bf16-rounded weights that the engine will load: a deterministic lower bound of the
sampled accuracy (another response can also end in the right answer) that costs one forward instead
of a token-by-token sampling run. The sampled accuracy (``sft.eval_samples`` samples per eval prompt)
and the greedy accuracy are measured once, on the final weights, and recorded beside it.

Training: the transformers model with fp32 weights, AdamW (linear warm-up, then constant), global
grad-norm clip 1.0; loss = mean NLL of the solution tokens (``extra_info.solution`` of the embedded
task's DAPO-schema rows, :mod:`isoexec.rl.data`) and ``<eos>``; prompt tokens carry no loss. Batches are
drawn with replacement from the train split by ``Random(sft.seed)``. Accuracy is DAPO-Math's rule
(:mod:`isoexec.rl.reward`) on the decoded responses.

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
from isoexec.rl.data import Example, load_splits, prompt_token_ids
from isoexec.rl.reward import reward, response_text
from isoexec.rl.tokenizer import build_tokenizer, load_tokenizer
from isoexec.trainer.hf_policy import HFPolicy

log = logging.getLogger(__name__)


def sft_batch(tok, problems: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack ``<bos> prompt solution <eos>`` sequences.

    Returns:
        ``(input_ids [T], cu_seqlens [B+1], target_rows [M], targets [M])``: the loss is the NLL of
        ``targets`` under rows ``target_rows`` of the ``[T, V]`` logprobs (solution tokens and EOS).
    """
    ids: list[int] = []
    lens, rows, targets = [], [], []
    for p in problems:
        prompt = prompt_token_ids(tok, p)
        ans = tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        start = len(ids)
        ids.extend(prompt + ans)
        lens.append(len(prompt) + len(ans))
        rows.extend(range(start + len(prompt) - 1, start + len(prompt) - 1 + len(ans)))
        targets.extend(ans)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lens).cumsum(0)])
    return torch.tensor(ids), cu, torch.tensor(rows), torch.tensor(targets)


def _bf16_copy(policy: HFPolicy, temperature: float) -> HFPolicy:
    """The weights rounded to bf16 (a copy), as the rollout engine will see them."""
    return HFPolicy(copy.deepcopy(policy.model).to(torch.bfloat16), temperature=temperature)


@torch.no_grad()
def expected_accuracy(policy: HFPolicy, tok, problems: list[Example], temperature: float) -> float:
    """Mean over ``problems`` of ``exp(sum of the logprobs of solution + EOS)`` under the bf16-rounded
    weights at ``temperature``: the probability that sampling reproduces each reference solution."""
    ids, cu, rows, targets = sft_batch(tok, problems)
    lp = _bf16_copy(policy, temperature).trainer_logprobs(ids, cu, grad=False)[rows].gather(1, targets[:, None])
    per_seq = torch.zeros(len(problems), dtype=torch.float64)
    lens = torch.tensor([len(tok(p.solution, add_special_tokens=False)["input_ids"]) + 1 for p in problems])
    per_seq.index_add_(0, torch.repeat_interleave(torch.arange(len(problems)), lens), lp.squeeze(1).double())
    return float(per_seq.exp().mean())


@torch.no_grad()
def evaluate(policy: HFPolicy, tok, problems: list[Example], samples: int, temperature: float,
             max_tokens: int, seed: int) -> dict[str, float]:
    """Accuracy of ``policy`` on ``problems``: sampled (``samples`` per prompt) and greedy.

    The weights are rounded to bf16 first (a copy), as the rollout engine will see them.
    """
    engine = LocalEngine(_bf16_copy(policy, temperature), tok.eos_token_id)
    prompts = [prompt_token_ids(tok, p) for p in problems]

    def acc(groups) -> float:
        rs = [reward(response_text(tok, c.token_ids), p.ground_truth) for p, g in zip(problems, groups) for c in g]
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
        The metrics dict written to ``sft_metrics.json``: ``expected_accuracy`` (the band's
        measure), ``accuracy`` (sampled) and ``greedy_accuracy`` of the final weights, ``in_band``,
        ``steps``, ``loss``, ``history`` (every check: step, loss, expected_accuracy), ``time_s``,
        ``provenance``.

    Raises:
        ValueError: the task's rows carry no solutions (``task.data_path`` set to other data).
    """
    t_start = time.perf_counter()
    sft, rl = config.sft, config.rl
    max_steps = sft.steps if steps is None else steps
    lo, hi = sft.target_accuracy
    torch.manual_seed(sft.seed)
    tok = load_tokenizer(init_dir)
    train, eval_ = load_splits(config.task)
    if eval_ is None or any(p.solution is None for p in train):
        raise ValueError(f"SFT needs the embedded task (rows with extra_info.solution); task.data_path="
                         f"{config.task.data_path!r} gives rows without solutions")
    policy = HFPolicy.from_pretrained(init_dir, temperature=rl.temperature, dtype=torch.float32)
    params = [p for p in policy.model.parameters()]
    opt = torch.optim.AdamW(params, lr=sft.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, sft.warmup_steps)))
    rng = random.Random(sft.seed)
    history: list[dict[str, float]] = []
    expected = float("nan")
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
            expected = expected_accuracy(policy, tok, eval_, rl.temperature)
            history.append({"step": step, "loss": loss_val, "expected_accuracy": expected})
            log.info("sft step %d loss %.4f expected accuracy %.3f", step, loss_val, expected)
            if step >= sft.min_steps and lo <= expected <= hi:
                break
    in_band = lo <= expected <= hi
    if not in_band:
        log.warning("SFT ended at step %d with expected accuracy %s outside the band [%s, %s]", step, expected, lo, hi)
    result = evaluate(policy, tok, eval_, sft.eval_samples, rl.temperature, rl.max_new_tokens, sft.seed)
    log.info("sft final: expected accuracy %.3f, sampled %.3f, greedy %.3f", expected, result["accuracy"],
             result["greedy_accuracy"])
    out_dir = Path(out_dir)
    save_hf_model(policy.model, out_dir, DTYPES[config.model.dtype], tok)
    metrics = {
        "expected_accuracy": expected,
        "accuracy": result["accuracy"],
        "greedy_accuracy": result["greedy_accuracy"],
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
