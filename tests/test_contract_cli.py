"""Tests of ``isoexec contract show|diff|verify`` through the top-level CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from isoexec.cli import app
from isoexec.contract import save
from test_contract import DEPLOY, make, with_constant

runner = CliRunner()


@pytest.fixture
def saved(tmp_path):
    return save(make(), tmp_path / "contract.json")


def run(*args):
    return runner.invoke(app, ["contract", *map(str, args)])


def test_verify_ok_prints_digests(saved):
    r = run("verify", saved)
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"OK {saved}")
    assert make().identities.numerical_policy in r.output


def test_verify_hand_edited_file_fails_naming_the_field(saved):
    text = saved.read_text()
    saved.write_text(text.replace('"chunk_size":64', '"chunk_size":32'))
    r = run("verify", saved)
    assert r.exit_code == 2
    assert "composition[gdn.core].constants.chunk_size" in r.output
    assert "numerical_policy" in r.output
    assert "OK" not in r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1


def test_every_command_refuses_a_hand_edited_file_alike(saved, tmp_path):
    """verify, diff and show on the same edited file: the same one line and exit status 2."""
    good = save(make(), tmp_path / "good.json")
    saved.write_text(saved.read_text().replace('"chunk_size":64', '"chunk_size":32'))
    results = [run("verify", saved), run("diff", good, saved), run("show", saved)]
    assert {r.exit_code for r in results} == {2}
    assert len({r.output for r in results}) == 1, [r.output for r in results]


def test_verify_malformed_file_fails_with_position(saved):
    saved.write_text('{\n  "cases": [\n')
    r = run("verify", saved)
    assert r.exit_code == 2  # unreadable input, as an edited one
    assert str(saved) in r.output and "malformed JSON" in r.output and "line 3" in r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1


def test_verify_of_another_json_document_says_it_is_not_a_contract_in_one_line(saved, tmp_path):
    """Any JSON that has none of a contract's fields gets one decode error naming what it has, not a
    missing-field error per contract field; a contract missing some fields still lists each (the control)."""
    for text, has in (('{"a": 1, "b": 2}', "it has a, b"), ("[1, 2]", "it is a list"), ("{}", "it has no field")):
        other = tmp_path / "other.json"
        other.write_text(text)
        r = run("verify", other)
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert "1 decode error(s): <json>: not an execution contract" in r.output and has in r.output
    obj = json.loads(saved.read_text())
    del obj["cases"], obj["claims"]
    saved.write_text(json.dumps(obj))
    r = run("verify", saved)
    assert r.exit_code == 2 and "cases: missing field" in r.output and "claims: missing field" in r.output


def test_verify_missing_file_fails(tmp_path):
    r = run("verify", tmp_path / "none.json")
    assert r.exit_code == 2 and r.output == f"error: {tmp_path / 'none.json'}: No such file or directory\n"


def test_diff_identical_exits_zero(saved, tmp_path):
    other = save(make(), tmp_path / "b.json")
    r = run("diff", saved, other)
    assert r.exit_code == 0, r.output
    assert "identical" in r.output


def test_diff_policy_difference_exits_one_naming_entry(saved, tmp_path):
    other = save(with_constant("gdn.core", "chunk_size", 32), tmp_path / "b.json")
    r = run("diff", saved, other)
    assert r.exit_code == 1
    assert "composition[gdn.core].constants.chunk_size: 64 != 32" in r.output
    assert "numerical_policy differs" in r.output


def test_diff_deployment_only_exits_zero_but_prints_it(saved, tmp_path):
    other = save(make(deployment={**DEPLOY, "max_num_seqs": 8}), tmp_path / "b.json")
    r = run("diff", saved, other)
    assert r.exit_code == 0, r.output
    assert "deployment.max_num_seqs: 256 != 8" in r.output
    assert "only deployment differs" in r.output


def test_diff_tampered_file_exits_two(saved, tmp_path):
    other = save(make(), tmp_path / "b.json")
    other.write_text(other.read_text().replace('"chunk_size":64', '"chunk_size":32'))
    r = run("diff", saved, other)
    assert r.exit_code == 2
    assert "composition[gdn.core].constants.chunk_size" in r.output


def test_show_prints_identities_composition_and_claims(saved):
    r = run("show", saved)
    assert r.exit_code == 0, r.output
    c = make()
    for s in (
        c.identities.semantic,
        c.identities.numerical_policy,
        c.identities.deployment,
        "gdn.core",
        "isoexec.cpr_gdn.reference",
        "chunk_size=64",
        "eps=1e-06",
        "temperature=f32(1.0)",
        "tp: in {1, 2, 4, 8}",
        "ep: pinned 1",
        "weight_sync invalidates: gdn_state, prefix_cache",
        "logprob_abs_diff <= 0.0",
        "enable_prefix_caching = false",
    ):
        assert s in r.output, s


@pytest.mark.parametrize("columns", ["80", "200"])
def test_show_keeps_every_field_at_any_width(saved, columns):
    r = runner.invoke(app, ["contract", "show", str(saved)], env={"COLUMNS": columns})
    assert r.exit_code == 0, r.output
    c = make()
    for e in c.composition:
        assert f"{e.impl} version {e.version} arch {e.arch}" in r.output
        for k in e.constants:
            assert f"{k}=" in r.output, k
    too_wide = [ln for ln in r.output.splitlines() if len(ln) > int(columns) and len(ln.split()) > 2]
    assert not too_wide  # only a single unbreakable word (a long proof path) may run past the width
