"""Gradient of the CPR Gated DeltaNet (region ``gdn.core``, ``trainer_fwd``) in Triton, chunkwise.

The trainer's forward is the CPR scan of :mod:`isoexec.kernels.gdn.triton` (bitwise with prefill and
decode); its backward need not be bitwise (docs/design.md, The unified model), so it is the exact gradient of the same function
computed chunkwise with tensor-core dots, as in the chunked WY/UT form of Yang et al. ("Parallelizing
Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024; "Gated Delta Networks",
ICLR 2025). Per chunk of C tokens, head h, with ``Q`` already scaled by ``Dk**-0.5``, ``G = cumsum(g)``
(within the chunk), ``gam = exp(G)``, ``Gam[t, s] = exp(G_t - G_s)``, entry state ``S0`` and exit
state ``S1``::

    A  = strict_lower(beta_t (k_t . k_s) Gam)        T = (I + A)^-1
    X  = beta (V - gam (K S0))                         U = T X      (the delta-rule corrections u_t)
    P  = lower_incl((Q K^T) Gam)                       O = (gam Q) S0 + P U
    KD = K exp(G_C - G)                                S1 = exp(G_C) S0 + KD^T U

Backward, with ``dO`` and the gradient ``dS1`` of the exit state (zero after a sequence's last chunk)::

    dU = P^T dO + KD dS1        dX = T^T dU        dA = -strict_lower(dX U^T)
    dS0 = exp(G_C) dS1 + (gam Q)^T dO - W^T dU      with W = T (beta gam K)   (the reverse state chain)

and the leaf gradients of q, k, v, beta, g through these products (the module's kernels spell them out;
``dg`` is the reverse cumulative sum of ``dG`` within the chunk).

Kernels (fp32 storage throughout; ``prec`` for the dots, ``tf32x3`` for the inverse):

* ``_bwd_prep`` (chunk, head): ``T`` (16x16 diagonal blocks as ``(I - D)(I + D^2)(I + D^4)(I + D^8)``,
  then the block-lower part as ``(I - N)(I + N^2)...`` with ``N = T_D L``, both exact for nilpotent
  factors), ``W``, ``U0 = T beta V``, ``KD``, ``gam Q``, ``P``, ``G``, ``exp(G_C)``.
* the forward state chain of :mod:`isoexec.kernels.gdn.triton` (``_state_chain``) recomputes each
  chunk's exit state from ``W``, ``U0``, ``KD``.
* ``_bwd_chain`` (sequence, head, Dv block): ``dS`` from the last chunk to the first.
* ``_bwd_dv`` (chunk, head, Dv block): ``U``, ``dX``, ``dv`` and per-block row sums.
* ``_bwd_dqk`` (chunk, head): ``dq``, ``dk``, ``dbeta``, ``dg``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from isoexec.kernels.gdn.triton import _state_chain, device_meta


@triton.jit
def _rows(ptr, row0, n, h, H, D: tl.constexpr, C: tl.constexpr):
    """Rows ``row0 .. row0 + n`` of a ``[N, H, D]`` tensor as a ``[C, D]`` tile (zeros past ``n``)."""
    t = tl.arange(0, C)
    d = tl.arange(0, D)
    r = (row0 + t).to(tl.int64)
    return tl.load(ptr + (r * H + h)[:, None] * D + d[None, :], mask=(t < n)[:, None], other=0.0)


@triton.jit
def _scalars(ptr, row0, n, h, H, C: tl.constexpr):
    """``[C]`` entries of a ``[N, H]`` tensor (zeros past ``n``)."""
    t = tl.arange(0, C)
    return tl.load(ptr + (row0 + t).to(tl.int64) * H + h, mask=t < n, other=0.0)


@triton.jit
def _tile(ptr, j, h, H, D: tl.constexpr, C: tl.constexpr):
    """``[C, D]`` tile of a chunk-major ``[NC, H, C, D]`` buffer."""
    t = tl.arange(0, C)
    d = tl.arange(0, D)
    return tl.load(ptr + ((j * H + h).to(tl.int64) * C + t)[:, None] * D + d[None, :])


@triton.jit
def _put(ptr, x, j, h, H, D: tl.constexpr, C: tl.constexpr):
    t = tl.arange(0, C)
    d = tl.arange(0, D)
    tl.store(ptr + ((j * H + h).to(tl.int64) * C + t)[:, None] * D + d[None, :], x)


@triton.jit
def _state_blocks(e_ptr, dse_ptr, src, jh, h, H, cols, DK: tl.constexpr, DV: tl.constexpr):
    """Columns ``cols`` of a chunk's entry state (``E[src]``, zeros when ``src < 0``) and of its exit-state
    gradient (``dSe[jh]``), each ``[DK, len(cols)]``."""
    s_offs = tl.arange(0, DK)[:, None] * DV + cols[None, :]
    S0 = tl.load(e_ptr + (tl.maximum(src, 0).to(tl.int64) * H + h) * DK * DV + s_offs, mask=src >= 0, other=0.0)
    return S0, tl.load(dse_ptr + jh * DK * DV + s_offs)


@triton.jit
def _gates(g, C: tl.constexpr):
    """``G = cumsum(g)``, ``exp(G)``, ``Gam`` (lower incl., zero above) and ``G_C`` of one chunk."""
    t = tl.arange(0, C)
    G = tl.cumsum(g, axis=0)
    gl = tl.sum(g, axis=0)
    incl = t[:, None] >= t[None, :]
    gam_m = tl.where(incl, tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    return G, tl.exp(G), gam_m, gl


@triton.jit
def _bwd_prep(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, cmeta_ptr, t_ptr, w_ptr, u0_ptr, kd_ptr, qg_ptr, p_ptr, gc_ptr,
              dc_ptr, H, scale, C: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, LOG2_NB: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr, TPREC: tl.constexpr):
    j = tl.program_id(0)
    h = tl.program_id(1)
    row0 = tl.load(cmeta_ptr + j * 3 + 0)
    n = tl.load(cmeta_ptr + j * 3 + 1)
    t = tl.arange(0, C)
    g = _scalars(g_ptr, row0, n, h, H, C)
    beta = _scalars(b_ptr, row0, n, h, H, C)
    G, gam, gam_m, gl = _gates(g, C)
    K = _rows(k_ptr, row0, n, h, H, DK, C)
    Q = _rows(q_ptr, row0, n, h, H, DK, C) * scale
    _put(p_ptr, tl.dot(Q, tl.trans(K), input_precision=PREC) * gam_m, j, h, H, C, C)
    _put(qg_ptr, Q * gam[:, None], j, h, H, DK, C)
    _put(kd_ptr, K * tl.exp(gl - G)[:, None], j, h, H, DK, C)
    _put(w_ptr, K * (beta * gam)[:, None], j, h, H, DK, C)  # beta gam K, replaced by W = T (beta gam K) below
    strict = t[:, None] > t[None, :]
    A = tl.where(strict, beta[:, None] * tl.dot(K, tl.trans(K), input_precision=PREC) * gam_m, 0.0)
    # T = (I + A)^-1: block-diagonal part D (BT x BT blocks), then the block-lower rest L
    eye = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
    blk = (t[:, None] // BT) == (t[None, :] // BT)
    D = tl.where(blk, A, 0.0)
    pw = D
    TD = eye - D
    for _ in tl.static_range(LOG2_BT - 1):
        pw = tl.dot(pw, pw, input_precision=TPREC)
        TD = tl.dot(TD, eye + pw, input_precision=TPREC)
    Tm = TD
    if LOG2_NB > 0:
        N = tl.dot(TD, tl.where(blk, 0.0, A), input_precision=TPREC)
        pw = N
        Tn = eye - N
        for _ in tl.static_range(LOG2_NB - 1):
            pw = tl.dot(pw, pw, input_precision=TPREC)
            Tn = tl.dot(Tn, eye + pw, input_precision=TPREC)
        Tm = tl.dot(Tn, TD, input_precision=TPREC)
    _put(t_ptr, Tm, j, h, H, C, C)
    tl.debug_barrier()  # every thread's beta gam K rows are stored before they are read back
    _put(w_ptr, tl.dot(Tm, _tile(w_ptr, j, h, H, DK, C), input_precision=PREC), j, h, H, DK, C)
    V = _rows(v_ptr, row0, n, h, H, DV, C)
    _put(u0_ptr, tl.dot(Tm, V * beta[:, None], input_precision=PREC), j, h, H, DV, C)
    tl.store(gc_ptr + (j * H + h).to(tl.int64) * C + t, G)
    tl.store(dc_ptr + j * H + h, tl.exp(gl))


@triton.jit
def _bwd_chain(qg_ptr, w_ptr, kd_ptr, p_ptr, dc_ptr, do_ptr, cmeta_ptr, smeta_ptr, dse_ptr, H,
               C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    s_id = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    chunk0 = tl.load(smeta_ptr + s_id * 2 + 0)
    nch = tl.load(smeta_ptr + s_id * 2 + 1)
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    t = tl.arange(0, C)
    s_offs = dk[:, None] * DV + cols[None, :]
    dS = tl.zeros((DK, BV), dtype=tl.float32)
    for i in range(0, nch):
        j = chunk0 + nch - 1 - i
        jh = (j * H + h).to(tl.int64)
        tl.store(dse_ptr + jh * DK * DV + s_offs, dS)
        row0 = tl.load(cmeta_ptr + j * 3 + 0)
        n = tl.load(cmeta_ptr + j * 3 + 1)
        dO = tl.load(do_ptr + ((row0 + t).to(tl.int64) * H + h)[:, None] * DV + cols[None, :], mask=(t < n)[:, None],
                     other=0.0)
        Qg = _tile(qg_ptr, j, h, H, DK, C)
        W = _tile(w_ptr, j, h, H, DK, C)
        KD = _tile(kd_ptr, j, h, H, DK, C)
        P = _tile(p_ptr, j, h, H, C, C)
        dc = tl.load(dc_ptr + jh)
        dU = tl.dot(tl.trans(P), dO, input_precision=PREC) + tl.dot(KD, dS, input_precision=PREC)
        dS = dS * dc + tl.dot(tl.trans(Qg), dO, input_precision=PREC) - tl.dot(tl.trans(W), dU, input_precision=PREC)


@triton.jit
def _bwd_dv(k_ptr, v_ptr, b_ptr, do_ptr, cmeta_ptr, t_ptr, w_ptr, u0_ptr, kd_ptr, p_ptr, gc_ptr, e_ptr,
            dse_ptr, u_ptr, dx_ptr, dv_ptr, part_ptr, H, NVB,
            C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Per Dv block: ``U``, ``dX``, ``dv`` and the block's share of the row sums over Dv that ``dbeta``
    and ``dG`` need (``<dX, V - gam K S0>``, ``<-beta gam dX, K S0>``, ``<U, KD dS1>``, ``<dS1, S0>``), so
    that ``_bwd_dqk`` keeps two ``[C, Dk]`` accumulators."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    row0 = tl.load(cmeta_ptr + j * 3 + 0)
    n = tl.load(cmeta_ptr + j * 3 + 1)
    src = tl.load(cmeta_ptr + j * 3 + 2)
    t = tl.arange(0, C)
    cols = vb * BV + tl.arange(0, BV)
    jh = (j * H + h).to(tl.int64)
    S0, dS1 = _state_blocks(e_ptr, dse_ptr, src, jh, h, H, cols, DK, DV)
    rmask = (t < n)[:, None]
    r = ((row0 + t).to(tl.int64) * H + h)[:, None] * DV + cols[None, :]
    dO = tl.load(do_ptr + r, mask=rmask, other=0.0)
    ct = (jh * C + t)[:, None] * DV + cols[None, :]
    G = tl.load(gc_ptr + jh * C + t)
    gam = tl.exp(G)
    beta = _scalars(b_ptr, row0, n, h, H, C)
    U = tl.load(u0_ptr + ct) - tl.dot(_tile(w_ptr, j, h, H, DK, C), S0, input_precision=PREC)
    KDdS1 = tl.dot(_tile(kd_ptr, j, h, H, DK, C), dS1, input_precision=PREC)
    dX = tl.dot(tl.trans(_tile(t_ptr, j, h, H, C, C)),
                tl.dot(tl.trans(_tile(p_ptr, j, h, H, C, C)), dO, input_precision=PREC) + KDdS1,
                input_precision=PREC)
    tl.store(u_ptr + ct, U)
    tl.store(dx_ptr + ct, dX)
    tl.store(dv_ptr + r, dX * beta[:, None], mask=rmask)
    KS0 = tl.dot(_rows(k_ptr, row0, n, h, H, DK, C), S0, input_precision=PREC)
    Vb = tl.load(v_ptr + r, mask=rmask, other=0.0)
    pb = tl.sum(dX * (Vb - gam[:, None] * KS0), axis=1)
    rkd = tl.sum(U * KDdS1, axis=1)
    pg = -beta * gam * tl.sum(dX * KS0, axis=1) - rkd
    pc = tl.sum(rkd, axis=0) + tl.sum(tl.sum(dS1 * S0, axis=1), axis=0) * tl.exp(tl.sum(tl.where(t == C - 1, G, 0.0)))
    base = (jh * NVB + vb) * (3 * C)
    tl.store(part_ptr + base + t, pb)
    tl.store(part_ptr + base + C + t, pg)
    tl.store(part_ptr + base + 2 * C + t, tl.where(t == 0, pc, 0.0))


@triton.jit
def _bwd_dqk(q_ptr, k_ptr, b_ptr, do_ptr, cmeta_ptr, gc_ptr, e_ptr, dse_ptr, u_ptr, dx_ptr, part_ptr,
             dq_ptr, dk_ptr, db_ptr, dg_ptr, H, NVB, scale,
             C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """``dq``, ``dk``, ``dbeta``, ``dg`` of one chunk: the Dv-summed products (row scales folded into the
    dot operands), then the ``[C, C]`` terms through ``P`` and ``A``, then ``dg`` = reverse cumsum of ``dG``."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    row0 = tl.load(cmeta_ptr + j * 3 + 0)
    n = tl.load(cmeta_ptr + j * 3 + 1)
    src = tl.load(cmeta_ptr + j * 3 + 2)
    t = tl.arange(0, C)
    dk = tl.arange(0, DK)
    jh = (j * H + h).to(tl.int64)
    rmask = (t < n)[:, None]
    beta = _scalars(b_ptr, row0, n, h, H, C)
    G = tl.load(gc_ptr + jh * C + t)
    gam = tl.exp(G)
    gl = tl.sum(tl.where(t == C - 1, G, 0.0), axis=0)
    kd = tl.exp(gl - G)
    dQ = tl.zeros((C, DK), dtype=tl.float32)  # gam * (dO S0^T)
    dK = tl.zeros((C, DK), dtype=tl.float32)  # kd * (U dS1^T) - beta gam * (dX S0^T)
    dP = tl.zeros((C, C), dtype=tl.float32)
    dA = tl.zeros((C, C), dtype=tl.float32)
    db = tl.zeros((C,), dtype=tl.float32)
    dG = tl.zeros((C,), dtype=tl.float32)
    for vb in range(0, NVB):
        cols = vb * BV + tl.arange(0, BV)
        S0, dS1 = _state_blocks(e_ptr, dse_ptr, src, jh, h, H, cols, DK, DV)
        dO = tl.load(do_ptr + ((row0 + t).to(tl.int64) * H + h)[:, None] * DV + cols[None, :], mask=rmask, other=0.0)
        ct = (jh * C + t)[:, None] * DV + cols[None, :]
        U = tl.load(u_ptr + ct)
        dX = tl.load(dx_ptr + ct)
        dQ += tl.dot(dO * gam[:, None], tl.trans(S0), input_precision=PREC)
        dK += tl.dot(U * kd[:, None], tl.trans(dS1), input_precision=PREC)
        dK += tl.dot(dX * (-beta * gam)[:, None], tl.trans(S0), input_precision=PREC)
        dP += tl.dot(dO, tl.trans(U), input_precision=PREC)
        dA -= tl.dot(dX, tl.trans(U), input_precision=PREC)
        base = (jh * NVB + vb) * (3 * C)
        db += tl.load(part_ptr + base + t)
        dG += tl.load(part_ptr + base + C + t)
        dG += tl.where(t == C - 1, tl.sum(tl.load(part_ptr + base + 2 * C + t), axis=0), 0.0)
    incl = t[:, None] >= t[None, :]
    strict = t[:, None] > t[None, :]
    gam_m = tl.where(incl, tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    K = _rows(k_ptr, row0, n, h, H, DK, C)
    KKg = tl.dot(K, tl.trans(K), input_precision=PREC) * gam_m
    dA = tl.where(strict, dA, 0.0)
    db += tl.sum(dA * KKg, axis=1)
    R = dA * beta[:, None] * KKg  # dA * A
    Q = _rows(q_ptr, row0, n, h, H, DK, C) * scale
    dP = tl.where(incl, dP, 0.0)
    Z = dP * (tl.dot(Q, tl.trans(K), input_precision=PREC) * gam_m) + R
    dG += tl.sum(Z, axis=1) - tl.sum(Z, axis=0) + tl.sum(dQ * Q, axis=1)  # the last: <dO, gam Q S0> per row
    dg = tl.cumsum(dG, axis=0, reverse=True)
    M = dP * gam_m
    R = dA * beta[:, None] * gam_m
    dQ += tl.dot(M, K, input_precision=PREC)
    dK += tl.dot(tl.trans(M), Q, input_precision=PREC) + tl.dot(R + tl.trans(R), K, input_precision=PREC)
    r = (row0 + t).to(tl.int64) * H + h
    tl.store(dq_ptr + r[:, None] * DK + dk[None, :], dQ * scale, mask=rmask)
    tl.store(dk_ptr + r[:, None] * DK + dk[None, :], dK, mask=rmask)
    tl.store(db_ptr + r, db, mask=t < n)
    tl.store(dg_ptr + r, dg, mask=t < n)


def cpr_gdn_backward(q, k, v, g, beta, do, lengths: list[int], chunk_size: int, cfg):
    """Gradient of :func:`isoexec.kernels.gdn.triton.cpr_gdn` (trainer case: every sequence from a zero state).

    Args:
        q, k: ``[N, H, Dk]``; v, do: ``[N, H, Dv]``; g, beta: ``[N, H]`` (as given to the forward; q unscaled).
        lengths: tokens per sequence (sum N). chunk_size: C (a power of two, at least 16).
        cfg: ``isoexec.config.TritonSection`` (``gdn_dot_precision``; ``gdn_chain_bv`` / ``gdn_chain_warps``
            for the recomputed forward state chain; ``gdn_bwd_prep_warps`` for the prep; ``gdn_bwd_bv`` /
            ``gdn_bwd_warps`` for the rest).

    Returns:
        ``(dq, dk, dv, dg, dbeta)``, fp32, shaped as the inputs. Not bitwise across layouts (a
        backward need not be); exact up to fp32/tf32 rounding (checked against an fp64 reference).

    Raises:
        ValueError: ``chunk_size`` not a power of two >= 16, or ``lengths`` not summing to N.
        RuntimeError: under CUDA-graph capture, ``lengths`` and ``chunk_size`` that no call before the capture
            ran (:func:`isoexec.kernels.gdn.triton.device_meta`).
    """
    C = chunk_size
    if C < 16 or C & (C - 1):
        raise ValueError(f"the Triton GDN backward needs C a power of two >= 16, got C={C}")
    N, H, DK = k.shape
    DV = v.shape[-1]
    if sum(lengths) != N:
        raise ValueError(f"lengths sum to {sum(lengths)}, the inputs have N={N} rows")
    dev = k.device
    q, k, v, do = (x.float().contiguous() for x in (q, k, v, do))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    cmeta, smeta, row0 = [], [], 0
    for n in lengths:
        nch = -(-n // C)
        smeta += [len(cmeta) // 3, nch]
        for c in range(nch):
            j = len(cmeta) // 3
            cmeta += [row0 + c * C, min(C, n - c * C), j - 1 if c else -1]
        row0 += n
    NC, S = len(cmeta) // 3, len(smeta) // 2
    f32 = dict(device=dev, dtype=torch.float32)
    dq, dk_, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dg, db = torch.zeros_like(g), torch.zeros_like(beta)
    if NC == 0:
        return dq, dk_, dv, dg, db
    chain = [x for i in range(S) for x in (smeta[2 * i], smeta[2 * i + 1] - 1, -1, smeta[2 * i])]
    meta = device_meta(cmeta + smeta + chain, torch.int32, dev)
    m_c, m_s, m_chain = meta[: 3 * NC], meta[3 * NC : 3 * NC + 2 * S], meta[3 * NC + 2 * S :]
    bt = min(C, 16)
    T, P = torch.empty((NC, H, C, C), **f32), torch.empty((NC, H, C, C), **f32)
    W, KD, Qg = (torch.empty((NC, H, C, DK), **f32) for _ in range(3))
    U0 = torch.empty((NC, H, C, DV), **f32)
    Gc, dC = torch.empty((NC, H, C), **f32), torch.empty((NC, H), **f32)
    scale = DK ** -0.5
    prec = cfg.gdn_dot_precision
    _bwd_prep[(NC, H)](q, k, v, g, beta, m_c, T, W, U0, KD, Qg, P, Gc, dC, H, scale, C=C, BT=bt,
                       LOG2_BT=bt.bit_length() - 1, LOG2_NB=(C // bt).bit_length() - 1, DK=DK, DV=DV, PREC=prec, TPREC="tf32x3",
                       num_warps=cfg.gdn_bwd_prep_warps)
    E = torch.empty((NC, H, DK, DV), **f32)  # exit state of every chunk but each sequence's last
    _state_chain[(S, H, DV // cfg.gdn_chain_bv)](E, W, U0, KD, dC, E, m_chain, H, C=C, DK=DK, DV=DV,
                                                 BV=cfg.gdn_chain_bv, PREC=prec, num_warps=cfg.gdn_chain_warps)
    bv = min(cfg.gdn_bwd_bv, DV)
    nvb = DV // bv
    dSe = torch.empty((NC, H, DK, DV), **f32)  # gradient of every chunk's exit state
    _bwd_chain[(S, H, nvb)](Qg, W, KD, P, dC, do, m_c, m_s, dSe, H, C=C, DK=DK, DV=DV, BV=bv, PREC=prec,
                            num_warps=cfg.gdn_bwd_warps, num_stages=1)
    U, dX = torch.empty((NC, H, C, DV), **f32), torch.empty((NC, H, C, DV), **f32)
    part = torch.empty((NC, H, nvb, 3 * C), **f32)
    _bwd_dv[(NC, H, nvb)](k, v, beta, do, m_c, T, W, U0, KD, P, Gc, E, dSe, U, dX, dv, part, H, nvb,
                          C=C, DK=DK, DV=DV, BV=bv, PREC=prec, num_warps=cfg.gdn_bwd_warps)
    _bwd_dqk[(NC, H)](q, k, beta, do, m_c, Gc, E, dSe, U, dX, part, dq, dk_, db, dg, H, nvb, scale,
                      C=C, DK=DK, DV=DV, BV=bv, PREC=prec, num_warps=cfg.gdn_bwd_warps)
    return dq, dk_, dv, dg, db


class CPRTritonTrainerFunction(torch.autograd.Function):
    """``trainer_fwd`` GDN on CUDA: the CPR bits forward (:func:`isoexec.kernels.gdn.triton.cpr_gdn`
    from zero states, ``keep_state=False``), :func:`cpr_gdn_backward` backward.

    Inputs: q, k ``[N, H, Dk]``, v ``[N, H, Dv]``, g, beta ``[N, H]``; ``lengths`` per sequence;
    ``chunk_size`` C; ``cfg`` the ``TritonSection``. Returns o ``[N, H, Dv]`` fp32. Forward and backward can
    be captured in one CUDA graph once a call with the same ``lengths`` and C ran before the capture.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, lengths: list[int], chunk_size: int, cfg):  # noqa: D102
        from isoexec.kernels.gdn.triton import cpr_gdn

        ctx.save_for_backward(q, k, v, g, beta)
        ctx.lengths, ctx.chunk_size, ctx.cfg = lengths, chunk_size, cfg
        return cpr_gdn(q, k, v, g, beta, lengths, [None] * len(lengths), chunk_size, cfg, keep_state=False)[0]

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        q, k, v, g, beta = ctx.saved_tensors
        grads = cpr_gdn_backward(q, k, v, g, beta, do, ctx.lengths, ctx.chunk_size, ctx.cfg)
        return *(gr.to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta))), None, None, None
