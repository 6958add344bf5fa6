"""Native Gated DeltaNet: transformers' stock torch kernels, chunked for sequences and recurrent for decode.

This is what the Hugging Face model runs on CPU (``torch_chunk_gated_delta_rule`` for prefill and
training, ``torch_recurrent_gated_delta_rule`` for one-token decode from a cache). The two use
different reduction orders, so decode and prefill differ in the last bits: the negative control.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def torch_references():
    """(chunk, recurrent): transformers' pure-PyTorch GDN functions.

    transformers wraps them so that an installed flash-linear-attention replaces them at import
    time; fla's Triton kernels do not run on CPU, so this unwraps (``__wrapped__``) to the torch
    references. Imported lazily: transformers' Qwen3-Next module takes seconds to import.
    """
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    def unwrap(fn):
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        return fn

    return unwrap(hf.torch_chunk_gated_delta_rule), unwrap(hf.torch_recurrent_gated_delta_rule)


def native_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: list[int],
    states: list[torch.Tensor | None],
    chunk_size: int = 64,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run transformers' GDN per sequence.

    Args:
        q, k: ``[N, H, Dk]`` l2-normalised fp32. v: ``[N, H, Dv]``. g, beta: ``[N, H]``.
        lengths: tokens per sequence (sum N). states: per sequence recurrent state ``[H, Dk, Dv]`` or None.

    Returns:
        (o ``[N, H, Dv]`` fp32, new states).
    """
    torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule = torch_references()
    outs, new_states = [], []
    row0 = 0
    for n, st in zip(lengths, states):
        sl = slice(row0, row0 + n)
        args = [x[sl].unsqueeze(0) for x in (q, k, v)]
        init = None if st is None else st.unsqueeze(0)
        if n == 1 and st is not None:
            o, s = torch_recurrent_gated_delta_rule(
                *args, g=g[sl].unsqueeze(0), beta=beta[sl].unsqueeze(0), initial_state=init, output_final_state=True
            )
        else:
            o, s = torch_chunk_gated_delta_rule(
                *args,
                g=g[sl].unsqueeze(0),
                beta=beta[sl].unsqueeze(0),
                chunk_size=chunk_size,
                initial_state=init,
                output_final_state=True,
            )
        outs.append(o[0].float())
        new_states.append(s[0].float())
        row0 += n
    return torch.cat(outs, dim=0), new_states
