"""The CPR Gated DeltaNet over context-parallel ranks (gloo, several processes): every rank's piece of a
sequence has the bits of the same rows computed on one rank, and the gradients agree with one rank's.

Sequences of 150, 70 and 9 tokens padded to 160, C = 64: at CP 2 the rank boundary (position 80) falls
in the middle of the second chunk; at CP 4 (40 positions per rank) a chunk spans three ranks, so the
chain passes through a rank that completes no chunk of its own.
"""

import pytest
import torch

C, H, DK, DV = 64, 2, 16, 16
LENGTHS, PADDED = [150, 70, 9], 160


def _inputs():
    """Whole-sequence fp32 inputs of the GDN core, packed ``[T, ...]`` (q, k l2-normalised, g <= 0)."""
    g = torch.Generator().manual_seed(3)
    t = sum(LENGTHS)
    q = torch.nn.functional.normalize(torch.randn(t, H, DK, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, H, DK, generator=g), dim=-1)
    v = torch.randn(t, H, DV, generator=g)
    gate = -torch.rand(t, H, generator=g) * 0.3
    beta = torch.rand(t, H, generator=g)
    do = torch.randn(t, H, DV, generator=g)
    return q, k, v, gate, beta, do


def _rows(piece):
    """Packed row indices of this rank's real tokens, sequence by sequence."""
    from itertools import accumulate

    offs = [0, *accumulate(LENGTHS)]
    n = piece.local_lengths(LENGTHS)
    return torch.cat([torch.arange(o + piece.start, o + piece.start + m) for o, m in zip(offs, n)])


def _worker(rank, world):
    import torch.distributed as dist

    from isoexec.kernels.collectives.cp import ChainExchange, SequenceSlice
    from isoexec.kernels.gdn.cpu import CPRPieceFunction

    piece = SequenceSlice(rank, world, PADDED // world)
    rows = _rows(piece)
    *ins, do = _inputs()
    mine = [x[rows].clone().requires_grad_() for x in ins]
    present = [n for n, m in zip(LENGTHS, piece.local_lengths(LENGTHS)) if m]
    link = ChainExchange(dist.group.WORLD, piece, present, C, torch.device("cpu"))
    o = CPRPieceFunction.apply(*mine, [m for m in piece.local_lengths(LENGTHS) if m], C, link)
    link.wait()
    o.backward(do[rows])
    return {"rows": rows, "o": o.detach(), "grads": [x.grad for x in mine]}


@pytest.fixture(scope="module")
def single():
    from isoexec.kernels.gdn.cpu import CPRTrainerFunction

    *ins, do = _inputs()
    ins = [x.clone().requires_grad_() for x in ins]
    o = CPRTrainerFunction.apply(*ins, LENGTHS, C)
    o.backward(do)
    return o.detach(), [x.grad for x in ins]


@pytest.mark.parametrize("cp", [2, 4])
def test_cpr_gdn_pieces_over_cp_ranks_equal_one_rank_bitwise_and_gradients_agree(single, cp):
    from isoexec.kernels.collectives.gloo import run_gloo

    ranks = run_gloo(_worker, cp)
    o1, g1 = single
    rows = torch.cat([r["rows"] for r in ranks])
    assert sorted(rows.tolist()) == list(range(sum(LENGTHS)))
    o = torch.cat([r["o"] for r in ranks])
    assert torch.equal(o, o1[rows])
    for i, name in enumerate(("q", "k", "v", "g", "beta")):
        g = torch.cat([r["grads"][i] for r in ranks])
        err = ((g - g1[i][rows]).abs().max() / g1[i].abs().max()).item()
        print(f"CP={cp} d{name}: max |diff| / max |grad| = {err:.2e}")
        assert err < 1e-5, name


def test_native_gdn_split_at_the_cp_boundary_differs_from_one_rank_negative_control():
    """transformers' chunked GDN (the native set) run on the CP=2 pieces of the 150-token sequence, the
    second from the first's final state, against the whole sequence: other bits."""
    from isoexec.kernels.gdn.native import native_gdn

    q, k, v, g, beta, _ = (x[: LENGTHS[0]] for x in _inputs())
    whole, _ = native_gdn(q, k, v, g, beta, [LENGTHS[0]], [None], C)
    cut = PADDED // 2
    first, (state,) = native_gdn(*(x[:cut] for x in (q, k, v, g, beta)), [cut], [None], C)
    second, _ = native_gdn(*(x[cut:] for x in (q, k, v, g, beta)), [LENGTHS[0] - cut], [state], C)
    split = torch.cat([first, second])
    print(f"native GDN split at position {cut} vs whole: max |diff| {(split - whole).abs().max().item():.3e}")
    assert not torch.equal(split, whole)
