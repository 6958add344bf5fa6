"""Candidate chunkwise in-chunk output for CPR Gated DeltaNet (issue 37's plan; not in the kernel set).

Today's CPR (:mod:`isoexec.kernels.gdn.triton`) computes every token's output with a token-by-token
scan (``in_chunk: recurrent``), 1.74 ms of its trainer forward at 1x10240 on the H200 (3.35 ms in that
breakdown, 3.15 ms since the Neumann prep). This module computes
the same outputs chunkwise from the chunk's entry state ``S`` (``[Dk, Dv]``) and the prep's
``W = T (beta e^G K)``, ``U0 = T (beta V)`` (``T = (I + A)^-1``; the same prep and state chain as today),
the form of fla's ``chunk_gated_delta_rule`` (Yang et al., "Gated Delta Networks", arXiv 2412.06464, and
its UT-transform chunk algorithm)::

    U = U0 - W S                                    [C, Dv]   the chunk's corrected values
    P = tril(Q K^T * exp(G_t - G_s))  (s <= t)      [C, C]
    O = (exp(G) * Q) S + P U, times Dk^-1/2         [C, Dv]

One program per (chunk, head, Dv block) computes a 64-row tile from rows ``0 .. n-1`` of its chunk (rows
``>= n`` load as zeros and are not stored): ``n = C`` in the trainer and in prefill; in decode, ``n = t + 1``
for the token at position ``t`` of its open chunk, with ``W``, ``U0`` from the same prep over the open chunk
(rows after ``t`` zero). Row ``t`` then has the trainer's bits if three facts of the GPU's dots hold: an
element of a tile product does not depend on the left operand's other rows, nor on the right operand's
other columns (``Q K^T``'s column s and the prep's ``K K^T`` take later rows of K as other columns), and
exact-zero products (the masked ``P[t, s > t]`` against rows that are zero in decode and real in the
trainer) change no bit; the prep's row ``t`` depends on rows ``<= t`` only (``A`` is strictly lower
triangular, its block inverse a product of such matrices). ``tests/test_kernels_triton.py`` probes the three
facts on the GPU (64- and 16-row tiles, 4 and 8 warps), and
:func:`isoexec.bench.cpr_gpu.cpr_chunkwise_table` checks the rows and times this path against the scan.
These are new bits (not the recurrent scan's): adopting it needs a contract constant
(``in_chunk: chunkwise``) and the gates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_out(q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, e_ptr, o_ptr, meta_ptr, H, scale,
               C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    j = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    row0 = tl.load(meta_ptr + j * 3 + 0).to(tl.int64)
    n = tl.load(meta_ptr + j * 3 + 1)
    src = tl.load(meta_ptr + j * 3 + 2)
    tc = tl.arange(0, C)
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    valid = tc < n
    rows = (row0 + tc) * H + h
    q = tl.load(q_ptr + rows[:, None] * DK + dk[None, :], mask=valid[:, None], other=0.0)
    k = tl.load(k_ptr + rows[:, None] * DK + dk[None, :], mask=valid[:, None], other=0.0)
    G = tl.cumsum(tl.load(g_ptr + rows, mask=valid, other=0.0), axis=0)
    S = tl.load(e_ptr + (tl.maximum(src, 0).to(tl.int64) * H + h) * DK * DV + dk[:, None] * DV + cols[None, :],
                mask=src >= 0, other=0.0)
    base = (j * H + h).to(tl.int64) * C + tc
    W = tl.load(w_ptr + base[:, None] * DK + dk[None, :], mask=valid[:, None], other=0.0)
    U = tl.load(u_ptr + base[:, None] * DV + cols[None, :], mask=valid[:, None], other=0.0)
    U = U - tl.dot(W, S, input_precision=PREC)
    causal = tc[:, None] >= tc[None, :]
    P = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PREC) *
                 tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
    o = (tl.dot(q * tl.exp(G)[:, None], S, input_precision=PREC) + tl.dot(P, U, input_precision=PREC)) * scale
    tl.store(o_ptr + rows[:, None] * DV + cols[None, :], o, mask=valid[:, None])


def chunk_out(q, k, g, W, U0, E, meta, out, C: int, block_v: int, num_warps: int, precision: str) -> torch.Tensor:
    """Launch :func:`_chunk_out` over ``meta``'s chunks and write their rows of ``out``.

    Args:
        q, k: ``[N, H, Dk]`` fp32 (l2-normalised; the output is scaled by ``Dk**-0.5`` here). g: ``[N, H]`` fp32
            log decay.
        W, U0: ``[n_chunks, H, C, Dk]`` / ``[n_chunks, H, C, Dv]`` fp32, the prep's outputs in ``meta``'s chunk order.
        E: ``[n_states, H, Dk, Dv]`` fp32 entry states. meta: ``[n_chunks, 3]`` int32 on the device: the chunk's
            first input row, its valid rows ``n`` (1..C) and its entry state's index in ``E`` (-1: zero state).
        out: ``[N, H, Dv]`` fp32; rows outside the chunks' valid rows are left as they are.
        C: chunk size (a power of two >= 16). block_v: Dv columns per program (divides Dv). num_warps,
            precision: the launch's warps and the dots' ``input_precision`` ("tf32" or "ieee").

    Returns:
        ``out``.

    Raises:
        ValueError: ``block_v`` not dividing Dv, or ``meta`` not ``[n_chunks, 3]`` for W's chunks.
    """
    N, H, DK = k.shape
    DV = U0.shape[-1]
    if DV % block_v:
        raise ValueError(f"block_v {block_v}: must divide Dv = {DV}")
    if tuple(meta.shape) != (W.shape[0], 3):
        raise ValueError(f"meta shape {tuple(meta.shape)}: expected ({W.shape[0]}, 3), one row per chunk of W")
    if W.shape[0]:
        _chunk_out[(W.shape[0], H, DV // block_v)](q, k, g, W, U0, E, out, meta, H, DK ** -0.5, C=C, DK=DK, DV=DV,
                                                   BV=block_v, PREC=precision, num_warps=num_warps)
    return out


def _check_chunk_size(C: int) -> None:
    if C < 16 or C & (C - 1):
        raise ValueError(f"chunk size C={C}: must be a power of two >= 16 (the prep's 16-row blocks, the tile's rows)")


def _prep_and_chain(k, v, g, beta, prep_meta, chain_meta, n_states, C: int, cfg, entry=None):
    """Today's chunk prep and state chain (:mod:`isoexec.kernels.gdn.triton`) over ``prep_meta``'s chunks:
    ``(W, U0, E)``; ``entry`` ``[P, H, Dk, Dv]``: the states ``chain_meta``'s sources index (None: none)."""
    from isoexec.kernels.gdn.triton import _state_chain, chunk_prep

    N, H, DK = k.shape
    DV = v.shape[-1]
    f32 = dict(device=k.device, dtype=torch.float32)
    n = prep_meta.shape[0]
    dummy = torch.empty(1, **f32)
    W, KD = torch.empty((n, H, C, DK), **f32), torch.empty((n, H, C, DK), **f32)
    U0, dC = torch.empty((n, H, C, DV), **f32), torch.empty((n, H), **f32)
    E = torch.empty((max(n_states, 1), H, DK, DV), **f32)
    chunk_prep(n, H, (k, v, g, beta, dummy, dummy, dummy, dummy, prep_meta, W, U0, KD, dC), C, DK, DV, cfg)
    if chain_meta.shape[0]:
        _state_chain[(chain_meta.shape[0], H, DV // cfg.gdn_chain_bv)](
            entry if entry is not None else dummy, W, U0, KD, dC, E, chain_meta, H, C=C, DK=DK, DV=DV,
            BV=cfg.gdn_chain_bv, PREC=cfg.gdn_dot_precision, num_warps=cfg.gdn_chain_warps)
    return W, U0, E


def chunkwise_forward(q, k, v, g, beta, lengths: list[int], C: int, cfg, block_v: int = 64,
                      num_warps: int = 8) -> torch.Tensor:
    """The trainer forward (and prefill from a zero state) with the chunkwise in-chunk output.

    Args:
        q, k: ``[N, H, Dk]``, v: ``[N, H, Dv]``, g, beta: ``[N, H]``, all fp32 (as :func:`~isoexec.kernels.gdn.triton.cpr_gdn`).
        lengths: tokens per sequence (sum N), each a multiple of C (this candidate has no partial last chunk yet).
        C: chunk size. cfg: ``isoexec.config.TritonSection`` (the prep's and chain's launch constants, dot precision).
        block_v, num_warps: :func:`chunk_out`'s launch.

    Returns:
        o ``[N, H, Dv]`` fp32.

    Raises:
        ValueError: C not a power of two >= 16, a length that is not a positive multiple of C, or lengths that do
            not sum to the inputs' N rows.
    """
    _check_chunk_size(C)
    if sum(lengths) != k.shape[0] or any(x.shape[0] != k.shape[0] for x in (q, v, g, beta)):
        raise ValueError(f"lengths sum to {sum(lengths)}; q, k, v, g, beta have {[x.shape[0] for x in (q, k, v, g, beta)]} "
                         "rows: expected the same N everywhere")
    bad = [n for n in lengths if n <= 0 or n % C]
    if bad:
        raise ValueError(f"length {bad[0]}: the chunkwise candidate needs whole chunks (positive multiples of C={C})")
    prep, chain, out_meta, row0, e0 = [], [], [], 0, 0
    for n in lengths:
        chain += [len(prep) // 3, n // C, -1, e0]
        for c in range(n // C):
            prep += [row0 + c * C, 0, 0]
            out_meta += [row0 + c * C, C, e0 + c - 1 if c else -1]
        row0, e0 = row0 + n, e0 + n // C
    dev = k.device
    as_meta = lambda m, w: torch.tensor(m, dtype=torch.int32).view(-1, w).to(dev)  # noqa: E731
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    W, U0, E = _prep_and_chain(k, v, g, beta, as_meta(prep, 3), as_meta(chain, 4), e0, C, cfg)
    o = torch.empty_like(v)
    return chunk_out(q, k, g, W, U0, E, as_meta(out_meta, 3), o, C, block_v, num_warps, cfg.gdn_dot_precision)


def open_chunk_rows(q, k, v, g, beta, entries, ts: list[int], C: int, cfg, block_v: int = 64, num_warps: int = 8):
    """Decode's form, for B sequences at once: the output of the token at position ``ts[b]`` of sequence b's open
    chunk, from that chunk's rows ``0 .. ts[b]`` only (later rows are zeroed before the prep) and its entry state.

    Args:
        q, k: ``[B * C, H, Dk]``, v: ``[B * C, H, Dv]``, g, beta: ``[B * C, H]``: the chunks' rows, chunk b at rows
            ``b*C .. b*C + C-1`` (rows after ``ts[b]`` are ignored, whatever they hold).
        entries: ``[B, H, Dk, Dv]`` fp32 entry states. ts: B positions in 0 .. C-1. Others as :func:`chunkwise_forward`.

    Returns:
        ``[B, H, Dv]`` fp32: row ``ts[b]`` of chunk b's output.

    Raises:
        ValueError: C not a power of two >= 16, no position, a position outside 0 .. C-1, or not B chunks of C rows.
    """
    _check_chunk_size(C)
    B = len(ts)
    if B == 0 or any(x.shape[0] != B * C for x in (q, k, v, g, beta)) or entries.shape[0] != B or \
            any(not 0 <= t < C for t in ts):
        raise ValueError(f"positions {ts} with q, k, v, g, beta of {[x.shape[0] for x in (q, k, v, g, beta)]} rows and "
                         f"{entries.shape[0]} entry states: expected at least one position, each in 0 .. {C - 1}, "
                         f"{B} chunks of C={C} rows in every input and as many states")
    dev = k.device
    t_dev = torch.tensor(ts, device=dev)
    keep = (torch.arange(C, device=dev)[None, :] <= t_dev[:, None]).reshape(B * C)
    # selected, not multiplied: a stale buffer row holding inf or NaN must become an exact zero too
    q, k, v = (torch.where(keep[:, None, None], x.float(), 0.0) for x in (q, k, v))
    g, beta = (torch.where(keep[:, None], x.float(), 0.0) for x in (g, beta))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    prep = torch.tensor([[b * C, 0, 0] for b in range(B)], dtype=torch.int32, device=dev)
    W, U0, _ = _prep_and_chain(k, v, g, beta, prep, torch.empty((0, 4), dtype=torch.int32, device=dev), 0, C, cfg)
    o = torch.zeros_like(v)
    meta = torch.tensor([[b * C, t + 1, b] for b, t in enumerate(ts)], dtype=torch.int32, device=dev)
    chunk_out(q, k, g, W, U0, entries.float().contiguous(), meta, o, C, block_v, num_warps, cfg.gdn_dot_precision)
    return o.view(B, C, *o.shape[1:])[torch.arange(B, device=dev), t_dev]
