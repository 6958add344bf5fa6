"""Tests of the execution contract: canonical encoding, identities, validation, diff, handshake,
runtime claim checks. Every positive test has its negative control beside it."""

from __future__ import annotations

import json
import logging
import math
import struct

import pytest

from isoexec.contract import (
    REGIONS,
    ClaimViolation,
    Claims,
    CompositionEntry,
    ContractDecodeError,
    ContractError,
    ContractMismatch,
    ContractValidationError,
    ExecutionContract,
    F32,
    TopologyClaim,
    check_engine_settings,
    check_handshake,
    check_topology,
    decode,
    diff,
    encode,
    validate,
)

ALL = ("trainer_fwd", "trainer_score", "engine_prefill", "engine_decode")


def entries():
    return [
        CompositionEntry(
            "gdn.core",
            ALL,
            "isoexec.cpr_gdn.reference",
            "1",
            "cpu",
            {"chunk_size": 64, "state_dtype": "float32", "eps": 1e-6},
            "gates/gdn.core",
        ),
        CompositionEntry(
            "logprob",
            ALL,
            "isoexec.logprob.blocked",
            "2",
            "any",
            {"vocab_block": 256, "temperature": F32(1.0)},
            "gates/logprob",
        ),
        CompositionEntry(
            "attn.core",
            ("trainer_fwd", "trainer_score"),
            "isoexec.attn.ref",
            "1",
            "cpu",
            {"kv_block": 64},
            "gates/attn.core/trainer",
        ),
        CompositionEntry(
            "attn.core",
            ("engine_prefill", "engine_decode"),
            "isoexec.attn.paged",
            "1",
            "cpu",
            {"kv_block": 64, "split_kv": 1},
            "gates/attn.core/engine",
        ),
    ]


def claims(**over):
    parts = dict(
        topology={"tp": TopologyClaim(domain=(1, 2, 4, 8)), "ep": TopologyClaim(pinned=1)},
        state={"weight_sync": ("prefix_cache", "gdn_state"), "preemption": ("kv_cache",)},
        tolerances={"logprob_abs_diff": 0.0},
        engine={"enable_prefix_caching": False, "block_size": 16},
    )
    parts.update(over)
    return Claims(**parts)


MODEL = {"architecture": "Qwen3NextForCausalLM", "config_sha256": "ab" * 32, "rms_norm_eps": 1e-6}
DEPLOY = {"gpu_memory_utilization": 0.9, "max_num_seqs": 256}


def make(**over):
    parts = dict(model=MODEL, cases=ALL, composition=entries(), claims=claims(), deployment=DEPLOY)
    parts.update(over)
    return ExecutionContract.build(**parts)


def with_constant(region, key, value, c=None):
    c = c or make()
    comp = [
        (
            CompositionEntry(e.region, e.cases, e.impl, e.version, e.arch, {**e.constants, key: value}, e.proof)
            if e.region == region
            else e
        )
        for e in c.composition
    ]
    return c.rebuild(composition=comp)


# ----------------------------------------------------------------------------- canonical encoding


def test_encode_decode_round_trip_is_byte_stable():
    c = make()
    data = encode(c)
    again = encode(decode(data))
    assert again == data
    assert decode(data).identities == c.identities


def test_canonical_json_has_sorted_keys_no_whitespace_and_no_raw_floats():
    data = encode(make()).decode()
    assert " " not in data.replace("Qwen3NextForCausalLM", "") and "\n" not in data
    obj = json.loads(data)
    assert list(obj) == sorted(obj)
    json.loads(data, parse_float=lambda s: pytest.fail(f"raw float {s} in canonical JSON"))


def test_digests_do_not_depend_on_declaration_order():
    a = make()
    b = ExecutionContract.build(
        model=dict(reversed(list(MODEL.items()))),
        cases=tuple(reversed(ALL)),
        composition=[
            CompositionEntry(
                e.region,
                tuple(reversed(e.cases)),
                e.impl,
                e.version,
                e.arch,
                dict(reversed(list(e.constants.items()))),
                e.proof,
            )
            for e in reversed(entries())
        ],
        claims=Claims(
            topology={"ep": TopologyClaim(pinned=1), "tp": TopologyClaim(domain=(8, 4, 2, 1))},
            state={"preemption": ("kv_cache",), "weight_sync": ("gdn_state", "prefix_cache")},
            tolerances={"logprob_abs_diff": 0.0},
            engine={"block_size": 16, "enable_prefix_caching": False},
        ),
        deployment=dict(reversed(list(DEPLOY.items()))),
    )
    assert a.identities == b.identities
    assert encode(a) == encode(b)


def test_changing_a_constant_changes_numerical_policy_but_not_semantic():  # negative control of the above
    a = make()
    b = with_constant("gdn.core", "chunk_size", 32)
    assert a.identities.numerical_policy != b.identities.numerical_policy
    assert a.identities.semantic == b.identities.semantic
    assert a.identities.deployment == b.identities.deployment


def test_model_change_changes_semantic_and_policy_deployment_change_only_deployment():
    a = make()
    m = make(model={**MODEL, "config_sha256": "cd" * 32})
    assert m.identities.semantic != a.identities.semantic
    assert m.identities.numerical_policy != a.identities.numerical_policy
    d = make(deployment={**DEPLOY, "gpu_memory_utilization": 0.8})
    assert d.identities.deployment != a.identities.deployment
    assert (d.identities.semantic, d.identities.numerical_policy) == (
        a.identities.semantic,
        a.identities.numerical_policy,
    )


def test_int_and_bool_and_float_constants_are_distinct():
    a = with_constant("logprob", "x", 1)
    assert a.identities != with_constant("logprob", "x", True).identities
    assert a.identities != with_constant("logprob", "x", 1.0).identities
    assert with_constant("logprob", "x", 1.0).identities != with_constant("logprob", "x", F32(1.0)).identities


F64_VALUES = [1e-6, 0.1, 5e-324, 2.2250738585072014e-308 / 3, -0.0, 0.0, 1.7976931348623157e308, -123.456]


@pytest.mark.parametrize("x", F64_VALUES, ids=repr)
def test_f64_constants_survive_round_trip_bit_for_bit(x):
    c = with_constant("gdn.core", "v", x)
    back = decode(encode(c)).composition
    got = next(e for e in back if e.region == "gdn.core").constants["v"]
    assert type(got) is float
    assert struct.pack("<d", got) == struct.pack("<d", x)


@pytest.mark.parametrize("x", [1e-6, 0.1, 1e-45, -0.0, 3.4028234663852886e38], ids=repr)
def test_f32_constants_survive_round_trip_bit_for_bit(x):
    c = with_constant("gdn.core", "v", F32(x))
    got = next(e for e in decode(encode(c)).composition if e.region == "gdn.core").constants["v"]
    assert isinstance(got, F32) and got.bits == F32(x).bits
    assert got.bits == struct.unpack("<I", struct.pack("<f", x))[0]


def test_float_bit_patterns_are_explicit_hex():
    data = encode(with_constant("gdn.core", "v", 1e-6)).decode()
    assert '"v":{"f64":"0x3eb0c6f7a0b5ed8d"}' in data
    data = encode(with_constant("gdn.core", "v", F32(1e-6))).decode()
    assert '"v":{"f32":"0x358637bd"}' in data


def test_negative_zero_is_not_positive_zero():
    assert with_constant("gdn.core", "v", -0.0).identities != with_constant("gdn.core", "v", 0.0).identities


def test_raw_float_in_json_is_refused_with_path():
    data = encode(make()).decode().replace('{"f64":"0x3eb0c6f7a0b5ed8d"}', "1e-06", 1)
    with pytest.raises(ContractDecodeError) as ei:
        decode(data)
    assert "raw float" in str(ei.value)
    assert any(v.path.endswith(".eps") for v in ei.value.violations)


def test_bad_bit_pattern_is_refused():
    data = encode(make()).decode().replace('"0x3eb0c6f7a0b5ed8d"', '"0x3EB0C6F7A0B5ED8D"', 1)
    with pytest.raises(ContractDecodeError, match="bit pattern"):
        decode(data)


def test_unknown_and_missing_fields_are_refused_all_at_once():
    obj = json.loads(encode(make()))
    obj["extra"] = 1
    obj["composition"][0]["tile"] = 2
    del obj["claims"]["engine"]
    with pytest.raises(ContractDecodeError) as ei:
        decode(json.dumps(obj))
    paths = {v.path: v.message for v in ei.value.violations}
    assert "unknown field" in paths["extra"]
    assert "unknown field" in paths["composition[0].tile"]
    assert paths["claims.engine"] == "missing field"


def test_duplicate_json_key_is_refused():
    data = encode(make()).decode().replace('{"cases":', '{"cases":[],"cases":', 1)
    with pytest.raises(ContractDecodeError, match="duplicate key 'cases'"):
        decode(data)


def test_malformed_json_names_source_and_position():
    data = encode(make()).decode()[:50]
    with pytest.raises(ContractDecodeError) as ei:
        decode(data, source="contract.json")
    msg = str(ei.value)
    assert msg.startswith("contract.json: ")
    assert "line 1 column" in msg and "malformed JSON" in msg


# ----------------------------------------------------------------------------- validation


def test_valid_contract_passes_validation():  # positive control of the rules below
    validate(make())


def _mutate_entry(i, **changes):
    es = entries()
    e = es[i]
    fields = dict(
        region=e.region,
        cases=e.cases,
        impl=e.impl,
        version=e.version,
        arch=e.arch,
        constants=e.constants,
        proof=e.proof,
    )
    fields.update(changes)
    es[i] = CompositionEntry(**fields)
    return dict(composition=es)


RULES = [
    ("unknown case", dict(cases=ALL + ("engine_spec",)), "cases", "unknown case 'engine_spec'"),
    ("duplicate case", dict(cases=ALL + ("trainer_fwd",)), "cases", "duplicate case"),
    ("no cases", dict(cases=()), "cases", "at least one case"),
    ("empty model", dict(model={}), "model", "non-empty mapping"),
    (
        "unknown region",
        _mutate_entry(0, region="gdn.magic"),
        "composition[gdn.magic].region",
        "unknown region 'gdn.magic'",
    ),
    ("empty impl", _mutate_entry(0, impl=""), "composition[gdn.core].impl", "non-empty"),
    ("empty version", _mutate_entry(0, version=" "), "composition[gdn.core].version", "non-empty"),
    ("empty arch", _mutate_entry(0, arch=""), "composition[gdn.core].arch", "non-empty"),
    ("empty proof", _mutate_entry(0, proof=""), "composition[gdn.core].proof", "discharge reference"),
    ("entry without cases", _mutate_entry(0, cases=()), "composition[gdn.core].cases", "at least one case"),
    (
        "entry unknown case",
        _mutate_entry(0, cases=("trainer_fwd", "decode")),
        "composition[gdn.core].cases",
        "unknown case 'decode'",
    ),
    (
        "entry case not covered",
        dict(cases=("trainer_fwd", "trainer_score", "engine_prefill"), composition=entries()[:2] + [entries()[2]]),
        "composition[gdn.core].cases",
        "'engine_decode' is not among the contract's cases",
    ),
    (
        "duplicate coverage",
        _mutate_entry(2, cases=("trainer_fwd", "engine_decode")),
        "composition",
        "(attn.core, engine_decode) is covered by 2 entries",
    ),
    (
        "non-scalar constant",
        _mutate_entry(0, constants={"tiles": [16, 16]}),
        "composition[gdn.core].constants.tiles",
        "int | bool | str | float | F32",
    ),
    ("empty constant name", _mutate_entry(0, constants={"": 1}), "composition[gdn.core].constants.", "non-empty"),
    (
        "negative tolerance",
        dict(claims=claims(tolerances={"logprob_abs_diff": -1e-9})),
        "claims.tolerances.logprob_abs_diff",
        ">= 0",
    ),
    (
        "inf tolerance",
        dict(claims=claims(tolerances={"logprob_abs_diff": math.inf})),
        "claims.tolerances.logprob_abs_diff",
        "finite",
    ),
    (
        "nan tolerance",
        dict(claims=claims(tolerances={"logprob_abs_diff": math.nan})),
        "claims.tolerances.logprob_abs_diff",
        "finite",
    ),
    (
        "string tolerance",
        dict(claims=claims(tolerances={"logprob_abs_diff": "0"})),
        "claims.tolerances.logprob_abs_diff",
        "float >= 0",
    ),
    (
        "empty domain",
        dict(claims=claims(topology={"tp": TopologyClaim()})),
        "claims.topology.tp.domain",
        "empty domain",
    ),
    (
        "non-positive degree",
        dict(claims=claims(topology={"tp": TopologyClaim(domain=(0, 1, 2))})),
        "claims.topology.tp.domain",
        "0 is not a positive",
    ),
    (
        "negative degree",
        dict(claims=claims(topology={"tp": TopologyClaim(domain=(-2, 1))})),
        "claims.topology.tp.domain",
        "-2 is not a positive",
    ),
    (
        "bool degree",
        dict(claims=claims(topology={"tp": TopologyClaim(domain=(True,))})),
        "claims.topology.tp.domain",
        "not a positive",
    ),
    (
        "duplicate degree",
        dict(claims=claims(topology={"tp": TopologyClaim(domain=(1, 2, 2))})),
        "claims.topology.tp.domain",
        "duplicate",
    ),
    (
        "pinned outside domain",
        dict(claims=claims(topology={"tp": TopologyClaim(domain=(1, 2), pinned=4)})),
        "claims.topology.tp.pinned",
        "outside the domain [1, 2]",
    ),
    (
        "pinned non-positive",
        dict(claims=claims(topology={"tp": TopologyClaim(pinned=0)})),
        "claims.topology.tp.pinned",
        "not a positive",
    ),
    (
        "unknown dim",
        dict(claims=claims(topology={"vpp": TopologyClaim(pinned=1)})),
        "claims.topology.vpp",
        "unknown parallel dimension 'vpp'",
    ),
    (
        "unknown state",
        dict(claims=claims(state={"weight_sync": ("prefix_cache", "lora_state")})),
        "claims.state.weight_sync",
        "unknown state 'lora_state'",
    ),
    ("no state", dict(claims=claims(state={"weight_sync": ()})), "claims.state.weight_sync", "at least one state"),
    (
        "bad event name",
        dict(claims=claims(state={"Weight Sync": ("kv_cache",)})),
        "claims.state.Weight Sync",
        "event name",
    ),
    ("nan engine setting", dict(claims=claims(engine={"x": math.nan})), "claims.engine.x", "finite"),
    ("nan constant", _mutate_entry(0, constants={"eps": math.nan}), "composition[gdn.core].constants.eps", "finite"),
    ("inf constant", _mutate_entry(0, constants={"eps": -math.inf}), "composition[gdn.core].constants.eps", "finite"),
    (
        "f32 inf constant",
        _mutate_entry(0, constants={"eps": F32(math.inf)}),
        "composition[gdn.core].constants.eps",
        "finite",
    ),
    ("nan in model", dict(model={**MODEL, "eps": math.nan}), "model.eps", "finite"),
    ("inf in deployment", dict(deployment={"mem": math.inf}), "deployment.mem", "finite"),
]


@pytest.mark.parametrize("name,over,path,msg", RULES, ids=[r[0] for r in RULES])
def test_each_validation_rule_refuses_its_violation(name, over, path, msg):
    with pytest.raises(ContractValidationError) as ei:
        make(**over)
    hits = [v for v in ei.value.violations if v.path == path and msg in v.message]
    assert hits, f"expected {path}: ...{msg}... in\n{ei.value}"


def test_validation_reports_every_violation_at_once():
    over = _mutate_entry(0, region="gdn.magic", impl="", proof="")
    over["cases"] = ALL + ("bogus",)
    over["claims"] = claims(
        tolerances={"logprob_abs_diff": -1.0}, topology={"tp": TopologyClaim(domain=(1, 2), pinned=8)}
    )
    with pytest.raises(ContractValidationError) as ei:
        make(**over)
    paths = {v.path for v in ei.value.violations}
    assert {
        "cases",
        "composition[gdn.magic].region",
        "composition[gdn.magic].impl",
        "composition[gdn.magic].proof",
        "claims.tolerances.logprob_abs_diff",
        "claims.topology.tp.pinned",
    } <= paths
    text = str(ei.value)
    assert f"{len(ei.value.violations)} contract violation(s)" in text
    assert "allowed: [" in text  # allowed values are named


def test_unknown_region_message_lists_allowed_regions():
    with pytest.raises(ContractValidationError) as ei:
        make(**_mutate_entry(0, region="gdn.magic"))
    assert "'gdn.core'" in str(ei.value) and "'lm_head'" in str(ei.value)


def test_region_list_extension_is_explicit():
    over = _mutate_entry(0, region="mtp.head")
    with pytest.raises(ContractValidationError, match="unknown region 'mtp.head'"):
        make(**over)
    c = make(**over, regions=REGIONS + ("mtp.head",))
    assert any(e.region == "mtp.head" for e in c.composition)


def test_validate_detects_stale_identities():
    a, b = make(), with_constant("gdn.core", "chunk_size", 32)
    validate(a)
    with pytest.raises(ContractValidationError, match="identities.numerical_policy: stored"):
        validate(b.with_identities(a.identities))


def test_contract_equality_is_canonical_and_hashable():
    assert make() == make() and hash(make()) == hash(make())
    assert len({make(), make()}) == 1
    assert with_constant("gdn.core", "v", -0.0) != with_constant("gdn.core", "v", 0.0)  # 0.0 == -0.0 in Python


def test_data_types_are_frozen():
    c = make()
    with pytest.raises(AttributeError):
        c.cases = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        c.composition[0].constants["chunk_size"] = 1  # type: ignore[index]


# ----------------------------------------------------------------------------- diff and handshake


def test_diff_names_every_differing_entry():
    a = make()
    b = with_constant("gdn.core", "chunk_size", 32, with_constant("logprob", "vocab_block", 512))
    d = diff(a, b)
    assert "composition[gdn.core].constants.chunk_size: 64 != 32" in d
    assert "composition[logprob].constants.vocab_block: 256 != 512" in d
    assert len(d) == 2


def test_diff_of_equal_contracts_is_empty():  # negative control
    assert diff(make(), make()) == []


def test_diff_names_split_region_entries_claims_and_absent_fields():
    a = make()
    b = make(
        claims=claims(
            topology={"tp": TopologyClaim(domain=(1, 2))}, engine={"enable_prefix_caching": True, "block_size": 16}
        )
    )
    b = with_constant("attn.core", "split_kv", 2, b)  # both attn.core entries get split_kv
    d = diff(a, b)
    assert "claims.topology.tp.domain: [1, 2, 4, 8] != [1, 2]" in d
    assert "claims.topology.ep.domain: [] != (absent)" in d
    assert "claims.engine.enable_prefix_caching: false != true" in d
    assert "composition[attn.core@engine_decode+engine_prefill].constants.split_kv: 1 != 2" in d
    assert "composition[attn.core@trainer_fwd+trainer_score].constants.split_kv: (absent) != 2" in d


def test_handshake_accepts_equal_contracts():  # positive control
    assert check_handshake(make(), make()) == []


def test_handshake_refuses_different_numerical_policy_naming_digests_and_entries():
    a, b = make(), with_constant("gdn.core", "chunk_size", 32)
    with pytest.raises(ContractMismatch) as ei:
        check_handshake(a, b)
    e = ei.value
    assert e.local == a.identities.numerical_policy and e.remote == b.identities.numerical_policy
    msg = str(e)
    assert a.identities.numerical_policy in msg and b.identities.numerical_policy in msg
    assert "composition[gdn.core].constants.chunk_size: 64 != 32" in msg
    assert isinstance(e, ContractError) and isinstance(e, Exception)


def test_handshake_allows_deployment_only_difference_and_logs_it(caplog):
    a = make()
    b = make(deployment={**DEPLOY, "gpu_memory_utilization": 0.5})
    with caplog.at_level(logging.INFO, logger="isoexec.contract"):
        dep = check_handshake(a, b)
    assert dep == ["deployment.gpu_memory_utilization: 0.9 != 0.5"]
    assert "deployment.gpu_memory_utilization" in caplog.text


def test_handshake_refuses_forged_identities():
    a, b = make(), with_constant("gdn.core", "chunk_size", 32)
    forged = b.with_identities(a.identities)  # claims a's digests with b's content
    with pytest.raises(ContractError, match="remote contract's stored identities do not match"):
        check_handshake(a, forged)


# ----------------------------------------------------------------------------- runtime claims


def test_topology_inside_claims_passes():  # positive control
    c = make()
    for tp in (1, 2, 4, 8):
        check_topology(c, tp=tp, ep=1)


@pytest.mark.parametrize(
    "degrees,path,msg",
    [
        (dict(tp=3), "claims.topology.tp", "tp=3 is outside the claimed domain [1, 2, 4, 8]"),
        (dict(tp=16), "claims.topology.tp", "outside the claimed domain"),
        (dict(ep=2), "claims.topology.ep", "ep=2 is not the pinned degree 1"),
        (dict(sp=2), "claims.topology.sp", "does not claim sp; only sp=1"),
    ],
)
def test_topology_outside_claims_is_refused(degrees, path, msg):
    with pytest.raises(ClaimViolation) as ei:
        check_topology(make(), **degrees)
    assert any(v.path == path and msg in v.message for v in ei.value.violations), str(ei.value)


def test_topology_refusal_lists_every_bad_dimension():
    with pytest.raises(ClaimViolation) as ei:
        check_topology(make(), tp=3, ep=2, dp=2)
    assert [v.path for v in ei.value.violations] == ["claims.topology.tp", "claims.topology.ep", "claims.topology.dp"]


def test_engine_settings_matching_claims_pass():  # positive control
    check_engine_settings(make(), {"enable_prefix_caching": False, "block_size": 16, "max_num_seqs": 3})


def test_engine_setting_contradicting_claims_is_refused_naming_it():
    with pytest.raises(ClaimViolation) as ei:
        check_engine_settings(make(), {"enable_prefix_caching": True, "block_size": 16})
    assert "enable_prefix_caching=true contradicts the claims, which require enable_prefix_caching=false" in str(
        ei.value
    )
    assert [v.path for v in ei.value.violations] == ["claims.engine.enable_prefix_caching"]


def test_engine_settings_are_type_strict_and_missing_ones_refused():
    with pytest.raises(ClaimViolation, match="block_size=16.0 contradicts"):
        check_engine_settings(make(), {"enable_prefix_caching": False, "block_size": 16.0})
    with pytest.raises(ClaimViolation, match="do not set block_size"):
        check_engine_settings(make(), {"enable_prefix_caching": False})
    check_engine_settings(make(), {"enable_prefix_caching": False}, require_all=False)
