"""The leaf GEMM's tree survives compilation for Hopper (sm90): compiled ahead of time on the CPU, no GPU.

Triton folds ``dot(a, b, 0) + s`` into ``dot(a, b, s)`` (its dot-combine pattern). In the leaf GEMM that
would move a tree addition into the tensor-core accumulator of the next leaf, so the in-register tree
would no longer add the same fp32 numbers as the one-leaf-per-program launch and the TP partials (seen on
an H200 for bf16 leaves of one 64-wide K step). The negative control shows the fold on a kernel whose
leaf loop has a compile-time trip count of one.
"""

import re

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def _tile_addf(kernel, signature: dict, constexprs: dict, num_warps: int = 8) -> tuple[int, int]:
    """(dot ops, fp32 tile additions) in the sm90 TTGIR of ``kernel``."""
    from triton.backends.compiler import GPUTarget

    sig = {**signature, **{c: "constexpr" for c in constexprs}}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ttgir"]
    bm, bn = constexprs["BM"], constexprs["BN"]
    return (len(re.findall(r"warp_group_dot |tt\.dot ", ttgir)),
            len(re.findall(rf"arith\.addf .*tensor<{bm}x{bn}xf32", ttgir)))


@triton.jit
def _folding_leaves(x_ptr, y_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    r = tl.arange(0, BM)
    c = tl.arange(0, BN)
    k = tl.arange(0, BK)
    s0 = tl.zeros((BM, BN), dtype=tl.float32)
    s1 = tl.zeros((BM, BN), dtype=tl.float32)
    for j in tl.static_range(2):
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for it in range(0, 1):  # compile-time trip count of one: the loop folds away
            a = tl.load(x_ptr + (j * BM + r)[:, None] * BK + k[None, :])
            b = tl.load(x_ptr + k[:, None] * BN + c[None, :])
            acc = tl.dot(a, b, acc)
        if j == 0:
            s0 = acc
        else:
            s1 = s0 + acc
    tl.store(y_ptr + r[:, None] * BN + c[None, :], s1)


def test_constant_one_step_leaf_loop_folds_the_tree_add_into_the_dot_negative_control():
    dots, adds = _tile_addf(_folding_leaves, {"x_ptr": "*bf16", "y_ptr": "*fp32"}, {"BM": 128, "BN": 64, "BK": 64})
    assert dots == 2 and adds == 0


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("loop", ["unrolled", "flat", "paired", "flat_paired"])
@pytest.mark.parametrize("leaf_k", [64, 128])
def test_leaf_gemm_in_register_tree_keeps_every_addition_for_sm90(leaf_k, loop, tma):
    from isoexec.bench.sm90_compile import leaf_launch
    from isoexec.kernels.gemm.triton import _leaf_gemm_kernel

    consts = {"LEAF_K": leaf_k, "LPP": 8, "LOOP": loop, "GROUPED": False, "TOP": 0, "BM": 128, "BN": 64, "BK": 64, "GM": 8,
              "PREC": "ieee"}
    # unrolled: 8 leaf loops, 7 tree additions; flat: one K loop whose leaf ends climb the tree's three
    # levels (one addition each); paired and flat_paired: two dots, then the same three levels' additions.
    # A folded addition would disappear into a dot's accumulator. Pointer or TMA loads: the same.
    want = {"unrolled": (8, 7), "flat": (1, 3), "paired": (2, 3), "flat_paired": (2, 3)}[loop]
    assert _tile_addf(_leaf_gemm_kernel, *leaf_launch(consts, tma)) == want


@pytest.mark.parametrize("tma", [False, True])
def test_leaf_gemm_tma_loads_replace_the_pointer_loads_for_sm90(tma):
    """``load: tma`` compiles the paired loop's operand tiles to TMA copies and no pointer copies; pointer loads
    (negative control) the other way round."""
    from isoexec.bench.sm90_compile import compile_sm90, leaf_launch
    from isoexec.kernels.gemm.triton import _leaf_gemm_kernel

    consts = {"LEAF_K": 512, "LPP": 4, "LOOP": "paired", "GROUPED": True, "TOP": 2, "BM": 128, "BN": 64, "BK": 64,
              "GM": 8, "PREC": "ieee"}
    r = compile_sm90(_leaf_gemm_kernel, *leaf_launch(consts, tma), 8, 3)  # as the JIT specializes a launch
    assert (r["tma_loads"] > 0, r["async_loads"] > 0, r["spill_store_bytes"]) == (tma, not tma, 0), r


@pytest.mark.parametrize("lpp,top", [(2, 0), (4, 0), (4, 2), (2, 4)])  # eight leaves spill (five fp32 tiles)
def test_gluon_leaf_program_keeps_one_wgmma_in_flight_across_leaves_and_every_tree_addition_for_sm90(lpp, top):
    """The Gluon leaf program (``loop: gluon_pipelined``) compiles for sm90 with one wgmma wait per K step that leaves
    that step's group in flight (``pendings = 1``, also at each leaf's first step, where the previous leaf climbs the
    tree) and a single full wait, for the last leaf; the tree keeps its LPP - 1 fp32 tile additions (+ 1 with two
    subtrees' top in the kernel, + 2 with four's), none folded into an accumulator. The Triton paired loop (negative control,
    :func:`test_paired_leaf_loop_keeps_two_tensor_core_dots_in_flight_for_sm90`) waits fully once per pair."""
    from isoexec.bench.sm90_compile import compile_sm90, gluon_leaf_launch
    from isoexec.kernels.gemm.gluon_leaf import _leaf_gemm_gluon_kernel
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = {"LEAF_K": 128, "LPP": lpp, "TOP": top, "GM": 8, "STAGES": 3, "BM": 64, "BN": 64, "BK": 64}
    sig, cx = gluon_leaf_launch(consts, 4)
    r = compile_sm90(_leaf_gemm_gluon_kernel, sig, cx, 4, 3)
    waits = [int(p) for p in r["dot_waits"].split(";")]
    assert (r["dots"], sorted(waits), r["spill_store_bytes"]) == (2 * lpp, [0] + [1] * (2 * lpp), 0), r
    ttgir = triton.compile(GluonASTSource(fn=_leaf_gemm_gluon_kernel, signature={**sig, **{c: "constexpr" for c in cx}},
                                          constexprs=cx), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ttgir"]
    assert len(re.findall(r"arith\.addf .*tensor<64x64xf32", ttgir)) == lpp - 1 + {0: 0, 2: 1, 4: 2}[top]


@pytest.mark.parametrize("top", [0, 2, 4])
def test_leaf_gemm_top_in_kernel_adds_each_left_subtree_once_for_sm90(top):
    """Four leaves per program, paired, two or four subtrees per tile: with ``TOP`` 2 the tile's second program adds the
    first's fp32 partial after its own climb (the pair loop's two climb additions, levels 0 and 1, + 1; the partial
    released and acquired through atomics); with ``TOP`` 4 the left nodes of two levels are released and acquired
    (+ 2 additions, two release and two acquire sites); without it (negative control) the climb's only, no atomics:
    the top is tree_combine's."""
    from isoexec.bench.sm90_compile import leaf_launch
    from isoexec.kernels.gemm.triton import _leaf_gemm_kernel
    from triton.backends.compiler import GPUTarget

    sig, consts = leaf_launch({"LEAF_K": 512, "LPP": 4, "LOOP": "paired", "GROUPED": False, "TOP": top, "BM": 128, "BN": 64,
                               "BK": 64, "GM": 8, "PREC": "ieee"})
    assert _tile_addf(_leaf_gemm_kernel, sig, consts) == (2, 2 + {0: 0, 2: 1, 4: 2}[top])
    sig = {**sig, **{c: "constexpr" for c in consts}}
    ttgir = triton.compile(triton.compiler.ASTSource(fn=_leaf_gemm_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ttgir"]
    atomics = (len(re.findall(r"tt\.atomic_rmw exch, release", ttgir)), len(re.findall(r"tt\.atomic_cas acquire", ttgir)))
    assert atomics == {0: (0, 0), 2: (1, 1), 4: (2, 2)}[top], atomics


def _dot_waits(loop: str) -> list[int]:
    """The ``pendings`` of every tensor-core wait in the sm90 TTGIR of the leaf GEMM with ``loop``, compiled as the
    JIT specializes it (:func:`isoexec.bench.sm90_compile.compile_sm90`), the pinned h200 tiles 64x64x64, 4 warps,
    4 stages."""
    from isoexec.bench.sm90_compile import compile_sm90, leaf_launch
    from isoexec.kernels.gemm.triton import _leaf_gemm_kernel

    consts = {"LEAF_K": 512, "LPP": 8, "LOOP": loop, "GROUPED": False, "TOP": 0, "BM": 64, "BN": 64, "BK": 64, "GM": 8,
              "PREC": "ieee"}
    return [int(p) for p in compile_sm90(_leaf_gemm_kernel, *leaf_launch(consts), 4, 4)["dot_waits"].split(";")]


def test_paired_leaf_loop_keeps_two_tensor_core_dots_in_flight_for_sm90():
    """In the paired loop's K steps the two leaves' wgmma chains stay in flight (the wait inside the loop leaves
    2 pending); the only full wait is the pair's, before its leaves climb the tree."""
    assert sorted(_dot_waits("paired")) == [0, 2]


def test_flat_leaf_loop_waits_for_every_dot_negative_control():
    """The flat loop reads its accumulator in the loop (the tree climb at a leaf's last step), so Triton waits for
    each K step's dot before the next (its only wait: ``pendings = 0``, in the loop)."""
    assert _dot_waits("flat") == [0]


@pytest.mark.parametrize("kc", [2, 4])
def test_conv1d_kernel_compiles_for_sm90_with_one_fma_chain_per_output(kc):
    """The gdn.conv1d kernel (one launch over every piece) compiles for Hopper, and each output element's tap
    sum is tap 0's product then KC-1 fused multiply-adds in tap order: as many ``fma.rn.f32`` as KC-1 per
    element, per element one ``add`` (the SiLU's 1 + exp)."""
    from triton.backends.compiler import GPUTarget

    from isoexec.kernels.conv.triton import _conv_kernel

    consts = {"KC": kc, "BT": 16, "BC": 128}
    sig = {"ext_ptr": "*bf16", "first_ptr": "*i64", "w_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32", "CH": "i32",
           **{c: "constexpr" for c in consts}}
    src = triton.compiler.ASTSource(fn=_conv_kernel, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    fma, add = len(re.findall(r"\bfma\.rn\.f32\b", ptx)), len(re.findall(r"\badd\.(?:rn\.)?f32\b", ptx))
    assert add > 0 and fma == (kc - 1) * add, (fma, add)


def test_chunk_prep_in_two_launches_spills_less_than_in_one_for_sm90():
    """CPR's chunk prep at the Qwen3.5 head (Dk = Dv = 128, C = 64, 4 warps): one launch (``PART`` 0) spills
    registers on sm90 (ncu on an H100: about 2 million spill requests, results/h200/counters_15762cc_h100); each of the
    two launches of ``gdn_prep_split`` (W / KD / decay totals, then U) spills less."""
    from isoexec.bench.sm90_compile import PREP_SIGNATURE, compile_sm90
    from isoexec.kernels.gdn.triton import _chunk_prep

    spills = [compile_sm90(_chunk_prep, PREP_SIGNATURE, {"C": 64, "BT": 16, "DK": 128, "DV": 128, "PREC": "tf32",
                                                         "PART": part}, 4, 3)["spill_store_bytes"] for part in (0, 1, 2)]
    assert spills[0] > 0 and spills[1] < spills[0] and spills[2] < spills[0], spills
