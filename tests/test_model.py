"""The unified model: transformers parity, checkpoint round trip, contract, and the bitwise gate matrix."""

import pytest
import torch

from isoexec.contract import diff
from isoexec.model import UnifiedModel
from isoexec.model.build import random_model
from isoexec.model.hf import hf_config
from isoexec.model.gates import run_gates


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, tiny_sections):
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(tiny_sections[0], vocab_size=96)
    hf = Qwen3NextForCausalLM(cfg).float().eval()
    with torch.no_grad():  # make the zero-initialised norms and gates matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(path)
    return hf, path


def _hf_logprobs(hf, ids):
    import transformers.models.qwen3_next.modeling_qwen3_next as M

    from isoexec.kernels.gdn import native

    # transformers would route GDN to flash-linear-attention's Triton kernels, which need a GPU.
    orig = M.torch_chunk_gated_delta_rule
    M.torch_chunk_gated_delta_rule = native.torch_references()[0]
    try:
        with torch.no_grad():
            return torch.log_softmax(hf(ids[None]).logits[0].float(), -1)
    finally:
        M.torch_chunk_gated_delta_rule = orig


@pytest.mark.parametrize("kernel_set", ["isoexec", "native"])
def test_logits_match_transformers_fp32(hf_checkpoint, kernel_set):
    hf, path = hf_checkpoint
    model = UnifiedModel.from_pretrained(path, kernel_set=kernel_set, dtype=torch.float32)
    ids = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(1))
    ours = model.trainer_logprobs(ids, torch.tensor([0, 50]))
    assert (ours - _hf_logprobs(hf, ids)).abs().max() < 1e-4


def test_checkpoint_round_trip(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint
    m = UnifiedModel.from_pretrained(path, dtype=torch.float32)
    m.save_pretrained(tmp_path / "out")
    m2 = UnifiedModel.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        UnifiedModel.from_pretrained(tmp_path)


def test_chunk_size_changes_numerical_policy(tiny_sections):
    ms, ks, _ = tiny_sections
    a = random_model(ms, ks, vocab_size=96).contract()
    b = random_model(ms, ks.model_copy(update={"chunk_size": 16}), vocab_size=96).contract()
    assert a.identities.semantic == b.identities.semantic
    assert a.identities.numerical_policy != b.identities.numerical_policy
    assert any("gdn.core" in line and "chunk_size" in line for line in diff(a, b))


def test_bad_cu_seqlens_are_refused(tiny_sections):
    m = random_model(tiny_sections[0], tiny_sections[1], vocab_size=96)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m.trainer_logprobs(torch.zeros(5, dtype=torch.long), torch.tensor([0, 3]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_isoexec_gates_all_bitwise_equal(tiny_sections, dtype):
    ms, ks, gs = tiny_sections
    model = random_model(ms, ks, "isoexec", vocab_size=96, dtype=dtype)
    cells = run_gates(model, gs, ks.chunk_size, "isoexec", str(dtype))
    assert len(cells) >= 15
    bad = [(c.gate, c.case_a, c.case_b, c.max_abs_diff) for c in cells if not c.bitwise_equal]
    assert not bad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_gates_detect_differences(tiny_sections, dtype):
    """Negative control: the same gates flag the stock kernels (attention/GDN decode, chunked prefill)."""
    ms, ks, gs = tiny_sections
    model = random_model(ms, ks, "native", vocab_size=96, dtype=dtype)
    cells = run_gates(model, gs, ks.chunk_size, "native", str(dtype))
    differ = {(c.gate, c.case_b.split("[")[0]) for c in cells if not c.bitwise_equal}
    assert ("decode_chunk_boundaries", "engine_decode") in differ
    assert ("prefill_split", "engine_prefill") in differ


def test_qwen3_5_moe_text_checkpoint_loads_and_matches_transformers(tmp_path, tiny_sections):
    """Qwen3.5's text model (separate GDN projections, M-RoPE on text positions) in fp32."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as M5

    from isoexec.kernels.gdn import native

    base = hf_config(tiny_sections[0], vocab_size=96).to_dict()
    keep = {k: base[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                                 "linear_key_head_dim", "linear_value_head_dim", "num_experts", "num_experts_per_tok",
                                 "moe_intermediate_size", "shared_expert_intermediate_size")}
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**keep)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    model = UnifiedModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in dict(model.named_parameters())
    ids = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(1))
    orig = M5.torch_chunk_gated_delta_rule
    M5.torch_chunk_gated_delta_rule = native.torch_references()[0]
    try:
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)
    finally:
        M5.torch_chunk_gated_delta_rule = orig
    assert (model.trainer_logprobs(ids, torch.tensor([0, 50])) - ref).abs().max() < 1e-4


def test_sequence_cache_refuses_another_kernel_set_or_constants(tiny_sections):
    ms, ks = tiny_sections[:2]
    a = random_model(ms, ks, vocab_size=96)
    b = random_model(ms, ks.model_copy(update={"kv_block": 2 * ks.kv_block}), vocab_size=96)
    cache = a.new_cache()
    a.engine_step([cache], [torch.arange(5)])
    with pytest.raises(ValueError, match="fingerprint"):
        b.engine_step([cache], [torch.arange(1)])


# --------------------------------------------------------------------------- input boundaries
@pytest.fixture(scope="module")
def small_model(tiny_sections):
    return random_model(tiny_sections[0], tiny_sections[1], vocab_size=96)


@pytest.mark.parametrize("bad", [-1, 96, 140])
def test_trainer_refuses_an_out_of_vocabulary_id_naming_it_its_position_and_v(small_model, bad):
    """An id of -1 used to be read as id V-1 (``weight[-1]``): the same bits on both sides, no gate sees it."""
    from isoexec.model.inputs import InputError

    ids = torch.tensor([5, 6, 7, bad, 8])
    msg = rf"token id {bad} at position 3 is outside the vocabulary \[0, 96\) \(V=96\)"
    with pytest.raises(InputError, match=msg):
        small_model.trainer_logprobs(ids, torch.tensor([0, 5]))
    with pytest.raises(InputError, match=r"token id .* at position \(0, 3\)"):
        small_model.trainer_logprobs_padded(ids[None], torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(InputError, match=rf"token id {bad} at position 3 "):
        small_model.engine_step([small_model.new_cache()], [ids])
    # positive control: the same batch with a valid id runs
    assert small_model.trainer_logprobs(ids.clamp(0, 95), torch.tensor([0, 5])).shape == (5, 96)


def test_trainer_refuses_non_integer_ids(small_model):
    from isoexec.model.inputs import InputError

    with pytest.raises(InputError, match="must be integers, got dtype torch.float32"):
        small_model.trainer_logprobs(torch.tensor([1.0, 2.0]), torch.tensor([0, 2]))


@pytest.mark.parametrize("call", [
    "packed_cu_seqlens_0",        # cu_seqlens=[0]: failed with "cannot reshape tensor of 0 elements"
    "packed_empty_sequence",      # a zero-length sequence inside cu_seqlens
    "padded_all_zero_mask_row",   # used to be accepted by the padded API
    "padded_empty_batch",
    "engine_step_no_chunk",
    "engine_step_empty_chunk",
])
def test_empty_and_degenerate_inputs_get_one_clear_error(small_model, call):
    from isoexec.model.inputs import InputError

    m = small_model
    ids = torch.tensor([1, 2, 3, 4])
    calls = {
        "packed_cu_seqlens_0": lambda: m.trainer_logprobs(torch.zeros(0, dtype=torch.long), torch.tensor([0])),
        "packed_empty_sequence": lambda: m.trainer_logprobs(ids, torch.tensor([0, 2, 2, 4])),
        "padded_all_zero_mask_row": lambda: m.trainer_logprobs_padded(
            torch.stack([ids, ids]), torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])),
        "padded_empty_batch": lambda: m.trainer_logprobs_padded(
            torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long)),
        "engine_step_no_chunk": lambda: m.engine_step([], []),
        "engine_step_empty_chunk": lambda: m.engine_step([m.new_cache()], [torch.zeros(0, dtype=torch.long)]),
    }
    with pytest.raises(InputError, match="^empty input: "):
        calls[call]()
