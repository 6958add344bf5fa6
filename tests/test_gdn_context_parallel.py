"""The CPR Gated DeltaNet over context-parallel ranks (gloo, several processes): every rank's piece of a
sequence has the bits of the same rows computed on one rank, and the gradients agree with one rank's.

Sequences of 150, 70 and 9 tokens padded to 160, C = 64, in the load-balanced CP chunks: at CP 2 chunks
of 40 positions (boundaries at 40, 80, 120, inside GDN chunks; the chain goes rank 0, 1, 1, 0); at CP 4
chunks of 20 (a GDN chunk spread over four CP chunks and three ranks; rank 3 holds chunks 3 and 4 and
passes the chain to itself).
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


def _worker(rank, world):
    """This rank's chunks (both slots) of every sequence through CPRPieceFunction, then the backward of
    both; returns the rows it computed, their outputs and its full-size input gradients."""
    from itertools import accumulate

    import torch.distributed as dist

    from isoexec.kernels.collectives.cp import ChainExchange, SequenceSlice
    from isoexec.kernels.gdn.cpu import CPRPieceFunction

    piece = SequenceSlice(rank, world, PADDED // world)
    offs = [0, *accumulate(LENGTHS)]
    *ins, do = _inputs()
    mine = [x.clone().requires_grad_() for x in ins]
    mailbox, rows, outs = {}, [], []
    for slot, n in enumerate(piece.chunk_lengths(LENGTHS)):
        present = [i for i, m in enumerate(n) if m]
        g = piece.chunks[slot] * piece.chunk
        r = torch.cat([torch.arange(offs[i] + g, offs[i] + g + n[i]) for i in present])
        link = ChainExchange(dist.group.WORLD, piece, slot, [LENGTHS[i] for i in present], C, torch.device("cpu"),
                             mailbox)
        outs.append(CPRPieceFunction.apply(*(x[r] for x in mine), [n[i] for i in present], C, link))
        link.wait()
        rows.append(r)
    torch.autograd.backward(outs, [do[r] for r in rows])
    return {"rows": torch.cat(rows), "o": torch.cat(outs).detach(), "grads": [x.grad for x in mine]}


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
        g = sum(r["grads"][i] for r in ranks)
        err = ((g - g1[i]).abs().max() / g1[i].abs().max()).item()
        print(f"CP={cp} d{name}: max |diff| / max |grad| = {err:.2e}")
        assert err < 1e-5, name


def test_native_gdn_split_at_the_cp_boundary_differs_from_one_rank_negative_control():
    """transformers' chunked GDN (the native set) run on two pieces of the 150-token sequence cut at
    position 80, the second from the first's final state, against the whole sequence: other bits."""
    from isoexec.kernels.gdn.native import native_gdn

    q, k, v, g, beta, _ = (x[: LENGTHS[0]] for x in _inputs())
    whole, _ = native_gdn(q, k, v, g, beta, [LENGTHS[0]], [None], C)
    cut = PADDED // 2
    first, (state,) = native_gdn(*(x[:cut] for x in (q, k, v, g, beta)), [cut], [None], C)
    second, _ = native_gdn(*(x[cut:] for x in (q, k, v, g, beta)), [LENGTHS[0] - cut], [state], C)
    split = torch.cat([first, second])
    print(f"native GDN split at position {cut} vs whole: max |diff| {(split - whole).abs().max().item():.3e}")
    assert not torch.equal(split, whole)
