"""The arms of a paired experiment: the config section, the interleaved schedule, and the off-policy
correction reaching SkyRL's own loss (not an isoexec reimplementation)."""

import pytest
import torch

from isoexec.config import ArmSection, ExperimentConfig, OffPolicyCorrection, RLSection
from isoexec.rl.arms import arm_names, arms, find_arm, schedule, seed_rounds

TIS = ArmSection(name="native-tis", mode="native")
EXP = ExperimentConfig(name="t", rl=RLSection(seeds=[0, 1, 2, 3]), arms=[TIS])


def test_arms_are_the_modes_then_the_arms_section():
    assert arm_names(EXP) == ["native", "isoexec", "native-tis"]
    tis = find_arm(EXP, "native-tis")
    assert tis.mode == "native" and tis.correction.tis_ratio_type == "token"
    assert tis.correction.token_tis_ratio_clip_high == 2.0
    assert find_arm(EXP, "isoexec").correction is None
    with pytest.raises(ValueError, match="'nope' is not an arm of experiment 't'; its arms: native, isoexec, native-tis"):
        find_arm(EXP, "nope")


def test_schedule_runs_each_seeds_arms_back_to_back_turning_the_order():
    order = [(a.name, s) for a, s in schedule(EXP)]
    assert order == [("native", 0), ("isoexec", 0), ("native-tis", 0),
                     ("isoexec", 1), ("native-tis", 1), ("native", 1),
                     ("native-tis", 2), ("native", 2), ("isoexec", 2),
                     ("native", 3), ("isoexec", 3), ("native-tis", 3)]
    # every arm takes every place once per len(arms) seeds, and every (arm, seed) runs exactly once
    assert sorted(order) == sorted((a, s) for a in arm_names(EXP) for s in EXP.rl.seeds)
    assert [o[0] for o in order[::3]] == ["native", "isoexec", "native-tis", "native"]


def test_seed_rounds_give_each_seed_its_arms_in_the_turned_order_the_schedule_runs():
    rounds = [(s, [a.name for a in seed_arms]) for s, seed_arms in seed_rounds(EXP)]
    assert rounds == [(0, ["native", "isoexec", "native-tis"]), (1, ["isoexec", "native-tis", "native"]),
                      (2, ["native-tis", "native", "isoexec"]), (3, ["native", "isoexec", "native-tis"])]
    assert [(a.name, s) for a, s in schedule(EXP)] == [(a, s) for s, names in rounds for a in names]


def test_skyrl_overrides_name_the_correction_or_turn_it_off():
    assert find_arm(EXP, "native").skyrl_overrides() == {
        "trainer.algorithm.off_policy_correction.tis_ratio_type": None,
        "trainer.algorithm.off_policy_correction.sequence_mask_metric": None}
    over = find_arm(EXP, "native-tis").skyrl_overrides()
    assert over["trainer.algorithm.off_policy_correction.tis_ratio_type"] == "token"
    assert over["trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high"] == 2.0
    assert set(over) == {f"trainer.algorithm.off_policy_correction.{k}" for k in OffPolicyCorrection.model_fields}


@pytest.mark.parametrize("arms_section, message", [
    ([{"name": "native", "mode": "native"}], "arms[0].name='native' is a mode's name"),
    ([{"name": "a"}, {"name": "a"}], "arms[1].name='a' is given twice"),
    ([{"name": "Native+TIS"}], "arms.0.name='Native+TIS'"),
    ([{"name": "iso-tis", "mode": "isoexec"}], "arms[0].mode='isoexec' is not one of rl.modes=['native']"),
    ([{"name": "x", "off_policy_correction": {"tis_ratio_type": None}}], "would run 'native' unchanged"),
])
def test_bad_arms_are_refused_at_load_naming_the_entry(tmp_path, arms_section, message):
    import yaml

    from isoexec.config import load_config

    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump({"name": "e", "rl": {"modes": ["native"]}, "arms": arms_section}))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        load_config(path)


def test_a_loss_skyrl_corrects_nothing_with_is_refused():
    with pytest.raises(ValueError, match="rl.policy_loss='clip_cov': SkyRL applies no off-policy correction"):
        ExperimentConfig(name="t", rl=RLSection(policy_loss="clip_cov"), arms=[TIS])


def test_the_correction_is_skyrls_inside_its_policy_loss():
    """The arm's settings reach SkyRL's AlgorithmConfig, and SkyRL's loss then weights each token by
    min(exp(old - rollout), 2): nothing changes where the rollout logprobs are the trainer's own; where
    they differ, a token whose ratio exceeds the cap is counted as capped."""
    pytest.importorskip("skyrl", reason="the skyrl extra is not installed")
    from isoexec.rl.skyrl.algorithm import algorithm_config, policy_loss

    plain, tis = algorithm_config(EXP, find_arm(EXP, "native")), algorithm_config(EXP, find_arm(EXP, "native-tis"))
    assert plain.off_policy_correction.tis_ratio_type is None
    assert (tis.off_policy_correction.tis_ratio_type, tis.off_policy_correction.token_tis_ratio_clip_high) == ("token", 2.0)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g)
    new = (old + 0.05 * torch.randn(4, 6, generator=g)).requires_grad_()
    adv, mask = torch.randn(4, 6, generator=g), torch.ones(4, 6)
    same = [policy_loss(new, old, adv, mask, old, c)[0] for c in (plain, tis)]
    assert torch.equal(same[0], same[1])  # rollout == old: every TIS weight is exactly 1
    rollout = old - torch.linspace(-0.5, 1.0, 24).reshape(4, 6)  # ratios exp(old - rollout) from 0.61 to 2.7
    (base, _), (corrected, stats) = (policy_loss(new, old, adv, mask, rollout, c) for c in (plain, tis))
    assert not torch.equal(base, corrected)
    assert stats["tis_token_clip_high_ratio"] == pytest.approx(float((torch.exp(old - rollout) > 2).float().mean()))
