"""Batch-invariance of the CPU primitives, each with a native negative control."""

import pytest
import torch

from isoexec.kernels.primitives import sigmoid, silu, softplus, tile_mm, tree_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_mm_row_bits_independent_of_row_count_and_position(dtype):
    """Both C GEMMs: fp32 operands (fma_gemm.c) and bf16 operands (bf16_gemm.c)."""
    torch.manual_seed(0)
    for rt, k, m in [(16, 64, 1), (16, 64, 4), (16, 128, 512), (16, 512, 128), (16, 32, 96), (64, 128, 64), (64, 8, 128)]:
        w = torch.randn(k, m).to(dtype)
        x = torch.randn(150, k).to(dtype)
        alone = tile_mm(x[:1], w, rt)
        for n in (2, 3, 5, 16, 17, 70, 150):
            assert torch.equal(tile_mm(x[:n], w, rt)[:1], alone), (rt, k, m, n)
        # the same row at another position of another tile
        assert torch.equal(tile_mm(torch.cat([x[1:100], x[:1]]), w, rt)[-1:], alone)


def test_native_matmul_row_bits_depend_on_row_count():
    """Negative control: plain torch.matmul changes row 0 with the number of rows on this CPU."""
    torch.manual_seed(0)
    differs = False
    for k, m in [(128, 512), (512, 128), (256, 1024)]:
        w = torch.randn(k, m)
        x = torch.randn(64, k)
        differs |= any(not torch.equal((x[:n] @ w)[:1], x[:1] @ w) for n in (2, 3, 4, 16, 64))
    assert differs


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 257])
def test_tree_sum_c_kernel_has_the_bits_of_the_torch_tree(n):
    """Without autograd, an fp32 last-dim tree_sum runs reduce/tree_sum.c; under autograd the torch tree of
    narrow + add: the same bits (values spanning 40 orders of magnitude, so any other order would show)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, 3, n, generator=g) * torch.logspace(-20, 20, n)
    c = tree_sum(x, -1, keepdim=True)
    t = tree_sum(x.clone().requires_grad_(True), -1, keepdim=True).detach()
    assert c.shape == t.shape == (5, 3, 1) and torch.equal(c, t)
    assert torch.equal(tree_sum(x.transpose(0, 1), -1), t.squeeze(-1).transpose(0, 1))  # non-contiguous input


def test_tree_sum_c_kernel_keeps_the_torch_nan_bits_and_ignores_the_default_dtype():
    """Where two NaNs meet in one add (inf + -inf, then the row's NaN) the C path returns the torch tree's
    NaN bits; its buffers are fp32 whatever torch's default dtype (vLLM's loader sets bf16)."""
    rows = torch.tensor([[float("inf"), float("nan"), float("-inf"), 0.0], [float("nan"), float("inf"), 0.0, float("-inf")],
                         [1.0, 2.0, 3.0, 4.0]])
    c = tree_sum(rows, -1)
    t = tree_sum(rows.clone().requires_grad_(True), -1).detach()
    assert torch.equal(c.view(torch.int32), t.view(torch.int32))
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert torch.equal(tree_sum(torch.arange(8, dtype=torch.float32).reshape(2, 4), -1), torch.tensor([6.0, 22.0]).float())
    finally:
        torch.set_default_dtype(old)


def test_causal_conv1d_refuses_prefixes_of_another_shape_or_count():
    """Before these checks the C kernel read past a short prefix."""
    from isoexec.kernels.conv.cpu import iso_causal_conv1d

    w = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"prefix 0 has shape \(1, 8\), need \(3, 8\)"):
        iso_causal_conv1d([torch.randn(5, 8)], w, [torch.randn(1, 8)])
    with pytest.raises(ValueError, match=r"2 pieces but 1 prefixes"):
        iso_causal_conv1d([torch.randn(1, 8)] * 2, w, [torch.randn(3, 8)])


def test_causal_conv1d_refuses_a_weight_of_other_channels():
    from isoexec.kernels.conv.cpu import iso_causal_conv1d

    with pytest.raises(ValueError, match=r"\[8, Kc\].*\(4, 4\)"):
        iso_causal_conv1d([torch.randn(3, 8)], torch.randn(4, 4), [torch.zeros(3, 8)])


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


def test_silu_without_autograd_has_the_bits_of_the_autograd_formula():
    torch.manual_seed(1)
    x = torch.randn(4099) * 6
    y = silu(x)
    xg = x.clone().requires_grad_(True)
    yg = silu(xg)
    yg.sum().backward()
    assert torch.equal(y, yg.detach()) and xg.grad is not None


def test_causal_conv1d_bits_per_position_whatever_the_pieces_and_autograd():
    """Output t of a piece is the tap-ascending fp32 sum then SiLU, the same bits alone, in any batch of
    pieces, with or without autograd (the no-autograd path reuses one temporary)."""
    from isoexec.kernels.conv.cpu import iso_causal_conv1d

    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 4, generator=g).to(torch.bfloat16)
    xs = [torch.randn(n, 24, generator=g).to(torch.bfloat16) for n in (1, 9, 3)]
    pre = [torch.randn(3, 24, generator=g).to(torch.bfloat16) for _ in xs]
    ys, tails = iso_causal_conv1d(xs, w, pre)
    for x, p, y, tail in zip(xs, pre, ys, tails):
        ext = torch.cat([p, x]).float()
        ref = ext[0 : len(x)] * w.float()[:, 0]
        for j in range(1, 4):
            ref = ref + ext[j : j + len(x)] * w.float()[:, j]
        assert torch.equal(y, silu(ref).to(torch.bfloat16)) and torch.equal(tail, ext[-3:].to(torch.bfloat16))
        alone, _ = iso_causal_conv1d([x], w, [p])
        assert torch.equal(alone[0], y)
    xg = [x.float().requires_grad_(True) for x in xs]
    yg, _ = iso_causal_conv1d(xg, w.float(), [p.float() for p in pre])
    yf, _ = iso_causal_conv1d([x.float() for x in xs], w.float(), [p.float() for p in pre])
    sum(y.sum() for y in yg).backward()
    assert all(torch.equal(a.detach(), b) for a, b in zip(yg, yf)) and xg[0].grad is not None


def test_causal_conv1d_decode_path_has_the_bits_of_the_general_path():
    """Single-token pieces without autograd take the stacked decode path: the same outputs and prefixes
    as the general path (taken under autograd)."""
    from isoexec.kernels.conv.cpu import iso_causal_conv1d

    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 4, generator=g).to(torch.bfloat16)
    xs = [torch.randn(1, 24, generator=g).to(torch.bfloat16) for _ in range(5)]
    pre = [torch.randn(3, 24, generator=g).to(torch.bfloat16) for _ in xs]
    with torch.no_grad():
        ys, tails = iso_causal_conv1d(xs, w, pre)
    with torch.enable_grad():
        yg, tg = iso_causal_conv1d([x.clone().requires_grad_(True) for x in xs], w, pre)
    assert all(torch.equal(a, b.detach()) for a, b in zip(ys, yg)) and all(torch.equal(a, b) for a, b in zip(tails, tg))
    assert [tuple(y.shape) for y in ys] == [(1, 24)] * 5 and [tuple(t.shape) for t in tails] == [(3, 24)] * 5


def test_causal_conv1d_gradient_matches_fp64_reference():
    """The C backward of the tap sums (inputs, prefixes and weights) against autograd of the fp64 tap sum."""
    from isoexec.kernels.conv.cpu import iso_causal_conv1d

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 24, generator=g).requires_grad_(True) for n in (1, 9, 70)]
    pre = [torch.randn(3, 24, generator=g).requires_grad_(True) for _ in xs]
    w = torch.randn(24, 4, generator=g).requires_grad_(True)
    ys, _ = iso_causal_conv1d(xs, w, pre)
    ws = [torch.randn_like(y) for y in ys]
    sum((y * c).sum() for y, c in zip(ys, ws)).backward()
    xd, pd, wd = [x.detach().double().requires_grad_(True) for x in xs], [p.detach().double().requires_grad_(True) for p in pre], w.detach().double().requires_grad_(True)
    total = 0
    for x, p, c in zip(xd, pd, ws):
        ext = torch.cat([p, x])
        acc = sum(ext[j : j + len(x)] * wd[:, j] for j in range(4))
        total = total + (torch.nn.functional.silu(acc) * c.double()).sum()
    total.backward()
    for a, b in [*zip(xs, xd), *zip(pre, pd), (w, wd)]:
        assert (a.grad.double() - b.grad).abs().max() < 1e-5 * max(1.0, b.grad.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 7, 64, 100, 128])
def test_norm_c_kernels_give_one_forward_in_every_case_and_the_reference_gradient(dtype, d):
    """norms.c's rows (magnitudes 1e-20..1e15, a zero row): the same bits with and without autograd and
    for a row alone, within 2 ulp-ish of an fp64 reference; the gradient is the torch expression's
    (checked against fp64); transformers' expression, the native stack's, gives other fp32 bits wherever a row has
    more than one feature (negative control)."""
    from isoexec.kernels.norm import cpu as norm, native

    g = torch.Generator().manual_seed(d)
    scale = torch.exp2(torch.randint(-66, 50, (300, 1), generator=g).float())
    x = (torch.randn(300, d, generator=g) * scale).to(dtype)
    x[0] = 0
    z = (torch.randn(300, d, generator=g) * 8).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)

    def ref64(name, a):
        a64 = a.double()
        if name == "l2":
            return a64 / torch.sqrt((a64 * a64).sum(-1, keepdim=True) + 1e-6)
        y = a64 / torch.sqrt((a64 * a64).mean(-1, keepdim=True) + 1e-6)
        if name == "gated":
            return w.double() * y * torch.nn.functional.silu(z.double())
        return y * ((1 + w.double()) if name == "rms" else w.double())

    cases = {"rms": lambda a, r=slice(None): norm.iso_rms_norm(a, w, 1e-6),
             "rms_w": lambda a, r=slice(None): norm.iso_rms_norm(a, w, 1e-6, False),
             "gated": lambda a, r=slice(None): norm.iso_gated_rms_norm(a, z[r], w, 1e-6),
             "l2": lambda a, r=slice(None): norm.iso_l2norm(a)}
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, fn in cases.items():
        fast = fn(x)
        alone = [fn(x[i : i + 1], slice(i, i + 1)) for i in (0, 5, 299)]
        assert torch.equal(torch.cat(alone), fast[[0, 5, 299]]), name
        xg = x.clone().requires_grad_(True)
        with torch.enable_grad():
            out = fn(xg)
            out.float().sum().backward()
        assert torch.equal(out.detach(), fast), name  # trainer_fwd's forward == engine's
        if dtype == torch.float32 and d > 1:  # native negative control: transformers' expression gives other bits
            # (its own sum order and torch.rsqrt; the gradient reference _*_ref shares the kernel's tree sum and can
            # match it bit for bit where torch.rsqrt rounds as 1 / sqrtf: seen with AVX-512 at d = 7 and 128)
            nat = {"rms": lambda: native.native_rms_norm(x, w, 1e-6),
                   "rms_w": lambda: native.native_rms_norm(x, w, 1e-6, False),
                   "gated": lambda: native.native_gated_rms_norm(x, z, w, 1e-6),
                   "l2": lambda: native.native_l2norm(x, 1e-6)}
            assert not torch.equal(nat[name](), fast), name
        ref = ref64(name, x)
        assert ((fast.double() - ref).abs() <= tol * ref.abs().clamp(min=1e-30) + 1e-30).all(), name
        if d == 1:
            continue  # one feature: the normalised row is +-1, its gradient 0 up to rounding
        x64 = x.double().requires_grad_(True)
        ref64(name, x64).sum().backward()
        rel = (xg.grad.double() - x64.grad).abs() / x64.grad.abs().amax(-1, keepdim=True).clamp(min=1e-300)
        assert rel.max() < (5e-2 if dtype == torch.bfloat16 else 1e-4), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_mm_column_bits_independent_of_position_neighbours_and_tiles(dtype):
    """Why a tensor-parallel rank's output features reproduce the full product's columns: in
    ``tile_mm`` a column's bits depend neither on its position, nor on the other columns, nor on the
    cache tiles (``row_tile``, ``col_tile``), one column alone included; ``iso_linear`` on a permuted,
    unaligned shard == that shard of ``iso_linear``. The values are the product's (fp64 reference).
    Both C GEMMs: fp32 operands (fma_gemm.c) and bf16 operands (bf16_gemm.c)."""
    from isoexec.kernels.gemm.cpu import iso_linear

    g = torch.Generator().manual_seed(0)
    for k, m in [(64, 16), (128, 130), (512, 8), (1024, 2), (128, 64), (7, 65)]:
        x = torch.randn(37, k, generator=g).to(dtype)
        w = torch.randn(k, m, generator=g).to(dtype)
        ref = tile_mm(x, w, 64)
        assert torch.allclose(ref.double(), x.double() @ w.double(), rtol=0, atol=1e-4 * k ** 0.5), (k, m)
        for rt, ct in [(1, 1), (4, 3), (16, 16), (64, 64), (5, None)]:
            assert torch.equal(tile_mm(x, w, rt, ct), ref), (k, m, rt, ct)
        perm = torch.randperm(m, generator=g)
        assert torch.equal(tile_mm(x, w[:, perm], 64), ref[:, perm]), (k, m)
        assert torch.equal(tile_mm(x, w[:, :1], 64), ref[:, :1]), (k, m)
        other = torch.randn(k, m, generator=g).to(dtype)
        other[:, 0] = w[:, 0]
        assert torch.equal(tile_mm(x, other, 64)[:, 0], ref[:, 0]), (k, m)
    x, w = torch.randn(37, 128, generator=g).to(dtype), torch.randn(200, 128, generator=g).to(dtype)
    full = iso_linear(x, w, 16, 16, torch.float32)
    shard = torch.cat([torch.arange(150, 200), torch.arange(3, 40)])  # a permuted, unaligned subset
    assert torch.equal(iso_linear(x, w[shard], 16, 16, torch.float32), full[:, shard])


def test_one_column_mkl_gemm_differs_from_its_column_in_a_wider_gemm_negative_control():
    """Negative control of the test above: MKL's ``torch.mm`` takes another kernel path for one
    output column on this CPU, so its columns are not shard-invariant."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 256, generator=g), torch.randn(256, 16, generator=g)
    assert not torch.equal(torch.mm(x, w[:, :1].contiguous()), torch.mm(x, w)[:, :1])


def test_tile_mm_empty_shapes_and_strided_views():
    """Zero rows, columns or features give the product's zeros / empty results (leaves too); views
    with other strides give the bits of their contiguous copies."""
    g = torch.Generator().manual_seed(5)
    for n, k, m, L in [(0, 8, 3, 1), (5, 8, 0, 1), (5, 0, 3, 1), (5, 0, 3, 4), (0, 0, 0, 1)]:
        y = tile_mm(torch.randn(n, k, generator=g), torch.randn(k, m, generator=g), 16, leaves=L)
        assert y.shape == (n, m) and torch.equal(y, torch.zeros(n, m)), (n, k, m, L)
    x, w = torch.randn(40, 30, generator=g), torch.randn(70, 20, generator=g)
    xs, ws = x.t()[::2], w[::3, 1:]  # [15, 40] with column stride 30; [24, 19] row stride 60
    assert torch.equal(tile_mm(xs[:, :24], ws, 16), tile_mm(xs[:, :24].contiguous(), ws.contiguous(), 16))


def test_tile_mm_bf16_backward_is_the_bf16_matmul_gradient():
    """``grad_dtype=torch.bfloat16`` (bf16 activations): the gradients are exactly the bf16 matmuls of
    the upstream gradient, as a native bf16 trainer computes them; fp32 keeps fp32 matmuls."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(33, 48, generator=g).bfloat16().float().requires_grad_()
    w = torch.randn(48, 20, generator=g).bfloat16().float().requires_grad_()
    gy = torch.randn(33, 20, generator=g)
    (tile_mm(x, w, 16, grad_dtype=torch.bfloat16) * gy).sum().backward()
    gb = gy.bfloat16()
    assert torch.equal(x.grad, (gb @ w.detach().bfloat16().t()).float())
    assert torch.equal(w.grad, (x.detach().bfloat16().t() @ gb).float())
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (tile_mm(x2, w2, 16) * gy).sum().backward()
    assert torch.equal(x2.grad, gy @ w.detach().t()) and not torch.equal(x2.grad, x.grad)


def test_tile_mm_refuses_other_dtypes_and_shapes():
    """Operands of two dtypes, or of one the C GEMMs do not take, are refused by name (bf16 x picks the
    bf16 kernel, anything else the fp32 one); so is a bf16 activation with a weight of another dtype."""
    from isoexec.kernels.primitives import tile_linear

    with pytest.raises(ValueError, match="bfloat16 x and w, got torch.bfloat16 and torch.float32"):
        tile_mm(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(4, 4), 16)
    with pytest.raises(ValueError, match="float32 x and w, got torch.float32 and torch.bfloat16"):
        tile_mm(torch.zeros(2, 3), torch.zeros(3, 4, dtype=torch.bfloat16), 16)
    with pytest.raises(ValueError, match="float32 x and w, got torch.float16"):
        tile_mm(torch.zeros(2, 3, dtype=torch.float16), torch.zeros(3, 4, dtype=torch.float16), 16)
    with pytest.raises(ValueError, match="bfloat16 activations need a bfloat16 weight, got torch.float32"):
        tile_linear(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(5, 4), 16)
    with pytest.raises(ValueError, match=r"x \[N, K\] and w \[K, M\], got \(2, 3\) and \(4, 4\)"):
        tile_mm(torch.zeros(2, 3), torch.zeros(4, 4), 16)
    with pytest.raises(ValueError, match="tiles must be >= 1, got row_tile=0"):
        tile_mm(torch.zeros(2, 3), torch.zeros(3, 4), 0)
    with pytest.raises(ValueError, match="CPU tensors, got x on meta"):
        tile_mm(torch.zeros(2, 3, device="meta"), torch.zeros(3, 4, device="meta"), 16)
    with pytest.raises(ValueError, match="grad_dtype must be torch.bfloat16 or torch.float32, got torch.float16"):
        tile_mm(torch.zeros(2, 3), torch.zeros(3, 4), 16, grad_dtype=torch.float16)


def test_tile_mm_gradient_is_the_matmul_gradient():
    """The forward is the C kernel (bitwise); the backward is two plain matmuls: same gradient as ``x @ w``."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 24, generator=g, requires_grad=True), torch.randn(24, 40, generator=g, requires_grad=True)
    gy = torch.randn(37, 40, generator=g)
    (tile_mm(x, w, 16) * gy).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((x2 @ w2) * gy).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-5) and torch.allclose(w.grad, w2.grad, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(tile_mm(x, w, 16), tile_mm(x.detach(), w.detach(), 16))  # same forward bits


def test_tile_mm_leaves_are_the_tree_of_the_leaf_chains_and_one_chain_is_not():
    """The pik leaf GEMM in one call: ``tile_mm(..., leaves=L)`` is bitwise the adjacent-pairs tree
    (``pik_tree_combine``) of the L leaves' own GEMMs, at any rows and tiles; its gradient is the
    matmul's. Negative control: the one chain over all of K (leaves=1) differs."""
    from isoexec.kernels.collectives.pik import pik_tree_combine

    g = torch.Generator().manual_seed(4)
    for n, k, m, L in [(1, 64, 8, 8), (37, 256, 130, 8), (70, 128, 64, 4), (5, 32, 3, 2)]:
        x, w = torch.randn(n, k, generator=g), torch.randn(k, m, generator=g)
        width = k // L
        ref = pik_tree_combine([tile_mm(x[:, j * width:(j + 1) * width], w[j * width:(j + 1) * width], 64)
                                for j in range(L)])
        for rt, ct in [(64, None), (1, 1), (4, 64), (16, 5)]:
            assert torch.equal(tile_mm(x, w, rt, ct, leaves=L), ref), (n, k, m, L, rt, ct)
        assert torch.equal(tile_mm(x[:1], w, 64, leaves=L), ref[:1])
        if n > 1:
            assert not torch.equal(tile_mm(x, w, 64), ref), (n, k, m, L)
    x = torch.randn(37, 64, generator=g, requires_grad=True)
    w = torch.randn(64, 24, generator=g, requires_grad=True)
    gy = torch.randn(37, 24, generator=g)
    (tile_mm(x, w, 16, leaves=8) * gy).sum().backward()
    assert torch.allclose(x.grad, gy @ w.detach().t(), atol=1e-5)
    assert torch.allclose(w.grad, x.detach().t() @ gy, atol=1e-5)
    with pytest.raises(ValueError, match="leaves=3 must be a power of two dividing K=64"):
        tile_mm(x.detach(), w.detach(), 16, leaves=3)


def test_tile_linear_reuses_a_weight_conversion_only_while_the_weight_is_unchanged():
    from isoexec.kernels.primitives import tile_linear

    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(12, 8).to(torch.bfloat16), requires_grad=False)
    x = torch.randn(5, 8).to(torch.bfloat16)
    y0 = tile_linear(x, w, 4)
    assert torch.equal(tile_linear(x, w, 4), y0)  # reused conversion, same bits
    with torch.no_grad():
        w.copy_(torch.randn(12, 8).to(torch.bfloat16))  # a weight sync: in place
    ref = tile_linear(x, w.detach().clone(), 4)  # a fresh tensor: nothing cached
    assert torch.equal(tile_linear(x, w, 4), ref) and not torch.equal(ref, y0)
    w.data = torch.randn(12, 8).to(torch.bfloat16)  # replaced storage
    assert torch.equal(tile_linear(x, w, 4), tile_linear(x, w.detach().clone(), 4))


def _bf16_operands(g, n, k, m, subnormal: bool = False):
    """Random bf16 x [n, k], w [k, m]; ``subnormal``: a third of the entries with exponents at the bottom of
    the range (bf16 subnormals, and products that underflow), to exercise the kernel's flushes."""
    x, w = torch.randn(n, k, generator=g), torch.randn(k, m, generator=g)
    if subnormal:
        for t in (x, w):
            tiny = torch.rand(t.shape, generator=g) < 0.33
            t[tiny] *= 2.0 ** -130
    return x.bfloat16(), w.bfloat16()


def test_bf16_pair_gemm_simd_path_equals_the_scalar_chain_and_is_batch_column_and_tp_invariant():
    """``bf16_pair_gemm`` (bf16_gemm.c): where the CPU has AVX512_BF16, ``VDPBF16PS`` gives the bits of the
    scalar chain the C file spells out (fmaf per pair, odd element first, subnormals flushed), on random and
    subnormal-heavy operands; a row's bits do not depend on the other rows, a column's not on the other
    columns or the tiles, and a TP rank's K leaves combined by the fixed tree give the full product's bits.
    Negative control: the fp32 chain of ``fma_gemm`` (k ascending, no flush) differs on some elements."""
    from isoexec.kernels.collectives.pik import pik_tree_combine
    from isoexec.kernels.gemm.fma import bf16_pair_gemm, bf16_simd, fma_gemm

    g = torch.Generator().manual_seed(0)
    differs_from_fp32_chain = False
    for n, k, m, sub in [(37, 128, 1024, False), (37, 128, 130, True), (5, 97, 64, True), (150, 256, 70, False),
                         (3, 64, 4, True)]:
        x, w = _bf16_operands(g, n, k, m, sub)
        ref = bf16_pair_gemm(x, w, 64, 64, simd=False)
        assert torch.equal(bf16_pair_gemm(x, w, 64, 64), ref), (n, k, m, sub, bf16_simd())
        alone = bf16_pair_gemm(x[:1], w, 64, 64)
        for rows in (2, 3, 5, 17, n):
            assert torch.equal(bf16_pair_gemm(x[:rows], w, 64, 64)[:1], alone), (n, k, m, rows)
        for rt, ct in [(1, 1), (4, 3), (16, None)]:
            assert torch.equal(bf16_pair_gemm(x, w, rt, ct), ref), (n, k, m, rt, ct)
        perm = torch.randperm(m, generator=g)
        assert torch.equal(bf16_pair_gemm(x, w[:, perm], 64, 64), ref[:, perm])
        assert torch.allclose(ref.double(), x.double() @ w.double(), rtol=0, atol=1e-4 * k ** 0.5)
        differs_from_fp32_chain |= not torch.equal(fma_gemm(x.float(), w.float(), 64, 64), ref)
    assert differs_from_fp32_chain
    x, w = _bf16_operands(g, 33, 256, 96)
    full = bf16_pair_gemm(x, w, 16, 64, leaves=8)
    for tp in (2, 4):
        s = 256 // tp
        parts = [bf16_pair_gemm(x[:, r * s:(r + 1) * s], w[r * s:(r + 1) * s], 16, 64, leaves=8 // tp) for r in range(tp)]
        assert torch.equal(pik_tree_combine(parts), full), tp
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_pair_gemm(x.float(), w, 16)
    with pytest.raises(ValueError, match="leaves=3"):
        bf16_pair_gemm(x, w, 16, leaves=3)
    with pytest.raises(ValueError, match="leaves=2 must be a power of two with K/leaves even"):
        bf16_pair_gemm(torch.ones(1, 3, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16), 4, leaves=2)


def test_bf16_pair_gemm_flushes_results_tiny_after_rounding_and_canonicalises_nan_on_both_paths():
    """The two corners where fmaf and ``VDPBF16PS`` part (found by review): a sum just below FLT_MIN that
    fmaf rounds up to FLT_MIN on the subnormal grid is tiny after rounding with an unbounded exponent, so
    the instruction flushes it (both paths must give +0 here); and NaN payloads, which the instruction and
    fmaf take from different operands (both paths store the canonical quiet NaN)."""
    from isoexec.kernels.gemm.fma import bf16_pair_gemm

    x = torch.tensor([[0.0, 2.0 ** -63, 0.0, 1.5 * 2.0 ** -75]]).bfloat16()
    w = torch.tensor([[0.0], [2.0 ** -63], [0.0], [-(2.0 ** -76)]]).bfloat16()  # 2^-126 - 1.5 * 2^-151
    for simd in (True, False):
        assert bf16_pair_gemm(x, w, 64, simd=simd).view(torch.int32).item() == 0, simd
    g = torch.Generator().manual_seed(4)  # a sweep of sums around FLT_MIN
    n, m = 64, 64
    sign = lambda *s: torch.randn(*s, generator=g).sign()  # noqa: E731
    mag = lambda lo, hi, *s: (1 + torch.rand(*s, generator=g)) * torch.exp2(torch.randint(lo, hi, s, generator=g).float())  # noqa: E731
    x, w = torch.zeros(n, 4), torch.zeros(4, m)
    x[:, 1], w[1] = sign(n) * 2.0 ** -63, 2.0 ** -63 * (1 + (torch.rand(m, generator=g) < 0.3).float() * 2.0 ** -7)
    x[:, 3], w[3] = sign(n) * mag(-76, -74, n), sign(m) * mag(-78, -75, m)
    x[:, 2], w[2] = sign(n) * mag(-76, -74, n), sign(m) * mag(-78, -74, m)
    x, w = x.bfloat16(), w.bfloat16()
    assert torch.equal(bf16_pair_gemm(x, w, 64).view(torch.int32), bf16_pair_gemm(x, w, 64, simd=False).view(torch.int32))
    xn = torch.tensor([[0, 0x7FC1]], dtype=torch.int16).view(torch.bfloat16)
    wn = torch.tensor([[0], [0x7FD3]], dtype=torch.int16).view(torch.bfloat16)
    for simd in (True, False):
        assert bf16_pair_gemm(xn, wn, 64, simd=simd).view(torch.int32).item() == 0x7FC00000, simd


def test_tile_linear_sees_weight_writes_and_the_kernels_cache_nothing_unpinned():
    """An engine's weight is converted and packed once and reused until a write through the parameter
    (``copy_`` under no_grad bumps its version); a tensor handed to the kernels directly is packed on every
    call, so even a write through ``.data`` (which the version counter does not see) is read."""
    from isoexec.kernels.gemm.fma import bf16_pair_gemm, fma_gemm
    from isoexec.kernels.primitives import tile_linear

    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 64, generator=g).bfloat16()
    p = torch.nn.Parameter(torch.randn(32, 64, generator=g).bfloat16())
    with torch.no_grad():
        before = tile_linear(x, p, 16, 64)
        assert torch.equal(tile_linear(x, p, 16, 64), before)
        p.copy_(torch.randn(32, 64, generator=g))
        after = tile_linear(x, p, 16, 64)
    assert not torch.equal(after, before)
    assert torch.equal(after, bf16_pair_gemm(x, p.detach().t().contiguous(), 16, 64))
    for w, gemm, xx in ((torch.randn(64, 8, generator=g), fma_gemm, x.float()),
                        (torch.randn(64, 8, generator=g).bfloat16(), bf16_pair_gemm, x)):
        first = gemm(xx, w, 16)
        w.data.mul_(-2)  # a power of two: every product and partial sum scales exactly
        assert torch.equal(gemm(xx, w, 16), -2 * first), gemm.__name__
    with pytest.raises(ValueError, match=r"tile_linear needs x \[N, K\] and w \[M, K\], got \(1, 3\) and \(5, 2\)"):
        tile_linear(torch.zeros(1, 3, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.bfloat16), 16)
