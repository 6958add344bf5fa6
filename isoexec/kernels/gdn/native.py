"""Native Gated DeltaNet (regions ``gdn.core``, ``gdn.gating``): the stock kernels, chunked for
sequences and recurrent for decode. The two use different reduction orders, so decode and prefill
differ in the last bits: the negative control.

* CPU: what the Hugging Face model runs (transformers' ``torch_chunk_gated_delta_rule`` for prefill
  and training, ``torch_recurrent_gated_delta_rule`` for one-token decode from a cache).
* CUDA: flash-linear-attention's ``chunk_gated_delta_rule`` (varlen) and
  ``fused_recurrent_gated_delta_rule``, as vLLM and fla-based trainers run them.

:func:`chunk_reference` (transformers' chunked torch GDN under autograd) also gives every isoexec
set its GDN gradient (the forward of ``trainer_fwd`` is bitwise, its backward is not).
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


def chunk_reference(lengths: list[int], chunk_size: int, q, k, v, g, beta) -> torch.Tensor:
    """Differentiable GDN of packed sequences through transformers' chunked torch implementation, all
    sequences in one call (right-padded: a padded token has ``k = v = g = beta = 0``, which leaves the
    state and every real token's output and gradient unchanged).

    Args:
        lengths: tokens per sequence (sum N); each sequence starts from a zero state.
        chunk_size: C of the chunked algorithm. q, k ``[N, H, Dk]`` (l2-normalised), v ``[N, H, Dv]``,
            g / beta ``[N, H]``.

    Returns:
        o ``[N, H, Dv]`` fp32 (autograd graph kept).
    """
    chunk = torch_references()[0]
    L, B = max(lengths), len(lengths)
    rows = torch.cat([torch.arange(n) + i * L for i, n in enumerate(lengths)]).to(q.device)

    def padded(x):
        out = x.new_zeros((B * L, *x.shape[1:]))
        return out.index_copy(0, rows, x).view(B, L, *x.shape[1:])

    o, _ = chunk(padded(q), padded(k), padded(v), g=padded(g), beta=padded(beta), chunk_size=chunk_size)
    return o.reshape(B * L, *o.shape[2:]).float().index_select(0, rows)


def native_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Region ``gdn.gating`` as transformers: ``beta = b.sigmoid()``, ``g = -exp(A_log) * softplus(a + dt_bias)``.

    Returns:
        (g ``[N, Hv]`` fp32, beta ``[N, Hv]`` fp32).
    """
    beta = b.sigmoid().float()
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return g, beta


def fla_gdn(q, k, v, g, beta, lengths, states):
    """fla GDN as the native stacks run it: ``fused_recurrent_gated_delta_rule`` for one-token decode
    steps from a state, ``chunk_gated_delta_rule`` (varlen) for everything else.

    q, k ``[N, H, Dk]`` (l2-normalised), v ``[N, H, Dv]``, g / beta ``[N, H]``; states per piece
    ``[H, Dk, Dv]`` fp32 or None. Returns (o ``[N, H, Dv]`` fp32, new states)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    N, H, Dk = k.shape
    Dv = v.shape[-1]
    dev = q.device
    o = torch.empty((N, H, Dv), device=dev, dtype=torch.float32)
    new_states = [None] * len(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    dec = [i for i, (n, s) in enumerate(zip(lengths, states)) if n == 1 and s is not None]
    seq = [i for i in range(len(lengths)) if i not in set(dec)]
    if dec:
        rows = torch.tensor([starts[i] for i in dec], device=dev)
        h0 = torch.stack([states[i] for i in dec])
        od, hd = fused_recurrent_gated_delta_rule(q[rows][:, None], k[rows][:, None], v[rows][:, None], g=g[rows][:, None],
                                                  beta=beta[rows][:, None], initial_state=h0, output_final_state=True)
        o[rows] = od[:, 0].float()
        for j, i in enumerate(dec):
            new_states[i] = hd[j].float()
    if seq:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=dev) for i in seq])
        cu = torch.tensor([0] + [lengths[i] for i in seq], device=dev).cumsum(0)
        h0 = torch.stack([states[i] if states[i] is not None else torch.zeros(H, Dk, Dv, device=dev) for i in seq])
        oc, hc = chunk_gated_delta_rule(q[rows][None], k[rows][None], v[rows][None], g=g[rows][None], beta=beta[rows][None],
                                        initial_state=h0.float(), output_final_state=True, cu_seqlens=cu)
        o[rows] = oc[0].float()
        for j, i in enumerate(seq):
            new_states[i] = hc[j].float()
    return o, new_states
