"""Megatron-core as the trainer (native and isoexec kernel sets) on CPU over gloo, several processes.

One launch per world size (1, 2, 4) runs every case of that size in the same processes
(:func:`_worker`); the tests below read its results. Bitwise claims compare full-vocabulary fp32
logprob rows with ``torch.equal``; each has its native negative control beside it.

Model: a tiny Qwen3-Next (GDN + gated attention, MoE with shared expert) whose head counts split over
TP 4; batches of three right-padded sequences, one longer than two GDN chunks (C = 64).
"""

from pathlib import Path

import pytest
import torch

from isoexec.bench.megatron_gpu import engine_rows
from isoexec.config import KernelSection
from isoexec.trainer.megatron.config import Layout

KERNELS = KernelSection(vocab_block=32)  # C = 64, kv_block = 64: the 150-token sequence crosses both
LENGTHS = [150, 70, 9]
VOCAB = 96
TP2, TP4 = Layout(tp=2, sp=True), Layout(tp=4, sp=True)
EP2, TP2_EP2 = Layout(ep=2), Layout(tp=2, sp=True, ep=2)
# (name, layout, kernel set, dtype, optimizer step)
CASES = {
    1: [("native_fp32_tp1", Layout(), "native", torch.float32, True),
        ("native_tp1", Layout(), "native", torch.bfloat16, False),
        ("isoexec_tp1", Layout(), "isoexec", torch.bfloat16, True)],
    2: [("native_tp2", TP2, "native", torch.bfloat16, False),
        ("native_fp32_tp2", TP2, "native", torch.float32, True),
        ("isoexec_tp2", TP2, "isoexec", torch.bfloat16, True),
        ("isoexec_ep2", EP2, "isoexec", torch.bfloat16, False),
        ("isoexec_tp2_ep2", TP2_EP2, "isoexec", torch.bfloat16, False)],
    4: [("isoexec_tp4", TP4, "isoexec", torch.bfloat16, False),
        ("native_tp4", TP4, "native", torch.bfloat16, False)],
}
ISO_LAYOUTS = ["isoexec_tp1", "isoexec_tp2", "isoexec_tp4", "isoexec_ep2", "isoexec_tp2_ep2"]


def tiny_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, max_position_embeddings=512, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, architectures=["Qwen3NextForCausalLM"],
    )


def _batch():
    ids = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(1))
    return ids, torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])


def _worker(rank, world, hf_state):
    """Every case of this world size on one rank: logprobs (trainer_score, trainer_fwd), the HF round
    trip through the gathered state, one optimizer step (loss, grad norm, logprobs after it)."""
    from isoexec.model.inputs import InputError
    from isoexec.trainer.megatron.launch import init_parallel
    from isoexec.trainer.megatron.trainer import MegatronTrainer

    ids, cu = _batch()
    out = {}
    for name, layout, kernel_set, dtype, step in CASES[world]:
        init_parallel(layout)
        t = MegatronTrainer(tiny_config(), layout, kernel_set, KERNELS, dtype, lr=1e-3)
        hf = {k: v.to(dtype) for k, v in hf_state.items()}
        t.load_hf_state_dict(hf)
        back = t.checkpoint_state_dict()
        r = {"score": t.trainer_logprobs(ids, cu, grad=False),
             "round_trip": set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)}
        try:
            t.trainer_logprobs(torch.tensor([3, VOCAB]), torch.tensor([0, 2]), grad=False)
        except InputError as e:
            r["refused"] = str(e)
        lp = t.trainer_logprobs(ids, cu, grad=True)
        r["fwd"] = lp.detach()
        if step:
            loss = -lp[torch.arange(len(ids) - 1), ids[1:]].mean()
            loss.backward()
            r["loss"], r["grad_norm"] = loss.detach(), t.step()
            r["after_step"] = t.trainer_logprobs(ids, cu, grad=False)
        out[name] = r
    return out


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen3NextForCausalLM

    from isoexec.trainer.hf_policy import HFPolicy

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(tiny_config()).float().eval()
    with torch.no_grad():  # make the zero-initialised norms and the shared-expert gate matter
        for name, p in model.named_parameters():
            if "norm" in name or "shared_expert_gate" in name:
                p.add_(torch.randn_like(p) * 0.1)
    policy = HFPolicy(model)
    return policy, {k: v.clone() for k, v in policy.checkpoint_state_dict().items()}


def run_cases(worker, worlds, hf_state) -> dict:
    """{case name: [per-rank results]} of ``worker`` from one launch per world size in ``worlds``."""
    from isoexec.trainer.megatron.launch import run

    out = {}
    for world in worlds:
        ranks = run(worker, world, hf_state)
        for name in ranks[0]:
            out[name] = [r[name] for r in ranks]
    return out


@pytest.fixture(scope="module")
def runs(hf_model):
    """{case name: [per-rank results]} from one launch per world size."""
    return run_cases(_worker, CASES, hf_model[1])


@pytest.fixture(scope="module")
def unified(hf_model):
    """(isoexec, native) unified models in bf16 on the same weights."""
    from isoexec.kernels import build_kernel_set
    from isoexec.model import UnifiedModel

    sd = {k: v.to(torch.bfloat16) for k, v in hf_model[1].items()}
    models = []
    for name in ("isoexec", "native"):
        m = UnifiedModel.from_config(tiny_config(), build_kernel_set(name, "cpu", KERNELS), torch.bfloat16)
        m.load_state_dict(sd, strict=True)
        models.append(m)
    return models


def _maxdiff(a, b):
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------- native
def test_native_megatron_tp1_matches_transformers_fp32(runs, hf_model):
    ids, cu = _batch()
    ref = hf_model[0].trainer_logprobs(ids, cu, grad=False)
    diff = _maxdiff(runs["native_fp32_tp1"][0]["score"], ref)
    print(f"native Megatron TP1 vs transformers, fp32 logprobs: max |diff| {diff:.3e}")
    assert diff < 1e-5


def test_native_megatron_tp2_differs_from_tp1_negative_control(runs):
    for dtype, (a, b) in {"bf16": ("native_tp1", "native_tp2"), "fp32": ("native_fp32_tp1", "native_fp32_tp2")}.items():
        x, y = runs[a][0]["score"], runs[b][0]["score"]
        print(f"native Megatron TP2 vs TP1 ({dtype}): max |diff| {_maxdiff(x, y):.3e}, "
              f"{int((x != y).sum())}/{x.numel()} logprobs differ")
        assert not torch.equal(x, y)
    x, y = runs["native_tp1"][0]["score"], runs["native_tp4"][0]["score"]
    print(f"native Megatron TP4 vs TP1 (bf16): max |diff| {_maxdiff(x, y):.3e}")
    assert not torch.equal(x, y)


def test_native_megatron_differs_from_the_native_engine_negative_control(runs, unified):
    ids, cu = _batch()
    eng = engine_rows(unified[1], ids, cu)
    x = runs["native_tp1"][0]["score"]
    print(f"native Megatron TP1 vs native engine path (bf16): max |diff| {_maxdiff(x, eng):.3e}")
    assert not torch.equal(x, eng)


# ------------------------------------------------------------------------------------ isoexec
@pytest.mark.parametrize("case", ISO_LAYOUTS)
def test_isoexec_trainer_bitwise_equal_across_layouts_and_to_the_engine(runs, unified, case):
    """trainer_score and trainer_fwd at TP 1/2/4 (SP), EP 2 and TP 2 x EP 2, on every rank, equal the
    unified model's trainer rows and its engine path (chunked prefill + decode), bit for bit."""
    ids, cu = _batch()
    ref = unified[0].trainer_logprobs(ids, cu)
    assert torch.equal(engine_rows(unified[0], ids, cu), ref)
    for rank, r in enumerate(runs[case]):
        assert torch.equal(r["score"], ref), (case, rank, _maxdiff(r["score"], ref))
        assert torch.equal(r["fwd"], ref), (case, rank, _maxdiff(r["fwd"], ref))


def test_converter_round_trips_every_tensor_bitwise(runs, hf_model):
    """HF -> Megatron -> HF is the identity at TP 1, 2, 4 and expert TP 1, 2, 4 in one process, and
    through the gathered state of every multi-process layout (TP 2/4, EP 2, TP 2 x EP 2)."""
    from isoexec.trainer.megatron.convert import full_to_hf, hf_to_full

    cfg, hf = tiny_config(), hf_model[1]
    for tp in (1, 2, 4):
        full = hf_to_full(hf, cfg, tp, etp=tp)
        assert all(len(s) in (1, tp) for s in full.values())
        back = full_to_hf(full, cfg)
        assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf), tp
    for name, ranks in runs.items():
        assert all(r["round_trip"] for r in ranks), name


def test_token_ids_outside_the_vocabulary_are_refused_on_every_rank(runs):
    for name, ranks in runs.items():
        assert all(f"token id {VOCAB} at position 1" in r.get("refused", "") for r in ranks), name


def test_layouts_that_do_not_divide_the_model_are_refused(hf_model):
    from isoexec.trainer.megatron.config import transformer_config
    from isoexec.trainer.megatron.convert import hf_to_full

    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        hf_to_full(hf_model[1], tiny_config(), tp=3)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp=8"):
        transformer_config(tiny_config(), Layout(tp=8, sp=True), torch.bfloat16)
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep=8"):
        transformer_config(tiny_config(), Layout(ep=8), torch.bfloat16)
    with pytest.raises(ValueError, match="needs sp=True"):
        Layout(tp=2).check()


# ---------------------------------------------------------------------------------- optimizer
def test_optimizer_step_tp1_vs_tp2_same_loss_close_grad_norm(runs):
    """One step of the fp32-master AdamW on Megatron's main_grad: the isoexec loss is bitwise equal at
    TP 1 and 2 (the forward is), the native one close; grad norms agree closely; the updated
    policies stay close."""
    for a, b, bitwise in [("isoexec_tp1", "isoexec_tp2", True), ("native_fp32_tp1", "native_fp32_tp2", False)]:
        x, y = runs[a][0], runs[b][0]
        print(f"{a} vs {b}: loss {x['loss'].item():.7f} / {y['loss'].item():.7f}, "
              f"grad norm {x['grad_norm']:.7f} / {y['grad_norm']:.7f}, "
              f"logprobs after the step max |diff| {_maxdiff(x['after_step'], y['after_step']):.3e}")
        if bitwise:
            assert torch.equal(x["loss"], y["loss"])
        assert torch.allclose(x["loss"], y["loss"], rtol=1e-6)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-3 * x["grad_norm"]
        assert all(r["grad_norm"] == y["grad_norm"] for r in runs[b])
        assert _maxdiff(x["after_step"], y["after_step"]) < 5e-2
        assert _maxdiff(x["after_step"], x["score"]) > 0  # the step changed the policy


# ----------------------------------------------------------------------------------- contract
def test_isoexec_contract_claims_the_proven_topology_and_refuses_others(unified):
    from isoexec.contract import ClaimViolation
    from isoexec.model.unified import build_contract
    from isoexec.trainer.megatron.trainer import MegatronTrainer, check_layout

    contract = build_contract(tiny_config(), unified[0].kernels, torch.bfloat16)
    assert contract.identities.numerical_policy == unified[0].contract().identities.numerical_policy
    topo = contract.claims.topology
    assert topo["tp"].domain == (1, 2, 4) and topo["ep"].domain == (1, 2) and topo["sp"].domain == (1, 2, 4)
    for ok in (Layout(), TP2, TP4, EP2, TP2_EP2):
        check_layout(contract, ok)
    for bad, dim in [(Layout(tp=8, sp=True), "tp=8"), (Layout(ep=4), "ep=4"), (Layout(tp=2, sp=True, ep=4), "ep=4")]:
        with pytest.raises(ClaimViolation, match=dim):
            check_layout(contract, bad)
    with pytest.raises(ClaimViolation, match="tp=8"):  # refused before any process group is needed
        MegatronTrainer(tiny_config(), Layout(tp=8, sp=True), "isoexec", KERNELS)


def test_rollout_check_scores_through_the_megatron_group(tmp_path, hf_model, unified):
    """``isoexec rollout-check`` with ``trainer.backend: megatron`` scores on the layout's gloo ranks:
    the isoexec TP=2 rows equal the unified model's (hence the engine's), native TP=2 rows differ; the group
    reports the checkpoint's own checksums at load (the load-time weight handshake's trainer side)."""
    from isoexec.config import TrainerSection, load_config
    from isoexec.engines.rollout_check import score
    from isoexec.model.hf import save_hf_model

    ckpt = save_hf_model(hf_model[0].model, tmp_path / "ckpt", torch.bfloat16)
    cfg = load_config(Path(__file__).parents[1] / "experiments" / "ci-tiny.yaml").model_copy(
        update={"trainer": TrainerSection(backend="megatron", tp=2), "kernels": KERNELS})
    ids, cu = _batch()
    seqs = [ids[a:b].tolist() for a, b in zip(cu.tolist(), cu[1:].tolist())]
    iso_held, iso = score(cfg, "isoexec", ckpt, seqs)
    native_held, native = score(cfg, "native", ckpt, seqs)
    from isoexec.engines.weight_sync import state_checksums
    from isoexec.model.hf import read_weights

    assert iso_held == native_held == state_checksums(read_weights(ckpt))  # what the group holds at load, gathered
    ref = unified[0].trainer_logprobs(ids, cu)
    refs = [ref[a:b - 1] for a, b in zip(cu.tolist(), cu[1:].tolist())]
    assert all(torch.equal(x, r) for x, r in zip(iso, refs))
    print(f"native Megatron TP2 vs isoexec rows: max |diff| {max(_maxdiff(x, r) for x, r in zip(native, refs)):.3e}")
    assert not all(torch.equal(x, r) for x, r in zip(native, refs))
