"""``engine_decode`` under CUDA graphs: the unified model's decode step replayed from one captured graph per padded
batch size, with the bits of the eager step (docs/design.md, Engine and trainer).

The eager step builds its metadata on the host from the sequences' caches (hundreds of small launches, each paid
in Python: ``results/h200-vllm/08dd807/engine_decode``). A captured step cannot: every address it reads must stay
put and every value that varies must live on the device. So:

* :class:`SlotPools` keeps every pooled sequence's attention keys and values ``[S+1, cap, Hkv, D]`` and conv
  prefixes ``[S+1, Kc-1, C]`` per layer at fixed addresses (slot S is the pad rows'); the eager path writes a
  pooled sequence's state there too (``SequenceCache.pools``), so the two paths interleave freely.
* GDN states already live in the :class:`~isoexec.kernels.gdn.triton.StatePool` (reserved here so it never moves).
* The step's inputs (token ids, positions, slots) are copied into static buffers and the graph replayed; the
  sequence regions run their ``slots`` implementations (:class:`~isoexec.model.layers.SlotBatch`): the same kernels
  with device-built tile tables. The MoE's grouped GEMMs take device tile tables in every step.
* A token that completes its GDN chunk is scanned in the graph; its chunk's state pass (the resync) runs after the
  replay, eagerly, for every such (sequence, layer) in one launch per kernel
  (:func:`~isoexec.kernels.gdn.triton.complete_chunks`).

Pad rows (up to the captured size) run on slot S and GDN dummy slots; no row's bits depend on the others
(batch invariance), so the real rows are the eager step's rows.
"""

from __future__ import annotations

import time
import weakref

import torch

from isoexec.model.cache import SequenceCache
from isoexec.model.layers import SlotBatch

SLOT_REGIONS = ("attn.core", "gdn.conv1d", "gdn.core")


def default_sizes(max_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then multiples of 8, up to the first >= ``max_seqs`` (vLLM's choice)."""
    candidates = [1, 2, 4, *range(8, max_seqs + 8, 8)]
    return candidates[: next(i for i, s in enumerate(candidates) if s >= max_seqs) + 1]


class SlotPools:
    """Attention keys/values and conv prefixes of up to ``slots`` sequences at fixed device addresses.

    Args:
        model: the :class:`~isoexec.model.unified.UnifiedModel` (its layers' shapes, dtype and device).
        slots: sequences held at once. capacity: tokens per sequence (prompt and response).

    Raises:
        ValueError: ``slots`` or ``capacity`` < 1.
    """

    def __init__(self, model, slots: int, capacity: int):
        if slots < 1 or capacity < 1:
            raise ValueError(f"SlotPools: slots={slots}, capacity={capacity}; both must be >= 1")
        w = model.model.embed_tokens.weight
        z = dict(device=w.device, dtype=model.dtype)
        self.slots, self.capacity, self.dummy = slots, capacity, slots
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._conv: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            if layer.layer_type == "full_attention":
                a = layer.self_attn
                self._kv[i] = tuple(torch.zeros(slots + 1, capacity, a.hkv, a.d, **z) for _ in range(2))
            else:
                g = layer.linear_attn
                self._conv[i] = torch.zeros(slots + 1, g.kc - 1, g.conv_dim, **z)
        self._free = list(range(slots - 1, -1, -1))

    def new_cache(self, policy: str) -> SequenceCache:
        """A sequence cache in a free slot (the slot is free again when the cache is gone), or, when every slot is
        taken, a cache of its own buffers (whose steps run eagerly)."""
        if not self._free:
            return SequenceCache(policy=policy)
        slot = self._free.pop()
        cache = SequenceCache(policy=policy, pools=self, slot=slot)
        weakref.finalize(cache, self._free.append, slot)
        return cache

    def free_slots(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        """Bytes the pools hold (allocated up front: every slot at the full capacity)."""
        return sum(t.nbytes for kv in self._kv.values() for t in kv) + sum(t.nbytes for t in self._conv.values())

    def check_fits(self, end: int) -> None:
        """Raises ValueError, naming both, when a sequence of ``end`` tokens exceeds the capacity."""
        if end > self.capacity:
            raise ValueError(f"a sequence of {end} tokens does not fit the decode pools' capacity of "
                             f"{self.capacity} tokens (max_len of enable_decode_graphs)")

    def kv_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention layer ``layer``'s (K, V) pools ``[S+1, capacity, Hkv, D]``."""
        return self._kv[layer]

    def kv_slot(self, layer: int, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s (K, V) ``[capacity, Hkv, D]`` of ``layer``, for a sequence reaching ``end`` tokens.

        Raises:
            ValueError: ``end`` beyond the capacity (:meth:`check_fits`).
        """
        self.check_fits(end)
        k, v = self._kv[layer]
        return k[slot], v[slot]

    def conv_pool(self, layer: int) -> torch.Tensor:
        """GDN layer ``layer``'s conv prefix pool ``[S+1, Kc-1, C]``."""
        return self._conv[layer]

    def conv_slot(self, layer: int, slot: int) -> torch.Tensor:
        """Slot ``slot``'s conv prefix ``[Kc-1, C]`` of GDN layer ``layer``."""
        return self._conv[layer][slot]


class DecodeGraphs:
    """Captured ``engine_decode`` steps of one model (enable with ``UnifiedModel.enable_decode_graphs``).

    Args:
        model: a :class:`~isoexec.model.unified.UnifiedModel` on CUDA with a kernel set whose sequence regions have
            ``slots`` implementations (the isoexec CUDA set).
        max_seqs: pooled sequences (and the largest captured batch). max_len: tokens per pooled sequence.
        sizes: batch sizes to capture (default :func:`default_sizes`); a step pads to the next one.

    Raises:
        ValueError: a model off CUDA, or a kernel set without slot implementations.
    """

    def __init__(self, model, max_seqs: int, max_len: int, sizes: list[int] | None = None):
        ks = model.kernels
        dev = model.model.embed_tokens.weight.device
        missing = [r for r in SLOT_REGIONS if ks[r].slots is None]
        if dev.type != "cuda" or missing:
            raise ValueError(f"CUDA-graph decode needs a model on CUDA with the isoexec CUDA kernel set; this one is on "
                             f"{dev} with {ks.mode}/{ks.arch}" + (f", no slot kernels for {missing}" if missing else ""))
        self.model, self.device = model, dev
        self.pools = SlotPools(model, max_seqs, max_len)
        self.sizes = sorted(set(sizes or default_sizes(max_seqs)), reverse=True)  # the largest first: one memory pool
        self.gdn_layers = [i for i, lay in enumerate(model.model.layers) if lay.layer_type == "linear_attention"]
        self.state_pool, self.gdn_dummy = None, []
        if self.gdn_layers:
            from isoexec.kernels.gdn import triton as gdn

            g = model.model.layers[self.gdn_layers[0]].linear_attn
            self.state_pool = gdn.get_pool(g.hv, g.dk, g.dv, ks.chunk_size, dev)
            self.state_pool.reserve(len(self.gdn_layers) * (max_seqs + 1) + 1)
            self.gdn_dummy = self.state_pool.alloc(len(self.gdn_layers))
            for d in self.gdn_dummy:
                weakref.finalize(self, self.state_pool.release, d)
        n = self.sizes[0]
        lng = dict(device=dev, dtype=torch.long)
        self._ids = torch.zeros(n, **lng)
        self._meta = torch.zeros(2 + len(self.gdn_layers), n, **lng)  # positions, slots, GDN slots per layer
        self._out = torch.empty(n, model.config.vocab_size, device=dev, dtype=torch.float32)  # every graph's output
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._mempool = None
        self._captured_on: tuple = ()
        self._stacked_at: tuple[int, bool] = (-1, False)
        self.stats = {"replays": 0, "captures": 0, "capture_s": 0.0, "chunk_completions": 0,
                      "eager_steps": 0, "unpooled_caches": 0, "pool_bytes": self.pools.nbytes(), "graph_pool_bytes": 0}

    # ------------------------------------------------------------------------------------ sequences
    def new_cache(self) -> SequenceCache:
        """A sequence cache in a free slot of the pools (released when the cache goes), or a cache of its own
        buffers when every slot is taken (that sequence's steps then run eagerly)."""
        cache = self.pools.new_cache(self.model.kernels.fingerprint)
        if cache.pools is None:
            self.stats["unpooled_caches"] += 1
        return cache

    def accepts(self, caches: list[SequenceCache], lengths: list[int]) -> bool:
        """Whether this step is a graph step: one token for each of at most ``max(sizes)`` pooled sequences past
        their prefill (every GDN layer's state present), none at its capacity."""
        ng, cap = len(self.gdn_layers), self.pools.capacity
        ok = (len(caches) <= self.sizes[0] and all(n == 1 for n in lengths) and self._stacked()
              and all(c.pools is self.pools and 0 < c.position < cap and len(c.gdn) == ng for c in caches))
        if not ok and all(n == 1 for n in lengths):
            self.stats["eager_steps"] += 1  # a decode step the graphs could not take (an unpooled or new sequence)
        return ok

    # ---------------------------------------------------------------------------------------- step
    def step(self, caches: list[SequenceCache], ids: torch.Tensor) -> torch.Tensor:
        """One decode token for each sequence (:meth:`accepts` said yes); the caches' states advance, not their
        ``position`` (the caller's).

        Args:
            caches: B pooled sequence caches. ids: ``[B]`` int64 token ids, checked by the caller.

        Returns:
            ``[B, V]`` fp32 full-vocabulary logprobs (a copy: the graphs' output buffer is reused by the next replay).

        Raises:
            RuntimeError: a GDN state whose open-chunk count disagrees with its sequence's position.
        """
        B = len(caches)
        size = min(s for s in self.sizes if s >= B)
        self._check_addresses()
        if not self._graphs:
            self._capture_all()
        C = self.model.kernels.chunk_size
        pos = [c.position for c in caches]
        states = [[c.gdn[layer] for c in caches] for layer in self.gdn_layers]
        for row in states:
            for st, p in zip(row, pos):
                if st.n_open != p % C:
                    raise RuntimeError(f"a GDN state holds {st.n_open} open-chunk tokens at position {p} (C={C}): "
                                       "its sequence's cache was advanced outside engine_step")
        pad = size - B
        meta = [pos + [0] * pad, [c.slot for c in caches] + [self.pools.dummy] * pad]
        meta += [[st.slot for st in row] + [d] * pad for row, d in zip(states, self.gdn_dummy)]
        self._meta[:, :size].copy_(torch.tensor(meta, dtype=torch.long), non_blocking=True)
        self._ids[:B].copy_(ids)
        self._graphs[size].replay()
        self.stats["replays"] += 1
        rows = self._out[:B].clone()
        done = [i for i, p in enumerate(pos) if p % C == C - 1]
        if done:
            from isoexec.kernels.gdn import triton as gdn

            gdn.complete_chunks(self.state_pool, [row[i].slot for row in states for i in done], self.model.kernels.section.triton)
            self.stats["chunk_completions"] += len(done) * len(states)
        for row in states:
            for st in row:
                st.n_open = (st.n_open + 1) % C
        return rows

    # ------------------------------------------------------------------------------------- capture
    def _forward(self, size: int) -> None:
        m = self.model
        pos, slots = self._meta[0, :size], self._meta[1, :size]
        gdn_slots = {layer: self._meta[2 + j, :size] for j, layer in enumerate(self.gdn_layers)}
        batch = SlotBatch(self.pools, slots, pos, gdn_slots, m.inv_freq_on(self.device), m.dtype)
        with torch.no_grad():
            self._out[:size].copy_(m._logprobs(m._hidden(self._ids[:size], batch)))

    def _capture_all(self) -> None:
        """Capture every size (vLLM captures its sizes at engine start; here the first decode step pays, once, and
        ``stats["capture_s"]`` says what it cost), and record what the graphs address."""
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        for size in self.sizes:
            self._capture(size)
        torch.cuda.synchronize(self.device)
        self._captured_on = self._addresses()
        self.stats["capture_s"] += time.perf_counter() - t0
        self.stats["graph_pool_bytes"] = max(self.stats["graph_pool_bytes"], torch.cuda.memory_reserved(self.device) - before)

    def _capture(self, size: int) -> None:
        """Warm up (Triton compiles, the allocator settles) and capture the step of ``size`` rows, all on the pad
        slots (no sequence's state is touched)."""
        self._meta[0, :size] = 0
        self._meta[1, :size] = self.pools.dummy
        for j, d in enumerate(self.gdn_dummy):
            self._meta[2 + j, :size] = d
        self._ids[:size] = 0
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            self._forward(size)  # no output held: the pool's blocks serve every capture, the result is in _out
        self._mempool = graph.pool()
        self._graphs[size] = graph
        self.stats["captures"] += 1

    def _pool_ptrs(self) -> tuple:
        return tuple(t.data_ptr() for t in self.state_pool.tensors()) if self.state_pool else ()

    def _addresses(self) -> tuple:
        """What the captured graphs hold and could change: the GDN state pool's tensors (they move when the pool
        grows), every parameter's storage, the stacks the MoE experts' weights are rows of
        (:class:`~isoexec.model.layers.ExpertWeights`) and the parameter epoch (:attr:`~isoexec.model.layers.W.epoch`).
        An in-place update of a weight (a weight sync, ``load_state_dict``, an optimizer step) writes the storage
        the graphs read: nothing to do."""
        from isoexec.model.layers import W

        params = tuple(p.data_ptr() for p in self.model.parameters())
        stacks = tuple(s.data_ptr() for lay in self.model.model.layers for s in lay.mlp.expert_weights().stacks)
        return self._pool_ptrs(), params, stacks, W.epoch

    def _stacked(self) -> bool:
        """Whether every layer's experts are rows of their stacks (checked once per :attr:`W.epoch`): a list of
        weights would give the kernels copies, which an in-place update of a weight does not reach, so such a
        model's steps run eagerly."""
        from isoexec.model.layers import W

        if self._stacked_at[0] != W.epoch:
            ok = all(getattr(lay.mlp.expert_weights(), "stacks", None) is not None for lay in self.model.model.layers)
            self._stacked_at = (W.epoch, ok)
        return self._stacked_at[1]

    def _check_addresses(self) -> None:
        """Before a replay: a storage that moved (a pool grown, a parameter replaced or converted) drops every graph
        (captured again at the next step). Per step it compares the pool's addresses and the parameter epoch (any
        replacement of a parameter or a submodule anywhere in any model bumps it; then every parameter's storage
        is compared)."""
        from isoexec.model.layers import W

        if not self._graphs:
            return
        pool, _, _, epoch = self._captured_on
        if (self._pool_ptrs(), W.epoch) == (pool, epoch):
            return
        now = self._addresses()
        if now[:3] != self._captured_on[:3]:
            self._graphs.clear()
        self._captured_on = now
