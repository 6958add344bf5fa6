"""CPR Gated DeltaNet in Triton (region ``gdn.core``): state pass over complete chunks, segmented
token-by-token scan, and decode with a buffered open chunk and resync (docs/design.md, CPR Gated DeltaNet; the algorithm of
:mod:`isoexec.kernels.gdn.cpu`, with GPU bits of its own).

Three kernels, each one compiled code path used by every case:

* ``_chunk_prep`` (one program per (chunk, head), all chunks in parallel): ``G = cumsum(g)``,
  ``A = strict_lower(beta_i (k_i.k_j) exp(G_i - G_j))``, and ``W = (I + A)^-1 (beta exp(G) K)``,
  ``U0 = (I + A)^-1 (beta V)`` by blocked forward substitution over blocks of 16 rows (each diagonal
  block inverted as ``(I - A)(I + A^2)(I + A^4)(I + A^8)``, exact for a strictly lower 16x16 block, in
  fp32 dots; earlier blocks' rows subtracted with dots; block order fixed),
  ``KD = K exp(G_C - G)``, ``dC = exp(G_C)``. A chunk's tokens come from the input rows and/or the
  sequence's open-chunk buffer (decode resync, chunked prefill), loaded exactly, so the same chunk
  gives the same bits.
* ``_state_chain`` (one program per (sequence, head, Dv block), sequential over that sequence's
  complete chunks): ``S_{c+1} = dC S_c + KD^T (U0 - W S_c)`` in fp32 storage with ``tf32`` dots.
  It is written in Triton (no batched cuBLAS GEMM whose algorithm depends on the batch count).
* ``_scan`` (one program per (segment, head, Dv block)): the recurrence token by token from the
  segment's start state (the entry state of its chunk, or the running state), in one pass over the
  state per token: ``a = exp(g); u = beta (v - a S^T k); o = (a S^T q + (q.k) u) / sqrt(Dk);
  S = a S + k u^T`` (the same function as ``S *= a; u = beta (v - S^T k); S += k u^T; o = S^T q``).
  Trainer and prefill scan every chunk's new tokens as one segment each; decode scans one token per
  sequence.

Decode keeps per sequence (a slot of a :class:`StatePool`): the fp32 entry state of the open chunk,
the running state and the raw (k, v, g, beta) of the open chunk. When a chunk completes, the state
pass re-runs over the buffered chunk from the entry state and the running state is replaced by the
result (resync). So trainer, prefill, chunked prefill and decode see identical states at every chunk
boundary and identical in-chunk scans.

The kernels' launch metadata (which rows, chunks, states and slots each program takes) is built on the host
and reaches the device through :func:`device_meta`, a bounded cache: a trainer or prefill call made once
before a CUDA-graph capture can be captured and replayed (a replayed prefill writes the pool slots its
captured call held; the decode graphs use :func:`decode_scan_slots`, whose metadata is built on the device).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import triton
import triton.language as tl


# ------------------------------------------------------------------------------- launch metadata
META_CACHE_SIZE = 32
_meta_lru: OrderedDict = OrderedDict()
_meta_captured: dict = {}


def device_meta(values, dtype: torch.dtype, device) -> torch.Tensor:
    """The host-built launch metadata ``values`` as a device tensor, built once and then reused, so that a call
    captured in a CUDA graph copies nothing from the host.

    Every host-to-device copy of :func:`cpr_gdn`'s general path (trainer and prefill: the int32 chunk / chain /
    segment tables, the int64 slot and row indices of the state bookkeeping), of :meth:`StatePool.alloc` and of
    :func:`isoexec.kernels.gdn.triton_backward.cpr_gdn_backward` goes through here (the decode step's
    :func:`_decode_step` and :func:`complete_chunks` copy per call: their metadata changes every token, and the
    decode graphs build theirs on the device, :func:`decode_scan_slots`). A copy from pageable host memory cannot
    be captured, and a pinned buffer copied during capture would have to stay alive and unchanged for every
    replay; instead the first call (a warm-up before capture, as CUDA-graph practice has anyway) copies, and
    later calls with the same metadata, the captured one included, read the tensor made then.

    Keyed by ``(device, dtype, tuple(values))``. At most :data:`META_CACHE_SIZE` (32) entries are kept in
    least-recently-used order: the GDN layers of a trainer step share one forward and one backward entry per
    list of sequence lengths and chunk size (no slot and no head count enters the trainer's metadata), so a few
    dozen cover the shapes in flight while the device memory stays bounded; prefill metadata names pool slots, so
    it mostly misses and copies as every call did before this cache. An entry read during a capture leaves the
    bound and is kept for the process's lifetime: the graph reads its address at every replay, and nothing says
    when the graph is gone. A hit outside capture records the current stream's use of the tensor, so that freeing
    it on eviction waits for that stream's kernels.

    Args:
        values: Python ints (a sequence). dtype: ``torch.int32`` or ``torch.int64``. device: where the kernels
            read it.

    Returns:
        ``[len(values)]`` tensor of ``dtype`` on ``device`` equal to ``values``, shared with later calls: read it,
        never write it.

    Raises:
        RuntimeError: a CUDA stream is capturing and these values were not built before the capture.
    """
    dev = torch.device(device)
    key = (dev, dtype, tuple(values))
    t = _meta_captured.get(key)
    if t is not None:
        return t
    t = _meta_lru.get(key)
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if t is None:
            raise RuntimeError(f"CPR launch metadata ({len(values)} {dtype} entries on {dev}: sequence lengths, state "
                               "slots) not built by a call before capture: run the same call once outside the CUDA "
                               "graph first")
        _meta_captured[key] = _meta_lru.pop(key)
        return t
    if t is None:
        t = torch.tensor(key[2], dtype=dtype).to(dev, non_blocking=True)
        _meta_lru[key] = t
        if len(_meta_lru) > META_CACHE_SIZE:
            _meta_lru.popitem(last=False)
        return t
    _meta_lru.move_to_end(key)
    if dev.type == "cuda":
        t.record_stream(torch.cuda.current_stream(dev))
    return t


def constants(chunk_size: int, cfg) -> dict:
    """The contract constants of :func:`cpr_gdn` (``cfg``: ``isoexec.config.TritonSection``)."""
    return {"chunk_size": chunk_size, "state_dtype": "float32", "state_pass": "wy_ut_blocked16_neumann_chain",
            "state_pass_dot_precision": cfg.gdn_dot_precision, "chain_tile_v": cfg.gdn_chain_bv,
            "chain_num_warps": cfg.gdn_chain_warps, "prep_num_warps": cfg.gdn_prep_warps,
            "prep_split": cfg.gdn_prep_split, "in_chunk": "recurrent",
            "scan_tile_v": cfg.gdn_scan_bv, "scan_num_warps": cfg.gdn_scan_warps, "decode_resync": True}


@triton.jit
def _prep_block_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, in_row0, nb, slot, h, H, t0,
                     BT: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, LOAD_V: tl.constexpr):
    """Rows ``t0 .. t0+BT`` of a chunk: from the open-chunk buffer for ``t < nb``, else from the input rows."""
    t = t0 + tl.arange(0, BT)
    dk = tl.arange(0, DK)
    from_buf = t < nb
    row = (in_row0 + t).to(tl.int64)
    brow = slot * C + t  # buffer row (slot-major [P, C, H, D])
    k_in = tl.load(k_ptr + (row * H + h)[:, None] * DK + dk[None, :], mask=~from_buf[:, None], other=0.0)
    k_bf = tl.load(bk_ptr + (brow * H + h)[:, None] * DK + dk[None, :], mask=from_buf[:, None], other=0.0)
    k = tl.where(from_buf[:, None], k_bf, k_in)
    g = tl.where(from_buf, tl.load(bg_ptr + brow * H + h, mask=from_buf, other=0.0),
                 tl.load(g_ptr + row * H + h, mask=~from_buf, other=0.0))
    beta = tl.where(from_buf, tl.load(bb_ptr + brow * H + h, mask=from_buf, other=0.0),
                    tl.load(b_ptr + row * H + h, mask=~from_buf, other=0.0))
    if LOAD_V:
        dv = tl.arange(0, DV)
        v_in = tl.load(v_ptr + (row * H + h)[:, None] * DV + dv[None, :], mask=~from_buf[:, None], other=0.0)
        v_bf = tl.load(bv_ptr + (brow * H + h)[:, None] * DV + dv[None, :], mask=from_buf[:, None], other=0.0)
        v = tl.where(from_buf[:, None], v_bf, v_in)
    else:
        v = k
    return k, v, g, beta


@triton.jit
def _chunk_prep(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, meta_ptr,
                w_ptr, u_ptr, kd_ptr, dc_ptr, H,
                C: tl.constexpr, BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr,
                PART: tl.constexpr = 0):
    # PART 0: W, U, KD and the decay total; 1: W, KD and the decay total; 2: U (the same operations per output)
    j = tl.program_id(0)
    h = tl.program_id(1)
    in_row0 = tl.load(meta_ptr + j * 3 + 0)
    nb = tl.load(meta_ptr + j * 3 + 1)
    slot = tl.load(meta_ptr + j * 3 + 2).to(tl.int64)
    tc = tl.arange(0, C)
    tb = tl.arange(0, BT)
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    # decay totals of the whole chunk: G of row t = (sum of g over earlier blocks) + (in-block cumsum)
    from_buf = tc < nb
    rowc = (in_row0 + tc).to(tl.int64)
    g_all = tl.where(from_buf, tl.load(bg_ptr + (slot * C + tc) * H + h, mask=from_buf, other=0.0),
                     tl.load(g_ptr + rowc * H + h, mask=~from_buf, other=0.0))
    gl = tl.sum(g_all, axis=0)
    base = (j * H + h).to(tl.int64) * C
    eye = tb[:, None] == tb[None, :]
    # blocked forward substitution of (I + A) [W | U] = [beta e^G K | beta V], A strictly lower,
    # A[t, s] = beta_t (k_t . k_s) exp(G_t - G_s); blocks of BT rows, block i after blocks 0..i-1
    for i in range(0, C // BT):
        t0 = i * BT
        k_i, v_i, g_i, b_i = _prep_block_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, in_row0, nb,
                                              slot, h, H, t0, BT, C, DK, DV, True)
        pre_i = tl.sum(tl.where(tc < t0, g_all, 0.0), axis=0)
        G_i = pre_i + tl.cumsum(g_i, axis=0)
        xw = k_i * (b_i * tl.exp(G_i))[:, None]
        xu = v_i * b_i[:, None]
        for jb in range(0, i):
            s0 = jb * BT
            k_j, _, g_j, _ = _prep_block_rows(k_ptr, v_ptr, g_ptr, b_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, in_row0, nb,
                                              slot, h, H, s0, BT, C, DK, DV, False)
            G_j = tl.sum(tl.where(tc < s0, g_all, 0.0), axis=0) + tl.cumsum(g_j, axis=0)
            a_ij = b_i[:, None] * tl.dot(k_i, tl.trans(k_j), input_precision=PREC) * tl.exp(G_i[:, None] - G_j[None, :])
            if PART != 2:
                w_j = tl.load(w_ptr + (base + s0 + tb)[:, None] * DK + dk[None, :])
                xw = xw - tl.dot(a_ij, w_j, input_precision=PREC)
            if PART != 1:
                u_j = tl.load(u_ptr + (base + s0 + tb)[:, None] * DV + dv[None, :])
                xu = xu - tl.dot(a_ij, u_j, input_precision=PREC)
        # T_ii = (I + A_ii)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8) for the strictly lower (nilpotent) 16x16 A_ii,
        # fp32 products (ieee: no tf32), a few dependent dots instead of a 15-step row substitution
        kk = tl.dot(k_i, tl.trans(k_i), input_precision=PREC)
        lower = tb[:, None] > tb[None, :]
        A = tl.where(lower, b_i[:, None] * kk * tl.exp(tl.where(lower, G_i[:, None] - G_i[None, :], 0.0)), 0.0)
        I = tl.where(eye, 1.0, 0.0)
        A2 = tl.dot(A, A, input_precision="ieee")
        A4 = tl.dot(A2, A2, input_precision="ieee")
        A8 = tl.dot(A4, A4, input_precision="ieee")
        T = tl.dot(I - A, I + A2, input_precision="ieee")
        T = tl.dot(T, I + A4, input_precision="ieee")
        T = tl.dot(T, I + A8, input_precision="ieee")
        if PART != 2:
            w_i = tl.dot(T, xw, input_precision=PREC)
            tl.store(w_ptr + (base + t0 + tb)[:, None] * DK + dk[None, :], w_i)
            tl.store(kd_ptr + (base + t0 + tb)[:, None] * DK + dk[None, :], k_i * tl.exp(gl - G_i)[:, None])
        if PART != 1:
            u_i = tl.dot(T, xu, input_precision=PREC)
            tl.store(u_ptr + (base + t0 + tb)[:, None] * DV + dv[None, :], u_i)
        tl.debug_barrier()  # block i's W, U rows are read back by the next blocks
    if PART != 2:
        tl.store(dc_ptr + j * H + h, tl.exp(gl))


def chunk_prep(n: int, H: int, args: tuple, C: int, DK: int, DV: int, cfg) -> None:
    """Launch :func:`_chunk_prep` over ``n`` chunks x ``H`` heads: ``args`` its pointer arguments (k, v, g, beta, the
    open-chunk buffers, the prep metadata, W, U, KD, dC); one launch, or with ``cfg.gdn_prep_split`` two (``PART`` 1:
    W, KD and the decay totals; 2: U), each output computed by the same operations either way."""
    for part in ((1, 2) if cfg.gdn_prep_split else (0,)):
        _chunk_prep[(n, H)](*args, H, C=C, BT=min(C, 16), DK=DK, DV=DV, PREC=cfg.gdn_dot_precision, PART=part,
                            num_warps=cfg.gdn_prep_warps)


@triton.jit
def _state_chain(entry_ptr, w_ptr, u_ptr, kd_ptr, dc_ptr, e_ptr, meta_ptr, H,
                 C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    s_id = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    chunk0 = tl.load(meta_ptr + s_id * 4 + 0)
    nch = tl.load(meta_ptr + s_id * 4 + 1)
    src = tl.load(meta_ptr + s_id * 4 + 2)
    e0 = tl.load(meta_ptr + s_id * 4 + 3)
    t = tl.arange(0, C)
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    s_offs = dk[:, None] * DV + cols[None, :]
    S = tl.load(entry_ptr + (tl.maximum(src, 0).to(tl.int64) * H + h) * DK * DV + s_offs, mask=src >= 0, other=0.0)
    for c in range(0, nch):
        jh = ((chunk0 + c) * H + h).to(tl.int64)
        W = tl.load(w_ptr + (jh * C + t)[:, None] * DK + dk[None, :])
        KD = tl.load(kd_ptr + (jh * C + t)[:, None] * DK + dk[None, :])
        U = tl.load(u_ptr + (jh * C + t)[:, None] * DV + cols[None, :])
        dc = tl.load(dc_ptr + jh)
        Un = U - tl.dot(W, S, input_precision=PREC)
        S = S * dc + tl.dot(tl.trans(KD), Un, input_precision=PREC)
        tl.store(e_ptr + ((e0 + c).to(tl.int64) * H + h) * DK * DV + s_offs, S)


@triton.jit
def _scan(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, run_ptr, e_ptr, f_ptr, meta_ptr, H, scale,
          DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    seg = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    row0 = tl.load(meta_ptr + seg * 6 + 0)
    L = tl.load(meta_ptr + seg * 6 + 1)
    src_kind = tl.load(meta_ptr + seg * 6 + 2)
    src_idx = tl.load(meta_ptr + seg * 6 + 3).to(tl.int64)
    dst_kind = tl.load(meta_ptr + seg * 6 + 4)
    dst_idx = tl.load(meta_ptr + seg * 6 + 5).to(tl.int64)
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    s_offs = dk[:, None] * DV + cols[None, :]
    s_run = tl.load(run_ptr + (src_idx * H + h) * DK * DV + s_offs, mask=src_kind == 1, other=0.0)
    s_ent = tl.load(e_ptr + (src_idx * H + h) * DK * DV + s_offs, mask=src_kind == 2, other=0.0)
    S = tl.where(src_kind == 1, s_run, tl.where(src_kind == 2, s_ent, 0.0))
    # token i+1's inputs are loaded while token i is computed (they do not depend on the state)
    r = row0.to(tl.int64) * H + h
    has = L > 0
    kn = tl.load(k_ptr + r * DK + dk, mask=has, other=0.0)
    qn = tl.load(q_ptr + r * DK + dk, mask=has, other=0.0)
    vn = tl.load(v_ptr + r * DV + cols, mask=has, other=0.0)
    gn = tl.load(g_ptr + r, mask=has, other=0.0)
    bn = tl.load(b_ptr + r, mask=has, other=0.0)
    for i in range(0, L):
        kt, qt, vt, gt, bt = kn, qn, vn, gn, bn
        rt = r
        r = r + H
        nxt = i + 1 < L
        kn = tl.load(k_ptr + r * DK + dk, mask=nxt, other=0.0)
        qn = tl.load(q_ptr + r * DK + dk, mask=nxt, other=0.0)
        vn = tl.load(v_ptr + r * DV + cols, mask=nxt, other=0.0)
        gn = tl.load(g_ptr + r, mask=nxt, other=0.0)
        bn = tl.load(b_ptr + r, mask=nxt, other=0.0)
        # S' = a S + k u^T with u = beta (v - a S^T k); o = S'^T q = a S^T q + (q.k) u (one pass over S)
        a = tl.exp(gt)
        ks = tl.sum(kt[:, None] * S, axis=0)
        qs = tl.sum(qt[:, None] * S, axis=0)
        qk = tl.sum(qt * kt, axis=0)
        u = (vt - a * ks) * bt
        S = S * a + kt[:, None] * u[None, :]
        o = (a * qs + qk * u) * scale
        tl.store(o_ptr + rt * DV + cols, o)
    if dst_kind == 1:
        tl.store(run_ptr + (dst_idx * H + h) * DK * DV + s_offs, S)
    if dst_kind == 2:
        tl.store(f_ptr + (dst_idx * H + h) * DK * DV + s_offs, S)


# ----------------------------------------------------------------------------------------- state
class StatePool:
    """Device storage of CPR decode states, one slot per (sequence, layer): fp32 ``entry`` and
    ``running`` ``[P, H, Dk, Dv]`` and the open chunk's raw inputs ``bk [P, C, H, Dk]``,
    ``bv [P, C, H, Dv]``, ``bg / bb [P, C, H]``. Kernels address slots directly (no gather copies)."""

    def __init__(self, h: int, dk: int, dv: int, c: int, device):
        self.h, self.dk, self.dv, self.c, self.device = h, dk, dv, c, device
        self.cap = 0
        self.free: list[int] = []
        self._alloc_tensors(16)

    def _alloc_tensors(self, cap: int):
        f = dict(device=self.device, dtype=torch.float32)
        new = {
            "entry": torch.zeros(cap, self.h, self.dk, self.dv, **f),
            "running": torch.zeros(cap, self.h, self.dk, self.dv, **f),
            "bk": torch.zeros(cap, self.c, self.h, self.dk, **f),
            "bv": torch.zeros(cap, self.c, self.h, self.dv, **f),
            "bg": torch.zeros(cap, self.c, self.h, **f),
            "bb": torch.zeros(cap, self.c, self.h, **f),
        }
        for name, t in new.items():
            if self.cap:
                t[: self.cap] = getattr(self, name)
            setattr(self, name, t)
        self.free += list(range(cap - 1, self.cap - 1, -1))
        self.cap = cap

    def reserve(self, n: int) -> None:
        """Grow to at least ``n`` slots now (a CUDA graph holds the tensors' addresses: they must not move later)."""
        while self.cap < n:
            self._alloc_tensors(self.cap * 2)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every storage tensor (what a captured graph addresses)."""
        return self.entry, self.running, self.bk, self.bv, self.bg, self.bb

    def alloc(self, n: int) -> list[int]:
        while len(self.free) < n:
            self._alloc_tensors(self.cap * 2)
        slots = [self.free.pop() for _ in range(n)]
        if slots:
            idx = device_meta(slots, torch.int64, self.device)
            self.entry.index_fill_(0, idx, 0.0)
            self.running.index_fill_(0, idx, 0.0)
        return slots

    def release(self, slot: int):
        self.free.append(slot)


_POOLS: dict = {}


def get_pool(h, dk, dv, c, device) -> StatePool:
    key = (h, dk, dv, c, str(device))
    if key not in _POOLS:
        _POOLS[key] = StatePool(h, dk, dv, c, device)
    return _POOLS[key]


class TritonCPRState:
    """A sequence's CPR state of one GDN layer: a pool slot and the open chunk's token count. The
    pool records the chunk size C that built the state (``pool.c``)."""

    def __init__(self, pool: StatePool, slot: int):
        self.pool, self.slot, self.n_open = pool, slot, 0
        weakref.finalize(self, pool.release, slot)

    @property
    def entry(self):
        return self.pool.entry[self.slot]

    @property
    def running(self):
        return self.pool.running[self.slot]


# ---------------------------------------------------------------------------------------- driver
def cpr_gdn(q, k, v, g, beta, lengths: list[int], states: list, chunk_size: int, cfg, keep_state: bool = True):
    """CPR gated delta rule over a batch of sequence pieces (trainer sequences, prefill chunks, decode tokens).

    Args:
        q, k: ``[N, H, Dk]`` fp32, l2-normalised (q is scaled by ``Dk**-0.5`` in the scan). v: ``[N, H, Dv]`` fp32.
        g: ``[N, H]`` log decay. beta: ``[N, H]``. lengths: new tokens per piece (sum N).
        states: per piece a :class:`TritonCPRState` or None (fresh). chunk_size: C.
        cfg: ``isoexec.config.TritonSection`` (tiles, warps, dot precision).
        keep_state: False for the trainer (no states kept or returned).

    Returns:
        (o ``[N, H, Dv]`` fp32, per piece its state (updated in place) or None).

    Raises:
        ValueError: a state built with another chunk size than ``chunk_size``.
        RuntimeError: under CUDA-graph capture, metadata (lengths, states' slots and open counts) that no call
            before the capture built (:func:`device_meta`).
    """
    bad = [s.pool.c for s in states if s is not None and s.pool.c != chunk_size]
    if bad:
        raise ValueError(f"a GDN state built with chunk size C={bad[0]} cannot continue under C={chunk_size}")
    N, H, DK = k.shape
    DV = v.shape[-1]
    C = chunk_size
    dev = k.device
    q, k, v = (x.float().contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    pool = get_pool(H, DK, DV, C, dev) if keep_state else None
    if keep_state and N == len(lengths) and all(s is not None for s in states):
        return _decode_step(q, k, v, g, beta, states, pool, C, cfg)
    if keep_state:
        fresh = [i for i, s in enumerate(states) if s is None]
        slots = pool.alloc(len(fresh))
        states = list(states)
        for i, sl in zip(fresh, slots):
            states[i] = TritonCPRState(pool, sl)
        had_state = [s is not None and i not in set(fresh) for i, s in enumerate(states)]
    else:
        had_state = [False] * len(lengths)
    prep, chain, segs = [], [], []
    n_entries = 0
    n_f = 0
    post_entry, post_resync, post_f, buf_dst = [], [], [], []
    row0 = 0
    for b, n in enumerate(lengths):
        st = states[b] if keep_state else None
        slot = st.slot if st is not None else 0
        n_open = st.n_open if st is not None else 0
        m = n_open + n
        full = m // C
        e0 = n_entries
        if full:
            chain += [len(prep) // 3, full, slot if had_state[b] else -1, e0]
            for c in range(full):
                prep += [row0 + c * C - n_open, n_open if c == 0 else 0, slot]
            n_entries += full
        n_seg_chunks = -(-m // C)
        touched = [c for c in range(n_seg_chunks) if max(c * C, n_open) < min((c + 1) * C, m)]
        for c in touched:
            a, bnd = max(c * C, n_open), min((c + 1) * C, m)
            if c == 0:
                src_kind, src_idx = (1, slot) if had_state[b] else (0, 0)
            else:
                src_kind, src_idx = 2, e0 + c - 1
            dst_kind, dst_idx = 0, 0
            if keep_state and c == touched[-1] and m % C:
                if len(touched) == 1:
                    dst_kind, dst_idx = 1, slot
                else:
                    dst_kind, dst_idx = 2, n_f
                    post_f.append(slot)
                    n_f += 1
            segs += [row0 + a - n_open, bnd - a, src_kind, src_idx, dst_kind, dst_idx]
        if keep_state:
            if full:
                post_entry.append((slot, e0 + full - 1))
            if m % C == 0:
                post_resync.append(slot)
            p0 = n_open if full == 0 else 0
            for p in range(p0, m - full * C):
                buf_dst.append((slot, p, row0 + full * C + p - n_open))
            st.n_open = m % C
        row0 += n
    # ---- all metadata in one device tensor (one copy, or none when a call before built the same)
    n_prep, n_chain, n_seg = len(prep) // 3, len(chain) // 4, len(segs) // 6
    meta = device_meta(prep + chain + segs, torch.int32, dev)
    m_prep, m_chain, m_seg = meta[: 3 * n_prep], meta[3 * n_prep : 3 * n_prep + 4 * n_chain], meta[3 * n_prep + 4 * n_chain :]
    f32 = dict(device=dev, dtype=torch.float32)
    dummy = torch.empty(1, **f32)
    bufs = (pool.bk, pool.bv, pool.bg, pool.bb) if pool is not None else (dummy,) * 4
    E = torch.empty((max(n_entries, 1), H, DK, DV), **f32)
    if n_prep:
        W = torch.empty((n_prep, H, C, DK), **f32)
        KD = torch.empty((n_prep, H, C, DK), **f32)
        U = torch.empty((n_prep, H, C, DV), **f32)
        dC = torch.empty((n_prep, H), **f32)
        chunk_prep(n_prep, H, (k, v, g, beta, *bufs, m_prep, W, U, KD, dC), C, DK, DV, cfg)
        entry = pool.entry if pool is not None else dummy
        _state_chain[(n_chain, H, DV // cfg.gdn_chain_bv)](entry, W, U, KD, dC, E, m_chain, H, C=C, DK=DK, DV=DV,
                                                           BV=cfg.gdn_chain_bv, PREC=cfg.gdn_dot_precision,
                                                           num_warps=cfg.gdn_chain_warps)
    o = torch.empty((N, H, DV), **f32)
    F = torch.empty((max(n_f, 1), H, DK, DV), **f32)
    if n_seg:
        run = pool.running if pool is not None else dummy
        _scan[(n_seg, H, DV // cfg.gdn_scan_bv)](q, k, v, g, beta, o, run, E, F, m_seg, H, DK ** -0.5,
                                                 DK=DK, DV=DV, BV=cfg.gdn_scan_bv, num_warps=cfg.gdn_scan_warps)
    if not keep_state:
        return o, [None] * len(lengths)
    # ---- state bookkeeping (batched index ops)
    if post_entry:
        se = device_meta([s for s, _ in post_entry] + [e for _, e in post_entry], torch.int64, dev)
        sl, ei = se[: len(post_entry)], se[len(post_entry) :]
        pool.entry.index_copy_(0, sl, E.index_select(0, ei))
    if post_f:
        pool.running.index_copy_(0, device_meta(post_f, torch.int64, dev), F[: len(post_f)])
    if post_resync:
        sl = device_meta(post_resync, torch.int64, dev)
        pool.running.index_copy_(0, sl, pool.entry.index_select(0, sl))
    if buf_dst:
        bd = device_meta([x for d in buf_dst for x in d], torch.int64, dev).view(-1, 3).t()
        s_i, p_i, r_i = bd[0], bd[1], bd[2]
        pool.bk[s_i, p_i] = k[r_i]
        pool.bv[s_i, p_i] = v[r_i]
        pool.bg[s_i, p_i] = g[r_i]
        pool.bb[s_i, p_i] = beta[r_i]
    return o, states


def _decode_step(q, k, v, g, beta, states, pool: StatePool, C: int, cfg):
    """One token for each of B sequences with states: the same kernels and metadata semantics as the
    general path of :func:`cpr_gdn` (one-token segments from the running state, updated in place;
    sequences whose chunk completes run the chunk prep + state chain over their buffer, then
    resync), with the metadata built without per-token Python work."""
    N, H, DK = k.shape
    DV = v.shape[-1]
    dev = k.device
    B = len(states)
    slots = [s.slot for s in states]
    n_open = [s.n_open for s in states]
    done = [i for i in range(B) if n_open[i] + 1 == C]
    seg = []
    for i in range(B):
        last = n_open[i] + 1 == C
        seg += [i, 1, 1, slots[i], 0 if last else 1, slots[i]]
    prep = []
    for j, i in enumerate(done):
        prep += [i - (C - 1), C - 1, slots[i]]
    chain = []
    for j, i in enumerate(done):
        chain += [j, 1, slots[i], j]
    meta = torch.tensor(seg + prep + chain + slots + n_open, dtype=torch.int32).to(dev, non_blocking=True)
    m_seg = meta[: 6 * B]
    m_prep = meta[6 * B : 6 * B + 3 * len(done)]
    m_chain = meta[6 * B + 3 * len(done) : 6 * B + 7 * len(done)]
    sl_t = meta[6 * B + 7 * len(done) : 7 * B + 7 * len(done)].long()
    no_t = meta[7 * B + 7 * len(done) :].long()
    f32 = dict(device=dev, dtype=torch.float32)
    o = torch.empty((N, H, DV), **f32)
    dummy = torch.empty(1, **f32)
    _scan[(B, H, DV // cfg.gdn_scan_bv)](q, k, v, g, beta, o, pool.running, dummy, dummy, m_seg, H, DK ** -0.5,
                                         DK=DK, DV=DV, BV=cfg.gdn_scan_bv, num_warps=cfg.gdn_scan_warps)
    if done:
        nd = len(done)
        W = torch.empty((nd, H, C, DK), **f32)
        KD = torch.empty((nd, H, C, DK), **f32)
        U = torch.empty((nd, H, C, DV), **f32)
        dC = torch.empty((nd, H), **f32)
        E = torch.empty((nd, H, DK, DV), **f32)
        chunk_prep(nd, H, (k, v, g, beta, pool.bk, pool.bv, pool.bg, pool.bb, m_prep, W, U, KD, dC), C, DK, DV, cfg)
        _state_chain[(nd, H, DV // cfg.gdn_chain_bv)](pool.entry, W, U, KD, dC, E, m_chain, H, C=C, DK=DK, DV=DV,
                                                      BV=cfg.gdn_chain_bv, PREC=cfg.gdn_dot_precision,
                                                      num_warps=cfg.gdn_chain_warps)
        sd = torch.tensor([slots[i] for i in done], device=dev)
        pool.entry.index_copy_(0, sd, E)
        pool.running.index_copy_(0, sd, E)
    # append the token to the open-chunk buffer (a completed chunk's buffer is simply overwritten later)
    pool.bk[sl_t, no_t] = k
    pool.bv[sl_t, no_t] = v
    pool.bg[sl_t, no_t] = g
    pool.bb[sl_t, no_t] = beta
    for s, n in zip(states, n_open):
        s.n_open = (n + 1) % C
    return o, states


# ------------------------------------------------------------------------------- slot-addressed decode
def decode_scan_slots(q, k, v, g, beta, slots: torch.Tensor, positions: torch.Tensor, pool: StatePool, cfg):
    """The in-graph half of a decode step (CUDA graph safe: metadata built on the device): one token per sequence
    scanned from its running state, appended to its open-chunk buffer. A token that completes its chunk leaves the
    running state as it was; :func:`complete_chunks` then runs that chunk's state pass (the general path's resync),
    outside the graph and before the sequence's next token.

    Args:
        q, k: ``[B, H, Dk]``, l2-normalised. v: ``[B, H, Dv]``. g, beta: ``[B, H]`` (all used as fp32, as
            :func:`cpr_gdn`). slots: ``[B]`` int64 pool slots (pad rows may share one). positions: ``[B]`` int64, tokens the sequences
            consumed before this one (the open chunk holds ``position % C`` of them).
        pool: the sequences' :class:`StatePool` (chunk size ``pool.c``). cfg: ``isoexec.config.TritonSection``.

    Returns:
        o ``[B, H, Dv]`` fp32: the bits of :func:`cpr_gdn`'s decode step for the same states and tokens (the same
        ``_scan`` program per token, the same metadata).
    """
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    B, H, DK = k.shape
    DV = v.shape[-1]
    C = pool.c
    n_open = positions % C
    keep = (n_open != C - 1).long()  # a completing token's scan stores no state (the resync replaces it)
    rows = torch.arange(B, device=k.device)
    one = torch.ones_like(rows)
    meta = torch.stack([rows, one, one, slots, keep, slots], 1).to(torch.int32)
    o = torch.empty((B, H, DV), device=k.device, dtype=torch.float32)
    dummy = torch.empty(1, device=k.device, dtype=torch.float32)
    _scan[(B, H, DV // cfg.gdn_scan_bv)](q, k, v, g, beta, o, pool.running, dummy, dummy, meta, H, DK ** -0.5,
                                         DK=DK, DV=DV, BV=cfg.gdn_scan_bv, num_warps=cfg.gdn_scan_warps)
    pool.bk[slots, n_open] = k
    pool.bv[slots, n_open] = v
    pool.bg[slots, n_open] = g
    pool.bb[slots, n_open] = beta
    return o


def complete_chunks(pool: StatePool, slots: list[int], cfg) -> None:
    """The state pass over the full open chunk of each slot in ``slots`` (its C tokens all in the buffer, the last
    appended by :func:`decode_scan_slots`), from the slot's entry state; entry and running state become the result.

    The same ``_chunk_prep`` and ``_state_chain`` programs as :func:`cpr_gdn`'s decode step, which takes the chunk's
    last token from the input rows rather than the buffer: the same values (the buffer holds them exactly, fp32),
    so the same bits. One launch each for every slot of every layer (the layers of one shape share a pool).
    """
    if not slots:
        return
    C, H, DK, DV = pool.c, pool.h, pool.dk, pool.dv
    dev = pool.entry.device
    n = len(slots)
    meta = torch.tensor([x for s in slots for x in (0, C, s)] + [x for j, s in enumerate(slots) for x in (j, 1, s, j)]
                        + list(slots), dtype=torch.int32).to(dev, non_blocking=True)
    m_prep, m_chain, sl = meta[: 3 * n], meta[3 * n : 7 * n], meta[7 * n :].long()
    f32 = dict(device=dev, dtype=torch.float32)
    W = torch.empty((n, H, C, DK), **f32)
    KD = torch.empty((n, H, C, DK), **f32)
    U = torch.empty((n, H, C, DV), **f32)
    dC = torch.empty((n, H), **f32)
    E = torch.empty((n, H, DK, DV), **f32)
    # nb = C: every row of the chunk from the buffer, so the input-row pointers are never read
    chunk_prep(n, H, (pool.bk, pool.bv, pool.bg, pool.bb, pool.bk, pool.bv, pool.bg, pool.bb, m_prep, W, U, KD, dC), C,
               DK, DV, cfg)
    _state_chain[(n, H, DV // cfg.gdn_chain_bv)](pool.entry, W, U, KD, dC, E, m_chain, H, C=C, DK=DK, DV=DV,
                                                 BV=cfg.gdn_chain_bv, PREC=cfg.gdn_dot_precision,
                                                 num_warps=cfg.gdn_chain_warps)
    pool.entry.index_copy_(0, sl, E)
    pool.running.index_copy_(0, sl, E)
