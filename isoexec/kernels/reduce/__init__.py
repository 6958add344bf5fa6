"""C kernels of the fixed-order reductions (``tree_sum.c``: :func:`isoexec.kernels.primitives.tree_sum`)."""
