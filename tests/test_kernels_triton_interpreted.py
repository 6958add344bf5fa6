"""Triton kernel-set code on the CPU: the MoE expert-weight cache (plain torch), and the Triton CPR
backward's arithmetic through Triton's interpreter (``TRITON_INTERPRET=1``,
numpy; its dots are plain fp32, so tf32 rounding is absent and the gradient must match the fp64
reference to fp32 accuracy). The GPU test ``tests/test_kernels_triton.py`` checks the compiled kernels.

Each case runs in a subprocess: the interpreter is chosen when the kernels are defined (import time)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_CASE = r"""
import json, sys, torch
import torch.nn.functional as F
from isoexec.config import TritonSection
from isoexec.kernels.gdn.reference import recurrent_reference
from isoexec.kernels.gdn.triton_backward import cpr_gdn_backward
C, dk, lengths, flip = json.loads(sys.argv[1])
torch.manual_seed(0)
N, H = sum(lengths), 2
q, k = (F.normalize(torch.randn(N, H, dk), dim=-1) for _ in range(2))
v, do = torch.randn(N, H, 32), torch.randn(N, H, 32)
g, b = F.logsigmoid(torch.randn(N, H)) * 0.3, torch.rand(N, H)
got = cpr_gdn_backward(q, k, v, g, b, do, lengths, C, TritonSection(gdn_chain_bv=16, gdn_bwd_bv=16))
ins = [x.double().requires_grad_() for x in (q, k, v, g, b)]
outs, r = [], 0
for n in lengths:
    outs.append(recurrent_reference(*(x[r:r + n] for x in ins))[0])
    r += n
(torch.cat(outs) * do.double() * (-1.0 if flip else 1.0)).sum().backward()
print(json.dumps({name: float((a.double() - x.grad).norm() / x.grad.norm())
                  for name, a, x in zip(["q", "k", "v", "g", "beta"], got, ins)}))
"""


def _rel_errors(C, dk, lengths, flip=False):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _CASE, json.dumps([C, dk, lengths, flip])], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("C, dk, lengths", [(16, 32, [40, 16, 7]), (64, 32, [200, 64, 5])])
def test_triton_cpr_backward_equals_the_fp64_gradient_in_the_interpreter(C, dk, lengths):
    errs = _rel_errors(C, dk, lengths)
    assert max(errs.values()) < 1e-5, errs


def test_interpreted_gradient_check_sees_a_wrong_gradient_negative_control():
    errs = _rel_errors(16, 32, [40, 7], flip=True)  # the reference of -o: every gradient has the wrong sign
    assert min(errs.values()) > 1.0, errs


def test_moe_expert_stacks_are_cached_per_layer_and_follow_in_place_updates():
    """The Triton MoE stacks a layer's expert weights once: two layers alternating keep one stack each
    (before, one cache slot per weight kind restacked every layer on every call), and an in-place update
    of any expert (a weight sync) gives a fresh stack. Runs on the CPU: the cache is plain torch."""
    import torch

    from isoexec.kernels.moe.triton import _stacked

    layers = [[tuple(torch.randn(4, 3) for _ in range(3)) for _ in range(5)] for _ in range(2)]
    first = [_stacked(ex, 2) for ex in layers]
    assert all(_stacked(ex, 2) is s for ex, s in zip(layers, first))
    assert all(torch.equal(s, torch.stack([e[2] for e in ex])) for ex, s in zip(layers, first))
    with torch.no_grad():
        layers[1][3][2].add_(1.0)
    fresh = _stacked(layers[1], 2)
    assert fresh is not first[1] and torch.equal(fresh[3], layers[1][3][2])
    assert _stacked(layers[0], 2) is first[0]
