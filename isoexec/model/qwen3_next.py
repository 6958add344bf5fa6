"""Qwen3-Next (transformers ``Qwen3NextForCausalLM``; vLLM ``qwen3_next.py``): the family's shared
layers with Gated DeltaNet projections fused per key-head group, ``in_proj_qkvz`` and ``in_proj_ba``."""

from __future__ import annotations

import torch

from isoexec.kernels import KernelSet
from isoexec.model.layers import GatedDeltaNet, W
from isoexec.model.unified import UnifiedModel


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Fused projections: ``in_proj_qkvz [2*Hk*Dk + 2*Hv*Dv, H]``, ``in_proj_ba [2*Hv, H]``."""

    def make_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = W(2 * self.key_dim + 2 * self.value_dim, hidden)
        self.in_proj_ba = W(2 * self.hv, hidden)

    def project(self, ks: KernelSet, x):
        """transformers' ``fix_query_key_value_ordering``: per key-head group ``[q | k | v-group | z-group]``
        and ``[b | a]``."""
        n, r = x.shape[0], self.hv // self.hk
        proj = ks["gdn.in_proj"]
        qkvz = proj(x, self.in_proj_qkvz.weight).view(n, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = torch.split(proj(x, self.in_proj_ba.weight).view(n, self.hk, 2 * r), [r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, self.hv, self.dv), b.reshape(n, self.hv), a.reshape(n, self.hv)


class Qwen3NextModel(UnifiedModel):
    """The unified model for ``Qwen3NextForCausalLM`` checkpoints."""

    gdn_class = Qwen3NextGatedDeltaNet
    model_types = ("qwen3_next",)
