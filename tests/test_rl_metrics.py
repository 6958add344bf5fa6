"""The metrics of docs/design.md (Metrics) on hand-made inputs."""

import json
import math

import pytest
import torch

from isoexec.rl.metrics import (
    MetricsLog, entropy_mean, exposure_metrics, full_vocab_kl, is_ratio_clip_frac, logprob_diff_metrics,
    mean_pass_at_k, pass_at_k,
)


def test_identical_logprobs_give_zero_mismatch_zero_diff_and_exactly_zero_k3():
    lp = torch.tensor([-0.1, -2.5, -7.0, -1e-6], dtype=torch.float32)
    m = logprob_diff_metrics(lp, lp.clone())
    assert m["tokens"] == 4 and m["mismatch_count"] == 0 and m["mismatch_rate"] == 0.0
    assert m["logprob_abs_diff_mean"] == 0.0 and m["logprob_abs_diff_std"] == 0.0 and m["logprob_abs_diff_max"] == 0.0
    assert m["k3_kl"] == 0.0
    assert m["is_ratio_mean"] == m["is_ratio_min"] == m["is_ratio_max"] == 1.0


def test_one_ulp_difference_counts_as_a_mismatch():
    lR = torch.tensor([-1.0, -2.0], dtype=torch.float32)
    lT = lR.clone()
    lT[1] = torch.nextafter(lT[1], torch.tensor(0.0))
    m = logprob_diff_metrics(lR, lT)
    assert m["mismatch_count"] == 1 and m["mismatch_rate"] == 0.5
    assert 0 < m["logprob_abs_diff_max"] < 1e-6


def test_negative_zero_differs_in_bits():
    m = logprob_diff_metrics(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert m["mismatch_count"] == 1 and m["logprob_abs_diff_max"] == 0.0


def test_known_differences_give_known_statistics():
    lR = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float32)
    d = torch.tensor([0.5, -0.5, 0.25, 0.0], dtype=torch.float64)
    lT = (lR.double() + d).float()
    m = logprob_diff_metrics(lR, lT)
    dd = lT.double() - lR.double()  # exact in float32 for these values
    assert torch.equal(dd, d)
    a = d.abs()
    assert m["mismatch_count"] == 3
    assert m["logprob_abs_diff_mean"] == pytest.approx(float(a.mean()), abs=0)
    assert m["logprob_abs_diff_std"] == pytest.approx(math.sqrt(float(((a - a.mean()) ** 2).mean())), rel=1e-12)
    assert m["logprob_abs_diff_max"] == 0.5
    k3 = sum(math.exp(x) - x - 1 for x in d.tolist()) / 4
    assert m["k3_kl"] == pytest.approx(k3, rel=1e-12)
    assert m["is_ratio_min"] == pytest.approx(math.exp(-0.5)) and m["is_ratio_max"] == pytest.approx(math.exp(0.5))
    assert m["is_ratio_mean"] == pytest.approx(sum(math.exp(x) for x in d.tolist()) / 4)


def test_k3_of_a_single_known_d():
    m = logprob_diff_metrics(torch.tensor([0.0]), torch.tensor([math.log(2.0)], dtype=torch.float32))
    d = float(torch.tensor(math.log(2.0), dtype=torch.float32))
    assert m["k3_kl"] == pytest.approx(math.exp(d) - d - 1)  # ~0.3069


def test_empty_step_gives_nan_not_an_error():
    m = logprob_diff_metrics(torch.zeros(0), torch.zeros(0))
    assert m["tokens"] == 0 and m["mismatch_count"] == 0 and math.isnan(m["k3_kl"])


def test_full_vocab_kl_is_zero_for_equal_rows_and_matches_the_formula():
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    lp, lq = p.log(), q.log()
    assert full_vocab_kl(lp, lp.clone()) == 0.0
    assert full_vocab_kl(lp, lq) == pytest.approx(0.5 * math.log(2.0) + 0.25 * 0 + 0.25 * 0)
    assert math.isnan(full_vocab_kl(None, lq))


def test_entropy_of_uniform_and_one_hot_rows():
    v = 64
    uni = torch.full((3, v), -math.log(v))
    assert entropy_mean(uni) == pytest.approx(math.log(v), rel=1e-6)
    one = torch.full((1, v), float("-inf"))
    one[0, 5] = 0.0
    assert entropy_mean(one) == 0.0


def test_pass_at_k_matches_the_combinatorial_definition():
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 8, 4) == 1.0
    assert pass_at_k(8, 5, 4) == 1.0  # fewer than 4 wrong samples
    assert pass_at_k(8, 1, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(8, 4))  # = 0.5
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    r = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0], [0.0] * 8])
    assert mean_pass_at_k(r, 4) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_metrics_log_rewrites_whole_lines_and_writes_nan_as_null(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path)
    assert path.read_text() == ""
    log.append({"step": 0, "full_vocab_kl": float("nan"), "x": 1.5})
    log.append({"step": 1, "full_vocab_kl": 0.25, "x": 2.5})
    lines = path.read_text().splitlines()
    assert [json.loads(s)["step"] for s in lines] == [0, 1]
    assert json.loads(lines[0])["full_vocab_kl"] is None
    assert not list(path.parent.glob(".*tmp"))  # no temp file left behind
    MetricsLog(path)  # a new run starts the file afresh
    assert path.read_text() == ""


def test_rollout_ratio_clip_fraction_counts_tokens_outside_the_clip_range():
    lR = torch.zeros(4, dtype=torch.float32)
    lT = torch.tensor([0.0, math.log(1.27), math.log(1.29), math.log(0.79)], dtype=torch.float32)
    assert is_ratio_clip_frac(lR, lT, 0.2, 0.28) == 0.5  # 1.29 > 1.28 and 0.79 < 0.8
    assert is_ratio_clip_frac(lR, lR.clone(), 0.2, 0.28) == 0.0
    assert math.isnan(is_ratio_clip_frac(lR[:0], lR[:0], 0.2, 0.28))
    assert logprob_diff_metrics(lR, lT)["is_ratio_std"] > 0


@pytest.mark.parametrize("p,r,prefill,decode,multi_block", [
    (64, 1, False, False, False),   # positions 0..63: one chunk, one KV block
    (65, 1, True, False, True),     # the prefill spans positions 63 and 64
    (10, 55, False, True, False),   # decode feeds 10..63 and completes chunk 0: a resync; last position 63
    (10, 54, False, False, False),  # decode feeds 10..62: chunk 0 still open
    (63, 2, False, True, False),    # decode feeds position 63 only: completes chunk 0
    (64, 2, False, False, True),    # prefill fills chunk 0 exactly; decode feeds 64: reads block 1
    (100, 40, True, True, True),    # prefill crosses 64, decode feeds 100..138 and completes chunk 1 (127)
])
def test_exposure_counts_chunk_crossings_in_prefill_and_decode(p, r, prefill, decode, multi_block):
    m = exposure_metrics([p], [r], chunk_size=64, kv_block=64)
    assert m["seqs_cross_chunk_prefill"] == prefill and m["seqs_cross_chunk_decode"] == decode
    assert m["seqs_cross_chunk"] == (prefill or decode)
    assert m["seqs_multi_kv_block"] == multi_block
    assert m["seqs"] == 1 and m["prompt_tokens"] == p and m["seq_len_max"] == p + r


def test_exposure_sums_over_a_step_and_refuses_bad_lengths():
    m = exposure_metrics([80, 20, 30], [5, 50, 3], chunk_size=64, kv_block=64)
    assert (m["seqs"], m["prompt_tokens"], m["seq_len_max"]) == (3, 130, 85)
    assert (m["seqs_cross_chunk"], m["seqs_cross_chunk_prefill"], m["seqs_cross_chunk_decode"]) == (2, 1, 1)
    assert m["seqs_multi_kv_block"] == 2
    with pytest.raises(ValueError, match="3 prompt lengths but 2"):
        exposure_metrics([1, 2, 3], [1, 2], 64, 64)
    with pytest.raises(ValueError, match=">= 1"):
        exposure_metrics([5], [0], 64, 64)
