"""Qwen3.5 MoE text model (transformers ``Qwen3_5MoeForCausalLM``, the text model of
``Qwen3_5MoeForConditionalGeneration``): the family's shared layers with four separate Gated
DeltaNet projections, ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``. A multimodal
checkpoint's ``model.language_model.*`` names map to ``model.*`` in :data:`isoexec.model.hf.HF_NAMES`."""

from __future__ import annotations

from isoexec.kernels import KernelSet
from isoexec.model.layers import GatedDeltaNet, W
from isoexec.model.unified import UnifiedModel


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """Separate projections: ``in_proj_qkv [2*Hk*Dk + Hv*Dv, H]``, ``in_proj_z [Hv*Dv, H]``,
    ``in_proj_b`` / ``in_proj_a`` ``[Hv, H]``."""

    def make_projections(self, hidden: int) -> None:
        self.in_proj_qkv, self.in_proj_z = W(self.conv_dim, hidden), W(self.value_dim, hidden)
        self.in_proj_b, self.in_proj_a = W(self.hv, hidden), W(self.hv, hidden)

    def project(self, ks: KernelSet, x):
        n, proj = x.shape[0], ks["gdn.in_proj"]
        z = proj(x, self.in_proj_z.weight).view(n, self.hv, self.dv)
        return proj(x, self.in_proj_qkv.weight), z, proj(x, self.in_proj_b.weight), proj(x, self.in_proj_a.weight)


class Qwen3_5Model(UnifiedModel):
    """The unified model for Qwen3.5 MoE text checkpoints."""

    gdn_class = Qwen3_5GatedDeltaNet
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_5_text", "qwen3_5")
