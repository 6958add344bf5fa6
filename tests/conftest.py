"""Shared test fixtures: tiny model configs built in-process (no network)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

if os.environ.get("CI"):
    # In CI the whole CPU stack must be present: a broken install fails here instead of turning the
    # vLLM and pipeline tests into skips.
    import snakemake  # noqa: F401
    import vllm  # noqa: F401


@pytest.fixture(scope="session")
def tiny_sections():
    """(ModelSection, KernelSection, GatesSection) small enough for CI; C=8 so gates cross many chunks."""
    from isoexec.config import GatesSection, KernelSection, ModelSection

    ms = ModelSection(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                      moe_intermediate_size=32, shared_expert_intermediate_size=32)
    ks = KernelSection(chunk_size=8, row_tile=16, kv_block=16, vocab_block=32)
    gs = GatesSection(batch_sizes=[1, 3, 8], micro_batch_sizes=[1, 2, 4], min_len=3, max_len=40, decode_steps=30)
    return ms, ks, gs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU-only test)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
