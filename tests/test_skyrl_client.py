"""Boundary checks of isoexec's SkyRL inference client, and the policy worker's model call."""

import re

import pytest
import torch

pytest.importorskip("skyrl", reason="the skyrl extra is not installed")

from isoexec.rl.skyrl import compat  # noqa: E402

compat.install()

from isoexec.rl.skyrl.client import IsoExecInferenceClient, check_sampling_params, shard_bounds  # noqa: E402
from isoexec.rl.skyrl.engine_actor import shard_seed  # noqa: E402
from isoexec.rl.skyrl.worker import PolicyModel  # noqa: E402


def _skyrl_defaults(**kw):
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
    from skyrl.train.config.config import SamplingParams

    return get_vllm_sampling_params(SamplingParams(max_generate_length=6, temperature=1.0, **kw))


def test_skyrl_sampling_params_for_the_policy_are_served():
    assert check_sampling_params(_skyrl_defaults()) == (6, 1.0)


@pytest.mark.parametrize("kw,key", [
    ({"top_p": 0.9}, "top_p=0.9"), ({"top_k": 5}, "top_k=5"), ({"min_p": 0.1}, "min_p=0.1"),
    ({"stop": ["x"]}, "stop=['x']"), ({"logprobs": None}, "logprobs=None"),
    ({"additional_kwargs": {"seed": 3}}, "seed=3"),
])
def test_sampling_params_that_change_the_distribution_are_refused(kw, key):
    with pytest.raises(ValueError, match="not served.*" + re.escape(key)):
        check_sampling_params(_skyrl_defaults(**kw))


class _Policy:
    """A stand-in trainer: logprobs of a fixed random bigram table, packed ``[T] -> [T, V]``."""

    def __init__(self, V=11):
        self.table = torch.log_softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(0)), -1)

    def trainer_logprobs(self, input_ids, cu_seqlens, grad):
        return self.table[input_ids]


def test_policy_model_scores_left_padded_rows_as_the_packed_trainer():
    pol = _Policy()
    seqs = [[1, 4, 5, 6, 2], [1, 7, 3, 2], [1, 9, 9, 8, 8, 2]]  # prompt + response, response <= R
    S, R = 6, 3
    rows = torch.zeros(3, S, dtype=torch.long)
    mask = torch.zeros(3, S, dtype=torch.long)
    for b, s in enumerate(seqs):
        rows[b, S - len(s):] = torch.tensor(s)
        mask[b, S - len(s):] = 1
    out = PolicyModel(pol, 1.0, keep_rows=False)(rows, R, mask, temperature=1.0)
    assert out.shape == (3, R) and out.dtype == torch.float32
    for b, s in enumerate(seqs):
        want = torch.stack([pol.table[s[t - 1], s[t]] for t in range(len(s) - R, len(s))])
        assert torch.equal(out[b], want)


def test_policy_model_refuses_another_temperature_and_holes_in_rows():
    m = PolicyModel(_Policy(), 1.0, keep_rows=False)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature=0.7"):
        m(ids, 2, torch.ones(1, 4), temperature=0.7)
    with pytest.raises(ValueError, match="suffix"):
        m(ids, 2, torch.tensor([[1, 0, 1, 1]]), temperature=1.0)


@pytest.mark.parametrize("n,shards,want", [
    (64, 2, [(0, 32), (32, 64)]),
    (5, 2, [(0, 3), (3, 5)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (1, 2, [(0, 1)]),  # an empty shard is left out
    (3, 1, [(0, 3)]),
])
def test_prompts_split_into_contiguous_shards_in_order(n, shards, want):
    assert shard_bounds(n, shards) == want


def test_shards_sample_with_distinct_seeds_and_shard_zero_keeps_the_loops_seed():
    from isoexec.rl.loop import generation_seed

    assert shard_seed(3, 5, 0) == generation_seed(3, 5)
    seeds = {shard_seed(s, c, i) for s in range(3) for c in range(50) for i in range(4)}
    assert len(seeds) == 3 * 50 * 4


def test_client_without_engines_is_refused():
    with pytest.raises(ValueError, match="at least one engine actor"):
        IsoExecInferenceClient([], "ckpt", "ckpt")
