"""SkyRL 0.4.0 workarounds (isoexec.rl.skyrl.compat): DAPO's filter sampling on a batch without an
informative group."""

import pytest

pytest.importorskip("skyrl", reason="the skyrl extra is not installed")

from isoexec.rl.skyrl import compat  # noqa: E402

compat.install()


def _batch(rewards):
    n = len(rewards)
    return {"rewards": rewards, "response_ids": [[1]] * n, "prompt_token_ids": [[2]] * n, "loss_masks": [[1]] * n,
            "rollout_logprobs": [[0.0]] * n, "stop_reasons": ["stop"] * n, "rollout_metrics": {}}, ["a", "a", "b", "b"]


CONFIG = {"train_batch_size": 2, "n_samples_per_prompt": 2}


def test_upstream_filter_sampling_fails_on_a_batch_without_informative_groups():
    # the negative control: SkyRL's own function, as the wrapper found it
    from skyrl.train.utils import trainer_utils

    original = getattr(trainer_utils.handle_filter_sampling, "__wrapped_original__", trainer_utils.handle_filter_sampling)
    out, uids = _batch([1.0, 1.0, 0.0, 0.0])
    with pytest.raises(AssertionError, match="indices must be non-empty"):
        original(out, uids, CONFIG, {"sample_batch_count": 1})


def test_wrapped_filter_sampling_keeps_sampling_and_still_filters():
    from skyrl.train.utils import trainer_utils

    compat.filter_sampling_keeps_sampling_on_uninformative_batches()
    compat.filter_sampling_keeps_sampling_on_uninformative_batches()  # idempotent
    out, uids = _batch([1.0, 1.0, 0.0, 0.0])
    _, _, keep, state = trainer_utils.handle_filter_sampling(out, uids, CONFIG, {"sample_batch_count": 1})
    assert keep and "collected_generator_output" not in state
    out, uids = _batch([1.0, 0.0, 0.0, 0.0])  # one informative group: SkyRL's own filter collects it
    _, _, keep, state = trainer_utils.handle_filter_sampling(out, uids, CONFIG, {"sample_batch_count": 1})
    assert keep and state["num_prompts_in_batch"] == 1 and state["collected_uids"] == ["a", "a"]
