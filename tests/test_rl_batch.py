"""Batch packing of the in-process loop, and SkyRL's GRPO advantages and DAPO loss as the experiment
configures them (clip 0.2 / 0.28, token-mean), through the loop's SkyRL layer."""

import pytest
import torch

from isoexec.config import ExperimentConfig, RLSection
from isoexec.engines.base import Completion
from isoexec.rl.batch import build_batch, token_logprobs


def _alg(**rl):
    pytest.importorskip("skyrl", reason="the skyrl extra is not installed")
    from isoexec.rl.skyrl.algorithm import algorithm_config

    return algorithm_config(ExperimentConfig(name="t", rl=RLSection(**rl)))


def _loss(new, old, adv, mask=None, **rl):
    """SkyRL's configured loss over one row of tokens ``[1, N]``."""
    from isoexec.rl.skyrl.algorithm import policy_loss

    mask = torch.ones(1, len(new)) if mask is None else mask[None].float()
    return policy_loss(new[None], old[None], adv[None], mask, old[None], _alg(**rl))


def test_skyrl_grpo_advantages_center_and_scale_by_the_sample_std_per_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    alg = _alg(advantage_std_norm=False)
    from isoexec.rl.skyrl.algorithm import sequence_advantages

    a = sequence_advantages(r, alg).view(3, 4)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(a[1], torch.zeros(4))
    assert torch.allclose(a[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]))
    s = sequence_advantages(r, _alg(advantage_std_norm=True)).view(3, 4)
    assert torch.allclose(s[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (1 / 3) ** 0.5, atol=1e-5)  # sample std
    assert torch.equal(s[1], torch.zeros(4))


def test_ratio_one_gives_minus_mean_advantage_and_the_policy_gradient():
    adv = torch.tensor([1.0, -2.0, 0.5])
    old = torch.tensor([-1.0, -2.0, -3.0])
    new = old.clone().requires_grad_(True)
    loss, stats = _loss(new, old, adv)
    assert loss.item() == pytest.approx(-adv.mean().item())
    loss.backward()
    assert torch.allclose(new.grad, -adv / 3)
    assert stats["clip_ratio"] == 0.0


def test_dapo_clip_higher_is_asymmetric():
    old = torch.zeros(1)
    # positive advantage: the ratio is capped at 1 + clip_high = 1.28 (not 1.2)
    for r, expect in [(1.25, 1.25), (1.5, 1.28)]:
        new = torch.log(torch.tensor([r])).requires_grad_(True)
        loss, _ = _loss(new, old, torch.tensor([1.0]))
        assert loss.item() == pytest.approx(-expect, rel=1e-6)
        loss.backward()
        assert (new.grad.abs().item() == 0.0) == (r > 1.28)
    # negative advantage: the ratio is floored at 1 - clip_low = 0.8
    for r, expect in [(0.85, 0.85), (0.5, 0.8)]:
        new = torch.log(torch.tensor([r])).requires_grad_(True)
        loss, _ = _loss(new, old, torch.tensor([-1.0]))
        assert loss.item() == pytest.approx(expect, rel=1e-6)
    # negative advantage with a large ratio is NOT clipped (pessimistic max)
    loss, stats = _loss(torch.log(torch.tensor([3.0])), old, torch.tensor([-1.0]))
    assert loss.item() == pytest.approx(3.0, rel=1e-6) and stats["clip_ratio"] == 0.0


def test_token_mean_loss_is_averaged_over_tokens_not_sequences():
    # sequence A: 1 token with advantage +1; sequence B: 3 tokens with advantage -1.
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    lp = torch.zeros(4)
    loss, _ = _loss(lp, lp, adv)
    assert loss.item() == pytest.approx(-(1 - 3) / 4)  # token mean 0.5; a per-sequence mean would give 0
    loss, _ = _loss(lp, lp, adv, mask=torch.tensor([True, True, False, False]))
    assert loss.item() == pytest.approx(0.0)


def _comp(tokens, base):
    return Completion(tokens, torch.full((len(tokens),), base, dtype=torch.float32))


def test_build_batch_maps_each_response_token_to_the_row_that_predicts_it():
    prompts = [[1, 5, 6], [1, 7]]
    comps = [[_comp([10, 2], -1.0), _comp([11], -2.0)], [_comp([12, 13, 2], -3.0), _comp([2], -4.0)]]
    b = build_batch(prompts, comps)
    assert b.cu_seqlens.tolist() == [0, 5, 9, 14, 17]
    for r, t in zip(b.score_rows.tolist(), b.tokens.tolist()):
        assert b.input_ids[r + 1].item() == t  # row r predicts the token at r+1
    assert b.seq_index.tolist() == [0, 0, 1, 2, 2, 2, 3]
    full = torch.randn(17, 16).log_softmax(-1)
    full[:, 10:14] = full[:, 10:14]
    lt = token_logprobs(full, b)
    assert torch.equal(lt, full[b.score_rows, b.tokens])
    sub = b.select([2, 0])
    assert sub.cu_seqlens.tolist() == [0, 5, 10]
    assert sub.tokens.tolist() == [12, 13, 2, 10, 2]
    for r, t in zip(sub.score_rows.tolist(), sub.tokens.tolist()):
        assert sub.input_ids[r + 1].item() == t
    assert sub.rollout_logprobs.tolist() == [-3.0, -3.0, -3.0, -1.0, -1.0]
    vals, mask = sub.padded(sub.rollout_logprobs)
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert vals.tolist() == [[-3.0, -3.0, -3.0], [-1.0, -1.0, 0.0]]
