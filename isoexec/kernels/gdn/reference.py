"""Plain token-by-token gated delta rule, the reference every GDN implementation is checked against.

Recurrence (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", ICLR 2025; as transformers'
``torch_recurrent_gated_delta_rule``), per head with state ``S [Dk, Dv]``::

    S   = S * exp(g_t)
    u_t = beta_t * (v_t - S^T k_t)
    S   = S + k_t u_t^T
    o_t = S^T (q_t / sqrt(Dk))

q and k are expected already l2-normalised.
"""

from __future__ import annotations

import torch


def recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule for one sequence, differentiable, in ``dtype`` (fp64 default).

    Args:
        q, k: ``[L, H, Dk]``. v: ``[L, H, Dv]``. g (log decay, <= 0), beta: ``[L, H]``.
        initial_state: ``[H, Dk, Dv]`` or None (zeros).

    Returns:
        (o ``[L, H, Dv]``, final state ``[H, Dk, Dv]``), both in ``dtype``.
    """
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    L, H, Dk = k.shape
    S = q.new_zeros(H, Dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    q = q * Dk**-0.5
    outs = []
    for t in range(L):
        S = S * torch.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs), S
