"""Megatron's gated ``SelfAttention`` with the output-gate fix for ``num_query_groups < TP`` (the ``native``
set's attention slot, and the base of :class:`~isoexec.trainer.megatron.layers.IsoSelfAttention`)."""

from __future__ import annotations

from isoexec.trainer.megatron import compat

compat.apply()

from megatron.core.parallel_state import get_tensor_model_parallel_rank  # noqa: E402
from megatron.core.transformer.attention import SelfAttention  # noqa: E402


class GatedSelfAttention(SelfAttention):
    """``SelfAttention`` whose output gate keeps only this rank's heads when query groups < TP.

    megatron-core 0.16.1 ``transformer/attention.py`` lines 1398-1417, 1464-1479 and 1486-1490: with
    ``num_query_groups < tp`` every rank all-gathers the fused QKV, takes its query group and then
    slices ``query`` to its own ``num_q_heads / tp`` heads, but returns the group's whole ``gate``, so
    ``_apply_output_gate`` fails on the shape. This slices ``gate`` the same way as ``query``.
    """

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        if not output_gate or self.config.num_query_groups >= self.world_size:
            return out
        query, key, value, gate = out
        per = self.world_size // self.config.num_query_groups
        size = gate.shape[2] // per
        idx = get_tensor_model_parallel_rank() % per
        return query, key, value, gate[:, :, idx * size : (idx + 1) * size]
