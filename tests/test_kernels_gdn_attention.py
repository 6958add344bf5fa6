"""CPR Gated DeltaNet and blockwise attention: correctness against references, bitwise across cases."""

import pytest
import torch

from isoexec.config import KernelSection
from isoexec.kernels import build_kernel_set
from isoexec.kernels.attention.cpu import iso_attention
from isoexec.kernels.attention.native import native_attention
from isoexec.kernels.gdn.cpu import cpr_gdn
from isoexec.kernels.gdn.native import native_gdn
from isoexec.kernels.norm.cpu import iso_l2norm
from isoexec.kernels.gdn.reference import recurrent_reference

H, DK, DV, C = 2, 32, 16, 8


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = iso_l2norm(torch.randn(n, H, DK, generator=g))
    k = iso_l2norm(torch.randn(n, H, DK, generator=g))
    return q, k, torch.randn(n, H, DV, generator=g), -torch.rand(n, H, generator=g) * 0.5, torch.rand(n, H, generator=g)


def _decode(fn, x, n):
    state, outs = None, []
    for t in range(n):
        o, (state,) = fn(*(a[t : t + 1] for a in x), [1], [state])
        outs.append(o)
    return torch.cat(outs), state


def test_cpr_matches_fp64_recurrence():
    x = _inputs(37)
    o, (st,) = cpr_gdn(*x, [37], [None], C)
    ref, s_ref = recurrent_reference(*x)
    assert (o.double() - ref).abs().max() < 1e-5
    assert (st.running.double() - s_ref).abs().max() < 1e-5


def test_cpr_decode_matches_trainer_across_chunk_boundaries():
    n = 5 * C + 3  # 5 chunk boundaries
    x = _inputs(n)
    o, _ = cpr_gdn(*x, [n], [None], C, keep_state=False)
    dec, _ = _decode(lambda *a: cpr_gdn(*a, C), x, n)
    assert torch.equal(dec, o)


def test_cpr_decode_advances_its_own_running_state_in_place_with_the_same_bits():
    """Decode updates a running state the sequence owns in place (no fresh state per step); the bits are
    those of the out-of-place scan, and a consumed state is refused rather than silently re-advanced."""
    n = 2 * C + 5
    x = _inputs(n)
    o, _ = cpr_gdn(*x, [n], [None], C, keep_state=False)
    _, (st,) = cpr_gdn(*(a[: C + 2] for a in x), [C + 2], [None], C)
    assert st.owns_running and st.running.data_ptr() != st.entry.data_ptr()
    buf, outs = st.running.data_ptr(), []
    for t in range(C + 2, 2 * C - 1):
        prev = st
        ot, (st,) = cpr_gdn(*(a[t : t + 1] for a in x), [1], [st], C)
        assert st.running.data_ptr() == buf  # in place
        outs.append(ot)
    assert torch.equal(torch.cat(outs), o[C + 2 : 2 * C - 1])
    with pytest.raises(ValueError, match="second time"):
        cpr_gdn(*(a[:1] for a in x), [1], [prev], C)


def test_cpr_scan_in_place_equals_out_of_place():
    from isoexec.kernels.gdn.cpu import _scan

    x = _inputs(11)
    g = torch.Generator().manual_seed(3)
    starts = [torch.randn(H, DK, DV, generator=g) for _ in range(3)]
    segs = [(0, 4), (4, 1), (5, 6)]
    fresh = [torch.empty(H, DK, DV) for _ in starts]
    o1 = _scan(starts, fresh, *x, segs)
    own = [s.clone() for s in starts]
    o2 = _scan(own, own, *x, segs)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(fresh, own))
    assert not torch.equal(own[0], starts[0])  # the states did advance


def test_native_gdn_decode_differs_from_its_chunked_prefill():
    """Negative control: transformers' recurrent decode vs chunked prefill are not bitwise equal."""
    n = 5 * C + 3
    x = _inputs(n)
    o, _ = native_gdn(*x, [n], [None], chunk_size=C)
    dec, _ = _decode(lambda *a: native_gdn(*a, chunk_size=C), x, n)
    assert not torch.equal(dec, o)
    assert (dec - o).abs().max() < 1e-4


def test_cpr_chunked_prefill_and_batching_are_bitwise():
    n = 4 * C + 5
    x = _inputs(n)
    o, (st,) = cpr_gdn(*x, [n], [None], C)
    for splits in ([C - 1, n - C + 1], [C, 1, C + 1, n - 2 * C - 2], [3, 2 * C + 5, n - 2 * C - 8]):
        state, outs, p = None, [], 0
        for m in splits:
            out, (state,) = cpr_gdn(*(a[p : p + m] for a in x), [m], [state], C)
            outs.append(out)
            p += m
        assert torch.equal(torch.cat(outs), o), splits
        assert torch.equal(state.running, st.running) and torch.equal(state.entry, st.entry)
    other = _inputs(19, seed=1)
    ob, _ = cpr_gdn(*(torch.cat([a, b]) for a, b in zip(other, x)), [19, n], [None, None], C)
    assert torch.equal(ob[19:], o)


@pytest.mark.parametrize("in_place", [False, True])
def test_scan_column_blocks_move_no_bit(in_place):
    """cpr_scan.c runs 64-column blocks in vector registers and a tail one column at a time: a column's
    bits are the same in a block, in the tail, and alone (DV = 80: one block + a 16-column tail, against
    the 16-column slices, which take the tail loop only), from a start state in place or copied."""
    from isoexec.kernels.gdn.cpu import _scan

    g = torch.Generator().manual_seed(3)
    n, h, dk, dv = 7, 2, 32, 80
    q, k = iso_l2norm(torch.randn(n, h, dk, generator=g)), iso_l2norm(torch.randn(n, h, dk, generator=g))
    v, gl, beta = torch.randn(n, h, dv, generator=g), -torch.rand(n, h, generator=g), torch.rand(n, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    segs = [(0, 3), (3, 4)]

    def run(cols):
        starts = [s0[..., cols].clone(memory_format=torch.contiguous_format) for _ in segs]
        dsts = starts if in_place else [torch.empty_like(s) for s in starts]
        return _scan(starts, dsts, q, k, v[..., cols].contiguous(), gl, beta, segs), dsts

    full, full_states = run(slice(0, dv))
    for c0 in range(0, dv, 16):
        part, part_states = run(slice(c0, c0 + 16))
        assert torch.equal(part, full[..., c0 : c0 + 16])
        assert all(torch.equal(p, f[..., c0 : c0 + 16]) for p, f in zip(part_states, full_states))


def test_ut_inverse_is_the_inverse_and_per_chunk():
    """The state pass's T = (I + A)^-1 (cpr_ut_inverse.c) against the fp64 inverse, and a chunk's T has
    the same bits alone as among others."""
    from isoexec.kernels.gdn.cpu import _ut_inverse

    g = torch.Generator().manual_seed(5)
    m, c = 6, 16
    k = iso_l2norm(torch.randn(m, c, DK, generator=g))
    gl, beta = -torch.rand(m, c, generator=g) * 0.5, torch.rand(m, c, generator=g)
    T, G = _ut_inverse(k, gl, beta)
    lower = torch.ones(c, c, dtype=torch.bool).tril(-1)
    A = torch.where(lower, beta[:, :, None] * (k @ k.transpose(1, 2)) * torch.exp(G[:, :, None] - G[:, None, :]), 0.0)
    ref = torch.linalg.inv(torch.eye(c, dtype=torch.float64) + A.double())
    assert (T.double() - ref).abs().max() < 1e-5
    assert torch.equal(_ut_inverse(k[2:3], gl[2:3], beta[2:3])[0][0], T[2])


def test_cpr_backward_matches_fp64_reference():
    x = _inputs(29)
    xs = [a.clone().requires_grad_(True) for a in x]
    gdn_core = build_kernel_set("isoexec", "cpu", KernelSection(chunk_size=C))["gdn.core"]
    out, _ = gdn_core(*xs, [29], [None], True)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    xd = [a.detach().double().requires_grad_(True) for a in x]
    ref, _ = recurrent_reference(*xd)
    (ref * w.double()).sum().backward()
    for a, b in zip(xs, xd):
        assert (a.grad.double() - b.grad).abs().max() < 1e-5


def test_attention_matches_sdpa_and_decode_is_bitwise():
    torch.manual_seed(0)
    n, hq, hkv, d = 45, 4, 2, 32
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    full = iso_attention(q, [(k, v)], [0], [n], 16)
    assert (full - native_attention(q, [(k, v)], [0], [n])).abs().max() < 1e-5
    dec = torch.cat([iso_attention(q[t : t + 1], [(k[: t + 1], v[: t + 1])], [t], [1], 16) for t in range(n)])
    assert torch.equal(dec, full)
    nat_full = native_attention(q, [(k, v)], [0], [n])
    nat_dec = torch.cat([native_attention(q[t : t + 1], [(k[: t + 1], v[: t + 1])], [t], [1]) for t in range(n)])
    assert not torch.equal(nat_dec, nat_full)  # negative control


def test_attention_batch_composition_and_row_stride_move_no_bit():
    """A sequence's rows get the same bits alone or beside others, in bf16 cache buffers or in strided
    views of a [batch, seq] tensor (Megatron's layout); a mid-sequence chunk equals the prefill's rows."""
    torch.manual_seed(1)
    hq, hkv, d, lens = 4, 2, 32, [70, 9, 131]
    qs = [torch.randn(n, hq, d).bfloat16() for n in lens]
    kvs = [(torch.randn(n, hkv, d).bfloat16(), torch.randn(n, hkv, d).bfloat16()) for n in lens]
    alone = [iso_attention(q, [kv], [0], [len(q)], 64) for q, kv in zip(qs, kvs)]
    batch = iso_attention(torch.cat(qs), kvs, [0, 0, 0], lens, 64)
    assert torch.equal(batch, torch.cat(alone))
    sk = torch.zeros(max(lens), len(lens), hkv, d, dtype=torch.bfloat16)  # [s, b, h, d]: a sequence's rows strided
    sv = torch.zeros_like(sk)
    for b, (k, v) in enumerate(kvs):
        sk[: lens[b], b], sv[: lens[b], b] = k, v
    strided = [(sk[:n, b], sv[:n, b]) for b, n in enumerate(lens)]
    assert not strided[0][0].is_contiguous()
    assert torch.equal(iso_attention(torch.cat(qs), strided, [0, 0, 0], lens, 64), batch)
    mixed = [(sk[:n, b], kvs[b][1]) for b, n in enumerate(lens)]  # K and V with different row strides
    assert torch.equal(iso_attention(torch.cat(qs), mixed, [0, 0, 0], lens, 64), batch)
    k, v = kvs[2]
    chunk = iso_attention(qs[2][100:120], [(k[:120], v[:120])], [100], [20], 64)
    assert torch.equal(chunk, alone[2][100:120])


def test_attention_gradient_matches_fp64_reference():
    torch.manual_seed(2)
    hq, hkv, d, lens = 4, 2, 32, [70, 81]
    q, k, v = (torch.randn(sum(lens), h, d, requires_grad=True) for h in (hq, hkv, hkv))
    split = list(zip(k.split(lens), v.split(lens)))
    out = iso_attention(q, split, [0, 0], lens, 64)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = native_attention(qd, list(zip(kd.split(lens), vd.split(lens))), [0, 0], lens)
    assert (out.double() - ref).abs().max() < 1e-5
    (ref * w.double()).sum().backward()
    for a, b in ((q, qd), (k, kd), (v, vd)):
        assert (a.grad.double() - b.grad).abs().max() < 2e-5


def test_attention_refuses_a_cache_shorter_than_its_positions():
    q, k = torch.randn(3, 2, 16), torch.randn(4, 1, 16)
    with pytest.raises(ValueError, match=r"2 cached and 3 new tokens"):
        iso_attention(q, [(k, k)], [2], [3], 64)


def test_attention_refuses_negative_lengths_or_starts_and_a_kv_block_below_one():
    """Before these checks a negative length read and wrote outside q and o, and kv_block 0 never returned."""
    k = torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match=r"length -1"):
        iso_attention(torch.randn(1, 2, 4), [(k, k), (k, k)], [0, 0], [-1, 2], 16)
    with pytest.raises(ValueError, match=r"start -1"):
        iso_attention(torch.randn(1, 2, 4), [(k, k)], [-1], [1], 16)
    with pytest.raises(ValueError, match=r"kv_block must be >= 1, got 0"):
        iso_attention(torch.randn(1, 2, 4), [(k, k)], [0], [1], 0)


def test_cpr_state_refuses_to_continue_under_another_chunk_size():
    x = _inputs(12)
    _, (st,) = cpr_gdn(*x, [12], [None], C)
    assert st.chunk_size == C
    try:
        cpr_gdn(*(a[:1] for a in x), [1], [st], 2 * C)
    except ValueError as e:
        assert f"C={C}" in str(e) and f"C={2 * C}" in str(e)
    else:
        raise AssertionError("a state built with C=8 continued under C=16")


def test_cpr_backward_of_packed_sequences_matches_fp64_reference():
    """Two packed sequences crossing several chunks: each gets its own gradient, from its own zero state."""
    lens = [29, 13]
    x = _inputs(sum(lens), seed=4)
    xs = [a.clone().requires_grad_(True) for a in x]
    gdn_core = build_kernel_set("isoexec", "cpu", KernelSection(chunk_size=C))["gdn.core"]
    out, _ = gdn_core(*xs, lens, [None, None], True)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    xd = [a.detach().double().requires_grad_(True) for a in x]
    refs = [recurrent_reference(*(t[a:b] for t in xd))[0] for a, b in ((0, 29), (29, 42))]
    (torch.cat(refs) * w.double()).sum().backward()
    for a, b in zip(xs, xd):
        assert (a.grad.double() - b.grad).abs().max() < 1e-5
