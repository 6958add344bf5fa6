"""The Megatron trainer on CUDA with the Triton isoexec set (marked ``gpu``; skipped elsewhere by conftest).

One GPU: the pieces a layout splits (expert and shared-expert SwiGLU shards, pik row-parallel) finished by
the fixed tree equal the single-GPU regions bit for bit; the trainer at TP=1 over NCCL equals the unified
model's engine path on full-vocabulary rows, native Megatron does not. The two-GPU layouts (TP=2 + SP,
EP=2) are ``isoexec.bench.megatron_gpu`` (``workflow/scripts/gpu_run.sh megatron``).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"


def test_expert_and_shared_expert_shards_compose_to_the_single_gpu_regions():
    """experts_partial / swiglu_partial on 1, 2 and 4 intermediate shards, combined by the fixed tree and
    rounded, equal moe.experts / mlp.shared_expert of the Triton set; experts split over two "EP ranks"
    are selected, not summed."""
    from isoexec.config import TritonSection
    from isoexec.kernels.collectives.pik import pik_tree_combine
    from isoexec.kernels.moe.triton import experts, experts_partial, shared_expert, shared_expert_gate, swiglu_partial

    cfg, G, E, H, inter, n, top_k = TritonSection(), 8, 8, 1024, 512, 700, 4
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(n, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    ws = [tuple(torch.randn(*s, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.03
                for s in ((inter, H), (inter, H), (H, inter))) for _ in range(E)]
    ids = torch.stack([torch.randperm(E, device=DEV, generator=gen)[:top_k] for _ in range(n)])
    full = experts(x, ids, ws, cfg, G)
    for etp in (1, 2, 4):
        s = inter // etp
        pieces = []
        for r in range(etp):
            shard = [(wg[r * s:(r + 1) * s], wu[r * s:(r + 1) * s], wd[:, r * s:(r + 1) * s]) for wg, wu, wd in ws]
            halves = [experts_partial(x, ids, list(range(e0, e0 + E // 2)), shard[e0:e0 + E // 2], cfg, G // etp)
                      for e0 in (0, E // 2)]  # two EP ranks
            owner = (ids >= E // 2)[..., None]
            pieces.append(torch.where(owner, halves[1], halves[0]))
        got = pik_tree_combine(pieces).to(x.dtype).float()
        assert torch.equal(got, full), etp
        if etp == 2:  # negative control: shard outputs rounded to bf16, then summed (a native all-reduce)
            assert not torch.equal((pieces[0].to(x.dtype) + pieces[1].to(x.dtype)).float(), full)
    shared = ws[0]
    gate_w = torch.randn(1, H, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.03
    ref = shared_expert(x, shared, gate_w, cfg, G)
    for tp in (1, 2, 4):
        s = inter // tp
        parts = [swiglu_partial(x, shared[0][r * s:(r + 1) * s], shared[1][r * s:(r + 1) * s],
                                shared[2][:, r * s:(r + 1) * s], cfg, G // tp) for r in range(tp)]
        assert torch.equal(shared_expert_gate(x, gate_w, cfg) * pik_tree_combine(parts).to(x.dtype).float(), ref), tp


@pytest.fixture(scope="module")
def one_gpu_group():
    import torch.distributed as dist

    from isoexec.kernels.collectives.gloo import _free_port

    if not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    from isoexec.trainer.megatron.launch import shutdown

    shutdown()


def test_megatron_tp1_isoexec_equals_the_engine_path_native_differs(one_gpu_group):
    """trainer_score and trainer_fwd of the Megatron trainer (Triton set, NCCL group of one) equal the unified
    model's engine path (chunked prefill + decode) on full-vocabulary fp32 rows; native Megatron differs."""
    from transformers import Qwen3NextConfig

    from isoexec.bench.megatron_gpu import run_phase
    from isoexec.config import KernelSection
    from isoexec.model import UnifiedModel
    from isoexec.kernels import build_kernel_set

    cfg = Qwen3NextConfig(
        vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, architectures=["Qwen3NextForCausalLM"])
    section = KernelSection()
    torch.manual_seed(0)
    src = UnifiedModel.from_config(cfg, build_kernel_set("native", "cpu", section), torch.float32)
    with torch.no_grad():
        for name, p in src.named_parameters():
            p.copy_(torch.randn_like(p) * (0.05 if p.dim() > 1 else 0.1) + (1.0 if name.endswith("dt_bias") else 0.0))
    state = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        rows, _ = run_phase("single", cfg, state, section, torch.bfloat16, Path(d), log=lambda r: None,
                            step_batch=(0, 0))
    by = {(r["check"], r["kernel_set"], r["case"]): r for r in rows}
    assert by[("unified_engine_vs_trainer", "isoexec", "engine_step")]["equal"]
    for case in ("trainer_score", "trainer_fwd"):
        assert by[("trainer_vs_engine", "isoexec", case)]["equal"], by[("trainer_vs_engine", "isoexec", case)]
        nat = by[("native_vs_isoexec_engine", "native", case)]
        assert not nat["equal"] and nat["max_abs_diff"] > 0
