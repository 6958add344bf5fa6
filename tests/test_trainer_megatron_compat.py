"""The Megatron trainer's upstream workarounds apply by device: CPU fixes only on a CPU, the CUDA fix only on
CUDA (CPU-side logic, tested on the CPU)."""

import pytest
import torch

from isoexec.trainer.megatron import compat


def test_cpu_workarounds_are_keyed_to_the_cpu_and_the_fla_backward_fix_to_cuda():
    cpu, cuda = set(compat.fixes("cpu")), set(compat.fixes("cuda"))
    only_cpu = {"fla_stand_in", "current_device_cpu", "inference_rng_tracker"}
    assert only_cpu <= cpu and not only_cpu & cuda
    assert "fla_chunk_torch_backward" in cuda and "fla_chunk_torch_backward" not in cpu
    assert {"te_general_gemm", "jit_fuser_off"} <= cpu & cuda  # no Transformer Engine; fusions off on both
    with pytest.raises(ValueError, match="device='tpu'; allowed"):
        compat.fixes("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU process's fixes")
def test_a_cpu_process_runs_the_cpu_fixes_and_refuses_the_cuda_ones():
    compat.apply()
    import megatron.core.ssm.gated_delta_net as gdn

    assert compat.DEVICE == "cpu" and torch.cuda.current_device() == "cpu"
    assert gdn.chunk_gated_delta_rule is gdn.torch_chunk_gated_delta_rule
    with pytest.raises(RuntimeError, match="applied in this process; cannot switch to 'cuda'"):
        compat.apply("cuda")


def test_fla_chunk_wrapper_keeps_fla_forward_bits_with_the_torch_chunk_gradient():
    """Fix 9 on CPU tensors: a stand-in "fla" forward that differs from the torch chunk (negative control:
    the outputs differ), while the gradients are exactly the torch chunk's."""
    compat.apply()
    import megatron.core.ssm.gated_delta_net as gdn

    torch_chunk = gdn.torch_chunk_gated_delta_rule

    def fake_fla(q, k, v, g, beta, **kw):
        return (torch_chunk(q, k, v, g=g, beta=beta, **kw)[0] + 1e-3, None)

    chunk = compat.fla_chunk_with_torch_backward(fake_fla, torch_chunk)
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 1, 70, 2, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=gen)
    g = -torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    ref_ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    out, state = chunk(*ins[:3], g=ins[3], beta=ins[4], use_qk_l2norm_in_kernel=False)
    ref = torch_chunk(*ref_ins[:3], g=ref_ins[3], beta=ref_ins[4], use_qk_l2norm_in_kernel=False)[0]
    assert state is None
    assert torch.equal(out, fake_fla(q, k, v, g, beta)[0]) and not torch.equal(out, ref)
    w = torch.randn(out.shape, generator=gen)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ins, ref_ins))
    with pytest.raises(ValueError, match="empty state"):
        chunk(q, k, v, g=g, beta=beta, output_final_state=True)
