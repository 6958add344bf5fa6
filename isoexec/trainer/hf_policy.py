"""The native trainer: Hugging Face transformers' ``Qwen3NextForCausalLM`` behind the trainer interface.

This is what an off-the-shelf RL trainer runs (native mode): the transformers model and its default
kernels, parameters in the checkpoint dtype (bf16, updated from fp32 master weights by
:class:`isoexec.trainer.optim.MasterAdamW`), logprobs as ``log_softmax(logits.float() / T)``.

It exposes the same call as the unified model (``trainer_logprobs(input_ids, cu_seqlens, grad)``),
so the RL loop, the optimizer and the weight sync do not know which trainer they drive.
"""

from __future__ import annotations

from pathlib import Path

import torch

from isoexec.model.inputs import check_cu_seqlens, check_token_ids

_TORCH_GDN_FORCED = False


def force_torch_gdn() -> None:
    """Make transformers' Qwen3-Next use its pure-PyTorch Gated DeltaNet on CPU.

    transformers picks the GDN implementation at import time: when flash-linear-attention is
    importable (it is, in the CPU stack) the module globals ``torch_chunk_gated_delta_rule`` and
    ``torch_recurrent_gated_delta_rule`` are wrappers around fla's Triton kernels, which fail on CPU
    ("0 active drivers"). There is no config flag for this; the wrappers keep the reference
    functions in ``__wrapped__`` (``functools.wraps``), so we put those back into the module globals
    the forward looks up. Only the native trainer on CPU calls this; the causal conv1d already falls
    back to PyTorch (``causal_conv1d`` is not installed). Idempotent.
    """
    global _TORCH_GDN_FORCED
    if _TORCH_GDN_FORCED:
        return
    import transformers.models.qwen3_next.modeling_qwen3_next as m

    from isoexec.kernels.gdn.native import torch_references

    m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule = torch_references()
    _TORCH_GDN_FORCED = True


def unpack(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, pad_id: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Packed ``[T]`` tokens with ``cu_seqlens [B+1]`` -> right-padded ``[B, Lmax]`` and the lengths."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    out = torch.full((len(lens), max(lens)), pad_id, dtype=torch.long)
    for b, (s, n) in enumerate(zip(cu_seqlens[:-1].tolist(), lens)):
        out[b, :n] = input_ids[s : s + n]
    return out, lens


class HFPolicy:
    """transformers ``Qwen3NextForCausalLM`` as the native trainer.

    Args:
        model: the transformers model (parameters in the compute dtype, usually bf16).
        temperature: policy temperature applied to the fp32 logits before the softmax.
    """

    kernel_set = "native"

    def __init__(self, model: torch.nn.Module, temperature: float = 1.0):
        if next(model.parameters()).device.type == "cpu":
            force_torch_gdn()
        self.model = model
        self.temperature = float(temperature)

    @classmethod
    def from_pretrained(cls, path: str | Path, temperature: float = 1.0, dtype: torch.dtype | None = None) -> HFPolicy:
        """Load a checkpoint directory; ``dtype`` None keeps the checkpoint dtype (``config.dtype``).

        Raises:
            isoexec.model.hf.CheckpointError: tensors that contradict the config (transformers would
                initialise a missing tensor at random and only warn).
        """
        from isoexec.model.hf import check_checkpoint

        check_checkpoint(path)
        force_torch_gdn()
        from transformers import Qwen3NextForCausalLM

        model = Qwen3NextForCausalLM.from_pretrained(str(path), dtype="auto" if dtype is None else dtype)
        model.train()  # no dropout in this model; train mode only matters for autograd bookkeeping
        return cls(model, temperature)

    def named_parameters(self):
        """Parameters with their Hugging Face names (``model.layers.0.linear_attn...``)."""
        return self.model.named_parameters()

    def trainer_logprobs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, grad: bool) -> torch.Tensor:
        """Full-vocabulary logprobs of packed sequences.

        Args:
            input_ids: ``[T]`` long, the sequences concatenated.
            cu_seqlens: ``[B+1]`` long, sequence boundaries (``cu_seqlens[0] == 0``, last ``== T``).
            grad: True for ``trainer_fwd`` (autograd graph kept), False for ``trainer_score``.

        Returns:
            ``[T, V]`` float32; row ``t`` is the distribution of the token after ``t`` (the last row of
            each sequence predicts past its end and is unused). Sequences are right-padded into one
            batch; with a causal model the padding after a sequence never reaches its rows.

        Raises:
            isoexec.model.inputs.InputError: an id outside ``[0, V)``; no sequence or an empty one;
                cu_seqlens not starting at 0, decreasing, or not ending at T.
        """
        check_cu_seqlens(cu_seqlens, input_ids.numel())
        check_token_ids(input_ids, self.model.config.vocab_size)
        padded, lens = unpack(input_ids, cu_seqlens, pad_id=0)
        with torch.set_grad_enabled(grad):
            logits = self.model(input_ids=padded, use_cache=False).logits  # [B, L, V] in the param dtype
            logits = torch.cat([logits[b, :n] for b, n in enumerate(lens)])
            return torch.log_softmax(logits.float() / self.temperature, dim=-1)

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under the *checkpoint* names that vLLM and the unified model load (detached).

        transformers 5 fuses each MoE block's experts on load; :data:`isoexec.model.hf.HF_NAMES`
        splits them back into per-expert views (no copy); every other parameter keeps its name.
        """
        from isoexec.model.hf import HF_NAMES

        return HF_NAMES.apply({n: p.detach() for n, p in self.model.named_parameters()})

    def contract(self):
        """The native trainer carries no execution contract."""
        return None

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(str(path))
