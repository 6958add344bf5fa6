"""Context parallelism (CP) in the Megatron trainer's isoexec set, over gloo with several processes.

Each sequence is split over the CP ranks in Megatron's load-balanced chunks (rank r holds chunks r and
2 cp - 1 - r); the logprob rows of CP 2 and 4 (x TP 1 and TP 2 + SP) must equal CP 1's and the engine
path's bit for bit (``torch.equal`` on full-vocabulary fp32 rows, every rank). The batch of
``tests/test_trainer_megatron.py`` (150, 70 and 9 tokens, C = 64, kv_block = 64) padded to 152 or 160
gives chunks of 38, 19 or 20 positions: boundaries inside GDN chunks and KV blocks, a GDN chunk over three
ranks at CP 4. A batch of 3 and 2 tokens leaves the last ranks padding only at CP 4. Negative control: Megatron's own CP does not run this
model (refused, with the reason); native at CP 1 against the native engine path differs (max diff shown).
Gradients need not be bitwise: fp32 per-parameter gradients at CP 2 and 4 agree with CP 1's.
"""

import pytest
import torch

from isoexec.trainer.megatron.config import Layout
from tests.test_trainer_megatron import KERNELS, _batch, _maxdiff, hf_model, run_cases, tiny_config, unified  # noqa: F401

SHORT = [3, 2]  # at CP 4 (chunks of 1 or 2 positions) the last ranks hold padding only
CP2, CP4 = Layout(cp=2), Layout(cp=4)
TP2 = Layout(tp=2, sp=True)
TP2_CP2, TP2_CP4 = Layout(tp=2, sp=True, cp=2), Layout(tp=2, sp=True, cp=4)
# (name, layout, dtype, what): "rows" = trainer_score, trainer_fwd and one step; "grads" = fp32 gradients
CASES = {
    1: [("tp1", Layout(), torch.bfloat16, "rows"), ("tp1_fp32", Layout(), torch.float32, "grads"),
        ("native_tp1", Layout(), torch.bfloat16, "native")],
    2: [("cp2", CP2, torch.bfloat16, "rows"), ("cp2_fp32", CP2, torch.float32, "grads"),
        ("tp2", TP2, torch.bfloat16, "rows")],
    4: [("cp4", CP4, torch.bfloat16, "rows"), ("cp4_fp32", CP4, torch.float32, "grads"),
        ("tp2_cp2", TP2_CP2, torch.bfloat16, "rows")],
    8: [("tp2_cp4", TP2_CP4, torch.bfloat16, "rows")],
}
CP_CASES = {"cp2": "tp1", "cp4": "tp1", "tp2_cp2": "tp2", "tp2_cp4": "tp2"}  # CP case -> its CP 1 reference


def _short_batch():
    ids = torch.randint(0, 96, (sum(SHORT),), generator=torch.Generator().manual_seed(2))
    return ids, torch.tensor([0, *torch.tensor(SHORT).cumsum(0).tolist()])


def _loss(lp, ids):
    return -lp[torch.arange(len(ids) - 1), ids[1:]].mean()


def _worker(rank, world, hf_state):
    from megatron.core.distributed import finalize_model_grads

    from isoexec.trainer.megatron.launch import init_parallel
    from isoexec.trainer.megatron.trainer import MegatronTrainer

    ids, cu = _batch()
    out = {}
    for name, layout, dtype, what in CASES[world]:
        init_parallel(layout)
        t = MegatronTrainer(tiny_config(), layout, "native" if what == "native" else "isoexec", KERNELS, dtype,
                            lr=1e-3)
        t.load_hf_state_dict({k: v.to(dtype) for k, v in hf_state.items()})
        r = {"score": t.trainer_logprobs(ids, cu, grad=False)}
        if what == "native":
            out[name] = r
            continue
        if what == "rows":
            sids, scu = _short_batch()
            slp = t.trainer_logprobs(sids, scu, grad=True)  # ranks of padding only at CP 4
            _loss(slp, sids).backward()
            t.zero_grad()
            r["short"] = slp.detach()
        lp = t.trainer_logprobs(ids, cu, grad=True)
        r["fwd"] = lp.detach()
        loss = _loss(lp, ids)
        loss.backward()
        r["loss"] = loss.detach()
        if what == "grads":  # Megatron's finalized gradients (the reduction over the CP ranks included)
            finalize_model_grads([t.ddp])
            r["grads"] = {n: p.main_grad.clone() for n, p in t.model.named_parameters()}
            t.zero_grad()
        else:
            r["grad_norm"] = t.step()
            r["after_step"] = t.trainer_logprobs(ids, cu, grad=False)
        out[name] = r
    return out


@pytest.fixture(scope="module")
def runs(hf_model):  # noqa: F811
    """{case name: [per-rank results]} from one launch per world size (1, 2, 4, 8)."""
    return run_cases(_worker, CASES, hf_model[1])


@pytest.mark.parametrize("case", list(CP_CASES))
def test_cp_trainer_rows_bitwise_equal_cp1_and_the_engine(runs, unified, case):  # noqa: F811
    """trainer_score and trainer_fwd at CP 2 / 4 x TP 1 / 2, on every rank, equal CP 1 (same TP), the
    unified model's trainer rows and its engine path (chunked prefill + decode), bit for bit."""
    from isoexec.bench.megatron_gpu import engine_rows

    ids, cu = _batch()
    ref = unified[0].trainer_logprobs(ids, cu)
    assert torch.equal(engine_rows(unified[0], ids, cu), ref)
    base = runs[CP_CASES[case]][0]
    assert torch.equal(base["score"], ref)
    for rank, r in enumerate(runs[case]):
        for key in ("score", "fwd"):
            assert torch.equal(r[key], ref), (case, rank, key, _maxdiff(r[key], ref))
        assert torch.equal(r["short"], runs[CP_CASES[case]][0]["short"]), (case, rank)


def test_native_megatron_cannot_run_cp_and_native_cp1_differs_from_the_engine_negative_control(runs, unified):  # noqa: F811
    from isoexec.bench.megatron_gpu import engine_rows
    from isoexec.trainer.megatron.trainer import MegatronTrainer

    with pytest.raises(ValueError, match="native set cannot run context parallelism.*Transformer Engine"):
        MegatronTrainer(tiny_config(), CP2, "native", KERNELS)
    ids, cu = _batch()
    x, eng = runs["native_tp1"][0]["score"], engine_rows(unified[1], ids, cu)
    print(f"native Megatron CP1 TP1 vs native engine path (bf16): max |diff| {_maxdiff(x, eng):.3e}, "
          f"{int((x != eng).sum())}/{x.numel()} logprobs differ")
    assert not torch.equal(x, eng)


@pytest.mark.parametrize("case", ["cp2", "cp4", "tp2_cp2", "tp2_cp4"])
def test_cp_training_step_matches_cp1(runs, case):
    """One AdamW step: the loss is bitwise CP 1's (the forward is), the grad norm agrees to 1e-3 and the
    updated policy stays close; every rank reports the same norm."""
    x, ys = runs[CP_CASES[case]][0], runs[case]
    y = ys[0]
    print(f"{case} vs CP1: grad norm {x['grad_norm']:.7f} / {y['grad_norm']:.7f}, logprobs after the step "
          f"max |diff| {_maxdiff(x['after_step'], y['after_step']):.3e}")
    assert torch.equal(x["loss"], y["loss"])
    assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-3 * x["grad_norm"]
    assert all(r["grad_norm"] == y["grad_norm"] for r in ys)
    assert _maxdiff(x["after_step"], y["after_step"]) < 5e-2
    assert _maxdiff(y["after_step"], y["score"]) > 0  # the step changed the policy


@pytest.mark.parametrize("case", ["cp2_fp32", "cp4_fp32"])
def test_cp_gradients_match_cp1_fp32(runs, case):
    """Every parameter's finalized fp32 gradient at CP 2 / 4 (summed over the CP ranks by Megatron's DDP)
    agrees with CP 1's to 1e-4 of its norm, on every rank."""
    ref = runs["tp1_fp32"][0]["grads"]
    worst = 0.0
    for r in runs[case]:
        assert set(r["grads"]) == set(ref)
        for n, g in r["grads"].items():
            err = ((g - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item()
            worst = max(worst, err)
            assert err < 1e-4, (case, n, err)
    print(f"{case}: worst per-parameter |grad - grad_cp1| / |grad_cp1| = {worst:.2e}")


def test_contract_claims_the_proven_cp_domain_and_trainer_refuses_layouts_outside_it(unified):  # noqa: F811
    from isoexec.contract import ClaimViolation
    from isoexec.model.unified import build_contract
    from isoexec.trainer.megatron.trainer import MegatronTrainer, check_layout

    contract = build_contract(tiny_config(), unified[0].kernels, torch.bfloat16)
    assert contract.claims.topology["cp"].domain == (1, 2, 4)
    for ok in (CP2, CP4, TP2_CP2, TP2_CP4):
        check_layout(contract, ok)
    for bad, what in [(Layout(cp=8), "cp=8 is outside the claimed domain"),
                      (Layout(cp=3), "cp=3 is outside the claimed domain \\[1, 2, 4\\]"),
                      (Layout(tp=4, sp=True, cp=2), "tp=4 with cp=2 is outside the degrees proven together with "
                                                    "context parallelism: tp in \\[1, 2\\]"),
                      (Layout(ep=2, cp=2), "ep=2 with cp=2 .*ep in \\[1\\]")]:
        with pytest.raises(ClaimViolation, match=what):
            check_layout(contract, bad)
    with pytest.raises(ClaimViolation, match="cp=8"):  # refused before any process group is needed
        MegatronTrainer(tiny_config(), Layout(cp=8), "isoexec", KERNELS)
