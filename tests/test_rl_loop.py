"""The RL loop end to end with a plain-PyTorch engine (no vLLM), and the SFT smoke run."""

import json

import pytest
import torch

from isoexec.config import ArmSection, ExperimentConfig, ModelSection, RLSection, SFTSection, TaskSection
from isoexec.engines.local import LocalEngine
from isoexec.rl.loop import run_rl, step_prompts
from isoexec.rl.data import load_splits
from isoexec.rl.tokenizer import load_tokenizer
from isoexec.rl.sft import init_checkpoint
from isoexec.trainer.hf_policy import HFPolicy

KEYS = {"step", "arm", "mode", "seed", "tis_capped_frac", "correction_masked_frac", "tokens", "mismatch_count", "mismatch_rate", "logprob_abs_diff_mean",
        "logprob_abs_diff_std", "logprob_abs_diff_max", "k3_kl", "is_ratio_mean", "is_ratio_min", "is_ratio_max",
        "full_vocab_kl", "reward_mean", "pass_at_k", "response_length_mean", "entropy_mean", "grad_norm", "loss",
        "time/generation", "time/score", "time/train", "time/weight_sync", "time/step", "is_ratio_std",
        "is_ratio_clip_frac", "seqs", "prompt_tokens", "seq_len_max", "seqs_cross_chunk", "seqs_cross_chunk_prefill",
        "seqs_cross_chunk_decode", "seqs_multi_kv_block"}


@pytest.fixture(scope="module")
def cfg():
    return ExperimentConfig(
        name="t",
        model=ModelSection(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                           moe_intermediate_size=32, shared_expert_intermediate_size=32),
        task=TaskSection(max_operand=9, num_train_prompts=64, num_eval_prompts=8),
        sft=SFTSection(steps=3, batch_size=4, eval_every=3, eval_samples=1, min_steps=1),
        rl=RLSection(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=4, pass_k=2, mini_batches=2),
        arms=[ArmSection(name="native-tis", mode="native")],
    )


@pytest.fixture(scope="module")
def ckpt(cfg, tmp_path_factory):
    return init_checkpoint(cfg.model, tmp_path_factory.mktemp("init"), seed=0)


def test_data_order_depends_on_seed_and_step_only(cfg):
    train, _ = load_splits(cfg.task)
    assert step_prompts(train, 0, 3, 2) == step_prompts(train, 0, 3, 2)
    assert step_prompts(train, 0, 3, 2) != step_prompts(train, 1, 3, 2)
    seen = [p.index for s in range(32) for p in step_prompts(train, 0, s, 2)]
    assert len(set(seen)) == 64  # one epoch covers the split once


def test_two_rl_steps_with_a_local_engine_write_every_metric(cfg, ckpt, tmp_path):
    torch.manual_seed(0)
    policy = HFPolicy.from_pretrained(ckpt)
    engine = LocalEngine(HFPolicy.from_pretrained(ckpt), load_tokenizer(ckpt).eos_token_id)
    before = {k: v.clone() for k, v in engine.policy.checkpoint_state_dict().items()}
    out = tmp_path / "rl" / "native" / "seed0"
    rows = run_rl(cfg, "native", 0, ckpt, out, engine=engine, policy=policy, command="test")
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and len(rows) == 2
    for r in lines:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["arm"] == r["mode"] == "native" and r["seed"] == 0
        assert r["tis_capped_frac"] is None and r["correction_masked_frac"] is None  # no correction: NaN -> null
        assert r["tokens"] > 0 and 0 <= r["mismatch_count"] <= r["tokens"]
        assert r["full_vocab_kl"] is not None and r["full_vocab_kl"] >= -1e-9
        assert 0 <= r["reward_mean"] <= 1 and 0 <= r["pass_at_k"] <= 1
        # DAPO-wrapped prompts are longer than the chunk size C=64: every sequence crosses a chunk
        assert r["seqs"] == 8 and r["seqs_cross_chunk"] == r["seqs_cross_chunk_prefill"] == 8
        assert r["prompt_tokens"] > 8 * 64 and r["seq_len_max"] > 64
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["command"] == "test" and prov["run"]["mode"] == "native"
    loaded = prov["weights_at_load"]  # both sides' weights at load, compared before the first step
    assert loaded["engine"] == loaded["trainer"] and loaded["engine"]["tensors"] == len(before)
    # the weight sync reached the engine: its weights are now the trainer's (bf16 of the masters)
    after = engine.policy.checkpoint_state_dict()
    trainer = policy.checkpoint_state_dict()
    assert all(torch.equal(after[k], trainer[k]) for k in after)
    if any(r["grad_norm"] > 0 for r in lines):
        assert any(not torch.equal(before[k], after[k]) for k in after)


def test_a_correction_arm_runs_its_modes_stack_with_skyrls_tis(cfg, ckpt, tmp_path):
    """native-tis: the native stack (same engine and trainer, same tokens at the first step), the loss
    reweighted by SkyRL's token TIS; its statistics are recorded."""
    def run(arm):
        torch.manual_seed(0)
        engine = LocalEngine(HFPolicy.from_pretrained(ckpt), load_tokenizer(ckpt).eos_token_id)
        return run_rl(cfg, arm, 0, ckpt, tmp_path / arm, engine=engine, policy=HFPolicy.from_pretrained(ckpt),
                      command="test")

    native, tis = run("native"), run("native-tis")
    assert [r["arm"] for r in tis] == ["native-tis"] * 2 and {r["mode"] for r in tis} == {"native"}
    assert all(0.0 <= r["tis_capped_frac"] <= 1.0 for r in tis)
    assert tis[0]["reward_mean"] == native[0]["reward_mean"] and tis[0]["tokens"] == native[0]["tokens"]
    prov = json.loads((tmp_path / "native-tis" / "provenance.json").read_text())
    assert prov["run"]["arm"] == "native-tis" and prov["run"]["mode"] == "native"


def test_sft_smoke_writes_a_bf16_checkpoint_and_metrics(cfg, ckpt, tmp_path):
    from isoexec.rl.sft import run_sft

    m = run_sft(cfg, ckpt, tmp_path / "sft")
    saved = json.loads((tmp_path / "sft" / "sft_metrics.json").read_text())
    assert saved["steps"] == m["steps"] == 3 and 0.0 <= saved["accuracy"] <= 1.0
    assert isinstance(saved["in_band"], bool) and saved["provenance"]["git"] is not None
    assert (tmp_path / "sft" / "tokenizer.json").is_file()
    assert HFPolicy.from_pretrained(tmp_path / "sft").model.dtype == torch.bfloat16


def test_isoexec_trainer_with_a_local_engine_of_the_same_unified_model_is_bitwise(cfg, ckpt, tmp_path):
    """Rollout logprobs come from growing prefixes in mixed batches, the trainer scores whole
    sequences: the unified model gives the same bits anyway (mismatch 0, k3 exactly 0)."""
    from isoexec.model import UnifiedModel

    load = lambda: UnifiedModel.from_pretrained(ckpt, kernel_set="isoexec", kernels=cfg.kernels)  # noqa: E731
    engine = LocalEngine(load(), load_tokenizer(ckpt).eos_token_id)
    rows = run_rl(cfg, "isoexec", 0, ckpt, tmp_path / "iso", engine=engine, policy=load(), command="test")
    for r in rows:
        assert r["tokens"] > 0 and r["mismatch_count"] == 0 and r["k3_kl"] == 0.0 and r["full_vocab_kl"] == 0.0


def test_a_paired_run_whose_engine_holds_other_weights_is_refused_before_any_step(cfg, ckpt, tmp_path):
    from isoexec.engines.weight_sync import WeightSyncError

    engine = LocalEngine(HFPolicy.from_pretrained(ckpt), load_tokenizer(ckpt).eos_token_id)
    with torch.no_grad():
        engine.policy.model.model.norm.weight.add_(1)
    out = tmp_path / "refused"
    with pytest.raises(WeightSyncError, match=r"1 tensors differ between the engine and the trainer at load .*"
                                              r"\['model.norm.weight'\]"):
        run_rl(cfg, "native", 0, ckpt, out, engine=engine, policy=HFPolicy.from_pretrained(ckpt), command="test")
    assert not (out / "metrics.jsonl").exists()


def test_rl_step_summary_gives_policy_training_time_in_every_row(cfg):
    """``isoexec.bench.rl_step.summarize``: every step row and each arm's median carry ``time/policy_training`` (score +
    train, the blog's training time), and the ratio row divides the two medians (it was filled in the ratio row only)."""
    from isoexec.bench.rl_step import summarize

    def step(ks, i, score, train):
        return {"kernel_set": ks, "engine": "local", "step": i, "time/generation": 1.0, "time/score": score,
                "time/train": train, "time/step": 2.0}

    # isoexec's median of sums (6) is not its sum of medians (2 + 3 = 5): the ratio is 6 / 2, not 5 / 2
    rows = [step("isoexec", 0, 1.0, 5.0), step("isoexec", 1, 2.0, 1.0), step("isoexec", 2, 3.0, 3.0),
            step("native", 0, 1.0, 1.0), step("native", 1, 1.0, 1.0)]
    table = summarize(rows, ("isoexec", "native"), "local", False, cfg, cfg.rl, 16)
    got = {(r["kernel_set"], r["step"]): r["time/policy_training"] for r in table}
    assert got == {("isoexec", 0): 6.0, ("isoexec", 1): 3.0, ("isoexec", 2): 6.0, ("native", 0): 2.0, ("native", 1): 2.0,
                   ("isoexec", "median"): 6.0, ("native", "median"): 2.0, ("isoexec/native", "ratio"): 3.0}
