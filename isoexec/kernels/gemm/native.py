"""Native GEMM: stock ``F.linear`` in the activation dtype (MKL/oneDNN or cuBLAS picks the kernel
from the shape, so a row's bits depend on the batch: the negative control)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def native_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stock ``F.linear`` in the activation dtype (MKL/oneDNN picks the kernel from the shape)."""
    y = F.linear(x, w.to(x.dtype))
    return y.to(out_dtype) if out_dtype is not None else y
