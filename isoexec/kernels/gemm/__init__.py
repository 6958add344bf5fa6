"""GEMM (``*.proj``, ``lm_head``): batch-invariant CPU tiles, Triton tiles, native ``F.linear``."""
