"""Every workaround megatron-core 0.16.1 needs to run on a CPU with gloo, in one place.

Call :func:`apply` once per process before building a Megatron model (it is idempotent); the
modules of this package call it on import. Nothing here edits Megatron's installed files: each fix
replaces a module attribute or a ``torch`` entry point at run time, and names the upstream
file/line of megatron-core 0.16.1 it works around. Paths are relative to ``megatron/core/``.

1. ``ssm/gated_delta_net.py`` lines 39-47 import ``l2norm`` and ``chunk_gated_delta_rule`` from
   flash-linear-attention (fla), whose Triton kernels do not run on a CPU (and whose import takes
   ~15 s). A stand-in ``fla`` package is placed in ``sys.modules`` for that import only; afterwards
   the module's globals are bound to torch implementations: ``l2norm`` as fla's reference formula,
   ``chunk_gated_delta_rule`` as Megatron's own ``torch_chunk_gated_delta_rule`` (same file, line
   572: the chunked torch GDN it runs in ``deterministic_mode``, copied from transformers).
2. ``torch.cuda.current_device()`` is used as a tensor factory device in
   ``ssm/gated_delta_net.py`` lines 173-245, ``transformer/moe/router.py`` line 90,
   ``transformer/dot_product_attention.py`` line 123 and
   ``models/common/embeddings/rotary_pos_embedding.py`` line 162; without CUDA it raises. Where no
   CUDA device exists, it answers ``"cpu"``.
3. ``transformer/moe/moe_utils.py`` line 1192 reads ``te_general_gemm``, which is only defined when
   Transformer Engine imports (lines 22-38): a NameError without TE. It is set to ``None`` (the
   branch Megatron takes when TE exists but the GEMM is unwanted).
4. ``jit.py`` line 33 makes ``jit_fuser`` ``torch.compile`` at import; every ``@jit_fuser`` method
   then compiles on its first CPU call (first step 11.7 s instead of 1 s). ``disable_jit_fuser()``
   runs before the modules below are imported, and the one compiled method already on our path when
   ``megatron.core`` finished importing (``transformer/moe/router.py`` line 531,
   ``TopKRouter._apply_expert_bias``) is unwrapped to its original function.
5. ``tensor_parallel/random.py``: the default CUDA RNG tracker calls ``torch.cuda.get_rng_state``;
   :func:`init_rng_tracker` installs the inference tracker (line 321), which never touches CUDA
   (no dropout is used: every dropout probability is 0).
6. ``transformer/utils.py`` line 35 (``get_default_causal_mask``) builds the mask on ``"cuda"``: the
   trainer always passes an explicit mask (:func:`causal_padding_mask`), so the default is never
   built.
7. ``transformer/moe/token_dispatcher.py`` line 445: the all-to-all dispatcher creates a
   ``torch.cuda.Stream``; :func:`isoexec.trainer.megatron.config.transformer_config` selects Megatron's
   all-gather dispatcher instead.
8. Megatron's optimizer does not run on CPU (``optimizer/``: bf16 master copies refuse CPU tensors,
   gradient clipping asserts CUDA tensors); the trainer steps its own fp32-master AdamW on Megatron's
   ``main_grad`` (:meth:`isoexec.trainer.megatron.trainer.MegatronTrainer.step`).
"""

from __future__ import annotations

import sys
import types

import torch

_APPLIED = False


def _torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``l2norm`` formula in torch: ``x * rsqrt(sum(x^2) + eps)`` computed in fp32, returned in ``x.dtype``."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _import_gated_delta_net():
    """Import ``megatron.core.ssm.gated_delta_net`` with a stand-in ``fla`` (fix 1) and bind its globals."""
    names = ["fla", "fla.modules", "fla.modules.l2norm", "fla.ops", "fla.ops.gated_delta_rule"]
    saved = {n: sys.modules.get(n) for n in names}
    stand_in = {n: types.ModuleType(n) for n in names}
    stand_in["fla.modules.l2norm"].l2norm = _torch_l2norm
    stand_in["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = None  # rebound below
    sys.modules.update(stand_in)
    try:
        import megatron.core.ssm.gated_delta_net as gdn
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    # Bind explicitly: the module may have been imported before, against the real fla.
    gdn.l2norm, gdn.chunk_gated_delta_rule, gdn.HAVE_FLA = _torch_l2norm, gdn.torch_chunk_gated_delta_rule, True
    return gdn


def apply() -> None:
    """Apply fixes 1-4 (idempotent). Fix 5 is :func:`init_rng_tracker`, fix 6 :func:`causal_padding_mask`."""
    global _APPLIED
    if _APPLIED:
        return
    if not torch.cuda.is_available():  # fix 2
        torch.cuda.current_device = lambda: "cpu"
    import megatron.core.jit as jit

    jit.disable_jit_fuser()  # fix 4: before the modules that decorate with it are imported
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    if not hasattr(moe_utils, "te_general_gemm"):  # fix 3
        moe_utils.te_general_gemm = None
    orig = getattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable", None)
    if orig is not None:  # fix 4, already compiled at import
        TopKRouter._apply_expert_bias = orig
    _import_gated_delta_net()  # fix 1
    _APPLIED = True


def init_rng_tracker() -> None:
    """Fix 5: Megatron's RNG tracker without CUDA RNG calls (``initialize_rng_tracker(inference_rng_tracker=True)``)."""
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def causal_padding_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Fix 6: the explicit attention mask of a right-padded batch, in Megatron's convention.

    Args:
        lengths: ``[B]`` int64 real tokens per row (>= 1).
        seq_len: L, the padded length.

    Returns:
        ``[B, 1, L, L]`` bool, True where query i must not see key j: ``j > i`` (causal) or
        ``j >= lengths[b]`` (padding). Real rows see exactly their causal prefix, so the padding
        never reaches them; every pad row keeps key 0 visible (no all-masked softmax row).
    """
    j = torch.arange(seq_len)
    causal = j[None, :] > j[:, None]  # [L, L]
    pad = j[None, :] >= lengths[:, None]  # [B, L]
    return (causal[None] | pad[:, None, :])[:, None]


def padding_lengths(mask: torch.Tensor) -> torch.Tensor:
    """The real lengths ``[B]`` (int64) of a mask from :func:`causal_padding_mask`: the keys its last
    query row may see."""
    return (~mask[:, 0, -1, :]).sum(-1)
