"""Chunkwise-parallel recurrent (CPR) Gated DeltaNet: one set of bits for trainer, prefill and decode.

Algorithm (docs/design.md, CPR Gated DeltaNet), chunk size C from the contract:

1. **State pass** (fp32 chain): the state entering chunk c+1 is ``F(S_c, chunk c)``, computed in
   the chunkwise WY/UT form (Yang et al., "Parallelizing Linear Transformers with the Delta Rule
   over Sequence Length", NeurIPS 2024; Gated DeltaNet, ICLR 2025)::

       G   = cumsum(g)                                  (within the chunk)
       A   = strict_lower(beta_i (k_i . k_j) exp(G_i - G_j))
       T   = (I + A)^-1                                  (forward substitution, fixed order)
       U   = T (beta * (V - exp(G) * (K S_c)))
       S_{c+1} = exp(G_C) S_c + (K * exp(G_C - G))^T U

2. **In-chunk scan**: every chunk is scanned token by token from its entry state with the plain
   recurrence (see ``reference.py``), in the C kernel ``cpr_scan.c`` (one pass over a state per
   token, fixed fp32 operation order, no FMA).

Decode runs the same per-token recurrence, buffers the open chunk's (k, v, g, beta) and, when the
chunk completes, re-runs ``F`` over the buffer from the stored fp32 entry state and replaces the
running state with the result (resync). So every case sees the same state at each chunk boundary
and the same in-chunk scan. Every state-pass product is a ``torch.bmm`` whose per-matrix bits do not
depend on the batch (see ``isoexec/kernels/primitives.py``); everything else is elementwise.

Backward (``trainer_fwd``) is not bitwise: :class:`CPRTrainerFunction` runs the CPR forward and the
gradient of the same recurrence in the C kernel ``cpr_scan_backward.c``.

The gating region (``gdn.gating``, :func:`iso_gating`) lives here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from isoexec.kernels.native_build import c_ptr, kernel_library
from isoexec.kernels.primitives import sigmoid, softplus


@dataclass
class CPRState:
    """Per-sequence CPR state of one GDN layer (all fp32).

    A step consumes the states it is given and returns new ones: a decode step advances a running
    state it owns in place (the Triton set's pool slots work the same way), so a state passed to
    :func:`cpr_gdn` must not be passed again (refused with ``ValueError``).

    Attributes:
        chunk_size: the chunk size C that built this state (a state refuses to continue under another C).
        entry: ``[H, Dk, Dv]`` state entering the open chunk (output of the state pass; never written).
        running: ``[H, Dk, Dv]`` state after the last consumed token.
        pending: the raw inputs of the open chunk, as the pieces they arrived in: each
            ``(rows, a, b)``, rows ``a:b`` of a step's packed ``[N, H*Dk + H*Dv + 2H]`` inputs
            (k | v | g | beta); ``n_open`` tokens in all (consumed tokens mod C). Kept as references
            so that a decode step appends without copying.
        n_open: tokens in the open chunk.
        owns_running: ``running`` is this sequence's own buffer (written by the scan), not a view
            shared with ``entry`` (after a resync) or with other states, so the next step may update
            it in place.
        consumed: set when a step has taken this state.
    """

    chunk_size: int
    entry: torch.Tensor
    running: torch.Tensor
    pending: tuple[tuple[torch.Tensor, int, int], ...] = ()
    n_open: int = 0
    owns_running: bool = False
    consumed: bool = False

    @classmethod
    def zeros(cls, chunk_size: int, h: int, dk: int, dv: int) -> "CPRState":
        z = torch.zeros(h, dk, dv, dtype=torch.float32)
        return cls(chunk_size, z, z)


def _unpack(rows: torch.Tensor, H: int, Dk: int, Dv: int):
    """(k ``[n, H, Dk]``, v ``[n, H, Dv]``, g ``[n, H]``, beta ``[n, H]``) of packed pending rows."""
    k, v, g, b = rows.split([H * Dk, H * Dv, H, H], dim=1)
    return k.reshape(-1, H, Dk), v.reshape(-1, H, Dv), g, b


def _ut_inverse(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-only quantities of the state pass for M chunks: ``T = (I + A)^-1`` and the cumulative decay.

    ``A`` is built here (torch elementwise and one ``bmm``); the forward substitution runs in the C kernel
    ``cpr_ut_inverse.c`` (fixed fp32 order, see its header).

    Args: k ``[M, C, Dk]``, g / beta ``[M, C]``. Returns (T ``[M, C, C]``, G ``[M, C]``).
    """
    import ctypes

    M, C, _ = k.shape
    G = torch.cumsum(g, dim=1)
    kk = torch.bmm(k, k.transpose(1, 2).contiguous())  # [M, C, C]
    diff = G[:, :, None] - G[:, None, :]
    lower = torch.ones(C, C, dtype=torch.bool).tril(-1)
    A = torch.where(lower, beta[:, :, None] * kk * torch.exp(torch.where(lower, diff, torch.zeros_like(diff))), 0.0)
    A = A.float().contiguous()
    T = torch.empty(M, C, C, dtype=torch.float32)
    kernel_library(__file__, "cpr_ut_inverse.c").isoexec_ut_inverse(c_ptr(A), c_ptr(T), ctypes.c_int64(M),
                                                                    ctypes.c_int64(C))
    return T, G


def _state_pass_step(S: torch.Tensor, k, v, beta, T, G) -> torch.Tensor:
    """``F(S, chunk)`` for M (chunk, head) pairs: S ``[M, Dk, Dv]``, k ``[M, C, Dk]``, v ``[M, C, Dv]``."""
    ks = torch.bmm(k, S)  # [M, C, Dv]
    B = beta[:, :, None] * (v - torch.exp(G)[:, :, None] * ks)
    U = torch.bmm(T, B)
    kd = (k * torch.exp(G[:, -1:] - G)[:, :, None]).transpose(1, 2).contiguous()  # [M, Dk, C]
    return torch.exp(G[:, -1])[:, None, None] * S + torch.bmm(kd, U)


def _scan(starts: list[torch.Tensor], dsts: list[torch.Tensor], q, k, v, g, beta, segments: list[tuple[int, int]]
          ) -> torch.Tensor:
    """Token-by-token recurrence of many segments, each from its own state, in the C kernel
    ``cpr_scan.c`` (one pass over a state per token; bits fixed by the kernel, see its header).

    Args:
        starts: per segment its start states ``[H, Dk, Dv]`` fp32 (contiguous).
        dsts: per segment where its final states go, ``[H, Dk, Dv]`` fp32 contiguous: its start states
            themselves (updated in place), a fresh buffer, or a scratch shared by segments whose final
            states are not needed.
        q, k: ``[N, H, Dk]`` fp32 (q already scaled). v: ``[N, H, Dv]``. g, beta: ``[N, H]``.
        segments: per segment (first token row, length).

    Returns:
        o ``[N, H, Dv]`` fp32 for the rows the segments cover (other rows 0).
    """
    import ctypes

    lib = kernel_library(__file__, "cpr_scan.c")
    N, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, beta = (x.float().contiguous() for x in (q, k, v, beta))
    decay = torch.exp(g.float()).contiguous()
    if not all(t.is_contiguous() for t in (*starts, *dsts)):
        raise ValueError("cpr_scan: start and final states must be contiguous [H, Dk, Dv] tensors")
    o = torch.zeros(N, H, Dv, dtype=torch.float32)
    meta = torch.tensor(segments, dtype=torch.int64).reshape(-1, 2).t().contiguous()
    src = torch.tensor([t.data_ptr() for t in starts], dtype=torch.int64)
    dst = torch.tensor([t.data_ptr() for t in dsts], dtype=torch.int64)
    work = torch.empty(Dv, dtype=torch.float32)
    lib.isoexec_cpr_scan(*map(c_ptr, (dst, src, q, k, v, decay, beta, o, meta[0], meta[1])),
                         *map(ctypes.c_int64, (len(segments), H, Dk, Dv)), c_ptr(work))
    return o


class CPRTrainerFunction(torch.autograd.Function):
    """``trainer_fwd`` GDN: the CPR bits forward (:func:`cpr_gdn` from zero states), the gradient of
    the same recurrence backward from ``cpr_scan_backward.c`` (reverse time, each chunk of C tokens
    recomputed from the state the forward's scan started it from, kept by the forward; not bitwise,
    checked against an fp64 reference in the tests).

    Inputs as :func:`cpr_gdn` (q, k ``[N, H, Dk]``, v ``[N, H, Dv]``, g, beta ``[N, H]``, fp32;
    ``lengths`` per sequence, each from a zero state). Returns o ``[N, H, Dv]`` fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, lengths: list[int], chunk_size: int):  # noqa: D102
        entries: list[torch.Tensor] = []
        out = cpr_gdn(q, k, v, g, beta, lengths, [None] * len(lengths), chunk_size, keep_state=False,
                      entries_out=entries)[0]
        ctx.save_for_backward(q, k, v, g, beta, *entries)
        ctx.lengths, ctx.chunk_size = lengths, chunk_size
        return out

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        q, k, v, g, beta, *entries = ctx.saved_tensors
        return (*cpr_gdn_backward(q, k, v, g, beta, ctx.lengths, entries, do, ctx.chunk_size)[:5], None, None)


class ChainLink(Protocol):
    """How the sequence pieces of one context-parallel rank exchange the GDN chain with its neighbours
    (:class:`CPRPieceFunction`; the Megatron trainer's implementation moves tensors with torch.distributed).

    A piece that does not start at position 0 continues from the previous rank's *chain state*: the fp32
    state entering the chunk holding the piece's first token, and the packed ``k | v | g | beta`` rows
    (:func:`_unpack`'s layout, fp32) of that chunk's tokens before the piece (``position mod C`` rows).
    Gradients travel back the same way: the gradient of that state and of those rows.
    """

    def recv_state(self, h: int, dk: int, dv: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per piece, None (it starts at position 0) or (state ``[h, dk, dv]``, rows ``[p, h*(dk+dv+2)]``)."""

    def send_state(self, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Per piece (state entering its open chunk, the open chunk's rows); sends those that the next rank continues."""

    def recv_grad(self, h: int, dk: int, dv: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per piece, None (no later rank continues it) or the gradients of what :meth:`send_state` sent."""

    def send_grad(self, grads: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Per piece, the gradients of what :meth:`recv_state` gave (None where it gave None)."""


class CPRPieceFunction(torch.autograd.Function):
    """The CPR GDN of sequence pieces held by one context-parallel rank: the same bits as :func:`cpr_gdn`
    over the whole sequences.

    Each piece is extended backwards to its chunk boundary with the rows received through ``link`` and
    run by :func:`cpr_gdn` from the received state, so every chunk is scanned from the same entry state,
    in the same segments, as on one rank; the state pass hands on the chain (``on_chain``) before the
    scans, so the ranks' scans overlap. The extension's outputs are dropped (its q rows are zeros).
    Backward: :func:`cpr_gdn_backward` over the extended pieces with the later rank's state gradient
    added at the piece's last chunk boundary; the gradients of the received state and rows go back.

    Inputs: q, k ``[N, H, Dk]``, v ``[N, H, Dv]``, g, beta ``[N, H]`` (fp32), ``lengths`` per piece
    (sum N), ``chunk_size`` C, ``link`` (:class:`ChainLink`). Returns o ``[N, H, Dv]`` fp32.

    Raises:
        ValueError: inputs not fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, lengths: list[int], chunk_size: int, link: ChainLink):  # noqa: D102
        if any(t.dtype != torch.float32 for t in (q, k, v, g, beta)):
            raise ValueError("CPRPieceFunction: q, k, v, g, beta must be fp32 (the gdn.core region's inputs)")
        N, H, Dk = k.shape
        Dv = v.shape[-1]
        C = chunk_size
        prev = link.recv_state(H, Dk, Dv)
        packed = torch.cat([k.reshape(N, -1), v.reshape(N, -1), g, beta], dim=1)
        pre = [0 if p is None else p[1].shape[0] for p in prev]
        parts, qparts, row0 = [], [], 0
        for n, p, rows in zip(lengths, prev, pre):
            if rows:
                parts.append(p[1])
                qparts.append(q.new_zeros(rows, H, Dk))
            parts.append(packed[row0 : row0 + n])
            qparts.append(q[row0 : row0 + n])
            row0 += n
        ext = torch.cat(parts)
        ek, ev, eg, eb = _unpack(ext, H, Dk, Dv)
        eq = torch.cat(qparts)
        elens = [p + n for p, n in zip(pre, lengths)]
        starts = [0]
        for n in elens[:-1]:
            starts.append(starts[-1] + n)

        def hand_on(open_entries: list[torch.Tensor]) -> None:
            link.send_state([(e, ext[a + (m // C) * C : a + m]) for e, a, m in zip(open_entries, starts, elens)])

        entries: list[torch.Tensor] = []
        states = [None if p is None else CPRState(C, p[0], p[0]) for p in prev]
        out = cpr_gdn(eq, ek, ev, eg, eb, elens, states, C, keep_state=False, entries_out=entries, on_chain=hand_on)[0]
        own = torch.cat([torch.arange(a + p, a + m) for a, p, m in zip(starts, pre, elens)])
        ctx.save_for_backward(eq, ek, ev, eg, eb, own, *entries)
        ctx.meta = (elens, pre, [p is not None for p in prev], starts, C, link)
        return out[own]

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        eq, ek, ev, eg, eb, own, *entries = ctx.saved_tensors
        elens, pre, continued, starts, C, link = ctx.meta
        H, Dk, Dv = ek.shape[1], ek.shape[2], ev.shape[2]
        later = link.recv_grad(H, Dk, Dv)
        edo = do.new_zeros(eq.shape[0], H, Dv).index_copy(0, own, do.float())
        dq, dk, dv, dg, db, heads = cpr_gdn_backward(eq, ek, ev, eg, eb, elens, entries, edo, C,
                                                     ds_tail=[None if x is None else x[0] for x in later],
                                                     want_head=continued)
        n = eq.shape[0]
        dpacked = torch.cat([dk.reshape(n, -1), dv.reshape(n, -1), dg, db], dim=1)
        for x, a, m in zip(later, starts, elens):
            if x is not None:  # the later rank's gradient of the rows handed on with the chain
                dpacked[a + (m // C) * C : a + m] += x[1]
        link.send_grad([(hd, dpacked[a : a + p]) if c else None for hd, a, p, c in zip(heads, starts, pre, continued)])
        dk, dv, dg, db = _unpack(dpacked[own], H, Dk, Dv)
        return dq[own], dk, dv, dg, db, None, None, None


def cpr_gdn_backward(q, k, v, g, beta, lengths: list[int], entries: list[torch.Tensor], do: torch.Tensor,
                     chunk_size: int, ds_tail: list[torch.Tensor | None] | None = None,
                     want_head: list[bool] | None = None):
    """Gradient of :func:`cpr_gdn`'s output for sequence pieces, each from its start state, in the C kernel
    ``cpr_scan_backward.c`` (reverse time, each chunk recomputed from its entry; fp32, not bitwise).

    Args:
        q, k, v, g, beta, lengths: the forward's inputs (q unscaled).
        entries: the forward's ``entries_out`` (``ceil(L_i / C)`` contiguous fp32 ``[H, Dk, Dv]`` states
            per piece, the first its start state).
        do: ``[N, H, Dv]`` gradient of the output. chunk_size: C.
        ds_tail: per piece None or the ``[H, Dk, Dv]`` fp32 gradient of the state entering its chunk
            ``floor(L_i / C)`` coming from outside the piece (a later context-parallel rank).
        want_head: per piece whether to return the gradient of its start state.

    Returns:
        (dq, dk, dv, dg, dbeta, heads): the input gradients (fp32, shapes of the inputs) and per piece
        its start state's gradient ``[H, Dk, Dv]`` fp32 (None where not wanted).

    Raises:
        RuntimeError: entries that are not contiguous fp32 states. ValueError: Dv not divisible by 16.
        MemoryError: the kernel could not allocate its buffers.
    """
    import ctypes

    N, H, Dk = k.shape
    Dv = v.shape[-1]
    scale = Dk**-0.5
    qs = (q.float() * scale).contiguous()
    k, v, beta = (x.float().contiguous() for x in (k, v, beta))
    decay = torch.exp(g.float()).contiguous()
    do = do.float().contiguous()
    dq, dk, dv = (torch.empty(N, H, d, dtype=torch.float32) for d in (Dk, Dk, Dv))
    dd, db = torch.empty(N, H, dtype=torch.float32), torch.empty(N, H, dtype=torch.float32)
    row0 = [0]
    for n in lengths[:-1]:
        row0.append(row0[-1] + n)
    r0, ln = torch.tensor(row0, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    if not all(e.is_contiguous() and e.dtype == torch.float32 for e in entries):
        raise RuntimeError("cpr_gdn's chunk entries must be contiguous fp32 [H, Dk, Dv] states")
    ent = torch.tensor([e.data_ptr() for e in entries], dtype=torch.int64)
    tails = [None if t is None else t.float().contiguous() for t in (ds_tail or [None] * len(lengths))]
    heads = [torch.empty(H, Dk, Dv, dtype=torch.float32) if w else None for w in (want_head or [False] * len(lengths))]
    ptrs = [torch.tensor([0 if t is None else t.data_ptr() for t in ts], dtype=torch.int64) for ts in (tails, heads)]
    rc = kernel_library(__file__, "cpr_scan_backward.c").isoexec_gdn_backward(
        *map(c_ptr, (qs, k, v, decay, beta, do, dq, dk, dv, dd, db, ent, *ptrs, r0, ln)),
        *map(ctypes.c_int64, (len(lengths), H, Dk, Dv, chunk_size)))
    if rc == -2:
        raise ValueError(f"the CPU GDN backward needs Dv divisible by 16, got Dv={Dv}")
    if rc != 0:
        raise MemoryError("cpr_scan_backward.c could not allocate its state buffers")
    return dq * scale, dk, dv, dd * decay, db, heads


def cpr_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: list[int],
    states: list[CPRState | None],
    chunk_size: int,
    keep_state: bool = True,
    entries_out: list[torch.Tensor] | None = None,
    on_chain: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[torch.Tensor, list[CPRState | None]]:
    """CPR gated delta rule over a batch of sequence pieces (prefill chunks, decode tokens, trainer sequences).

    Args:
        q, k: ``[N, H, Dk]`` fp32, l2-normalised (q is scaled by ``Dk**-0.5`` here). v: ``[N, H, Dv]`` fp32.
        g: ``[N, H]`` log decay (<= 0). beta: ``[N, H]``.
        lengths: new tokens per sequence (sum N). states: per sequence :class:`CPRState` or None (fresh).
        chunk_size: C. keep_state: return new states (False for the trainer).
        entries_out: if a list, receives the state entering every chunk the call touches, sequence-major
            and chunk-ascending (``ceil((n_open + L_i) / C)`` per sequence, each ``[H, Dk, Dv]`` fp32
            contiguous; the state pass's, which the in-chunk scan starts from): what the trainer's
            backward recomputes each chunk from.
        on_chain: called once the state pass is done and before the in-chunk scans, with each
            sequence's state entering its open chunk (after its last complete chunk): a
            context-parallel rank hands the chain on to the next rank here, so that the scans of all
            ranks run in parallel.

    Returns:
        (o ``[N, H, Dv]`` fp32, new states or Nones). Not differentiable (see the module docstring).

    Raises:
        ValueError: a state built with another chunk size than ``chunk_size``.
    """
    N, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    bad = [st.chunk_size for st in states if st is not None and st.chunk_size != C]
    if bad:
        raise ValueError(f"a GDN state built with chunk size C={bad[0]} cannot continue under C={C}")
    if any(st is not None and st.consumed for st in states):
        raise ValueError("a GDN state was passed to a step a second time: a step consumes its states (decode "
                         "advances the running state in place); continue from the state the step returned")
    q = q * Dk**-0.5
    states = [st if st is not None else CPRState.zeros(C, H, Dk, Dv) for st in states]
    row0 = [0]
    for n in lengths:
        row0.append(row0[-1] + n)
    m = [st.n_open + n for st, n in zip(states, lengths)]  # open-chunk tokens + new tokens
    nfull = [mi // C for mi in m]
    # ---- every complete chunk (sequence-major, chunk order): its C tokens, gathered in one index op
    #      per input tensor; a chunk that starts with pending tokens is assembled from them first.
    complete = [(i, c) for i in range(len(states)) for c in range(nfull[i])]
    entries: dict[tuple[int, int], torch.Tensor] = {(i, 0): st.entry for i, st in enumerate(states)}
    if complete:
        rows, assembled = [], {}
        for i, c in complete:
            st = states[i]
            if c == 0 and st.n_open:
                fill = C - st.n_open
                old = _unpack(torch.cat([t[a:b] for t, a, b in st.pending]), H, Dk, Dv)
                new = [x[row0[i] : row0[i] + fill] for x in (k, v, g, beta)]
                assembled[len(rows) // C] = [torch.cat([o_, n_]) for o_, n_ in zip(old, new)]
                rows += [0] * C  # placeholder rows, overwritten below
            else:
                start = row0[i] + c * C - st.n_open
                rows += range(start, start + C)
        idx = torch.tensor(rows, dtype=torch.long)
        ck, cv, cg, cb = (x[idx].view(len(complete), C, *x.shape[1:]) for x in (k, v, g, beta))
        for j, parts in assembled.items():
            ck[j], cv[j], cg[j], cb[j] = parts
        nc = len(complete)
        ck = ck.transpose(1, 2).reshape(nc * H, C, Dk).contiguous()
        cv = cv.transpose(1, 2).reshape(nc * H, C, Dv).contiguous()
        cg = cg.transpose(1, 2).reshape(nc * H, C).contiguous()
        cb = cb.transpose(1, 2).reshape(nc * H, C).contiguous()
        T, G = _ut_inverse(ck, cg, cb)
        index = {sc: j for j, sc in enumerate(complete)}
        # ---- the fp32 state chain, batched across sequences at each chunk index
        for c in range(max(nfull)):
            members = [i for i in range(len(states)) if nfull[i] > c]
            sel = torch.cat([torch.arange(index[(i, c)] * H, index[(i, c)] * H + H) for i in members])
            S = torch.cat([entries[(i, c)] for i in members])  # [len*H, Dk, Dv]
            S_next = _state_pass_step(S, ck[sel], cv[sel], cb[sel], T[sel], G[sel])
            for j, i in enumerate(members):
                entries[(i, c + 1)] = S_next[j * H : (j + 1) * H]
    if on_chain is not None:
        on_chain([entries[(i, nfull[i])] for i in range(len(states))])
    # ---- segments: new tokens of each touched chunk, scanned from that chunk's start state. A sequence's
    #      last segment leaves its running state: in place when it starts from a running state the
    #      sequence owns (decode), else in a fresh buffer; the final states of other segments, of a segment
    #      that ends on a chunk boundary (resync), and all of them for the trainer go to one scratch
    #      buffer that nobody reads.
    seg_state, seg_dst, segments = [], [], []
    final_running: dict[int, torch.Tensor] = {}
    scratch = None
    for i, st in enumerate(states):
        n_open = st.n_open
        touched = [c for c in range(n_open // C, -(-m[i] // C) if m[i] else 0) if max(c * C, n_open) < min((c + 1) * C, m[i])]
        for c in touched:
            a, b = max(c * C, n_open), min((c + 1) * C, m[i])
            start = st.running if c == n_open // C else entries[(i, c)]
            if keep_state and c == touched[-1] and m[i] % C:  # (at a chunk boundary the state resyncs instead)
                dst = start if start is st.running and st.owns_running else torch.empty(H, Dk, Dv, dtype=torch.float32)
                final_running[i] = dst
            else:
                scratch = torch.empty(H, Dk, Dv, dtype=torch.float32) if scratch is None else scratch
                dst = scratch
            seg_state.append(start)
            seg_dst.append(dst)
            segments.append((row0[i] + a - n_open, b - a))
    out = _scan(seg_state, seg_dst, q, k, v, g, beta, segments) if segments else q.new_zeros(N, H, Dv)
    if entries_out is not None:
        entries_out.extend(entries[(i, c)] for i in range(len(states)) for c in range(-(-m[i] // C)))
    for st in states:
        st.consumed = True
    if not keep_state:
        return out, [None] * len(states)
    new_states = []
    packed = None
    for i, st in enumerate(states):
        entry = entries[(i, nfull[i])]
        if m[i] % C == 0:
            new_states.append(CPRState(C, entry, entry))  # chunk boundary: resync to the state pass
            continue
        tail = m[i] - nfull[i] * C  # tokens of the new open chunk, all from this call's rows when nfull > 0
        a = row0[i + 1] - (tail if nfull[i] else lengths[i])
        if packed is None:
            packed = torch.cat([k.reshape(N, -1), v.reshape(N, -1), g, beta], dim=1)
        piece = (packed, a, row0[i + 1])
        pending = (piece,) if nfull[i] else st.pending + (piece,)
        running = final_running.get(i)
        new_states.append(CPRState(C, entry, st.running if running is None else running, pending, tail,
                                   owns_running=st.owns_running if running is None else True))
    return out, new_states


def iso_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Region ``gdn.gating``: ``beta = sigmoid(b)`` (rounded to ``b.dtype``, as transformers) and the log
    decay ``g = -exp(A_log) * softplus(a + dt_bias)``, fp32 math with the position-invariant
    transcendental functions (also the CUDA set's, as torch elementwise ops there).

    Args:
        a, b: ``[N, Hv]`` (boundary dtype). A_log, dt_bias: ``[Hv]``.

    Returns:
        (g ``[N, Hv]`` fp32, beta ``[N, Hv]`` fp32).
    """
    beta = sigmoid(b.float()).to(b.dtype).float()
    g = -torch.exp(A_log.float()) * softplus(a.float() + dt_bias.float())
    return g, beta
