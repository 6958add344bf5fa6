"""The native trainer (transformers Qwen3-Next on CPU), checkpoints, and the fp32-master optimizer."""

import pytest
import torch
from safetensors import safe_open

from isoexec.config import ModelSection
from isoexec.rl.sft import init_checkpoint
from isoexec.trainer.hf_policy import HFPolicy, unpack
from isoexec.trainer.optim import MasterAdamW
from isoexec.trainer.base import sync_state

SMALL = ModelSection(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                     moe_intermediate_size=32, shared_expert_intermediate_size=32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return init_checkpoint(SMALL, tmp_path_factory.mktemp("ckpt"), seed=0)


def test_checkpoint_is_bf16_with_tokenizer_and_padded_vocab(ckpt):
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "config.json").is_file()
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert f.get_tensor("lm_head.weight").shape[0] % 64 == 0


def test_init_is_deterministic_in_the_seed(tmp_path):
    a, b = init_checkpoint(SMALL, tmp_path / "a", seed=1), init_checkpoint(SMALL, tmp_path / "b", seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_native_trainer_runs_on_cpu_and_packing_matches_separate_sequences(ckpt):
    pol = HFPolicy.from_pretrained(ckpt, dtype=torch.float32)
    ids = torch.tensor([1, 5, 6, 7, 8, 1, 9, 10])
    cu = torch.tensor([0, 5, 8])
    lp = pol.trainer_logprobs(ids, cu, grad=False)
    assert lp.shape == (8, pol.model.config.vocab_size) and lp.dtype == torch.float32
    assert torch.allclose(lp.exp().sum(-1), torch.ones(8), atol=1e-5)
    alone = pol.trainer_logprobs(ids[5:], torch.tensor([0, 3]), grad=False)
    assert torch.allclose(lp[5:], alone, atol=1e-5)


def test_unpack_right_pads():
    padded, lens = unpack(torch.tensor([3, 4, 5, 6, 7]), torch.tensor([0, 2, 5]), pad_id=0)
    assert lens == [2, 3] and padded.tolist() == [[3, 4, 0], [5, 6, 7]]


def test_checkpoint_state_dict_uses_the_checkpoint_names_and_values(ckpt):
    pol = HFPolicy.from_pretrained(ckpt)
    sd = sync_state(pol)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert set(sd) == set(f.keys())
        for k in f.keys():
            assert torch.equal(sd[k], f.get_tensor(k)), k


def test_master_adamw_keeps_fp32_masters_and_writes_rounded_bf16():
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5], dtype=torch.bfloat16))
    opt = MasterAdamW([("w", p)], lr=1e-3, max_grad_norm=0.0)
    for _ in range(3):
        (p.float() * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        norm = opt.step()
    assert norm == pytest.approx(14 ** 0.5, rel=1e-2)
    master = opt.master["w"]
    assert master.dtype == torch.float32
    assert torch.equal(p.detach(), master.to(torch.bfloat16))
    # three Adam steps of 1e-3 each move the fp32 master by about 3e-3, below bf16's resolution at 1.0
    assert torch.allclose(master, torch.tensor([0.997, -1.003, 0.497]), atol=1e-4)
    assert p.grad is None


def test_master_adamw_clips_the_global_grad_norm():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = MasterAdamW([("w", p)], lr=1.0, max_grad_norm=1.0)
    p.grad = torch.full((4,), 10.0)
    assert opt.step() == pytest.approx(20.0)


@pytest.mark.parametrize("which", ["-1", "V", "V+100"])
def test_native_trainer_refuses_out_of_vocabulary_ids(ckpt, which):
    from isoexec.model.inputs import InputError

    pol = HFPolicy.from_pretrained(ckpt)
    V = pol.model.config.vocab_size
    bad = {"-1": -1, "V": V, "V+100": V + 100}[which]
    with pytest.raises(InputError, match=rf"token id {bad} at position 2 is outside the vocabulary \[0, {V}\)"):
        pol.trainer_logprobs(torch.tensor([1, 5, bad]), torch.tensor([0, 3]), grad=False)


@pytest.mark.parametrize("ids, cu", [([], [0]), ([1, 2, 3], [0, 2, 2, 3])])
def test_native_trainer_refuses_empty_inputs(ckpt, ids, cu):
    from isoexec.model.inputs import InputError

    pol = HFPolicy.from_pretrained(ckpt)
    with pytest.raises(InputError, match="^empty input: "):
        pol.trainer_logprobs(torch.tensor(ids, dtype=torch.long), torch.tensor(cu), grad=False)


def test_master_adamw_set_lr_scales_the_next_updates_and_counts_them():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = MasterAdamW([("w", p)], lr=1.0, max_grad_norm=0.0)
    opt.set_lr(0.0)
    p.grad = torch.ones(2)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(2)) and opt.updates == 1  # lr 0: no move
    opt.set_lr(1e-2)
    p.grad = torch.ones(2)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((2,), -1e-2), atol=1e-4) and opt.updates == 2
    p.grad = torch.full((2,), float("nan"))
    opt.step()
    assert opt.updates == 2  # a skipped (non-finite) update is not counted
