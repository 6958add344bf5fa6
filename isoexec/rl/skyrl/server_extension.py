"""The vLLM worker extension of SkyRL's servers in isoexec mode (:data:`isoexec.rl.skyrl.servers.SERVER_EXTENSION`).

Imported by vLLM inside SkyRL's server processes only: SkyRL's ``NewInferenceWorkerWrap`` patches vLLM when
imported (:mod:`isoexec.rl.skyrl.compat`, item 5), which must not happen in a process running isoexec's
own in-process engine.
"""

from __future__ import annotations

from isoexec.rl.skyrl import compat

compat.install()  # before the first skyrl import (compat item 1): vLLM's worker processes are no Ray workers

from skyrl.backends.skyrl_train.inference_servers.new_inference_worker_wrap import NewInferenceWorkerWrap  # noqa: E402

from isoexec.engines.vllm_plugin import IsoExecWorkerExtension  # noqa: E402
from isoexec.rl.skyrl.servers import JsonRpc  # noqa: E402


class IsoExecServerExtension(JsonRpc, IsoExecWorkerExtension, NewInferenceWorkerWrap):
    """SkyRL's worker extension (sleep / wake, fetch) with isoexec's checked weight update, reachable over HTTP."""
