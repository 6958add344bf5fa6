"""Tests of contract files (atomic save, verifying load), the shared atomic writers and provenance."""

from __future__ import annotations

import json
import os

import pytest

from isoexec.contract import (
    ContractDecodeError,
    ContractTampered,
    ContractValidationError,
    CompositionEntry,
    ExecutionContract,
    load,
    save,
    to_file_bytes,
)
from isoexec.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from isoexec.provenance import provenance
from test_contract import make, with_constant


def test_save_load_round_trip_is_byte_stable(tmp_path):
    c = make()
    p = save(c, tmp_path / "sub" / "contract.json")
    data = p.read_bytes()
    back = load(p)
    assert back.identities == c.identities
    assert to_file_bytes(back) == data
    save(back, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == data


def test_load_accepts_reformatted_but_unchanged_file(tmp_path):  # identities follow content, not bytes
    p = save(make(), tmp_path / "c.json")
    p.write_text(json.dumps(json.loads(p.read_text()), indent=2))
    assert load(p).identities == make().identities


def test_hand_edited_constant_is_detected_naming_identity_and_field(tmp_path):
    p = save(make(), tmp_path / "c.json")
    text = p.read_text()
    assert text.count('"chunk_size":64') == 1
    p.write_text(text.replace('"chunk_size":64', '"chunk_size":32'))
    with pytest.raises(ContractTampered) as ei:
        load(p)
    e = ei.value
    assert e.identities == ["numerical_policy"]
    assert e.fields == ["composition[gdn.core].constants.chunk_size"]
    assert str(p) in str(e) and "identity numerical_policy: stored" in str(e)


def test_hand_edited_model_names_semantic_and_deployment_names_deployment(tmp_path):
    p = save(make(), tmp_path / "c.json")
    text = p.read_text()
    p.write_text(text.replace('"architecture":"Qwen3NextForCausalLM"', '"architecture":"Qwen3MoeForCausalLM"'))
    with pytest.raises(ContractTampered) as ei:
        load(p)
    assert ei.value.identities == ["semantic", "numerical_policy"]
    assert ei.value.fields == ["model.architecture"]
    p.write_text(text.replace('"max_num_seqs":256', '"max_num_seqs":128'))
    with pytest.raises(ContractTampered) as ei:
        load(p)
    assert ei.value.identities == ["deployment"] and ei.value.fields == ["deployment.max_num_seqs"]


def test_edited_stored_identity_is_reported_as_such(tmp_path):
    c = make()
    p = save(c, tmp_path / "c.json")
    p.write_text(p.read_text().replace(c.identities.numerical_policy, "0" * 64))
    with pytest.raises(ContractTampered, match="stored identity numerical_policy itself was edited"):
        load(p)


def test_added_field_is_reported(tmp_path):
    p = save(make(), tmp_path / "c.json")
    p.write_text(p.read_text().replace('"chunk_size":64', '"chunk_size":64,"split_k":2'))
    with pytest.raises(ContractTampered, match=r"composition\[gdn.core\].constants.split_k \(added\)"):
        load(p)


def test_untampered_file_loads(tmp_path):  # negative control for the tamper tests
    assert load(save(make(), tmp_path / "c.json")).identities == make().identities


def test_missing_field_digests_is_a_decode_error(tmp_path):
    p = save(make(), tmp_path / "c.json")
    obj = json.loads(p.read_text())
    del obj["field_digests"]
    p.write_text(json.dumps(obj))
    with pytest.raises(ContractDecodeError, match="field_digests: missing field"):
        load(p)


def test_malformed_file_names_file_and_position(tmp_path):
    p = save(make(), tmp_path / "c.json")
    p.write_text(p.read_text()[:-10])
    with pytest.raises(ContractDecodeError) as ei:
        load(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: ") and "malformed JSON" in msg and "line 1 column" in msg


def test_save_refuses_stale_identities(tmp_path):
    a, b = make(), with_constant("gdn.core", "chunk_size", 32)
    with pytest.raises(ContractValidationError):
        save(b.with_identities(a.identities), tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()


def test_atomic_save_leaves_old_file_intact_when_serialization_fails(tmp_path):
    p = save(make(), tmp_path / "c.json")
    old = p.read_bytes()
    good = make()
    bad = ExecutionContract(
        good.model,
        good.cases,
        good.composition[:-1]
        + (CompositionEntry("logprob", ("trainer_fwd",), "x", "1", "cpu", {"obj": object()}, "t"),),
        good.claims,
        good.deployment,
        good.identities,
    )
    with pytest.raises((TypeError, ContractValidationError)):
        save(bad, p)
    with pytest.raises(TypeError):
        to_file_bytes(bad)  # the encoder itself refuses, so nothing reaches the file
    assert p.read_bytes() == old
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.json"]


def test_atomic_save_leaves_old_file_intact_when_write_fails(tmp_path, monkeypatch):
    p = save(make(), tmp_path / "c.json")
    old = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save(with_constant("gdn.core", "chunk_size", 32), p)
    assert p.read_bytes() == old
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.json"]  # temp file removed


def test_atomic_writers_create_parents_and_replace(tmp_path):
    p = tmp_path / "a" / "b" / "x.json"
    atomic_write_json(p, {"b": 1, "a": [1, 2]})
    assert p.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    atomic_write_text(p, "hello")
    assert p.read_text() == "hello"
    atomic_write_bytes(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    with pytest.raises(TypeError):
        atomic_write_text(p, b"bytes")  # type: ignore[arg-type]


def test_atomic_write_json_keeps_old_file_when_object_is_not_serializable(tmp_path):
    p = tmp_path / "x.json"
    atomic_write_json(p, {"ok": True})
    with pytest.raises(TypeError):
        atomic_write_json(p, {"bad": object()})
    assert json.loads(p.read_text()) == {"ok": True}
    assert [x.name for x in tmp_path.iterdir()] == ["x.json"]


def test_atomic_write_keeps_file_mode(tmp_path):
    p = tmp_path / "x.txt"
    atomic_write_text(p, "a")
    assert p.stat().st_mode & 0o777 == 0o644
    os.chmod(p, 0o600)
    atomic_write_text(p, "b")
    assert p.stat().st_mode & 0o777 == 0o600


def test_provenance_has_every_field():
    prov = provenance("isoexec gates")
    assert prov["command"] == "isoexec gates"
    for k in ("git", "hostname", "machine", "platform", "cpu", "cpu_isa", "device", "python", "packages", "date_utc"):
        assert k in prov, k
    assert set(prov["git"]) == {"commit", "dirty"}
    assert prov["packages"]["torch"]  # installed in the venv
    for name in ("transformers", "vllm", "triton", "fla-core", "megatron-core", "snakemake"):
        assert name in prov["packages"]
    assert prov["date_utc"].endswith("+00:00")
    json.dumps(prov)


def test_cpu_isa_and_model_read_the_first_processor_of_cpuinfo(tmp_path):
    from isoexec.provenance import cpu_isa, cpu_model

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9R14\n"
                    "flags\t\t: fpu avx2 fma avx512f avx512_bf16 sse4_2\n\nprocessor\t: 1\ncpu family\t: 6\n"
                    "model name\t: other\nflags\t\t: avx2 amx_tile\n")
    assert cpu_isa(info) == {"family": 25, "model": 17, "flags": ["avx2", "avx512_bf16", "avx512f", "fma"]}
    assert cpu_model(info) == "AMD EPYC 9R14"
    assert cpu_isa(tmp_path / "missing") is None


def test_provenance_does_not_fail_without_git(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    prov = provenance()
    assert prov["git"] == {"commit": None, "dirty": None}
    assert isinstance(prov["command"], str)
