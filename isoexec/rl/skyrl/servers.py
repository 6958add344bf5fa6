"""SkyRL's own vLLM servers in isoexec mode (the GPU-node recipe): weight sync through the plugin's checked path.

SkyRL 0.4 starts its vLLM servers itself (``skyrl/backends/skyrl_train/inference_servers/setup.py``) and
talks to them over HTTP (``RemoteInferenceClient``). Its own weight sync goes through vLLM's native
``/update_weights`` routes, which in the isoexec model end in ``load_weights``: no contract handshake, no
checksums, per-request caches kept. In the recipe's isoexec arm (:mod:`isoexec.rl.skyrl.recipe`):

- the servers load :data:`SERVER_EXTENSION` as their vLLM worker extension (rendered into
  ``generator.inference_engine.engine_init_kwargs.worker_extension_cls``, which SkyRL applies after its own
  settings in ``build_vllm_cli_args``): SkyRL's ``NewInferenceWorkerWrap`` (sleep / wake, fetch), the
  plugin's :class:`~isoexec.engines.vllm_plugin.IsoExecWorkerExtension` and the JSON methods of
  :class:`JsonRpc`. vLLM's HTTP ``/collective_rpc`` (``vllm/entrypoints/serve/dev/rpc/api_router.py``)
  passes only JSON values and returns dicts, so the contract and the weights travel as base64 text;
- the trainer talks to them through :class:`IsoExecServerClient`, SkyRL's client whose
  ``update_named_weights`` is the checked path of :meth:`isoexec.engines.vllm_engine.RolloutEngine.sync_weights`:
  every server's contract is fetched and handshaked against the trainer's (``ContractMismatch`` before any
  weight moves), each server's worker refuses a state that is not exactly its parameter set, applies it in
  place and drops every per-request cache, and the checksums every worker reports are compared with the
  trainer's.

The whole state crosses HTTP as base64 at every sync: correct at any size, slow for a large model.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from isoexec.rl.skyrl import compat

compat.install()  # before the first skyrl import (compat item 1)

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient  # noqa: E402

SERVER_EXTENSION = "isoexec.rl.skyrl.server_extension.IsoExecServerExtension"
"""vLLM ``worker_extension_cls`` of SkyRL's servers in isoexec mode (module imported in the server processes only)."""


class JsonRpc:
    """The plugin's worker RPCs in the JSON form vLLM's HTTP ``/collective_rpc`` carries (mixed into the worker
    next to :class:`~isoexec.engines.vllm_plugin.IsoExecWorkerExtension`)."""

    def isoexec_attach_json(self) -> dict[str, str]:
        """``isoexec_attach`` with the contract as base64 text: ``{"kind", "contract"}`` ("" for native)."""
        info = self.isoexec_attach()  # type: ignore[attr-defined]
        contract = info.get("contract")
        return {"kind": info["kind"], "contract": base64.b64encode(contract).decode() if contract else ""}

    def isoexec_update_weights_json(self, payload: str, trainer_numerical_policy: str) -> dict[str, Any]:
        """``isoexec_update_weights`` of base64 safetensors text; returns its dict (checksums, dropped caches)."""
        return self.isoexec_update_weights(base64.b64decode(payload), trainer_numerical_policy)  # type: ignore[attr-defined]


@dataclasses.dataclass
class IsoExecServerClient(RemoteInferenceClient):
    """SkyRL's HTTP client of its vLLM servers, with the isoexec plugin's checked weight sync.

    Build it from the client SkyRL built (:meth:`of`), then :meth:`attach` once the servers are up.
    """

    @classmethod
    def of(cls, client: RemoteInferenceClient) -> "IsoExecServerClient":
        """The same client (servers, router, settings) with this class's weight sync."""
        return cls(**{f.name: getattr(client, f.name) for f in dataclasses.fields(client) if f.init})

    async def generate(self, input_batch, model: str | None = None):
        """SkyRL's ``generate`` with the local driver's sampling boundary
        (:func:`isoexec.rl.skyrl.client.check_sampling_params`): what the isoexec engine does not serve raises
        ``ValueError`` naming it; ``min_tokens``, which SkyRL always sends as 1 (``get_vllm_sampling_params``,
        ``inference_servers/engine_utils.py`` line 58, skyrl 0.4.0) and the server's request guard refuses
        (masking EOS samples from another distribution than the policy), is sent as 0."""
        from isoexec.rl.skyrl.client import check_sampling_params

        params = dict(input_batch.get("sampling_params") or {})
        check_sampling_params(params)
        return await super().generate({**input_batch, "sampling_params": {**params, "min_tokens": 0}}, model)

    async def _rpc(self, method: str, **kwargs: Any) -> dict[str, list[Any]]:
        """``method`` on every worker of every server: ``{server url: [one result per worker]}``."""
        res = await self._call_all_servers("/collective_rpc", {"method": method, "kwargs": kwargs})
        return {url: r["body"]["results"] for url, r in res.items()}

    async def attach(self):
        """Attach every server worker's runner to the isoexec model (before that it serves vLLM's dummy runs
        only) and return the servers' contract.

        Raises:
            ValueError: a server runs vLLM's native model (its config lacks the isoexec architecture).
            isoexec.contract.ContractMismatch: two servers hold different contracts.
        """
        from isoexec.contract import ContractMismatch, decode

        contracts = {}
        for url, results in (await self._rpc("isoexec_attach_json")).items():
            for i, r in enumerate(results):
                if r["kind"] != "isoexec":
                    raise ValueError(f"vLLM server {url} worker {i} runs vLLM's native model; the isoexec arm's servers "
                                     "must build the isoexec architecture (engine_init_kwargs.hf_overrides)")
                contracts[f"{url} worker {i}"] = decode(base64.b64decode(r["contract"]))
        first = next(iter(contracts.values()))
        for where, c in contracts.items():
            if c.identities.numerical_policy != first.identities.numerical_policy:
                raise ContractMismatch(first.identities.numerical_policy, c.identities.numerical_policy,
                                       [f"{where} holds another contract than {next(iter(contracts))}"])
        return first

    async def update_named_weights(self, request: dict[str, Any]) -> dict[str, str]:
        """The checked weight sync (see the module docstring).

        Args:
            request: ``{"safetensors": bytes, "contract": bytes}`` (the trainer's state under Hugging Face
                names and its encoded contract), as :class:`isoexec.rl.skyrl.worker.IsoExecPolicyWorker` sends.

        Returns:
            name -> checksum of every tensor, as every server worker reported it.

        Raises:
            ValueError: another request (SkyRL's native update info): isoexec mode has no unchecked path.
            isoexec.contract.ContractMismatch: before any weight moves, a server's contract differs from the
                trainer's.
            isoexec.engines.weight_sync.WeightSyncError: a worker refused the state (not its parameter set), or
                reported checksums that differ from the trainer's.
        """
        from safetensors.torch import load

        from isoexec.contract import check_handshake, decode
        from isoexec.engines.weight_sync import state_checksums, verify_checksums

        if set(request) != {"safetensors", "contract"} or request["contract"] is None:
            raise ValueError(f"isoexec mode syncs weights only with the trainer's contract, {{'safetensors', "
                             f"'contract'}}; got keys {sorted(request)}")
        trainer = decode(request["contract"])
        check_handshake(await self.attach(), trainer)
        expected = state_checksums(load(request["safetensors"]))
        res = await self._rpc("isoexec_update_weights_json", payload=base64.b64encode(request["safetensors"]).decode(),
                              trainer_numerical_policy=trainer.identities.numerical_policy)
        for results in res.values():
            for r in results:
                verify_checksums(expected, r["checksums"])
        from loguru import logger  # SkyRL's logger: this runs in SkyRL's trainer worker, whose log SkyRL keeps

        logger.info(f"isoexec weight sync: contract handshake passed (numerical policy "
                    f"{trainer.identities.numerical_policy}); {len(expected)} tensors, checksums verified on "
                    f"{sum(len(r) for r in res.values())} worker(s) of {len(res)} vLLM server(s)")
        return expected
