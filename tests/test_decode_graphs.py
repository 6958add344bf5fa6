"""``engine_decode`` under CUDA graphs (``isoexec.model.graphs``): a captured step gives the eager step's
full-vocabulary rows bitwise, across GDN chunk boundaries, padded batch sizes, sequences joining and leaving, and an
in-place weight update; the native set's rows on the same tokens differ (negative control). On the CPU: the pooled
sequence state the graphs read gives the eager path's bits, and what cannot run is refused in one line."""

import pytest
import torch

from isoexec.config import KernelSection, ModelSection
from isoexec.model.build import random_model
from isoexec.model.graphs import DecodeGraphs, SlotPools, default_sizes

V = 256


def _model(kernel_set="isoexec", device="cpu"):
    return random_model(ModelSection(), KernelSection(chunk_size=16), kernel_set, vocab_size=V, device=device)


def _script(seed=0, lens=(3, 17, 30, 9, 1), steps=40):
    """Prompts and the decode tokens fed to every run (teacher forcing: the same inputs, whatever the bits); the
    last two columns are the joining sequences'."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lens], torch.randint(0, V, (steps, len(lens) + 2), generator=g)


def _decode(model, prompts, tokens, make_cache, join_at=None, leave_at=None, update_at=None, rejoin_at=None,
            record=None):
    """Prefill, then one row per sequence per step; a sequence joins (its prefill beside the decodes) at step
    ``join_at``, the first two leave at ``leave_at`` (their caches dropped: pooled ones give their slots back),
    another joins at ``rejoin_at``, expert 0 of layer 0 is scaled in place at ``update_at``. ``record``: a dict that
    gets the dropped caches' slots (``freed``) and the rejoining cache's (``rejoined``)."""
    caches = [make_cache() for _ in prompts]
    first = [torch.cat(model.engine_step(caches, prompts, last_only=True))]
    live = list(range(len(prompts)))
    out = []
    for step, row in enumerate(tokens):
        chunks = [row[i].view(1) for i in live]
        if step == join_at:
            caches.append(make_cache())
            chunks.append(torch.arange(5) % V)
            live.append(len(caches) - 1)
        if step == leave_at:
            if record is not None:
                record["freed"] = [getattr(caches[i], "slot", None) for i in live[:2]]
            for i in live[:2]:
                caches[i] = None
            live, chunks = live[2:], chunks[2:]
        if step == rejoin_at:
            caches.append(make_cache())
            if record is not None:
                record["rejoined"] = getattr(caches[-1], "slot", None)
            chunks.append((torch.arange(7) * 3) % V)
            live.append(len(caches) - 1)
        if step == update_at:
            with torch.no_grad():
                model.model.layers[0].mlp.experts[0].down_proj.weight.mul_(1.5)
        out.append(torch.cat(model.engine_step([caches[i] for i in live], chunks, last_only=True)))
    return first + out


# ------------------------------------------------------------------------------------------------- CPU
def test_default_sizes_pad_to_multiples_of_eight():
    assert default_sizes(1) == [1]
    assert default_sizes(4) == [1, 2, 4]
    assert default_sizes(5) == [1, 2, 4, 8]
    assert default_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_sizes(33)[-1] == 40


def test_pooled_caches_give_the_bits_of_caches_of_their_own():
    """The eager path writes a pooled sequence's keys, values and conv prefixes into its slot (what a graph step
    reads): same rows as caches with their own buffers, through chunked prefill and decode."""
    model = _model()
    pools = SlotPools(model, slots=6, capacity=64)
    prompts, tokens = _script(steps=12)
    fp = model.kernels.fingerprint
    from isoexec.model.cache import SequenceCache

    slots = iter(range(6))
    plain = _decode(model, prompts, tokens, model.new_cache, join_at=4)
    pooled = _decode(model, prompts, tokens, lambda: SequenceCache(policy=fp, pools=pools, slot=next(slots)), join_at=4)
    assert all(torch.equal(a, b) for a, b in zip(plain, pooled))
    k, _ = pools.kv_pools(3)
    assert k[0, : len(prompts[0])].abs().sum() > 0  # the slots hold the keys (not a silent fallback)
    assert pools.conv_pool(0)[1].abs().sum() > 0


def test_a_sequence_in_a_slot_another_gave_back_gets_the_bits_of_a_cache_of_its_own():
    """Two sequences leave (their caches dropped give their slots back), another joins in one of those slots, whose
    keys, values and conv prefix still hold the old sequence's: every row equals the run with caches of their own."""
    model = _model()
    pools = SlotPools(model, slots=8, capacity=96)
    prompts, tokens = _script()
    kw = dict(join_at=10, leave_at=20, rejoin_at=25)
    rec = {}
    pooled = _decode(model, prompts, tokens, lambda: pools.new_cache(model.kernels.fingerprint), record=rec, **kw)
    own = _model()
    plain = _decode(own, prompts, tokens, own.new_cache, **kw)
    assert rec["rejoined"] in rec["freed"]
    assert all(torch.equal(a, b) for a, b in zip(plain, pooled))
    # what the rows do not read is there: the old sequence's keys past the new one's last position (7 + 14 tokens)
    k, _ = pools.kv_pools(3)
    assert k[rec["rejoined"], 22:36].abs().sum() > 0


def test_a_sequence_beyond_the_pool_capacity_is_refused_before_any_state_moves():
    """Refused before any layer runs: the refused sequence then continues as its twin that never saw the step (the
    check inside the attention layer came after the GDN layers had moved the sequence's states)."""
    model = _model()
    pools = SlotPools(model, slots=2, capacity=8)
    a, b = pools.new_cache(model.kernels.fingerprint), pools.new_cache(model.kernels.fingerprint)
    for c in (a, b):
        model.engine_step([c], [torch.arange(5)])
    with pytest.raises(ValueError, match="a sequence of 10 tokens does not fit the decode pools' capacity of 8 tokens"):
        model.engine_step([a], [torch.arange(5)])
    ra, rb = (model.engine_step([c], [torch.tensor([7])])[0] for c in (a, b))
    assert torch.equal(ra, rb) and a.position == b.position == 6


def test_pool_slots_are_reused_when_their_caches_go_and_a_full_pool_gives_caches_of_their_own():
    model = _model()
    pools = SlotPools(model, slots=2, capacity=16)
    fp = model.kernels.fingerprint
    a, b = pools.new_cache(fp), pools.new_cache(fp)
    extra = pools.new_cache(fp)
    assert {a.slot, b.slot} == {0, 1} and extra.pools is None and pools.free_slots() == 0
    slot_a = a.slot
    del a
    assert pools.free_slots() == 1
    c = pools.new_cache(fp)
    assert c.pools is pools and c.slot == slot_a


def test_graphs_refuse_a_cpu_model_in_one_line():
    with pytest.raises(ValueError, match="CUDA-graph decode needs a model on CUDA with the isoexec CUDA kernel set; "
                                         "this one is on cpu"):
        DecodeGraphs(_model(), max_seqs=4, max_len=64)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_graph_decode_equals_eager_bitwise_and_native_differs():
    """Five sequences (padded to 8), 40 steps with C = 16 (every sequence completes chunks at its own steps), a
    sequence joining with its prefill (an eager step), two leaving (another captured size) and a third joining in a
    slot one of them gave back, an in-place update of an
    expert weight (a row of the stack the graphs read: no capture again): every full-vocabulary fp32 row equal to the
    eager model's."""
    prompts, tokens = _script()
    kw = dict(join_at=10, leave_at=20, rejoin_at=25, update_at=30)
    eager = _model(device="cuda")
    graphed = _model(device="cuda")
    graphs = graphed.enable_decode_graphs(max_seqs=8, max_len=96)
    a = _decode(eager, prompts, tokens, eager.new_cache, **kw)
    rec = {}
    b = _decode(graphed, prompts, tokens, graphed.new_cache, record=rec, **kw)
    assert len(a) == len(b) == 41
    unequal = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
    assert not unequal, f"graph rows differ from eager rows at steps {unequal}"
    assert rec["rejoined"] in rec["freed"]  # the rejoining sequence decodes in a slot another sequence held
    assert graphs.stats["replays"] == 38  # every decode step but the two joining ones
    assert graphs.stats["chunk_completions"] > 0
    assert graphs.stats["captures"] == 4  # sizes 8, 4, 2, 1 at the first step, none after the update
    native = _model("native", device="cuda")
    c = _decode(native, prompts, tokens, native.new_cache, **kw)
    assert sum(not torch.equal(x, z) for x, z in zip(a, c)) > 20  # negative control


@pytest.mark.gpu
def test_graph_rows_do_not_depend_on_the_other_sequences():
    """One sequence alone (padded to 1) and beside seven others (size 8): the same rows, step by step."""
    prompts, tokens = _script(lens=(7, 12, 3, 25, 4, 9, 16, 2), steps=20)
    model = _model(device="cuda")
    model.enable_decode_graphs(max_seqs=8, max_len=64)
    many = _decode(model, prompts, tokens, model.new_cache)
    one = _decode(model, prompts[:1], tokens[:, :2], model.new_cache)
    assert all(torch.equal(m[:1], o) for m, o in zip(many, one))


def test_replacing_any_parameter_of_the_model_moves_the_epoch_the_graphs_check():
    """The decode graphs read parameters by address: a replaced one (here the GDN decay ``A_log``, held by its layer
    itself, not by a weight holder) must bump ``W.epoch``; an in-place update must not (the graphs see it)."""
    from isoexec.model.layers import W

    model = _model()
    gdn = model.model.layers[0].linear_attn
    e0 = W.epoch
    with torch.no_grad():
        gdn.A_log.mul_(1.0)
    assert W.epoch == e0
    gdn.A_log = torch.nn.Parameter(gdn.A_log.detach().clone())
    assert W.epoch > e0
