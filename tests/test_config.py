"""Experiment config validation: every bad input fails at load, naming the key."""

import re
from pathlib import Path

import pytest

from isoexec.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", ["cpu-tiny", "ci-tiny", "h200", "h200-rlstep"])
def test_shipped_experiments_load(name):
    assert load_config(f"experiments/{name}.yaml").name == name


@pytest.mark.parametrize(
    "body, key",
    [
        ("kernels: {chunk_sise: 64}", "chunk_sise"),  # typo
        ("kernels: {set: fancy}", "set"),
        ("kernels: {chunk_size: -8}", "chunk_size"),
        ("kernels: {row_tile: 0}", "row_tile"),
        ("kernels: {temperature: 0}", "temperature"),
        ("kernels: {vocab_block: 100}", "vocab_block"),
        ("rl: {steps: 0}\n", "rl.steps=0"),  # every mode x seed is a run of at least one step
        ("sft: {steps: 0}\n", "sft.steps=0"),  # the SFT metrics are measured on a trained checkpoint
        ("rl: {seeds: []}", "seeds"),
        ("rl: {modes: []}", "modes"),
        ("rl: {temperature: 0.7}", "rl.temperature"),
        ("model: {num_experts: 2, num_experts_per_tok: 4}", "num_experts_per_tok"),
        ("gates: {min_len: 50, max_len: 10}", "gates.max_len"),
        ("device: cuda\nkernels: {chunk_size: 24}", "kernels.chunk_size=24"),
        ("device: cuda\nkernels: {kv_block: 8}", "kernels.kv_block=8"),
        ("kernels: {triton: {gdn_scan_bv: 12}}", "gdn_scan_bv=12"),
        ("kernels: {triton: {gemm_bfloat16: [128, 96, 64, 8, 3]}}", "gemm_bfloat16 tile 96"),
        ("kernels: {triton: {gemm_bfloat16: [128, 128, 64, 6, 3]}}", "gemm_bfloat16 num_warps 6"),
        ("kernels: {triton: {gdn_scan_warps: 3}}", "gdn_scan_warps=3"),
        # what pydantic's lax mode would convert silently
        ("kernels: {triton: {gdn_scan_bv: true}}", "gdn_scan_bv=True: a boolean where a number is expected"),
        ("kernels: {triton: {gdn_scan_bv: '16'}}", "gdn_scan_bv='16': a string where an integer is expected"),
        ("kernels: {triton: {gdn_prep_split: 'yes'}}", "gdn_prep_split='yes': expected true or false"),
        ("rl: {steps: true}", "steps=True: a boolean where a number is expected"),
        # a typo inside a bucket names the bucket's keys; a section's own check names its key, not the whole section
        ("kernels: {triton: {pik_bfloat16_by_leaf_k: [{max_leaf_k: 64, loop: paired, tiles: [64, 64, 64, 4, 3], "
         "program_leaves: 8, loads: tma}]}}",
         "kernels.triton.pik_bfloat16_by_leaf_k.0.loads='tma': unknown key; allowed: max_leaf_k, max_rows, loop, tiles"),
        ("kernels: {triton: {pik_loop: gluon_pipelined, pik_gemm_bfloat16: [32, 64, 64, 4, 3]}}",
         "kernels.triton: kernels.triton.pik_gemm_bfloat16: loop gluon_pipelined with BM=32"),
        ("trainer: {backend: hf}", "cannot run mode isoexec"),
        ("trainer: {backend: {native: hf}}", "no entry for mode 'isoexec'"),
        ("trainer: {backend: megatronn}", "backend"),
        ("engine: {backend: sglang}", "backend"),
        ("rl: {interleave: steps}", "rl.interleave='steps': Input should be 'step' or 'run'"),
        ("rl: {driver: loop, interleave: step}", "rl.interleave='step' runs the arms' SkyRL trainers in turns: only "
         "the SkyRL driver runs it"),
        # settings one arm of a paired run cannot honour
        ("model: {tie_word_embeddings: true}", "model.tie_word_embeddings=true cannot be honoured by the native arm"),
        ("engine: {enable_prefix_caching: true}", "engine.enable_prefix_caching=true cannot be honoured by the isoexec arm"),
    ],
)
def test_bad_values_fail_at_load_naming_the_key(tmp_path, body, key):
    p = _write(tmp_path, f"name: t\n{body}\n")
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(p)


def test_name_cannot_escape_results(tmp_path):
    with pytest.raises(ValueError, match="name"):
        load_config(_write(tmp_path, "name: ../../etc\n"))


def test_duplicate_section_is_refused(tmp_path):
    with pytest.raises(ValueError, match="duplicate key 'engine'"):
        load_config(_write(tmp_path, "name: t\nengine: {max_num_seqs: 4}\nengine: {max_num_seqs: 8}\n"))


def test_missing_file_and_malformed_yaml(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(_write(tmp_path, "name: [unclosed\n"))


def test_constants_come_from_the_config_only(tmp_path):
    """The Triton launch constants and the CPU tiles are config fields; a CPU config may keep
    constants only the Triton set can refuse (they are checked for the device that runs them)."""
    cfg = load_config(_write(tmp_path, "name: t\nkernels: {chunk_size: 24, triton: {gdn_scan_bv: 16}}\n"))
    assert cfg.kernels.chunk_size == 24 and cfg.kernels.triton.gdn_scan_bv == 16
    assert cfg.trainer.backend_for("native") == "hf" and cfg.trainer.backend_for("isoexec") == "unified"


def test_megatron_layout_problems_are_named_once_with_the_modes_they_concern(tmp_path):
    """TP=3 on cpu-tiny's model: each size it cannot split is one problem (both modes share it); the isoexec
    set's topology claim is isoexec's alone."""
    body = (ROOT / "experiments" / "cpu-tiny.yaml").read_text().replace("\n  tp: 2\n", "\n  tp: 3\n")
    with pytest.raises(ValueError) as e:
        load_config(_write(tmp_path, body.replace("name: cpu-tiny", "name: tp3")))
    msg = str(e.value)
    assert msg.count("linear_num_value_heads=2 is not divisible by tp=3") == 1, msg
    assert "this model splits at tp in [1, 2] (ep 1) and at ep in [1, 2, 4] (tp 1), of 1..16" in msg, msg  # what works
    assert "mode native" not in msg and "Layout(" not in msg, msg
    assert "mode isoexec: trainer layout tp3_sp: tp=3 is outside the isoexec kernel set's proven domain" in msg, msg


def test_gemm_row_buckets_pick_by_rows_and_must_ascend():
    """The first bucket that holds the rows picks program and tiles; unsorted buckets are refused."""
    import torch
    from pydantic import ValidationError

    from isoexec.config import TritonSection
    from isoexec.kernels.gemm.triton import program_for

    ok = TritonSection(gemm_bfloat16=(128, 256, 64, 8, 3), gemm_kernel="persistent_tma", gemm_bfloat16_by_rows=[
        {"max_rows": 64, "program": "tiled", "tiles": (64, 128, 64, 4, 4)},
        {"max_rows": 512, "program": "persistent_tma", "tiles": (128, 128, 64, 8, 4)}])
    assert program_for(ok, torch.bfloat16, 1) == ("tiled", (64, 128, 64, 4, 4))
    assert program_for(ok, torch.bfloat16, 65) == ("persistent_tma", (128, 128, 64, 8, 4))
    assert program_for(ok, torch.bfloat16, 513) == ("persistent_tma", (128, 256, 64, 8, 3))
    assert program_for(ok, torch.float32, 1) == ("tiled", tuple(ok.gemm_float32))
    with pytest.raises(ValidationError, match=r"max_rows \[512, 64\] must be strictly ascending"):
        TritonSection(gemm_bfloat16_by_rows=[{"max_rows": 512, "program": "tiled", "tiles": (64, 128, 64, 4, 4)},
                                             {"max_rows": 64, "program": "tiled", "tiles": (64, 128, 64, 4, 4)}])


def test_leaf_buckets_pick_by_leaf_width_and_rows_and_are_checked():
    """The first leaf-width bucket that holds K / leaves picks loop, tiles, leaves per program, top and loads for bf16 launches
    of the in-register tree (more rows than pik_split_rows, or the tree forced); a bucket with max_rows for launches of
    at most that many rows (before pik_split_rows decides); the forced split launch, fp32 and wider leaves keep the pik_*
    constants; the contract records the buckets (rows where set) only when some are pinned, and not their loop or loads
    (same bits); unsorted buckets, another
    BK and a leaves-per-program that is no power of two are refused, naming the value."""
    import torch
    from pydantic import ValidationError

    from isoexec.config import TritonSection
    from isoexec.kernels.gemm.triton import leaf_constants, leaf_program_for

    b64 = {"max_leaf_k": 64, "loop": "paired", "tiles": (64, 64, 64, 4, 2), "program_leaves": 8}
    b512 = {"max_leaf_k": 512, "loop": "paired", "tiles": (128, 128, 64, 8, 3), "program_leaves": 4, "top": "in_kernel"}
    b512t = {**b512, "loop": "flat_paired", "load": "tma"}
    r256 = {"max_rows": 256, "max_leaf_k": 256, "loop": "paired", "tiles": (64, 64, 64, 4, 3), "program_leaves": 1}
    r256w = {"max_rows": 256, "max_leaf_k": 512, "loop": "paired", "tiles": (128, 128, 64, 8, 3), "program_leaves": 2}
    plain = TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4))
    ok = TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4), pik_bfloat16_by_leaf_k=[r256, r256w, b64, b512])
    bf = torch.bfloat16
    assert leaf_program_for(ok, bf, 64, 600) == ("paired", (64, 64, 64, 4, 2), 8, "combine", "pointer")
    assert leaf_program_for(ok, bf, 128, 600) == ("paired", (128, 128, 64, 8, 3), 4, "in_kernel", "pointer")
    assert leaf_program_for(ok, torch.float16, 512, 600) == ("paired", (128, 128, 64, 8, 3), 4, "in_kernel", "pointer")
    assert leaf_program_for(ok, bf, 1024, 600) == ("flat", (64, 64, 64, 4, 4), 8, "combine", "pointer")
    assert leaf_program_for(ok, bf, 64, 600, split=True) == ("flat", (64, 64, 64, 4, 4), 1, "combine", "pointer")
    assert leaf_program_for(ok, torch.float32, 64, 600) == ("flat", tuple(ok.pik_gemm_float32), 8, "combine", "pointer")
    # by rows: 256 rows with leaves of 256 and 512 features; 257-512 rows and wider leaves: the split launch
    assert leaf_program_for(ok, bf, 256, 256) == ("paired", (64, 64, 64, 4, 3), 1, "combine", "pointer")
    assert leaf_program_for(ok, bf, 512, 1) == ("paired", (128, 128, 64, 8, 3), 2, "combine", "pointer")
    assert leaf_program_for(ok, bf, 512, 300) == ("flat", (64, 64, 64, 4, 4), 1, "combine", "pointer")
    assert leaf_program_for(ok, bf, 1024, 8) == ("flat", (64, 64, 64, 4, 4), 1, "combine", "pointer")
    assert leaf_program_for(ok, bf, 512, 256, split=False) == ("paired", (128, 128, 64, 8, 3), 4, "in_kernel", "pointer")
    assert leaf_program_for(ok, torch.float32, 256, 256) == ("flat", tuple(ok.pik_gemm_float32), 1, "combine", "pointer")
    assert leaf_program_for(ok, bf, 256, 256, grouped=True) == ("flat", (64, 64, 64, 4, 4), 1, "combine", "pointer")  # dense only
    assert leaf_program_for(ok, bf, 512, 600, grouped=True) == ("paired", (128, 128, 64, 8, 3), 4, "in_kernel", "pointer")
    tma = TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4), pik_bfloat16_by_leaf_k=[b64, b512t])
    assert leaf_program_for(tma, bf, 512, 600) == ("flat_paired", (128, 128, 64, 8, 3), 4, "in_kernel", "tma")
    assert leaf_constants(tma, bf, 8) == leaf_constants(TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4),
                                                                      pik_bfloat16_by_leaf_k=[b64, b512]), bf, 8)
    assert "leaf_k_buckets" not in leaf_constants(plain, bf, 8)
    assert leaf_constants(ok, bf, 8)["leaf_k_buckets"] == (
        "rows<=256:leaf_k<=256:64x64x64:4w:3s;rows<=256:leaf_k<=512:128x128x64:8w:3s;"
        "leaf_k<=64:64x64x64:4w:2s;leaf_k<=512:128x128x64:8w:3s")
    assert "leaf_k_buckets" not in leaf_constants(ok, torch.float32, 8)
    with pytest.raises(ValidationError, match=r"max_leaf_k \[512, 64\] of the buckets without max_rows must be strictly"):
        TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4), pik_bfloat16_by_leaf_k=[b512, b64])
    with pytest.raises(ValidationError, match=r"\(max_rows, max_leaf_k\) \[\(256, 512\), \(256, 256\)\] of the buckets with"):
        TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4), pik_bfloat16_by_leaf_k=[r256w, r256])
    with pytest.raises(ValidationError, match=r"pik_bfloat16_by_leaf_k\[0\].tiles BK=32 differs from pik_gemm_bfloat16's 64"):
        TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4), pik_bfloat16_by_leaf_k=[{**b64, "tiles": (64, 64, 32, 4, 2)}])
    with pytest.raises(ValidationError, match=r"pik_bfloat16_by_leaf_k\[0\].program_leaves=3"):
        TritonSection(pik_bfloat16_by_leaf_k=[{**b64, "program_leaves": 3}])
    with pytest.raises(ValidationError, match=r"top"):
        TritonSection(pik_bfloat16_by_leaf_k=[{**b64, "top": "tree_combine"}])
    with pytest.raises(ValidationError, match=r"load"):
        TritonSection(pik_bfloat16_by_leaf_k=[{**b64, "load": "cp_async"}])
    # the Gluon program: whole warp groups of 64 rows, a TMA ring; the same bucket with allowed values passes
    gl = {**b64, "loop": "gluon_pipelined", "load": "tma", "program_leaves": 4}
    TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4), pik_bfloat16_by_leaf_k=[gl])
    for bad in ({"tiles": (64, 64, 64, 2, 4)}, {"tiles": (32, 64, 64, 4, 4)}, {"tiles": (64, 64, 64, 4, 1)}, {"load": "pointer"}):
        with pytest.raises(ValidationError, match=r"pik_bfloat16_by_leaf_k\[0\]: loop gluon_pipelined with .*allowed: BM >= 64"):
            TritonSection(pik_gemm_bfloat16=(64, 64, 64, 4, 4), pik_bfloat16_by_leaf_k=[{**gl, **bad}])
    with pytest.raises(ValidationError, match=r"pik_gemm_bfloat16: loop gluon_pipelined with BM=32"):
        TritonSection(pik_gemm_bfloat16=(32, 64, 64, 4, 4), pik_loop="gluon_pipelined")


def test_triton_section_refuses_the_cpr_backward_launch_that_faults_on_the_h200():
    from isoexec.config import TritonSection

    with pytest.raises(ValueError, match="gdn_bwd_warps=8 with gdn_bwd_bv=16"):
        TritonSection(gdn_bwd_warps=8, gdn_bwd_bv=16)
    assert TritonSection(gdn_bwd_warps=8, gdn_bwd_bv=32).gdn_bwd_bv == 32


def _isoexec_only(body: str) -> str:
    """An experiment YAML trained in isoexec mode only: rl.modes [isoexec], no arms section (its arm is native's)."""
    return re.sub(r"\narms:\n(  .*\n)*", "\n", body).replace("modes: [native, isoexec]", "modes: [isoexec]")


def test_trainer_cp_outside_the_proven_domain_or_in_native_mode_is_refused_at_load(tmp_path):
    """trainer.cp: 2 loads for isoexec; cp 3, cp 2 with tp 4, and cp 2 for the native mode (Megatron's own
    modules have no CP) are refused at load, naming what works."""
    body = (ROOT / "experiments" / "cpu-tiny.yaml").read_text().replace("name: cpu-tiny", "name: cp")
    iso = _isoexec_only(body)
    assert load_config(_write(tmp_path, iso.replace("\n  tp: 2\n", "\n  tp: 2\n  cp: 2\n"))).trainer.layout().cp == 2
    with pytest.raises(ValueError, match=r"cp=3 is outside the isoexec kernel set's proven domain \[1, 2, 4\]"):
        load_config(_write(tmp_path, iso.replace("\n  tp: 2\n", "\n  tp: 2\n  cp: 3\n")))
    wide = body.replace("linear_num_value_heads: 2", "linear_num_value_heads: 4").replace(
        "linear_num_key_heads: 2", "linear_num_key_heads: 4").replace("num_attention_heads: 2", "num_attention_heads: 4")
    with pytest.raises(ValueError, match=r"tp=4 with cp=2 is outside the degrees proven together with context "
                                         r"parallelism: tp in \[1, 2\]"):
        load_config(_write(tmp_path, _isoexec_only(wide).replace(
            "\n  tp: 2\n", "\n  tp: 4\n  cp: 2\n")))
    with pytest.raises(ValueError, match=r"mode native: trainer.cp=2: .*no context parallelism.*run mode native at "
                                         r"cp=1"):
        load_config(_write(tmp_path, body.replace("\n  tp: 2\n", "\n  tp: 2\n  cp: 2\n")))


def test_interleave_defaults_to_steps_under_skyrl_on_cpu_and_runs_elsewhere(tmp_path):
    assert load_config(_write(tmp_path, "name: t\n")).interleave == "step"
    assert load_config(_write(tmp_path, "name: t\nrl: {driver: loop}\n")).interleave == "run"
    assert load_config(_write(tmp_path, "name: t\nrl: {interleave: run}\n")).interleave == "run"
    assert load_config("experiments/h200-rl.yaml").interleave == "run"  # cuda: unmeasured there
    assert load_config("experiments/cpu-tiny.yaml").interleave == "step"
