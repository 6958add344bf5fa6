"""GRPO/DAPO pieces: advantages, the clip-higher token-level loss, batch packing."""

import pytest
import torch

from isoexec.rl.grpo import build_batch, group_advantages, informative_groups, policy_loss, token_logprobs
from isoexec.engines.base import Completion


def test_group_advantages_center_and_optionally_scale_per_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    a = group_advantages(r, std_norm=False)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(a[1], torch.zeros(4))
    assert torch.allclose(a[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]))
    s = group_advantages(r, std_norm=True)
    assert torch.allclose(s[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(s[1], torch.zeros(4))
    assert informative_groups(r).tolist() == [True, False, True]


def test_ratio_one_gives_minus_mean_advantage_and_the_policy_gradient():
    adv = torch.tensor([1.0, -2.0, 0.5])
    old = torch.tensor([-1.0, -2.0, -3.0])
    new = old.clone().requires_grad_(True)
    loss, stats = policy_loss(new, old, adv, 0.2, 0.28)
    assert loss.item() == pytest.approx(-adv.mean().item())
    loss.backward()
    assert torch.allclose(new.grad, -adv / 3)
    assert stats["clip_frac"] == 0.0


def test_clip_higher_is_asymmetric():
    old = torch.zeros(1)
    # positive advantage: the ratio is capped at 1 + clip_high = 1.28 (not 1.2)
    for r, expect in [(1.25, 1.25), (1.5, 1.28)]:
        new = torch.log(torch.tensor([r])).requires_grad_(True)
        loss, stats = policy_loss(new, old, torch.tensor([1.0]), 0.2, 0.28)
        assert loss.item() == pytest.approx(-expect, rel=1e-6)
        loss.backward()
        assert (new.grad.abs().item() == 0.0) == (r > 1.28)
    # negative advantage: the ratio is floored at 1 - clip_low = 0.8
    for r, expect in [(0.85, 0.85), (0.5, 0.8)]:
        new = torch.log(torch.tensor([r])).requires_grad_(True)
        loss, _ = policy_loss(new, old, torch.tensor([-1.0]), 0.2, 0.28)
        assert loss.item() == pytest.approx(expect, rel=1e-6)
    # negative advantage with a large ratio is NOT clipped (pessimistic max)
    new = torch.log(torch.tensor([3.0]))
    loss, stats = policy_loss(new, old, torch.tensor([-1.0]), 0.2, 0.28)
    assert loss.item() == pytest.approx(3.0, rel=1e-6) and stats["clip_frac"] == 0.0


def test_loss_is_averaged_over_tokens_not_sequences():
    # sequence A: 1 token with advantage +1; sequence B: 3 tokens with advantage -1.
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    lp = torch.zeros(4)
    loss, _ = policy_loss(lp, lp, adv, 0.2, 0.28)
    assert loss.item() == pytest.approx(-(1 - 3) / 4)  # token mean 0.5; a per-sequence mean would give 0
    mask = torch.tensor([True, True, False, False])
    loss, _ = policy_loss(lp, lp, adv, 0.2, 0.28, mask=mask)
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
