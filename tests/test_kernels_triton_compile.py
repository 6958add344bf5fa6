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


@pytest.mark.parametrize("flat", [False, True], ids=["unrolled", "flat"])
@pytest.mark.parametrize("leaf_k", [64, 128])
def test_leaf_gemm_in_register_tree_keeps_every_addition_for_sm90(leaf_k, flat):
    from isoexec.kernels.gemm.triton import _leaf_gemm_kernel

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_ym": "i32", "stride_we": "i32", "stride_ys": "i32", "tile_e_ptr": "*i32",
           "tile_r0_ptr": "*i32", "tile_r1_ptr": "*i32", "n_tiles": "i32", "kpl": "i32"}
    consts = {"LEAF_K": leaf_k, "LPP": 8, "FLAT": flat, "GROUPED": False, "BM": 128, "BN": 64, "BK": 64, "GM": 8,
              "PREC": "ieee"}
    # unrolled: 8 leaf loops, 7 tree additions; flat: one K loop whose leaf ends climb the tree's three
    # levels (one addition each). A folded addition would disappear into a dot's accumulator.
    assert _tile_addf(_leaf_gemm_kernel, sig, consts) == ((1, 3) if flat else (8, 7))


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
