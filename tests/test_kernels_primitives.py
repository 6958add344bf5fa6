"""Batch-invariance of the CPU primitives, each with a native negative control."""

import torch

from isoexec.kernels.primitives import sigmoid, silu, softplus, tile_mm, tree_sum


def test_tile_mm_row_bits_independent_of_row_count_and_position():
    torch.manual_seed(0)
    for k, m in [(64, 1), (64, 4), (128, 512), (512, 128), (32, 96)]:
        w = torch.randn(k, m)
        x = torch.randn(70, k)
        alone = tile_mm(x[:1], w, 16)
        for n in (2, 3, 5, 16, 17, 70):
            assert torch.equal(tile_mm(x[:n], w, 16)[:1], alone), (k, m, n)
        # the same row at another position of another tile
        assert torch.equal(tile_mm(torch.cat([x[1:40], x[:1]]), w, 16)[-1:], alone)


def test_native_matmul_row_bits_depend_on_row_count():
    """Negative control: plain torch.matmul changes row 0 with the number of rows on this CPU."""
    torch.manual_seed(0)
    differs = False
    for k, m in [(128, 512), (512, 128), (256, 1024)]:
        w = torch.randn(k, m)
        x = torch.randn(64, k)
        differs |= any(not torch.equal((x[:n] @ w)[:1], x[:1] @ w) for n in (2, 3, 4, 16, 64))
    assert differs


def test_tree_sum_is_fixed_order_and_correct():
    torch.manual_seed(0)
    x = torch.randn(37, 100, dtype=torch.float64)
    assert torch.allclose(tree_sum(x, -1), x.sum(-1))
    x = torch.randn(300, 1001)
    assert torch.equal(tree_sum(x, -1)[:1], tree_sum(x[:1], -1))
    assert torch.equal(tree_sum(x, 0, keepdim=True), tree_sum(x, 0).unsqueeze(0))


def _tail_mismatches(fn, x):
    full = fn(x)
    parts = torch.cat([fn(x[i : i + 7]) for i in range(0, x.numel(), 7)])
    return int((full != parts).sum())


def test_elementwise_functions_are_position_invariant_where_torch_is_not():
    torch.manual_seed(0)
    x = torch.randn(20003) * 5
    for ours, theirs in [(sigmoid, torch.sigmoid), (silu, torch.nn.functional.silu), (softplus, torch.nn.functional.softplus)]:
        assert _tail_mismatches(ours, x) == 0
        assert _tail_mismatches(theirs, x) > 0  # negative control
        assert torch.allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
