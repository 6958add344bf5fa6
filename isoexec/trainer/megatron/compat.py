"""Every workaround megatron-core 0.16.1 needs here, in one place, keyed by the device it runs on.

The Megatron trainer runs where the process runs: on a CUDA device wherever one exists (one process
per GPU, NCCL), else on the CPU (gloo): :data:`DEVICE`. Call :func:`apply` once per process before
building a Megatron model (it is idempotent); the modules of this package call it on import.
Nothing here edits Megatron's installed files: each fix replaces a module attribute or a ``torch``
entry point at run time, and names the upstream file/line it works around. Paths are relative to
``megatron/core/`` (megatron-core 0.16.1) or ``fla/`` (fla-core 0.6.0). :func:`fixes` lists what
applies on a device.

CPU only (a CUDA process runs Megatron's own code paths):

1. ``ssm/gated_delta_net.py`` lines 39-47 import ``l2norm`` and ``chunk_gated_delta_rule`` from
   flash-linear-attention (fla), whose Triton kernels do not run on a CPU (and whose import takes
   ~15 s). A stand-in ``fla`` package is placed in ``sys.modules`` for that import only; afterwards
   the module's globals are bound to torch implementations: ``l2norm`` as fla's reference formula,
   ``chunk_gated_delta_rule`` as Megatron's own ``torch_chunk_gated_delta_rule`` (same file, line
   572: the chunked torch GDN it runs in ``deterministic_mode``, copied from transformers).
2. ``torch.cuda.current_device()`` is used as a tensor factory device in
   ``ssm/gated_delta_net.py`` lines 173-245, ``transformer/moe/router.py`` line 90,
   ``transformer/dot_product_attention.py`` line 123 and
   ``models/common/embeddings/rotary_pos_embedding.py`` line 162; without CUDA it raises. It answers
   ``"cpu"``.
5. ``tensor_parallel/random.py``: the default CUDA RNG tracker calls ``torch.cuda.get_rng_state``;
   :func:`init_rng_tracker` installs the inference tracker (line 321), which never touches CUDA
   (no dropout is used: every dropout probability is 0). On CUDA it seeds Megatron's own tracker
   (``model_parallel_cuda_manual_seed``, line 378).

CUDA only:

9. ``fla/ops/common/chunk_o.py`` line 727 (fla-core 0.6.0) refuses the gated chunk backward
   (``chunk_bwd_dqkwg``) on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue 640), so Megatron's GDN
   (``ssm/gated_delta_net.py`` line 382, ``chunk_gated_delta_rule``) cannot train there. Its global is
   bound to fla's chunk forward with the gradient of Megatron's ``torch_chunk_gated_delta_rule``
   (:func:`isoexec.kernels.autograd.with_ref_grad`): the forward bits stay fla's; the backward is the
   fastest correct one on that stack (the native set of the unified model does the same).

Every device (no Transformer Engine, and the trainer's setting "every fusion off"):

3. ``transformer/moe/moe_utils.py`` line 1192 reads ``te_general_gemm``, which is only defined when
   Transformer Engine imports (lines 22-38): a NameError without TE. It is set to ``None`` (the
   branch Megatron takes when TE exists but the GEMM is unwanted).
4. ``jit.py`` line 33 makes ``jit_fuser`` ``torch.compile`` at import; every ``@jit_fuser`` method
   then compiles on its first call (on the CPU the first step took 11.7 s instead of 1 s; on CUDA each
   new shape recompiles). Like the fusion flags of :func:`~isoexec.trainer.megatron.config.transformer_config`
   it is switched off: ``disable_jit_fuser()`` runs before the modules below are imported, and the
   one compiled method already on our path when ``megatron.core`` finished importing
   (``transformer/moe/router.py`` line 531, ``TopKRouter._apply_expert_bias``) is unwrapped to its
   original function.

Not patches, but the reason for choices made elsewhere (both devices):

6. ``transformer/utils.py`` line 35 (``get_default_causal_mask``) builds the mask on ``"cuda"``: the
   trainer always passes an explicit mask (:func:`causal_padding_mask`), so the default is never
   built.
7. ``transformer/moe/token_dispatcher.py`` line 445: the all-to-all dispatcher creates a
   ``torch.cuda.Stream``; :func:`isoexec.trainer.megatron.config.transformer_config` selects Megatron's
   all-gather dispatcher instead.
8. Megatron's optimizer does not run on CPU (``optimizer/``: bf16 master copies refuse CPU tensors,
   gradient clipping asserts CUDA tensors); the trainer steps its own fp32-master AdamW on Megatron's
   ``main_grad`` on every device (:meth:`isoexec.trainer.megatron.trainer.MegatronTrainer.step`).
"""

from __future__ import annotations

import sys
import types

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""The device of this process's Megatron trainer: ``"cuda"`` wherever CUDA is available, else ``"cpu"``."""

_FIXES = {
    "cpu": ("fla_stand_in", "current_device_cpu", "te_general_gemm", "jit_fuser_off", "inference_rng_tracker"),
    "cuda": ("fla_chunk_torch_backward", "te_general_gemm", "jit_fuser_off", "cuda_rng_tracker"),
}
_APPLIED: str | None = None


def fixes(device: str) -> tuple[str, ...]:
    """The fixes :func:`apply` and :func:`init_rng_tracker` make on ``device`` (names, in order).

    Raises:
        ValueError: ``device`` not ``"cpu"`` or ``"cuda"``.
    """
    if device not in _FIXES:
        raise ValueError(f"device={device!r}; allowed: {sorted(_FIXES)}")
    return _FIXES[device]


def _torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``l2norm`` formula in torch: ``x * rsqrt(sum(x^2) + eps)`` computed in fp32, returned in ``x.dtype``."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _import_gated_delta_net_cpu():
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


def fla_chunk_with_torch_backward(fla_chunk, torch_chunk):
    """Fix 9: ``chunk_gated_delta_rule`` with fla's forward and the gradient of Megatron's torch chunk.

    Args:
        fla_chunk: fla's ``chunk_gated_delta_rule``. torch_chunk: Megatron's ``torch_chunk_gated_delta_rule``.

    Returns:
        A function with Megatron's call (``q, k, v [B, T, H, D]``, keywords ``g, beta [B, T, H]``,
        ``initial_state=None``, ``output_final_state=False``, ``use_qk_l2norm_in_kernel``) returning
        ``(o [B, T, H, Dv], None)``.

    Raises (from the returned function):
        ValueError: an initial state or a final state is asked for (the trainer uses neither).
    """
    from isoexec.kernels.autograd import with_ref_grad

    def chunk(q, k, v, g, beta, initial_state=None, output_final_state=False, **kw):
        if initial_state is not None or output_final_state:
            raise ValueError("the GDN of the Megatron trainer runs from an empty state and returns no final state")

        def fwd(*t):
            with torch.no_grad():
                return fla_chunk(t[0], t[1], t[2], g=t[3], beta=t[4], **kw)[0]

        def ref(*t):
            return torch_chunk(t[0], t[1], t[2], g=t[3], beta=t[4], **kw)[0]

        return with_ref_grad(fwd, ref, q, k, v, g, beta), None

    return chunk


def apply(device: str | None = None) -> None:
    """Apply the import-time fixes of ``device`` (default :data:`DEVICE`; idempotent). The RNG fix is
    :func:`init_rng_tracker`, fix 6 :func:`causal_padding_mask`.

    Raises:
        ValueError: an unknown device. RuntimeError: the fixes of another device were applied in this
            process already.
    """
    global _APPLIED
    device = device or DEVICE
    todo = fixes(device)
    if _APPLIED is not None:
        if _APPLIED != device:
            raise RuntimeError(f"Megatron's fixes for {_APPLIED!r} are applied in this process; cannot switch to {device!r}")
        return
    if "current_device_cpu" in todo:  # fix 2
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
    if "fla_stand_in" in todo:  # fix 1
        _import_gated_delta_net_cpu()
    else:  # fix 9
        import megatron.core.ssm.gated_delta_net as gdn
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        gdn.chunk_gated_delta_rule = fla_chunk_with_torch_backward(chunk_gated_delta_rule, gdn.torch_chunk_gated_delta_rule)
    _APPLIED = device


def init_rng_tracker(device: str | None = None, seed: int = 0) -> None:
    """Fix 5: Megatron's RNG tracker. CPU: the inference tracker, without CUDA RNG calls
    (``initialize_rng_tracker(inference_rng_tracker=True)``); CUDA: ``model_parallel_cuda_manual_seed(seed)``."""
    from megatron.core.tensor_parallel import random

    if "inference_rng_tracker" in fixes(device or DEVICE):
        random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        random.model_parallel_cuda_manual_seed(seed)


def causal_padding_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Fix 6: the explicit attention mask of a right-padded batch, in Megatron's convention.

    Args:
        lengths: ``[B]`` int64 real tokens per row (>= 1).
        seq_len: L, the padded length.

    Returns:
        ``[B, 1, L, L]`` bool (on ``lengths.device``), True where query i must not see key j: ``j > i``
        (causal) or ``j >= lengths[b]`` (padding). Real rows see exactly their causal prefix, so the
        padding never reaches them; every pad row keeps key 0 visible (no all-masked softmax row).
    """
    j = torch.arange(seq_len, device=lengths.device)
    causal = j[None, :] > j[:, None]  # [L, L]
    pad = j[None, :] >= lengths[:, None]  # [B, L]
    return (causal[None] | pad[:, None, :])[:, None]


def key_padding_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The padding part of :func:`causal_padding_mask` alone, ``[B, 1, 1, L]`` bool, True where key
    ``j >= lengths[b]`` (Megatron's convention; it broadcasts over the query rows): what the ``isoexec``
    modules read (the real lengths, :func:`padding_lengths`), without the ``L x L`` causal part. Under
    context parallelism every rank gets the whole sequence's mask."""
    return (torch.arange(seq_len, device=lengths.device)[None, :] >= lengths[:, None])[:, None, None]


def padding_lengths(mask: torch.Tensor) -> list[int]:
    """The real lengths (host ints, one per row) of a mask from :func:`causal_padding_mask` or
    :func:`key_padding_mask`: the keys its last query row may see."""
    return (~mask[:, 0, -1, :]).sum(-1).tolist()
