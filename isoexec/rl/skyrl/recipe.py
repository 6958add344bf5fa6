"""The isoexec arm of the GPU-node recipe behind SkyRL's own entry point.

SkyRL 0.4's ``skyrl.train.entrypoints.main_base.main`` picks the policy worker by ``trainer.strategy`` (its
stock FSDP or Megatron worker, which train the native model) and has no config key naming another worker
class. Its extension point is ``trainer.override_entrypoint=<module>``: read from the command line before the
config is parsed, it hands the run to ``<module>.main()``. The rendered isoexec config names this module
(:data:`isoexec.rl.skyrl.render.RECIPE_ENTRYPOINT`); the native config does not, so SkyRL runs it unchanged.

:func:`main` parses the other overrides into SkyRL's config and starts Ray as SkyRL's own ``main`` does, then
runs :class:`RecipeExp`, a ``BasePPOExp`` whose hooks change two things:

- ``get_inference_client``: SkyRL starts its vLLM servers as usual (the rendered ``engine_init_kwargs`` make
  them build the isoexec architecture with its checks and :data:`~isoexec.rl.skyrl.servers.SERVER_EXTENSION`);
  the client is :class:`~isoexec.rl.skyrl.servers.IsoExecServerClient`, attached to every server;
- ``run``: composes SkyRL's hooks as ``BasePPOExp._setup_trainer`` does (tracker, inference client, generator,
  ``RayPPOTrainer``), but hands ``build_models`` :data:`POLICY_WORKER` (isoexec's policy worker: the Megatron
  trainer with the isoexec kernel set, NCCL, the contract handshake at every weight sync) and no critic or
  reference. ``_setup_trainer`` imports SkyRL's stock worker of ``trainer.strategy`` first, whose Megatron
  module needs Megatron-Bridge and Transformer Engine (``megatron_worker.py`` line 14, skyrl 0.4.0), which
  the isoexec arm never runs. The environment of ``environment.env_class`` is registered in skyrl-gym first
  (:func:`isoexec.rl.skyrl.env.register`).
"""

from __future__ import annotations

import asyncio
import sys

from isoexec.rl.skyrl import compat

compat.install()  # before the first skyrl import (compat item 1)

import ray  # noqa: E402
from loguru import logger  # noqa: E402 - SkyRL's logger
from skyrl.train.config import SkyRLTrainConfig  # noqa: E402
from skyrl.train.entrypoints.main_base import BasePPOExp  # noqa: E402
from skyrl.train.utils import validate_cfg  # noqa: E402
from skyrl.train.utils.utils import initialize_ray  # noqa: E402

from isoexec.rl.skyrl.env import register  # noqa: E402
from isoexec.rl.skyrl.render import ENTRYPOINT_KEY  # noqa: E402
from isoexec.rl.skyrl.servers import IsoExecServerClient  # noqa: E402
from isoexec.rl.skyrl.worker import IsoExecPolicyWorker  # noqa: E402

POLICY_WORKER = IsoExecPolicyWorker
"""The policy worker of the isoexec arm (one Ray actor per trainer rank, one GPU each, as SkyRL's stock workers)."""


class RecipeExp(BasePPOExp):
    """SkyRL's experiment with isoexec's policy worker and the checked weight sync to SkyRL's vLLM servers."""

    def get_inference_client(self) -> IsoExecServerClient:
        client = IsoExecServerClient.of(super().get_inference_client())
        asyncio.run(client.attach())
        return client

    def run(self) -> None:
        """Build the servers, the generator and :data:`POLICY_WORKER`'s group (no critic, no reference), then train."""
        register()
        tracker = self.get_tracker()
        client = self.get_inference_client()
        generator = self.get_generator(self.cfg, self.tokenizer, client)
        self.trainer = self.get_trainer(cfg=self.cfg, tracker=tracker, tokenizer=self.tokenizer,
                                        train_dataset=self.train_dataset, eval_dataset=self.eval_dataset,
                                        inference_engine_client=client, generator=generator,
                                        colocate_pg=self.colocate_pg)
        self.trainer.trajectory_logger = self.get_trajectory_logger()
        self.trainer.build_models(ray.remote(num_gpus=1)(POLICY_WORKER), None, None)
        classes = ray.get([a.handle.__ray_call__.remote(lambda w: type(w).__name__)
                           for a in self.trainer.policy_model.actor_infos])  # what the actors are, asked of them
        logger.info(f"isoexec recipe: policy workers {classes} (one per trainer rank); no critic, no reference")
        asyncio.run(self.trainer.train())


def parse(argv: list[str]) -> SkyRLTrainConfig:
    """SkyRL's config from its command-line overrides, without :data:`~isoexec.rl.skyrl.render.ENTRYPOINT_KEY`
    (SkyRL's launcher reads it; it is no config field), validated by SkyRL."""
    cfg = SkyRLTrainConfig.from_cli_overrides([a for a in argv if not a.startswith(f"{ENTRYPOINT_KEY}=")])
    validate_cfg(cfg)
    return cfg


@ray.remote(num_cpus=1)
def _entrypoint(cfg: SkyRLTrainConfig) -> None:
    compat.install()
    compat.filter_sampling_keeps_sampling_on_uninformative_batches()  # compat item 4 (DAPO's dynamic sampling)
    compat.frontend_args_at_skyrls_path()  # compat item 7 (vLLM 0.26)
    RecipeExp(cfg).run()


def main() -> None:
    """Entry called by SkyRL's ``main_base.main`` for ``trainer.override_entrypoint=isoexec.rl.skyrl.recipe``."""
    cfg = parse(sys.argv[1:])
    initialize_ray(cfg)
    ray.get(_entrypoint.remote(cfg))
