"""Parallel-invariant (pik) GEMMs and combines: the ``torch.distributed`` reference and gloo test harness
(``pik.py``, ``gloo.py``) and the CUDA row-parallel GEMM over NCCL with Triton kernels (``triton.py``)."""
