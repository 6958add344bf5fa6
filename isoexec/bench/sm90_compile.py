"""The leaf GEMM (pik row-parallel regions) and CPR's candidates compiled for Hopper on any machine, no GPU:
what limits each loop shape and tile choice before it is timed.

``python -m isoexec.bench.sm90_compile --out results/h200/leaf_gemm/sm90_compile/compile.csv``
``python -m isoexec.bench.sm90_compile --kernels cpr_chunkwise --out results/h200/cpr_chunkwise/sm90_compile/compile.csv``
(the in-chunk output program of :mod:`isoexec.kernels.gdn.triton_chunkwise` at Dv blocks 32-128 and 4 or 8 warps, after
today's token scan ``_scan`` at ``experiments/h200.yaml``'s launch for reference, at the Qwen3.5 GDN head: Dk = Dv = 128)
``python -m isoexec.bench.sm90_compile --kernels cpr_prep --out results/h200/cpr_prep_split/sm90_compile/compile.csv``
(CPR's chunk prep in one launch and in the two of ``gdn_prep_split``, and the Triton backward's four kernels)

Each candidate (``pik_loop``, tiles BM x BN x BK, warps, stages, leaves per program; the Gluon program of
:mod:`isoexec.kernels.gemm.gluon_leaf` last) is compiled by Triton for sm90
as its JIT specializes a launch at the model's shapes (16-byte aligned pointers; the integer arguments it specializes
multiples of 16), and its PTX assembled by the ptxas that Triton bundles (``-arch=sm_90a -v``). One CSV row per candidate, after two rows of the column GEMM's program (``loop``
``column``) for reference:

* ``registers``, ``spill_store_bytes``, ``spill_load_bytes``: per thread, from ptxas; ``shared_bytes``: Triton's
  shared memory per program (the pipeline's stages of operand tiles);
* ``ctas_per_sm``: programs one SM can hold by registers (65,536 per SM) and shared memory (232,448 bytes);
* ``dots``: tensor-core dots in the TTGIR; ``dot_waits``: the ``pendings`` of each wait on them (0 = every dot
  before finished; in a K loop it means no tensor-core work overlaps the next step's issue); ``async_loads``:
  asynchronous global-to-shared copies by pointers (prologue and loop); ``tma_loads``: TMA copies (``load: tma``).

The same numbers hold on the GPU only for the same Triton version (``provenance.json`` records it; the H200 node runs
Triton 3.6.0, which installs on a CPU machine: ``pip install --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LEAF_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "flag_ptr": "*i32", "M": "i32",
                  "N": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_we": "i32", "stride_ys": "i32",
                  "tile_e_ptr": "*i32", "tile_r0_ptr": "*i32", "tile_r1_ptr": "*i32", "n_tiles": "i32", "kpl": "i32"}


def leaf_launch(consts: dict, tma: bool = False) -> tuple[dict, dict]:
    """(signature, constexprs) of the leaf GEMM with ``consts`` (LEAF_K ... PREC) and pointer loads (the descriptor
    arguments None, compile-time) or TMA loads (host descriptors of the ``[BM, BK]`` and ``[BN, BK]`` bf16 tiles)."""
    if tma:
        bm, bn, bk = consts["BM"], consts["BN"], consts["BK"]
        return ({**LEAF_SIGNATURE, "x_desc": f"tensordesc<bf16[{bm},{bk}]>", "w_desc": f"tensordesc<bf16[{bn},{bk}]>"},
                {**consts, "TMA": True})
    return ({**LEAF_SIGNATURE, "x_desc": "constexpr", "w_desc": "constexpr"},
            {**consts, "x_desc": None, "w_desc": None, "TMA": False})


TILES = ((64, 64, 64, 4, 4), (64, 64, 64, 4, 3), (64, 64, 64, 4, 2), (128, 64, 64, 8, 3), (128, 64, 64, 8, 2),
         (128, 128, 64, 8, 3))
REGISTERS_PER_SM, SHARED_PER_SM = 65536, 232448


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """Compile the Triton or Gluon kernel ``fn`` for sm90 without a GPU and read its resources.

    Args:
        fn: a ``triton.jit`` or ``gluon.jit`` function. signature: its run-time arguments' Triton types
            (``"*bf16"``, ``"i32"``).
        constexprs: its compile-time arguments. num_warps, num_stages: the launch's.

    Returns:
        The module docstring's columns (``registers`` ... ``tma_loads``).

    Raises:
        RuntimeError: ptxas printed no register count (its output attached).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    # what the JIT assumes of a launch at the model's shapes: 16-byte aligned tensors, and every integer it
    # specializes (all but ``do_not_specialize``: row counts, kpl) a multiple of 16
    skip = {p.name for p in fn.params if p.do_not_specialize}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a, t in signature.items() if t.startswith("*") or (t == "i32" and a not in skip)}
    source = triton.compiler.ASTSource
    if fn.is_gluon():  # a Gluon kernel's module carries its warps from the start (triton.experimental.gluon)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature={**signature, **{c: "constexpr" for c in constexprs}}, constexprs=constexprs,
                 attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas gave no register count:\n{log[-2000:]}")
    ttgir = k.asm["ttgir"]
    r, smem = int(regs.group(1)), int(k.metadata.shared)
    return {"registers": r, "spill_store_bytes": int(spills.group(1)), "spill_load_bytes": int(spills.group(2)),
            "shared_bytes": smem,
            "ctas_per_sm": min(REGISTERS_PER_SM // (r * 32 * num_warps), SHARED_PER_SM // max(smem, 1)),
            "dots": len(re.findall(r"warp_group_dot ", ttgir)),
            "dot_waits": ";".join(re.findall(r"warp_group_dot_wait .*pendings = (\d+)", ttgir)),
            "async_loads": len(re.findall(r"async_copy_global_to_local", ttgir)),
            "tma_loads": len(re.findall(r"async_tma_copy_global_to_local", ttgir))}


COLUMN_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                    "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_we": "i32",
                    "tile_e_ptr": "*i32", "tile_r0_ptr": "*i32", "tile_r1_ptr": "*i32", "n_tiles": "i32"}


def column_rows() -> list[dict]:
    """The reference: the column GEMM's tile program (no leaves, one K loop; ``tiled``) at the leaf GEMM's pinned tiles
    and at the column GEMM's, compiled by :func:`compile_sm90`."""
    from isoexec.kernels.gemm.triton import _gemm_kernel

    rows = []
    for bm, bn, bk, nw, ns in ((64, 64, 64, 4, 4), (128, 128, 64, 8, 3)):
        consts = {"GROUPED": False, "BM": bm, "BN": bn, "BK": bk, "GM": 8, "PREC": "ieee"}
        rows.append({"loop": "column", "tiles": f"{bm}x{bn}x{bk}", "num_warps": nw, "num_stages": ns,
                     "leaves_per_program": None, "leaf_k": None,
                     **compile_sm90(_gemm_kernel, COLUMN_SIGNATURE, consts, nw, ns)})
    return rows


def leaf_rows(leaf_k: int = 512) -> list[dict]:
    """The bf16 leaf GEMM (leaves of ``leaf_k`` features: h200-rlstep's 4096 / 8) compiled by :func:`compile_sm90` at
    every :data:`TILES`: the one-leaf program of the split launch (``unrolled``, 1 leaf), the flat and paired loops at
    8, 4 and 2 leaves per program, the paired loop with the top in the kernel (four leaves), then with TMA loads the
    paired and flat_paired loops at eight leaves and at four with the top in the kernel."""
    from isoexec.kernels.gemm.triton import _leaf_gemm_kernel

    rows = []
    for loop, counts in (("unrolled", (1,)), ("flat", (8, 4, 2)), ("paired", (8, 4, 2))):
        for bm, bn, bk, nw, ns in TILES:
            for lpp in counts:
                consts = {"LEAF_K": leaf_k, "LPP": lpp, "LOOP": loop, "GROUPED": False, "TOP": 0, "BM": bm, "BN": bn, "BK": bk,
                          "GM": 8, "PREC": "ieee"}
                rows.append({"loop": loop, "tiles": f"{bm}x{bn}x{bk}", "num_warps": nw, "num_stages": ns,
                             "leaves_per_program": lpp, "leaf_k": leaf_k, "top": "combine", "load": "pointer",
                             **compile_sm90(_leaf_gemm_kernel, *leaf_launch(consts), nw, ns)})
    for bm, bn, bk, nw, ns in TILES:  # two subtrees of four leaves per tile, the top added in the kernel
        consts = {"LEAF_K": leaf_k, "LPP": 4, "LOOP": "paired", "GROUPED": False, "TOP": 2, "BM": bm, "BN": bn,
                  "BK": bk, "GM": 8, "PREC": "ieee"}
        rows.append({"loop": "paired", "tiles": f"{bm}x{bn}x{bk}", "num_warps": nw, "num_stages": ns,
                     "leaves_per_program": 4, "leaf_k": leaf_k, "top": "in_kernel", "load": "pointer",
                     **compile_sm90(_leaf_gemm_kernel, *leaf_launch(consts), nw, ns)})
    # TMA loads (the candidates of isoexec.bench.variants_gpu): the paired and flat_paired loops, 8 leaves per program
    # and two subtrees of four with the top in the kernel
    for loop in ("paired", "flat_paired"):
        for bm, bn, bk, nw, ns in TILES:
            for lpp, top in ((8, 0), (4, 2)):
                consts = {"LEAF_K": leaf_k, "LPP": lpp, "LOOP": loop, "GROUPED": False, "TOP": top, "BM": bm, "BN": bn,
                          "BK": bk, "GM": 8, "PREC": "ieee"}
                rows.append({"loop": loop, "tiles": f"{bm}x{bn}x{bk}", "num_warps": nw, "num_stages": ns,
                             "leaves_per_program": lpp, "leaf_k": leaf_k, "top": "in_kernel" if top else "combine",
                             "load": "tma", **compile_sm90(_leaf_gemm_kernel, *leaf_launch(consts, tma=True), nw, ns)})
    return rows


def gluon_leaf_launch(consts: dict, num_warps: int) -> tuple[dict, dict]:
    """(signature, constexprs) of :func:`isoexec.kernels.gemm.gluon_leaf._leaf_gemm_gluon_kernel` with ``consts``
    (LEAF_K, LPP, TOP, GM, STAGES and the tiles BM, BN, BK) at ``num_warps``: bf16 host TMA descriptors of the tiles,
    as the JIT mangles them."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    def desc(block):
        t = torch.empty(256, 4096, dtype=torch.bfloat16)
        return mangle_type(TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                            gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)))

    c = dict(consts)
    bm, bn, bk = c.pop("BM"), c.pop("BN"), c.pop("BK")
    sig = {"x_desc": desc([bm, bk]), "w_desc": desc([bn, bk]), "y_ptr": "*bf16", "part_ptr": "*fp32",
           "flag_ptr": "*i32", "M": "i32", "N": "i32", "stride_ym": "i32", "stride_ys": "i32", "kpl": "i32"}
    return sig, {**c, "num_warps": num_warps}


def gluon_rows(leaf_k: int = 512) -> list[dict]:
    """The Gluon leaf program (``loop`` ``gluon_pipelined``) compiled by :func:`compile_sm90` at the tiles of its
    variants candidates: four leaves per program with the top in the kernel, and two leaves per program at 128x128
    (four tiles of fp32 live at four leaves: 128x128 spills), with the top two levels in tree_combine or in the kernel
    (four subtrees per tile)."""
    from isoexec.kernels.gemm.gluon_leaf import _leaf_gemm_gluon_kernel

    rows = []
    for (bm, bn, bk, nw, ns), lpp, top in (((128, 64, 64, 8, 4), 4, 2), ((128, 64, 64, 8, 3), 4, 2),
                                          ((64, 64, 64, 4, 4), 4, 2), ((64, 64, 64, 4, 3), 4, 2),
                                          ((128, 128, 64, 8, 4), 2, 0), ((128, 128, 64, 8, 3), 4, 2),
                                          ((128, 128, 64, 8, 4), 2, 4)):
        consts = {"LEAF_K": leaf_k, "LPP": lpp, "TOP": top, "GM": 8, "STAGES": ns, "BM": bm, "BN": bn, "BK": bk}
        rows.append({"loop": "gluon_pipelined", "tiles": f"{bm}x{bn}x{bk}", "num_warps": nw, "num_stages": ns,
                     "leaves_per_program": lpp, "leaf_k": leaf_k, "top": "in_kernel" if top else "combine",
                     "load": "tma", **compile_sm90(_leaf_gemm_gluon_kernel, *gluon_leaf_launch(consts, nw), nw, ns)})
    return rows


CHUNKWISE_SIGNATURE = {"q_ptr": "*fp32", "k_ptr": "*fp32", "g_ptr": "*fp32", "w_ptr": "*fp32", "u_ptr": "*fp32",
                       "e_ptr": "*fp32", "o_ptr": "*fp32", "meta_ptr": "*i32", "H": "i32", "scale": "fp32"}
SCAN_SIGNATURE = {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "g_ptr": "*fp32", "b_ptr": "*fp32",
                  "o_ptr": "*fp32", "run_ptr": "*fp32", "e_ptr": "*fp32", "f_ptr": "*fp32", "meta_ptr": "*i32", "H": "i32",
                  "scale": "fp32"}


def chunkwise_rows(config: str = "experiments/h200.yaml", dk: int = 128, dv: int = 128) -> list[dict]:
    """Today's token scan at the launch ``config`` pins (``kernels.triton``), then the chunkwise candidate's in-chunk
    output program at Dv blocks 32, 64, 128 and 4 or 8 warps (``config``'s chunk size and dot precision), compiled by
    :func:`compile_sm90`."""
    from isoexec.config import load_config
    from isoexec.kernels.gdn.triton import _scan
    from isoexec.kernels.gdn.triton_chunkwise import _chunk_out

    exp = load_config(config)
    cfg, C = exp.kernels.triton, exp.kernels.chunk_size
    rows = [{"kernel": "_scan (recurrent)", "block_v": cfg.gdn_scan_bv, "num_warps": cfg.gdn_scan_warps,
             **compile_sm90(_scan, SCAN_SIGNATURE, {"DK": dk, "DV": dv, "BV": cfg.gdn_scan_bv}, cfg.gdn_scan_warps, 1)}]
    for bv in (32, 64, 128):
        for nw in (4, 8):
            consts = {"C": C, "DK": dk, "DV": dv, "BV": bv, "PREC": cfg.gdn_dot_precision}
            rows.append({"kernel": "_chunk_out (chunkwise)", "block_v": bv, "num_warps": nw,
                         **compile_sm90(_chunk_out, CHUNKWISE_SIGNATURE, consts, nw, 1)})
    return rows


PREP_SIGNATURE = {**{n: "*fp32" for n in ("k_ptr", "v_ptr", "g_ptr", "b_ptr", "bk_ptr", "bv_ptr", "bg_ptr", "bb_ptr")},
                  "meta_ptr": "*i32", "w_ptr": "*fp32", "u_ptr": "*fp32", "kd_ptr": "*fp32", "dc_ptr": "*fp32",
                  "H": "i32"}


def prep_rows(config: str = "experiments/h200.yaml", dk: int = 128, dv: int = 128) -> list[dict]:
    """CPR's chunk prep (:func:`isoexec.kernels.gdn.triton._chunk_prep`) at the ``config`` pins, in one launch
    (``PART`` 0) and split in two (``gdn_prep_split``: 1, W / KD / decay totals; 2, U), at 4 and 8 warps, then the
    Triton backward's kernels (:func:`backward_rows`), compiled by :func:`compile_sm90`."""
    from isoexec.config import load_config
    from isoexec.kernels.gdn.triton import _chunk_prep

    exp = load_config(config)
    cfg, C = exp.kernels.triton, exp.kernels.chunk_size
    rows = []
    for part in (0, 1, 2):
        for nw in (4, 8):
            consts = {"C": C, "BT": min(C, 16), "DK": dk, "DV": dv, "PREC": cfg.gdn_dot_precision, "PART": part}
            rows.append({"kernel": "_chunk_prep", "part": part, "num_warps": nw,
                         **compile_sm90(_chunk_prep, PREP_SIGNATURE, consts, nw, 3)})
    return rows + backward_rows(cfg, C, dk, dv)


def backward_rows(cfg, C: int, dk: int, dv: int) -> list[dict]:
    """The Triton CPR backward's four kernels (:mod:`isoexec.kernels.gdn.triton_backward`) at the launches
    ``cpr_gdn_backward`` makes with ``cfg`` (``TritonSection``), compiled by :func:`compile_sm90`; pointer arguments
    fp32 (int32 for the metadata), ``H`` and ``NVB`` int32, ``scale`` fp32."""
    import inspect

    from isoexec.kernels.gdn import triton_backward as tb

    def signature(fn) -> dict:
        out = {}
        for n in inspect.signature(fn.fn).parameters:
            if n.endswith("_ptr"):
                out[n] = "*i32" if "meta" in n else "*fp32"
            elif n in ("H", "NVB"):
                out[n] = "i32"
            elif n == "scale":
                out[n] = "fp32"
        return out

    bt, bv, prec = min(C, 16), min(cfg.gdn_bwd_bv, dv), cfg.gdn_dot_precision
    blocks = {"C": C, "DK": dk, "DV": dv, "BV": bv, "PREC": prec}
    launches = ((tb._bwd_prep, {"C": C, "BT": bt, "LOG2_BT": bt.bit_length() - 1, "LOG2_NB": (C // bt).bit_length() - 1,
                                "DK": dk, "DV": dv, "PREC": prec, "TPREC": "tf32x3"}, cfg.gdn_bwd_prep_warps, 3),
                (tb._bwd_chain, blocks, cfg.gdn_bwd_warps, 1), (tb._bwd_dv, blocks, cfg.gdn_bwd_warps, 3),
                (tb._bwd_dqk, blocks, cfg.gdn_bwd_warps, 3))
    return [{"kernel": fn.fn.__name__, "part": "", "num_warps": nw, **compile_sm90(fn, signature(fn), consts, nw, ns)}
            for fn, consts, nw, ns in launches]


def main(argv: list[str] | None = None) -> None:
    import json

    import triton

    from isoexec.io import atomic_write_text, write_csv
    from isoexec.provenance import provenance

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", required=True, help="CSV path; provenance.json is written beside it")
    p.add_argument("--kernels", choices=("leaf", "cpr_chunkwise", "cpr_prep"), default="leaf",
                   help="the leaf GEMM's loops and tiles, the chunkwise CPR candidate, or CPR's chunk prep in one or "
                   "two launches and its backward's kernels (default: %(default)s)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.is_dir():
        p.error(f"--out {out}: a folder; give the CSV's path (e.g. {out / 'compile.csv'})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tables = {"leaf": lambda: column_rows() + leaf_rows() + gluon_rows(), "cpr_chunkwise": chunkwise_rows,
              "cpr_prep": prep_rows}
    write_csv(out, tables[a.kernels]())
    from triton.backends.nvidia.compiler import get_ptxas_version

    prov = {**provenance(), "triton_imported": triton.__version__, "triton_path": triton.__file__,
            "ptxas": get_ptxas_version(90).strip().splitlines()[-1], "target": "cuda sm90 (ptxas -arch=sm_90a)"}
    atomic_write_text(out.parent / "provenance.json", json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
