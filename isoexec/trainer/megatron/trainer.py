"""One rank of the Megatron trainer: the same call as the other trainers, on a TP/EP/SP layout.

Built after :func:`~isoexec.trainer.megatron.launch.init_parallel` on every rank of the layout, and
driven identically on every rank (same batch, same calls): it is the object a Ray actor, a ``torchrun``
process or a test worker holds. It runs on :data:`~isoexec.trainer.megatron.compat.DEVICE` (the
process's GPU where CUDA exists, with the Triton ``isoexec`` set; else the CPU set on the CPU); inputs
may live anywhere, outputs live on that device. The model is a Megatron ``GPTModel`` from :func:`~isoexec.trainer.megatron.spec.build_gpt_model`
(kernel set ``native`` or ``isoexec``), wrapped in Megatron's ``DistributedDataParallel`` for its fp32
``main_grad`` buffers; weights come from a Hugging Face state dict through
:mod:`~isoexec.trainer.megatron.convert`.

- :meth:`MegatronTrainer.trainer_logprobs`: packed ``[T]`` tokens -> ``[T, V]`` fp32 full-vocabulary
  logprobs, identical on every rank (the vocabulary dim is gathered over TP, the sequence over CP).
  Megatron's GDN refuses packed sequences, so the batch runs right-padded as ``[B, Lmax]`` (``Lmax``
  rounded up to a multiple of 2 CP x TP under sequence parallelism) with an explicit mask (causal +
  padding for ``native``; the padding alone for ``isoexec``, whose modules read the real lengths).
  Under context parallelism (``layout.cp``) each rank runs its two load-balanced chunks of ``Lmax / (2 cp)``
  positions (:mod:`isoexec.kernels.collectives.cp`) and the logprob rows are all-gathered; only the
  ``isoexec`` set runs it (Megatron's local attention and GDN have no CP without Transformer Engine).
- :meth:`MegatronTrainer.checkpoint_state_dict`: the weights under HF names, gathered over TP/EP (what a
  weight sync sends to the engine).
- :meth:`MegatronTrainer.step`: the fp32-master AdamW of the other trainers
  (:class:`isoexec.trainer.optim.MasterAdamW`) on each rank's shards, reading Megatron's ``main_grad``
  after ``finalize_model_grads``, with a TP/EP-aware global grad norm (Megatron's own optimizer does
  not run on CPU).
- :meth:`MegatronTrainer.contract`: the isoexec execution contract (the unified model's, same kernel
  set) or None for ``native``; building an isoexec trainer on a layout outside the contract's
  topology claim raises :class:`~isoexec.contract.ClaimViolation`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from isoexec.trainer.megatron import compat
from isoexec.trainer.megatron.config import Layout, transformer_config
from isoexec.trainer.megatron.convert import full_to_hf, gather_full_state, hf_to_full, rank_state


def check_layout(contract, layout: Layout, device: str = "cpu") -> None:
    """Refuse a layout outside the contract's topology claim, or, under context parallelism, outside the
    degrees proven together with it (:func:`isoexec.kernels.topology.topology_problems`).

    Raises:
        ClaimViolation: naming each degree (tp, ep, sp, dp, cp) outside its claimed domain, or each
            degree that context parallelism is not proven with (path ``claims.topology.cp``).
    """
    from isoexec.contract import ClaimViolation, Violation, check_topology
    from isoexec.kernels.topology import topology_problems

    check_topology(contract, **layout.degrees())
    joint = topology_problems("isoexec", device, layout.degrees())
    if joint:
        raise ClaimViolation([Violation("claims.topology.cp", m) for m in joint])


NATIVE_CP = ("the native set cannot run context parallelism (cp > 1): megatron-core 0.16.1's local "
             "DotProductAttention asserts context_parallel_size == 1 (CP needs Transformer Engine's attention) and "
             "its GatedDeltaNet has none (transformer_config.py: 'Gated delta net does not support context "
             "parallel'); run cp > 1 with the isoexec set, or native at cp=1")
"""Why the ``native`` set refuses ``cp > 1`` (the trainer at construction, the experiment config at load)."""


class MegatronTrainer:
    """The Megatron trainer on this rank.

    Args:
        hf_config: transformers Qwen3-Next config (``vocab_size`` divisible by ``layout.tp``).
        layout: the parallel layout; :func:`~isoexec.trainer.megatron.launch.init_parallel` must have
            been called with it.
        kernel_set: ``"native"`` (Megatron's stock modules) or ``"isoexec"`` (our kernels, pik).
        kernels: an ``isoexec.config.KernelSection`` (defaults if None): the pinned constants of the
            ``isoexec`` set (built for this process's device) and the policy temperature of both sets;
            or a :class:`~isoexec.kernels.KernelSet` whose section gives them and which the ``isoexec`` set
            runs instead (e.g. the Triton set on CPU tensors under ``TRITON_INTERPRET=1``, fp32 only, for
            checks without a GPU).
        dtype: parameter dtype (``torch.bfloat16`` or ``torch.float32``).
        lr, betas, eps, weight_decay, max_grad_norm: AdamW of :meth:`step`.

    Raises:
        ValueError: unknown kernel set, a native KernelSet for the ``isoexec`` set, ``native`` with
        ``cp > 1`` (:data:`NATIVE_CP`), or heads / experts / vocabulary not divisible by the layout's degrees.
        ClaimViolation: an ``isoexec`` layout outside the contract's topology claim or the degrees proven
        with context parallelism (checked before Megatron is imported or any process group is touched).
    """

    def __init__(self, hf_config, layout: Layout, kernel_set: str = "isoexec", kernels=None,
                 dtype: torch.dtype = torch.bfloat16, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0):
        from isoexec.config import KernelSection
        from isoexec.kernels import KernelSet, build_kernel_set

        if kernel_set not in ("native", "isoexec"):
            raise ValueError(f"kernel_set must be 'native' or 'isoexec', got {kernel_set!r}")
        if kernel_set == "isoexec" and isinstance(kernels, KernelSet) and kernels.mode != "isoexec":
            raise ValueError(f"kernels is a {kernels.mode!r} kernel set; kernel_set='isoexec' needs an 'isoexec' one")
        if kernel_set == "native" and layout.cp > 1:
            raise ValueError(NATIVE_CP)
        self.hf_config, self.layout, self.kernel_set, self.dtype = hf_config, layout.check(), kernel_set, dtype
        section = kernels.section if isinstance(kernels, KernelSet) else (kernels or KernelSection())
        self.temperature = float(section.temperature)
        self.kernels = None
        if kernel_set == "isoexec":
            self.kernels = kernels if isinstance(kernels, KernelSet) else build_kernel_set("isoexec", compat.DEVICE, section)
            check_layout(self.contract(), layout, "cpu" if self.kernels.arch == "cpu" else "cuda")
        compat.apply()
        self.config = transformer_config(hf_config, layout, dtype)
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from isoexec.trainer.megatron.launch import groups
        from isoexec.trainer.megatron.layers import _device
        from isoexec.trainer.megatron.spec import build_gpt_model

        self.groups, self.device = groups(), _device()
        self.model = build_gpt_model(hf_config, self.config, self.kernels).to(self.device)
        self.model.train()  # no dropout anywhere; train mode only matters for autograd bookkeeping
        self.ddp = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=False),
            module=self.model,
        )
        self.hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        self.optimizer = None  # built at the first step, from the loaded weights

    # ----------------------------------------------------------------------------------- weights
    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (every rank passes the same full state dict; it keeps its shards).

        Raises:
            KeyError / ValueError from the converter; RuntimeError on missing/unexpected names (strict).
        """
        from megatron.core import parallel_state as ps

        full = hf_to_full(hf, self.hf_config, self.layout.tp, self.layout.expert_tp)
        local = rank_state(full, self.hf_config, self.layout.ep, ps.get_tensor_model_parallel_rank(),
                           ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
        with torch.no_grad():  # Megatron's linears add their empty ``_extra_state`` in a load hook
            self.model.load_state_dict({k: v.to(self.dtype) for k, v in local.items()}, strict=True)
        self.optimizer = None

    @classmethod
    def from_pretrained(cls, path: str | Path, layout: Layout, kernel_set: str = "isoexec", kernels=None,
                        dtype: torch.dtype | None = None, **kw) -> "MegatronTrainer":
        """Build on this rank and load a HF ``Qwen3NextForCausalLM`` checkpoint folder.

        ``dtype`` None keeps the checkpoint's dtype; other keywords go to the constructor.

        Raises:
            isoexec.model.hf.CheckpointError: tensors that contradict the config (before any rank loads).
        """
        from isoexec.model.hf import check_checkpoint, config_dtype, read_config, read_weights

        check_checkpoint(path)
        cfg = read_config(path)
        dtype = dtype or config_dtype(cfg)
        trainer = cls(cfg, layout, kernel_set, kernels, dtype, **kw)
        sd = read_weights(path)
        if getattr(cfg, "tie_word_embeddings", False):
            sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
        trainer.load_hf_state_dict(sd)
        return trainer

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """All weights under Hugging Face checkpoint names, gathered over TP / expert TP / EP
        (a collective: every rank calls it; every rank gets the full dict). Detached, compute dtype."""
        local = {k: v.detach() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        return full_to_hf(gather_full_state(local, self.hf_config, self.groups), self.hf_config)

    def named_parameters(self):
        """``(HF name, gathered tensor)`` pairs of :meth:`checkpoint_state_dict` (copies, not the live
        shards: the optimizer is :meth:`step`)."""
        return iter(self.checkpoint_state_dict().items())

    # ----------------------------------------------------------------------------------- forward
    def trainer_logprobs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, grad: bool) -> torch.Tensor:
        """Full-vocabulary logprobs of packed sequences (``trainer_fwd`` with ``grad``, else ``trainer_score``).

        Args:
            input_ids: ``[T]`` int64, sequences concatenated.
            cu_seqlens: ``[B+1]`` int64 offsets rising strictly from 0 to T.
            grad: keep the autograd graph (``trainer_fwd``).

        Returns:
            ``[T, V]`` fp32 on every rank (on this trainer's device); row t is the distribution of the
            token after ``input_ids[t]`` at the policy temperature.

        Raises:
            isoexec.model.inputs.InputError: an id outside ``[0, V)``, an empty batch or sequence, or
                malformed ``cu_seqlens`` (the unified model's checks).

        Under context parallelism every rank computes its slice's rows and all-gathers them; the gradient
        of the gathered rows is taken back as Megatron-LM does for its CP loss (this rank's rows, times
        ``cp``: Megatron's DDP averages over the data- and context-parallel ranks).
        """
        from isoexec.model.inputs import check_cu_seqlens, check_token_ids

        from isoexec.kernels.collectives.cp import gather_sequence_replicated
        from isoexec.trainer.megatron.layers import cp_slice, keep_in_graph

        cu = check_cu_seqlens(cu_seqlens, input_ids.numel())
        check_token_ids(input_ids, self.hf_config.vocab_size)
        lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])])
        cp = self.layout.cp
        step = (2 * cp if cp > 1 else 1) * (self.layout.tp if self.layout.sp else 1)  # 2 cp chunks, each rank's rows over SP
        lmax = -(-int(lengths.max()) // step) * step
        padded = torch.zeros(len(lengths), lmax, dtype=torch.long)
        for b, (a, n) in enumerate(zip(cu, lengths.tolist())):
            padded[b, :n] = input_ids[a : a + n].cpu()
        piece = cp_slice(lmax // cp)
        positions = piece.positions().expand(len(lengths), piece.size)
        padded = padded.gather(1, positions).to(self.device)
        positions = positions.to(self.device)
        if self.kernels is None:
            mask = compat.causal_padding_mask(lengths.to(self.device), lmax)
        else:  # the isoexec modules read the real lengths only
            mask = compat.key_padding_mask(lengths.to(self.device), lmax)
        local = piece.local_lengths(lengths.tolist())
        with torch.set_grad_enabled(grad):
            logits = self.ddp(input_ids=padded, position_ids=positions, attention_mask=mask,
                              runtime_gather_output=True)  # [B, Lmax / cp, V]
            rows = torch.cat([logits[b, :n] for b, n in enumerate(local)])
            if self.kernels is None:
                lp = torch.log_softmax(rows.float() / self.temperature, dim=-1)
            elif rows.shape[0]:
                lp = self.kernels["logprob"](rows)
            else:  # a CP slice of padding only
                lp = rows.new_zeros(rows.shape)
            if piece.degree == 1:
                return lp
            # every rank's rows, put in sequence order (the gather's backward: this rank's rows, x cp)
            idx = torch.cat([b * piece.size + torch.arange(n, device=lp.device) for b, n in enumerate(local)])
            mine = lp.new_zeros(len(local) * piece.size, lp.shape[1]).index_copy(0, idx, lp)
            if not rows.shape[0]:
                mine = keep_in_graph(mine, logits)
            full = gather_sequence_replicated(mine.view(len(local), piece.size, -1), self.groups["cp"], dim=1)
            full = full.index_select(1, piece.gather_order(full.device))
            return torch.cat([full[b, :n] for b, n in enumerate(lengths.tolist())])

    # --------------------------------------------------------------------------------- optimizer
    def zero_grad(self) -> None:
        """Zero Megatron's ``main_grad`` buffers (and any ``.grad``)."""
        self.ddp.zero_grad_buffer()
        for p in self.model.parameters():
            p.grad = None

    def grad_norm(self, grads: dict[str, torch.Tensor]) -> float:
        """Global L2 norm of this rank's gradient shards ``{parameter name: fp32 gradient}``: TP-replicated
        tensors counted once (TP rank 0), TP shards on every rank, summed over TP; expert tensors
        summed over the expert tensor-and-model-parallel ranks. A collective; the same value on every rank."""
        from megatron.core import parallel_state as ps

        params = dict(self.model.named_parameters())
        dense = torch.zeros(1, dtype=torch.float64, device=self.device)
        expert = torch.zeros(1, dtype=torch.float64, device=self.device)
        tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
        for name, g in grads.items():
            p, sq = params[name], (g.double() ** 2).sum()
            sharded = getattr(p, "tensor_model_parallel", False)
            if getattr(p, "allreduce", True):  # Megatron marks expert-parallel tensors allreduce=False
                dense += sq if (sharded or tp_rank == 0) else 0.0
            else:
                expert += sq if (sharded or etp_rank == 0) else 0.0
        dist.all_reduce(dense, group=self.groups["tp"])
        dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
        return math.sqrt(float(dense + expert))

    def build_optimizer(self):
        """This rank's :class:`~isoexec.trainer.optim.MasterAdamW` over its shards (reading ``main_grad``,
        clipping by :meth:`grad_norm`), built once from the current weights; :meth:`step` runs it."""
        from isoexec.trainer.optim import MasterAdamW

        if self.optimizer is None:
            self.optimizer = MasterAdamW(self.model.named_parameters(), grad_of=lambda p: p.main_grad,
                                         norm_of=self.grad_norm, **self.hyper)
        return self.optimizer

    def step(self) -> float:
        """One AdamW update of every local shard from the accumulated gradients (a collective).

        Finalizes the gradients with Megatron's ``finalize_model_grads`` (data-parallel reduce, the
        all-reduce of sequence-parallel weights over TP), then :class:`~isoexec.trainer.optim.MasterAdamW`
        clips by :meth:`grad_norm`, steps the fp32 masters and writes ``dtype(master)`` back.

        Returns:
            The global gradient L2 norm before clipping (``nan``/``inf``: no update).
        """
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        norm = self.build_optimizer().step()
        self.zero_grad()
        return norm

    # ---------------------------------------------------------------------------------- contract
    def contract(self):
        """The execution contract of the ``isoexec`` set (the unified model's, with the same kernel set
        and config, so the engine's handshake matches); None for ``native``."""
        if self.kernels is None:
            return None
        from isoexec.model.unified import build_contract

        return build_contract(self.hf_config, self.kernels, self.dtype)
