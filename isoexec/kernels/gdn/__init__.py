"""Gated DeltaNet (``gdn.core``, ``gdn.gating``): the token-by-token reference (``reference.py``), CPR
on CPU (``cpu.py``) and in Triton (``triton.py``), and the native chunked/recurrent kernels."""
