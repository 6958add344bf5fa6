"""The CPR kernels' launch-metadata cache (:func:`isoexec.kernels.gdn.triton.device_meta`) on the CPU: a miss
copies once and a hit returns that tensor; the bound and its least-recently-used order; an entry read during a
CUDA-graph capture outlives the bound; a miss during a capture is refused in one line (the capture is faked by
monkeypatching ``torch.cuda.is_current_stream_capturing``). Through Triton's interpreter: a trainer forward, its
backward and a prefill call, repeated with the same lengths, copy no metadata again and give the same bits. The
GPU test ``tests/test_kernels_triton.py`` captures and replays the compiled kernels."""

import json
import os
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

pytest.importorskip("triton")

from isoexec.kernels.gdn import triton as t_gdn  # noqa: E402


@pytest.fixture(autouse=True)
def _empty_cache(monkeypatch):
    monkeypatch.setattr(t_gdn, "_meta_lru", OrderedDict())
    monkeypatch.setattr(t_gdn, "_meta_captured", {})


def _capturing(monkeypatch, on: bool):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)


def test_a_miss_copies_the_values_and_a_hit_returns_the_same_tensor():
    vals = [3, -1, 0, 2**31 - 1]
    t = t_gdn.device_meta(vals, torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.device.type == "cpu" and t.shape == (4,) and t.tolist() == vals
    assert t_gdn.device_meta(list(vals), torch.int32, torch.device("cpu")) is t
    wide = t_gdn.device_meta(vals, torch.int64, "cpu")  # the dtype is part of the key
    assert wide is not t and wide.dtype == torch.int64 and wide.tolist() == vals
    assert t_gdn.device_meta(vals[:3], torch.int32, "cpu") is not t  # so are the values
    assert len(t_gdn._meta_lru) == 3


def test_the_cache_keeps_at_most_its_bound_and_drops_the_least_recently_used():
    n = t_gdn.META_CACHE_SIZE
    first = [t_gdn.device_meta([i], torch.int64, "cpu") for i in range(n)]
    assert t_gdn.device_meta([0], torch.int64, "cpu") is first[0]  # [0] is now the most recently used
    t_gdn.device_meta([n], torch.int64, "cpu")
    assert len(t_gdn._meta_lru) == n
    assert t_gdn.device_meta([0], torch.int64, "cpu") is first[0]
    assert t_gdn.device_meta([2], torch.int64, "cpu") is first[2]
    again = t_gdn.device_meta([1], torch.int64, "cpu")  # [1] was the least recently used: dropped, copied anew
    assert again is not first[1] and again.tolist() == [1]
    assert len(t_gdn._meta_lru) == n


def test_a_miss_during_a_capture_is_refused_in_one_line_and_copies_nothing(monkeypatch):
    _capturing(monkeypatch, True)
    one_line = (r"^CPR launch metadata \(3 torch.int32 entries on cuda: sequence lengths, state slots\) not built by a "
                r"call before capture: [^\n]*$")
    with pytest.raises(RuntimeError, match=one_line):
        t_gdn.device_meta([1, 2, 3], torch.int32, "cuda")
    assert not t_gdn._meta_lru and not t_gdn._meta_captured
    assert t_gdn.device_meta([1, 2, 3], torch.int32, "cpu").tolist() == [1, 2, 3]  # CPU metadata: no capture check


def test_an_entry_read_during_a_capture_outlives_the_bound(monkeypatch):
    # two CUDA entries made before the capture, CPU tensors standing in for the device copies (no GPU here);
    # the capture reads the first only
    read, unread = torch.tensor([5, 6], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    t_gdn._meta_lru[(torch.device("cuda"), torch.int32, (5, 6))] = read
    t_gdn._meta_lru[(torch.device("cuda"), torch.int32, (7,))] = unread
    _capturing(monkeypatch, True)
    assert t_gdn.device_meta([5, 6], torch.int32, "cuda") is read
    assert list(t_gdn._meta_captured.values()) == [read] and len(t_gdn._meta_lru) == 1
    _capturing(monkeypatch, False)
    for i in range(t_gdn.META_CACHE_SIZE):  # the bounded entries turn over
        t_gdn.device_meta([i], torch.int32, "cpu")
    _capturing(monkeypatch, True)
    assert t_gdn.device_meta((5, 6), torch.int32, "cuda") is read  # the graph's address is still this tensor's
    with pytest.raises(RuntimeError, match="before capture"):  # negative control: the unread entry was dropped
        t_gdn.device_meta([7], torch.int32, "cuda")


_REPEAT = r"""
import json, torch
import torch.nn.functional as F
from isoexec.config import TritonSection
from isoexec.kernels.gdn import triton as t_gdn
from isoexec.kernels.gdn.triton_backward import cpr_gdn_backward
C, lengths = 16, [40, 16, 7]
torch.manual_seed(0)
N, H, dk, dv = sum(lengths), 2, 32, 32
q, k = (F.normalize(torch.randn(N, H, dk), dim=-1) for _ in range(2))
v, do = torch.randn(N, H, dv), torch.randn(N, H, dv)
g, b = F.logsigmoid(torch.randn(N, H)) * 0.3, torch.rand(N, H)
cfg = TritonSection(gdn_chain_bv=16, gdn_scan_bv=16, gdn_bwd_bv=16)

def calls():
    o = t_gdn.cpr_gdn(q, k, v, g, b, lengths, [None] * 3, C, cfg, keep_state=False)[0]
    grads = cpr_gdn_backward(q, k, v, g, b, do, lengths, C, cfg)
    op = t_gdn.cpr_gdn(q, k, v, g, b, lengths, [None] * 3, C, cfg)[0]  # prefill: fresh pool slots, states kept
    return [o, *grads, op]

first = calls()
entries = dict(t_gdn._meta_lru)
second = calls()
same = len(t_gdn._meta_lru) == len(entries) and all(t_gdn._meta_lru.get(kk) is vv for kk, vv in entries.items())
t_gdn.cpr_gdn(q, k, v, g, b, [39, 17, 7], [None] * 3, C, cfg, keep_state=False)  # other lengths: a new table
new = len(t_gdn._meta_lru) - len(entries)
print(json.dumps({"entries": len(entries), "same_entries": same, "other_lengths_new": new,
                  "same_bits": all(torch.equal(x, y) for x, y in zip(first, second)),
                  "prefill_equals_trainer": torch.equal(first[0], first[-1])}))
"""


def test_repeated_calls_in_the_interpreter_reuse_every_metadata_tensor_and_keep_the_bits():
    """A trainer forward (one table), its backward (one) and a prefill call (six: the fresh slots, the tables, and
    the bookkeeping's entry, running-state, resync and open-chunk indices) put their metadata in the cache once;
    the same calls again find every tensor there (the condition of a capture after a warm-up) and give the same
    bits, the prefill's output the trainer's. Negative control: other lengths make a new table."""
    out = subprocess.run([sys.executable, "-c", _REPEAT], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == {"entries": 8, "same_entries": True, "other_lengths_new": 1, "same_bits": True,
                 "prefill_equals_trainer": True}, r
