"""Fixtures for the engine tests: a stand-in with ``isoexec.model.UnifiedModel``'s engine API, and the
module-scoped checkpoint, trainer and engines the vLLM test modules share (import them into a module:
each module then gets its own; in-process engines live until the module ends, see
``RolloutEngine.shutdown``).

``ToyUnifiedModel`` is used only while ``isoexec.model.UnifiedModel`` is not importable. It reads
the Hugging Face Qwen3-Next checkpoint's embedding and lm_head (same names, so weight sync works on
HF names) and runs a trivially batch-invariant recurrent model: every token is processed alone, in
the same order in every case, so ``engine_step`` and ``trainer_logprobs`` give the same bits
whatever the batching and chunking. That lets the vLLM routing (rows -> requests, preemption,
caches) be tested before the real model lands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

TOY = "tests.engine_fixtures:ToyUnifiedModel"
"""``model_factory`` of an isoexec engine running :class:`ToyUnifiedModel`."""


@dataclass
class ToyCache:
    """Per-sequence state: recurrent vector and tokens consumed."""

    h: torch.Tensor
    position: int = 0
    tokens: list = field(default_factory=list)


class ToyUnifiedModel(nn.Module):
    """Stand-in for ``UnifiedModel`` (same engine-facing API)."""

    def __init__(self, vocab_size: int, hidden: int, temperature: float = 1.0, tag: str = "toy"):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab_size, hidden, dtype=torch.bfloat16)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False, dtype=torch.bfloat16)
        self.temperature = float(temperature)
        self.tag = tag
        self.hidden = hidden

    @classmethod
    def from_pretrained(cls, path, kernel_set: str = "isoexec", kernels=None, device: str = "cpu", tag: str = "toy"):
        cfg = json.loads((Path(path) / "config.json").read_text())
        temperature = kernels.temperature if kernels is not None else 1.0
        m = cls(cfg["vocab_size"], cfg["hidden_size"], temperature, tag)
        sd = load_file(str(Path(path) / "model.safetensors"))
        if cfg.get("tie_word_embeddings"):  # a tied checkpoint holds no lm_head.weight
            m.lm_head.weight = m.model.embed_tokens.weight
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        own = {k: sd[k] for k in ("model.embed_tokens.weight", "lm_head.weight")}
        m.load_state_dict(own, strict=True)
        return m.to(device)

    def contract(self):
        from isoexec.contract import CASES, Claims, CompositionEntry, ExecutionContract, F32

        return ExecutionContract.build(
            model={"architecture": "ToyUnifiedModel", "tag": self.tag},
            cases=list(CASES),
            composition=[
                CompositionEntry("logprob", tuple(CASES), impl="toy.rowwise", version="1", arch="cpu",
                                 constants={"temperature": F32(self.temperature)}, proof="tests/test_engine_vllm.py")
            ],
            claims=Claims(
                state={"weight_sync": ("prefix_cache", "gdn_state")},
                tolerances={"logprob_abs_diff": 0.0},
                engine={"enable_prefix_caching": False},
            ),
        )

    def new_cache(self) -> ToyCache:
        return ToyCache(torch.zeros(self.hidden, dtype=torch.float32))

    @torch.no_grad()
    def _token(self, h: torch.Tensor, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.model.embed_tokens.weight[tok].float()
        h = torch.tanh(0.5 * h + 8.0 * e)
        logits = (h[None, :] @ self.lm_head.weight.float().T)[0] * 8.0 / self.temperature
        return h, torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def engine_step(self, caches, chunks, last_only: bool = False):
        outs = []
        for c, chunk in zip(caches, chunks):
            rows = []
            for tok in chunk.tolist():
                c.h, lp = self._token(c.h, tok)
                c.position += 1
                rows.append(lp)
            outs.append(torch.stack(rows[-1:] if last_only else rows))
        return outs

    @torch.no_grad()
    def trainer_logprobs(self, input_ids, cu_seqlens, grad: bool = False):
        out = []
        cu = cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            c = self.new_cache()
            out.append(self.engine_step([c], [input_ids[a:b]])[0])
        return torch.cat(out)


def toy_factory_name() -> str:
    return TOY


def engine_section():
    """A small engine: 8 sequences, a 64-token step budget (chunked prefill), 256 positions."""
    from isoexec.config import EngineSection

    return EngineSection(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny untied Qwen3-Next checkpoint (vocabulary 256) the module's engines and trainers load."""
    from isoexec.config import ModelSection
    from isoexec.model.hf import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", ModelSection(), vocab_size=256)


@pytest.fixture(scope="module")
def toy_trainer(ckpt):
    return ToyUnifiedModel.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def toy_engine(ckpt):
    """An isoexec engine running the stand-in (:data:`TOY`)."""
    from isoexec.engines.vllm_engine import RolloutEngine

    e = RolloutEngine(ckpt, "isoexec", engine_section(), model_factory=TOY)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def native_engine(ckpt):
    """vLLM's own Qwen3-Next on the checkpoint. Module-scoped like the others: an in-process vLLM engine's
    shutdown (or garbage collection) tears down vLLM's process-global distributed state, which breaks every
    other live engine."""
    from isoexec.engines.vllm_engine import RolloutEngine

    e = RolloutEngine(ckpt, "native", engine_section())
    yield e
    e.shutdown()
