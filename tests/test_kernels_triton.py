"""GPU gates of the Triton kernel set: each kernel's bits for a row do not depend on the
batch, the row's position or the execution mode; each bitwise test has its native negative control.

All tests need CUDA (marked ``gpu``; skipped elsewhere with a reason by conftest)."""

import pytest
import torch
import torch.nn.functional as F

from isoexec.config import TritonSection

pytestmark = pytest.mark.gpu
DEV = "cuda"
CFG = TritonSection()


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_kernel_sets_registered_for_cuda_with_sm90_composition():
    from isoexec.kernels import build_kernel_set

    ks = build_kernel_set("isoexec", "cuda")
    assert ks.arch == "sm90" and ks["gdn.core"].impl_id == "isoexec.triton.cpr_gated_delta_rule"
    assert ks["lm_head"].constants_for(torch.bfloat16)["tile_m"] == CFG.gemm_bfloat16[0]
    assert build_kernel_set("native", "cuda")["attn.core"].impl_id == "native.torch.sdpa"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_row_bits_independent_of_batch_size_and_position(dtype):
    from isoexec.kernels.gemm.triton import linear

    x = torch.randn(513, 1024, device=DEV, dtype=dtype)
    w = torch.randn(3072, 1024, device=DEV, dtype=dtype) * 0.02
    ref = linear(x[7:8], w, CFG)[0]
    for rows in (slice(0, 8), slice(7, 300), slice(0, 513)):
        i = 7 - (rows.start or 0)
        assert torch.equal(linear(x[rows], w, CFG)[i], ref)
    assert _rel(linear(x, w, CFG).float(), (x.double() @ w.double().T).float()) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("program", ["tiled", "persistent_tma"])
def test_gemm_programs_row_bits_independent_of_batch_size(program):
    from isoexec.kernels.gemm.triton import linear

    cfg = CFG.model_copy(update={"gemm_kernel": program})
    x = torch.randn(700, 1024, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device=DEV, dtype=torch.bfloat16) * 0.03
    full = linear(x, w, cfg)
    assert all(torch.equal(linear(x[r], w, cfg)[0], full[r.start]) for r in (slice(3, 4), slice(3, 67), slice(3, 700)))
    assert _rel(full.float(), (x.double() @ w.double().T).float()) < 1e-2


def test_gemm_row_buckets_give_the_bits_of_the_pinned_tiles_and_another_order_does_not():
    """Rows of a GEMM of few rows (decode) run other programs and tiles (``gemm_bfloat16_by_rows``)
    with the bits of the pinned ones; another summation order (two pik leaves) differs (negative control)."""
    from isoexec.config import GemmRowBucket
    from isoexec.kernels.gemm.triton import linear, linear_leaves

    buckets = (GemmRowBucket(max_rows=64, program="tiled", tiles=(64, 64, 32, 4, 4)),
               GemmRowBucket(max_rows=512, program="persistent_tma", tiles=(128, 256, 64, 8, 4)))
    pinned = CFG.model_copy(update={"gemm_kernel": "persistent_tma", "gemm_bfloat16": (128, 128, 64, 8, 4)})
    by_rows = pinned.model_copy(update={"gemm_bfloat16_by_rows": buckets})
    x = torch.randn(700, 1024, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3072, 1024, device=DEV, dtype=torch.bfloat16) * 0.03
    ref = linear(x, w, pinned)
    for m in (1, 3, 64, 65, 300, 512, 513, 700):
        assert torch.equal(linear(x[:m], w, by_rows), ref[:m]), m
    assert not torch.equal(linear_leaves(x[:64], w, pinned, 2), ref[:64])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [512, 2048])  # bf16 leaves of one 64-wide K step (512) and of four (2048)
@pytest.mark.parametrize("program_leaves", [8, 2])
@pytest.mark.parametrize("loop", ["flat", "paired", "flat_paired", "gluon_pipelined"])
def test_leaf_gemm_bitwise_across_tp_subtrees_and_launches(dtype, k, program_leaves, loop):
    """pik at TP 1, 2, 4, 8 on one GPU: each rank's leaf subtree from its K shard, the rank partials
    added by the same tree, equal the TP=1 leaf GEMM; every launch (one leaf per program, all eight, or
    ``pik_program_leaves`` with the levels above in the combine kernel), every loop shape (``pik_loop``) and
    every batch give the same row."""
    from isoexec.kernels.gemm.triton import linear_leaves, linear_leaves_partial, tree_combine

    cfg = CFG.model_copy(update={"pik_program_leaves": program_leaves, "pik_loop": loop})
    x = torch.randn(333, k, device=DEV, dtype=dtype)
    w = torch.randn(1024, k, device=DEV, dtype=dtype) * 0.02
    full = linear_leaves(x, w, cfg, 8, split=False)
    assert torch.equal(full, linear_leaves(x, w, cfg, 8, split=True))
    assert torch.equal(full, linear_leaves(x, w, CFG, 8, split=False))  # eight leaves per program, the pinned loop
    assert torch.equal(linear_leaves(x[200:201], w, cfg, 8)[0], full[200])
    for tp in (2, 4, 8):
        s = k // tp
        parts = torch.stack([linear_leaves_partial(x[:, r * s:(r + 1) * s], w[:, r * s:(r + 1) * s], cfg, 8 // tp)
                             for r in range(tp)])
        assert torch.equal(tree_combine(parts, dtype), full)
    assert _rel(full.float(), (x.double() @ w.double().T).float()) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("top,loop,load,lpp", [("combine", "paired", "pointer", 4), ("in_kernel", "paired", "pointer", 4),
                                               ("in_kernel", "paired", "tma", 4), ("in_kernel", "flat_paired", "tma", 4),
                                               ("in_kernel", "gluon_pipelined", "tma", 4),
                                               ("in_kernel", "paired", "tma", 2), ("in_kernel", "gluon_pipelined", "tma", 2)])
def test_leaf_k_buckets_give_the_bits_of_the_pinned_program_and_another_tree_does_not(top, loop, load, lpp):
    """Launches whose leaf width (and, for decode, rows) falls in a ``pik_bfloat16_by_leaf_k`` bucket (other loop,
    tiles, loads, leaves per program, and the two or four subtrees of a tile added in tree_combine or in the leaf
    kernel, ``top``) give
    the pinned program's rows at every width of the h200 configs' buckets, in every launch, at 1 and 256 rows, at TP 2
    and in the grouped (expert) launch; four leaves instead of eight and cuBLAS's ``F.linear`` differ (negative
    controls)."""
    from isoexec.config import LeafKBucket
    from isoexec.kernels.gemm.triton import grouped_linear_leaves, linear_leaves, linear_leaves_partial, tree_combine

    pinned = CFG.model_copy(update={"pik_gemm_bfloat16": (64, 64, 64, 4, 4), "pik_loop": "flat", "pik_program_leaves": 8})
    lt = {"loop": loop, "load": load}
    buckets = (LeafKBucket(max_rows=256, max_leaf_k=256, tiles=(64, 64, 64, 4, 3), program_leaves=1, **lt),
               LeafKBucket(max_rows=256, max_leaf_k=512, tiles=(128, 128, 64, 8, 3), program_leaves=lpp, top=top, **lt),
               LeafKBucket(max_leaf_k=64, tiles=(64, 64, 64, 4, 2), program_leaves=8, **lt),
               LeafKBucket(max_leaf_k=128, tiles=(64, 64, 64, 4, 3), program_leaves=lpp, top=top, **lt),
               LeafKBucket(max_leaf_k=256, tiles=(128, 64, 64, 8, 3), program_leaves=8, **lt),
               LeafKBucket(max_leaf_k=512, tiles=(128, 128, 64, 8, 3), program_leaves=lpp, top=top, **lt))
    by_k = pinned.model_copy(update={"pik_bfloat16_by_leaf_k": buckets})
    for k in (512, 1024, 2048, 4096):
        x = torch.randn(600, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(1024, k, device=DEV, dtype=torch.bfloat16) * 0.02
        ref = linear_leaves(x, w, pinned, 8, split=False)
        assert torch.equal(linear_leaves(x, w, by_k, 8, split=False), ref), k
        assert torch.equal(linear_leaves(x, w, by_k, 8), ref), k  # 600 rows > pik_split_rows: the bucket's launch
        assert torch.equal(linear_leaves(x, w, by_k, 8, split=True), ref), k
        for m in (1, 256):  # the rows buckets (leaves of 256 and 512), the split launch for the others
            assert torch.equal(linear_leaves(x[:m], w, by_k, 8), ref[:m]), (k, m)
        parts = torch.stack([linear_leaves_partial(x[:, r * k // 2:(r + 1) * k // 2], w[:, r * k // 2:(r + 1) * k // 2],
                                                   by_k.model_copy(update={"pik_split_rows": 0}), 4) for r in range(2)])
        assert torch.equal(tree_combine(parts, torch.bfloat16), ref), k
        full = linear_leaves_partial(x, w, by_k.model_copy(update={"pik_split_rows": 0}), 8)  # fp32, one rank of all 8
        assert torch.equal(full.to(torch.bfloat16), ref), k
        counts = torch.tensor([250, 0, 350], device=DEV)
        ws = torch.stack([w, w.flip(0), w * 0.5])
        g = grouped_linear_leaves(x, ws, counts, by_k, 8, split=False)
        assert torch.equal(g, torch.cat([ref[:250], linear_leaves(x[250:], ws[2], pinned, 8, split=False)])), k
    assert not torch.equal(linear_leaves(x, w, by_k, 4), ref)
    assert not torch.equal(F.linear(x, w), ref)


@pytest.mark.parametrize("loop,load,lpp", [("paired", "pointer", 4), ("paired", "tma", 4), ("gluon_pipelined", "tma", 4),
                                          ("paired", "tma", 2), ("gluon_pipelined", "tma", 2)])
def test_leaf_top_in_kernel_over_many_waves_gives_the_pinned_bits(loop, load, lpp, monkeypatch):
    """``top: in_kernel`` at a trainer shape (10240 rows: 1,280 tiles of 128x128, two programs each at four leaves per
    program, four at two: about 19 or 39 waves of one CTA per SM on an H100/H200), three times, dense and grouped,
    pointer and TMA loads and the Gluon program: each right node's program waits for its left sibling across waves
    (grid dispatch in increasing order), and the rows equal the pinned program's; no ``tree_combine`` launch runs, and
    the Gluon loop's dense launches run the Gluon program (not the paired fallback); four leaves differ (negative
    control)."""
    from isoexec.config import LeafKBucket
    from isoexec.kernels.gemm import gluon_leaf
    from isoexec.kernels.gemm import triton as tg
    from isoexec.kernels.gemm.triton import grouped_linear_leaves, linear_leaves

    pinned = CFG.model_copy(update={"pik_gemm_bfloat16": (64, 64, 64, 4, 4), "pik_loop": "flat", "pik_program_leaves": 8})
    top = pinned.model_copy(update={"pik_bfloat16_by_leaf_k": (
        LeafKBucket(max_leaf_k=512, loop=loop, tiles=(128, 128, 64, 8, 3), program_leaves=lpp, top="in_kernel",
                    load=load),)})
    x = torch.randn(10240, 4096, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2048, 4096, device=DEV, dtype=torch.bfloat16) * 0.02
    ref = linear_leaves(x, w, pinned, 8)
    combines, gluon_ran, launch = [], [], gluon_leaf.launch
    monkeypatch.setattr(tg, "tree_combine", lambda *a, **k: combines.append(1))
    monkeypatch.setattr(gluon_leaf, "launch", lambda *a, **k: gluon_ran.append(launch(*a, **k)) or gluon_ran[-1])
    for _ in range(3):
        assert torch.equal(linear_leaves(x, w, top, 8), ref)
    assert not combines and gluon_ran == ([True] * 3 if loop == "gluon_pipelined" else [])
    monkeypatch.undo()
    counts = torch.tensor([4000, 0, 6240], device=DEV)
    ws = torch.stack([w, w.flip(0), w * 0.5])
    g = grouped_linear_leaves(x, ws, counts, top, 8)
    assert torch.equal(g, torch.cat([ref[:4000], linear_leaves(x[4000:], ws[2], pinned, 8)]))
    assert not torch.equal(linear_leaves(x, w, top, 4), ref)


def test_row_parallel_cublas_sum_of_shards_differs_negative_control():
    x = torch.randn(4096, 2048, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device=DEV, dtype=torch.bfloat16) * 0.02
    tp2 = F.linear(x[:, :1024], w[:, :1024]) + F.linear(x[:, 1024:], w[:, 1024:])
    assert not torch.equal(tp2, F.linear(x, w))


def test_grouped_leaf_gemm_rows_batch_and_launch_invariant():
    from isoexec.kernels.gemm.triton import grouped_linear_leaves, linear_leaves

    x = torch.randn(300, 512, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(4, 256, 512, device=DEV, dtype=torch.bfloat16) * 0.05
    counts = torch.tensor([100, 0, 150, 50], device=DEV)
    y = grouped_linear_leaves(x, w, counts, CFG, 8, split=True)
    assert torch.equal(y, grouped_linear_leaves(x, w, counts, CFG, 8, split=False))
    two = CFG.model_copy(update={"pik_program_leaves": 2})
    assert torch.equal(y, grouped_linear_leaves(x, w, counts, two, 8, split=False))
    for lpp in (8, 2):
        paired = CFG.model_copy(update={"pik_program_leaves": lpp, "pik_loop": "paired"})
        assert torch.equal(y, grouped_linear_leaves(x, w, counts, paired, 8, split=False))
    assert torch.equal(y[120], grouped_linear_leaves(x[120:121], w[2:3], torch.tensor([1], device=DEV), CFG, 8)[0])
    assert _rel(y[100:250].float(), linear_leaves(x[100:250], w[2], CFG, 8).float()) < 1e-2


def test_cublas_row_bits_depend_on_batch_size_negative_control():
    x = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16)
    assert any(not torch.equal(F.linear(x[:b], w)[0], F.linear(x[:1], w)[0]) for b in (64, 256, 4096))


def test_grouped_gemm_matches_per_expert_rows_bitwise():
    from isoexec.kernels.gemm.triton import grouped_linear, linear

    x = torch.randn(300, 256, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(4, 512, 256, device=DEV, dtype=torch.bfloat16)
    y = grouped_linear(x, w, torch.tensor([100, 0, 150, 50], device=DEV), CFG)
    y2 = grouped_linear(x[100:101], w[2:3], torch.tensor([1], device=DEV), CFG)
    assert torch.equal(y[100], y2[0])
    assert _rel(y[100:250].float(), linear(x[100:250], w[2], CFG).float()) < 1e-6


def test_row_norms_batch_invariant():
    from isoexec.kernels.norm.triton import gated_rms_norm, l2norm, rms_norm

    x = torch.randn(1000, 1024, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(1024, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-6)[500], rms_norm(x[500:501], w, 1e-6)[0])
    z = torch.randn_like(x)
    assert torch.equal(gated_rms_norm(x, z, w, 1e-6)[3], gated_rms_norm(x[3:4], z[3:4], w, 1e-6)[0])
    assert torch.equal(l2norm(x)[999], l2norm(x[999:])[0])


def test_attention_decode_equals_prefill_bitwise_and_sdpa_does_not():
    from isoexec.kernels.attention.native import native_attention
    from isoexec.kernels.attention.triton import attention

    L, hq, hkv, d = 300, 8, 2, 128
    q = torch.randn(L, hq, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(L, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(L, hkv, d, device=DEV, dtype=torch.bfloat16)
    full = attention(q, [(k, v)], [0], [L], 64, CFG.attn_block_m)
    other = torch.randn(50, hq, d, device=DEV, dtype=torch.bfloat16)
    kv2 = (torch.randn(90, hkv, d, device=DEV, dtype=torch.bfloat16),) * 2
    for t in (0, 63, 64, 200, L - 1):
        dec = attention(torch.cat([other, q[t : t + 1]]), [kv2, (k[: t + 1], v[: t + 1])], [40, t], [50, 1], 64, CFG.attn_block_m)
        assert torch.equal(dec[-1], full[t])
    chunk = attention(q[100:170], [(k[:170], v[:170])], [100], [70], 64, CFG.attn_block_m)
    assert torch.equal(chunk, full[100:170])
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(),
                                         v.transpose(0, 1)[None].float(), is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    assert _rel(full.float(), ref) < 1e-2
    nfull = native_attention(q, [(k, v)], [0], [L])
    diffs = [not torch.equal(native_attention(q[t : t + 1], [(k[: t + 1], v[: t + 1])], [t], [1])[0], nfull[t])
             for t in range(200, 300)]
    assert any(diffs)


def _gdn_inputs(T, H=4, dk=128, dv=128):
    q = F.normalize(torch.randn(T, H, dk, device=DEV), dim=-1)
    k = F.normalize(torch.randn(T, H, dk, device=DEV), dim=-1)
    v = torch.randn(T, H, dv, device=DEV)
    g = F.logsigmoid(torch.randn(T, H, device=DEV)) * 0.2
    b = torch.rand(T, H, device=DEV)
    return q, k, v, g, b


def test_cpr_decode_matches_trainer_across_chunk_boundaries_bitwise():
    from isoexec.kernels.gdn.reference import recurrent_reference
    from isoexec.kernels.gdn.triton import cpr_gdn

    C, T = 64, 200
    q, k, v, g, b = _gdn_inputs(T)
    o, _ = cpr_gdn(q, k, v, g, b, [T], [None], C, CFG, keep_state=False)
    ref, _ = recurrent_reference(q.cpu(), k.cpu(), v.cpu(), g.cpu(), b.cpu())
    assert _rel(o.cpu(), ref.float()) < 1e-3
    q2, k2, v2, g2, b2 = _gdn_inputs(77)
    outs = []
    op, st = cpr_gdn(q[:10], k[:10], v[:10], g[:10], b[:10], [10], [None], C, CFG)
    outs.append(op)
    op, st = cpr_gdn(torch.cat([q[10:75], q2]), torch.cat([k[10:75], k2]), torch.cat([v[10:75], v2]),
                     torch.cat([g[10:75], g2]), torch.cat([b[10:75], b2]), [65, 77], [st[0], None], C, CFG)
    outs.append(op[:65])
    s = [st[0]]
    for t in range(75, T):
        ot, s = cpr_gdn(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], b[t : t + 1], [1], s, C, CFG)
        outs.append(ot)
    assert torch.equal(torch.cat(outs), o)



def test_chunkwise_candidate_decode_rows_equal_its_trainer_rows_and_differ_from_the_scan():
    """Issue 37's chunkwise in-chunk output (not in the kernel set): decode's form of a token (the open chunk's rows
    0..t and its entry state, one 64-row tile) gives the trainer's row bit for bit on the GPU's dots; its outputs are
    the recurrence to tf32 accuracy and not the recurrent scan's bits (negative control: a new contract constant)."""
    from isoexec.kernels.gdn.reference import recurrent_reference
    from isoexec.kernels.gdn.triton import cpr_gdn
    from isoexec.kernels.gdn.triton_chunkwise import _prep_and_chain, chunkwise_forward, open_chunk_rows

    C, T = 64, 256
    q, k, v, g, b = _gdn_inputs(T)
    o = chunkwise_forward(q, k, v, g, b, [T], C, CFG)
    ref, _ = recurrent_reference(q.cpu(), k.cpu(), v.cpu(), g.cpu(), b.cpu())
    # four tf32 dots on the output and tf32 prep rows (Triton's tf32 truncates): a looser bound than the scan's 1e-3,
    # as the tf32 CPR backward's 1.9e-3 (results/h200/README.md)
    assert _rel(o.cpu(), ref.float()) < 5e-3
    o_scan, _ = cpr_gdn(q, k, v, g, b, [T], [None], C, CFG, keep_state=False)
    assert not torch.equal(o, o_scan)
    c = 2  # chunk 2: its entry state is the chain's after chunks 0 and 1
    meta = torch.tensor([[0, 0, 0], [C, 0, 0]], dtype=torch.int32, device=DEV)
    _, _, E = _prep_and_chain(k, v, g, b, meta, torch.tensor([[0, 2, -1, 0]], dtype=torch.int32, device=DEV), 2, C, CFG)
    chunk = [x[c * C:(c + 1) * C] for x in (q, k, v, g, b)]
    for t in (0, 17, 40, 63):
        row = open_chunk_rows(*chunk, E[1:2], [t], C, CFG)[0]
        assert torch.equal(row, o[c * C + t]) and _same_bits(row, o[c * C + t]), t
    # two sequences' open chunks in one launch (the chunk before as the second, from its own entry state)
    both = [torch.cat([x, y]) for x, y in zip(chunk, (x[(c - 1) * C:c * C] for x in (q, k, v, g, b)))]
    rows = open_chunk_rows(*both, torch.cat([E[1:2], E[0:1]]), [40, 5], C, CFG)
    assert _same_bits(rows, torch.stack([o[c * C + 40], o[(c - 1) * C + 5]]))
    assert not torch.equal(open_chunk_rows(*chunk, E[0:1], [17], C, CFG)[0], o[c * C + 17])  # another entry state

def _fp64_grads(q, k, v, g, b, do, lengths):
    """Gradients of the fp64 token-by-token reference (per sequence from a zero state), on the CPU."""
    from isoexec.kernels.gdn.reference import recurrent_reference

    ins = [x.detach().cpu().double().requires_grad_() for x in (q, k, v, g, b)]
    outs, r = [], 0
    for n in lengths:
        outs.append(recurrent_reference(*(x[r : r + n] for x in ins))[0])
        r += n
    (torch.cat(outs) * do.cpu().double()).sum().backward()
    return [x.grad for x in ins]


def test_cpr_triton_backward_matches_the_fp64_gradient_and_keeps_the_forward_bits():
    from isoexec.kernels.gdn.native import chunk_reference
    from isoexec.kernels.gdn.triton import cpr_gdn
    from isoexec.kernels.gdn.triton_backward import CPRTritonTrainerFunction

    C, lengths = 64, [150, 64, 37]
    q, k, v, g, b = _gdn_inputs(sum(lengths))
    do = torch.randn_like(v)
    ins = [x.clone().requires_grad_() for x in (q, k, v, g, b)]
    o = CPRTritonTrainerFunction.apply(*ins, lengths, C, CFG)
    assert torch.equal(o, cpr_gdn(q, k, v, g, b, lengths, [None] * 3, C, CFG, keep_state=False)[0])
    got = torch.autograd.grad(o, ins, do)
    ref = _fp64_grads(q, k, v, g, b, do, lengths)
    torch_ins = [x.clone().requires_grad_() for x in (q, k, v, g, b)]
    torch_grads = torch.autograd.grad(chunk_reference(lengths, C, *torch_ins), torch_ins, do)
    for name, gt_, tt, r in zip("q k v g beta".split(), got, torch_grads, ref):
        err, err_torch = _rel(gt_.cpu(), r), _rel(tt.cpu(), r)
        assert err < max(3 * err_torch, 5e-3), (name, err, err_torch)  # tf32 dots


def _capture_after_warm_up(fn):
    """``fn`` captured in a CUDA graph after one warm-up call on a side stream (torch.cuda.graphs' practice; the
    call before capture builds CPR's launch metadata): (graph, the captured call's output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture ends with no kernel in it
@pytest.mark.parametrize("keep_state", [False, True])  # trainer; prefill (fresh pool slots, states kept)
def test_cpr_forward_replays_in_a_cuda_graph_with_the_eager_bits(keep_state):
    """CPR's forward captured after a warm-up replays the eager output bit for bit (full fp32 rows), also after
    the launch-metadata cache turned over (the captured entries stay); replayed on new values in the captured
    inputs it gives a new eager call's bits (negative control: the replay computes, the old bits differ). A call
    whose metadata no call before the capture built is refused in one line."""
    from isoexec.kernels.gdn import triton as t_gdn

    C, lengths = 64, [150, 64, 37]
    q, k, v, g, b = _gdn_inputs(sum(lengths))

    def fwd():
        return t_gdn.cpr_gdn(q, k, v, g, b, lengths, [None] * 3, C, CFG, keep_state=keep_state)[0]

    eager = fwd()
    graph, out = _capture_after_warm_up(fwd)
    for i in range(2 * t_gdn.META_CACHE_SIZE):
        t_gdn.device_meta([i, -1], torch.int32, DEV)
    graph.replay()
    assert torch.equal(out, eager)
    v.copy_(torch.randn_like(v))
    graph.replay()
    assert not torch.equal(out, eager) and torch.equal(out, fwd())
    with pytest.raises(RuntimeError, match="^CPR launch metadata .* not built by a call before capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            t_gdn.cpr_gdn(q, k, v, g, b, [151, 100], [None] * 2, C, CFG, keep_state=keep_state)


def test_cpr_forward_and_backward_replay_in_one_cuda_graph_with_the_eager_bits():
    """The trainer's CPR forward + Triton backward (``torch.autograd.grad`` of ``<o, do>``) captured after a
    warm-up replays the eager gradients bit for bit; a new ``do`` in the captured buffer gives a new eager call's
    gradients (negative control: the old ones differ)."""
    from isoexec.kernels.gdn.triton_backward import CPRTritonTrainerFunction

    C, lengths = 64, [150, 64, 37]
    q, k, v, g, b = _gdn_inputs(sum(lengths))
    do = torch.randn_like(v)

    def fwd_bwd():
        ins = [x.detach().requires_grad_() for x in (q, k, v, g, b)]
        return torch.autograd.grad(CPRTritonTrainerFunction.apply(*ins, lengths, C, CFG), ins, do)

    eager = fwd_bwd()
    graph, out = _capture_after_warm_up(fwd_bwd)
    graph.replay()
    assert all(torch.equal(a, e) for a, e in zip(out, eager))
    do.copy_(torch.randn_like(do))
    graph.replay()
    assert not any(torch.equal(a, e) for a, e in zip(out, eager))
    assert all(torch.equal(a, e) for a, e in zip(out, fwd_bwd()))


def test_fla_chunk_and_recurrent_differ_negative_control():
    pytest.importorskip("fla")
    from isoexec.kernels.gdn.native import fla_gdn

    q, k, v, g, b = _gdn_inputs(130)
    o, _ = fla_gdn(q, k, v, g, b, [130], [None])
    _, st = fla_gdn(q[:129], k[:129], v[:129], g[:129], b[:129], [129], [None])
    od, _ = fla_gdn(q[129:], k[129:], v[129:], g[129:], b[129:], [1], st)
    assert not torch.equal(od[0], o[129])


def test_logprob_rows_batch_invariant_and_correct():
    from isoexec.kernels.logprob.triton import logprob

    x = torch.randn(300, 32768, device=DEV) * 4
    full = logprob(x, 0.7, 2048)
    assert torch.equal(full[123], logprob(x[123:124], 0.7, 2048)[0])
    assert _rel(full, torch.log_softmax(x / 0.7, -1)) < 1e-6


def test_moe_rows_batch_invariant():
    from isoexec.kernels import build_kernel_set

    iso, nat = build_kernel_set("isoexec", "cuda"), build_kernel_set("native", "cuda")

    def moe(ks, x, rw, ex, sh, sg, k):
        w, ids = ks["moe.router"](x, rw, k, True)
        y = ks["moe.experts"](x, ids, ex)
        return ks["moe.combine"](y, w, ids, ks["mlp.shared_expert"](x, sh, sg), x.dtype)

    H, E, I = 256, 8, 128
    bf = torch.bfloat16
    x = torch.randn(333, H, device=DEV, dtype=bf)
    rw = torch.randn(E, H, device=DEV, dtype=bf) * 0.1
    ex = [tuple(torch.randn(*s, device=DEV, dtype=bf) * 0.05 for s in ((I, H), (I, H), (H, I))) for _ in range(E)]
    sh = tuple(torch.randn(*s, device=DEV, dtype=bf) * 0.05 for s in ((I, H), (I, H), (H, I)))
    sg = torch.randn(1, H, device=DEV, dtype=bf) * 0.1
    y = moe(iso, x, rw, ex, sh, sg, 2)
    assert torch.equal(y[200], moe(iso, x[200:201], rw, ex, sh, sg, 2)[0])
    assert _rel(y.float(), moe(nat, x, rw, ex, sh, sg, 2).float()) < 2e-2


@pytest.mark.parametrize("split_rows", [0, 512])  # leaf GEMM: in-register tree (flat K loop) / one leaf per program
def test_moe_experts_run_without_host_sync_and_replay_in_a_cuda_graph(split_rows):
    """The experts region (routing counts, device-built tile tables of a static size, three grouped launches)
    runs with no host sync (CUDA sync debug mode 'error') and is captured in a CUDA graph; replayed on other
    routings (spread, all rows on one expert) it gives the eager bits, and eager equals the per-expert products
    to bf16 accuracy. Negative control: ``torch.bincount``, the counts before, syncs."""
    from isoexec.kernels.moe.triton import _experts, experts_reference

    cfg = CFG.model_copy(update={"pik_split_rows": split_rows})
    E, H, I, n, k = 8, 256, 512, 40, 2
    bf = torch.bfloat16
    x = torch.randn(n, H, device=DEV, dtype=bf)
    ex = [tuple(torch.randn(*s, device=DEV, dtype=bf) * 0.05 for s in ((I, H), (I, H), (H, I))) for _ in range(E)]
    ids = torch.randint(0, E, (n, k), device=DEV)
    routings = [torch.randint(0, E, (n, k), device=DEV), torch.full((n, k), 3, device=DEV),
                torch.randint(0, 2, (n, k), device=DEV) * (E - 1)]
    with torch.no_grad():
        eager = _experts(x, ids, ex, cfg, 8)  # compiles, stacks the weights
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = _experts(x, ids, ex, cfg, 8)
            with pytest.raises(RuntimeError):
                torch.bincount(ids.reshape(-1), minlength=E)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(again, eager)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _experts(x, ids, ex, cfg, 8)
        for r in routings:
            ids.copy_(r)
            graph.replay()
            want = _experts(x, ids, ex, cfg, 8)
            assert torch.equal(out, want)
            assert _rel(want, experts_reference(x, ids, ex)) < 2e-2


# ------------------------------------------------------------------ hardware facts a chunkwise in-chunk CPR needs
# Issue 37's chunkwise candidate (isoexec/kernels/gdn/triton_chunkwise.py) computes a token's in-chunk output as a
# row of one 64-row tile product, in the trainer (all rows real) and in decode (row t real, later rows zero). That
# holds only if (1) an element of a tile dot does not depend on the left operand's other rows, (2) nor on the right
# operand's other columns (Q K^T and the prep's K K^T take later rows of K as columns), and (3) products that are exact
# zeros change no bit. Probed at the candidate's tiles (64 rows, 64 / 128 columns, 4 and 8 warps) and the prep's
# 16-row blocks, through wgmma (bf16, tf32) and the FMA path (fp32 ieee), comparing bits (int32 views: +0 and -0
# differ); the negative control shows a split K reduction does change bits, so the check can fail.
def _tile_dot_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def tile_dot(a_ptr, b_ptr, c_ptr, R: tl.constexpr, K: tl.constexpr, N: tl.constexpr, PREC: tl.constexpr):
        r, k, n = tl.arange(0, R), tl.arange(0, K), tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        tl.store(c_ptr + r[:, None] * N + n[None, :], tl.dot(a, b, input_precision=PREC))

    def run(a, b, prec, num_warps):
        c = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.float32)
        tile_dot[(1,)](a.contiguous(), b.contiguous(), c, R=a.shape[0], K=a.shape[1], N=b.shape[1], PREC=prec,
                       num_warps=num_warps)
        return c

    return run


def _same_bits(x, y):
    return torch.equal(x.view(torch.int32), y.view(torch.int32))


PRECISIONS = [(torch.bfloat16, "tf32"), (torch.float32, "tf32"), (torch.float32, "ieee")]
TILES = [(64, 128, 128, 4), (64, 128, 64, 8), (64, 64, 64, 8), (16, 16, 128, 4), (16, 128, 16, 4)]  # R, K, N, warps


@pytest.mark.parametrize("dtype, prec", PRECISIONS)
@pytest.mark.parametrize("R, K, N, warps", TILES)
def test_tile_dot_elements_do_not_depend_on_other_rows_or_columns(dtype, prec, R, K, N, warps):
    dot = _tile_dot_kernel()
    a, b = torch.randn(R, K, device=DEV).to(dtype), torch.randn(K, N, device=DEV).to(dtype)
    ref = dot(a, b, prec, warps)
    for t in (0, R // 3, R - 1):
        for other in (torch.zeros_like(a), (torch.randn(R, K, device=DEV) * 1e3).to(dtype)):
            a2 = other.clone()
            a2[t] = a[t]
            assert _same_bits(dot(a2, b, prec, warps)[t], ref[t]), ("row", t)
    for s in (0, N // 3, N - 1):
        for other in (torch.zeros_like(b), (torch.randn(K, N, device=DEV) * 1e3).to(dtype)):
            b2 = other.clone()
            b2[:, s] = b[:, s]
            assert _same_bits(dot(a, b2, prec, warps)[:, s], ref[:, s]), ("column", s)


@pytest.mark.parametrize("dtype, prec", PRECISIONS)
@pytest.mark.parametrize("warps", [4, 8])
def test_tile_dot_exact_zero_products_change_no_bit_and_a_split_reduction_does(dtype, prec, warps):
    dot = _tile_dot_kernel()
    # the in-chunk form: row t of (causally masked scores [64, 64]) @ (values [64, 128]); decode has values for
    # rows <= t only, the trainer has all 64: the masked scores make the later rows' products exact zeros
    p = torch.randn(64, 64, device=DEV).tril().to(dtype)
    v = torch.randn(64, 128, device=DEV).to(dtype)
    full = dot(p, v, prec, warps)
    for t in (0, 17, 40, 63):
        v_dec = v.clone()
        v_dec[t + 1:] = 0
        p_dec = p.clone()
        p_dec[t + 1:] = 0  # decode's other rows: not computed yet
        assert _same_bits(dot(p_dec, v_dec, prec, warps)[t], full[t]), t
    # negative control: the same products summed in two halves of K and added outside the dot
    split = dot(p[:, :32], v[:32], prec, warps) + dot(p[:, 32:], v[32:], prec, warps)
    assert torch.allclose(split, full, rtol=1e-2, atol=1e-2) and not _same_bits(split, full)
