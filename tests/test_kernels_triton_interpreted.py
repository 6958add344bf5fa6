"""Triton kernel-set code on the CPU: the MoE expert-weight cache (plain torch), the conv1d's one launch
over every piece, the leaf GEMM's loop shapes, and the Triton CPR backward's arithmetic through Triton's interpreter (``TRITON_INTERPRET=1``,
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


_CHUNKWISE = r"""
import json, torch
import torch.nn.functional as F
from isoexec.config import TritonSection
from isoexec.kernels.gdn import triton as rec
from isoexec.kernels.gdn import triton_chunkwise as cw
from isoexec.kernels.gdn.reference import recurrent_reference
C, lengths = 16, [48, 32]
torch.manual_seed(0)
N, H, dk, dv = sum(lengths), 2, 32, 32
q, k = (F.normalize(torch.randn(N, H, dk), dim=-1) for _ in range(2))
v = torch.randn(N, H, dv)
g, b = F.logsigmoid(torch.randn(N, H)) * 0.3, torch.rand(N, H)
cfg = TritonSection(gdn_chain_bv=16, gdn_scan_bv=16)
o = cw.chunkwise_forward(q, k, v, g, b, lengths, C, cfg, block_v=16, num_warps=4)
o_rec, _ = rec.cpr_gdn(q, k, v, g, b, lengths, [None] * 2, C, cfg, keep_state=False)
ref, r = [], 0
for n in lengths:
    ref.append(recurrent_reference(*(x[r:r + n].double() for x in (q, k, v, g, b)))[0])
    r += n
ref = torch.cat(ref)
rel = lambda a: float((a.double() - ref).norm() / ref.norm())
# each sequence's chunk 1 as decode sees it: its entry state (the chain after chunk 0) and rows 0..t
_, _, E = cw._prep_and_chain(k, v, g, b, torch.tensor([[0, 0, 0], [48, 0, 0]], dtype=torch.int32),
                             torch.tensor([[0, 1, -1, 0], [1, 1, -1, 1]], dtype=torch.int32), 2, C, cfg)
chunk = [x[C:2 * C] for x in (q, k, v, g, b)]
rows = {t: torch.equal(cw.open_chunk_rows(*chunk, E[:1], [t], C, cfg, 16, 4)[0], o[C + t]) for t in (0, 5, 15)}
both = [torch.cat([x[C:2 * C], x[48 + C:48 + 2 * C]]) for x in (q, k, v, g, b)]  # two sequences in one launch
rows["batched"] = torch.equal(cw.open_chunk_rows(*both, E, [5, 11], C, cfg, 16, 4), torch.stack([o[C + 5], o[48 + C + 11]]))
wrong_entry = torch.equal(cw.open_chunk_rows(*chunk, torch.zeros_like(E[:1]), [5], C, cfg, 16, 4)[0], o[C + 5])
print(json.dumps({"rel_chunkwise": rel(o), "rel_recurrent": rel(o_rec), "equal_recurrent": torch.equal(o, o_rec),
                  "rows": rows, "wrong_entry_equal": wrong_entry}))
"""


def test_chunkwise_in_chunk_candidate_matches_the_fp64_recurrence_and_its_decode_rows_in_the_interpreter():
    """Issue 37's chunkwise in-chunk output (isoexec/kernels/gdn/triton_chunkwise.py) computes the recurrence
    (fp64 reference) to fp32 accuracy, with other bits than the recurrent scan; decode's form (the open chunk's rows
    0..t, the entry state) gives the trainer's row t bit for bit here (numpy dots; the GPU test checks the wgmma
    dots), and a wrong entry state does not (negative control)."""
    out = subprocess.run([sys.executable, "-c", _CHUNKWISE], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["rel_chunkwise"] < 1e-6 and r["rel_recurrent"] < 1e-6, r
    assert not r["equal_recurrent"], r  # new bits: a contract constant of its own if adopted
    assert all(r["rows"].values()) and not r["wrong_entry_equal"], r


@pytest.mark.parametrize("call, arg, C, match", [
    ("forward", [20, 12], 16, r"length 20: the chunkwise candidate needs whole chunks \(positive multiples of C=16\)"),
    ("forward", [16], 16, r"lengths sum to 16; q, k, v, g, beta have \[32, 32, 32, 32, 32\] rows"),
    ("forward", [24, 8], 24, r"chunk size C=24: must be a power of two >= 16"),
    ("rows", [], 16, r"positions \[\] with q, k, v, g, beta of \[32, 32, 32, 32, 32\] rows"),
    ("rows", [3, 16], 16, r"each in 0 \.\. 15"),
    ("rows", [3], 16, r"1 chunks of C=16 rows in every input"),
])
def test_chunkwise_candidate_refuses_bad_input_in_one_line(call, arg, C, match):
    """Checked before any launch: no kernel runs on inputs it would read out of bounds."""
    import torch

    from isoexec.config import TritonSection
    from isoexec.kernels.gdn.triton_chunkwise import chunkwise_forward, open_chunk_rows

    x = torch.zeros(32, 1, 16)
    with pytest.raises(ValueError, match=match):
        if call == "forward":
            chunkwise_forward(x, x, x, x[..., 0], x[..., 0], arg, C, TritonSection())
        else:
            open_chunk_rows(x, x, x, x[..., 0], x[..., 0], torch.zeros(max(len(arg), 1), 1, 16, 16), arg, C, TritonSection())


def test_moe_expert_stacks_are_cached_per_layer_and_follow_in_place_updates():
    """The Triton MoE stacks a layer's expert weights once: two layers alternating keep their stacks (before,
    one cache slot per weight kind restacked every layer on every call), an in-place update of any expert
    weight of any kind (a weight sync) restacks the new values into the same stack tensors (what a captured CUDA
    graph reads), and a weight at another address gives new stacks. Runs on the CPU: the cache is plain torch."""
    import torch

    from isoexec.kernels.moe.triton import expert_stacks

    layers = [[tuple(torch.randn(4, 3) for _ in range(3)) for _ in range(5)] for _ in range(2)]
    first = [expert_stacks(ex) for ex in layers]
    assert all(expert_stacks(ex) is s for ex, s in zip(layers, first))
    assert all(torch.equal(s[k], torch.stack([e[k] for e in ex])) for ex, s in zip(layers, first) for k in range(3))
    for kind in range(3):
        before = expert_stacks(layers[1])
        ptr = before[kind].data_ptr()
        with torch.no_grad():
            layers[1][3][kind].add_(1.0)
        fresh = expert_stacks(layers[1])
        assert fresh is before and fresh[kind].data_ptr() == ptr
        assert all(torch.equal(fresh[k], torch.stack([e[k] for e in layers[1]])) for k in range(3))
    moved = [list(e) for e in layers[1]]
    moved[4][0] = moved[4][0] * 2  # another storage (and other values): a fresh stack holding them
    got = expert_stacks([tuple(e) for e in moved])
    assert got is not expert_stacks(layers[1]) and torch.equal(got[0][4], moved[4][0])
    assert expert_stacks(layers[0]) is first[0]


def test_unified_experts_are_rows_of_their_stacks_through_conversion_and_loading():
    """``SparseMoE`` holds its expert weights as rows of three stacks: the grouped kernels read them with no copy (one
    copy of the weights in memory), an in-place update of a weight is in the stack, and a conversion (``.to()``) or a
    ``load_state_dict(assign=True)`` stacks again, keeping the Parameter objects and the values. A weight swapped in
    another way is not a row (negative control): the kernels then get a copy."""
    import copy

    import torch

    from isoexec.kernels.moe.triton import _STACK_CACHE, expert_stacks
    from isoexec.model.layers import W

    moe = _moe_probe().moe
    params = [e.weights() for e in moe.experts]

    def rows_of_stacks():
        ew = moe.expert_weights()
        st = getattr(ew, "stacks", None)
        return st is not None and all(w[i].data_ptr() == st[i][e].data_ptr() and w[i] is params[e][i]
                                      for e, w in enumerate(ew) for i in range(3))

    assert rows_of_stacks()
    cached = len(_STACK_CACHE)
    ew = moe.expert_weights()
    assert expert_stacks(ew) is ew.stacks and len(_STACK_CACHE) == cached  # no copy
    stored = {w.untyped_storage().data_ptr() for ws in params for w in ws}
    assert stored == {s.untyped_storage().data_ptr() for s in ew.stacks}  # one storage per stack, nothing else
    with torch.no_grad():
        params[3][2].add_(1.0)
    assert torch.equal(ew.stacks[2][3], params[3][2])
    before = [w.detach().clone() for ws in params for w in ws]
    moe.to(torch.float64)
    assert rows_of_stacks() and moe.expert_weights().stacks[0].dtype == torch.float64
    assert all(torch.equal(a.double(), b) for a, b in zip(before, [w for ws in params for w in ws]))
    sd = {k: torch.randn_like(v) for k, v in moe.state_dict().items()}
    moe.load_state_dict(sd, assign=True)
    params = [e.weights() for e in moe.experts]
    assert rows_of_stacks() and torch.equal(moe.experts[1].up_proj.weight, sd["experts.1.up_proj.weight"])
    kept = moe.expert_weights().stacks
    moe.to(torch.float64)  # a conversion that converts nothing keeps the stacks
    assert rows_of_stacks() and moe.expert_weights().stacks[0].data_ptr() == kept[0].data_ptr()
    twin = copy.deepcopy(moe)  # a copy holds its own rows and stacks
    tw = twin.expert_weights()
    assert tw.stacks[0].data_ptr() != kept[0].data_ptr()
    assert all(w[i].data_ptr() == tw.stacks[i][e].data_ptr() for e, w in enumerate(tw) for i in range(3))
    moe.experts.to(torch.float32)  # negative control: a conversion below the layer leaves weights that are not rows
    assert getattr(moe.expert_weights(), "stacks", None) is None
    moe.to(torch.float64)  # converted through the layer: rows again
    params = [e.weights() for e in moe.experts]
    assert rows_of_stacks()
    one = {"experts.0.gate_proj.weight": torch.zeros_like(params[0][0], dtype=torch.float32)}
    moe.load_state_dict(one, strict=False, assign=True)  # another dtype for one weight: no silent cast of the rest
    assert getattr(moe.expert_weights(), "stacks", None) is None and params[1][0].dtype == torch.float64
    moe.experts[0].gate_proj = W(*moe.experts[0].gate_proj.weight.shape)  # negative control: not a row
    moe.to(torch.float64)
    params = [e.weights() for e in moe.experts]
    assert rows_of_stacks()
    moe.experts[0].gate_proj = W(*moe.experts[0].gate_proj.weight.shape)
    ew = moe.expert_weights()
    assert getattr(ew, "stacks", None) is None
    copies = expert_stacks(ew)
    assert copies[0].data_ptr() != moe._stacks[0].data_ptr() and torch.equal(copies[1][2], params[2][1])


def _moe_probe():
    import torch

    from isoexec.config import ModelSection
    from isoexec.model.hf import hf_config
    from isoexec.model.layers import SparseMoE

    class Probe(torch.nn.Module):  # functional_call needs a forward; it returns the list the kernel set gets
        def __init__(self):
            super().__init__()
            self.moe = SparseMoE(hf_config(ModelSection()))

        def forward(self):
            return self.moe.expert_weights()

    return Probe()


def _replacements(probe):
    """Every way torch replaces an expert's Parameter or submodule; per way, whether the list the kernel set
    gets afterwards holds the module's current tensors."""
    import torch
    from torch.func import functional_call

    from isoexec.model.layers import W

    moe, ok = probe.moe, {}
    moe.expert_weights()
    sd = {k: torch.randn_like(v) for k, v in moe.state_dict().items()}
    moe.load_state_dict(sd, assign=True)
    ok["load_state_dict(assign=True)"] = moe.expert_weights()[1][2] is moe.experts[1].down_proj.weight
    ones = torch.ones_like(moe.experts[1].down_proj.weight)
    seen = functional_call(probe, {"moe.experts.1.down_proj.weight": ones}, ())
    ok["functional_call"] = seen[1][2] is ones and moe.expert_weights()[1][2] is moe.experts[1].down_proj.weight
    other = W(*moe.experts[0].gate_proj.weight.shape)
    moe.experts[0].gate_proj = other
    ok["submodule swap"] = moe.expert_weights()[0][0] is other.weight
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        moe.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    ok[".to() overwriting"] = moe.expert_weights()[2][1] is moe.experts[2].up_proj.weight
    return ok


def test_moe_expert_weight_list_is_reused_until_a_weight_parameter_is_replaced():
    """``SparseMoE.expert_weights`` hands the kernel set one list while no expert Parameter or submodule is
    replaced, and the module's current tensors after any replacement torch offers."""
    probe = _moe_probe()
    ws = probe.moe.expert_weights()
    assert probe.moe.expert_weights() is ws and ws[1][2] is probe.moe.experts[1].down_proj.weight
    ok = _replacements(probe)
    assert all(ok.values()), ok


def test_moe_expert_weight_list_goes_stale_without_the_counting_dicts_negative_control(monkeypatch):
    """With the dicts' counting switched off, the replacements only the dicts see (``functional_call``, a submodule
    swap) leave a stale list: the test above can fail. ``load_state_dict(assign=True)`` and ``.to()`` stay fresh:
    ``SparseMoE`` stacks its experts again after them and bumps the epoch itself."""
    from isoexec.model import layers

    probe = _moe_probe()
    monkeypatch.setattr(layers._EpochDict, "__setitem__", dict.__setitem__)
    ok = _replacements(probe)
    assert ok == {"load_state_dict(assign=True)": True, "functional_call": False, "submodule swap": False,
                  ".to() overwriting": True}, ok


_CONV_CASE = r"""
import json, sys, torch
from isoexec.kernels.conv.triton import causal_conv1d, causal_conv1d_pieces
from isoexec.kernels.conv.native import native_causal_conv1d_pieces
torch.manual_seed(0)
C, kc, lengths = 40, 4, [1, 1, 9, 2, 1, 70, 3]
out = {}
for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    pieces = [torch.randn(n, C).to(dt) for n in lengths]
    prefixes = [torch.randn(kc - 1, C).to(dt) for _ in lengths]
    w = (torch.randn(C, kc) * 0.5).to(dt)
    ys, ps = causal_conv1d_pieces(pieces, w, prefixes, 16, 32)  # one launch: decode tokens and prefill chunks
    alone = [causal_conv1d(x, w, p, 8, 16) for x, p in zip(pieces, prefixes)]  # each piece alone, other tiles
    y1, p1 = causal_conv1d(pieces[5][:33], w, prefixes[5], 16, 32)  # chunked prefill: 33 + 37 rows
    y2, p2 = causal_conv1d(pieces[5][33:], w, p1, 16, 32)
    nat, nat_ps = native_causal_conv1d_pieces(pieces, w, prefixes)
    out[name] = {"batched_eq_alone": all(torch.equal(a, b[0]) for a, b in zip(ys, alone)),
                 "prefixes_eq_alone": all(torch.equal(a, b[1]) for a, b in zip(ps, alone)),
                 "prefixes_eq_native": all(torch.equal(a, b) for a, b in zip(ps, nat_ps)),
                 "chunked_eq_whole": torch.equal(torch.cat([y1, y2]), ys[5]) and torch.equal(p2, ps[5]),
                 "native_differs": not all(torch.equal(a, b) for a, b in zip(ys, nat))}
# under autograd: the value is the kernel's, the gradient transformers' F.conv1d path (per piece)
xs = [torch.randn(n, C, requires_grad=True) for n in (5, 1, 12)]
w = torch.randn(C, kc, requires_grad=True)
prefixes = [torch.zeros(kc - 1, C)] * 3
gy = torch.randn(18, C)
(torch.cat(causal_conv1d_pieces(xs, w, prefixes, 16, 32)[0]) * gy).sum().backward()
got = [x.grad.clone() for x in xs] + [w.grad.clone()]
for t in xs + [w]:
    t.grad = None
(torch.cat(native_causal_conv1d_pieces(xs, w, prefixes)[0]) * gy).sum().backward()
out["grad_eq_native"] = all(torch.equal(a, t.grad) for a, t in zip(got, xs + [w]))
print(json.dumps(out))
"""


def test_triton_conv1d_one_launch_over_every_piece_equals_each_piece_alone_in_the_interpreter():
    """gdn.conv1d runs an engine step's pieces (decode tokens and prefill chunks) in one launch: each output
    equals its piece run alone and chunked, bf16 and fp32, with the native F.conv1d as the negative control;
    under autograd the gradient is the native path's."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _CONV_CASE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for dt in ("bf16", "fp32"):
        assert res[dt] == {"batched_eq_alone": True, "prefixes_eq_alone": True, "prefixes_eq_native": True,
                           "chunked_eq_whole": True, "native_differs": True}, (dt, res[dt])
    assert res["grad_eq_native"]


_GRAD_CASE = r"""
import json, torch
from isoexec.config import TritonSection
from isoexec.kernels.attention.native import native_attention
from isoexec.kernels.attention.triton import attention, attention_autograd
from isoexec.kernels.gemm.native import native_linear
from isoexec.kernels.gemm.triton import linear, linear_autograd, linear_leaves, linear_leaves_autograd
from isoexec.kernels.logprob.native import native_logprob
from isoexec.kernels.logprob.triton import logprob, logprob_autograd
torch.manual_seed(0)
t = TritonSection()


def grads(fn, ins, gy):
    ins = [x.detach().clone().requires_grad_() for x in ins]
    y = fn(*ins)
    return y.detach(), torch.autograd.grad(y, ins, gy)


def case(iso, kernel, nat, ins, gy):  # the wrapper's value is the kernel's bits, its gradient the native one's
    y_iso, g_iso = grads(iso, ins, gy)
    _, g_nat = grads(nat, ins, gy)
    return {"value_eq_kernel": torch.equal(y_iso, kernel(*ins)),
            "grad_eq_native": all(torch.equal(a, b) for a, b in zip(g_iso, g_nat))}


# bf16, where the old and the native gradients part; the interpreter's bf16 dots are not the GPU's (its bf16 GEMM and
# attention values are off by orders of magnitude), so a value is checked against the kernel's own call only
x, w = torch.randn(24, 256).bfloat16(), (torch.randn(96, 256) * 0.1).bfloat16()
gy = torch.randn(24, 96)
out = {"lm_head": case(lambda a, b: linear_autograd(a, b, t, out_dtype=torch.float32),
                       lambda a, b: linear(a, b, t, torch.float32),
                       lambda a, b: native_linear(a, b, out_dtype=torch.float32), [x, w], gy),
       "leaf": case(lambda a, b: linear_leaves_autograd(a, b, t, 8), lambda a, b: linear_leaves(a, b, t, 8, a.dtype),
                    native_linear, [x, w], gy.bfloat16())}
# the gradient these replaced (fp32 GEMMs of the upcast operands) is not the native one: the check can tell them apart
_, g_old = grads(lambda a, b: torch.nn.functional.linear(a.float(), b.float()), [x, w], gy)
_, g_nat = grads(lambda a, b: native_linear(a, b, out_dtype=torch.float32), [x, w], gy)
out["upcast_grad_differs"] = not all(torch.equal(a.to(b.dtype), b) for a, b in zip(g_old, g_nat))
# three pieces: a whole prompt (17 rows), a chunked prefill's second chunk (rows 9-22 over keys 0-22) and a decode row
# (position 30 over keys 0-30); k, v [17 + 23 + 31, 2, 64] hold each piece's keys
starts, lengths, keys = [0, 9, 30], [17, 14, 1], [17, 23, 31]
cut = [0, 17, 40, 71]
q, k, v = torch.randn(32, 4, 64).bfloat16(), torch.randn(71, 2, 64).bfloat16(), torch.randn(71, 2, 64).bfloat16()
kv = lambda b, c: [(b[a:z], c[a:z]) for a, z in zip(cut, cut[1:])]  # noqa: E731
gq = torch.randn(32, 4, 64).bfloat16()
out["attention"] = case(lambda a, b, c: attention_autograd(a, kv(b, c), starts, lengths, 16, 16),
                        lambda a, b, c: attention(a, kv(b, c), starts, lengths, 16, 16),
                        lambda a, b, c: native_attention(a, kv(b, c), starts, lengths), [q, k, v], gq)


def fp32_attention(a, b, c):  # the fp32 softmax attention whose gradient attention used before
    outs, row = [], 0
    for (kk, vv), s, n in zip(kv(b, c), starts, lengths):
        qb = a[row:row + n].float().transpose(0, 1)  # [4, n, 64]
        kb, vb = (x.float().repeat_interleave(2, 1).transpose(0, 1) for x in (kk, vv))  # [4, keys, 64]: 2 q heads per kv
        mask = torch.arange(kk.shape[0])[None] > (s + torch.arange(n))[:, None]
        sc = (qb @ kb.transpose(1, 2) / 8.0).masked_fill(mask, float("-inf"))
        outs.append((torch.softmax(sc, -1) @ vb).transpose(0, 1))
        row += n
    return torch.cat(outs).to(a.dtype)


_, g_old = grads(fp32_attention, [q, k, v], gq)
_, g_nat = grads(lambda a, b, c: native_attention(a, kv(b, c), starts, lengths), [q, k, v], gq)
out["fp32_attention_grad_differs"] = not all(torch.equal(a, b) for a, b in zip(g_old, g_nat))
z = torch.randn(6, 1000) * 3
out["logprob"] = case(lambda a: logprob_autograd(a, 0.7, 256), lambda a: logprob(a, 0.7, 256), lambda a: native_logprob(a, 0.7),
                      [z], torch.randn(6, 1000))
print(json.dumps(out))
"""


def test_triton_set_gradients_are_the_native_stacks_in_the_interpreter():
    """Under autograd the Triton set's GEMMs (``lm_head``'s fp32 output, the leaf GEMM), attention and logprob return
    their kernels' bits and the native stack's gradients, bit for bit on the same inputs (the backward is outside the contract: it is the native trainer's); attention over a whole prompt, a
    chunked prefill's later chunk and a decode row. Negative controls: the gradients of the fp32 expressions the GEMMs'
    and attention's references used before differ from the native ones."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _GRAD_CASE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("lm_head", "leaf", "attention", "logprob"):
        assert res[name] == {"value_eq_kernel": True, "grad_eq_native": True}, (name, res[name])
    assert res["upcast_grad_differs"] and res["fp32_attention_grad_differs"]


_SLOTS_CASE = r"""
import json, torch
import torch.nn.functional as F
from isoexec.config import TritonSection
from isoexec.kernels.attention.triton import attention, attention_slots
from isoexec.kernels.conv.triton import causal_conv1d_pieces, causal_conv1d_slots
from isoexec.kernels.gdn import triton as gdn
torch.manual_seed(0)
res = {}
# attention: 3 sequences with 5, 9, 2 cached keys, one new token each, slots 2, 0, 3 of a pool of 4 x 16
B, hq, hkv, d, cap = 3, 4, 2, 16, 16
pos = torch.tensor([5, 9, 2]); slots = torch.tensor([2, 0, 3])
pk, pv = torch.randn(4, cap, hkv, d), torch.randn(4, cap, hkv, d)
q, k, v = torch.randn(B, hq, d), torch.randn(B, hkv, d), torch.randn(B, hkv, d)
kv = [(torch.cat([pk[s, :p], k[i:i + 1]]), torch.cat([pv[s, :p], v[i:i + 1]])) for i, (s, p) in enumerate(zip(slots, pos))]
want = attention(q, kv, pos.tolist(), [1] * B, kv_block=4, block_m=16)
got = attention_slots(q, k, v, pk, pv, slots, pos, kv_block=4, block_m=16)
res["attn"] = torch.equal(want, got) and all(torch.equal(pk[s, p], k[i]) for i, (s, p) in enumerate(zip(slots, pos)))
# conv: 3 tokens, prefixes in slots 1, 2, 0
w = torch.randn(8, 4); pool = torch.randn(3, 3, 8); sl = torch.tensor([1, 2, 0]); x = torch.randn(3, 8)
ys, pre = causal_conv1d_pieces(list(x[:, None]), w, list(pool[sl].clone()), block_t=4, block_c=8)
y = causal_conv1d_slots(x, w, pool, sl, block_t=4, block_c=8)
res["conv"] = torch.equal(torch.cat(ys), y) and torch.equal(torch.stack(pre), pool[sl])
# GDN: the eager decode step (cpr_gdn) against the slot scan + complete_chunks, from the same prefill, C = 16
cfg = TritonSection(gdn_chain_bv=16, gdn_scan_bv=16)
H, dk, C = 2, 32, 16
lens = [13, 3, 16]
def inputs(n):
    return (F.normalize(torch.randn(n, H, dk), dim=-1), F.normalize(torch.randn(n, H, dk), dim=-1), torch.randn(n, H, dk),
            F.logsigmoid(torch.randn(n, H)) * 0.3, torch.rand(n, H))
pre_in = inputs(sum(lens))
_, sa = gdn.cpr_gdn(*pre_in, lens, [None] * 3, C, cfg)
_, sb = gdn.cpr_gdn(*pre_in, lens, [None] * 3, C, cfg)
pool = sa[0].pool
p = torch.tensor(lens)
eq, completions = True, 0
for step in range(20):
    x = inputs(3)
    oa, sa = gdn.cpr_gdn(*x, [1] * 3, sa, C, cfg)
    ob = gdn.decode_scan_slots(*x, torch.tensor([s.slot for s in sb]), p, pool, cfg)
    done = [s.slot for s, n in zip(sb, p.tolist()) if n % C == C - 1]
    gdn.complete_chunks(pool, done, cfg)
    completions += len(done)
    for s in sb:
        s.n_open = (s.n_open + 1) % C
    p = p + 1
    eq = eq and torch.equal(oa, ob) and all(torch.equal(pool.running[a.slot], pool.running[b.slot])
                                            and torch.equal(pool.entry[a.slot], pool.entry[b.slot]) for a, b in zip(sa, sb))
res["gdn"] = eq
res["completions"] = completions
print(json.dumps(res))
"""


def test_slot_kernels_equal_the_eager_kernels_in_the_interpreter():
    """The CUDA-graph decode's slot-addressed wrappers (``attention_slots``, ``causal_conv1d_slots``,
    ``decode_scan_slots`` + ``complete_chunks``) give the eager kernels' outputs and states exactly, through
    chunk completions (device-built metadata; the compiled kernels: ``tests/test_decode_graphs.py`` on a GPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _SLOTS_CASE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res == {"attn": True, "conv": True, "gdn": True, "completions": 4}, res

_LEAF_CASE = r"""
import json, torch
import torch.nn.functional as F
from isoexec.config import TritonSection
from isoexec.kernels.gemm.triton import linear_leaves, grouped_linear_leaves, linear_leaves_partial, tree_combine
import isoexec.kernels.gemm.triton as tg
torch.manual_seed(0)
res = {}
for name, dt in (("fp32", torch.float32), ("fp16", torch.float16)):
    for K in (256, 1024):  # leaves of 32 features (one partial K step) and of 128 (two or four steps)
        x, w = torch.randn(37, K).to(dt), torch.randn(48, K).to(dt)
        out = {}
        for loop in ("flat", "paired", "flat_paired", "gluon_pipelined"):  # gluon: the paired fallback off CUDA
            for lpp in (8, 4, 2):
                cfg = TritonSection(pik_loop=loop, pik_program_leaves=lpp)
                out[f"{loop}{lpp}"] = linear_leaves(x, w, cfg, 8, torch.float32, split=False)
        # leaf-width buckets (pik_bfloat16_by_leaf_k; fp16 only, fp32 keeps pik_gemm_float32): K 256 -> leaves of 32,
        # K 1024 -> of 128. The default BM x BN: the interpreter's fp16 dots (numpy) change bits with the tile shape,
        # the compiled ones do not (tests/test_kernels_triton.py)
        buckets = TritonSection(pik_bfloat16_by_leaf_k=[
            {"max_leaf_k": 32, "loop": "paired", "tiles": [128, 64, 64, 4, 2], "program_leaves": 2},
            {"max_leaf_k": 128, "loop": "flat", "tiles": [128, 64, 64, 8, 2], "program_leaves": 4}])
        # the two subtrees of each tile added in the leaf kernel (top "in_kernel"), by a rows bucket (37 rows <= 64,
        # split None) and by a bucket of the in-register tree (split False)
        topcfg = TritonSection(pik_bfloat16_by_leaf_k=[
            {"max_rows": 64, "max_leaf_k": 128, "loop": "flat", "tiles": [128, 64, 64, 4, 2], "program_leaves": 4,
             "top": "in_kernel"},
            {"max_leaf_k": 128, "loop": "paired", "tiles": [128, 64, 64, 8, 2], "program_leaves": 4, "top": "in_kernel"}])
        seen, launch = [], tg._launch_leaves  # which program each launch ran
        tg._launch_leaves = lambda *a, **k: seen.append((a[5], a[6], a[8], tuple(a[9]), k.get("top", False))) or launch(*a, **k)
        out["buckets"] = linear_leaves(x, w, buckets, 8, torch.float32, split=False)
        out["top_rows"] = linear_leaves(x, w, topcfg, 8, torch.float32)
        out["top_tree"] = linear_leaves(x, w, topcfg, 8, torch.float32, split=False)
        out["top_partial"] = linear_leaves_partial(x, w, topcfg, 8)
        # four subtrees of two leaves per tile, both top levels in the leaf kernel
        top4cfg = TritonSection(pik_bfloat16_by_leaf_k=[
            {"max_leaf_k": 128, "loop": "paired", "tiles": [128, 64, 64, 8, 2], "program_leaves": 2, "top": "in_kernel"}])
        out["top4_tree"] = linear_leaves(x, w, top4cfg, 8, torch.float32, split=False)
        tg._launch_leaves = launch
        # TMA loads (fp16 only, as every bucket; leaves of 32 features are not a multiple of BK = 64: pointer loads)
        tmacfg = TritonSection(pik_bfloat16_by_leaf_k=[
            {"max_rows": 64, "max_leaf_k": 128, "loop": "flat_paired", "tiles": [128, 64, 64, 4, 2], "program_leaves": 8,
             "load": "tma"},
            {"max_leaf_k": 128, "loop": "paired", "tiles": [128, 64, 64, 8, 2], "program_leaves": 4, "top": "in_kernel",
             "load": "tma"}])
        descs, make = [], tg._tma_descriptors
        tg._tma_descriptors = lambda *a: descs.append(make(*a)) or descs[-1]
        out["tma_rows"] = linear_leaves(x, w, tmacfg, 8, torch.float32)
        out["tma_tree"] = linear_leaves(x, w, tmacfg, 8, torch.float32, split=False)
        tg._tma_descriptors = make
        tma_made = [d is not None for d in descs] == ([K == 1024] * 2 if dt == torch.float16 else [])
        b = [bk for bk in buckets.pik_bfloat16_by_leaf_k if K // 8 <= bk.max_leaf_k][0]
        tb = topcfg.pik_bfloat16_by_leaf_k
        fp32_tiles = tuple(buckets.pik_gemm_float32)
        want = ([(K // 8, b.program_leaves, b.loop, tuple(b.tiles), False)]
                + [(K // 8, 4, t.loop, tuple(t.tiles), True) for t in (tb[0], tb[1], tb[0])]
                + [(K // 8, 2, "paired", (128, 64, 64, 8, 2), True)] if dt == torch.float16
                else [(K // 8, 8, "flat", fp32_tiles, False), (K // 8, 1, "flat", fp32_tiles, False),
                      (K // 8, 8, "flat", fp32_tiles, False), (K // 8, 1, "flat", fp32_tiles, False),
                      (K // 8, 8, "flat", fp32_tiles, False)])
        ref = linear_leaves(x, w, TritonSection(), 8, torch.float32, split=True)  # one leaf per program + tree_combine
        tp = [linear_leaves_partial(x[:, r * K // 4:(r + 1) * K // 4], w[:, r * K // 4:(r + 1) * K // 4],
                                    TritonSection(pik_loop="paired", pik_split_rows=0), 2) for r in range(4)]
        tp4 = tree_combine(torch.stack(tp), torch.float32)
        counts = torch.tensor([10, 0, 27])
        ws = torch.stack([w, w.flip(0), w * 0.5])
        g_want = torch.cat([linear_leaves(x[:10], ws[0], TritonSection(), 8, split=True),
                            linear_leaves(x[10:], ws[2], TritonSection(), 8, split=True)])
        g_eq = all(torch.equal(grouped_linear_leaves(x, ws, counts, c, 8, split=False), g_want)
                   for c in (TritonSection(pik_loop="paired"), topcfg, top4cfg, tmacfg))
        res[f"{name}_K{K}"] = {"loops_eq_split": all(torch.equal(v, ref) for v in out.values()), "dispatch": seen == want,
                               "tp4_eq": torch.equal(tp4, ref), "grouped_eq": g_eq,
                               "tma_made": tma_made, "native_differs": not torch.equal(F.linear(x.float(), w.float()), ref)}
print(json.dumps(res))
"""


def test_leaf_gemm_loop_shapes_give_the_same_bits_in_the_interpreter():
    """The leaf GEMM's loop shapes (``pik_loop`` flat, paired, flat_paired) at 8, 4 and 2 leaves per program, leaf-width buckets
    (``pik_bfloat16_by_leaf_k``, each launch's loop, tiles, leaves per program and top recorded), buckets by rows and
    the two subtrees added in the leaf kernel (``top: in_kernel``; direct, a rank's fp32 partial and grouped), TMA loads
    (``load: tma``, direct and grouped; descriptors made exactly where the leaf width allows them), a TP=4
    rank's subtree (paired) through the combine, and the grouped launch give the one-leaf-per-program launch's fp32 rows,
    fp32 and fp16 inputs, leaves of one partial K step and of several; the native ``F.linear`` differs (negative
    control). The compiled kernels: ``tests/test_kernels_triton.py`` on a GPU."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _LEAF_CASE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res and all(v == {"loops_eq_split": True, "dispatch": True, "tp4_eq": True, "grouped_eq": True, "tma_made": True,
                             "native_differs": True} for v in res.values()), res


_PREP_SPLIT_CASE = r"""
import json, torch
import torch.nn.functional as F
from isoexec.config import TritonSection
from isoexec.kernels.gdn import triton as gdn
torch.manual_seed(0)
H, d = 2, 32
lens = [40, 16, 7]
N = sum(lens)
q, k = (F.normalize(torch.randn(N, H, d), dim=-1) for _ in range(2))
v, g, b = torch.randn(N, H, d), F.logsigmoid(torch.randn(N, H)) * 0.3, torch.rand(N, H)
res = {}
for name, C, split in (("one", 16, False), ("split", 16, True), ("one_C32", 32, False)):
    cfg = TritonSection(gdn_chain_bv=16, gdn_scan_bv=16, gdn_prep_split=split)
    o, st = gdn.cpr_gdn(q, k, v, g, b, lens, [None] * 3, C, cfg, keep_state=True)
    outs = [o]
    for t in range(18):  # decode across a chunk boundary of C = 16: the open chunk's prep runs from the buffers
        ot, st = gdn.cpr_gdn(*(z[N - 3:] for z in (q, k, v, g, b)), [1] * 3, st, C, cfg)
        outs.append(ot)
    res[name] = torch.cat(outs)
print(json.dumps({"equal": torch.equal(res["one"], res["split"]), "rows": int(res["one"].shape[0]),
                  "other_chunks_differ": not torch.equal(res["one"][:N], res["one_C32"][:N])}))
"""


def test_chunk_prep_in_two_launches_gives_the_one_launch_bits_in_the_interpreter():
    """``gdn_prep_split``: the chunk prep's W / KD / decay totals and its U in two launches give the one launch's CPR
    outputs for a packed prefill and for decode steps across a chunk boundary (where the open chunk's prep runs from
    the buffers); another chunk size gives other bits (negative control: the check sees the prep's arithmetic). The
    compiled kernels' bits: the variants table's check on a GPU (``isoexec.bench.variants_gpu``)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _PREP_SPLIT_CASE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res == {"equal": True, "rows": 63 + 3 * 18, "other_chunks_differ": True}, res
