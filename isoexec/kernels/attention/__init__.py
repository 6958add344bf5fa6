"""Attention (``attn.core``, ``attn.gate``, ``attn.rope``): blockwise online softmax on CPU and in
Triton, native SDPA, and the partial RoPE every set shares."""
