"""Row reductions in Triton: RMSNorm (``norm.rms``, q/k norms), gated RMSNorm (``gdn.norm``) and
l2norm (``gdn.l2norm``).

Each program normalises ``ROWS`` rows held as a ``[ROWS, BLOCK]`` tile; ``tl.sum`` along the row uses
a reduction tree fixed by ``(ROWS, BLOCK, num_warps)``, which depend only on the row length D (a
model constant), never on the number of rows. So a row's bits depend on that row alone. Semantics
as :mod:`isoexec.kernels.dense` (fp32 math, ``(1 + w)`` scale, HF's rounding points).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from isoexec.kernels.autograd import with_ref_grad
from isoexec.kernels.norm.native import native_gated_rms_norm, native_l2norm, native_rms_norm

MODE_RMS, MODE_GATED, MODE_L2 = 0, 1, 2


def row_config(d: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) for rows of length d: a function of d only (contract constant)."""
    block = triton.next_power_of_2(d)
    rows = max(1, min(16, 2048 // block))
    warps = 4 if block * rows >= 2048 else 2
    return block, rows, warps


@triton.jit(do_not_specialize=["M"])
def _row_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, M, D, eps, MODE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask = rows < M
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x_raw = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    if MODE == 0:
        inv = 1.0 / tl.sqrt_rn(ss / D + eps)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = (x * inv[:, None]) * (1.0 + w)[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    elif MODE == 1:
        inv = 1.0 / tl.sqrt_rn(ss / D + eps)
        yn = (x * inv[:, None]).to(x_raw.dtype)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
        yw = (w[None, :].to(tl.float32) * yn.to(tl.float32)).to(x_raw.dtype)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sz = z / (1.0 + tl.exp(-z))
        tl.store(y_ptr + offs, (yw.to(tl.float32) * sz).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        inv = 1.0 / tl.sqrt_rn(ss + eps)
        tl.store(y_ptr + offs, x * inv[:, None], mask=mask)


def _launch(x, z, w, eps, mode, out_dtype):
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    M = x2.shape[0]
    y = torch.empty((M, d), device=x.device, dtype=out_dtype)
    if M:
        block, rows, warps = row_config(d)
        z2 = x2 if z is None else z.reshape(-1, d).contiguous()
        w2 = x2 if w is None else w.contiguous()
        _row_norm_kernel[(triton.cdiv(M, rows),)](x2, z2, w2, y, M, d, float(eps), MODE=mode, BLOCK=block, ROWS=rows,
                                                   num_warps=warps)
    return y.view(x.shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim in fp32, returned in ``x.dtype``. x: ``[..., D]``, w: ``[D]``."""
    return _launch(x, None, w, eps, MODE_RMS, x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``(w * norm(x).to(dtype)) * silu(z)`` (HF ``Qwen3NextRMSNormGated``). x, z: ``[N, D]``, w: ``[D]``."""
    return _launch(x, z, w, eps, MODE_GATED, x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim; fp32 out. x: ``[..., D]``."""
    return _launch(x, None, None, eps, MODE_L2, torch.float32)


def rms_norm_autograd(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` whose gradient is transformers' RMSNorm's."""
    return with_ref_grad(lambda a, b: rms_norm(a, b, eps), lambda a, b: native_rms_norm(a, b, eps), x, w)


def gated_rms_norm_autograd(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm` whose gradient is transformers' gated RMSNorm's."""
    return with_ref_grad(lambda a, c, b: gated_rms_norm(a, c, b, eps),
                         lambda a, c, b: native_gated_rms_norm(a, c, b, eps), x, z, w)


def l2norm_autograd(x: torch.Tensor) -> torch.Tensor:
    """:func:`l2norm` whose gradient is fla's l2norm's."""
    return with_ref_grad(l2norm, native_l2norm, x)
