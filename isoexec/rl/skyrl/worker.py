"""isoexec's policy worker for SkyRL: SkyRL's ``PolicyWorkerBase`` on isoexec's trainer backends.

SkyRL's ``PolicyWorkerBase`` (``skyrl/backends/skyrl_train/workers/worker.py``) owns the RL step:
micro-batching, the policy loss from SkyRL's ``PolicyLossRegistry`` (chosen by
``trainer.algorithm.policy_loss_type``), entropy/KL terms, metrics (``forward`` = the pre-update
``trainer_score``, ``forward_backward`` + ``optim_step`` = the PPO update). It reaches the model only
through

- ``self.model(sequences, num_actions, attention_mask, temperature=..., return_output=...,
  compute_entropy=...)`` -> action logprobs ``[B, num_actions]`` (and ``{"entropy": [B, S]}``),
- ``self.strategy`` (``backward``, ``optimizer_step``, ``all_reduce``), ``self.scheduler``.

This module supplies those on the trainer of ``trainer.backend`` (:func:`isoexec.trainer.factory.load_trainer`),
with no edit to SkyRL:

- :class:`PolicyModel`: the call above over the trainer's ``trainer_logprobs``. SkyRL's left-padded
  ``[B, S]`` rows are packed (``cu_seqlens``) and the full-vocabulary rows ``[T, V]`` float32 are
  gathered back; the policy temperature is the trainer's own (isoexec: the contract's) and any
  other temperature is refused.
- :class:`IsoExecStrategy`: ``DistributedStrategy`` whose optimizer step is the trainer's
  fp32-master AdamW (:class:`isoexec.trainer.optim.MasterAdamW`; Megatron: ``MegatronTrainer.step``,
  which finalizes Megatron's gradients and clips by the TP/EP-aware norm).
- :class:`IsoExecPolicyWorker`: one rank of the worker group. SkyRL starts
  ``trainer.placement.policy_num_gpus_per_node`` of them as Ray actors (the rendered config sets it to
  the trainer's world size: ``trainer.cp`` x ``max(trainer.tp, trainer.ep)`` ranks for ``megatron``, 1 otherwise);
  they form one gloo group, and for ``megatron`` each builds its shard of the model on the Megatron
  groups of the layout (:func:`isoexec.trainer.megatron.launch.init_parallel`). Every rank receives
  the whole batch (SkyRL's mesh: one data-parallel rank; Megatron's replicas want the same data) and
  runs the same calls; rank 0 is the one SkyRL collects from. Weight sync goes through SkyRL's sync
  path (``init_weight_sync_state`` / ``broadcast_to_inference_engines``): every rank joins the gather
  of its shards into the engine's Hugging Face names, and rank 0 sends them with the trainer's
  contract to :meth:`isoexec.rl.skyrl.client.IsoExecInferenceClient.update_named_weights`, where the
  engine runs the contract handshake before any weight moves, at every sync.

No critic or reference model: GRPO needs neither (the run config sets no critic path and no KL).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank
from skyrl.backends.skyrl_train.distributed.strategy import DistributedStrategy
from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase

from isoexec.config import ExperimentConfig
from isoexec.rl.skyrl.compat import cpu_device_answers, local_rank_on_present_gpus

SETTINGS_KEY = "isoexec"
"""Key in ``trainer.policy.model_config_kwargs`` holding ``{"mode", "experiment", "threads"}`` (experiment as JSON)."""


def isoexec_settings(model_config_kwargs: dict[str, Any]) -> tuple[str, ExperimentConfig]:
    """``(mode, experiment config)`` from ``trainer.policy.model_config_kwargs``.

    Raises:
        ValueError: the key is missing, or the mode is not ``native`` / ``isoexec``.
    """
    s = model_config_kwargs.get(SETTINGS_KEY)
    if s is None:
        raise ValueError(f"trainer.policy.model_config_kwargs has no {SETTINGS_KEY!r} entry (written by "
                         "isoexec.rl.skyrl.render.local_overrides)")
    if s["mode"] not in ("native", "isoexec"):
        raise ValueError(f"isoexec mode must be 'native' or 'isoexec', got {s['mode']!r}")
    return s["mode"], ExperimentConfig.model_validate(json.loads(s["experiment"]))


class PolicyModel(torch.nn.Module):
    """SkyRL's model call over an isoexec trainer.

    Args:
        policy: ``HFPolicy``, ``UnifiedModel`` or this rank's ``MegatronTrainer``
            (``trainer_logprobs(input_ids [T], cu_seqlens [B+1], grad) -> [T, V]`` float32, row t
            predicts token t+1, the same on every rank).
        temperature: the trainer's policy temperature (``kernels.temperature``).
        keep_rows: each no-grad call appends the full-vocabulary rows of its action positions
            (``[B, num_actions, V]`` float32) to ``kept``, for the run's metrics (drained by
            :meth:`IsoExecPolicyWorker.isoexec_drain_score`).
    """

    def __init__(self, policy: Any, temperature: float, keep_rows: bool):
        super().__init__()
        self.policy = policy
        self.temperature = float(temperature)
        self.keep_rows = keep_rows
        self.kept: list[torch.Tensor] = []

    def forward(self, sequences: torch.Tensor, num_actions: int, attention_mask: torch.Tensor,
                temperature: float = 1.0, return_output: bool = False, compute_entropy: bool = False,
                entropy_requires_grad: bool = True, **unused: Any):
        """Action logprobs of left-padded rows.

        Args:
            sequences: ``[B, S]`` long, each row padding then prompt then response (real tokens are
                a suffix of the row, as SkyRL lays them out).
            num_actions: the response window R; ``out[b, j]`` scores ``sequences[b, S - R + j]``.
            attention_mask: ``[B, S]``, 1 on real tokens.
            temperature: must equal the trainer's policy temperature (applied inside the trainer).
            return_output, compute_entropy, entropy_requires_grad: as SkyRL's ``HFModelWrapper``.
            unused: SkyRL's multimodal / sample-support arguments; must be None / False.

        Returns:
            ``[B, R]`` float32 logprobs (and ``{"entropy": [B, S]}`` when ``return_output``); positions
            outside a row's real tokens hold 0.

        Raises:
            ValueError: another temperature, a row whose real tokens are not a suffix, or a
                multimodal / sample-support input.
        """
        if float(temperature) != self.temperature:
            raise ValueError(f"trainer.algorithm.temperature={temperature} differs from the trainer's policy "
                             f"temperature {self.temperature} (kernels.temperature)")
        for k, v in unused.items():
            if v not in (None, False):
                raise ValueError(f"{k}={v!r} is not supported by isoexec's policy worker")
        B, S = sequences.shape
        mask = attention_mask.bool().cpu()
        lens = mask.sum(1)
        if not torch.equal(mask, torch.arange(S)[None, :] >= (S - lens)[:, None]):
            raise ValueError("attention_mask rows must be 0...0 1...1 (real tokens as a suffix)")
        ids = sequences.cpu()[mask]
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        grad = torch.is_grad_enabled()
        rows = self.policy.trainer_logprobs(ids, cu, grad=grad)  # [T, V] float32, on the trainer's device
        V = rows.shape[1]
        mask, sequences = mask.to(rows.device), sequences.to(rows.device)  # SkyRL's batch: on its device
        full = rows.new_zeros(B, S, V)
        full = full.masked_scatter(mask[:, :, None].expand(B, S, V), rows)
        nxt = torch.roll(sequences, shifts=-1, dims=1)
        logp = full.gather(2, nxt[:, :, None]).squeeze(2) * mask  # [B, S]; last column unused
        out = logp[:, -num_actions - 1 : -1]
        with torch.set_grad_enabled(grad and compute_entropy and entropy_requires_grad):
            ent = -(full.exp() * full).sum(-1) if compute_entropy else None
        if self.keep_rows and not grad:
            self.kept.append(full[:, -num_actions - 1 : -1].detach())
        if return_output:
            return out, {"entropy": ent}
        return out


class WarmupLR:
    """The learning-rate schedule SkyRL reads (``get_last_lr``): ``rl.lr`` after a linear warm-up over
    ``rl.warmup_updates`` updates (:func:`isoexec.trainer.optim.warmup_lr`, as the in-process loop), set on
    the trainer's optimizer by the strategy before each update."""

    def __init__(self, optimizer, lr: float, warmup_updates: int):
        self.optimizer, self.lr, self.warmup_updates = optimizer, float(lr), warmup_updates

    def get_last_lr(self) -> list[float]:
        from isoexec.trainer.optim import warmup_lr

        return [warmup_lr(self.lr, self.warmup_updates, self.optimizer.updates)]

    def step(self) -> None:
        return None


class IsoExecStrategy(DistributedStrategy):
    """``DistributedStrategy`` over the trainer's own optimizer step.

    Args:
        world_size: ranks of the worker group.
        update: one optimizer update from the accumulated gradients, returning the pre-clip global
            gradient norm (``MasterAdamW.step`` or ``MegatronTrainer.step``; a collective for Megatron).
    """

    def __init__(self, world_size: int, update: Callable[[], float]):
        self.world_size = world_size
        self.update = update

    def setup_distributed(self) -> None:
        return None  # the worker's init_worker_process_group does it

    def backward(self, loss: torch.Tensor, model, optimizer, **kwargs) -> None:
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs) -> torch.Tensor:
        """One update; returns the pre-clip global grad norm as a tensor."""
        return torch.tensor(self.update())

    def save_checkpoint(self, *args, **kwargs):
        raise NotImplementedError("isoexec runs do not save SkyRL checkpoints (trainer.ckpt_interval=0)")

    def load_checkpoint(self, *args, **kwargs):
        raise NotImplementedError("isoexec runs do not resume (trainer.resume_mode=none)")

    def save_hf_model(self, *args, **kwargs) -> None:
        raise NotImplementedError("isoexec runs do not export through SkyRL (trainer.hf_save_interval=-1)")

    def offload_to_cpu(self, *args, **kwargs) -> None:
        return None

    def backload_to_gpu(self, *args, **kwargs) -> None:
        return None


class IsoExecPolicyWorker(PolicyWorkerBase):
    """One rank of SkyRL's policy worker group on isoexec's trainer of the run's mode (a Ray actor built by SkyRL)."""

    def init_worker_process_group(self) -> None:
        """The gloo (CPU) / NCCL (CUDA) group of the worker group, and SkyRL's ``("dp", "mp")`` mesh of one
        data-parallel rank: every rank gets the whole batch, rank 0 is collected from.

        SkyRL's ``Worker.init_worker_process_group`` builds a ``("dp", "sp")`` mesh on ``"cuda"`` only.
        """
        cpu_device_answers()
        local_rank_on_present_gpus()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
            dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
        self.device_mesh = dist.device_mesh.init_device_mesh(
            device, mesh_shape=(1, self._world_size), mesh_dim_names=("dp", "mp"))
        self.mesh_rank = MeshRank(dp=0, sp=0, tp=self._rank, pp=0, world_size=self._world_size, dp_size=1,
                                  pp_size=1)

    def init_model(self, model_path: str, num_training_steps: int | None = None) -> None:
        """Build this rank's trainer of the run's mode from ``model_path`` and its optimizer.

        Raises:
            ValueError: isoexec settings missing, SkyRL's optimizer settings differ from the
                experiment's ``rl`` section (they must describe the same optimizer), or the worker
                group's size is not the trainer's world size.
        """
        from isoexec.trainer.factory import load_trainer
        from isoexec.trainer.optim import MasterAdamW

        kw = self.cfg.policy.model_config_kwargs
        mode, exp = isoexec_settings(kw)
        torch.set_num_threads(int(kw[SETTINGS_KEY].get("threads", 1)))
        oc = self.cfg.policy.optimizer_config
        want = {"lr": exp.rl.lr, "weight_decay": exp.rl.weight_decay, "max_grad_norm": exp.rl.max_grad_norm}
        got = {"lr": oc.lr, "weight_decay": oc.weight_decay, "max_grad_norm": oc.max_grad_norm}
        if got != want:
            raise ValueError(f"trainer.policy.optimizer_config {got} differs from the experiment's rl section {want}")
        if self._world_size != exp.trainer.world_size(mode):
            raise ValueError(f"SkyRL started {self._world_size} policy workers; trainer.backend="
                             f"{exp.trainer.backend_for(mode)!r} in mode {mode} needs {exp.trainer.world_size(mode)}")
        self.mode, self.experiment = mode, exp
        self.policy = load_trainer(exp, mode, model_path)
        if exp.trainer.backend_for(mode) == "megatron":
            self.optimizer = self.policy.build_optimizer()
            update = self.policy.step
        else:
            self.optimizer = MasterAdamW(self.policy.named_parameters(), lr=oc.lr, betas=tuple(oc.adam_betas),
                                         weight_decay=oc.weight_decay, max_grad_norm=oc.max_grad_norm)
            update = self.optimizer.step
        self.model = PolicyModel(self.policy, exp.kernels.temperature, keep_rows=self._rank == 0)
        self.scheduler = WarmupLR(self.optimizer, oc.lr, exp.rl.warmup_updates)

        def warmed_update() -> float:
            self.optimizer.set_lr(self.scheduler.get_last_lr()[0])
            return update()

        self.strategy = IsoExecStrategy(self._world_size, warmed_update)
        self.last_sync: dict[str, Any] = {}

    def isoexec_begin_run(self, cfg) -> None:
        """Take the SkyRL trainer config of the next run of a session (:class:`isoexec.rl.skyrl.driver.Session`)
        before ``init_model`` rebuilds the trainer: its mode and experiment (``policy.model_config_kwargs``),
        algorithm and off-policy correction replace the last run's, the policy loss is looked up again
        (``PolicyWorkerBase.__init__`` does it once), and the last run's trainer and optimizer are let go.

        Args:
            cfg: SkyRL's ``TrainerConfig`` of the run (``SkyRLTrainConfig.trainer``).
        """
        import gc

        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

        self.cfg = cfg
        self.policy_loss_fn = PolicyLossRegistry.get(cfg.algorithm.policy_loss_type)
        self.policy = self.model = self.optimizer = self.scheduler = self.strategy = None
        gc.collect()

    def _set_pad_token_id(self, pad_token_id: int) -> None:
        return None  # trainer_logprobs never sees padding (rows are packed)

    def _get_module_for_offload(self):
        return self.model

    async def init_weight_sync_state(self, inference_engine_client, inference_engine_cfg) -> None:
        """Keep the client for the syncs (SkyRL passes None at each later sync)."""
        self._weight_sync_inference_client = inference_engine_client

    async def broadcast_to_inference_engines(self, inference_engine_client, inference_engine_cfg,
                                             model_id: str | None = None) -> None:
        """Send the compute-dtype weights (HF checkpoint names) with the trainer's contract.

        Every rank joins the gather of the shards (``MegatronTrainer.checkpoint_state_dict``); rank 0
        sends. The engine runs the contract handshake first and raises ``ContractMismatch`` before any
        weight moves.
        """
        from safetensors.torch import save

        from isoexec.contract import encode
        from isoexec.trainer.base import sync_state

        if model_id is not None:
            raise ValueError(f"model_id={model_id!r}: LoRA adapters are not part of the isoexec contract")
        client = inference_engine_client or self._weight_sync_inference_client
        t0 = time.perf_counter()
        state = sync_state(self.policy)
        if dist.get_rank() == 0:
            state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
            contract = self.policy.contract()
            checksums = await client.update_named_weights(
                {"safetensors": save(state), "contract": None if contract is None else encode(contract)})
            self.last_sync = {"tensors": len(checksums), "seconds": time.perf_counter() - t0}
        dist.barrier()

    def isoexec_drain_score(self) -> torch.Tensor:
        """The rows kept by the no-grad forwards since the last drain, in call order: ``[B, R, V]``
        float32 on the CPU on rank 0 (empty on the others), then forgets them."""
        rows, self.model.kept = self.model.kept, []
        return torch.cat(rows).cpu() if rows else torch.empty(0)

    def isoexec_load_checksums(self) -> dict[str, str]:
        """Checksums (HF names) of the weights this trainer holds, as a weight sync would send them; a
        collective for ``megatron`` (every rank joins the gather, every rank gets them). Called once before the
        first step, for the load-time weight handshake with the engines."""
        from isoexec.engines.weight_sync import state_checksums
        from isoexec.trainer.base import sync_state

        return state_checksums(sync_state(self.policy))

    def isoexec_contract(self) -> bytes | None:
        """The trainer's contract (canonical JSON), None in native mode."""
        from isoexec.contract import encode

        c = self.policy.contract()
        return None if c is None else encode(c)
