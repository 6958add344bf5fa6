"""SkyRL's configuration rendered from an isoexec experiment: GRPO + DAPO settings, isoexec settings carried."""

import pytest

pytest.importorskip("skyrl", reason="the skyrl extra is not installed")

from isoexec.config import ExperimentConfig, RLSection  # noqa: E402
from isoexec.rl.skyrl import compat  # noqa: E402

compat.install()

from isoexec.rl.skyrl import render  # noqa: E402
from isoexec.rl.skyrl.worker import isoexec_settings  # noqa: E402

EXP = ExperimentConfig(name="t", rl=RLSection(prompts_per_step=4, group_size=3, mini_batches=2, max_new_tokens=5,
                                              clip_low=0.2, clip_high=0.28, dynamic_sampling=True))


def _cfg(exp=EXP, mode="isoexec"):
    return render.build(render.local_overrides(exp, mode, 7, "/ckpt", "/data.parquet", "/run", steps=3))


def test_rendered_config_selects_skyrl_grpo_and_dapo_loss():
    cfg = _cfg()
    a = cfg.trainer.algorithm
    assert (a.advantage_estimator, a.policy_loss_type, a.loss_reduction) == ("grpo", "regular", "token_mean")
    assert (a.eps_clip_low, a.eps_clip_high) == (0.2, 0.28)
    assert a.grpo_norm_by_std and not a.use_kl_loss and not a.use_kl_in_reward
    assert a.dynamic_sampling.type == "filter"
    assert a.temperature == cfg.generator.sampling_params.temperature == EXP.rl.temperature
    assert (cfg.trainer.train_batch_size, cfg.trainer.policy_mini_batch_size) == (4, 2)
    assert cfg.generator.n_samples_per_prompt == 3 and cfg.generator.sampling_params.max_generate_length == 5
    assert cfg.trainer.max_training_steps == 3 and cfg.trainer.seed == 7 and cfg.trainer.critic.model.path is None


def test_dynamic_sampling_off_renders_no_filter():
    exp = EXP.model_copy(update={"rl": EXP.rl.model_copy(update={"dynamic_sampling": False})})
    assert _cfg(exp).trainer.algorithm.dynamic_sampling.type is None


def test_every_isoexec_setting_reaches_the_trainer_worker():
    exp = EXP.model_copy(update={"kernels": EXP.kernels.model_copy(update={"chunk_size": 32, "row_tile": 8})})
    mode, back = isoexec_settings(_cfg(exp, "native").trainer.policy.model_config_kwargs)
    assert mode == "native" and back == exp


def test_missing_isoexec_settings_are_refused():
    with pytest.raises(ValueError, match="model_config_kwargs has no 'isoexec'"):
        isoexec_settings({})


def test_prompts_not_divisible_by_mini_batches_are_refused():
    exp = EXP.model_copy(update={"rl": EXP.rl.model_copy(update={"prompts_per_step": 3})})
    with pytest.raises(ValueError, match="prompts_per_step=3 must be a multiple of rl.mini_batches=2"):
        render.algorithm_overrides(exp)


def test_epochs_cover_the_steps_without_a_thousand_passes():
    """trainer.epochs is what the run can consume (SkyRL logs 'Total steps' as batches x epochs): one batch per
    step, or up to SkyRL's max_sample_batches per step with dynamic sampling; too few prompts are refused."""
    plain = EXP.model_copy(update={"rl": EXP.rl.model_copy(update={"dynamic_sampling": False})})
    assert render.epochs_for(3, 8, plain) == 2 and render.epochs_for(2, 8, plain) == 1  # 2 batches of 4 prompts
    assert render.epochs_for(3, 8, EXP) == 45  # 3 steps x 30 sampled batches at most / 2 batches per pass
    assert _cfg().trainer.epochs == render.epochs_for(3, EXP.task.num_train_prompts, EXP) == 1
    with pytest.raises(ValueError, match="3 prompts, fewer than rl.prompts_per_step=4"):
        render.epochs_for(1, 3, EXP)
